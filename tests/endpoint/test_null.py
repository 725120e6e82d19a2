"""The null baseline's verdict (audit/endpoint/null.py) on hand-made comparisons: divergence
at the null's margins is numerics, more divergence than the null or divergence beyond its
margins fails, and failed requests make a level inconclusive."""

import pytest

from verispec.audit.endpoint.client import PromptResult
from verispec.audit.endpoint.null import Comparison, compare, exceedance_p, margin_at, verdict
from verispec.audit.stats import fisher_greater


def _cmp(c, n, margins=(), unknown=0, errors=0):
    """n prompts at level c: one divergence per margin given (plus `unknown` without one)."""
    rows = []
    for i in range(n):
        if i < len(margins):
            rows.append({"id": f"p{i}", "slice": "s", "exact": False, "first_divergence": 3, "margin": margins[i],
                         "error": None})
        elif i < len(margins) + unknown:
            rows.append({"id": f"p{i}", "slice": "s", "exact": False, "first_divergence": 3, "margin": None,
                         "error": None})
        elif i < len(margins) + unknown + errors:
            rows.append({"id": f"p{i}", "slice": "s", "exact": False, "first_divergence": None, "margin": None,
                         "error": "HTTP 500: boom"})
        else:
            rows.append({"id": f"p{i}", "slice": "s", "exact": True, "first_divergence": None, "margin": None,
                         "error": None})
    return Comparison(c, rows)


def test_divergence_inside_the_null_is_numerics():
    # the llama.cpp figures: the plain server against itself diverged twice at c=8 (0.043, 0.056)
    nulls = {1: _cmp(1, 16), 8: _cmp(8, 16, [0.043, 0.056])}
    tests = [_cmp(1, 16, [0.02]), _cmp(8, 16, [0.05, 0.03])]
    v = verdict(tests, nulls)
    assert v["failures"] == [] and v["null_max_margin"] == 0.056
    assert [r["passed"] for r in v["per_level"]] == [True, True]
    assert [r["verdict"] for r in tests[1].rows[:2]] == ["near-tie", "near-tie"]


def test_more_divergence_than_the_null_fails_by_fisher():
    nulls = {1: _cmp(1, 16), 8: _cmp(8, 16, [0.043, 0.056])}
    tests = [_cmp(1, 16), _cmp(8, 16, [0.01] * 11)]  # 11/16 against the null's 2/16, all at small margins
    v = verdict(tests, nulls)
    assert v["per_level"][0]["passed"] and not v["per_level"][1]["passed"]
    assert v["per_level"][1]["fisher_p"] < 0.0025
    assert "Fisher" in v["failures"][0] and v["failures"][0].startswith("c=8")


def test_margins_beyond_the_null_fail_by_exceedance():
    nulls = {1: _cmp(1, 16, [0.01, 0.02]), 8: _cmp(8, 16, [0.03, 0.05])}
    tests = [_cmp(1, 16), _cmp(8, 16, [0.9, 1.4, 2.0, 3.1, 0.7, 0.8, 1.1, 2.2])]  # 8/16 vs 2/16: Fisher passes
    v = verdict(tests, nulls)
    row = v["per_level"][1]
    assert row["fisher_p"] > row["alpha"]
    assert row["beyond_null"] == 8 and row["margin_p"] == pytest.approx(1 / 495)  # C(8,8)/C(12,8)
    assert not row["passed"] and "exceedance" in v["failures"][0]


def test_exceedance_and_fisher_are_exact():
    assert exceedance_p(0, 3, 4) == 1.0 and exceedance_p(2, 2, 0) == 1.0  # no null divergence: no evidence
    assert exceedance_p(1, 1, 1) == 0.5
    assert exceedance_p(2, 3, 2) == pytest.approx(3 / 10)
    assert fisher_greater(0, 16, 0, 16) == 1.0
    assert fisher_greater(16, 16, 0, 16) == pytest.approx(1 / 601080390)  # 1 / C(32, 16)
    assert fisher_greater(3, 16, 0, 0) == 1.0


def test_failed_requests_are_inconclusive_and_unknown_margins_count():
    nulls = {1: _cmp(1, 8)}
    v = verdict([_cmp(1, 8, errors=1)], nulls)
    assert not v["per_level"][0]["passed"] and "inconclusive" in v["failures"][0]
    v = verdict([_cmp(1, 8, unknown=8)], {1: _cmp(1, 8)})  # no logprobs: all 8 diverge, margins unknown
    assert not v["per_level"][0]["passed"] and "Fisher" in v["failures"][0]
    # a level with no null of its own is judged against the pooled null, and says so
    v = verdict([_cmp(4, 8)], {1: _cmp(1, 8)})
    assert v["per_level"][0]["null_source"] == "pooled over levels" and v["per_level"][0]["passed"]


def test_compare_and_margin_at():
    ref = PromptResult("a", "s", text="Hello world", tokens=["Hello", " wor", "ld"], token_logprobs=[-1, -1, -1],
                       top2_margins=[2.0, 0.01, 3.0], finish_reason="length")
    same = PromptResult("a", "s", text="Hello world", finish_reason="length")
    other = PromptResult("a", "s", text="Hello worms", finish_reason="length")
    broken = PromptResult("a", "s", error="ReadError: connection reset")
    assert margin_at(ref, 6) == 0.01 and margin_at(ref, 9) == 3.0 and margin_at(ref, 99) is None
    rows = compare([ref], [other], 2).rows
    assert rows[0]["first_divergence"] == 9 and rows[0]["margin"] == 3.0 and not rows[0]["exact"]
    assert compare([ref], [same], 1).rows[0]["exact"]
    assert compare([ref], [broken], 1).rows[0]["error"].startswith("ReadError")
    with pytest.raises(ValueError, match="order"):
        compare([ref], [PromptResult("b", "s", text="x")], 1)


def test_the_margin_is_read_at_the_first_token_that_differs():
    """Two answers that list their tokens: the choice was at the first token that differs
    (" met" + "re" against " meter"), where the reference may have been torn, not at the
    token holding the first differing character ("re", where it was sure)."""
    ref = PromptResult("a", "s", text="800 metre road", tokens=["800", " met", "re", " road"],
                       token_logprobs=[-1] * 4, top2_margins=[5.0, 0.2, 9.6, 4.0], finish_reason="length")
    other = PromptResult("a", "s", text="800 meter road", tokens=["800", " meter", " road"],
                         token_logprobs=[-1] * 3, top2_margins=[5.0, 0.2, 4.0], finish_reason="length")
    row = compare([ref], [other], 1).rows[0]
    assert row["first_divergence"] == 7 and row["margin"] == 0.2
    no_tokens = PromptResult("a", "s", text="800 meter road", finish_reason="length")
    assert compare([ref], [no_tokens], 1).rows[0]["margin"] == 9.6  # without them: the character's token
