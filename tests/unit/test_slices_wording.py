"""The slices' summary and headline name a best and a worst slice only among the resolved
ones: one resolved slice is named once, none resolved is said so (audit/speed.ranking_text)."""

from verispec.audit.checks import CheckResult
from verispec.audit.registry import SLICES
from verispec.audit.speed import ranking_text


def _row(name, verdict, speedup=1.57):
    return {"slice": name, "verdict": verdict, "speedup": speedup, "speedup_text": f"{speedup:.2f}x"}


def _headline(rows, best, worst):
    c = CheckResult(True, "", {"best_slice": best, "worst_slice": worst, "pooled_mean_accepted_length": 2.0,
                               "noise_slices": [], "unresolved_slices": [r["slice"] for r in rows
                                                                         if r["verdict"] == "unresolved"]},
                    {"slices": rows, "pooled": {"speedup_text": "1.40x"}}, True)
    return SLICES.headline(c)[0][1]


def test_one_resolved_slice_is_named_once():
    rows = [_row("code", "faster"), _row("chat", "unresolved", 1.1)]
    assert ranking_text(rows, "code", "code") == "1 slice resolved: code 1.57x"
    text = _headline(rows, "code", "code")
    assert "1 slice resolved: code" in text and "best" not in text and "worst" not in text


def test_no_resolved_slice_is_said_so():
    rows = [_row("code", "unresolved"), _row("chat", "noise", 1.1)]
    assert ranking_text(rows, None, None) == "no slice resolved"
    assert "no slice resolved" in _headline(rows, None, None)


def test_two_resolved_slices_name_best_and_worst():
    rows = [_row("code", "faster"), _row("chat", "slower", 0.9)]
    assert ranking_text(rows, "code", "chat") == "best code 1.57x, worst chat 0.90x"
    assert "best code, worst chat" in _headline(rows, "code", "chat")


def test_without_timed_speedups_the_slices_rank_by_acceptance():
    rows = [{"slice": "code", "verdict": None, "speedup": None, "speedup_text": "n/a"}]
    assert ranking_text(rows, "code", "code") == "1 slice ranked: code"
