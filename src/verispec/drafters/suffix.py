"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): draft the continuation that a
suffix trie over this request's own text, and over earlier requests' prompts and outputs,
has seen most often after the sequence's latest tokens. No model, no q: a greedy or a
sampled row verifies the drafts as one-hot proposals, which the rules keep exact.

Two sources, the better-scored proposal of which is drafted:

* the request's own trie, over its prompt and the tokens generated so far (what prompt
  lookup copies from, with frequencies instead of the latest match);
* the global SuffixCache (suffix_tree.py), over finished requests, bounded in nodes with
  FIFO eviction, one trie per scope: a request's scope is its API key's hash, so that no
  tenant receives drafts made of another tenant's text (acceptance speed would reveal it).
  cache_nodes=0 switches it off.

The per-request trie holds only committed tokens: a rollback below what it holds drops it,
and the next proposal rebuilds it from the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..verify.tree import MAX_BRANCHES
from .base import Drafter
from .suffix_tree import SuffixCache, SuffixTrie


@dataclass(frozen=True)
class SuffixSettings:
    """vLLM's knobs for method `suffix`, under the names suffix_decoding_<name>."""

    max_depth: int = 24  # max_tree_depth: the longest suffix kept, and so the longest match
    max_spec_factor: float = 1.0  # a proposal is at most factor * match length + offset tokens
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # stop where the walk's estimated probability falls below this
    cache_nodes: int = 200_000  # the global cache's bound in trie nodes; 0: no global cache
    # the most branches of a draft tree (verify/tree.py); 1: a linear draft. A pass costs by its
    # token count, so width pays only where a wide pass is nearly free (a GPU, not 2 CPU cores)
    width: int = 1

    def __post_init__(self):
        if self.max_depth < 2:
            raise ValueError(f"suffix: depth must be >= 2, got {self.max_depth}")
        if not self.max_spec_factor >= 0 or not self.max_spec_offset >= 0:
            raise ValueError("suffix: factor and offset must be >= 0")
        if not 0 <= self.min_token_prob <= 1:
            raise ValueError(f"suffix: min-prob must be in [0, 1], got {self.min_token_prob}")
        if self.cache_nodes < 0:
            raise ValueError(f"suffix: cache must be >= 0 nodes (0: off), got {self.cache_nodes}")
        if not 1 <= self.width <= MAX_BRANCHES:
            raise ValueError(f"suffix: width must be in [1, {MAX_BRANCHES}], got {self.width}")

    @classmethod
    def parse(cls, options: str) -> "SuffixSettings":
        """'depth=24,factor=1.0,offset=0,min-prob=0.1,cache=200000,width=1' (any subset, any order)."""
        names = {"depth": ("max_depth", int), "factor": ("max_spec_factor", float),
                 "offset": ("max_spec_offset", float), "min-prob": ("min_token_prob", float),
                 "cache": ("cache_nodes", int), "width": ("width", int)}
        kw = {}
        for part in filter(None, (p.strip() for p in options.split(","))):
            key, eq, value = part.partition("=")
            if not eq or key not in names:
                raise ValueError(f"suffix option {part!r}: expected one of {', '.join(n + '=' for n in names)}")
            field, kind = names[key]
            try:
                kw[field] = kind(value)
            except ValueError:
                raise ValueError(f"suffix option {key}: {value!r} is not a {kind.__name__}") from None
        return cls(**kw)


class SuffixDrafter(Drafter):
    name = "suffix"
    estimates_acceptance = True  # found_conf: the trie's counts (confidence())

    def __init__(self, settings: SuffixSettings | None = None, cache: SuffixCache | None = None):
        self.settings = settings or SuffixSettings()
        s = self.settings
        # a cache passed in is shared (several engines, or a test's); else one of our own
        self.cache = cache if cache is not None else (
            SuffixCache(max_depth=s.max_depth, max_nodes=s.cache_nodes) if s.cache_nodes > 0 else None)
        self._tries: dict[int, SuffixTrie] = {}  # row -> the request's own trie
        self._fed: dict[int, int] = {}  # row -> tokens its trie holds
        self._scopes: dict[int, str | None] = {}  # row -> its request's scope
        self.tree_width = s.width

    @property
    def replayable(self) -> bool:
        """Whether a draft is a function of the request's own prefix alone (no global
        cache), so that the audit can recompute it, a tree as well as a chain."""
        return self.cache is None

    def replica(self) -> "SuffixDrafter":
        """A suffix drafter with these settings and no global cache (Drafter.replica)."""
        return SuffixDrafter(replace(self.settings, cache_nodes=0))

    def identity(self) -> dict:
        s = self.settings
        return {"kind": "suffix", "max_depth": s.max_depth, "global": s.cache_nodes > 0, "width": s.width}

    def admit(self, rows, tokens):
        for row in rows:
            self._drop(row)
            self._scopes[row] = None  # the key-less scope until admit_scopes says otherwise

    def admit_scopes(self, rows, scopes):
        for row, scope in zip(rows, scopes):
            self._scopes[row] = scope

    def prepare(self, rows, tokens):
        pass

    def _trie(self, row: int, seq: list[int]) -> SuffixTrie:
        trie, fed = self._tries.get(row), self._fed.get(row, 0)
        if trie is None or fed > len(seq):
            trie, fed = SuffixTrie(self.settings.max_depth), 0
            self._tries[row] = trie
        if len(seq) > fed:
            trie.extend(0, seq[fed:])
            self._fed[row] = len(seq)
        return trie

    def continuation(self, row: int, seq: list[int], k: int) -> list[int]:
        """Up to k tokens: the better-scored of the request's own trie's proposal and the
        global cache's (in the request's scope); ties go to the request's own."""
        return list(self._best(row, seq, k).tokens[:k])

    def _best(self, row: int, seq: list[int], k: int):
        s = self.settings
        knobs = dict(max_spec_factor=s.max_spec_factor, max_spec_offset=s.max_spec_offset,
                     min_token_prob=s.min_token_prob)
        ctx = seq[-(s.max_depth - 1):]
        best = self._trie(row, seq).propose(ctx, k, **knobs)
        if self.cache is not None:
            other = self.cache.propose(self._scopes.get(row), ctx, k, **knobs)
            if other.score > best.score:
                best = other
        return best

    def tree(self, row: int, seq: list[int], k: int):
        """Up to k nodes of a draft tree of at most settings.width branches: the better-scored
        of the request's own trie's tree and the global cache's; ties go to the request's own."""
        s = self.settings
        knobs = dict(max_spec_factor=s.max_spec_factor, max_spec_offset=s.max_spec_offset,
                     min_token_prob=s.min_token_prob)
        ctx = seq[-(s.max_depth - 1):]
        best = self._trie(row, seq).propose_tree(ctx, k, s.width, **knobs)
        if self.cache is not None:
            other = self.cache.propose_tree(self._scopes.get(row), ctx, k, s.width, **knobs)
            if other.score > best.score:
                best = other
        return best

    @staticmethod
    def tree_confidence(probs: list[float], parents: list[int], match_len: int) -> list[float]:
        """confidence() for a tree: each node's share of its parent's continuations (its path
        probability over its parent's), shrunk by m / (m + 1)."""
        shrink = match_len / (match_len + 1.0)
        return [(p / (1.0 if a < 0 else probs[a]) if a < 0 or probs[a] > 0 else 0.0) * shrink
                for p, a in zip(probs, parents)]

    @staticmethod
    def confidence(probs: list[float], match_len: int) -> list[float]:
        """Per draft, the trie's estimate of P(accepted | the drafts before it were): the
        share of the matched context's continuations that went this way, shrunk by
        m / (m + 1) for a match over m tokens, since a continuation seen once after a
        one-token match predicts far less than one seen after twenty. The policy maps it
        to acceptance through a calibration it learns, so only its order has to be right."""
        shrink = match_len / (match_len + 1.0)
        out, before = [], 1.0
        for p in probs:
            out.append(p / before * shrink if before > 0 else 0.0)
            before = p
        return out

    def propose(self, rows, tokens, k, sampling, generators):
        if self.hooks is not None:
            tokens = self.hooks.held(rows, self.hooks.sequences(tokens))
        K = max(k, default=0)
        out = torch.zeros(len(rows), K, dtype=torch.long)  # [B,K]
        n = torch.zeros(len(rows), dtype=torch.long)  # [B] drafts actually found
        conf = []
        if self.settings.width > 1:
            parents = []
            for b, (row, seq, kb) in enumerate(zip(rows, tokens, k)):
                t = self.tree(row, seq, kb) if kb else None
                toks = [] if t is None else t.tokens[:kb]
                if toks:
                    out[b, :len(toks)] = torch.tensor(toks, dtype=torch.long)
                n[b] = len(toks)
                parents.append([] if not toks else t.parents[:kb])
                conf.append(self.tree_confidence(t.probs[:kb], t.parents[:kb], t.match_len) if toks else [])
            self.found_conf, self.found_parents = conf, parents
            return out, None, n
        for b, (row, seq, kb) in enumerate(zip(rows, tokens, k)):
            best = self._best(row, seq, kb) if kb else None
            cont = [] if best is None else list(best.tokens[:kb])
            if cont:
                out[b, :len(cont)] = torch.tensor(cont, dtype=torch.long)
            n[b] = len(cont)
            conf.append(self.confidence(best.probs[:len(cont)], best.match_len) if cont else [])
        self.found_conf = conf
        return out, None, n

    def rollback(self, rows, committed):
        # the trie holds committed tokens plus the pending one: anything beyond is void
        for row, c in zip(rows, committed):
            if self._fed.get(row, 0) > c + 1:
                self._drop(row)

    def learn(self, rows, tokens):
        if self.cache is not None:
            for row, seq in zip(rows, tokens):
                self.cache.add(self._scopes.get(row), list(seq))

    def cache_stats(self):
        return None if self.cache is None else self.cache.stats()

    def release(self, rows):
        for row in rows:
            self._drop(row)
            self._scopes.pop(row, None)
        if self.hooks is not None:
            self.hooks.released(rows)

    def _drop(self, row: int) -> None:
        self._tries.pop(row, None)
        self._fed.pop(row, None)
