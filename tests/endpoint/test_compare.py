"""--compare-to: a re-test gate between two endpoint audits (audit/endpoint/compare.py)."""

import copy
import json

import pytest

from tests.endpoint import audit_parser
from tests.server.helpers import LiveServer, make_state
from verispec.audit.endpoint.compare import CompareError, compare_reports, load_report
from verispec.audit.endpoint.runner import EndpointAuditConfig, cmd_endpoint_audit, run_endpoint_audit
from verispec.audit.suite import SuitePrompt

PROMPTS = [SuitePrompt(f"s{i}", ("a", "b")[i % 2], t) for i, t in enumerate(
    ["abc abc abc abc", "hello there hello", "the quick brown fox", "one, two, three", "lorem ipsum dolor",
     "xyzzy plugh xyzzy", "zz zz zz", "q r s t"])]


def _audit(url, previous=None):
    return run_endpoint_audit(EndpointAuditConfig(url, chat=False, max_tokens=16, concurrency=(1, 4),
                                                  previous=previous), PROMPTS)


@pytest.fixture(scope="module")
def reports():
    with LiveServer(make_state(drafter="draft", k=3, max_batch=4)) as k3, \
            LiveServer(make_state(drafter="draft", k=1, max_batch=4)) as k1, \
            LiveServer(make_state(drafter="lookup", k=3, max_batch=4)) as lookup:
        first = _audit(k3.url)
        yield {"first": first, "again": _audit(k3.url, previous=first), "k1": _audit(k1.url, previous=first),
               "lookup": _audit(lookup.url, previous=first)}


def _cmp(report):
    return next(c for c in report["checks"] if c["name"] == "compare")


def test_nothing_changed_passes(reports):
    c = _cmp(reports["again"])
    assert c["passed"], c["summary"]
    assert c["figures"]["triggers_changed"] == [] and "triggers changed: none" in c["summary"]
    assert reports["again"]["verdict"] == "pass"


def test_a_k_change_shows_the_trigger_and_the_moved_figures(reports):
    c = _cmp(reports["k1"])
    changed = {t["key"]: (t["old"], t["new"]) for t in c["figures"]["triggers_changed"]}
    assert changed == {"k": (3, 1)}
    lv = {r["batch"]: r for r in c["details"]["levels"]}
    acc = lv[1]["acceptance"]
    assert acc["old"]["n"] == acc["new"]["n"] == len(PROMPTS)
    assert acc["old"]["value"] != acc["new"]["value"] and acc["low"] is not None
    assert {s["slice"] for s in c["details"]["slices"]} == {"a", "b"}
    titles = [t[0] for t in c["details"]["tables"]]
    assert any("triggers that changed" in t for t in titles) and any("speedup and acceptance" in t for t in titles)


def test_a_drafter_change_shows_the_trigger(reports):
    c = _cmp(reports["lookup"])
    changed = {t["key"]: (t["old"], t["new"]) for t in c["figures"]["triggers_changed"]}
    assert changed["drafter"] == ("draft", "lookup")


def test_gate_fails_on_a_speedup_drop_and_on_worse_equivalence(reports):
    old = reports["first"]
    slow = copy.deepcopy(reports["again"])
    for lv in slow["endpoint_runs"]["endpoint"]["levels"]:
        for r in lv["results"]:
            r["latency_s"] *= 3  # the same answers, three times slower
    cmp = compare_reports(old, slow, "equivalence")
    assert not cmp["passed"] and any("speedup fell" in f for f in cmp["failures"])
    worse = copy.deepcopy(reports["again"])
    eq = next(c for c in worse["checks"] if c["name"] == "equivalence")
    eq["passed"] = False
    for r in eq["details"]["per_batch"]:
        r["identical"] = 0
    cmp = compare_reports(old, worse, "equivalence")
    assert "equivalence passed before and fails now" in cmp["failures"]
    assert any("divergences rose" in f for f in cmp["failures"])


def test_cli_exit_status_and_bad_old_report(reports, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "report.json").write_text(json.dumps(reports["first"]))
    with pytest.raises(CompareError, match="not the report of an endpoint audit"):
        (tmp_path / "x.json").write_text("{}")
        load_report(tmp_path / "x.json")
    with pytest.raises(CompareError, match="does not exist"):
        load_report(tmp_path / "nope")
    suite = tmp_path / "suite.jsonl"
    suite.write_text("\n".join(json.dumps({"id": p.id, "slice": p.slice, "prompt": p.prompt}) for p in PROMPTS))
    p = audit_parser()
    assert cmd_endpoint_audit(p.parse_args(["--suite", str(suite), "--out", str(tmp_path / "r"), "--endpoint",
                                            "http://127.0.0.1:9", "--compare-to", str(tmp_path / "x.json")])) == 2
    with LiveServer(make_state(drafter="draft", k=2, max_batch=4)) as k2:
        rc = cmd_endpoint_audit(p.parse_args(["--suite", str(suite), "--out", str(tmp_path / "r"), "--raw",
                                              "--endpoint", k2.url, "--compare-to", str(old), "--max-tokens", "16",
                                              "--concurrency", "1,4", "--sampled-tokens", "0"]))
    new = json.loads((tmp_path / "r" / "report.json").read_text())
    c = _cmp(new)
    assert [t["key"] for t in c["figures"]["triggers_changed"]] == ["k"]
    assert rc == (0 if new["verdict"] == "pass" else 1)
    assert "Compared with the earlier audit" in (tmp_path / "r" / "report.md").read_text()
