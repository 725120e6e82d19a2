"""The data structures of a SuffixDecoding-style drafter (arXiv 2411.04975): a
depth-bounded suffix trie over token sequences, a bounded, scoped cache of earlier
requests built on it, and the greedy speculation both answer.

A trie node stands for a token path; its count is how many inserted suffix occurrences
(one per start position of each sequence, truncated to max_depth tokens) pass through
it. Speculation matches the context's longest suffixes against the trie and follows the
most frequent continuation while its estimated probability holds up.

Pure Python on purpose: the structures are dicts of ints, touched a few times per step,
and need no tensor library.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import threading
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Proposal:
    """A speculation: the tokens, the cumulative estimated probability of each prefix
    (probs[i] is the chance that tokens[:i + 1] are all accepted), the length of the
    context suffix it was matched on, and its score (sum of probs: the expected number
    of accepted tokens, which is how SuffixDecoding ranks speculations). The default is
    the empty proposal (no match)."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0
    score: float = 0.0


@dataclass(frozen=True)
class TreeProposal:
    """A speculation tree (verify/tree.py's DraftTree, best-first): node i is tokens[i]
    under parents[i] (-1: the root, the context's end), probs[i] the estimated probability
    that the path to it is accepted; match_len and score (the sum of probs, the expected
    accepted tokens) as in Proposal."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0
    score: float = 0.0


class _Seq:
    """What the trie keeps of one sequence: its tokens (to subtract them on removal) and
    the nodes where its windows shorter than max_depth end, longest first (to append
    without walking from the root)."""

    __slots__ = ("tokens", "active")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.active: list[int] = []


class SuffixTrie:
    """Every suffix of every inserted sequence, truncated to max_depth tokens, as a path
    from the root, with occurrence counts. Sequences grow incrementally (extend) and can
    be removed exactly (remove), which the cache's eviction needs.

    Nodes are integer ids into parallel lists (the root is 0): count, child_sum (the sum
    of the children's counts; a node's own count also includes the suffixes that end on
    it, which predict nothing), best (the token of the most frequent child, ties to the
    smallest id, -1 while unknown, so that a walk does not scan every child) and kids
    (token -> child id). A dict of ints holds no reference the garbage collector follows,
    so CPython leaves it untracked: a trie of any size is a handful of tracked objects,
    where an object per node made every full collection walk the whole cache (390 ms at
    200,000 nodes, stalling every request in the server). Freed ids are reused."""

    def __init__(self, max_depth: int = 24) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._seqs: dict[Hashable, _Seq] = {}
        self._reset_nodes()

    def _reset_nodes(self) -> None:
        """Just the root."""
        self._count: list[int] = [0]
        self._child_sum: list[int] = [0]
        self._best: list[int] = [-1]
        self._kids: list[dict[int, int]] = [{}]
        self._free: list[int] = []  # ids of freed nodes, reused before the lists grow
        self._num_nodes = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    @property
    def num_nodes(self) -> int:
        """Nodes besides the root; maintained on every change, so O(1)."""
        return self._num_nodes

    @property
    def capacity(self) -> int:
        """Node slots held, the root and freed ones included: the most nodes the trie has
        had at once since it was last empty, plus one."""
        return len(self._count)

    def extend(self, seq_id: Hashable, tokens: Iterable[int]) -> None:
        """Append tokens to sequence seq_id (created if new). Token t at position i
        extends the windows that start at i - max_depth + 1 .. i by one step, so an
        append costs O(max_depth) and the result equals inserting the whole sequence at
        once."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = _Seq()
        depth = self.max_depth
        step = self._step
        active = seq.active
        added = []
        for t in tokens:
            nxt = [step(node, t) for node in active]
            nxt.append(step(0, t))
            # the longest window just reached max_depth: it grows no further
            if len(nxt) == depth:
                del nxt[0]
            active = nxt
            added.append(t)
        seq.active = active
        seq.tokens.extend(added)

    def _step(self, node: int, t: int) -> int:
        """Count one more occurrence through node's child t, creating it if needed."""
        kids = self._kids[node]
        child = kids.get(t)
        if child is None:
            child = kids[t] = self._new_node()
        count = self._count
        c = count[child] = count[child] + 1
        self._child_sum[node] += 1
        best = self._best[node]
        # a known best stays valid: only t's count rose, so t either overtakes it or not
        if best >= 0 and best != t:
            bc = count[kids[best]]
            if c > bc or (c == bc and t < best):
                self._best[node] = t
        return child

    def _new_node(self) -> int:
        self._num_nodes += 1
        if self._free:
            return self._free.pop()  # its slots were reset when it was freed
        self._count.append(0)
        self._child_sum.append(0)
        self._best.append(-1)
        self._kids.append({})
        return len(self._count) - 1

    def _free_node(self, node: int) -> None:
        self._count[node] = 0
        self._child_sum[node] = 0
        self._best[node] = -1
        self._kids[node] = {}
        self._free.append(node)
        self._num_nodes -= 1

    def remove(self, seq_id: Hashable) -> None:
        """Subtract every count seq_id contributed and free the nodes left at 0."""
        seq = self._seqs.pop(seq_id)
        toks = seq.tokens
        depth = self.max_depth
        count, child_sum, best, kids_of = self._count, self._child_sum, self._best, self._kids
        for s in range(len(toks)):
            window = toks[s:s + depth]
            node = 0
            for d, t in enumerate(window):
                kids = kids_of[node]
                child = kids[t]
                count[child] -= 1
                child_sum[node] -= 1
                if best[node] == t:
                    best[node] = -1
                if count[child] == 0:
                    # a count of 1 meant only this window passed through child, so its
                    # subtree is exactly the rest of this window: free it whole
                    del kids[t]
                    for u in window[d + 1:]:
                        below = kids_of[child][u]
                        self._free_node(child)
                        child = below
                    self._free_node(child)
                    break
                node = child
        if not self._seqs:
            # nothing left: give the lists' memory back rather than keep them for reuse
            self._reset_nodes()

    def paths(self) -> dict[tuple[int, ...], int]:
        """Every path with its count: the trie's whole observable state, for tests and
        debugging."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[tuple[int, ...], int]] = [((), 0)]
        while stack:
            path, node = stack.pop()
            for t, child in self._kids[node].items():
                p = path + (t,)
                out[p] = self._count[child]
                stack.append((p, child))
        return out

    def _best_child(self, node: int) -> int:
        best = self._best[node]
        if best < 0:
            count = self._count
            best = self._best[node] = min(self._kids[node].items(),
                                          key=lambda kv: (-count[kv[1]], kv[0]))[0]
        return best

    def _matches(self, context: list[int]) -> list[int]:
        """Nodes of the context's suffixes of length 1, 2, ... that are paths, up to
        max_depth - 1 tokens (a longer match leaves no depth to propose from). Paths are
        closed under taking suffixes, so the first miss ends the search."""
        nodes: list[int] = []
        kids_of = self._kids
        n = len(context)
        for length in range(1, min(n, self.max_depth - 1) + 1):
            node = 0
            for t in context[n - length:]:
                node = kids_of[node].get(t, -1)
                if node < 0:
                    return nodes
            nodes.append(node)
        return nodes

    def propose(self, context: list[int], max_tokens: int, *, max_spec_factor: float = 1.0,
                max_spec_offset: float = 0.0, min_token_prob: float = 0.1) -> Proposal:
        """Speculate a continuation of context. Every matching suffix length is tried and
        the speculation with the highest score wins, ties going to the longer match:
        a longer match is more specific, a shorter one has seen more data, and the score
        (expected accepted tokens) weighs the two as SuffixDecoding does.

        From the match, the walk takes the most frequent child (ties: smallest token id)
        with probability child.count / sum of the children's counts, multiplied along
        the path. It stops when that product falls below min_token_prob (that token is
        not proposed), at a node without children (nodes at max_depth have none), or at
        min(max_tokens, floor(max_spec_factor * match_len + max_spec_offset)) tokens."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        best = Proposal()
        if max_tokens == 0:
            return best
        count, child_sum, kids_of, best_of = self._count, self._child_sum, self._kids, self._best
        for match_len, node in enumerate(self._matches(context), start=1):
            limit = min(max_tokens, math.floor(max_spec_factor * match_len + max_spec_offset))
            toks: list[int] = []
            probs: list[float] = []
            p = 1.0
            while len(toks) < limit:
                kids = kids_of[node]
                if not kids:
                    break
                t = best_of[node]
                if t < 0:
                    t = self._best_child(node)
                child = kids[t]
                p *= count[child] / child_sum[node]
                if p < min_token_prob:
                    break
                toks.append(t)
                probs.append(p)
                node = child
            score = sum(probs)
            if score >= best.score:
                best = Proposal(toks, probs, match_len, score)
        return best

    def propose_tree(self, context: list[int], max_nodes: int, max_width: int, *,
                     max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                     min_token_prob: float = 0.1) -> TreeProposal:
        """Speculate a tree: for every matching suffix length, grow it best-first from the
        match, always adding the candidate whose path probability (the product of
        child.count / child_sum along it) is highest, while that is at least min_token_prob,
        the tree has at most max_nodes nodes and max_width leaves, and no path is longer than
        floor(max_spec_factor * match_len + max_spec_offset). The highest-scoring tree wins,
        ties going to the longer match. With max_width 1 it is propose()'s chain."""
        if max_nodes < 0 or max_width < 1:
            raise ValueError(f"max_nodes must be >= 0 and max_width >= 1, got {max_nodes}, {max_width}")
        best = TreeProposal()
        if max_nodes == 0:
            return best
        for match_len, node in enumerate(self._matches(context), start=1):
            limit = min(max_nodes, math.floor(max_spec_factor * match_len + max_spec_offset))
            tree = self._grow(node, max_nodes, max_width, limit, min_token_prob)
            tree = TreeProposal(*tree, match_len=match_len, score=sum(tree[2]))
            if tree.tokens and tree.score >= best.score:
                best = tree
        return best

    def _grow(self, start: int, max_nodes: int, max_width: int, limit: int, min_prob: float):
        """Best-first growth below start: (tokens, parents, probs)."""
        toks: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        if limit < 1:
            return toks, parents, probs
        count, child_sum, kids_of = self._count, self._child_sum, self._kids
        kids = [0]  # children added per node, the root (index 0 here) first
        leaves = 0
        heap: list = []
        order = 0

        def push(node: int, parent: int, p: float, depth: int) -> None:
            nonlocal order
            if depth > limit or not kids_of[node]:
                return
            top = heapq.nlargest(max_width, kids_of[node].items(), key=lambda kv: (count[kv[1]], -kv[0]))
            for t, child in top:
                q = p * count[child] / child_sum[node]
                if q >= min_prob:
                    order += 1
                    heapq.heappush(heap, (-q, order, t, child, parent, depth))

        push(start, -1, 1.0, 1)
        while heap and len(toks) < max_nodes:
            negq, _, t, child, parent, depth = heapq.heappop(heap)
            # a child of the root, or a second child anywhere, is one more leaf; a first child
            # under a node replaces that node as a leaf
            grows = 1 if parent == -1 or kids[parent + 1] > 0 else 0
            if leaves + grows > max_width:
                continue
            leaves += grows
            toks.append(t)
            parents.append(parent)
            probs.append(-negq)
            kids[parent + 1] += 1
            kids.append(0)
            push(child, len(toks) - 1, -negq, depth + 1)
        return toks, parents, probs


class SuffixCache:
    """The cache of earlier requests' text that the drafter speculates from, bounded in
    nodes (and optionally in sequences), one trie per scope so that text never crosses
    scopes, and safe to share between threads (one lock guards every method).

    Eviction is FIFO across all scopes: the oldest sequences leave first. The newest
    sequence has priority: if it alone exceeds max_nodes, every other sequence is
    evicted and it is truncated to its longest tail that fits (a tail of a sequence is a
    sub-trie of it, so the tail's node count grows with its length and the longest
    fitting one is found by bisection). A single token is one node, so something is
    always cached."""

    def __init__(self, max_depth: int = 24, max_nodes: int = 200_000,
                 max_sequences: int | None = None) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        if max_sequences is not None and max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1 or None, got {max_sequences}")
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self.max_sequences = max_sequences
        self._lock = threading.Lock()
        self._tries: dict[str | None, SuffixTrie] = {}
        self._order: deque[tuple[str | None, int]] = deque()  # (scope, seq id), oldest first
        self._nodes = 0
        self._next_id = 0
        self._evictions = 0
        self._truncations = 0

    def add(self, scope: str | None, tokens: list[int]) -> None:
        """Cache a finished request's prompt + output under scope (None: the shared
        scope), then evict until the bounds hold. Empty token lists are ignored."""
        if not tokens:
            return
        with self._lock:
            trie = self._tries.get(scope)
            if trie is None:
                trie = self._tries[scope] = SuffixTrie(self.max_depth)
            sid = self._next_id
            self._next_id += 1
            self._insert(trie, sid, tokens)
            self._order.append((scope, sid))
            while len(self._order) > 1 and self._over():
                old_scope, old_sid = self._order.popleft()
                self._remove(old_scope, old_sid)
                self._evictions += 1
            if self._nodes > self.max_nodes:
                # only the new sequence is left, and alone it is too big
                self._remove(scope, sid)
                keep = self._longest_fitting_tail(tokens)
                trie = self._tries[scope] = SuffixTrie(self.max_depth)
                self._insert(trie, sid, tokens[len(tokens) - keep:])
                self._truncations += 1

    def _over(self) -> bool:
        return self._nodes > self.max_nodes or (
            self.max_sequences is not None and len(self._order) > self.max_sequences)

    def _insert(self, trie: SuffixTrie, sid: int, tokens: list[int]) -> None:
        before = trie.num_nodes
        trie.extend(sid, tokens)
        self._nodes += trie.num_nodes - before

    def _remove(self, scope: str | None, sid: int) -> None:
        trie = self._tries[scope]
        before = trie.num_nodes
        trie.remove(sid)
        self._nodes += trie.num_nodes - before
        if not len(trie):
            del self._tries[scope]

    def _longest_fitting_tail(self, tokens: list[int]) -> int:
        """Longest tail length whose trie alone has <= max_nodes nodes. A tail of m
        tokens has at most m * max_depth nodes, which gives the bisection's lower end;
        the whole sequence is known not to fit."""
        lo = max(1, min(self.max_nodes // self.max_depth, len(tokens) - 1))
        hi = len(tokens)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            trial = SuffixTrie(self.max_depth)
            trial.extend(0, tokens[len(tokens) - mid:])
            if trial.num_nodes <= self.max_nodes:
                lo = mid
            else:
                hi = mid
        return lo

    def propose(self, scope: str | None, context: list[int], max_tokens: int, *,
                max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                min_token_prob: float = 0.1) -> Proposal:
        """SuffixTrie.propose on scope's trie alone; the empty proposal if it has none."""
        with self._lock:
            trie = self._tries.get(scope)
            if trie is None:
                return Proposal()
            return trie.propose(context, max_tokens, max_spec_factor=max_spec_factor,
                                max_spec_offset=max_spec_offset, min_token_prob=min_token_prob)

    def propose_tree(self, scope: str | None, context: list[int], max_nodes: int, max_width: int, *,
                     max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                     min_token_prob: float = 0.1) -> TreeProposal:
        """SuffixTrie.propose_tree on scope's trie alone; the empty tree if it has none."""
        with self._lock:
            trie = self._tries.get(scope)
            if trie is None:
                return TreeProposal()
            return trie.propose_tree(context, max_nodes, max_width, max_spec_factor=max_spec_factor,
                                     max_spec_offset=max_spec_offset, min_token_prob=min_token_prob)

    def stats(self) -> dict[str, int | None]:
        with self._lock:
            return {"scopes": len(self._tries), "sequences": len(self._order),
                    "nodes": self._nodes, "evictions": self._evictions,
                    "truncations": self._truncations, "max_nodes": self.max_nodes,
                    "max_sequences": self.max_sequences}

    def clear(self) -> None:
        """Drop every cached sequence. The eviction and truncation counters keep counting:
        clearing is neither."""
        with self._lock:
            self._tries.clear()
            self._order.clear()
            self._nodes = 0


def scope_of(api_key: str | None) -> str | None:
    """The cache scope of an API key: None (the shared scope) without a key, otherwise a
    short stable hash, so that the cache never holds a key in clear."""
    if not api_key:
        return None
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()[:16]
