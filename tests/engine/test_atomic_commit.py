"""A step commits every row or none. An exception before the commit point (while tokens are
appended, the caches truncated or the drafter rolled back) leaves every row's output as it
was before the step, so step()'s undo and row-by-row retry decode from outputs and caches
that agree; an exception after it (ending a row, the policy's observation) never sends the
committed step back to be taken again. Either way, every row the exception did not belong
to decodes exactly what plain decoding does."""

import pytest
import torch

from tests.tiny import native_from_hf, tiny_hf
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.engine.hooks import StepHooks
from verispec.policy import FixedK

V = 53
MAX_NEW = 20


@pytest.fixture(scope="module")
def setup():
    target = native_from_hf(tiny_hf("llama", seed=4, vocab=V))
    noisy = tiny_hf("llama", seed=4, vocab=V)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    draft = native_from_hf(noisy)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in (4, 11, 7, 19, 6)]
    plain = Engine(target, config=EngineConfig(max_batch=5, max_len=64))
    ref = [Request(p, GenerationParams(max_new_tokens=MAX_NEW)) for p in prompts]
    plain.run(ref)
    return target, draft, prompts, [r.output_ids for r in ref]


class Boom(RuntimeError):
    pass


class Once:
    """Raises Boom on the n-th call (batch calls only, where asked), then passes through."""

    def __init__(self, inner, at: int = 3, batch_only: bool = True):
        self.inner, self.at, self.batch_only, self.calls, self.fired = inner, at, batch_only, 0, False

    def __call__(self, rows, *a, **kw):
        if not self.fired and (not self.batch_only or len(rows) > 1):
            self.calls += 1
            if self.calls == self.at:
                self.fired = True
                raise Boom("injected")
        return self.inner(rows, *a, **kw)


class AppendThenRaise(StepHooks):
    """Appends a row's tokens, then raises, once: a failure in the middle of the appends."""

    fired = False

    def append(self, r, emitted):
        reason = super().append(r, emitted)
        if not self.fired and len(r.output_ids) > 6:
            self.fired = True
            raise Boom("after appending")
        return reason


def _engine(target, draft, hooks=None, trace=False):
    return Engine(target, DraftModelDrafter(draft, V, max_rows=5, max_len=64), FixedK(3),
                  EngineConfig(max_batch=5, max_len=64, trace=trace), hooks=hooks)


def _outputs(eng, prompts):
    reqs = [Request(p, GenerationParams(max_new_tokens=MAX_NEW)) for p in prompts]
    eng.run(reqs)
    return reqs


def test_the_reference_path_drafts(setup):
    target, draft, prompts, ref = setup
    reqs = _outputs(_engine(target, draft), prompts)
    assert [r.output_ids for r in reqs] == ref and sum(r.stats.drafted for r in reqs) > 20


@pytest.mark.parametrize("where", ["cache.truncate", "drafter.rollback", "append"])
def test_an_exception_before_the_commit_point_leaves_every_output_exact(setup, where):
    """The step is undone and taken again row by row: no row keeps tokens whose cache was
    rolled back, so every output equals plain decoding."""
    target, draft, prompts, ref = setup
    hooks = AppendThenRaise()
    eng = _engine(target, draft, hooks=hooks if where == "append" else None, trace=True)
    if where == "cache.truncate":
        eng.cache.truncate = hooks = Once(eng.cache.truncate)
    elif where == "drafter.rollback":
        eng.drafter.rollback = hooks = Once(eng.drafter.rollback)
    reqs = _outputs(eng, prompts)
    assert hooks.fired
    assert [r.output_ids for r in reqs] == ref
    assert all(r.finish_reason == "length" for r in reqs)
    for r in reqs:  # the stats count each committed step once: no step recorded twice
        assert r.stats.generated_tokens == MAX_NEW == len(r.output_ids)
        assert sum(acc + 1 for _, _, acc, _ in r.stats.trace) >= MAX_NEW


def test_an_exception_ending_a_row_fails_that_row_alone(setup):
    """Freeing a finished row's drafter state raises: that request ends with an error that
    says so, its committed tokens kept; the others go on and stay exact."""
    target, draft, prompts, ref = setup
    eng = _engine(target, draft)
    eng.drafter.release = Once(eng.drafter.release, at=1, batch_only=False)
    reqs = _outputs(eng, prompts)
    errors = [r for r in reqs if r.finish_reason == "error"]
    assert len(errors) == 1 and "after its tokens were committed" in errors[0].error
    assert errors[0].output_ids == ref[reqs.index(errors[0])]  # its tokens were right, and kept
    assert [r.output_ids for r in reqs if r.finish_reason != "error"] == \
        [o for r, o in zip(reqs, ref) if r.finish_reason != "error"]


def test_a_policy_that_raises_after_the_commit_does_not_replay_the_step(setup):
    target, draft, prompts, ref = setup
    eng = _engine(target, draft)
    observe = eng.policy.observe
    calls = []

    def flaky(reqs, ks, accepted):
        calls.append(len(reqs))
        if len(calls) == 2:
            raise Boom("observe")
        return observe(reqs, ks, accepted)
    eng.policy.observe = flaky
    reqs = _outputs(eng, prompts)
    assert len(calls) > 2 and [r.output_ids for r in reqs] == ref
    assert all(r.stats.generated_tokens == len(r.output_ids) == MAX_NEW for r in reqs)
