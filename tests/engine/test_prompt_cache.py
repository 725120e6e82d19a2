"""The exact-prompt KV cache: a restored row decodes exactly as a prefilled one."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.test_engine_tiny import V, _prompts
from tests.tiny import native_from_hf, tiny_hf
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import Engine, EngineConfig, GenerationParams, PromptCache, Request
from verispec.models.prefill import length_groups, prefill
from verispec.policy import FixedK


@pytest.fixture(scope="module")
def models():
    hf = tiny_hf("qwen2", seed=0, vocab=V, embed_scale=20.0)
    noisy = tiny_hf("qwen2", seed=0, vocab=V, embed_scale=20.0)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.03)
    return native_from_hf(hf), native_from_hf(noisy)


def _run(target, drafter, k, prompts, cache=None, batch=4):
    eng = Engine(target, drafter, FixedK(k), EngineConfig(max_batch=batch, max_len=96), prompt_cache=cache)
    reqs = [Request(p, GenerationParams(max_new_tokens=12, ignore_eos=True)) for p in prompts]
    eng.run(reqs)
    return [r.output_ids for r in reqs], eng


def test_restored_prompts_decode_as_prefilled_ones(models):
    target, draft = models
    prompts = _prompts(10, seed=3)
    ref, _ = _run(target, None, 0, prompts)
    pc, dpc = PromptCache(), PromptCache()
    for attempt in range(2):  # the first run fills the caches, the second only restores
        drafter = DraftModelDrafter(draft, V, max_rows=4, max_len=120)
        drafter.prompt_cache = dpc
        out, eng = _run(target, drafter, 3, prompts, cache=pc)
        assert out == ref, attempt
    distinct = len({tuple(p[:-1]) for p in prompts if len(p) > 1})
    assert pc.hits == distinct and dpc.hits == distinct
    assert len(pc) == distinct
    # a plain engine reuses the same snapshots
    out, _ = _run(target, None, 0, prompts, cache=pc)
    assert out == ref and pc.hits == 2 * distinct


def test_budget_evicts_least_recently_used(models):
    target, _ = models
    cache = target.new_cache(2, 64)
    rows = cache.alloc(1)
    pc = PromptCache(max_tokens=10)
    for ids in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]):
        cache.truncate(rows, [0])
        target.forward(torch.tensor([ids]), cache, rows, last_only=True)
        pc.save(cache, rows[0], ids)
    assert len(pc) == 2  # 4 + 4 + 3 > 10: the oldest went
    assert not pc.restore(cache, rows[0], [1, 2, 3, 4])
    assert pc.restore(cache, rows[0], [9, 10, 11]) and int(cache.lengths[rows[0]]) == 3
    with pytest.raises(ValueError, match="holds 3 tokens"):
        pc.save(cache, rows[0], [1, 2])
    with pytest.raises(ValueError):
        PromptCache(max_tokens=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 400), max_size=40), st.floats(1.0, 3.0))
def test_length_groups_cover_every_row_once_within_the_slack(lens, slack):
    groups = length_groups(lens, slack)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        real = sum(lens[i] for i in g)
        assert len(g) == 1 or len(g) * max(lens[i] for i in g) <= slack * real + 1e-9
    flat = [lens[i] for g in groups for i in g]
    assert flat == sorted(flat)  # shortest first: a group never straddles another


def test_length_groups_keep_similar_lengths_in_one_pass():
    # the quick audit's 16 chat prompts: one padded pass would compute 3.3x their tokens
    lens = [37, 39, 55, 56, 88, 54, 275, 252, 47, 75, 67, 68, 62, 65, 50, 47]
    groups = length_groups(lens)
    padded = sum(len(g) * max(lens[i] for i in g) for g in groups)
    assert padded <= 1.25 * sum(lens) and len(groups) < len(lens) / 2
    assert length_groups([10] * 8) == [list(range(8))]
    with pytest.raises(ValueError):
        length_groups([1, 2], 0.5)


def test_ragged_prefill_in_length_groups_equals_one_row_at_a_time(models):
    target, _ = models
    seqs = [list(range(3, 3 + n)) for n in (5, 40, 6, 38, 7, 90)]  # three groups
    assert len(length_groups([len(s) for s in seqs])) >= 2
    batched = target.new_cache(len(seqs), 100)
    rows = batched.alloc(len(seqs))
    prefill(target, batched, rows, seqs)
    nxt = torch.tensor([[1]] * len(seqs))
    got = target.forward(nxt, batched, rows, last_only=True)
    for b, s in enumerate(seqs):
        one = target.new_cache(1, 100)
        r = one.alloc(1)
        prefill(target, one, r, [s])
        want = target.forward(torch.tensor([[1]]), one, r, last_only=True)
        torch.testing.assert_close(got[b], want[0], rtol=1e-4, atol=1e-4)
