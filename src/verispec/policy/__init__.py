"""How many tokens to draft per row per step. Drafters make tokens; policies pick k.

Policy protocol::

    max_k: int                          upper bound on any choice (sizes the cache slack)
    choose(requests) -> list[int]       k per row, from what was known before this step
    observe(requests, k, accepted)      the step's outcome, for adaptive policies: k as asked
                                        (capped at what a row may still emit; a drafter may
                                        have found fewer), accepted draft tokens per row

Optional hooks an engine uses when present: observe_costs(...) (measured step times),
trim(requests, found) (settle k once a model-free drafter's drafts are found), and
halt(requests, k, i, active, conf) -> list[bool] (stop rows while a drafter with
`halts = True` drafts, on its own confidence; see drafters/__init__.py).
"""

from __future__ import annotations

from typing import Protocol


class Policy(Protocol):
    max_k: int

    def choose(self, requests: list) -> list[int]: ...

    def observe(self, requests: list, k: list[int], accepted: list[int]) -> None: ...


class FixedK:
    """Draft the same k tokens for every row at every step (k = 0: plain decoding)."""

    name = "fixed"

    def __init__(self, k: int):
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.max_k = k

    def choose(self, requests):
        return [self.max_k] * len(requests)

    def observe(self, requests, k, accepted):
        pass


class PolicyWrapper:
    """Base for a policy that wraps another: the optional hooks an engine looks for
    (observe_costs, trim) pass through to the wrapped policy when it has them."""

    def __init__(self, inner):
        self.inner = inner
        self.max_k = inner.max_k

    def choose(self, requests):
        return self.inner.choose(requests)

    def observe(self, requests, k, accepted):
        self.inner.observe(requests, k, accepted)

    def observe_costs(self, *args):
        if hasattr(self.inner, "observe_costs"):
            self.inner.observe_costs(*args)

    def trim(self, requests, found):
        return self.inner.trim(requests, found) if hasattr(self.inner, "trim") else list(found)

    def halt(self, requests, k, i, active, conf):
        h = getattr(self.inner, "halt", None)
        return h(requests, k, i, active, conf) if h is not None else [False] * len(active)


# --k when not given: the adaptive policy's k is a cap (a draft model or layer-skip stops
# each row on its confidence; prompt lookup verifies what pays of what it finds), so it
# defaults to the 8 its benchmarks ran with; a fixed k is paid every step, so it stays small
DEFAULT_K = {"adaptive": 8, "fixed": 4}


def resolve_k(kind: str, k: int | None) -> int:
    """The --k a command runs with: the one given, else the policy's default."""
    return DEFAULT_K.get(kind, 4) if k is None else k


def make_policy(kind: str, target, drafter, max_batch: int, k: int):
    """The policy a CLI or server asks for: 'adaptive' (costs timed now, on this machine,
    up to max_batch rows and k drafts) or 'fixed' (always k); plain decoding where there
    is no drafter or k = 0."""
    if kind not in ("adaptive", "fixed"):
        raise ValueError(f"unknown policy {kind!r}; valid: adaptive, fixed")
    if drafter is None or k == 0:
        return FixedK(0)
    if kind == "fixed":
        return FixedK(k)
    from .adaptive import AdaptivePolicy, measure_costs
    return AdaptivePolicy(measure_costs(target, drafter, max_batch, k), max_k=k)
