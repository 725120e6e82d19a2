"""Each injected fault really breaks the engine (so the audit has something to catch),
and the engine is exact again once the fault is lifted."""

import pytest
import torch

from tests.tiny import native_from_hf, tiny_hf
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.engine.faults import FAULTS, inject
from verispec.policy import FixedK

V = 53


@pytest.fixture(scope="module")
def setup():
    target = native_from_hf(tiny_hf("llama", seed=2, vocab=V))
    noisy = tiny_hf("llama", seed=2, vocab=V)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    draft = native_from_hf(noisy)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in (3, 9, 17, 30, 5, 12)]
    return target, draft, prompts


def _run(target, draft, prompts):
    eng = Engine(target, DraftModelDrafter(draft, V, max_rows=6, max_len=80), FixedK(3),
                 EngineConfig(max_batch=6, max_len=70))
    reqs = [Request(p, GenerationParams(max_new_tokens=24)) for p in prompts]
    eng.run(reqs)
    return reqs


@pytest.mark.parametrize("fault", sorted(set(FAULTS) - {"residual-not-normalised", "draft-no-catchup"}))
def test_fault_changes_greedy_output(setup, fault):
    target, draft, prompts = setup
    ref = [r.output_ids for r in _run(target, draft, prompts)]
    with inject(fault):
        bad = [r.output_ids for r in _run(target, draft, prompts)]
    assert bad != ref
    assert [r.output_ids for r in _run(target, draft, prompts)] == ref  # lifted cleanly


def test_draft_no_catchup_changes_proposals(setup):
    """Output stays exact (the target verifies), but proposals no longer match a fresh draft."""
    target, draft, prompts = setup
    ok = _run(target, draft, prompts)
    with inject("draft-no-catchup"):
        bad = _run(target, draft, prompts)
    assert [r.output_ids for r in bad] == [r.output_ids for r in ok]
    assert [r.stats.trace for r in bad] != [r.stats.trace for r in ok]


def test_unknown_fault():
    with pytest.raises(ValueError, match="unknown fault"):
        with inject("nope"):
            pass
