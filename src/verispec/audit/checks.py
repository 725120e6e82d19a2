"""What an audit check is, what it returns, and the one registry both audits run from.

A check is one `Check`: its name, how it runs in each mode it applies to (``engine``: the
offline audit of verispec's own engine, audit/runner.py; ``endpoint``: any
OpenAI-compatible server from outside, audit/endpoint/runner.py), and how the report shows
its result (headline lines, tables, the drafts it verified). Both runners walk
``checks_for(mode)`` in registry order and the report renders every result through the
check that made it, so a new check is one `Check` passed to `register` (audit/registry.py
registers the built-in ones), and it appears in report.json, report.md and report.html.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

ENGINE, ENDPOINT = "engine", "endpoint"

Section = tuple[str, list[str], list[list]]  # (title, header, rows): one table of the report


@dataclass
class CheckResult:
    """One item of report.json's "checks" list.

    ``passed`` is the check's verdict; ``informational`` checks (slices, load, record)
    always pass and exist to be read. ``figures`` are the headline numbers (flat, JSON
    scalars or short lists), ``details`` the per-prompt / per-configuration rows. ``name``
    is the check's: the loop that runs a check stamps it (run_checks), so a check's code
    never spells its own name.
    """

    passed: bool
    summary: str  # one line a person reads first
    figures: dict[str, Any] = field(default_factory=dict)
    details: Any = None
    informational: bool = False
    elapsed_s: float = 0.0
    name: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "passed": self.passed,
                "informational": self.informational, "summary": self.summary,
                "elapsed_s": round(self.elapsed_s, 3), "figures": self.figures, "details": self.details}

    @classmethod
    def from_dict(cls, d: dict) -> "CheckResult":
        """A result read back from report.json (the report is rendered from the JSON alone)."""
        return cls(bool(d["passed"]), d.get("summary") or "", d.get("figures") or {}, d.get("details"),
                   bool(d.get("informational")), float(d.get("elapsed_s") or 0.0), d["name"])

    @property
    def completed(self) -> bool:
        """It ran to the end: a check that raised or was not run has no figures to show."""
        return bool(self.figures) and "error" not in self.figures

    @property
    def status(self) -> str:
        """What the report shows: error (its code raised), info, pass or fail."""
        return status_of({"passed": self.passed, "informational": self.informational, "figures": self.figures})


def status_of(d: dict) -> str:
    """A result's status from its report.json fields (reports written before results had a
    status: an error is a failed result whose figures hold "error")."""
    if "error" in (d.get("figures") or {}):
        return "error"
    return "info" if d.get("informational") else ("pass" if d.get("passed") else "fail")


def verdict(checks: list[CheckResult]) -> str:
    return "pass" if all(c.passed for c in checks) else "fail"


def failed_check(e: BaseException, tb: str | None = None) -> CheckResult:
    """What a check whose code raised reports: an error, which fails the audit, with the
    exception (an exception in the system under audit is a finding, not a crash of the audit)."""
    return CheckResult(False, f"raised {type(e).__name__}: {e}", {"error": f"{type(e).__name__}: {e}"},
                       {"traceback": tb} if tb else None)


@dataclass(frozen=True)
class Check:
    """One check of the audit.

    engine(audit) / endpoint(audit) -> CheckResult | None: the check in that mode (None: it
    does not apply there), given the mode's audit state (runner.EngineAudit,
    endpoint.runner.EndpointAudit); a None result means "not applicable to this server".
    ``always``: runs whatever --only says (lossy-rule, record). ``greedy``: the modes in
    which it reads the greedy runs (not run when they failed; from outside: they are made
    only when a check that reads them runs). ``closes``: it reads every result before it,
    so it comes after every check registered without it (record, the re-test gate).
    headline / sections / drafts_verified / plot render a completed result in the report."""

    name: str
    engine: Callable[[Any], CheckResult | None] | None = None
    endpoint: Callable[[Any], CheckResult | None] | None = None
    always: bool = False
    greedy: tuple[str, ...] = ()
    closes: bool = False
    samples: bool = False  # it runs the sampled (temperature > 0) phase: --sampled-tokens sizes it
    headline: Callable[[CheckResult], list[tuple[str, str]]] | None = None
    sections: Callable[[CheckResult], list[Section]] | None = None
    drafts_verified: Callable[[CheckResult], int | None] | None = None
    # (name, title, draw): draw(matplotlib.pyplot, the result or None where the check did not
    # complete) -> a figure, embedded in report.html
    plot: tuple[str, str, Callable[[Any, CheckResult | None], Any]] | None = None

    def runs_in(self, mode: str) -> bool:
        return self.runner(mode) is not None

    def runner(self, mode: str) -> Callable[[Any], CheckResult | None] | None:
        return self.engine if mode == ENGINE else self.endpoint


REGISTRY: list[Check] = []


def register(check: Check, *, before: Check | None = None) -> Check:
    """Add a check: before the given one; by default before the first check that closes the
    report, or last when it closes the report itself. A name registered twice is an error:
    results are keyed by name."""
    if any(c.name == check.name for c in REGISTRY):
        raise ValueError(f"a check named {check.name!r} is already registered")
    if before is not None:
        at = REGISTRY.index(before)
    elif check.closes:
        at = len(REGISTRY)
    else:
        at = next((i for i, c in enumerate(REGISTRY) if c.closes), len(REGISTRY))
    REGISTRY.insert(at, check)
    return check


def unregister(name: str) -> None:
    REGISTRY[:] = [c for c in REGISTRY if c.name != name]


def checks_for(mode: str) -> list[Check]:
    """The checks of one mode, in report order."""
    return [c for c in REGISTRY if c.runs_in(mode)]


def selectable(mode: str) -> tuple[str, ...]:
    """The names --only may choose in that mode (the rest always run)."""
    return tuple(c.name for c in checks_for(mode) if not c.always)


def find(name: str) -> Check | None:
    return next((c for c in REGISTRY if c.name == name), None)


def run_checks(mode: str, audit, *, only: tuple[str, ...] = (), fail_fast: bool = False, progress=None) -> None:
    """The one loop over the registry, for both modes: each check of the mode in report
    order, its result stamped with the check's name and its time and appended to
    ``audit.results``; a check not asked for (--only) or after a failure (--fail-fast) goes
    to ``audit.skipped``. A check whose code raises becomes an ``error`` result and the
    loop goes on: one broken check never costs the report of the others.

    audit: the mode's state (runner.EngineAudit, endpoint.state.EndpointAudit), which
    each check reads; it has ``results``, ``skipped`` and ``greedy_error`` (why the greedy
    runs failed, or None)."""
    for check in checks_for(mode):
        if not check.always and ((fail_fast and any(not c.passed for c in audit.results))
                                 or (only and check.name not in only)):
            audit.skipped.append(check.name)  # --fail-fast: the verdict is already FAIL; --only: not asked for
            continue
        result = attempt(check, mode, audit)
        if result is not None:
            audit.results.append(result)
            if progress is not None:
                progress.check_done(result)


def attempt(check: Check, mode: str, audit) -> CheckResult | None:
    """Run one check in one mode: its result with its name and time, an ``error`` result
    when its code raised, or None where it does not apply."""
    t0 = time.perf_counter()
    try:
        if mode in check.greedy and audit.greedy_error is not None:
            result = CheckResult(False, f"not run: the greedy runs failed ({audit.greedy_error})")
        else:
            result = check.runner(mode)(audit)
    except Exception as e:  # noqa: BLE001 - whatever the system under audit raises is a finding
        result = failed_check(e, traceback.format_exc(limit=-6))
    if result is not None:
        result.name = check.name
        result.elapsed_s += time.perf_counter() - t0
    return result
