"""Each injected fault really breaks the engine it is built into (so the audit has
something to catch), and only that engine: a correct engine on the same models, built
before, beside or after it, stays exact."""

import pytest
import torch

from tests.tiny import native_from_hf, tiny_hf
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.audit import churn
from verispec.audit.faults import EXPECTED_CHECK, FAULTS, build
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


def _engine(target, draft, fault=None):
    make = Engine if fault is None else build(fault).engine
    return make(target, DraftModelDrafter(draft, V, max_rows=6, max_len=80), FixedK(3),
                EngineConfig(max_batch=6, max_len=70))


# row churn, as the audit's runs have it (audit/churn.py): mixed lengths and staggered
# arrivals, so rows are freed and taken again after sitting free (faults of row churn, and
# a backend that reorders rows, show only then)
LENGTHS = churn.mixed_lengths(6, 24)
PLAN = churn.schedule(LENGTHS, 6, seed=0)


def _requests(prompts):
    return [Request(prompts[i], GenerationParams(max_new_tokens=LENGTHS[i])) for i in PLAN.order]


def _run(target, draft, prompts, fault=None):
    reqs = _requests(prompts)
    _engine(target, draft, fault).run(reqs, arrivals=[PLAN.arrivals[i] for i in PLAN.order])
    return reqs


# faults of the sampling paths (temperature > 0), of the drafter's proposals only, and of
# stop tokens are invisible in greedy output without stops: the audit's own checks see them.
# A tree fault touches only steps whose drafts branch, and this suite's draft model proposes
# chains: tests/engine/test_tree_verify.py runs those faults with a tree drafter.
GREEDY_VISIBLE = sorted(f for f, check in EXPECTED_CHECK.items()
                        if check == "equivalence" and not f.startswith("tree-"))


@pytest.mark.parametrize("fault", GREEDY_VISIBLE)
def test_fault_changes_greedy_output(setup, fault):
    target, draft, prompts = setup
    ref = [r.output_ids for r in _run(target, draft, prompts)]
    bad = [r.output_ids for r in _run(target, draft, prompts, fault)]
    assert bad != ref
    assert [r.output_ids for r in _run(target, draft, prompts)] == ref  # nothing left behind


@pytest.mark.parametrize("fault", GREEDY_VISIBLE)
def test_fault_stays_in_its_engine(setup, fault):
    """A faulty engine and a correct one on the same target and draft model, stepped in
    turn: the correct one's output is the reference's, the faulty one's is not."""
    target, draft, prompts = setup
    ref = [r.output_ids for r in _run(target, draft, prompts)]
    engines = {f: _engine(target, draft, f) for f in (None, fault)}
    reqs = {f: _requests(prompts) for f in engines}
    arrivals = [PLAN.arrivals[i] for i in PLAN.order]
    step = 0
    while step <= max(arrivals) or any(eng.has_work for eng in engines.values()):
        for f, eng in engines.items():
            for r, a in zip(reqs[f], arrivals):
                if a == step:
                    eng.add(r)
            if eng.has_work:
                eng.step()
        step += 1
    assert [r.output_ids for r in reqs[None]] == ref
    assert [r.output_ids for r in reqs[fault]] != ref


def test_every_fault_builds_its_hooks():
    for name in FAULTS:
        f = build(name)
        assert f.name == name and (f.step, f.drafter, f.positions, f.backend) != (None, None, None, None)
    assert build("relaxed-acceptance:1.25").name == "relaxed-acceptance:1.25"


@pytest.fixture(scope="module")
def setup_context():
    """A draft that agrees often (the target plus a little noise): steps that accept every
    draft, after which the draft cache must catch up on the last draft token, are common."""
    target = native_from_hf(tiny_hf("llama", seed=2, vocab=V, embed_scale=10.0))
    noisy = tiny_hf("llama", seed=2, vocab=V, embed_scale=10.0)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in (3, 9, 17, 30, 5, 12)]
    return target, native_from_hf(noisy), prompts


class LagSpy(DraftModelDrafter):
    """Records, after every proposal, how far the draft cache lags the sequence it drafted
    from: a correct drafter has fed the whole sequence and k - 1 of its drafts."""

    lags: list

    def propose(self, rows, tokens, k, sampling, generators):
        out = super().propose(rows, tokens, k, sampling, generators)
        for b, r in enumerate(rows):
            if k[b] > 0:
                self.lags.append(len(tokens[b]) + k[b] - 1 - int(self.cache.lengths[r]))
        return out


def _run_spy(target, draft, prompts, fault=None):
    d = LagSpy(draft, V, max_rows=6, max_len=80)
    d.lags = []
    make = Engine if fault is None else build(fault).engine
    eng = make(target, d, FixedK(3), EngineConfig(max_batch=6, max_len=70, trace=True))
    reqs = [Request(p, GenerationParams(max_new_tokens=24)) for p in prompts]
    eng.run(reqs)
    return reqs, d.lags


def test_draft_no_catchup_leaves_the_draft_cache_behind(setup_context):
    """Output stays exact (the target verifies), but after a step that accepted every
    draft the draft cache skips the last draft token and stays behind from then on. (On
    these tiny models the proposals barely depend on older context; the audit's
    drafter-consistency check, on the audit's tiny models, sees the stale proposals.)"""
    target, draft, prompts = setup_context
    ok, ok_lags = _run_spy(target, draft, prompts)
    full = sum(a == len(d) > 0 for r in ok for _, d, a, _ in r.stats.trace)
    assert full >= 5  # the catch-up path really ran
    assert set(ok_lags) == {0}
    bad, bad_lags = _run_spy(target, draft, prompts, "draft-no-catchup")
    assert [r.output_ids for r in bad] == [r.output_ids for r in ok]
    assert max(bad_lags) > 0


def test_unknown_fault():
    with pytest.raises(ValueError, match="unknown fault"):
        build("nope")
