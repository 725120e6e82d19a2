"""Row churn: requests that arrive while others decode (Engine.run(arrivals=...)), the
engine's churn counters (RowChurn), the audit's schedule (audit/churn.py), and the churn
faults, which only that schedule exposes."""

import pytest
import torch

from tests.audit_tiny import V, one_thread, tiny_audit, tiny_drafter_factory, tiny_models
from verispec.audit import churn
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.policy import FixedK


@pytest.fixture(scope="module")
def models():
    with one_thread():
        yield tiny_models()


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(3, V, (int(torch.randint(2, 24, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    for i in range(1, n, 3):  # repetitive prompts: prompt lookup finds something to draft
        out[i] = (out[i][:3] * 8)[:len(out[i])]
    return out


def _requests(prompts, lengths):
    return [Request(p, GenerationParams(max_new_tokens=m, stop_token_ids=(2,))) for p, m in zip(prompts, lengths)]


@pytest.mark.parametrize("kind", ["draft-model", "lookup", "layerskip"])
def test_arrivals_give_the_outputs_of_a_batch_that_arrives_at_once(models, kind):
    target, _ = models
    prompts = _prompts(10)
    lengths = churn.mixed_lengths(10, 20)
    make = tiny_drafter_factory(models, kind)

    def run(batch, arrivals=None):
        eng = Engine(target, make(batch, 64), FixedK(3), EngineConfig(max_batch=batch, max_len=48))
        reqs = eng.run(_requests(prompts, lengths), arrivals=arrivals)
        assert eng.cache.rows_in_use == 0 and not eng.has_work
        return [r.output_ids for r in reqs], eng

    at_once, _ = run(4)
    arrivals = [0, 0, 9, 3, 3, 60, 12, 1, 90, 7]
    for batch in (1, 4, 10):
        got, eng = run(batch, arrivals)
        assert got == at_once, batch
        assert eng.churn.reused_rows > 0
    # at b=10 all but two have ended long before step 60 (20 tokens at most): the run jumps
    # to each of the last two arrivals instead of stepping idle
    assert eng.times.steps < 60


def test_counters_on_a_hand_built_schedule(models):
    """Plain decoding emits one token per row per step, so every step of the schedule is
    known: rows 0-2 admitted at step 0; the middle row (2 tokens) ends in step 1 and sits
    free through step 2 (a gap between rows 0 and 2) until a request arriving at step 3
    takes it again; that one ends in step 4 and its row is taken again at once in step 5;
    the last request arrives at step 20, after everything ended in step 5: the run jumps
    there and takes no idle step."""
    target, _ = models
    p = [5, 6, 7, 8]  # one prompt length: lengths differ only once a request joins later
    lengths = [6, 2, 6, 2, 1, 2]
    arrivals = [0, 0, 0, 3, 5, 20]
    eng = Engine(target, config=EngineConfig(max_batch=3, max_len=32))
    reqs = eng.run([Request(list(p), GenerationParams(max_new_tokens=m)) for m in lengths], arrivals=arrivals)
    assert [r.row for r in reqs] == [0, 1, 2, 1, 1, 0]
    assert [len(r.output_ids) for r in reqs] == lengths
    assert eng.times.steps == 8  # steps 0-5, then the last request's two: no idle step
    assert eng.churn.counts() == {"reused_rows": 3,  # requests 3, 4 and 5
                                  "reused_after_idle": 1,  # request 3: row 1 sat free through step 2
                                  "gapped_steps": 1,  # step 2: rows 0 and 2
                                  "mixed_length_steps": 3}  # steps 3-5: a newcomer beside older rows


def test_arrivals_are_checked_before_anything_is_decoded(models):
    target, _ = models
    eng = Engine(target, config=EngineConfig(max_batch=2, max_len=16))
    ok, too_long = Request([3, 4], GenerationParams(max_new_tokens=4)), Request([3, 4], GenerationParams(max_new_tokens=40))
    with pytest.raises(ValueError, match="one step >= 0 per request"):
        eng.run([ok, too_long], arrivals=[0])
    with pytest.raises(ValueError, match="exceeds the context"):
        eng.run([ok, too_long], arrivals=[0, 5])
    assert not eng.has_work and ok.output_ids == []


def test_schedule():
    lengths = churn.mixed_lengths(12, 24)
    assert lengths == [24, 24, 8] * 4
    assert churn.mixed_lengths(4, 3) == [3, 3, 2, 3]  # never below 2
    plan = churn.schedule(lengths, 12, seed="x")
    assert plan == churn.schedule(lengths, 12, seed="x") != churn.schedule(lengths, 12, seed="y")
    assert sorted(plan.order) == list(range(12))
    assert [plan.arrivals[i] for i in plan.order] == sorted(plan.arrivals)
    second = plan.order[1]  # a shortest request, handed over second: it takes row 1 and leaves a gap
    assert plan.arrivals[plan.order[0]] == plan.arrivals[second] == 0 and lengths[second] == 8
    # two waves of 6 (b >= n: half the requests), the second from step 12 on
    assert sum(a >= 12 for a in plan.arrivals) == 6 and max(plan.arrivals) <= 12 + 24 // 6


@pytest.mark.parametrize("kind", ["draft-model", "lookup"])
def test_schedule_reuses_rows_and_leaves_gaps_at_a_batch_of_every_request(models, kind):
    """At b >= n no row is ever reused when the requests arrive at once; under the
    schedule rows are freed and taken again after sitting free, and running rows have gaps."""
    target, _ = models
    n = 12
    prompts = _prompts(n, seed=1)
    lengths = churn.mixed_lengths(n, 24)
    make = tiny_drafter_factory(models, kind)
    for batch, seed in ((12, 0), (12, 1), (32, 2), (4, 3)):
        eng = Engine(target, make(min(batch, n), 64), FixedK(3), EngineConfig(max_batch=min(batch, n), max_len=48))
        at_once = _requests(prompts, lengths)
        eng.run(at_once)
        assert eng.churn.reused_rows == 0 or batch < n  # b < n: continuous batching reuses rows anyway
        eng = Engine(target, make(min(batch, n), 64), FixedK(3), EngineConfig(max_batch=min(batch, n), max_len=48))
        reqs = _requests(prompts, lengths)
        figures = churn.run_churned(eng, reqs, seed, policy="fixed")
        assert [r.output_ids for r in reqs] == [r.output_ids for r in at_once]
        assert figures["batch"] == min(batch, n) and figures["requests"] == n and figures["policy"] == "fixed"
        assert figures["reused_rows"] > 0 and figures["reused_after_idle"] > 0, figures
        assert figures["gapped_steps"] > 0 and figures["mixed_length_steps"] > 0, figures
        assert churn.note(figures) == "" and churn.shortfalls([figures]) == []


def test_report_says_where_churn_was_not_reached():
    runs = [{"batch": 1, "policy": "fixed", "reused_rows": 12, "gapped_steps": 0},
            {"batch": 4, "policy": "fixed", "reused_rows": 5, "gapped_steps": 0},
            {"batch": 8, "policy": "fixed k=4", "reused_rows": 0, "gapped_steps": 3}]
    assert churn.note(runs[0]) == "no gapped step (one row: none possible)"
    assert churn.shortfalls(runs) == ["b=4 (fixed): no gapped step", "b=8 (fixed k=4): no row reused"]


@pytest.mark.parametrize("fault", ["draft-row-cleared-lazily", "rejoined-row-stale-input"])
def test_churn_faults_pass_an_audit_without_churn(models, monkeypatch, fault):
    """The churn faults are invisible to the audit as it was before row churn (every
    request at once, one length): its runs never take a row that sat free. With churn
    they fail it (test_audit_faults.py runs them with every drafter)."""
    from verispec.audit import seeded

    def at_once(engine, requests, seed, on_finish=None, **labels):
        before = churn.counted(engine)
        engine.run(requests, on_finish)
        return {**churn.since(engine, before, **labels), "requests": len(requests), "arrival_span": 0}

    for module in (churn, seeded):
        monkeypatch.setattr(module, "run_churned", at_once)
        monkeypatch.setattr(module, "mixed_lengths", lambda n, max_new: [max_new] * n)
    with one_thread():
        result = tiny_audit(models, fault=fault)
    assert result.verdict == "pass", result.failed
    eq = next(c for c in result.checks if c.name == "equivalence")
    assert sum(r["reused_after_idle"] for r in eq.details["churn"]) == 0


def test_report_shows_each_run_churn(models, tmp_path):
    from verispec.audit.report import write_reports

    with one_thread():
        result = tiny_audit(models, batch_sizes=(1, 4, 12))  # 12 = the number of prompts
    checks = {c.name: c for c in result.checks}
    runs = checks["equivalence"].details["churn"]
    assert [r["batch"] for r in runs] == [1, 4, 12]
    assert runs[0]["gapped_steps"] == 0 and runs[0]["reused_rows"] == 12  # batch 1: one row, taken again
    for r in runs[1:] + [c["churn"] for c in checks["seeded"].details["per_config"]][1:]:
        assert r["reused_after_idle"] > 0 and r["gapped_steps"] > 0, r
    assert checks["equivalence"].figures["churn_not_reached"] == []
    md = write_reports(result.to_dict(), tmp_path)["md"].read_text()
    assert "Row churn of the greedy speculative runs" in md and "Row churn of the seeded speculative runs" in md
    assert "no gapped step (one row: none possible)" in md
