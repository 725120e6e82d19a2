"""Exact verification of a tree of deterministic drafts: several candidate continuations
checked in one target pass.

A row's draft tree is a list of nodes in best-first order, each a token and the index of
its parent (-1: the root, which is the row's pending token). Parents come before their
children, so any prefix of the list is itself a tree: the policy trims a tree by keeping
a prefix. The verify pass lays the row out in slots: slot 0 is the pending token and slot
i + 1 is node i, at position start + depth (the root has depth 0), and each slot attends to
the row's cache and to its own ancestors in the tree.

Verification walks down from the root. At each node it draws the target's token exactly
as plain decoding draws it at that position (greedy: the argmax; a seeded request: the
argmax of log p plus the noise keyed on (seed, sequence index); any other sampled request:
one draw from p with the request's generator). If the drawn token is one of the node's
children the walk descends into it; otherwise it stops. Every drawn token is emitted: the
accepted drafts are the drawn tokens that were children, and the last drawn token is the
recovered or bonus token. The emitted tokens are therefore exactly those plain decoding
emits from the same random source (keyed noise makes that bitwise), and their distribution
is the target's at any temperature. The walk is exact for any tree, unlike rejection
sampling against several one-hot proposals, which needs the residual bookkeeping of
SpecInfer's multi-draft rule.

With a chain (every parent the node before) this is the linear step, and for greedy and
seeded rows it emits the same tokens as rules.greedy and rules.coupled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["DraftTree", "is_chain", "depths", "layout", "walk", "TreeWalk", "MAX_BRANCHES"]

# the most branches (leaves) a draft tree may have: the ggml backend gives each branch a
# sequence id, and llama.cpp allows 256 in all (models/ggml/kvcache.py)
MAX_BRANCHES = 8


@dataclass(frozen=True)
class DraftTree:
    """One row's drafts: tokens[i] with parent parents[i] (-1: the root), in best-first order."""

    tokens: list[int]
    parents: list[int]

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a draft tree needs one parent per token ({len(self.tokens)} tokens, "
                             f"{len(self.parents)} parents)")
        seen: set[tuple[int, int]] = set()
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            if not -1 <= p < i:
                raise ValueError(f"node {i}'s parent {p} must be -1 (the root) or an earlier node")
            if (p, t) in seen:
                raise ValueError(f"node {i} repeats token {t} under parent {p}: siblings must differ")
            seen.add((p, t))

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, n: int) -> "DraftTree":
        return DraftTree(self.tokens[:n], self.parents[:n])


def is_chain(parents: list[int]) -> bool:
    """Whether a tree is a linear draft: node i's parent is node i - 1."""
    return all(p == i - 1 for i, p in enumerate(parents))


def depths(parents: list[int]) -> list[int]:
    """Depth of each node (a child of the root: 1)."""
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


def layout(trees: list[list[int]], T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify pass's layout for rows whose node parents are trees[b], T >= 1 + the most
    nodes: depth [B,T] long (slot 0 is the root at depth 0; padding slots get depth 0) and
    visible [B,T,T] bool, visible[b,t,u] = slot u is slot t or one of its ancestors (padding
    slots see only themselves)."""
    B = len(trees)
    depth = torch.zeros(B, T, dtype=torch.long)
    visible = torch.eye(T, dtype=torch.bool).repeat(B, 1, 1)
    for b, parents in enumerate(trees):
        if len(parents) + 1 > T:
            raise ValueError(f"row {b} has {len(parents)} nodes, more than the pass's {T - 1}")
        visible[b, 1:len(parents) + 1, 0] = True
        for i, p in enumerate(parents):
            s, ps = i + 1, p + 1
            depth[b, s] = depth[b, ps] + 1
            visible[b, s] |= visible[b, ps]
    return depth, visible


@dataclass(frozen=True)
class TreeWalk:
    """A row's verdict: the slots kept (the root, then each accepted node's slot, in order of
    depth) and the tokens emitted (the accepted drafts, then the recovered or bonus token)."""

    slots: list[int]
    tokens: list[int]

    @property
    def accepted(self) -> int:
        return len(self.slots) - 1


def child_slots(parents: list[int], tokens: list[int]) -> dict[int, dict[int, int]]:
    """slot -> {token: its child's slot}, children in node order (slot 0: the root)."""
    children: dict[int, dict[int, int]] = {}
    for i, (p, t) in enumerate(zip(parents, tokens)):
        children.setdefault(p + 1, {})[t] = i + 1
    return children


def walk(parents: list[int], tokens: list[int], draw: Callable[[int, int], int]) -> TreeWalk:
    """Walk one row's tree. draw(slot, depth) -> the target's token at that slot, drawn as
    plain decoding draws it at sequence position (root's + depth); it is called once per
    emitted token, root first, so a sampler's random stream advances as plain decoding's."""
    children = child_slots(parents, tokens)
    slot, slots, out = 0, [0], []
    while True:
        tok = draw(slot, len(out))
        out.append(tok)
        nxt = children.get(slot, {}).get(tok)
        if nxt is None:
            return TreeWalk(slots, out)
        slot = nxt
        slots.append(slot)
