"""The fault catalogue: every fault's description, the check meant to catch it, and its
parameter -> Fault's fields. Each module of this package registers its faults here; the
package imports them all, so the catalogue is whole once `verispec.audit.faults` is."""

from __future__ import annotations

from typing import Callable

from ..checks import Check, find

FAULTS: dict[str, str] = {}  # name -> what it breaks
EXPECTED_CHECK: dict[str, str] = {}  # name -> the audit check meant to catch it (others may fail too)
PARTS: dict[str, Callable[[float | None], dict]] = {}  # name -> (its parameter -> Fault's fields)


def expect(fault: str, check: Check) -> None:
    """Name the check meant to catch a fault: a registered one, or an error at import (a
    catalogue that expects a check nobody runs would pass its fault unnoticed)."""
    if find(check.name) is not check:
        raise ValueError(f"fault {fault!r} expects check {check.name!r}, which is not registered")
    EXPECTED_CHECK[fault] = check.name


def register(name: str, description: str, check: Check, parts: Callable[[float | None], dict]) -> None:
    """Add a fault to the catalogue."""
    if name in FAULTS:
        raise ValueError(f"fault {name!r} is already registered")
    expect(name, check)
    FAULTS[name], PARTS[name] = description, parts
