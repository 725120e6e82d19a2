"""The ggml backend (llama.cpp on a GGUF file as shipped) on SmolLM2-135M's Q4_1 file.

Skips, saying why, without llama-cpp-python (`pip install 'verispec[gguf]'` or
`bash scripts/install.sh --gguf`) or without the SmolLM2 preset's package. Loading the
file takes well under a second; every test here decodes a few dozen tokens.
"""

from __future__ import annotations

import pytest
import torch

from verispec.models.ggml import available

pytestmark = pytest.mark.skipif(
    not available(), reason="llama-cpp-python not installed: pip install 'verispec[gguf]' "
                            "or bash scripts/install.sh --gguf")

PRESET = "smollm2-135m"


@pytest.fixture(scope="module")
def smol():
    from verispec.models import load_model
    from verispec.models.presets import PresetNotInstalledError
    try:
        return load_model(PRESET, backend="ggml", progress=False)
    except PresetNotInstalledError as e:
        pytest.skip(f"SmolLM2 preset not installed: {e}")


@pytest.fixture(scope="module")
def noise(smol):
    from verispec.models.noise import batching_noise
    n = batching_noise(smol.model)
    print(f"\nggml SmolLM2 Q4_1 batching noise (pass widths, KV cell order): logits {n['logit']:.3g}, "
          f"top-2 gap {n['margin']:.3g}")
    return n


def test_files_are_the_gguf_as_shipped(smol):
    from verispec.models.presets import PRESETS
    assert smol.model.runtime == "ggml" and smol.model.partial_layers is False
    assert smol.files.sha256 == PRESETS[PRESET].sha256
    assert smol.files.files == {PRESETS[PRESET].gguf_name: PRESETS[PRESET].sha256}
    assert str(smol.files.path).endswith(".gguf")
    assert smol.model.fingerprint() == f"ggml:{PRESETS[PRESET].sha256}"
    assert smol.model.config.vocab_size == 49152 and smol.model.config.num_layers == 30


def test_ragged_batch_after_rollbacks_equals_fresh_single_row(smol, noise):
    """Rows at different lengths, prefilled together, given rejected drafts of different
    lengths twice, rolled back (seq_rm) and fed the rest ragged: every row's logits equal a
    fresh single-row decode of its tokens within the backend's measured noise (on this file:
    bitwise)."""
    from verispec.models.noise import rollback_difference
    diffs = [rollback_difference(smol.model, seed=s) for s in (0, 1)]
    print(f"ggml SmolLM2 Q4_1: ragged-after-rollback vs fresh {max(diffs):.3g} (noise {noise['logit']:.3g})")
    assert max(diffs) <= noise["logit"] + 1e-5, (diffs, noise)


def test_padding_positions_are_zeros(smol):
    m = smol.model
    cache = m.new_cache(3, 16)
    rows = cache.alloc(3)
    out = m.forward(torch.tensor([[1, 2, 3], [4, 5, 0], [0, 0, 0]]), cache, rows, [3, 2, 0])  # [B,T,V]
    assert bool((out[1, 2] == 0).all()) and bool((out[2] == 0).all()) and bool((out[0] != 0).any())
    assert cache.lengths[rows].tolist() == [3, 2, 0]
    last = m.forward(torch.tensor([[7, 8], [9, 0], [6, 0]]), cache, rows, [2, 1, 1], last_only=True)  # [B,V]
    assert last.shape == (3, m.config.vocab_size) and cache.lengths[rows].tolist() == [5, 3, 1]
    fresh = m.new_cache(1, 16)
    row = fresh.alloc()
    assert torch.equal(last[1], m.forward(torch.tensor([[4, 5, 9]]), fresh, row)[0, -1])  # its own last token


def test_rollback_is_truncate_and_a_length_written_directly_is_refused(smol):
    """Rollback is truncate (llama_memory_seq_rm of the row's tail): the next feed equals a
    fresh decode of the kept tokens. A length written directly, lowered or raised, is refused
    at the row's next forward and snapshot, never decoded at positions llama.cpp disagrees
    with; a feed that llama.cpp refuses leaves the row as it was."""
    m = smol.model
    V = m.config.vocab_size
    cache = m.new_cache(2, 32)
    row = cache.alloc()
    m.forward(torch.tensor([[1, 2, 3, 4]]), cache, row)
    cache.truncate(row, [2])
    assert cache.held[row].tolist() == [2]
    got = m.forward(torch.tensor([[5, 6]]), cache, row)[0]
    assert cache.lengths[row].tolist() == [4] and cache.held[row].tolist() == [4]
    fresh = m.new_cache(1, 32)
    ref = m.forward(torch.tensor([[1, 2, 5, 6]]), fresh, fresh.alloc())[0, 2:]
    assert torch.equal(got, ref)
    for wrong in (2, 6):
        cache.lengths[row] = wrong
        with pytest.raises(RuntimeError, match="outside truncate"):
            m.forward(torch.tensor([[7]]), cache, row)
        with pytest.raises(RuntimeError, match="outside truncate"):
            cache.snapshot(row[0])
        cache.lengths[row] = 4
    with pytest.raises(RuntimeError, match="llama_decode failed"):  # a token past the vocabulary
        m.forward(torch.tensor([[7, V + 5]]), cache, row)
    assert cache.lengths[row].tolist() == [4] and cache.held[row].tolist() == [4]
    got = m.forward(torch.tensor([[7, 8]]), cache, row)[0]
    fresh = m.new_cache(1, 32)
    ref = m.forward(torch.tensor([[1, 2, 5, 6, 7, 8]]), fresh, fresh.alloc())[0, 4:]
    assert torch.equal(got, ref) and cache.held[row].tolist() == [6]


def test_draft_model_rejections_on_ggml(smol, noise):
    """A draft model that disagrees with the target (the Qwen-pair case: drafts rejected,
    the draft cache rolled back every step) decodes without a failed request, and its
    greedy output is plain decoding's within the measured noise."""
    from verispec.drafters.draft_model import DraftModelDrafter
    m = smol.model
    prompts = _prompts(smol.tokenizer, 4)
    plain = [r.output_ids for r in _run(m, prompts, batch=1, max_new=12)]

    class Contrary:  # the same model, its argmax pushed to the second choice at every other position
        config, runtime = m.config, m.runtime

        def new_cache(self, rows, n):
            return m.new_cache(rows, n)

        def forward(self, tokens, cache, rows, num_new=None, **kw):
            out = m.forward(tokens, cache, rows, num_new, **kw)
            if int(cache.lengths[torch.as_tensor(rows).reshape(-1)[0]]) % 2:
                out = out.clone()
                top = out.argmax(-1, keepdim=True)
                out.scatter_(-1, top, out.min().item())
            return out

    dm = DraftModelDrafter(Contrary(), m.config.vocab_size, max_rows=4, max_len=max(map(len, prompts)) + 20)
    reqs = _run(m, prompts, dm, k=3, batch=4, max_new=12)
    assert all(r.finish_reason in ("stop", "length") for r in reqs), [r.error for r in reqs]
    drafted, accepted = sum(r.stats.drafted for r in reqs), sum(r.stats.accepted for r in reqs)
    assert drafted > 0 and accepted < 0.8 * drafted  # drafts were rejected: rollbacks happened
    assert_equivalent(m, prompts, plain, [r.output_ids for r in reqs], noise, 0.5)


def test_cache_interface_errors(smol):
    from verispec.models import CacheFullError
    m = smol.model
    cache = m.new_cache(2, 8)
    rows = cache.alloc(2)
    with pytest.raises(CacheFullError):
        cache.alloc()
    m.forward(torch.tensor([[1, 2, 3]]), cache, [rows[0]])
    with pytest.raises(ValueError, match="only shorten"):
        cache.truncate([rows[0]], [4])
    with pytest.raises(CacheFullError, match="exceeds cache length"):
        m.forward(torch.ones(1, 6, dtype=torch.long), cache, [rows[0]])
    cache.free(rows)
    assert cache.rows_in_use == 0 and cache.lengths.tolist() == [0, 0]


def test_layerskip_refused_naming_why(smol):
    from verispec.drafters import make_drafter
    from verispec.models.ggml import UnsupportedFeatureError
    with pytest.raises(UnsupportedFeatureError, match="ggml backend: layer-skip drafting needs"):
        make_drafter("layerskip:8", smol.model, smol.tokenizer, max_rows=1, max_len=8)
    cache = smol.model.new_cache(1, 8)
    with pytest.raises(UnsupportedFeatureError, match="layer-skip"):
        smol.model.forward(torch.tensor([[1]]), cache, cache.alloc(), num_layers=4)


@pytest.fixture(scope="module")
def smol_invariant(smol):
    from verispec.models import load_model
    return load_model(PRESET, backend="ggml", batch_invariant=True, progress=False)


def test_batch_invariant_mode_reports_itself(smol, smol_invariant):
    from verispec.audit.equivalence import TIE_MARGIN, tie_margin_for
    m = smol_invariant.model
    assert m.batch_invariant and not m.noisy_numerics and m.backend.endswith("/invariant")
    assert smol.model.noisy_numerics and not smol.model.batch_invariant
    assert m.fingerprint() == smol.model.fingerprint()  # the same weights
    assert tie_margin_for(m) == {"value": TIE_MARGIN, "source": "fixed (fp32 backend)"}


@pytest.mark.parametrize("threads", [1, 2])
def test_batch_invariant_rows_equal_a_fresh_decode_bitwise(smol_invariant, threads):
    """In batch-invariant mode every logit of a ragged batch after rollbacks, of one-token
    passes past 512 cells, of rows decoded beside rows that leave, and of a churn of rows
    starting, taking verify-like passes, rolling back and leaving, is bitwise a fresh
    single-row one-pass decode; at 2 threads too (where llama.cpp splits one-token
    attention across threads)."""
    from verispec.models.noise import batching_noise, churn_difference, rollback_difference
    m = smol_invariant.model
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert batching_noise(m, seeds=(0,)) == {"logit": 0.0, "margin": 0.0}
        assert rollback_difference(m, seed=threads) == 0.0
        assert churn_difference(m, steps=12, seed=threads) == 0.0
    finally:
        torch.set_num_threads(before)


def test_batch_invariant_cache_keeps_cells_ordered_and_compacts(smol_invariant):
    """The ordered cache frees a rolled-back tail at the top of its cells and hands one below
    the top to garbage; a compaction removes the garbage and keeps every row's logits."""
    m = smol_invariant.model
    V = m.config.vocab_size
    g = torch.Generator().manual_seed(5)
    cache = m.new_cache(2, 40)
    a, b = cache.alloc(2)
    m.forward(torch.randint(0, V, (2, 10), generator=g), cache, [a, b])  # cells: a 0-9, b 10-19
    assert cache._head == 20 and cache.live_cells == 20
    cache.truncate([b], [6])  # b's tail is the top: freed
    assert cache._head == 16 and cache._garbage == 0
    cache.truncate([a], [7])  # a's tail lies below b's cells: garbage
    assert cache._head == 16 and cache._garbage == 3 and cache.live_cells == 13
    nxt = torch.randint(0, V, (2, 3), generator=g)
    before = m.forward(nxt, cache, [a, b])
    cache.truncate([a, b], [7, 6])
    cache.compact()
    assert cache._garbage == 0 and cache._head == 13 and cache.compactions == 1
    assert cache.lengths[[a, b]].tolist() == [7, 6]
    assert torch.equal(m.forward(nxt, cache, [a, b]), before)


def test_batch_invariant_failed_feed_is_rolled_back(smol_invariant):
    """A feed of several passes that fails after some of them reached llama.cpp is rolled back
    by truncate's own path: with the layout known (a failure past the decode) the placed cells
    are freed and the head returns; with it unknown (llama.cpp refused a pass) the tail is
    removed and the next feed compacts. Either way the row then decodes as a fresh one."""
    m = smol_invariant.model
    V = m.config.vocab_size
    g = torch.Generator().manual_seed(7)
    prompt, more = torch.randint(0, V, (1, 10), generator=g), torch.randint(0, V, (1, 70), generator=g)
    cache = m.new_cache(2, 96)
    a, b = cache.alloc(2)
    m.forward(prompt, cache, [a])
    m.forward(prompt, cache, [b])
    head = cache._head

    class Stop(Exception):
        pass

    outputs, calls = cache._outputs, []

    def second_fails(n, width):  # the second of the feed's two passes (63 + 7 tokens) fails
        calls.append(n)
        if len(calls) == 2:
            raise Stop
        return outputs(n, width)

    cache._outputs = second_fails
    with pytest.raises(Stop):
        m.forward(more, cache, [b])
    del cache._outputs
    assert cache.lengths[[a, b]].tolist() == [10, 10] and cache.held[[a, b]].tolist() == [10, 10]
    assert cache._head == head and cache._garbage == 0 and not cache._dirty
    bad = more.clone()
    bad[0, -1] = V + 5  # llama.cpp refuses the second pass
    with pytest.raises(RuntimeError, match="llama_decode failed"):
        m.forward(bad, cache, [a])
    assert cache.lengths[[a, b]].tolist() == [10, 10] and cache._dirty
    got = m.forward(more[:, :5].repeat(2, 1), cache, [b, a])  # both rows, together
    fresh = m.new_cache(1, 96)
    ref = m.forward(torch.cat([prompt, more[:, :5]], 1), fresh, fresh.alloc())[0, 10:]
    assert cache.compactions == 1 and torch.equal(got[0], ref) and torch.equal(got[1], ref)


def _prompts(tok, n):
    from verispec.audit.context import encode
    from verispec.audit.suite import load_suite
    return [encode(tok, p.prompt, True) for p in load_suite("default")[:n]]


def _run(model, prompts, drafter=None, k=4, batch=4, max_new=16, prompt_cache=None):
    from verispec.engine import Engine, EngineConfig, GenerationParams, Request
    from verispec.policy import FixedK
    eng = Engine(model, drafter, FixedK(k if drafter is not None else 0),
                 EngineConfig(max_batch=batch, max_len=max(map(len, prompts)) + max_new + 2),
                 prompt_cache=prompt_cache)
    reqs = [Request(p, GenerationParams(max_new_tokens=max_new)) for p in prompts]
    eng.run(reqs)
    assert all(r.finish_reason in ("length", "stop") for r in reqs), [r.error for r in reqs]
    return reqs


def assert_equivalent(model, prompts, ref, got, noise, min_identical):
    """Greedy outputs equal, or diverging where the reference's top-2 margin lies inside the
    backend's measured noise of the top-2 gap; at least min_identical of them identical.
    -> number identical."""
    from verispec.audit.equivalence import compare, reference_logits_at
    same = 0
    for p, r, g in zip(prompts, ref, got):
        c = compare(p, r, g, lambda pr, rf, i: reference_logits_at(model, pr, rf, i), tie_margin=noise["margin"])
        assert c.verdict != "divergence", c
        same += c.exact
    assert same >= min_identical * len(prompts), (same, len(prompts))
    return same


def test_greedy_speculative_equals_plain_lookup_and_draft_model(smol, noise):
    """Prompt lookup at batch 1 and 4 and a draft model (a second llama.cpp context: the
    same file, so nearly every draft is accepted) at batch 4 emit plain decoding's tokens,
    but where a near-tie inside the backend's measured noise flips."""
    from verispec.drafters.draft_model import DraftModelDrafter
    from verispec.drafters.lookup import PromptLookupDrafter
    m = smol.model
    prompts = _prompts(smol.tokenizer, 4)
    plain = [r.output_ids for r in _run(m, prompts, batch=1, max_new=12)]
    assert len({t for o in plain for t in o}) > 10
    for batch in (1, 4):
        look = _run(m, prompts, PromptLookupDrafter(), k=4, batch=batch, max_new=12)
        assert sum(r.stats.drafted for r in look) > 0
        assert_equivalent(m, prompts, plain, [r.output_ids for r in look], noise, 0.5)
        if batch == 1:
            continue
        dm = DraftModelDrafter(m, m.config.vocab_size, max_rows=batch, max_len=max(map(len, prompts)) + 20)
        same = _run(m, prompts, dm, k=3, batch=batch, max_new=12)
        assert_equivalent(m, prompts, plain, [r.output_ids for r in same], noise, 0.5)
        assert sum(r.stats.drafted for r in same) > 0
        # the draft is the target itself: it agrees with every token the target verifies
        assert sum(r.stats.accepted for r in same) >= 0.9 * sum(r.stats.drafted for r in same)


def test_draft_trees_on_ggml_equal_plain(smol, noise):
    """Draft trees (each branch a sequence id of its own, a node in every branch below it)
    around plain decoding's continuation, wrong siblings before and after the right node, at
    batch 1, 4 and 8: greedy output is plain decoding's but where a near-tie inside the
    backend's measured noise flips, with paths taken off later siblings too."""
    from tests.engine.test_tree_verify import TreeOracle
    m = smol.model
    prompts = _prompts(smol.tokenizer, 8)
    plain = [r.output_ids for r in _run(m, prompts, batch=1, max_new=16)]
    ref = {tuple(p): o for p, o in zip(prompts, plain)}
    for batch in (1, 4, 8):
        d = TreeOracle(ref, rate=0.8, width=4, seed=batch)
        got = _run(m, prompts, d, k=6, batch=batch, max_new=16)
        assert d.trees > 10 and sum(r.stats.accepted for r in got) > 40
        assert_equivalent(m, prompts, plain, [r.output_ids for r in got], noise, 0.5)


def test_prompt_cache_snapshots_ggml_rows(smol):
    from verispec.engine import PromptCache
    m = smol.model
    prompts = _prompts(smol.tokenizer, 3)
    pc = PromptCache()
    first = [r.output_ids for r in _run(m, prompts, batch=2, prompt_cache=pc)]
    assert pc.misses == 3 and len(pc) == 3
    again = [r.output_ids for r in _run(m, prompts, batch=2, prompt_cache=pc)]
    assert pc.hits == 3 and again == first


def test_adaptive_policy_costs_measured_on_ggml(smol, tmp_path):
    """The cost model is timed on the backend in use, and keyed on it."""
    from verispec.drafters.lookup import PromptLookupDrafter
    from verispec.policy.costs import CostCache, cost_key, measure_costs
    d = PromptLookupDrafter()
    costs = measure_costs(smol.model, d, 2, 2, context=32, repeats=1)
    assert all(t > 0 for row in costs.target_s for t in row)
    key = cost_key(smol.model, d, 2, 2)
    assert key["backend"].startswith("ggml-cpu") and key["target"].startswith("ggml:")
    assert CostCache(tmp_path).entry(smol.model, d, 2, 2).path.parent == tmp_path


def test_generate_cli_on_ggml(smol, capsys):
    import json

    from verispec.cli import main
    from verispec.models.presets import PRESETS, locate_parts
    import os
    path = str(locate_parts(PRESETS[PRESET])[0])  # a .gguf path: ggml by default
    before = torch.get_num_threads()
    try:  # --threads auto (the default): 1 or all cores, timed on the loaded GGUF
        rc = main(["generate", "--model", path, "--prompt", "def fib(n):", "--max-new-tokens", "8",
                   "--draft", "lookup", "--json", "--batch-size", "1"])
        assert torch.get_num_threads() in {1, os.cpu_count() or 1}
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 8
    rc = main(["generate", "--model", PRESET, "--backend", "ggml", "--prompt", "hi", "--draft", "layerskip:4",
               "--max-new-tokens", "4"])
    assert rc == 2
    assert "layer-skip" in capsys.readouterr().err
