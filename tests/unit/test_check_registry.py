"""The audit's checks are one registry (audit/checks.py, audit/registry.py): both audits run
what is registered for their mode, in registry order, and the report renders every result
through the check that made it. A toy check, registered here and nowhere else, runs in the
offline audit and from outside and shows up in report.json, report.md and report.html."""

from __future__ import annotations

import json

import pytest

from tests.audit_tiny import TINY_SIZES, one_thread, tiny_audit, tiny_models
from tests.server.helpers import LiveServer, make_state
from verispec.audit import checks
from verispec.audit.checks import ENDPOINT, ENGINE, Check, CheckResult, register, unregister
from verispec.audit.endpoint.runner import EndpointAuditConfig, run_endpoint_audit
from verispec.audit.report import write_reports
from verispec.audit.suite import SuitePrompt

TOY = "toy-prompt-count"


def _engine(a) -> CheckResult:
    n = len(a.ctx.prompt_ids)
    return CheckResult(n > 0, f"{n} prompts audited (toy)", {"prompts": n, "mode": ENGINE})


def _endpoint(a) -> CheckResult:
    n = len(a.prompts)
    return CheckResult(n > 0, f"{n} prompts audited (toy)", {"prompts": n, "mode": ENDPOINT})


TOY_CHECK = Check(TOY, engine=_engine, endpoint=_endpoint,
                  headline=lambda r: [("Toy headline", f"{r.figures['prompts']} prompts, {r.figures['mode']}")],
                  sections=lambda r: [("Toy section", ["mode", "prompts"], [[r.figures["mode"], r.figures["prompts"]]])],
                  drafts_verified=lambda r: 0,
                  plot=("toy", "Toy plot", lambda plt, r: plt.subplots(figsize=(2, 2))[0]))


@pytest.fixture
def toy():
    register(TOY_CHECK)
    try:
        yield TOY_CHECK
    finally:
        unregister(TOY)


def _seen_everywhere(report: dict, out, mode: str) -> None:
    paths = write_reports(report, out)
    doc = json.loads(paths["json"].read_text())
    names = [c["name"] for c in doc["checks"]]
    assert TOY in names and names[-1] == "record" and names.index(TOY) == len(names) - 2  # before record
    md, html = paths["md"].read_text(), paths["html"].read_text()
    for text in (md, html):
        assert TOY in text and "prompts audited (toy)" in text  # the checks table
        assert "Toy headline" in text and "Toy section" in text and mode in text  # its own renderers
    assert "id='plot-toy'" in html and "Toy plot" in html  # and its plot


def test_the_built_in_checks_are_one_list_in_report_order():
    names = [c.name for c in checks.REGISTRY]
    assert names == ["lossy-rule", "equivalence", "distribution", "acceptance-calibration", "counter-fidelity",
                     "sampling-params", "logprob-fidelity", "seeded", "stopping", "drafter-consistency",
                     "corruption", "slices", "speedup-floor", "load", "record", "compare"]
    assert checks.selectable(ENDPOINT) == ("equivalence", "distribution", "acceptance-calibration", "counter-fidelity",
                                           "sampling-params", "logprob-fidelity", "seeded", "stopping", "corruption",
                                           "slices", "speedup-floor", "load")
    # the re-test gate is the endpoint's; the four checks of what only a server shows run from outside only
    outside_only = {"acceptance-calibration", "counter-fidelity", "sampling-params", "logprob-fidelity", "compare"}
    assert [c.name for c in checks.checks_for(ENGINE)] == [n for n in names if n not in outside_only]
    with pytest.raises(ValueError, match="already registered"):
        register(Check("equivalence"))


def test_a_toy_check_runs_offline_and_appears_in_every_report_format(toy, tmp_path):
    sizes = TINY_SIZES.__class__(**{**TINY_SIZES.__dict__, "name": "toy", "distribution_tokens": 200,
                                    "probe_tokens": 0})
    with one_thread():
        result = tiny_audit(tiny_models(), sizes=sizes, batch_sizes=(1, 4))
    toy_result = next(c for c in result.checks if c.name == TOY)
    assert toy_result.passed and toy_result.figures == {"prompts": 12, "mode": ENGINE}
    _seen_everywhere(result.to_dict(), tmp_path, ENGINE)


def test_a_toy_check_runs_from_outside_and_appears_in_every_report_format(toy, tmp_path):
    prompts = [SuitePrompt(f"p{i}", "s", t) for i, t in enumerate(["abc abc abc", "hello there", "1 2 3 4"])]
    with LiveServer(make_state(drafter="draft", k=3)) as s:
        report = run_endpoint_audit(EndpointAuditConfig(s.url, chat=False, max_tokens=8, concurrency=(2,)), prompts)
    got = next(c for c in report["checks"] if c["name"] == TOY)
    assert got["passed"] and got["figures"] == {"prompts": 3, "mode": ENDPOINT}
    _seen_everywhere(report, tmp_path, ENDPOINT)


# -- a check whose code raises: an error in the report, the rest of the audit unharmed ----------
BROKEN = "broken-on-purpose"


def _raise(a):
    raise RuntimeError("this check breaks on purpose")


@pytest.fixture
def broken():
    check = register(Check(BROKEN, engine=_raise, endpoint=_raise), before=checks.find("equivalence"))
    try:
        yield check
    finally:
        unregister(BROKEN)


def _error_reported(report: dict, mode: str, out) -> None:
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name[BROKEN]["status"] == "error" and "breaks on purpose" in by_name[BROKEN]["summary"]
    assert report["verdict"] == "fail" and BROKEN in report["failed_checks"]
    # every other check of the mode ran and reported after it (none is skipped by the error)
    expected = [c.name for c in checks.checks_for(mode) if c.name not in (BROKEN, "compare", "lossy-rule")]
    assert all(n in by_name for n in expected), set(expected) - set(by_name)
    assert all(by_name[n]["status"] != "error" for n in expected), {n: by_name[n]["summary"] for n in expected}
    paths = write_reports(report, out)
    assert "ERROR" in paths["md"].read_text() and "ERROR" in paths["html"].read_text()


def test_a_check_that_raises_is_an_error_and_the_offline_audit_goes_on(broken, tmp_path):
    sizes = TINY_SIZES.__class__(**{**TINY_SIZES.__dict__, "name": "toy", "distribution_tokens": 200,
                                    "probe_tokens": 0})
    with one_thread():
        result = tiny_audit(tiny_models(), sizes=sizes, batch_sizes=(1, 4))
    _error_reported(result.to_dict(), ENGINE, tmp_path)


def test_a_check_that_raises_is_an_error_and_the_endpoint_audit_goes_on(broken, tmp_path):
    from tests.endpoint import audit_parser
    from verispec.audit.endpoint.runner import cmd_endpoint_audit
    suite = tmp_path / "suite.jsonl"
    suite.write_text("\n".join(json.dumps({"id": f"p{i}", "slice": "s", "prompt": t})
                               for i, t in enumerate(["abc abc abc", "hello there", "1 2 3 4"])))
    with LiveServer(make_state(drafter="draft", k=3)) as s:
        args = audit_parser().parse_args(["--endpoint", s.url, "--suite", str(suite), "--out", str(tmp_path / "r"),
                                          "--raw", "--max-tokens", "8", "--concurrency", "2",
                                          "--sampled-tokens", "200", "--min-verified-drafts", "0"])
        assert cmd_endpoint_audit(args) == 1  # the exit status of a failed audit, not a crash
    _error_reported(json.loads((tmp_path / "r" / "report.json").read_text()), ENDPOINT, tmp_path / "again")
