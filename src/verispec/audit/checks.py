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

from dataclasses import dataclass, field
from typing import Any, Callable

ENGINE, ENDPOINT = "engine", "endpoint"

Section = tuple[str, list[str], list[list]]  # (title, header, rows): one table of the report


@dataclass
class CheckResult:
    """One item of report.json's "checks" list.

    ``passed`` is the check's verdict; ``informational`` checks (slices, load, record)
    always pass and exist to be read. ``figures`` are the headline numbers (flat, JSON
    scalars or short lists), ``details`` the per-prompt / per-configuration rows.
    """

    name: str
    passed: bool
    summary: str  # one line a person reads first
    figures: dict[str, Any] = field(default_factory=dict)
    details: Any = None
    informational: bool = False
    elapsed_s: float = 0.0

    def to_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "informational": self.informational,
                "summary": self.summary, "elapsed_s": round(self.elapsed_s, 3),
                "figures": self.figures, "details": self.details}

    @classmethod
    def from_dict(cls, d: dict) -> "CheckResult":
        """A result read back from report.json (the report is rendered from the JSON alone)."""
        return cls(d["name"], bool(d["passed"]), d.get("summary") or "", d.get("figures") or {},
                   d.get("details"), bool(d.get("informational")), float(d.get("elapsed_s") or 0.0))

    @property
    def completed(self) -> bool:
        """It ran to the end: a check that raised or was not run has no figures to show."""
        return bool(self.figures) and "error" not in self.figures


def verdict(checks: list[CheckResult]) -> str:
    return "pass" if all(c.passed for c in checks) else "fail"


def failed_check(name: str, e: BaseException, tb: str | None = None) -> CheckResult:
    """What a check whose code raised reports: a failure, with the error (an exception in the
    system under audit is a finding, not a crash of the audit)."""
    return CheckResult(name, False, f"raised {type(e).__name__}: {e}", {"error": f"{type(e).__name__}: {e}"},
                       {"traceback": tb} if tb else None)


@dataclass(frozen=True)
class Check:
    """One check of the audit.

    engine(audit) / endpoint(audit) -> CheckResult | None: the check in that mode (None: it
    does not apply there), given the mode's audit state (runner.EngineAudit,
    endpoint.runner.EndpointAudit); a None result means "not applicable to this server".
    ``always``: runs whatever --only says (lossy-rule, record). ``greedy``: the modes in
    which it reads the greedy runs (offline: not run when they failed; from outside: they
    are made only when a check that reads them runs).
    headline / sections / drafts_verified / plot render a completed result in the report."""

    name: str
    engine: Callable[[Any], CheckResult | None] | None = None
    endpoint: Callable[[Any], CheckResult | None] | None = None
    always: bool = False
    greedy: tuple[str, ...] = ()
    headline: Callable[[CheckResult], list[tuple[str, str]]] | None = None
    sections: Callable[[CheckResult], list[Section]] | None = None
    drafts_verified: Callable[[CheckResult], int | None] | None = None
    # (name, title, draw): draw(matplotlib.pyplot, the result or None where the check did not
    # complete) -> a figure, embedded in report.html
    plot: tuple[str, str, Callable[[Any, CheckResult | None], Any]] | None = None

    def runs_in(self, mode: str) -> bool:
        return (self.engine if mode == ENGINE else self.endpoint) is not None


REGISTRY: list[Check] = []


def register(check: Check, *, before: str | None = None) -> Check:
    """Add a check (before the named one; default: before record, which closes every
    report). A name registered twice is an error: results are keyed by name."""
    if any(c.name == check.name for c in REGISTRY):
        raise ValueError(f"a check named {check.name!r} is already registered")
    anchor = before if before is not None else ("record" if any(c.name == "record" for c in REGISTRY) else None)
    at = next((i for i, c in enumerate(REGISTRY) if c.name == anchor), len(REGISTRY))
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
