"""The native runtime against Hugging Face transformers' forward on the same weights."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.tiny import native_from_hf, tiny_hf
from verispec.models import UnsupportedModelError
from verispec.models.cache import RowPool
from verispec.models.config import ModelConfig


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-tied"])
def pair(request):
    arch = request.param.split("-")[0]
    hf = tiny_hf(arch, tie=request.param.endswith("tied"))
    return hf, native_from_hf(hf)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_prefill_matches_hf(pair):
    hf, nat = pair
    ids = torch.randint(0, 97, (23,)).tolist()
    cache = nat.new_cache(2, 64)
    row = cache.alloc()
    out = nat.forward(torch.tensor([ids]), cache, row)[0]
    assert (out - hf_logits(hf, ids)).abs().max() <= 1e-3
    assert int(cache.lengths[row[0]]) == 23


def test_ragged_batch_matches_hf(pair):
    """Rows of different lengths in one pass, then incremental decoding, non-contiguous rows."""
    hf, nat = pair
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 17, 1, 30)]
    cache = nat.new_cache(6, 64)
    cache.alloc(2)  # occupy rows 0-1 so the batch uses rows 2..5
    rows = [5, 2, 4, 3]
    for r in rows:
        cache.in_use[r] = True
    T = max(map(len, prompts))
    toks = torch.zeros(4, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        toks[b, :len(p)] = torch.tensor(p)
    last = nat.forward(toks, cache, rows, [len(p) for p in prompts], last_only=True)
    for b, p in enumerate(prompts):
        assert (last[b] - hf_logits(hf, p)[-1]).abs().max() <= 1e-3
    # two more decode steps of 1 and 3 tokens per row
    for T2 in (1, 3):
        new = torch.randint(0, 97, (4, T2), generator=g)
        out = nat.forward(new, cache, rows)
        for b in range(4):
            prompts[b] = prompts[b] + new[b].tolist()
            assert (out[b] - hf_logits(hf, prompts[b])[-T2:]).abs().max() <= 1e-3


def test_layer_skip_prefix():
    """num_layers=N equals a model truncated to its first N layers."""
    hf = tiny_hf("qwen2")
    nat = native_from_hf(hf)
    ids = torch.randint(0, 97, (1, 9))
    cache = nat.new_cache(1, 32)
    row = cache.alloc()
    part = nat.forward(ids, cache, row, num_layers=1)
    hf.model.layers = hf.model.layers[:1]
    hf.config.num_hidden_layers = 1
    with torch.no_grad():
        ref = hf(ids).logits
    assert (part - ref).abs().max() <= 1e-3


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 96), min_size=2, max_size=20), st.data())
def test_rollback_equals_fresh(prefix, data):
    """Write k tokens, roll back to any length, write others: logits equal a fresh run."""
    nat = _shared_tiny()
    cache = nat.new_cache(2, 64)
    row = cache.alloc()
    nat.forward(torch.tensor([prefix]), cache, row)
    junk = data.draw(st.lists(st.integers(0, 96), min_size=1, max_size=8))
    nat.forward(torch.tensor([junk]), cache, row)
    keep = data.draw(st.integers(1, len(prefix)))
    cache.truncate(row, [keep])
    new = data.draw(st.lists(st.integers(0, 96), min_size=1, max_size=6))
    got = nat.forward(torch.tensor([new]), cache, row)
    fresh_cache = nat.new_cache(1, 64)
    r2 = fresh_cache.alloc()
    ref = nat.forward(torch.tensor([prefix[:keep] + new]), fresh_cache, r2)[:, -len(new):]
    assert (got - ref).abs().max() <= 1e-4
    assert int(cache.lengths[row[0]]) == keep + len(new)


_TINY = {}


def _shared_tiny():
    if "m" not in _TINY:
        _TINY["m"] = native_from_hf(tiny_hf("llama", seed=3))
    return _TINY["m"]


def test_unsupported_architecture_is_clear():
    with pytest.raises(UnsupportedModelError, match="not supported"):
        ModelConfig.from_hf_dict({"model_type": "gpt2"})


def test_cache_overflow_is_clear():
    nat = _shared_tiny()
    cache = nat.new_cache(1, 8)
    row = cache.alloc()
    with pytest.raises(Exception, match="exceeds cache length"):
        nat.forward(torch.zeros(1, 9, dtype=torch.long), cache, row)


def test_row_pool_truncate_takes_ints_lists_tensors_and_refuses_growth():
    pool = RowPool(3, 10)
    rows = pool.alloc(2)
    pool.lengths[rows] = torch.tensor([5, 7])
    pool.truncate(rows, 6 - 1)  # one length for every row (row 0 keeps its 5)
    assert pool.lengths[rows].tolist() == [5, 5]
    pool.truncate(torch.tensor([rows[1]]), torch.tensor([2]))
    pool.truncate(rows[0], [3])
    assert pool.lengths[rows].tolist() == [3, 2]
    for bad, match in (([4, 1], "only shorten"), ([-1, 0], "only shorten"), ([1, 1, 1], "one length per row")):
        with pytest.raises(ValueError, match=match):
            pool.truncate(rows, bad)
    assert pool.lengths[rows].tolist() == [3, 2]  # a refused truncate changes nothing
