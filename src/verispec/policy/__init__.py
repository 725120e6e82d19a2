"""How many tokens to draft per row per step. Drafters make tokens; policies pick k.

Every policy subclasses Policy (below): choose() is the one method it must have; the
hooks the engine calls on every step have no-op defaults, so the engine calls them
directly, never probing for them. A policy overrides the ones it uses:

    max_k: int                          upper bound on any choice (sizes the cache slack)
    choose(requests) -> list[int]       k per row, from what was known before this step
    halts: bool = False                 True: while a drafter with `halts = True` drafts,
    halt(requests, k, i, active, conf)  the engine passes it a callback to halt(), which
        -> list[bool]                   stops rows on the drafter's own confidence
                                        (drafters/__init__.py); the rows' k then is
                                        where they stopped
    trims: bool = False                 True: once drafts are found the engine calls
    trim(requests, found) -> list[int]  trim(), which settles how many of them to verify
                                        per row (default: all found); k then is that
    observe(requests, k, accepted)      after the step: k per row (as chosen, or settled
                                        by halt/trim), accepted draft tokens per row
    observe_costs(B, tokens_per_row,    after the step: its measured times (the target
        drafting_rows, drafts,          pass over B rows x tokens_per_row tokens, and
        draft_s, verify_s)              drafting `drafts` tokens for drafting_rows rows)

The flags say whether the engine acts on a hook's answer: a policy that neither halts
nor trims is told k as it chose it, whatever the drafter found, so the step's trace keeps
what was asked of the drafter (the audit compares it with what a correct drafter finds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import FixedK, Policy, PolicyWrapper
from .config import AdaptiveConfig

__all__ = ["DEFAULT_K", "AdaptiveConfig", "FixedK", "Policy", "PolicyWrapper", "make_policy", "resolve_k"]

if TYPE_CHECKING:  # policy.costs imports numpy and torch: only make_policy() needs it
    from .costs import CostCache


# --k when not given: the adaptive policy's k is a cap (a draft model or layer-skip stops
# each row on its confidence; prompt lookup verifies what pays of what it finds), so it
# defaults to the 8 its benchmarks ran with; a fixed k is paid every step, so it stays small
DEFAULT_K = {"adaptive": 8, "fixed": 4}


def resolve_k(kind: str, k: int | None) -> int:
    """The --k a command runs with: the one given, else the policy's default."""
    return DEFAULT_K.get(kind, 4) if k is None else k


def make_policy(kind: str, target, drafter, max_batch: int, k: int, *,
                config: AdaptiveConfig | None = None, cost_cache: CostCache | None = None) -> Policy:
    """The policy a CLI or server asks for: 'adaptive' (the costs of this machine up to
    max_batch rows and k drafts, tunables from config: AdaptiveConfig()'s defaults unless
    given) or 'fixed' (always k); plain decoding where there is no drafter or k = 0.

    cost_cache: a policy.costs.CostCache (CostCache.default() is the machine's, under
    $VERISPEC_CACHE/costs) to read the measured cost model from and write it to; None
    measures it now and keeps nothing."""
    if kind not in ("adaptive", "fixed"):
        raise ValueError(f"unknown policy {kind!r}; valid: adaptive, fixed")
    if drafter is None or k == 0:
        return FixedK(0)
    if kind == "fixed":
        return FixedK(k)
    from .adaptive import AdaptivePolicy
    from .costs import cached_costs
    costs, entry = cached_costs(target, drafter, max_batch, k, cost_cache)
    return AdaptivePolicy(costs, max_k=k, config=config, cost_entry=entry)


__all__ = ["AdaptiveConfig", "DEFAULT_K", "FixedK", "Policy", "PolicyWrapper", "make_policy", "resolve_k"]
