"""Exact verification of draft trees (verify/tree.py) in the engine, native backend.

A fake drafter proposes random trees around the reference continuation: along one path the
reference's next token with a per-row probability (else a wrong token), and beside it wrong
siblings, before or after it in the node order, some with children of their own. Whatever
the tree, greedy output equals plain decoding's and seeded output is byte-identical to
seeded plain decoding's; at temperature 1 with a generator the emitted tokens are
distributed as the target's (PIT). Each tree fault of the audit's fault suite breaks the
greedy equality here, so the equality is a test that can fail.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.tiny import assert_varied, engine_pit, native_from_hf, tiny_hf
from verispec.drafters import Drafter
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.policy import FixedK
from verispec.sampling import SamplingParams
from verispec.verify.tree import DraftTree, depths, is_chain, layout, walk

V = 61
_M = {}


def _target():
    """A tiny random target whose attention is sharp (queries and keys scaled up 8x): at
    HF's init its attention is nearly uniform, so a key at the wrong position or one key
    too many barely moves a logit, and a tree fault of that kind could pass unseen."""
    if "t" not in _M:
        hf = tiny_hf("llama", seed=11, vocab=V, embed_scale=20.0)
        with torch.no_grad():
            for layer in hf.model.layers:
                layer.self_attn.q_proj.weight.mul_(8.0)
                layer.self_attn.k_proj.weight.mul_(8.0)
        _M["t"] = native_from_hf(hf)
        g = torch.Generator().manual_seed(1)
        _M["prompts"] = [torch.randint(0, V, (int(n),), generator=g).tolist()
                         for n in torch.randint(1, 25, (32,), generator=g)]
    return _M["t"], _M["prompts"]


def _reference(sampling: SamplingParams, n: int = 24) -> dict:
    """Plain decoding's outputs of the 32 prompts, keyed by prompt."""
    key = repr(sampling)
    if key not in _M:
        target, prompts = _target()
        eng = Engine(target, config=EngineConfig(max_batch=16, max_len=80))
        reqs = [Request(p, GenerationParams(max_new_tokens=n, sampling=sampling)) for p in prompts]
        eng.run(reqs)
        _M[key] = {tuple(p): r.output_ids for p, r in zip(prompts, reqs)}
        assert_varied([r.output_ids for r in reqs])
    return _M[key]


class TreeOracle(Drafter):
    """Random draft trees around the reference continuation (see the module docstring)."""

    name = "tree-oracle"

    def __init__(self, ref, rate: float, width: int, seed: int):
        self.ref, self.rate, self.tree_width = ref, rate, width
        self.g = torch.Generator().manual_seed(seed)
        self.prompt = {}
        self.trees = 0  # proposals that branched

    def _u(self) -> float:
        return float(torch.rand(1, generator=self.g))

    def _other(self, avoid: set) -> int:
        while True:
            t = int(torch.randint(0, V, (1,), generator=self.g))
            if t not in avoid:
                return t

    def admit(self, rows, tokens):
        for r, t in zip(rows, tokens):
            self.prompt[r] = list(t)

    def prepare(self, rows, tokens):
        pass

    def _tree(self, cont: list[int], done: int, k: int):
        toks, parents = [], []
        parent, pos, leaves, on_path = -1, done, 1, True
        while len(toks) < k:
            right = cont[pos] if pos < len(cont) else 0
            main = right if on_path and self._u() < self.rate else self._other({right})
            kids = [main]
            if leaves < self.tree_width and len(toks) + 2 <= k and self._u() < 0.6:
                kids.append(self._other({main}))
                leaves += 1
            if len(kids) > 1 and self._u() < 0.5:
                kids.reverse()  # the path's node after a sibling: a later slot, a later sibling
            main_idx = None
            for t in kids:
                toks.append(t)
                parents.append(parent)
                if t == main:
                    main_idx = len(toks) - 1
            if len(kids) > 1 and len(toks) < k and self._u() < 0.5:
                sib = next(i for i in range(len(toks) - len(kids), len(toks)) if i != main_idx)
                toks.append(self._other(set()))  # a child under the sibling: a subtree off the path
                parents.append(sib)
            on_path = on_path and main == right
            parent, pos = main_idx, pos + 1
        return toks[:k], parents[:k]

    def propose(self, rows, tokens, k, sampling, generators):
        K = max(k)
        out = torch.zeros(len(rows), K, dtype=torch.long)
        found = []
        for b, (row, seq) in enumerate(zip(rows, tokens)):
            prompt = self.prompt[row]
            cont = self.ref[tuple(prompt)]
            toks, parents = self._tree(cont, len(seq) - len(prompt), k[b])
            DraftTree(toks, parents)  # a valid tree: distinct siblings, parents first
            out[b, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            found.append(parents)
            self.trees += not is_chain(parents)
        self.found_parents = found
        return out, None, torch.tensor([len(p) for p in found])

    def rollback(self, rows, committed):
        pass

    def release(self, rows):
        pass


class TargetTree(Drafter):
    """Trees grown best-first from the target's own probabilities at the row's current
    prefix (a forward per node on a cache of its own): at T > 0 the target takes many of
    its branches, the later siblings included."""

    name = "target-tree"

    def __init__(self, target, width: int):
        self.target, self.tree_width = target, width
        self.cache = target.new_cache(1, 128)

    def admit(self, rows, tokens):
        pass

    def prepare(self, rows, tokens):
        pass

    def _probs(self, seq):
        self.cache.truncate([0], [0])
        logits = self.target.forward(torch.tensor([seq]), self.cache, [0], last_only=True)[0]
        return logits.softmax(-1)

    def propose(self, rows, tokens, k, sampling, generators):
        import heapq
        out = torch.zeros(len(rows), max(k), dtype=torch.long)
        found = []
        for b, seq in enumerate(tokens):
            toks, parents, leaves = [], [], 0
            heap = [(-float(q), int(t), -1, [int(t)]) for q, t in zip(*self._probs(seq).topk(self.tree_width))]
            heapq.heapify(heap)
            kids = {}
            while heap and len(toks) < k[b]:
                negq, t, parent, path = heapq.heappop(heap)
                grows = parent == -1 or kids.get(parent, 0) > 0
                if leaves + grows > self.tree_width:
                    continue
                leaves += grows
                kids[parent] = kids.get(parent, 0) + 1
                toks.append(t)
                parents.append(parent)
                q, ts = self._probs(seq + path).topk(self.tree_width)
                for qi, ti in zip(q.tolist(), ts.tolist()):
                    heapq.heappush(heap, (negq * qi, ti, len(toks) - 1, path + [ti]))
            out[b, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            found.append(parents)
        self.found_parents = found
        return out, None, torch.tensor([len(p) for p in found])

    def rollback(self, rows, committed):
        pass

    def release(self, rows):
        pass


def _run(target, drafter, k, batch, sampling, n=24, hooks=None):
    ref = drafter.ref
    eng = Engine(target, drafter, FixedK(k), EngineConfig(max_batch=batch, max_len=80), hooks=hooks)
    reqs = [Request(list(p), GenerationParams(max_new_tokens=min(n, len(out)), sampling=sampling))
            for p, out in ref.items()]
    eng.run(reqs)
    assert eng.cache.rows_in_use == 0
    return reqs


# -- pure functions -------------------------------------------------------------------

def test_layout_and_walk():
    #        root
    #       /    \
    #     5(0)   7(1)
    #     |        \
    #     6(2)     8(3)
    parents, toks = [-1, -1, 0, 1], [5, 7, 6, 8]
    assert depths(parents) == [1, 1, 2, 2]
    depth, vis = layout([parents], 5)
    assert depth[0].tolist() == [0, 1, 1, 2, 2]
    assert vis[0, 4].tolist() == [True, False, True, False, True]  # node 3 sees root, node 1, itself
    assert vis[0, 3].tolist() == [True, True, False, True, False]
    drawn = {0: 7, 2: 8, 4: 9}  # slot -> the target's token there
    w = walk(parents, toks, lambda slot, d: drawn[slot])
    assert w.slots == [0, 2, 4] and w.tokens == [7, 8, 9] and w.accepted == 2
    w = walk(parents, toks, lambda slot, d: 3)
    assert w.slots == [0] and w.tokens == [3]
    with pytest.raises(ValueError):
        DraftTree([1, 1], [-1, -1])  # two siblings with one token
    with pytest.raises(ValueError):
        DraftTree([1, 2], [1, -1])  # a parent after its child


# -- greedy and seeded exactness ---------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 4, 16])
def test_greedy_trees_equal_plain(batch):
    target, _ = _target()
    ref = _reference(SamplingParams(temperature=0.0))
    drafter = TreeOracle(ref, rate=0.8, width=4, seed=batch)
    reqs = _run(target, drafter, 6, batch, SamplingParams(temperature=0.0))
    assert drafter.trees > 50
    accepted = sum(r.stats.accepted for r in reqs)
    assert accepted > 100  # the trees were taken, not only proposed
    for r in reqs:
        assert r.output_ids == ref[tuple(r.prompt_ids)]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 12), k=st.integers(2, 7), width=st.integers(2, 4),
       rate=st.sampled_from([0.3, 0.7, 1.0]), seed=st.integers(0, 2**16))
def test_any_tree_equals_plain(batch, k, width, rate, seed):
    target, _ = _target()
    ref = _reference(SamplingParams(temperature=0.0))
    reqs = _run(target, TreeOracle(ref, rate, width, seed), k, batch, SamplingParams(temperature=0.0), n=12)
    for r in reqs:
        assert r.output_ids == ref[tuple(r.prompt_ids)][:12]


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_seeded_trees_byte_identical(batch):
    target, _ = _target()
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    ref = _reference(sp)
    drafter = TreeOracle(ref, rate=0.9, width=3, seed=7 + batch)
    reqs = _run(target, drafter, 5, batch, sp)
    assert sum(r.stats.accepted for r in reqs) > 100
    for r in reqs:
        assert r.output_ids == ref[tuple(r.prompt_ids)]


def test_sampled_trees_follow_the_target():
    """Unseeded sampling: the walk draws every emitted token from p with the request's
    generator, so the tokens' randomised PIT under the teacher-forced p is uniform, with
    hundreds of tokens accepted off trees, many off a later sibling."""
    from scipy import stats

    target, prompts = _target()
    sp = SamplingParams(temperature=0.15)  # the tiny target is nearly flat at 1.0 (top token ~3% of 61)
    drafter = TargetTree(target, width=3)
    reqs = []
    for rep in range(3):
        eng = Engine(target, drafter, FixedK(5), EngineConfig(max_batch=16, max_len=80, trace=True))
        batch = [Request(list(p), GenerationParams(max_new_tokens=24, sampling=sp)) for p in prompts]
        for i, r in enumerate(batch):
            r.generator = torch.Generator().manual_seed(1000 * rep + i)
        eng.run(batch)
        reqs += batch
    off_first = sum(1 for r in reqs for (_, line, acc, _), tree in zip(r.stats.trace, r.stats.trace_trees)
                    if tree is not None and acc and line[0] != tree[0][0])
    assert sum(r.stats.accepted for r in reqs) > 300 and off_first > 50  # later siblings taken too
    u = engine_pit(target, reqs, torch.Generator().manual_seed(0), temperature=0.15)
    assert len(u) > 2000
    print(f"sampled trees: {sum(r.stats.accepted for r in reqs)} accepted, {off_first} steps off a later "
          f"sibling, KS p = {stats.kstest(u.numpy(), 'uniform').pvalue:.3g} over {len(u)} tokens")
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3


# -- the tree faults break it ----------------------------------------------------------------

@pytest.mark.parametrize("fault", ["tree-sibling-leak", "tree-position-off-by-one", "tree-compare-wrong-node"])
def test_tree_faults_break_greedy_equality(fault):
    from verispec.audit.faults import build

    target, _ = _target()
    ref = _reference(SamplingParams(temperature=0.0))
    f = build(fault)
    drafter = TreeOracle(ref, rate=0.8, width=4, seed=5)
    reqs = _run(target, drafter, 6, 8, SamplingParams(temperature=0.0), hooks=f.step)
    assert any(r.output_ids != ref[tuple(r.prompt_ids)] for r in reqs)


@pytest.mark.parametrize("fault", ["tree-sibling-leak", "tree-position-off-by-one", "tree-compare-wrong-node"])
def test_tree_fault_stays_in_its_engine(fault):
    """A faulty engine and a correct one on the same target, stepped in turn with the same
    trees: the correct one's greedy output is plain decoding's, the faulty one's is not."""
    from verispec.audit.faults import build

    target, _ = _target()
    ref = _reference(SamplingParams(temperature=0.0))
    engines, reqs = {}, {}
    for f in (None, fault):
        drafter = TreeOracle(ref, rate=0.8, width=4, seed=5)
        engines[f] = Engine(target, drafter, FixedK(6), EngineConfig(max_batch=8, max_len=80),
                            hooks=None if f is None else build(f).step)
        reqs[f] = [Request(list(p), GenerationParams(max_new_tokens=min(24, len(out))))
                   for p, out in ref.items()]
        for r in reqs[f]:
            engines[f].add(r)
    while any(e.has_work for e in engines.values()):
        for e in engines.values():
            if e.has_work:
                e.step()
    assert all(r.output_ids == ref[tuple(r.prompt_ids)] for r in reqs[None])
    assert any(r.output_ids != ref[tuple(r.prompt_ids)] for r in reqs[fault])
