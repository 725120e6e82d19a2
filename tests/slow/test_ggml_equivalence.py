"""Greedy speculative decoding equals plain decoding on the ggml backend, at scale: 32 suite
prompts (4 per slice, chat template), 32 new tokens, plain decoding at batch 1 as the
reference, speculative at batch 1, 4 and 16. Every divergence must lie at a reference top-2
margin inside the backend's own batching noise, measured on the same file without any
rollback (models/noise.py); the share of identical outputs is printed (RESULTS.md).

    python -m pytest -q -s tests/slow/test_ggml_equivalence.py
"""

from __future__ import annotations

import pytest

from verispec.models.ggml import available

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not available(), reason="llama-cpp-python not installed: "
                                 "pip install 'verispec[gguf]' or bash scripts/install.sh --gguf")]

N_PROMPTS, MAX_NEW = 32, 32


def _load(spec, batch_invariant=False):
    from verispec.models import load_model
    from verispec.models.presets import PresetNotInstalledError
    try:
        return load_model(spec, backend="ggml", progress=False, batch_invariant=batch_invariant)
    except PresetNotInstalledError as e:
        pytest.skip(f"{spec} not installed: {e}")


def _equivalence(loaded, drafter_for, k=4):
    """Batch-invariant models must match plain batch 1 on every prompt, at every batch size."""
    from verispec.audit.context import encode, select_prompts
    from verispec.audit.equivalence import compare, reference_logits_at, tie_margin_for
    from verispec.audit.suite import load_suite
    from verispec.engine import Engine, EngineConfig, GenerationParams, Request
    from verispec.models.noise import batching_noise
    from verispec.policy import FixedK

    m, tok = loaded.model, loaded.tokenizer
    prompts = [encode(tok, p.prompt, True) for p in select_prompts(load_suite("default"), N_PROMPTS // 8)]
    assert len(prompts) == N_PROMPTS
    max_len = max(map(len, prompts)) + MAX_NEW + 2
    noise = batching_noise(m)
    exact = getattr(m, "batch_invariant", False)
    if exact:
        assert noise == {"logit": 0.0, "margin": 0.0}, noise
        noise = {**noise, "margin": tie_margin_for(m)["value"]}  # the fixed fp32 margin

    def run(drafter, batch):
        eng = Engine(m, drafter, FixedK(k if drafter is not None else 0),
                     EngineConfig(max_batch=batch, max_len=max_len))
        reqs = [Request(p, GenerationParams(max_new_tokens=MAX_NEW)) for p in prompts]
        eng.run(reqs)
        assert all(r.finish_reason in ("stop", "length") for r in reqs), [r.error for r in reqs]
        return reqs

    ref = [r.output_ids for r in run(None, 1)]
    margins = {}

    def margin_fn(i):
        def fn(prompt, r, index):
            if (i, index) not in margins:
                margins[(i, index)] = reference_logits_at(m, prompt, r, index)
            return margins[(i, index)]
        return fn

    rows = {}
    for batch in (1, 4, 16):
        reqs = run(drafter_for(batch, max_len), batch)
        cs = [compare(prompts[i], ref[i], r.output_ids, margin_fn(i), tie_margin=noise["margin"])
              for i, r in enumerate(reqs)]
        rows[batch] = {"identical": sum(c.exact for c in cs), "near_tie": sum(c.verdict == "near-tie" for c in cs),
                       "divergence": sum(c.verdict == "divergence" for c in cs),
                       "margins": sorted(round(c.margin, 3) for c in cs if c.margin is not None),
                       "drafted": sum(r.stats.drafted for r in reqs), "accepted": sum(r.stats.accepted for r in reqs)}
    print(f"\n{loaded.files.name} (ggml): noise {noise}; " + "; ".join(
        f"b={b}: {v['identical']}/{N_PROMPTS} identical, near-ties {v['near_tie']} at margins {v['margins']}, "
        f"divergences {v['divergence']}, drafts {v['accepted']}/{v['drafted']} accepted" for b, v in rows.items()))
    for b, v in rows.items():
        assert v["drafted"] > 100, f"b={b}: too few drafts to test anything"
        assert v["divergence"] == 0, f"b={b}: a divergence beyond the backend's noise: {v}"
        if exact:
            assert v["identical"] == N_PROMPTS, f"b={b}: batch-invariant, yet not identical: {v}"
    return rows


def test_smollm2_lookup():
    from verispec.drafters.lookup import PromptLookupDrafter
    _equivalence(_load("smollm2-135m"), lambda b, L: PromptLookupDrafter())


def test_smollm2_lookup_batch_invariant():
    from verispec.drafters.lookup import PromptLookupDrafter
    _equivalence(_load("smollm2-135m", batch_invariant=True), lambda b, L: PromptLookupDrafter())


def test_qwen_pair_batch_invariant():
    """The Q4_K_M target in batch-invariant mode (the draft model in the default mode: its
    numerics change what it drafts, never what the target emits). Its Q4_K/Q6_K weights need
    llama.cpp's tiled kernel off, which ggml fixes at a process's first decode: after other
    tests have decoded, this test runs itself in a fresh process."""
    from verispec.models.ggml import lib
    if lib._tiled_off_at_first_decode is False:
        import os
        import subprocess
        import sys
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                            f"{__file__}::test_qwen_pair_batch_invariant"], capture_output=True, text=True,
                           env={**os.environ, lib.TILED_MM_ENV: "0"})
        print(r.stdout[-3000:])
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        return
    from verispec.drafters.draft_model import DraftModelDrafter
    target, draft = _load("qwen2.5-coder-1.5b", batch_invariant=True), _load("qwen2.5-coder-0.5b")
    V = target.model.config.vocab_size
    _equivalence(target, lambda b, L: DraftModelDrafter(draft.model, V, max_rows=b, max_len=L + 8))


def test_qwen_pair():
    from verispec.drafters.draft_model import DraftModelDrafter
    target, draft = _load("qwen2.5-coder-1.5b"), _load("qwen2.5-coder-0.5b")
    V = target.model.config.vocab_size
    _equivalence(target, lambda b, L: DraftModelDrafter(draft.model, V, max_rows=b, max_len=L + 8))


def test_qwen_ragged_rollbacks_within_noise():
    """On the Q4_K_M target (whose repacked matrix kernels make even a single row's logits
    depend on the width of its passes) a ragged batch after rollbacks stays inside the
    backend's own noise."""
    from verispec.models.noise import batching_noise, rollback_difference
    m = _load("qwen2.5-coder-1.5b").model
    noise, diff = batching_noise(m), rollback_difference(m)
    print(f"\nqwen2.5-coder-1.5b (ggml): noise {noise}, ragged after rollbacks vs fresh {diff:.3g}")
    assert diff <= noise["logit"] + 1e-5
