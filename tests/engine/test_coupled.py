"""Seeded coupled sampling: speculative decoding at temperature > 0 emits exactly the
tokens plain decoding emits with the same seeds, with each drafter and at batch 1, 8
and 32; and the emitted tokens still pass the randomised-PIT test."""

import pytest
import torch

from tests.engine.test_engine_tiny import V, _prompts
from tests.tiny import engine_pit, native_from_hf, tiny_hf
from verispec.audit.stats import test_uniform
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.layerskip import LayerSkipDrafter
from verispec.drafters.lookup import PromptLookupDrafter
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.policy import FixedK
from verispec.sampling import SamplingParams


@pytest.fixture(scope="module")
def models():
    hf = tiny_hf("qwen2", seed=4, vocab=V)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)  # peaked distributions, so drafts are often right
    noisy = tiny_hf("qwen2", seed=4, vocab=V)
    with torch.no_grad():
        noisy.lm_head.weight.mul_(3.0)
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.03)
    return native_from_hf(hf), native_from_hf(noisy)


PROMPTS = _prompts(32, seed=9)
MAX_NEW = [6 + (i * 7) % 19 for i in range(32)]


def _run(target, drafter, k, batch, temperature, rule="coupled"):
    eng = Engine(target, drafter, FixedK(k), EngineConfig(max_batch=batch, max_len=128, rule=rule))
    reqs = [Request(p, GenerationParams(max_new_tokens=m, sampling=SamplingParams(
        temperature=temperature, top_p=0.95, seed=1000 + i))) for i, (p, m) in enumerate(zip(PROMPTS, MAX_NEW))]
    eng.run(reqs)
    return reqs


@pytest.fixture(scope="module")
def plain(models):
    return {t: [r.output_ids for r in _run(models[0], None, 0, 8, t)] for t in (0.7, 1.0)}


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("drafter", ["draft", "layerskip", "lookup"])
def test_coupled_speculative_equals_plain(models, plain, drafter, batch, temperature):
    target, draft = models
    d = {"draft": lambda: DraftModelDrafter(draft, V, max_rows=batch, max_len=140),
         "layerskip": lambda: LayerSkipDrafter(target, 2),
         "lookup": lambda: PromptLookupDrafter(2)}[drafter]()
    reqs = _run(target, d, 3, batch, temperature)
    assert [r.output_ids for r in reqs] == plain[temperature]
    drafted, accepted = sum(r.stats.drafted for r in reqs), sum(r.stats.accepted for r in reqs)
    assert drafted > 0 and (accepted > 0 or drafter == "lookup")


def test_plain_coupled_is_batch_independent(models, plain):
    assert [r.output_ids for r in _run(models[0], None, 0, 1, 1.0)] == plain[1.0]


def test_coupled_distribution(models):
    target, draft = models
    eng = Engine(target, DraftModelDrafter(draft, V, max_rows=16, max_len=128), FixedK(3),
                 EngineConfig(max_batch=16, max_len=100, rule="coupled"))
    g = torch.Generator().manual_seed(0)
    reqs = [Request(torch.randint(0, V, (3,), generator=g).tolist(),
                    GenerationParams(max_new_tokens=64, sampling=SamplingParams(temperature=1.0, seed=i)))
            for i in range(80)]
    eng.run(reqs)
    res = test_uniform(engine_pit(target, reqs, g).numpy())
    assert res.n >= 5000
    assert res.passed(1e-3), res


def test_the_rule_is_resolved_once_at_admission():
    """Engine.add settles a request's verification rule; the step and every reader see that
    one (Engine.rule_for), whatever happens to the engine's configuration afterwards."""
    from verispec.sampling import SamplingParams

    eng = Engine(native_from_hf(tiny_hf("llama")), None, None, EngineConfig(max_batch=2, max_len=64, rule="coupled"))
    greedy = Request([1, 2, 3], GenerationParams(max_new_tokens=4))
    unseeded = Request([1, 2, 3], GenerationParams(max_new_tokens=4, sampling=SamplingParams(temperature=1.0)))
    assert greedy.rule is None and unseeded.rule is None
    eng.add(greedy)
    eng.add(unseeded)
    assert (greedy.rule, unseeded.rule) == ("greedy", "coupled")  # a coupled engine seeds an unseeded row
    assert unseeded.params.sampling.seed is not None
    eng.config = EngineConfig(max_batch=2, max_len=64, rule="typical-lossy")
    assert eng.rule_for(unseeded) == "coupled"
