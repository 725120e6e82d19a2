"""Drafter consistency: did the drafter propose what a correct drafter proposes?

The target verifies every draft, so a drafter whose state is wrong (a draft cache that
missed a token, a stale n-gram table) leaves greedy output exact and only costs
acceptance: equivalence cannot see it. Each request's trace records, per step, the
sequence length before the step, the drafted tokens and how many were accepted. From the
final sequence we recompute what a correct drafter proposes from each committed prefix
and compare, over the accepted drafts plus the first rejected one (later drafts were
conditioned on a rejected token and cannot be recomputed from the final sequence):

* prompt lookup: `lookup_continuation` on the prefix (exact, integer logic);
* a replayable drafter (suffix decoding without its global cache): a fresh replica of it
  (Drafter.replica) fed the same prefixes (exact; with the global cache a draft depends on
  earlier requests and is not replayed);
* layer-skip: the target's first N layers + final norm + head, teacher-forced;
* draft model: the draft model, teacher-forced; greedy drafts are its argmax.

Model drafters count a mismatch as a near-tie when the drafted token's logit is within the
draft model's tie margin of the argmax in the teacher-forced draft logits (kernels differ):
TIE_MARGIN on an fp32 backend, the measured batching noise on a noisy one (tie_margin_for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..drafters.lookup import lookup_continuation
from ..sampling import SamplingParams
from .checks import CheckResult
from .context import AuditContext, GreedyRuns
from .equivalence import TIE_MARGIN, prefix_cache, teacher_forced_logits, tie_margin_for

MAX_LISTED = 20


@dataclass(frozen=True)
class Oracle:
    kind: str  # "lookup" | "replay" | "model"
    max_ngram: int = 0  # lookup
    drafter: object = None  # replay: the replayable drafter, whose replica() a request replays on
    model: object = None  # model: the CausalLM whose argmax a greedy draft is
    num_layers: int | None = None  # layer-skip depth


def oracle_for(drafter, target_model) -> Oracle | None:
    """What a greedy draft of this drafter is, from what it states (drafters/base.py): the
    continuation prompt lookup copies, or the argmax of its draft model or of the target's
    first layers. None: nothing to recompute its drafts from."""
    if drafter.lookup_ngram is not None:
        return Oracle("lookup", max_ngram=drafter.lookup_ngram)
    if drafter.replayable:
        return Oracle("replay", drafter=drafter)
    if drafter.draft_layers is not None:
        return Oracle("model", model=target_model, num_layers=drafter.draft_layers)
    if drafter.draft_model is not None:
        return Oracle("model", model=drafter.draft_model)
    return None


@dataclass(frozen=True)
class _Replay:
    """What one request's steps are checked against: its final sequence, the draft model's
    teacher-forced logits and their argmax (a model oracle), the replica fed its prefixes as
    they grow (a replayable drafter)."""

    oracle: Oracle
    full: list[int]  # prompt + output
    P: int  # prompt length
    k: int  # the audited draft length: what a step asks for is capped at it
    logits: Any  # [len(full) - P + 1, V]: row j is the draft's output at position P - 1 + j (model), else None
    best: list[int] | None  # the argmax of each row of logits
    replica: Any  # one replica of the drafter per request (replay), else None
    tie_margin: float


def check_request(oracle: Oracle, req, k: int, logits_cache: dict,
                  tie_margin: float = TIE_MARGIN, prefixes=None) -> tuple[int, int, list[dict]]:
    """-> (positions compared, near-ties, mismatches) for one finished greedy request.
    prefixes: the draft model's prompt prefills to reuse (equivalence.prefix_cache)."""
    full, P = req.tokens, len(req.prompt_ids)
    logits = best = None
    if oracle.kind == "model":
        logits, best = _draft_logits(oracle, full, P, logits_cache, prefixes)
    replica = None
    if oracle.kind == "replay":  # one replica per request, fed as its prefixes grow
        replica = oracle.drafter.replica()
        replica.admit([0], [full[:P]])
    rp = _Replay(oracle, full, P, k, logits, best, replica, tie_margin)
    compared, ties, bad = 0, 0, []
    trees = req.stats.trace_trees or [None] * len(req.stats.trace)
    proposed = req.stats.trace_asked or [a for _, _, _, a in req.stats.trace]
    for step, ((n0, drafted, acc, asked), tree, ask) in enumerate(zip(req.stats.trace, trees, proposed)):
        c, t, b = _check_step(rp, step, n0, drafted, acc, asked, tree, ask)
        compared, ties = compared + c, ties + t
        bad += b
    return compared, ties, bad


def _draft_logits(oracle: Oracle, full: list[int], P: int, logits_cache: dict, prefixes):
    """The draft model's teacher-forced logits over full and their argmax, once per sequence."""
    key = tuple(full)
    if key not in logits_cache:
        # [len(full) - P + 1, V]: row j is the draft's output at position P - 1 + j
        lg = teacher_forced_logits(oracle.model, full, first=P - 1, num_layers=oracle.num_layers,
                                   prefixes=prefixes)
        logits_cache[key] = (lg, lg.argmax(-1).tolist())  # sync: one transfer per sequence
    return logits_cache[key]


def _check_step(rp: _Replay, step: int, n0: int, drafted: list[int], acc: int, asked: int, tree,
                ask: int) -> tuple[int, int, list[dict]]:
    """One step of the trace against what a correct drafter proposes from full[:n0]: ->
    (positions compared, near-ties, mismatches). A step with another number of drafts than
    a correct drafter's is one mismatch."""
    k_eff = min(asked, rp.k)  # what the engine asked the drafter for (policy choice, capped)
    if rp.oracle.kind == "replay" and rp.replica.tree_width > 1 and k_eff:
        return _check_tree_step(rp, step, n0, drafted, k_eff, tree, ask)
    expected = None
    if rp.oracle.kind in ("lookup", "replay"):
        expected = _expected_chain(rp, n0, k_eff, ask)
        if len(drafted) != len(expected):
            return 0, 0, [{"step": step, "position": n0, "drafted": drafted, "expected": expected,
                           "why": f"{len(drafted)} drafts where a correct drafter finds {len(expected)}"}]
    elif len(drafted) != k_eff:
        return 0, 0, [{"step": step, "position": n0, "drafted": drafted,
                       "why": f"{len(drafted)} drafts, {k_eff} asked for"}]
    return _compare_drafts(rp, step, n0, drafted, acc, expected)


def _check_tree_step(rp: _Replay, step: int, n0: int, drafted: list[int], k_eff: int, tree,
                     ask: int) -> tuple[int, int, list[dict]]:
    """A tree drafter's step: its whole proposal is a function of the prefix, asked for `ask`
    nodes and kept to the verified prefix by the policy; the tree must be the replica's."""
    want = _replayed(rp.replica, rp.full[:n0], min(ask, rp.k))
    chain = drafted[:k_eff]  # a step whose kept drafts do not branch is a chain
    got = tree if tree is not None else (chain, list(range(-1, len(chain) - 1)))
    exp = (want[0][:k_eff], want[1][:k_eff])
    if (list(got[0]), list(got[1])) != (list(exp[0]), list(exp[1])):
        return 0, 0, [{"step": step, "position": n0, "drafted": list(got[0]), "parents": list(got[1]),
                       "expected": list(exp[0]), "expected_parents": list(exp[1])}]
    return len(got[0]), 0, []


def _expected_chain(rp: _Replay, n0: int, k_eff: int, ask: int) -> list[int]:
    """What a correct lookup or replayed drafter drafts from full[:n0] when asked for k_eff."""
    if not k_eff:
        return []
    if rp.replica is not None:
        # proposed with what the drafter was asked for, kept to what was verified
        return _replayed(rp.replica, rp.full[:n0], min(ask, rp.k))[0][:k_eff]
    return lookup_continuation(rp.full[:n0], k_eff, rp.oracle.max_ngram)


def _compare_drafts(rp: _Replay, step: int, n0: int, drafted: list[int], acc: int,
                    expected: list[int] | None) -> tuple[int, int, list[dict]]:
    """The step's accepted drafts and its first rejected one, each against the expected chain
    (lookup, replay) or the draft model's argmax, where a gap below the tie margin is a
    near-tie (numerics)."""
    compared, ties, bad = 0, 0, []
    for i in range(min(acc + 1, len(drafted))):
        pos = n0 - 1 + i  # the draft at i predicts the token at pos + 1
        if pos >= len(rp.full) or rp.full[n0:n0 + i] != drafted[:i]:
            break  # the request stopped inside the accepted drafts: no committed context
        compared += 1
        if rp.oracle.kind in ("lookup", "replay"):
            if drafted[i] != expected[i]:
                bad.append({"step": step, "position": pos + 1, "drafted": drafted[i], "expected": expected[i]})
            continue
        j = pos - (rp.P - 1)
        if drafted[i] == rp.best[j]:
            continue
        gap = float(rp.logits[j, rp.best[j]] - rp.logits[j, drafted[i]])  # >= 0; tiny: numerics (sync: rare)
        if gap < rp.tie_margin:
            ties += 1
        else:
            bad.append({"step": step, "position": pos + 1, "drafted": drafted[i], "expected": rp.best[j],
                        "logit_gap": gap})
    return compared, ties, bad


def _replayed(replica, prefix: list[int], n: int) -> tuple[list[int], list[int]]:
    """(drafts, their parents) that a replica, admitted on row 0, proposes from prefix when
    asked for n: the parents its propose() found (a tree drafter's), else a chain's."""
    drafts, _, num = replica.propose([0], [prefix], [n], [SamplingParams(temperature=0.0)], [None])
    tokens = drafts[0, :int(num[0])].tolist()
    if replica.tree_width > 1:
        return tokens, list(replica.found_parents[0])
    return tokens, list(range(-1, len(tokens) - 1))


def drafter_consistency_check(ctx: AuditContext, runs: GreedyRuns) -> CheckResult:
    probe = ctx.drafter_factory(1, 8)
    oracle = oracle_for(probe, ctx.model)
    name = probe.name
    if oracle is None:
        return CheckResult(True,
                           f"not applicable: no reference implementation for drafter {name!r}",
                           {"drafter": name, "applicable": False}, informational=True)
    logits_cache: dict = {}
    prefixes = prefix_cache() if oracle.kind == "model" else None  # each prompt prefilled once
    tie = tie_margin_for(oracle.model) if oracle.kind == "model" else None  # lookup: exact integers
    per_batch, mismatches = [], []
    # the deployed policy's runs, and the run with drafting forced: an adaptive policy may
    # draft little or nothing (layer-skip on SmolLM2 at 24 tokens), which compares nothing
    configs = [(b, ctx.config.policy, reqs) for b, reqs in sorted(runs.speculative.items())]
    if runs.forced is not None:
        configs.append((runs.forced[0], f"fixed k={ctx.config.forced_k}", runs.forced[1]))
    total = sum(len(reqs) for _, _, reqs in configs)
    with ctx.progress.stage(f"drafter consistency ({oracle.kind})", total) as bar:
        for b, policy, reqs in configs:
            compared = ties = n_bad = 0
            for i, r in enumerate(reqs):
                c, t, bad = check_request(oracle, r, ctx.config.k, logits_cache,
                                          tie["value"] if tie else TIE_MARGIN, prefixes)
                compared, ties, n_bad = compared + c, ties + t, n_bad + len(bad)
                for m in bad[:MAX_LISTED - len(mismatches)]:
                    mismatches.append({"batch": b, "policy": policy, "id": ctx.prompts[i].id, **m})
                bar.advance()
            per_batch.append({"batch": b, "policy": policy, "positions_compared": compared, "near_ties": ties,
                              "mismatches": n_bad})
    n_bad = sum(r["mismatches"] for r in per_batch)
    compared = sum(r["positions_compared"] for r in per_batch)
    passed = n_bad == 0 and compared > 0
    if n_bad:
        summary = (f"{n_bad} of {compared} draft positions differ from a fresh {name} drafter "
                   "(stale drafter state)")
    elif not compared:
        summary = f"INCONCLUSIVE: no draft of the {name} drafter was made, so none could be compared"
    else:
        summary = (f"{compared} draft positions match a fresh {name} drafter ("
                   + ", ".join(f"b{r['batch']}" + ("" if r["policy"] == ctx.config.policy else f" {r['policy']}")
                               + f" {r['positions_compared']}" for r in per_batch) + ")")
    figures = {"drafter": name, "oracle": oracle.kind, "applicable": True,
               "positions_compared": compared, "mismatches": n_bad,
               "near_ties": sum(r["near_ties"] for r in per_batch),
               "tie_margin": tie["value"] if tie else TIE_MARGIN, "tie_margin_source": tie}
    return CheckResult(passed, summary, figures,
                       {"per_batch": per_batch, "mismatches": mismatches})
