"""The draft model prefills a row when the row first drafts (Drafter.prepare), not on admission:
a row the policy never lets draft costs the draft model nothing, and output is unchanged."""

import torch

from tests.tiny import native_from_hf, tiny_hf
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.policy import FixedK, Policy

V = 53


class CountingModel:
    """The draft model, counting the tokens it is fed."""

    def __init__(self, model):
        self.model, self.config, self.fed = model, model.config, 0

    def new_cache(self, *a, **kw):
        return self.model.new_cache(*a, **kw)

    def forward(self, x, cache, rows, num_new=None, **kw):
        self.fed += int(x.shape[0] * x.shape[1] if num_new is None else sum(int(n) for n in num_new))
        return self.model.forward(x, cache, rows, num_new, **kw)


class DraftLater(Policy):
    """No drafts for the first `rest` steps of the engine, then k for every row."""

    name = "draft-later"

    def __init__(self, rest, k):
        self.rest, self.max_k, self.steps = rest, k, 0

    def choose(self, requests):
        self.steps += 1
        return [0 if self.steps <= self.rest else self.max_k] * len(requests)


def _models():
    target = native_from_hf(tiny_hf("llama", seed=2, vocab=V))
    noisy = tiny_hf("llama", seed=2, vocab=V)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return target, CountingModel(native_from_hf(noisy))


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, V, (int(n),), generator=g).tolist() for n in (3, 9, 17, 30)]


def _run(target, draft, policy, max_batch=4):
    eng = Engine(target, DraftModelDrafter(draft, V, max_rows=4, max_len=90), policy,
                 EngineConfig(max_batch=max_batch, max_len=80))
    reqs = [Request(p, GenerationParams(max_new_tokens=20, ignore_eos=True)) for p in _prompts()]
    eng.run(reqs)
    return reqs, eng


def _plain_outputs(target):
    ref = [Request(p, GenerationParams(max_new_tokens=20, ignore_eos=True)) for p in _prompts()]
    Engine(target, None, FixedK(0), EngineConfig(max_batch=4, max_len=80)).run(ref)
    return [r.output_ids for r in ref]


def test_a_row_that_never_drafts_costs_the_draft_model_nothing():
    target, draft = _models()
    reqs, eng = _run(target, draft, FixedK(0))
    assert draft.fed == 0
    assert [r.output_ids for r in reqs] == _plain_outputs(target)


def test_first_drafting_step_prefills_as_prefill_and_output_is_exact():
    target, draft = _models()
    ref = _plain_outputs(target)
    for policy in (FixedK(3), DraftLater(rest=5, k=3)):
        draft.fed = 0
        reqs, eng = _run(target, draft, policy, max_batch=2)  # rows join as others leave
        assert [r.output_ids for r in reqs] == ref
        assert sum(r.stats.drafted for r in reqs) > 0
        # the draft saw each sequence once (prefill up to its first drafting step, then a
        # catch-up and its own drafts), never a prompt twice
        assert draft.fed < sum(len(p) for p in _prompts()) + sum(len(r.output_ids) for r in reqs) * 4
        # its prefill is prefill time, not drafting time, and not inside the step times
        assert eng.times.prefill_s > 0
        steps = sum(s for *_, s in eng.times.per_step)
        assert abs(steps - (eng.times.draft_s + eng.times.verify_forward_s + eng.times.other_s)) < 1e-6


def test_prepare_prefills_only_rows_with_an_empty_draft_cache():
    _, draft = _models()
    d = DraftModelDrafter(draft, V, max_rows=3, max_len=40)
    d.admit([0, 1, 2], [[1, 2, 3, 4], [5, 6], [7]])
    assert d.cache.lengths[:3].tolist() == [0, 0, 0] and draft.fed == 0
    d.prepare([0, 2], [[1, 2, 3, 4], [7]])  # a one-token prompt has nothing to prefill
    assert d.cache.lengths[:3].tolist() == [3, 0, 0] and draft.fed == 3
    d.prepare([0, 1], [[1, 2, 3, 4, 9], [5, 6]])  # row 0 is prefilled: the catch-up feeds it
    assert d.cache.lengths[:3].tolist() == [3, 1, 0] and draft.fed == 4
