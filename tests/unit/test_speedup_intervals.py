"""Speedups with intervals (audit/stats.py): the paired interval, what acceptance predicts,
the verdict, and how the slices and load checks turn pairs into a row (audit/speed.py)."""

import math

import pytest

from verispec.audit.speed import interval_figures, predicted_from_costs, verdict_counts
from verispec.audit.stats import Speedup, judge_speedup, predicted_speedup, speedup_interval, speedup_text
from verispec.policy.costs import CostModel


def test_interval_is_the_geometric_mean_with_a_t_interval_on_the_log_ratios():
    plain = [2.0, 3.0, 2.2, 2.6]
    spec = [1.0, 2.0, 1.0, 2.0]
    sp = speedup_interval(plain, spec)
    logs = [math.log(p / s) for p, s in zip(plain, spec)]
    m = sum(logs) / 4
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 3)
    half = 3.182446305284263 * sd / 2  # t(0.975, 3) * sd / sqrt(4)
    assert sp.pairs == 4 and sp.estimate == pytest.approx(math.exp(m))
    assert sp.low == pytest.approx(math.exp(m - half)) and sp.high == pytest.approx(math.exp(m + half))
    assert sp.low < sp.estimate < sp.high


def test_pairs_that_agree_give_a_tight_interval_and_unusable_pairs_are_dropped():
    sp = speedup_interval([2.0, 2.0, 2.0, None, 1.0], [1.0, 1.0, 1.0, 1.0, 0.0])
    assert sp.pairs == 3 and sp.estimate == pytest.approx(2.0)
    assert sp.low == pytest.approx(2.0) and sp.high == pytest.approx(2.0)
    assert speedup_interval([None, 1.0], [1.0, 0.0]) is None


def test_one_pair_resolves_nothing():
    sp = speedup_interval([1.5], [1.0])
    assert (sp.estimate, sp.low, sp.high, sp.pairs) == (pytest.approx(1.5), 0.0, math.inf, 1)
    assert judge_speedup(sp, 3.0) == "unresolved"
    assert "no interval: 1 pair" in speedup_text(sp, "unresolved")


def test_prediction_from_tokens_per_pass_and_costs():
    # 2.5 tokens for a pass of 12 ms and 3 ms of drafting, against 10 ms per plain token
    assert predicted_speedup(2.5, 0.010, 0.012, 0.003) == pytest.approx(2.5 * 10 / 15)
    assert predicted_speedup(1.8) == 1.8  # no costs: tokens per pass is the upper bound
    # a pass timed cheaper than a decode is noise in the timings: still tokens per pass at most
    assert predicted_speedup(1.0046, 0.0100, 0.0097) == pytest.approx(1.0046)
    assert predicted_speedup(1.5, 0.0100, 0.0050, 0.0010) == pytest.approx(1.5)
    assert predicted_speedup(None, 0.01, 0.01) is None


def _costs(draft_free: bool) -> CostModel:
    # a pass costs 10 ms + 1 ms per row-token; a draft token 2 ms (at any number of rows)
    return CostModel((1, 2, 4), (1, 2, 3, 5), tuple(tuple(0.010 + 0.001 * b * t for t in (1, 2, 3, 5))
                                                    for b in (1, 2, 4)),
                     (1, 4), (0.002, 0.002), draft_free=draft_free)


def test_prediction_from_the_cost_model_charges_drafting_unless_the_drafter_is_free():
    # batch 1, 2 drafts per step: pass 13 ms, plain 11 ms; a draft model adds 2 x 2 ms
    assert predicted_from_costs(_costs(False), 1, 2.0, 2.0) == pytest.approx(2.0 * 0.011 / (0.013 + 0.004))
    assert predicted_from_costs(_costs(True), 1, 2.0, 2.0) == pytest.approx(2.0 * 0.011 / 0.013)
    # batch 4: plain 14 ms, a 3-token pass 22 ms
    assert predicted_from_costs(_costs(True), 4, 1.5, 2.0) == pytest.approx(1.5 * 0.014 / 0.022)
    assert predicted_from_costs(_costs(True), 1, None, 2.0) is None


def test_a_speedup_acceptance_cannot_explain_is_noise():
    """The report a user saw: 1.20x at 1.02 tokens per target pass. Even a tight interval
    above 1 is no win when acceptance predicts at most 1.02x."""
    sp = Speedup(1.20, 1.10, 1.31, 32)
    assert judge_speedup(sp, predicted_speedup(1.02)) == "noise"
    text = speedup_text(sp, "noise", 1.02)
    assert text.startswith("noise: 1.20x [1.10, 1.31]") and "predicts 1.02x at most" in text
    # the same timing with acceptance that explains it is a win
    assert judge_speedup(sp, predicted_speedup(2.1)) == "faster"
    # unknown acceptance cannot be called noise
    assert judge_speedup(sp, None) == "faster"


@pytest.mark.parametrize("sp, predicted, verdict", [
    (Speedup(0.80, 0.75, 0.86, 16), 1.5, "slower"),
    (Speedup(1.01, 0.99, 1.03, 40), 1.3, "even"),  # narrow, holds 1
    (Speedup(1.10, 0.85, 1.42, 4), 1.8, "unresolved"),  # holds 1, too wide to say
    (Speedup(1.04, 0.90, 1.20, 4), 1.02, "unresolved"),  # within tolerance of what acceptance allows
    (Speedup(1.50, 1.30, 1.70, 8), 1.9, "faster"),
    (None, 1.5, "unresolved"),
])
def test_verdicts(sp, predicted, verdict):
    assert judge_speedup(sp, predicted) == verdict


def test_a_row_carries_its_interval_prediction_and_verdict():
    sp = speedup_interval([1.2, 1.25, 1.18, 1.3], [1.0, 1.0, 1.0, 1.02])
    row = interval_figures(sp, predicted_speedup(1.02))
    assert row["verdict"] == "noise" and row["pairs"] == 4 and row["predicted"] == 1.02
    assert row["speedup"] == pytest.approx(sp.estimate)
    assert row["speedup_ci"] == [pytest.approx(sp.low), pytest.approx(sp.high)] and sp.low > 1.1
    assert row["speedup_text"].startswith("noise: ")
    unknown = interval_figures(sp, None)
    assert unknown["verdict"] == "faster" and "acceptance unknown" in unknown["speedup_text"]
    none = interval_figures(None, 2.0)
    assert none["verdict"] is None and none["speedup_ci"] is None and none["speedup_text"] == "not measured"
    one = interval_figures(speedup_interval([1.2], [1.0]), 2.0)
    assert one["speedup_ci"] is None and one["verdict"] == "unresolved" and one["pairs"] == 1
    rows = [{"verdict": v} for v in ("noise", "faster", "unresolved", "noise", None)]
    assert verdict_counts(rows).startswith("2 noise") and verdict_counts(rows).endswith("1 not resolved at this budget")
    assert verdict_counts([{"verdict": "even"}]) == ""


def test_speed_repeats_sizes_and_option():
    import dataclasses

    from verispec.audit.context import AuditSizes
    from verispec.cli import build_parser
    from verispec.cli.audit import config_from_args

    assert AuditSizes.quick().speed_repeats == 3 and AuditSizes.full().speed_repeats == 4

    def sizes(*argv):
        return config_from_args(build_parser().parse_args(["audit", *argv])).sizes
    assert sizes("--quick") == AuditSizes.quick() and sizes() == AuditSizes.full()
    assert sizes("--quick", "--speed-repeats", "5") == dataclasses.replace(AuditSizes.quick(), speed_repeats=5)
    with pytest.raises(ValueError, match="positive"):
        dataclasses.replace(AuditSizes.quick(), speed_repeats=0)
