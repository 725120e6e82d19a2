"""The suffix trie and cache of the SuffixDecoding-style drafter: the trie against a
brute-force model of its counts, incremental growth and removal against building from
scratch, hand-made speculations, and the cache's bound, FIFO order, scopes and lock."""

import hashlib
import math
import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.drafters.suffix_tree import Proposal, SuffixCache, SuffixTrie, scope_of

FAST = settings(max_examples=60, deadline=None)

small_seq = st.lists(st.integers(0, 3), max_size=25)
depths = st.integers(1, 6)
KNOBS = dict(max_spec_factor=3.0, max_spec_offset=1.0, min_token_prob=0.05)


def reference_counts(seqs, depth):
    """Count of every path: the number of (sequence, start) windows having it as prefix."""
    counts = {}
    for seq in seqs:
        for s in range(len(seq)):
            window = tuple(seq[s:s + depth])
            for d in range(1, len(window) + 1):
                counts[window[:d]] = counts.get(window[:d], 0) + 1
    return counts


def reference_propose(counts, depth, context, max_tokens, max_spec_factor, max_spec_offset,
                      min_token_prob):
    """The proposal rule spelled out over a flat dict of path counts, rescanning every
    child at every step (what the trie's cached best child must agree with)."""
    best = Proposal()
    if max_tokens == 0:
        return best
    for m in range(1, min(len(context), depth - 1) + 1):
        path = tuple(context[len(context) - m:])
        if path not in counts:
            break
        limit = min(max_tokens, math.floor(max_spec_factor * m + max_spec_offset))
        toks, probs, p = [], [], 1.0
        while len(toks) < limit:
            kids = {k[-1]: c for k, c in counts.items() if len(k) == len(path) + 1
                    and k[:-1] == path}
            if not kids:
                break
            t = min(kids, key=lambda k: (-kids[k], k))
            p *= kids[t] / sum(kids.values())
            if p < min_token_prob:
                break
            toks.append(t)
            probs.append(p)
            path = path + (t,)
        if sum(probs) >= best.score:
            best = Proposal(toks, probs, m, sum(probs))
    return best


def build(seqs, depth):
    trie = SuffixTrie(depth)
    for i, seq in enumerate(seqs):
        trie.extend(i, seq)
    return trie


# --- SuffixTrie: structure -------------------------------------------------------------

def test_max_depth_validated():
    with pytest.raises(ValueError):
        SuffixTrie(0)


@FAST
@given(st.lists(small_seq, max_size=4), depths, st.lists(small_seq, min_size=1, max_size=6))
def test_trie_matches_reference(seqs, depth, contexts):
    trie = build(seqs, depth)
    ref = reference_counts(seqs, depth)
    assert trie.paths() == ref
    assert trie.num_nodes == len(ref)
    assert len(trie) == len(seqs)
    for ctx in contexts:
        for k in (0, 1, 4):
            assert trie.propose(ctx, k, **KNOBS) == reference_propose(ref, depth, ctx, k, **KNOBS)


@FAST
@given(st.lists(st.tuples(small_seq, st.lists(st.integers(0, 25), max_size=4)), max_size=4),
       depths, st.lists(small_seq, min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_incremental_extend_equals_bulk(seqs_cuts, depth, contexts, rnd):
    bulk = build([s for s, _ in seqs_cuts], depth)
    # the same sequences grown in chunks, the chunks of different sequences interleaved
    chunks = []
    for i, (seq, cuts) in enumerate(seqs_cuts):
        bounds = [0] + sorted(c for c in cuts if c <= len(seq)) + [len(seq)]
        chunks.append([(i, seq[a:b]) for a, b in zip(bounds, bounds[1:])])
    inc = SuffixTrie(depth)
    while any(chunks):
        pending = [c for c in chunks if c]
        sid, piece = rnd.choice(pending).pop(0)
        inc.extend(sid, piece)
    assert inc.paths() == bulk.paths()
    assert inc.num_nodes == bulk.num_nodes
    for ctx in contexts:
        assert inc.propose(ctx, 5, **KNOBS) == bulk.propose(ctx, 5, **KNOBS)


@FAST
@given(st.lists(small_seq, max_size=4), st.lists(small_seq, min_size=1, max_size=3), depths,
       st.lists(small_seq, min_size=1, max_size=4))
def test_remove_restores_prior_state(base, extra, depth, contexts):
    trie = build(base, depth)
    before_paths, before_nodes = trie.paths(), trie.num_nodes
    before_props = [trie.propose(c, 5, **KNOBS) for c in contexts]
    # proposals fill the cached best children before the extra counts arrive and leave
    for j, seq in enumerate(extra):
        trie.extend(("extra", j), seq)
        for c in contexts:
            trie.propose(c, 5, **KNOBS)
    order = list(range(len(extra)))
    if len(extra) % 2:  # removal order does not matter
        order.reverse()
    for j in order:
        trie.remove(("extra", j))
    assert trie.paths() == before_paths
    assert trie.num_nodes == before_nodes
    assert [trie.propose(c, 5, **KNOBS) for c in contexts] == before_props
    assert ("extra", 0) not in trie and len(trie) == len(base)


@FAST
@given(st.lists(small_seq, min_size=1, max_size=5), depths, st.randoms(use_true_random=False))
def test_remove_in_any_order_equals_rebuild(seqs, depth, rnd):
    trie = build(seqs, depth)
    order = list(range(len(seqs)))
    rnd.shuffle(order)
    for n, sid in enumerate(order, start=1):
        trie.remove(sid)
        left = [seqs[i] for i in sorted(order[n:])]
        assert trie.paths() == reference_counts(left, depth)
        assert trie.num_nodes == len(reference_counts(left, depth))
    assert trie.num_nodes == 0 and len(trie) == 0


def test_extend_grows_a_sequence_in_place():
    trie = SuffixTrie(4)
    trie.extend("r", [1, 2])
    trie.extend("r", iter([3]))  # any iterable
    assert "r" in trie and len(trie) == 1
    assert trie.paths() == reference_counts([[1, 2, 3]], 4)


@FAST
@given(st.lists(st.tuples(st.integers(0, 3), small_seq), min_size=1, max_size=12), depths,
       st.lists(small_seq, min_size=1, max_size=3))
def test_interleaved_extends_and_removes_equal_rebuild(ops, depth, contexts):
    """Sequences grown in pieces, removed and started again in any interleaving: freed
    node ids are reused, and the counts and proposals equal a trie built from scratch
    over what is left."""
    trie, live = SuffixTrie(depth), {}
    for sid, toks in ops:
        if sid in live and not toks:  # an empty piece on a live sequence: remove it
            trie.remove(sid)
            del live[sid]
        else:
            trie.extend(sid, toks)
            live[sid] = live.get(sid, []) + toks
        for c in contexts:
            trie.propose(c, 5, **KNOBS)  # fills cached best children that later ops must keep valid
    ref = build(list(live.values()), depth)
    assert trie.paths() == reference_counts(list(live.values()), depth)
    assert trie.num_nodes == ref.num_nodes
    assert [trie.propose(c, 5, **KNOBS) for c in contexts] == [ref.propose(c, 5, **KNOBS) for c in contexts]
    assert [trie.propose_tree(c, 6, 3, **KNOBS) for c in contexts] == \
        [ref.propose_tree(c, 6, 3, **KNOBS) for c in contexts]


def test_freed_nodes_are_reused_not_grown():
    rng = random.Random(3)
    trie = SuffixTrie(8)
    peak = 0
    for i in range(60):  # a sliding window of 5 live sequences, as the cache's eviction keeps
        trie.extend(i, [rng.randrange(50) for _ in range(40)])
        peak = max(peak, trie.num_nodes)
        if i >= 5:
            trie.remove(i - 5)
    assert trie.capacity <= peak + 1
    for i in range(55, 60):
        trie.remove(i)
    assert trie.num_nodes == 0 and trie.capacity == 1  # empty: the memory goes back


def test_the_trie_adds_no_objects_for_the_garbage_collector():
    """A full collection walks every tracked object, stalling every thread that needs the
    GIL; at the cache's default bound an object per node made that 390 ms. Nodes are
    ints in lists and dicts of ints, which CPython leaves untracked."""
    import gc
    cache = SuffixCache(max_depth=24, max_nodes=50_000)
    rng = random.Random(0)
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(40):
        cache.add(None, [rng.randrange(3000) for _ in range(300)])
    gc.collect()
    assert cache.stats()["nodes"] > 40_000
    assert len(gc.get_objects()) - before < 200  # per sequence and trie, never per node


# --- SuffixTrie: proposals by hand -----------------------------------------------------

def test_repeated_phrase_is_proposed():
    trie = build([[10, 1, 2, 3, 4, 5, 11]], 8)
    p = trie.propose([9, 9, 1, 2], 8, max_spec_factor=2.0)
    # the 2-token match allows 4 tokens and beats the 1-token match's 2
    assert p == Proposal([3, 4, 5, 11], [1.0, 1.0, 1.0, 1.0], 2, 4.0)


def test_counts_pick_the_frequent_continuation():
    trie = build([[1, 2, 3], [1, 2, 3], [1, 2, 4]], 8)
    p = trie.propose([1, 2], 1, max_spec_factor=4.0)
    assert p.tokens == [3]
    assert p.probs == pytest.approx([2 / 3])
    assert p.match_len == 2


def test_ties_go_to_the_smallest_token():
    trie = build([[1, 7], [1, 3], [1, 5]], 4)
    assert trie.propose([1], 1, min_token_prob=0.0).tokens == [3]


def test_min_token_prob_stops_a_branching_walk():
    trie = build([[1, 2, 3, 9], [1, 2, 4, 9]], 8)
    # after [1]: 2 (p = 1), then 3 or 4 (p = 1/2 each, tie to 3), then 9 (p stays 1/2)
    assert trie.propose([1], 5, max_spec_factor=10, min_token_prob=0.6).tokens == [2]
    low = trie.propose([1], 5, max_spec_factor=10, min_token_prob=0.4)
    assert low.tokens == [2, 3, 9]
    assert low.probs == pytest.approx([1.0, 0.5, 0.5])
    assert low.score == pytest.approx(2.0)


def test_max_spec_factor_and_offset_limit_length_by_match():
    trie = build([list(range(1, 11))], 16)
    assert trie.propose([1, 2], 8).tokens == [3, 4]  # factor 1: as long as the match
    assert trie.propose([1, 2], 8, max_spec_factor=0.5).tokens == [3]
    assert trie.propose([1, 2], 8, max_spec_offset=1).tokens == [3, 4, 5]
    assert trie.propose([1, 2], 2, max_spec_factor=10).tokens == [3, 4]  # max_tokens caps


def test_depth_bounds_match_and_walk():
    trie = build([[1, 2, 3, 4, 5]], 3)
    # matches are at most max_depth - 1 = 2 tokens long. The match [2, 3] sits at depth 2:
    # one token more reaches max_depth and ends its walk (score 1); the match [3] has room
    # for two and scores higher
    p = trie.propose([1, 2, 3], 8, max_spec_factor=10)
    assert p == Proposal([4, 5], [1.0, 1.0], 1, 2.0)
    assert trie.propose([1, 2, 3], 1, max_spec_factor=10) == Proposal([4], [1.0], 2, 1.0)
    assert SuffixTrie(1).propose([1], 4) == Proposal()  # no room to match and propose


def test_no_match_gives_the_empty_proposal():
    trie = build([[1, 2, 3]], 4)
    assert trie.propose([7], 4) == Proposal()
    assert trie.propose([], 4) == Proposal()
    assert SuffixTrie().propose([1, 2], 4) == Proposal()
    assert trie.propose([1, 2], 0) == Proposal()
    with pytest.raises(ValueError):
        trie.propose([1], -1)


# --- SuffixCache ------------------------------------------------------------------------

def test_cache_validates_bounds():
    for kw in (dict(max_depth=0), dict(max_nodes=0), dict(max_sequences=0)):
        with pytest.raises(ValueError):
            SuffixCache(**kw)


def _reference_total(retained, depth):
    """Nodes of the retained (scope, tokens) sequences, one trie per scope."""
    by_scope = {}
    for scope, toks in retained:
        by_scope.setdefault(scope, []).append(toks)
    return sum(len(reference_counts(seqs, depth)) for seqs in by_scope.values())


@FAST
@given(st.lists(st.tuples(st.sampled_from([None, "a", "b"]),
                          st.lists(st.integers(0, 4), min_size=1, max_size=15)),
                min_size=1, max_size=8),
       st.integers(1, 60), st.one_of(st.none(), st.integers(1, 4)), st.integers(1, 5))
def test_cache_bound_and_fifo_against_a_model(adds, max_nodes, max_seqs, depth):
    cache = SuffixCache(max_depth=depth, max_nodes=max_nodes, max_sequences=max_seqs)
    retained, evictions = [], 0
    for scope, toks in adds:
        cache.add(scope, toks)
        # the model: append, drop the oldest while over a bound, then cut the newest
        # alone to its longest tail that fits
        retained.append((scope, toks))
        while len(retained) > 1 and (_reference_total(retained, depth) > max_nodes
                                     or (max_seqs is not None and len(retained) > max_seqs)):
            retained.pop(0)
            evictions += 1
        if _reference_total(retained, depth) > max_nodes:
            keep = max(m for m in range(1, len(toks) + 1)
                       if len(reference_counts([toks[-m:]], depth)) <= max_nodes)
            retained = [(scope, toks[-keep:])]
        s = cache.stats()
        assert s["nodes"] <= max_nodes
        assert max_seqs is None or s["sequences"] <= max_seqs
        assert s["nodes"] == _reference_total(retained, depth)
        assert s["sequences"] == len(retained)
        assert s["scopes"] == len({sc for sc, _ in retained})
        assert s["evictions"] == evictions
        for sc in (None, "a", "b"):
            ref = reference_counts([t for c, t in retained if c == sc], depth)
            for ctx in (toks[:2], toks[-1:], [0, 1]):
                assert cache.propose(sc, ctx, 4, **KNOBS) == \
                    reference_propose(ref, depth, ctx, 4, **KNOBS)


def test_fifo_evicts_the_oldest():
    cache = SuffixCache(max_depth=4, max_sequences=2)
    cache.add(None, [1, 2, 3])
    cache.add(None, [4, 5, 6])
    cache.add("k", [7, 8, 9])  # FIFO runs across scopes
    assert cache.propose(None, [1], 2).tokens == []
    assert cache.propose(None, [4], 2, max_spec_factor=2).tokens == [5, 6]
    assert cache.propose("k", [7], 2, max_spec_factor=2).tokens == [8, 9]
    assert cache.stats()["evictions"] == 1

    # by nodes: each of these sequences makes 4 * 6 - 6 = 18 distinct nodes at depth 4
    cache = SuffixCache(max_depth=4, max_nodes=40)
    for base in (0, 10, 20):
        cache.add(None, [base + i for i in range(6)])
    s = cache.stats()
    assert (s["sequences"], s["nodes"], s["evictions"]) == (2, 36, 1)
    assert cache.propose(None, [0], 1).tokens == []
    assert cache.propose(None, [10], 1).tokens == [11]


def test_a_sequence_too_big_alone_keeps_its_tail():
    cache = SuffixCache(max_depth=4, max_nodes=10)
    cache.add("x", [50, 51])
    cache.add(None, list(range(20)))  # m distinct tokens make 4m - 6 nodes: 4 fit
    s = cache.stats()
    assert (s["nodes"], s["sequences"], s["scopes"], s["truncations"]) == (10, 1, 1, 1)
    assert cache.propose(None, [15], 2).tokens == []
    assert cache.propose(None, [16, 17], 2).tokens == [18, 19]
    assert cache.propose("x", [50], 1) == Proposal()


def test_empty_add_is_ignored_and_clear_empties():
    cache = SuffixCache(max_depth=4)
    cache.add(None, [])
    assert cache.stats()["sequences"] == 0
    cache.add(None, [1, 2, 3])
    cache.add("a", [1, 2, 3])
    cache.clear()
    s = cache.stats()
    assert (s["scopes"], s["sequences"], s["nodes"]) == (0, 0, 0)
    assert cache.propose(None, [1], 2) == Proposal()


@FAST
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=12), max_size=4),
       st.lists(st.lists(st.integers(5, 9), min_size=1, max_size=12), min_size=1, max_size=4),
       st.lists(st.integers(0, 9), max_size=6))
def test_scopes_never_see_each_others_text(a_texts, b_texts, probe):
    cache = SuffixCache(max_depth=6, max_nodes=10_000)
    for t in a_texts:
        cache.add(scope_of("key-a"), t)
    for t in b_texts:
        cache.add(scope_of("key-b"), t)
    # contexts taken from B's text itself tempt scope A and the shared scope to answer
    for ctx in [probe] + [t[:i] for t in b_texts for i in range(1, len(t) + 1)]:
        for scope in (scope_of("key-a"), None):
            p = cache.propose(scope, ctx, 6, max_spec_factor=6, min_token_prob=0.0)
            assert all(tok < 5 for tok in p.tokens)


def test_threads_share_the_cache_and_the_bound_holds():
    cache = SuffixCache(max_depth=6, max_nodes=300, max_sequences=40)
    errors = []

    def worker(w):
        rnd = random.Random(w)
        scope = scope_of(f"key-{w % 3}") if w % 4 else None
        try:
            for _ in range(60):
                toks = [rnd.randrange(6) for _ in range(rnd.randrange(1, 20))]
                cache.add(scope, toks)
                p = cache.propose(scope, toks[:3], 4, min_token_prob=0.0)
                assert len(p.tokens) <= 4
                s = cache.stats()
                assert s["nodes"] <= 300 and s["sequences"] <= 40
        except Exception as e:  # noqa: BLE001 - a thread's failure must reach the test
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = cache.stats()
    assert 0 < s["nodes"] <= 300 and 0 < s["sequences"] <= 40
    assert s["evictions"] + s["sequences"] == 8 * 60


def test_scope_of_hashes_keys():
    assert scope_of(None) is None and scope_of("") is None
    h = scope_of("sk-secret")
    assert h == hashlib.sha256(b"sk-secret").hexdigest()[:16]
    assert h == scope_of("sk-secret") and h != scope_of("sk-secreu")
    assert len(h) == 16 and "secret" not in h
