"""The suffix-decoding drafter (drafters/suffix.py): its options, what it drafts from the
request's own text and from earlier requests', scopes that never mix, rollback, and the
engine's calls that feed it (admit_scopes, learn)."""

from __future__ import annotations

import pytest
import torch

from verispec.drafters import make_drafter
from verispec.drafters.suffix import SuffixDrafter, SuffixSettings
from verispec.drafters.suffix_tree import SuffixCache, scope_of
from verispec.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _propose(d, rows, seqs, k):
    out, q, n = d.propose(rows, seqs, [k] * len(rows), [GREEDY] * len(rows), [None] * len(rows))
    assert q is None  # no model: one-hot proposals
    return [out[b, :n[b]].tolist() for b in range(len(rows))]


def test_options_parse_and_bad_ones_are_refused():
    s = SuffixSettings.parse("depth=16,factor=2,offset=1,min-prob=0.05,cache=0")
    assert (s.max_depth, s.max_spec_factor, s.max_spec_offset, s.min_token_prob, s.cache_nodes) == (16, 2.0, 1.0, 0.05, 0)
    assert SuffixSettings.parse("") == SuffixSettings()
    assert SuffixSettings.parse("width=4").width == 4
    for bad in ("depth", "breadth=3", "width=0", "width=9", "depth=x", "depth=1", "min-prob=2", "cache=-1",
                "factor=-1"):
        with pytest.raises(ValueError, match="suffix"):
            SuffixSettings.parse(bad)
    d = make_drafter("suffix:cache=0", None, None, max_rows=1, max_len=64)
    assert isinstance(d, SuffixDrafter) and d.cache is None and d.replayable
    assert make_drafter("suffix", None, None, max_rows=1, max_len=64).cache is not None


def test_drafts_the_continuation_the_request_has_repeated():
    d = SuffixDrafter(SuffixSettings(cache_nodes=0, max_spec_factor=4))
    seq = [5, 6, 7, 8, 9, 1, 2, 5, 6]  # "5 6" was followed by "7 8 9"
    d.admit([0], [seq])
    assert _propose(d, [0], [seq], 3) == [[7, 8, 9]]
    assert _propose(d, [0], [seq + [7]], 3) == [[8, 9, 1]]  # the trie follows the sequence as it grows
    assert _propose(d, [0], [[3, 4]], 3) == [[]]  # shorter than what it holds: rebuilt, nothing repeats


def test_rollback_below_the_trie_drops_it():
    d = SuffixDrafter(SuffixSettings(cache_nodes=0, max_spec_factor=4))
    seq = [1, 2, 3, 4, 1, 2]
    d.admit([3], [seq])
    assert _propose(d, [3], [seq], 2) == [[3, 4]]
    d.rollback([3], [len(seq) - 1])  # the pending token is not in the cache: nothing void
    assert d._fed[3] == len(seq)
    d.rollback([3], [2])
    assert 3 not in d._tries
    assert _propose(d, [3], [[1, 2, 9, 1, 2]], 1) == [[9]]  # rebuilt from the sequence given


def test_earlier_requests_are_drafted_within_their_scope_only():
    cache = SuffixCache(max_depth=24, max_nodes=10_000)
    d = SuffixDrafter(SuffixSettings(max_spec_factor=4), cache=cache)
    a, b = scope_of("key-a"), scope_of("key-b")
    text = [10, 11, 12, 13, 14, 15, 16]
    d.admit([0], [text])
    d.admit_scopes([0], [a])
    d.learn([0], [text])
    d.release([0])
    ctx = [40, 10, 11, 12]  # the start of tenant a's text, in a new request
    for row, scope, expected in ((1, a, [13, 14, 15]), (2, b, []), (3, None, [])):
        d.admit([row], [ctx])
        d.admit_scopes([row], [scope])
        assert _propose(d, [row], [ctx], 3) == [expected], scope
    d.release([1, 2, 3])
    # a row reused without admit_scopes is key-less, never the previous request's scope
    d.admit([1], [ctx])
    assert _propose(d, [1], [ctx], 3) == [[]]


def test_the_better_scored_source_wins():
    cache = SuffixCache(max_depth=24, max_nodes=10_000)
    d = SuffixDrafter(SuffixSettings(max_spec_factor=4, min_token_prob=0.0), cache=cache)
    for _ in range(3):  # earlier requests agree on "1 2 -> 3 4 5"
        cache.add(None, [1, 2, 3, 4, 5])
    seq = [1, 2, 8, 1, 2, 3, 1, 2]  # this request is unsure: "1 2" went on to 8 and to 3 once each
    d.admit([0], [seq])
    assert _propose(d, [0], [seq], 3) == [[3, 4, 5]]  # score 3 against its own [3, 1, 2]'s 1.5
    own = SuffixDrafter(SuffixSettings(max_spec_factor=4, min_token_prob=0.0, cache_nodes=0))
    own.admit([0], [seq])
    assert _propose(own, [0], [seq], 3) == [[3, 1, 2]]
    # a tie goes to the request's own text
    tie = [1, 2, 8, 1, 2]
    d.admit([1], [tie])
    assert _propose(d, [1], [tie], 3) == [[8, 1, 2]]


def test_the_engine_scopes_and_learns(monkeypatch):
    from tests.tiny import native_from_hf, tiny_hf
    from verispec.engine import Engine, EngineConfig, GenerationParams, Request
    from verispec.policy import FixedK

    target = native_from_hf(tiny_hf("qwen2", seed=3, vocab=64))
    d = SuffixDrafter(SuffixSettings(min_token_prob=0.0))
    seen = []
    monkeypatch.setattr(d, "admit_scopes", lambda rows, scopes: seen.extend(scopes) or
                        SuffixDrafter.admit_scopes(d, rows, scopes))
    eng = Engine(target, d, FixedK(3), EngineConfig(max_batch=2, max_len=64))
    reqs = [Request([5, 6, 7, 8], GenerationParams(max_new_tokens=6), scope="t1"),
            Request([5, 6, 7, 9], GenerationParams(max_new_tokens=6))]
    with torch.no_grad():
        eng.run(reqs)
    assert sorted(seen, key=str) == [None, "t1"]
    st = d.cache.stats()
    assert st["sequences"] == 2 and st["scopes"] == 2  # one trie each: no text shared


def test_proposals_carry_the_tries_estimates_shrunk_by_match_length():
    assert SuffixDrafter.confidence([1.0, 0.5], 1) == [0.5, 0.25]
    assert SuffixDrafter.confidence([1.0, 1.0, 1.0], 9) == pytest.approx([0.9] * 3)
    d = SuffixDrafter(SuffixSettings(cache_nodes=0))
    assert d.estimates_acceptance
    d.admit([0, 1], [[1], [1]])
    seq = [5, 6, 7, 8, 9, 5, 6, 7]
    drafts = _propose(d, [0, 1], [seq, [42]], 4)
    assert drafts[0] == [8, 9, 5][:len(drafts[0])] and drafts[0] and drafts[1] == []
    assert len(d.found_conf[0]) == len(drafts[0]) and d.found_conf[1] == []
    assert all(0.0 < c < 1.0 for c in d.found_conf[0])


def test_tree_proposals_grow_best_first_within_width():
    """The trie's tree: nodes in best-first order of path probability (parents first), at most
    `width` leaves, and with width 1 exactly the linear proposal."""
    from verispec.drafters.suffix_tree import SuffixTrie
    from verispec.verify.tree import DraftTree

    t = SuffixTrie(24)
    t.extend(0, [1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2, 7, 7])
    line = t.propose([1, 2], 8, max_spec_factor=4)
    one = t.propose_tree([1, 2], 8, 1, max_spec_factor=4)
    assert (one.tokens, one.probs) == (line.tokens, line.probs) and one.parents == list(range(-1, 7))
    tree = t.propose_tree([1, 2], 8, 3, max_spec_factor=4)
    DraftTree(tree.tokens, tree.parents)  # siblings distinct, parents first
    assert tree.tokens[0] == 3 and 7 in [tok for tok, p in zip(tree.tokens, tree.parents) if p == -1]
    assert tree.probs == sorted(tree.probs, reverse=True)
    leaves = [i for i in range(len(tree.tokens)) if i not in tree.parents]
    assert 1 < len(leaves) <= 3
    # a second branch is priced like any node: after "1 2", "7" (1 of 4) is as likely as "3 9"
    assert abs(sum(tree.probs) - tree.score) < 1e-12


def test_suffix_drafter_proposes_trees_with_width():
    d = SuffixDrafter(SuffixSettings(cache_nodes=0, max_spec_factor=4, width=3))
    seq = [1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2, 7, 7, 1, 2]
    d.admit([0], [seq])
    out, q, n = d.propose([0], [seq], [6], [None], [None])
    parents = d.found_parents[0]
    assert q is None and int(n[0]) == len(parents) == 6 and len(d.found_conf[0]) == 6
    assert parents.count(-1) >= 2  # two continuations of "1 2" drafted side by side
    assert all(0 < c <= 1 for c in d.found_conf[0])
