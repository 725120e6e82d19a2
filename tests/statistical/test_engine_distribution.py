"""Engine distribution at temperature 1: the randomised-PIT test over >= 5,000 emitted
tokens passes for the exact rule and fails for the typical (lossy) rule."""

import pytest
import torch

from tests.tiny import engine_pit, native_from_hf, tiny_hf
from verispec.audit.stats import test_uniform
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.policy import FixedK
from verispec.sampling import SamplingParams

V = 32


@pytest.fixture(scope="module")
def pair():
    hf = tiny_hf("llama", seed=5, vocab=V)
    with torch.no_grad():
        hf.lm_head.weight.mul_(4.0)  # peaked target distributions, as real models have
    target = native_from_hf(hf)
    d = tiny_hf("llama", seed=5, vocab=V)
    with torch.no_grad():
        d.lm_head.weight.mul_(4.0)
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.15)
    return target, native_from_hf(d)


def _pit_of_engine(target, draft, rule, n_prompts=80, max_new=72, seed=0):
    eng = Engine(target, DraftModelDrafter(draft, V, max_rows=16, max_len=128), FixedK(3),
                 EngineConfig(max_batch=16, max_len=100, rule=rule))
    g = torch.Generator().manual_seed(seed)
    reqs = [Request(torch.randint(0, V, (4,), generator=g).tolist(),
                    GenerationParams(max_new_tokens=max_new,
                                     sampling=SamplingParams(temperature=1.0, seed=seed * 1000 + i)))
            for i in range(n_prompts)]
    eng.run(reqs)
    u = engine_pit(target, reqs, g)
    drafted = sum(r.stats.drafted for r in reqs)
    accepted = sum(r.stats.accepted for r in reqs)
    return u, accepted / drafted


def test_exact_rule_passes(pair):
    u, acc = _pit_of_engine(*pair, "rejection")
    assert u.numel() >= 5000
    assert 0.2 < acc < 0.95  # drafts are both accepted and rejected: the ragged path is exercised
    res = test_uniform(u.numpy())
    assert res.passed(1e-3), res


def test_typical_rule_fails(pair):
    u, _ = _pit_of_engine(*pair, "typical-lossy")
    res = test_uniform(u.numpy())
    assert not res.passed(1e-3), res
