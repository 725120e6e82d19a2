"""The engine calls the policy's hooks directly: a minimal policy that subclasses Policy
(choose() only) runs with a drafter that halts, and the halts / trims flags decide
whether the engine acts on halt() and trim()."""

import pytest

from tests.engine.test_engine_tiny import V, _hf_reference, _prompts
from tests.tiny import native_from_hf, tiny_hf
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.lookup import PromptLookupDrafter
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.policy import FixedK, Policy, PolicyWrapper


@pytest.fixture(scope="module")
def models():
    hf = tiny_hf("qwen2", seed=0, vocab=V)
    return hf, native_from_hf(hf)


class Three(Policy):
    """choose() only: every other hook is the base's no-op."""

    max_k = 3

    def choose(self, requests):
        return [3] * len(requests)


class Recording(Three):
    def __init__(self, halts=False, trims=False, stop_after=None, keep=None):
        self.halts, self.trims, self.stop_after, self.keep = halts, trims, stop_after, keep
        self.calls = {"halt": 0, "trim": 0, "observe": [], "observe_costs": 0}

    def halt(self, requests, k, i, active, conf):
        self.calls["halt"] += 1
        assert len(conf) == len(active) and all(0.0 <= c <= 1.0 for c in conf)
        return [i + 1 >= self.stop_after] * len(active)

    def trim(self, requests, found):
        self.calls["trim"] += 1
        return [min(f, self.keep) for f in found]

    def observe(self, requests, k, accepted):
        self.calls["observe"].append(list(k))

    def observe_costs(self, *args):
        self.calls["observe_costs"] += 1


def _run(models, drafter, policy, n=6, max_new=12):
    hf, target = models
    prompts = _prompts(n, seed=7)
    eng = Engine(target, drafter(target), policy, EngineConfig(max_batch=4, max_len=128, trace=True))
    reqs = [Request(p, GenerationParams(max_new_tokens=max_new)) for p in prompts]
    eng.run(reqs)
    assert [r.output_ids for r in reqs] == [_hf_reference(hf, [p], max_new)[0] for p in prompts]
    return eng, reqs


def draft_model(target):
    return DraftModelDrafter(target, V, max_rows=4, max_len=160)  # the target drafts for itself


def lookup(target):
    return PromptLookupDrafter(2)


def test_a_minimal_policy_runs_with_a_halting_drafter(models):
    eng, reqs = _run(models, draft_model, Three())
    # no halt rule was passed: every row drafted the k it was given (capped near the end)
    assert any(len(d) == 3 for r in reqs for _, d, _, _ in r.stats.trace)
    assert all(len(d) == asked for r in reqs for _, d, _, asked in r.stats.trace)


def test_halt_is_passed_only_when_both_policy_and_drafter_halt(models):
    p = Recording(halts=False, stop_after=1)
    _run(models, draft_model, p)
    assert p.calls["halt"] == 0  # the policy does not halt
    p = Recording(halts=True, stop_after=1)
    _run(models, lookup, p)
    assert p.calls["halt"] == 0  # the drafter takes no halt rule
    p = Recording(halts=True, stop_after=1)
    eng, reqs = _run(models, draft_model, p)
    assert p.calls["halt"] > 0
    # every row stopped after one draft, and the policy was told so
    assert all(len(d) <= 1 for r in reqs for _, d, _, _ in r.stats.trace)
    assert all(kb <= 1 for k in p.calls["observe"] for kb in k)
    assert p.calls["observe_costs"] == eng.times.steps == len(p.calls["observe"])


def test_trim_is_acted_on_only_where_the_policy_trims(models):
    p = Recording(trims=False, keep=0)
    _, reqs = _run(models, lookup, p)
    assert p.calls["trim"] == 0
    assert any(len(d) > 0 for r in reqs for _, d, _, _ in r.stats.trace)
    # k as chosen (3, capped near the end), whatever the drafter found
    assert max(kb for k in p.calls["observe"] for kb in k) == 3
    p = Recording(trims=True, keep=1)
    _, reqs = _run(models, lookup, p)
    assert p.calls["trim"] > 0
    assert all(len(d) <= 1 for r in reqs for _, d, _, _ in r.stats.trace)
    assert all(kb <= 1 for k in p.calls["observe"] for kb in k)  # k is what trim() kept


def test_a_wrapper_passes_every_hook_and_flag_through(models):
    inner = Recording(halts=True, trims=True, stop_after=2, keep=1)
    w = PolicyWrapper(inner)
    assert (w.halts, w.trims, w.max_k, w.name) == (True, True, 3, inner.name)
    assert w.trim([None], [3]) == [1] and w.halt([None], [3], 1, [0], [0.5]) == [True]
    w.observe_costs(1, 2, 1, 1, 0.0, 0.1)
    assert inner.calls["observe_costs"] == 1
    assert not PolicyWrapper(FixedK(2)).halts and PolicyWrapper(FixedK(2)).trim([None], [2]) == [2]


def test_policy_must_choose():
    class NoChoice(Policy):
        max_k = 1
    with pytest.raises(TypeError):
        NoChoice()
