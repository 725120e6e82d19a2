"""The fault catalogue: every fault's description, the check meant to catch it, and its
parameter -> Fault's fields. Each module of this package registers its faults here; the
package imports them all, so the catalogue is whole once `verispec.audit.faults` is."""

from __future__ import annotations

from typing import Callable

FAULTS: dict[str, str] = {}  # name -> what it breaks
EXPECTED_CHECK: dict[str, str] = {}  # name -> the audit check meant to catch it (others may fail too)
PARTS: dict[str, Callable[[float | None], dict]] = {}  # name -> (its parameter -> Fault's fields)


def register(name: str, description: str, check: str, parts: Callable[[float | None], dict]) -> None:
    """Add a fault to the catalogue."""
    if name in FAULTS:
        raise ValueError(f"fault {name!r} is already registered")
    FAULTS[name], EXPECTED_CHECK[name], PARTS[name] = description, check, parts
