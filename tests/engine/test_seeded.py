"""Same seed, same bytes, by default: a seeded request at temperature > 0 gives the same
tokens with speculation off, with each drafter, with a fixed and an adaptive k, at
batch 1, 8 and 32, under the default rule (rejection), because seeded requests sample
with noise keyed on (seed, position) and are verified by the coupled rule."""

import secrets

import pytest
import torch

from tests.engine.test_engine_tiny import V, _prompts
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.layerskip import LayerSkipDrafter
from verispec.drafters.lookup import PromptLookupDrafter
from verispec.drafters.suffix import SuffixDrafter, SuffixSettings
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.policy import AdaptiveConfig, FixedK
from verispec.policy.adaptive import AdaptivePolicy, CostModel
from verispec.sampling import SamplingParams
from tests.tiny import native_from_hf, tiny_hf

PROMPTS = _prompts(32, seed=21)
MAX_NEW = [5 + (i * 7) % 19 for i in range(32)]
# a cost model where drafting pays, so the adaptive policy drafts and varies k per row;
# halts=True: rows also stop on the drafter's confidence
# for prompt lookup (draft_free, as measure_costs reports it) proposals cost next to
# nothing and the policy starts out sure of them: at T > 0 on these random models lookup's
# drafts are rarely kept, and a policy that priced them honestly would soon stop asking
PAYING = CostModel.from_total_tokens((1, 64, 1024), (1.0, 1.0, 3.0), (1, 64), (1e-4, 1e-4), draft_free=True)
EAGER = AdaptiveConfig(prior=1.0, min_gain=0.0)
HALTING = CostModel.from_total_tokens((1, 64, 1024), (1.0, 1.0, 3.0), (1, 64), (0.05, 0.08), halts=True)


@pytest.fixture(scope="module")
def models():
    hf = tiny_hf("qwen2", seed=5, vocab=V)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)  # peaked distributions, so drafts are often right
    noisy = tiny_hf("qwen2", seed=5, vocab=V)
    with torch.no_grad():
        noisy.lm_head.weight.mul_(3.0)
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.03)
    return native_from_hf(hf), native_from_hf(noisy)


def _sampling(i, temperature):
    # top-k / top-p / min-p vary per request: the keyed noise is applied to the
    # processed distribution, in plain and speculative decoding alike
    return SamplingParams(temperature=temperature, top_k=(0, 20, 50)[i % 3], top_p=(1.0, 0.9)[i % 2],
                          min_p=(0.0, 0.02)[i % 2], seed=7_000 + 13 * i)


def _run(target, drafter, policy, batch, temperature, rule="rejection"):
    eng = Engine(target, drafter, policy, EngineConfig(max_batch=batch, max_len=128, rule=rule))
    reqs = [Request(p, GenerationParams(max_new_tokens=m, sampling=_sampling(i, temperature)))
            for i, (p, m) in enumerate(zip(PROMPTS, MAX_NEW))]
    eng.run(reqs)
    assert all(eng.rule_for(r) == "coupled" for r in reqs)
    return reqs


@pytest.fixture(scope="module")
def plain(models):
    return {t: [r.output_ids for r in _run(models[0], None, FixedK(0), 8, t)] for t in (0.7, 1.0)}


def _drafter(kind, models, batch):
    target, draft = models
    return {"draft": lambda: DraftModelDrafter(draft, V, max_rows=batch, max_len=140),
            "layerskip": lambda: LayerSkipDrafter(target, 2),
            "lookup": lambda: PromptLookupDrafter(2),
            "suffix": lambda: SuffixDrafter(SuffixSettings(min_token_prob=0.0))}[kind]()


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("kind", ["draft", "layerskip", "lookup", "suffix"])
def test_seeded_output_is_independent_of_speculation(models, plain, kind, policy, batch, temperature):
    d = _drafter(kind, models, batch)
    if policy == "fixed":
        pol = FixedK(3)
    else:
        pol = AdaptivePolicy(HALTING, max_k=4) if kind not in ("lookup", "suffix") else AdaptivePolicy(PAYING, max_k=4, config=EAGER)
    reqs = _run(models[0], d, pol, batch, temperature)
    assert [r.output_ids for r in reqs] == plain[temperature]
    drafted, accepted = sum(r.stats.drafted for r in reqs), sum(r.stats.accepted for r in reqs)
    assert drafted > 0 and (accepted > 0 or kind in ("lookup", "suffix")), "the check must exercise speculation"


def test_seeded_plain_is_batch_and_rule_independent(models, plain):
    assert [r.output_ids for r in _run(models[0], None, FixedK(0), 1, 1.0)] == plain[1.0]
    assert [r.output_ids for r in _run(models[0], None, FixedK(0), 32, 1.0, rule="coupled")] == plain[1.0]


def test_explicit_uncoupled_seed_uses_the_rule_with_a_seeded_generator(models):
    """coupled=False keeps a seed reproducible for a fixed configuration (the audit tests
    rejection sampling that way) while the rule is rejection, not coupled."""
    target, _ = models
    runs = []
    for _ in range(2):
        eng = Engine(target, PromptLookupDrafter(2), FixedK(3), EngineConfig(max_batch=4, max_len=128))
        reqs = [Request(p, GenerationParams(max_new_tokens=12, sampling=SamplingParams(
            temperature=1.0, seed=i, coupled=False))) for i, p in enumerate(PROMPTS[:8])]
        eng.run(reqs)
        assert {eng.rule_for(r) for r in reqs} == {"rejection"}
        runs.append([r.output_ids for r in reqs])
    assert runs[0] == runs[1]


def test_unseeded_requests_draw_from_os_entropy(models):
    """Unseeded requests on a coupled engine get seeds from OS entropy, not from the global
    torch RNG (which starts from the same state in every process)."""
    target, _ = models
    seeds = []
    for _ in range(2):
        torch.manual_seed(0)  # as a fresh process would be
        eng = Engine(target, None, FixedK(0), EngineConfig(max_batch=2, max_len=64, rule="coupled"))
        r = Request(PROMPTS[0], GenerationParams(max_new_tokens=2, sampling=SamplingParams(temperature=1.0)))
        eng.add(r)
        assert r.params.sampling.keyed
        seeds.append(r.params.sampling.seed)
    assert seeds[0] != seeds[1]
    # unseeded requests on a rejection engine: independent generators, different output
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        eng = Engine(target, None, FixedK(0), EngineConfig(max_batch=2, max_len=64))
        r = Request(PROMPTS[0], GenerationParams(max_new_tokens=24, sampling=SamplingParams(temperature=1.0)))
        eng.run([r])
        outs.append(r.output_ids)
    assert outs[0] != outs[1]


def test_greedy_rule_refuses_sampled_requests(models):
    target, _ = models
    eng = Engine(target, PromptLookupDrafter(2), FixedK(2), EngineConfig(max_batch=2, max_len=64, rule="greedy"))
    with pytest.raises(ValueError, match="temperature-0 requests only"):
        eng.add(Request(PROMPTS[0], GenerationParams(max_new_tokens=3, sampling=SamplingParams(temperature=0.8))))
    eng.add(Request(PROMPTS[0], GenerationParams(max_new_tokens=3)))  # greedy is fine


def test_secrets_is_the_entropy_source(monkeypatch, models):
    target, _ = models
    monkeypatch.setattr(secrets, "randbits", lambda n: 12345)
    eng = Engine(target, None, FixedK(0), EngineConfig(max_batch=2, max_len=64, rule="coupled"))
    r = Request(PROMPTS[0], GenerationParams(max_new_tokens=2, sampling=SamplingParams(temperature=1.0)))
    eng.add(r)
    assert r.params.sampling.seed == 12345
