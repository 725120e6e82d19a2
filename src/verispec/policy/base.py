"""The policy protocol as a base class (the hooks and flags the engine calls: see
policy/__init__.py), fixed k, and the base of a policy that wraps another."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Policy(ABC):
    """Base of every policy: choose() to implement, the other hooks no-ops (see above)."""

    name: str = "policy"
    max_k: int
    halts: bool = False
    trims: bool = False

    @abstractmethod
    def choose(self, requests: list) -> list[int]:
        """k per row for this step (before any draft of it is made)."""

    def observe(self, requests: list, k: list[int], accepted: list[int]) -> None:
        """The step's outcome (a policy that learns nothing ignores it)."""

    def observe_costs(self, B: int, tokens_per_row: int, drafting_rows: int, drafts: int,
                      draft_s: float, verify_s: float) -> None:
        """The step's measured times (a policy without a cost model ignores them)."""

    def bind_drafter(self, drafter) -> None:
        """What the policy may know of the engine's drafter before the first step (a
        policy that reads nothing of it ignores it)."""

    def trim(self, requests: list, found: list[int], conf: list | None = None,
             parents: list | None = None) -> list[int]:
        """How many of the drafts found per row to verify: all of them. conf: the
        drafter's own per-draft estimates (Drafter.found_conf), where it has them; parents:
        each row's draft tree (Drafter.found_parents), where the drafts branch (a kept
        prefix of a row's drafts is a tree)."""
        return list(found)

    def observe_tree(self, requests: list, parents: list, accepted: dict) -> None:
        """Before observe() of a step that verified draft trees: each row's node parents and,
        per row index, the accepted nodes (indices into its drafts, root first excluded). A
        policy that learns nothing of trees ignores it."""

    def halt(self, requests: list, k: list[int], i: int, active: list[int], conf) -> list[bool]:
        """Which of the rows `active` stop after draft position i: none."""
        return [False] * len(active)


class FixedK(Policy):
    """Draft the same k tokens for every row at every step (k = 0: plain decoding)."""

    name = "fixed"

    def __init__(self, k: int):
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.max_k = k

    def choose(self, requests):
        return [self.max_k] * len(requests)


class PolicyWrapper(Policy):
    """Base for a policy that wraps another: every hook, and the flags saying whether the
    engine acts on halt() and trim(), pass through to the wrapped policy; a subclass
    overrides what it changes (choose(), mostly)."""

    def __init__(self, inner: Policy):
        self.inner = inner
        self.max_k = inner.max_k

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def halts(self) -> bool:
        return self.inner.halts

    @property
    def trims(self) -> bool:
        return self.inner.trims

    def choose(self, requests):
        return self.inner.choose(requests)

    def observe(self, requests, k, accepted):
        self.inner.observe(requests, k, accepted)

    def observe_costs(self, B, tokens_per_row, drafting_rows, drafts, draft_s, verify_s):
        self.inner.observe_costs(B, tokens_per_row, drafting_rows, drafts, draft_s, verify_s)

    def bind_drafter(self, drafter):
        self.inner.bind_drafter(drafter)

    def trim(self, requests, found, conf=None, parents=None):
        kw = {k: v for k, v in (("conf", conf), ("parents", parents)) if v is not None}
        return self.inner.trim(requests, found, **kw)

    def observe_tree(self, requests, parents, accepted):
        self.inner.observe_tree(requests, parents, accepted)

    def halt(self, requests, k, i, active, conf):
        return self.inner.halt(requests, k, i, active, conf)
