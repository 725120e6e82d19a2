"""Faults of draft-tree verification (verify/tree.py): the bugs a tree verifier gets wrong
where a linear one cannot, each in one seam of the step (engine/hooks.py: tree_layout,
tree_walk). They touch only steps whose drafts branch, so an audit catches them only where
its drafter proposes trees and the target takes a branch other than the first: the audit
of a tree drafter (`--draft suffix:width=N`) runs its equivalence check on such steps.
"""

from __future__ import annotations

from ...engine.hooks import StepHooks
from ...verify.tree import TreeWalk, child_slots, layout
from .catalogue import register
from ..registry import EQUIVALENCE


def _earlier_siblings(parents: list[int]) -> dict[int, list[int]]:
    """slot -> the slots of the nodes under the same parent that come before it."""
    seen: dict[int, list[int]] = {}
    out: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        out[i + 1] = list(seen.get(p, []))
        seen.setdefault(p, []).append(i + 1)
    return out


class _SiblingLeak(StepHooks):
    """A slot attends to its earlier siblings too (a causal mask over the slots of one
    depth instead of the tree's): the taken branch reads keys and values it never had."""

    @staticmethod
    def tree_layout(trees, T):
        depth, visible = layout(trees, T)
        for b, parents in enumerate(trees):
            for slot, sibs in _earlier_siblings(parents).items():
                for u in sibs:
                    visible[b, slot, u] = True
        return depth, visible


class _PositionOffByOne(StepHooks):
    """A node after the first child of its parent sits one position further (the position
    counts the siblings before it), and its subtree with it."""

    @staticmethod
    def tree_layout(trees, T):
        depth, visible = layout(trees, T)
        for b, parents in enumerate(trees):
            sibs = _earlier_siblings(parents)
            for i, p in enumerate(parents):
                slot = i + 1
                depth[b, slot] = depth[b, p + 1] + 1 + (1 if sibs[slot] else 0)
        return depth, visible


class _CompareWrongNode(StepHooks):
    """The drawn token is emitted, but the walk goes on from the node's first child whichever
    child it matched: past a later sibling, the next token is drawn where it was not compared,
    and the cache keeps the first child's keys and values."""

    @staticmethod
    def tree_walk(parents, tokens, draw):
        children = child_slots(parents, tokens)
        slot, slots, out = 0, [0], []
        while True:
            tok = draw(slot, len(out))
            out.append(tok)
            kids = children.get(slot, {})
            if tok not in kids:
                return TreeWalk(slots, out)
            slot = next(iter(kids.values()))  # the first child, not the one that matched
            slots.append(slot)


register("tree-sibling-leak", "inside a draft tree a node attends to its earlier siblings' keys and values",
         EQUIVALENCE, lambda c: {"step": _SiblingLeak()})
register("tree-position-off-by-one", "inside a draft tree a node after its parent's first child sits one "
         "position further, and its subtree with it", EQUIVALENCE, lambda c: {"step": _PositionOffByOne()})
register("tree-compare-wrong-node", "a draft tree's walk emits the drawn token but goes on from the first "
         "child, whichever child the token matched", EQUIVALENCE, lambda c: {"step": _CompareWrongNode()})
