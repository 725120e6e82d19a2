"""The adaptive policy's decisions on synthetic cost models and acceptance traces."""

import numpy as np
import pytest

from verispec.policy.adaptive import CONF_EDGES, AdaptivePolicy, CostModel


class R:
    def __init__(self, rid):
        self.request_id, self.finished = rid, False


def costs(verify_slope=0.0, draft=0.3, flat_until=16, draft_per_row=False):
    """Target: 1.0 s per pass up to flat_until rows, then +verify_slope per row; draft: `draft`
    s per token for one row, twice that for 64 rows (or `draft` more per row drafting)."""
    rows = (1, flat_until, 1024)
    secs = (1.0, 1.0, 1.0 + verify_slope * (1024 - flat_until))
    if draft_per_row:
        return CostModel.from_total_tokens(rows, secs, (1, 64), (draft, 64 * draft))
    return CostModel.from_total_tokens(rows, secs, (1, 64), (draft, 2 * draft))


def feed(policy, reqs, rate, steps, rng):
    """Simulate steps where each draft is accepted with probability `rate` per row."""
    for _ in range(steps):
        k = policy.choose(reqs)
        acc = []
        for kb, rt in zip(k, rate):
            a = 0
            while a < kb and rng.random() < rt:
                a += 1
            acc.append(a)
        policy.observe(reqs, k, acc)
    return policy.choose(reqs)


def test_k0_when_drafting_cannot_pay():
    # a draft as expensive as the target: even perfect acceptance cannot pay for itself
    p = AdaptivePolicy(costs(draft=1.0), max_k=8)
    assert p.best_choice(np.array([0.9, 0.9])) == [0, 0]
    # verify cost grows steeply with rows: no speculation either
    p = AdaptivePolicy(costs(verify_slope=1.0, draft=0.1, flat_until=1), max_k=8)
    assert p.best_choice(np.array([0.6])) == [0]


def test_larger_k_as_acceptance_rises():
    p = AdaptivePolicy(costs(verify_slope=0.02, draft=0.1), max_k=8)
    ks = [p.best_choice(np.array([a]))[0] for a in (0.1, 0.5, 0.8, 0.95)]
    assert ks[0] == 0
    assert ks == sorted(ks) and ks[-1] > ks[1] > 0, ks


def test_rows_that_fail_stop_drafting_and_recover():
    rng = np.random.default_rng(0)
    # (a row that drafts costs its own draft tokens: else a row that rarely accepts may
    # still be worth a free ride on the good row's wider pass)
    p = AdaptivePolicy(costs(verify_slope=0.01, draft=0.05, draft_per_row=True), max_k=8)
    reqs = [R("good"), R("bad")]
    k = feed(p, reqs, [0.9, 0.0], 60, rng)
    assert k[0] >= 3 and k[1] <= 1  # the failing row only ever gets probes
    drafted_bad = 0
    for _ in range(64):  # probes are rare
        k = p.choose(reqs)
        drafted_bad += k[1] > 0
        p.observe(reqs, k, [k[0], 0])
    assert drafted_bad <= 64 // 8
    # acceptance returns: the row drafts again
    k = feed(p, reqs, [0.9, 0.9], 200, rng)
    assert k[1] >= 3


def test_never_worse_than_plain_in_the_cost_model():
    rng = np.random.default_rng(1)
    for _ in range(200):
        B = int(rng.integers(1, 33))
        c = costs(verify_slope=float(rng.uniform(0, 0.1)), draft=float(rng.uniform(0.01, 1.0)),
                  flat_until=int(rng.integers(1, 32)))
        p = AdaptivePolicy(c, max_k=8)
        alphas = rng.uniform(0, 1, B)
        choice = p.best_choice(alphas)
        E = p.expected_tokens(alphas)
        tokens = sum(E[b, kb] for b, kb in enumerate(choice))
        m, k = sum(kb > 0 for kb in choice), max(choice)
        secs = float(c.target(B, k + 1) + k * c.draft(m))  # the engine pads rows to the longest draft
        assert tokens / secs >= B / float(c.target(B, 1)) - 1e-9


def test_max_k_validated():
    with pytest.raises(ValueError):
        AdaptivePolicy(costs(), max_k=0)


def test_cost_of_a_step_is_the_padded_pass():
    # a pass whose cost grows with tokens per row, not with total rows: 4 rows x 2
    # tokens cost 1.6x 4 rows x 1 token, though 1 row x 8 tokens costs what 1 x 4 does
    bp, tp = (1, 4), (1, 2, 3)
    grid = ((1.0, 1.0, 1.0), (1.0, 1.6, 2.2))
    c = CostModel(bp, tp, grid, (1, 4), (0.0, 0.0))
    assert float(c.target(4, 2)) == pytest.approx(1.6)
    assert float(c.target(2, 2)) == pytest.approx(1.2)  # bilinear between the batch points
    assert float(c.target(4, 5)) == pytest.approx(3.4)  # linear beyond the last token point
    p = AdaptivePolicy(c, max_k=2)
    # one row that accepts half the time does not pay for the whole batch's wider pass
    assert p.best_choice(np.array([0.5, 0.0, 0.0, 0.0])) == [0, 0, 0, 0]
    # all rows accepting often do
    assert p.best_choice(np.array([0.9, 0.9, 0.9, 0.9])) == [2, 2, 2, 2]


def test_probes_share_steps():
    # rows that never accept (a prior of 0) on a cheap drafter: only probes draft
    p = AdaptivePolicy(costs(draft=0.02), max_k=4, prior=0.0)
    reqs = [R(f"r{i}") for i in range(8)]
    probe_steps = 0
    for step in range(200):
        k = p.choose(reqs)
        if step < 3:  # rows join one at a time: their probe clocks start out of phase
            for r in reqs[step * 3:(step + 1) * 3]:
                p.rows.pop(r.request_id, None)
        probe_steps += any(k)
        p.observe(reqs, k, [0] * len(k))
    # 8 failing rows, each alone, would probe on up to 8x as many steps as one row does
    assert 0 < probe_steps <= 10, probe_steps


def test_grid_shape_validated():
    with pytest.raises(ValueError, match="grid"):
        CostModel((1, 2), (1,), ((1.0,),), (1,), (0.1,))


def test_drafts_not_found_count_as_rejected():
    # prompt lookup without a match drafts nothing though asked for k: the engine reports
    # what was asked, so the row's acceptance falls and it stops asking (bar probes)
    p = AdaptivePolicy(costs(verify_slope=0.1, draft=0.001, flat_until=1), max_k=8)
    reqs = [R("no-match")]
    assert p.choose(reqs)[0] > 0  # the prior says drafting pays
    for _ in range(20):
        k = p.choose(reqs)
        p.observe(reqs, k, [0])
    assert p._alphas([p.rows["no-match"]])[0, 0] < 0.2
    assert p.choose(reqs)[0] == 0


def test_measured_times_recalibrate_the_cost_model():
    # start-up said a draft token costs a whole target pass: drafting cannot pay
    p = AdaptivePolicy(costs(verify_slope=0.0, draft=1.0), max_k=4)
    alphas = np.array([0.8])
    assert p.best_choice(alphas) == [0]
    for _ in range(40):  # the engine measures drafting at 1/20 of that
        p.observe_costs(1, 5, 1, 4, 4 * 0.05, 1.0)
        p.observe_costs(1, 1, 0, 0, 0.0, 1.0)
    assert p.scale["draft"] < 0.3 and abs(p.scale["plain"] - 1.0) < 1e-9
    assert p.best_choice(alphas)[0] >= 2
    # and back: wide passes turn out to cost 3x what start-up measured
    q = AdaptivePolicy(costs(verify_slope=0.0, draft=0.01), max_k=4)
    alphas = np.array([0.6])
    assert q.best_choice(alphas)[0] > 0
    for _ in range(40):
        q.observe_costs(1, 5, 1, 4, 4 * 0.01, 3.0)
    assert q.best_choice(alphas) == [0]


def test_one_stalled_step_moves_the_model_little():
    p = AdaptivePolicy(costs(), max_k=4)
    p.observe_costs(1, 1, 0, 0, 0.0, 1000.0)  # a 1000x stall (the machine was busy)
    assert p.scale["plain"] == pytest.approx(1.0 + 0.1 * (4.0 - 1.0))


def test_model_free_drafter_settles_k_on_the_drafts_found():
    flat = CostModel.from_total_tokens((1, 64, 1024), (1.0, 1.0, 3.0), (1, 64), (1e-5, 1e-5), draft_free=True)
    p = AdaptivePolicy(flat, max_k=8)
    reqs = [R("a"), R("b"), R("c")]
    assert p.choose(reqs) == [8, 8, 8]  # asking is free
    assert p.trim(reqs, [0, 0, 0]) == [0, 0, 0]
    # a flat pass: every draft found is worth verifying
    assert p.trim(reqs, [5, 0, 2]) == [5, 0, 2]
    # a pass that costs 1.5x per extra token per row: one modest row cannot pay for it
    bp, tp = (1, 3), tuple(range(1, 10))
    steep = CostModel(bp, tp, (tuple(1.0 + 0.5 * (t - 1) for t in tp),) * 2, (1, 3), (1e-5, 1e-5),
                      draft_free=True)
    q = AdaptivePolicy(steep, max_k=8)
    for r in reqs:
        q.choose([r])
        q.rows[r.request_id].assume(0.5)
    assert q.trim(reqs, [4, 0, 0]) == [0, 0, 0]
    for r in reqs:
        q.rows[r.request_id].assume(0.99)
    assert max(q.trim(reqs, [4, 4, 4])) >= 2  # all rows nearly always right: it pays
    # a draft model's drafts are never trimmed: choose() already priced them
    dm = AdaptivePolicy(costs(), max_k=8)
    assert dm.trim(reqs, [3, 1, 0]) == [3, 1, 0]


def test_model_free_drafter_is_not_asked_when_no_draft_could_pay():
    # a pass that costs 1.5x per extra token per row, and a proposal that costs 1% of a
    # pass per token: rows that accept half their drafts could not pay even with max_k
    # found everywhere, so choose() spares the proposal (and asks again for a probe)
    bp, tp = (1, 2), tuple(range(1, 10))
    steep = CostModel(bp, tp, (tuple(1.0 + 0.5 * (t - 1) for t in tp),) * 2, (1, 2), (0.01, 0.01),
                      draft_free=True)
    p = AdaptivePolicy(steep, max_k=8)
    reqs = [R("a"), R("b")]
    for r in reqs:
        p.choose([r])
        p.rows[r.request_id].assume(0.5)
    asked = []
    for _ in range(3 * p.probe_interval(2)):
        k = p.choose(reqs)
        asked.append(max(k))
        p.observe(reqs, p.trim(reqs, [0, 0]) if max(k) else k, [0, 0])
    assert asked[0] == 0
    assert 0 < sum(a > 0 for a in asked) <= 3  # probes only
    # rows that nearly always accept: asking pays every step
    for r in reqs:
        p.rows[r.request_id].assume(0.99)
    assert p.choose(reqs) == [8, 8]
    # and where proposing costs as much as the pass, even perfect drafts cannot pay for it
    dear = CostModel(bp, tp, (tuple(1.0 + 0.01 * (t - 1) for t in tp),) * 2, (1, 2), (1.0, 1.0),
                     draft_free=True)
    q = AdaptivePolicy(dear, max_k=8)
    q.choose(reqs)
    for r in reqs:
        q.rows[r.request_id].assume(0.99)
    assert q.choose(reqs) == [0, 0]


def test_acceptance_is_tracked_per_draft_position():
    # lookup-like rows: the first draft is a coin toss, but a draft that survives it is a
    # copy that goes on. A geometric model (one rate for every position) would price k=8
    # at 1 + 0.5 + 0.25 + ... and stop early; per position, long drafts pay
    bp, tp = (1,), tuple(range(1, 10))
    c = CostModel(bp, tp, (tuple(1.0 + 0.12 * (t - 1) for t in tp),), (1,), (1e-5,))
    p = AdaptivePolicy(c, max_k=8, prior=0.5)
    reqs = [R("copy")]
    rng = np.random.default_rng(0)
    long = 0
    for step in range(100):
        k = p.choose(reqs)
        acc = k[0] if rng.random() < 0.5 else 0  # all or nothing
        p.observe(reqs, k, [acc])
        long += step >= 50 and k[0] >= 6
    a = p._alphas([p.rows["copy"]])[0]
    assert a[0] < 0.6 and a[1:4].min() > 0.7, a
    assert long >= 40, long  # k >= 6 on most steps once learned
    geometric = AdaptivePolicy(c, max_k=8)
    assert geometric.best_choice(np.array([0.5]))[0] <= 2


def test_new_requests_start_from_what_the_drafter_did_lately():
    p = AdaptivePolicy(costs(verify_slope=0.01, draft=0.15), max_k=8)
    assert p.choose([R("first")])[0] > 0  # the prior says drafting pays
    rng = np.random.default_rng(2)
    for i in range(20):  # requests come and go; every one of them rejects
        r = R(f"r{i}")
        feed(p, [r], [0.0], 16, rng)
        r.finished = True
        p.observe([r], [0], [0])
    assert "r0" not in p.rows  # finished rows are forgotten...
    assert p.global_alpha[0] < 0.3  # ...but not what they taught about the drafter
    fresh = R("fresh")
    assert p.choose([fresh]) == [0]  # a new request does not re-learn it from scratch


def test_a_probe_prices_its_draft_token():
    # the same wider pass; a drafter costing half a pass per token makes probing dear
    cheap = AdaptivePolicy(costs(verify_slope=0.0, draft=0.001), max_k=4)
    dear = AdaptivePolicy(costs(verify_slope=0.0, draft=0.5), max_k=4)
    assert cheap.probe_interval(1) == cheap.min_probe
    assert dear.probe_interval(1) >= 0.5 / dear.probe_budget


def halting_costs(draft=0.1, per_row=False):
    return CostModel.from_total_tokens((1, 16, 1024), (1.0, 1.0, 1.0 + 0.02 * 1008), (1, 64),
                                       (draft, (64 if per_row else 2) * draft), halts=True)


def draft_with_halt(policy, reqs, k, confs):
    """Run the halt rule as a drafter would: confs[b][i] is row b's confidence in draft i.
    Returns the drafts per row."""
    num = list(k)
    active = [b for b in range(len(reqs)) if k[b] > 0]
    i = 0
    while active:
        stop = policy.halt(reqs, k, i, active, [confs[b][i] for b in active])
        nxt = []
        for b, s in zip(active, stop):
            if k[b] > i + 1 and not s:
                nxt.append(b)
            else:
                num[b] = i + 1
        active, i = nxt, i + 1
    return num


def test_halt_drafts_on_while_the_drafter_is_confident():
    p = AdaptivePolicy(halting_costs(), max_k=8)
    reqs = [R("a")]
    p._state(reqs[0]).assume(0.8)
    k = p.choose(reqs)
    assert k == [8]  # a cap: halt() decides where each row stops
    assert draft_with_halt(p, reqs, k, [[0.99] * 8]) == [8]
    k = p.choose(reqs)
    assert draft_with_halt(p, reqs, k, [[0.99, 0.99, 0.05] + [0.99] * 5]) == [3]
    k = p.choose(reqs)
    assert draft_with_halt(p, reqs, k, [[0.05] * 8]) == [1]
    # a dear draft token stops sooner on the same confidences
    dear = AdaptivePolicy(halting_costs(draft=0.3), max_k=8)
    dear._state(reqs[0]).assume(0.8)
    k = dear.choose(reqs)
    n_dear = draft_with_halt(dear, reqs, k, [[0.8] * 8])[0]
    k = p.choose(reqs)
    assert 1 <= n_dear < draft_with_halt(p, reqs, k, [[0.8] * 8])[0]


def test_halt_stops_rows_one_by_one():
    # (where a draft pass costs the same for two rows as for one, a doubtful row rides
    # free on the sure row's pass; here each row pays its own draft tokens)
    p = AdaptivePolicy(halting_costs(per_row=True), max_k=8)
    reqs = [R("sure"), R("unsure")]
    for r in reqs:
        p._state(r).assume(0.8)
    k = p.choose(reqs)
    assert k == [8, 8]
    assert draft_with_halt(p, reqs, k, [[0.99] * 8, [0.99, 0.1] + [0.99] * 6]) == [8, 2]


def test_confidence_calibration_learns_an_overconfident_drafter():
    rng = np.random.default_rng(1)
    p = AdaptivePolicy(halting_costs(), max_k=8)
    reqs = [R("a")]
    drafted = []
    for _ in range(150):
        k = p.choose(reqs)
        n = draft_with_halt(p, reqs, k, [[0.96] * 8])
        a = 0
        while a < n[0] and rng.random() < 0.3:  # confident, yet mostly wrong
            a += 1
        p.observe(reqs, n, [a])
        drafted.append(n[0])
    assert p.calibrated([0.96])[0] < 0.45
    # bins never seen follow the fitted curve: overconfident everywhere, still monotone
    unseen = p.calibrated([0.35, 0.55, 0.75])
    assert unseen[1] < 0.5 and unseen[0] <= unseen[1] <= unseen[2], unseen
    assert drafted[0] == 8 and np.mean(drafted[-30:]) < 2.5, drafted


def test_calibration_learns_an_underconfident_drafter_from_few_drafts():
    """A draft model of the target's family: its pick is the target's more often than it
    believes. The logistic curve lifts the bins it has not seen much of as well."""
    rng = np.random.default_rng(2)
    p = AdaptivePolicy(halting_costs(), max_k=8)
    for _ in range(60):
        c = rng.uniform(0.3, 0.9)
        i = np.searchsorted(CONF_EDGES, c, side="right") - 1
        p.cs *= p.conf_keep
        p.cn *= p.conf_keep
        p.cs[i] += rng.random() < min(1.0, c + 0.25)
        p.cn[i] += 1
        p._curve = None
    est = p.calibrated([0.35, 0.55, 0.75])
    assert np.all(est > np.array([0.35, 0.55, 0.75]) + 0.05), est


def test_halt_is_inert_where_the_drafter_cannot_halt():
    p = AdaptivePolicy(costs(verify_slope=0.02, draft=0.1), max_k=8)
    reqs = [R("a")]
    p._state(reqs[0]).assume(0.8)
    k = p.choose(reqs)
    assert 0 < k[0] < 8  # the planned k, not a cap
    assert p.halt(reqs, k, 0, [0], [0.01]) == [False]


def test_halt_weighs_a_draft_against_the_rate_realised():
    """A marginal draft must bring tokens faster than the engine has been emitting them
    (tokens per second measured at this batch size): the slower decoding has been, the
    further a doubtful row drafts on."""
    reqs = [R("a")]
    n = {}
    for realised in (0.5, 100.0):
        p = AdaptivePolicy(halting_costs(), max_k=8)
        p._state(reqs[0]).assume(0.8)
        p.rate_seen[1] = realised
        k = p.choose(reqs)
        n[realised] = draft_with_halt(p, reqs, k, [[0.7] * 8])[0]
    assert n[0.5] == 8 and n[100.0] == 1
    # the engine's step reports feed it: 1 + 3 tokens in 0.5 s at batch 1
    p = AdaptivePolicy(halting_costs(), max_k=8)
    p.observe(reqs, [4], [3])
    p.observe_costs(1, 5, 1, 4, 0.1, 0.4)
    assert p.rate_seen[1] == pytest.approx(8.0)
    p.observe(reqs, [4], [0])
    p.observe_costs(1, 5, 1, 4, 0.1, 0.4)
    # forgotten tokens over forgotten seconds, not an average of the two steps' rates
    assert p.rate_seen[1] == pytest.approx((0.9 * 4 + 1) / (0.9 * 0.5 + 0.5))


def test_measured_pass_times_replace_the_start_up_grid():
    """A start-up grid that made a wider pass look free (a noisy timing): once the engine
    has measured that shape as dear, the policy drafts less there."""
    free = CostModel.from_total_tokens((1, 1024), (1.0, 1.0), (1, 64), (0.05, 0.05), halts=True)
    p = AdaptivePolicy(free, max_k=8)
    reqs = [R("a")]
    p._state(reqs[0]).assume(0.8)
    k = p.choose(reqs)
    assert draft_with_halt(p, reqs, k, [[0.9] * 8]) == [8]
    for T in range(3, 10):  # measured: every column past the second costs two passes
        for _ in range(20):
            p.observe_costs(1, T, 1, T - 1, 0.05 * (T - 1), 1.0 + 2.0 * (T - 2))
    t_pass = p._pass_costs(1)[0]
    assert t_pass[4] == pytest.approx(7.0, rel=0.2) and t_pass[0] == pytest.approx(1.0)
    k = p.choose(reqs)
    assert draft_with_halt(p, reqs, k, [[0.9] * 8])[0] <= 2


def test_one_slow_spell_at_one_shape_is_not_a_wall():
    """A shape measured slow a couple of times (a burst of load) is pooled with its
    neighbours: the cost over tokens per row stays non-decreasing and the bump shrinks."""
    p = AdaptivePolicy(costs(), max_k=8)  # flat: 1.0 s per pass at any width
    for _ in range(2):
        p.observe_costs(1, 3, 1, 2, 0.6, 1.6)  # T = 3 measured slow
    for T in (2, 4, 5):
        for _ in range(5):
            p.observe_costs(1, T, 1, T - 1, 0.3 * (T - 1), 1.0)
    t = p._pass_costs(1)[0]
    assert np.all(np.diff(t) >= 0)
    assert t[2] - t[1] < 0.1  # pooled with the shapes after it


def test_isotonic():
    from verispec.policy.adaptive import _isotonic
    assert list(_isotonic([1, 3, 2, 4], [1, 1, 1, 1])) == [1, 2.5, 2.5, 4]
    assert list(_isotonic([1, 2, 3], [1, 1, 1])) == [1, 2, 3]


def test_a_settled_plan_is_reused_but_never_stale():
    # planning runs with caches cold after every target pass (~0.3 ms a step measured):
    # a policy that has settled reuses its plan while nothing it rests on moved
    p = AdaptivePolicy(costs(draft=1.0), max_k=4)  # a draft costs a whole pass: k = 0
    planned = []
    inner = p._plan
    p._plan = lambda a: planned.append(1) or inner(a)
    reqs = [R("a")]
    for _ in range(10):
        assert p.choose(reqs) == [0]
        p.observe(reqs, [0], [0])
    assert len(planned) == 1
    # the cost model moves (drafting measured at 1/20 of start-up): replanned within
    # replan_every steps, and then the policy drafts
    for _ in range(40):
        p.observe_costs(1, 5, 1, 4, 4 * 0.05, 1.0)
    ks = []
    for _ in range(p.replan_every + 1):
        ks.append(p.choose(reqs)[0])
        p.observe(reqs, [0], [0])
    assert ks[-1] > 0
    # a new request, or a row's record changing, replans at once
    q = AdaptivePolicy(costs(verify_slope=0.1, draft=0.001, flat_until=1), max_k=8)
    a = [R("x")]
    q.choose(a)
    q.rows["x"].assume(0.0)
    assert q.choose(a) == [0]
    q.rows["x"].assume(0.95)
    assert q.choose(a)[0] > 0
    assert q.choose([R("x"), R("y")])[1] > 0  # a new row starts from the drafter's figures


class _Confident:
    """A drafter as the policy sees it: model-free, with its own acceptance estimates."""

    estimates_acceptance = True


def test_a_confident_model_free_drafter_drafts_where_its_estimates_pay():
    # a pass that costs 0.75 of a decode per extra token (a 2-core CPU): only drafts that
    # are nearly always right can pay, and a row's record cannot tell which those are
    bp, tp = (1, 2), tuple(range(1, 10))
    steep = CostModel(bp, tp, (tuple(1.0 + 0.75 * (t - 1) for t in tp),) * 2, (1, 2), (1e-5, 1e-5),
                      draft_free=True)
    p = AdaptivePolicy(steep, max_k=8)
    one, two = [R("a")], [R("a"), R("b")]
    assert p.choose(one) == [0]  # without estimates: a prior that cannot pay, so never asked
    p.bind_drafter(_Confident())
    assert p.choose(one) == [8]  # with them: asked every step
    kept = p.trim(one, [6], [[0.97] * 6])
    assert 2 <= kept[0] <= 6  # a copy the trie is sure of pays
    p.observe(one, kept, kept)
    p.choose(one)
    assert p.trim(one, [6], [[0.3] * 6]) == [0]  # a guess does not
    # a pass widened for one row of two costs both: one sure row cannot pay for it here
    p.choose(two)
    assert p.trim(two, [6, 0], [[0.97] * 6, []]) == [0, 0]
    p.choose(two)
    assert min(p.trim(two, [6, 6], [[0.97] * 6, [0.97] * 6])) >= 2


def test_the_calibration_overrules_an_overconfident_drafter():
    bp, tp = (1,), tuple(range(1, 10))
    steep = CostModel(bp, tp, (tuple(1.0 + 0.75 * (t - 1) for t in tp),), (1,), (1e-5,), draft_free=True)
    p = AdaptivePolicy(steep, max_k=8)
    p.bind_drafter(_Confident())
    reqs = [R("a")]
    drafted = []
    for _ in range(60):  # it says 0.97 and the target accepts none of it
        p.choose(reqs)
        kept = p.trim(reqs, [6], [[0.97] * 6])
        drafted.append(kept[0])
        p.observe(reqs, kept, [0])
    assert drafted[0] > 0 and sum(drafted[-20:]) == 0


def test_estimates_are_ignored_from_a_drafter_not_bound_as_confident():
    flat = CostModel.from_total_tokens((1, 64, 1024), (1.0, 1.0, 3.0), (1, 64), (1e-5, 1e-5), draft_free=True)
    p = AdaptivePolicy(flat, max_k=8)
    reqs = [R("a")]
    p.choose(reqs)
    assert p.trim(reqs, [5], [[0.01] * 5]) == [5]  # a flat pass: everything found is verified
