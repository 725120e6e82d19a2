"""How the report writes numbers: shared by the report and the checks' own tables."""

from __future__ import annotations


def f(x, fmt: str = ".2f", none: str = "-") -> str:
    if x is None:
        return none
    if isinstance(x, float):
        return format(x, fmt)
    return str(x)


def pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def temps(figures: dict) -> str:
    """The audited temperatures of a check's figures: "1, 0.5"."""
    return ", ".join(f"{t:g}" for t in (figures.get("temperatures") or [figures["temperature"]]))
