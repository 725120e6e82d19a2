"""What every audit check returns, and the one verdict rule built on it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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


def verdict(checks: list[CheckResult]) -> str:
    return "pass" if all(c.passed for c in checks) else "fail"
