"""`verispec audit --endpoint` (audit/endpoint/runner.py) against a live tiny verispec
server: the same report files as the offline audit; it passes a correct server and fails
one whose answers differ from the reference."""

import json

import pytest

import verispec

from tests.endpoint import audit_parser
from tests.server.helpers import LiveServer, make_state
from verispec.audit.endpoint.runner import cmd_endpoint_audit

SUITE = [{"id": f"s{i}", "slice": ("letters", "words", "mixed")[i % 3], "prompt": p} for i, p in enumerate(
    ["hello there", "abc abc abc abc", "the quick brown fox", "zz", "one, two, three", "lorem ipsum dolor",
     "q", "xyzzy plugh"])]


def _args(tmp_path, *argv):
    suite = tmp_path / "suite.jsonl"
    suite.write_text("\n".join(json.dumps(r) for r in SUITE) + "\n")
    return audit_parser().parse_args(["--suite", str(suite), "--out", str(tmp_path / "report"), "--raw",
                         "--max-tokens", "12", "--concurrency", "1,4", *argv])


@pytest.fixture(scope="module")
def servers():
    with LiveServer(make_state(drafter="draft", k=3, max_batch=4)) as good, \
            LiveServer(make_state(drafter=None, model="draft")) as other:
        yield good, other


def test_endpoint_audit_writes_the_offline_report_files(servers, tmp_path):
    good, _ = servers
    assert cmd_endpoint_audit(_args(tmp_path, "--endpoint", good.url + "/v1")) == 0
    out = tmp_path / "report"
    assert {p.name for p in out.iterdir()} >= {"report.json", "report.md", "report.html"}
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "pass"
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) >= {"lossy-rule", "equivalence", "corruption", "slices", "load", "record"}
    eq = checks["equivalence"]["figures"]
    assert eq["exact_match_by_batch"] == {"1": 1.0, "4": 1.0}
    assert eq["reference"] == "the same verispec server with speculation off"
    sl = checks["slices"]["figures"]
    assert sl["pooled_mean_accepted_length"] > 1.0 and 0 < sl["pooled_acceptance_rate"] < 1
    assert [p["batch"] for p in checks["load"]["details"]["points"]["short"]] == [1, 4]
    rec = report["record"]
    assert rec["endpoint"]["kind"] == "verispec" and rec["server"]["version"] == verispec.__version__
    # the record is what the server said, not a default: this server drafts with "draft", fixed k = 3
    assert (rec["drafter"]["name"], rec["drafter"]["k"], rec["drafter"]["policy"], rec["rule"]) == (
        "draft", 3, "fixed", "rejection")
    assert rec["seed"] != 0 and rec["sampling"]["temperature"] == 0.0
    # the null baseline (the server with speculation off, against itself) sits beside the figures
    assert eq["null_exact_match_by_batch"] == {"1": 1.0, "4": 1.0} and eq["null_divergences"] == 0
    assert "null baseline" in (out / "report.md").read_text()
    assert "verispec audit: PASS" in (out / "report.md").read_text()
    assert "data:image/png;base64" in (out / "report.html").read_text()


def test_endpoint_audit_fails_a_server_that_answers_differently(servers, tmp_path):
    good, other = servers
    # the "reference" serves other weights: the endpoint's answers differ from it, and no logprobs
    # tell a near-tie apart, so the audit must fail equivalence
    rc = cmd_endpoint_audit(_args(tmp_path, "--endpoint", good.url, "--reference-endpoint", other.url,
                                  "--concurrency", "2"))
    assert rc == 1
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert "equivalence" in report["failed_checks"]
    eq = next(c for c in report["checks"] if c["name"] == "equivalence")
    assert eq["figures"]["divergences"] > 0
    # against a null of no divergence at all, most prompts diverging fails the count test
    assert "Fisher" in eq["summary"] and eq["figures"]["null_divergences"] == 0


@pytest.mark.parametrize("argv", [["--sampled-tokens", "-1"], ["--null-repeats", "0"], ["--concurrency", "0"],
                                  ["--null-repeats", "x"]])
def test_bad_endpoint_options_are_usage_errors(tmp_path, argv):
    with pytest.raises(SystemExit):
        _args(tmp_path, "--endpoint", "http://127.0.0.1:9", *argv)
