"""Greedy equivalence against a non-speculative reference: exact match, first
divergence, and the reference's top-2 logit margin there (near-tie vs bug)."""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ..engine import PromptCache, Request
from . import churn
from .checks import CheckResult
from .endpoint import null as endpoint_null
from .endpoint.state import EndpointAudit
from .endpoint.client import EndpointRun
from .stats import against_null

if TYPE_CHECKING:  # annotations only
    from .context import AuditContext, GreedyRuns

TIE_MARGIN = 1e-4  # a divergence below this top-2 logit margin is numerics, not a bug (fp32 backends)
EXACT_MATCH_MIN = 0.95  # at least this share of prompts identical


_MEASURED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> tie_margin_for's answer


def tie_margin_for(model) -> dict:
    """The near-tie margin on this model's backend, and where it comes from:
    {"value": margin, "source": ..., plus the measurement when there is one}.

    The native runtime computes in fp32 with kernels whose only variation is summation order,
    so TIE_MARGIN (1e-4) is its bound. A backend that declares `noisy_numerics` (ggml:
    8-bit-rounded activations, kernels that depend on how many tokens share a pass and on
    the KV cell order) moves a top-2 gap by far more than that in plain decoding, with no
    speculation: its margin is its own measured batching noise (models/noise.py: the
    largest change of a top-2 gap, against a fresh single-row decode), measured once per
    model, on the threads in use, and never below TIE_MARGIN."""
    if not model.noisy_numerics:
        return {"value": TIE_MARGIN, "source": "fixed (fp32 backend)"}
    if model not in _MEASURED:
        from ..models.noise import batching_noise
        t0 = time.perf_counter()
        noise = batching_noise(model, seeds=(0, 1, 2))
        _MEASURED[model] = {"value": max(TIE_MARGIN, noise["margin"]),
                            "source": "measured batching noise of the backend (models/noise.py)",
                            "backend": model.backend, "noise_logit": noise["logit"],
                            "noise_top2_gap": noise["margin"], "ceiling": NOISE_CEILING,
                            "code_path": NOISE_CODE_PATH, "seconds": round(time.perf_counter() - t0, 1)}
    return dict(_MEASURED[model])


# What the noise measurement shares with the runs under audit, as the report states it: a
# batching fault in the multi-row cache can raise the measured noise, which the ceiling bounds
NOISE_CODE_PATH = ("references: a fresh single-row cache per sequence, one pass over it; compared with the "
                   "same row fed one token per pass in its own single-row cache, and with the row fed beside "
                   "a second row that leaves (the backend's multi-row cache, which the runs under audit share)")
# The most a backend's rounding may move a top-2 logit gap before the measurement itself is
# suspect: measured 0.27-1.06 on the Q4 files (SmolLM2-135M Q4_1, Qwen2.5-Coder-1.5B Q4_K_M,
# two machines), while the clear divergences of real faults lie at 1-12. Above it the
# equivalence check is inconclusive: the noise cannot tell numerics from a broken batch.
NOISE_CEILING = 2.5


NULL_ALPHA = 0.01  # a noisy backend's near-tie count against its null run: family-wise, over the configs


def near_tie_allowance(n: int) -> int:
    """Non-identical outputs (all near-ties) tolerated among n prompts: misses <= floor(5% of
    n), but at least one, or 16 prompts would turn one benign numerical flip into a failure."""
    return max(1, math.floor((1 - EXACT_MATCH_MIN) * n + 1e-9))


@dataclass(frozen=True)
class Comparison:
    exact: bool
    first_divergence: int | None  # index into the generated tokens
    margin: float | None  # reference's top-2 logit margin at the first divergence
    verdict: str  # "identical" | "near-tie" | "divergence"

    def to_dict(self) -> dict:
        return asdict(self)


def first_divergence(ref: list[int], got: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), None if equal."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))


def top2_margin(logits: torch.Tensor) -> float:
    """logits [V] -> largest minus second-largest logit."""
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def reference_logits_at(model, prompt: list[int], ref: list[int], index: int) -> torch.Tensor:
    """Teacher-force the reference model: logits [V] that predicted ref[index]."""
    seq = prompt + ref[:index]
    cache = model.new_cache(1, len(seq) + 1)
    row = cache.alloc()
    return model.forward(torch.tensor([seq]), cache, row, last_only=True)[0]


def compare(prompt: list[int], ref: list[int], got: list[int], margin_fn, tie_margin: float = TIE_MARGIN) -> Comparison:
    """margin_fn(prompt, ref, index) -> logits [V] of the reference at that index."""
    i = first_divergence(ref, got)
    if i is None:
        return Comparison(True, None, None, "identical")
    if i >= len(ref):  # the candidate ran on past the reference's end: the reference stopped
        return Comparison(False, i, None, "divergence")
    m = top2_margin(margin_fn(prompt, ref, i))
    return Comparison(False, i, m, "near-tie" if m < tie_margin else "divergence")


def teacher_forced_logits(model, tokens: list[int], first: int = 0, num_layers: int | None = None,
                          prefixes=None) -> torch.Tensor:
    """One batch-1 pass of model over tokens -> logits [T - first, V]; row j is the output at
    position first + j, i.e. the distribution of tokens[first + j + 1]. Positions before
    `first` are prefilled without computing their logits (the LM head is a large share of a
    small model). num_layers < L gives the layer-skip draft's logits (see models/llama.py).
    prefixes: an engine.PromptCache for one (model, num_layers): the prefill of tokens[:first]
    is taken from it when an earlier call made it (the audit scores several outputs of each
    prompt), and put there otherwise; the numbers are those of the batch-1 prefill either way."""
    if not 0 <= first < len(tokens):
        raise ValueError(f"first must lie in [0, {len(tokens)}), got {first}")
    cache = model.new_cache(1, len(tokens))
    row = cache.alloc()
    if first > 0:
        head = tokens[:first]
        if prefixes is None or not prefixes.restore(cache, row[0], head):
            model.forward(torch.tensor([head]), cache, row, last_only=True, num_layers=num_layers)
            if prefixes is not None:
                prefixes.save(cache, row[0], head)
    return model.forward(torch.tensor([tokens[first:]]), cache, row, num_layers=num_layers)[0]


TF_PREFIX_TOKENS = 1 << 13  # the prompt prefills one check keeps for its teacher forcing


def prefix_cache():
    """A cache of prompt prefills for teacher_forced_logits (one per model and layer count)."""
    return PromptCache(max_tokens=TF_PREFIX_TOKENS)


# -- the equivalence check offline: speculative greedy output against plain batch 1 -------------
class _ReferenceLogits:
    """The reference's logits at (prompt, index), each computed once: the null run and every
    configuration compare against the same reference."""

    def __init__(self, model):
        self.model = model
        self.logits: dict[tuple[int, int], Any] = {}  # (prompt, index) -> reference logits there

    def for_prompt(self, i: int):
        """compare's margin_fn for prompt i."""
        def fn(prompt, ref, index):
            if (i, index) not in self.logits:
                self.logits[(i, index)] = reference_logits_at(self.model, prompt, ref, index)
            return self.logits[(i, index)]
        return fn


@dataclass(frozen=True)
class _Bar:
    """What a configuration's differences from the reference are judged by."""

    tie_margin: float  # fixed on fp32 backends, the measured noise on noisy ones
    null: dict | None  # the null run (a backend whose numerics move with batching), else None
    alpha: float  # NULL_ALPHA over the configurations
    batch_invariant: bool  # bitwise identity promised: no near-tie is excused


def equivalence_check(ctx: AuditContext, runs: GreedyRuns) -> CheckResult:
    """Every greedy speculative output against plain decoding at batch 1, under each
    configuration: identical, a near-tie (the reference's top-2 logit margin at the first
    divergence below the backend's tie margin) or a divergence; on a backend whose numerics
    move with batching, against its own null run."""
    logits = _ReferenceLogits(ctx.model)
    tie = tie_margin_for(ctx.model)  # fixed on fp32 backends, the measured noise on noisy ones
    null = null_run(ctx, runs, logits.for_prompt, tie) if "noise_top2_gap" in tie else None
    configs = [(b, reqs, ctx.config.policy) for b, reqs in sorted(runs.speculative.items())]
    if runs.forced is not None:
        configs.append((runs.forced[0], runs.forced[1], f"fixed k={ctx.config.forced_k}"))
    bar = _Bar(tie["value"], null, NULL_ALPHA / len(configs), ctx.config.batch_invariant)
    per_batch, rows, failures = [], [], []
    with ctx.progress.stage("equivalence: margins", sum(len(reqs) for _, reqs, _ in configs)) as pbar:
        for b, reqs, policy in configs:
            row, failure = _judge_config(ctx, runs.reference, b, reqs, policy, logits, bar, rows, pbar)
            per_batch.append(row)
            failures += [failure] if failure else []
    found, inconclusive = null_findings(tie, null)
    failures = found + failures
    trees = tree_steps([r for _, reqs, _ in configs for r in reqs])
    summary = _summary(ctx.config.policy, per_batch, tie, null, failures, trees)
    main = [r for r in per_batch if r["policy"] == ctx.config.policy]
    figures = {"exact_match_by_batch": {str(r["batch"]): r["exact_match_rate"] for r in main},
               **trees,
               "forced_exact_match": next((r["exact_match_rate"] for r in per_batch if r not in main), None),
               "drafts_verified": sum(r["drafted"] for r in per_batch),
               "min_exact_match": min(per_batch, key=lambda r: r["exact_match_rate"])["exact_match_rate"],
               "divergences": sum(r["divergence"] for r in per_batch),
               "near_ties": sum(r["near-tie"] for r in per_batch),
               "tie_margin": tie["value"], "tie_margin_source": tie,
               "null_run": null, "inconclusive": inconclusive,
               "exact_match_threshold": EXACT_MATCH_MIN if null is None else None,
               "near_tie_allowance": near_tie_allowance(len(runs.reference)) if null is None else None,
               "prompts": len(runs.reference), "max_new_tokens": ctx.config.sizes.max_new_tokens,
               "reference": "plain decoding, batch 1, greedy", "greedy_seconds": round(runs.seconds, 1)}
    return CheckResult(not failures, summary, figures, {"per_batch": per_batch, "prompts": rows})


def _judge_config(ctx: AuditContext, reference: list[Request], b: int, reqs: list[Request], policy: str,
                  logits: _ReferenceLogits, bar: _Bar, rows: list, pbar) -> tuple[dict, str | None]:
    """One configuration's outputs, each compared with the reference's: -> (its row of counts,
    why it fails or None); every output's comparison goes to rows."""
    counts = {"identical": 0, "near-tie": 0, "divergence": 0}
    for i, (ref, got) in enumerate(zip(reference, reqs)):
        c = compare(ctx.prompt_ids[i], ref.output_ids, got.output_ids, logits.for_prompt(i), bar.tie_margin)
        counts[c.verdict] += 1
        rows.append({"batch": b, "policy": policy, "id": ctx.prompts[i].id, "slice": ctx.prompts[i].slice,
                     **c.to_dict()})
        pbar.advance()
    n = len(reqs)
    rate = counts["identical"] / n
    # rate >= EXACT_MATCH_MIN, i.e. misses <= floor(5% of n) - but at least one near-tie
    # is tolerated, or 16 prompts would turn one benign numerical flip into a failure
    # batch-invariant mode promises bitwise identity: no near-tie is excused there
    allowance = 0 if bar.batch_invariant else near_tie_allowance(n)
    ok, fisher = against_null(counts, n, bar.null, bar.alpha, allowance)  # a noisy backend: against its null
    row = {"batch": b, "policy": policy, "rows_decoded_together": min(b, n), "prompts": n,
           "exact_match_rate": rate, **counts, "drafted": sum(r.stats.drafted for r in reqs),
           "accepted": sum(r.stats.accepted for r in reqs), "passed": ok,
           **({} if fisher is None else {"fisher_p_vs_null": fisher, "alpha": bar.alpha})}
    where = f"b={b}" if policy == ctx.config.policy else f"b={b} ({policy})"
    if counts["divergence"]:
        return row, f"{where}: {counts['divergence']} divergence(s) at a clear margin"
    if not ok and fisher is not None:
        return row, (f"{where}: {n - counts['identical']}/{n} differ against the null run's "
                     f"{bar.null['differ']}/{bar.null['prompts']} (Fisher p = {fisher:.2g} < {bar.alpha:.2g})")
    if not ok:
        return row, f"{where}: exact match {rate:.0%} < {EXACT_MATCH_MIN:.0%}"
    return row, None


def _summary(policy: str, per_batch: list[dict], tie: dict, null: dict | None, failures: list[str],
             trees: dict) -> str:
    """The line a person reads first: the exact-match rate of each configuration, the drafts
    verified, the backend's noise and null run where measured, and what failed."""
    main = [r for r in per_batch if r["policy"] == policy]
    summary = ("exact match " + ", ".join(f"b{r['batch']} {r['exact_match_rate']:.0%}" for r in main)
               + "".join(f", b{r['batch']} {r['policy']} {r['exact_match_rate']:.0%}"
                         for r in per_batch if r not in main)
               + f"; {sum(r['drafted'] for r in per_batch)} drafts verified"
               + ("" if null is None else
                  f"; {tie.get('backend') or 'noisy backend'}: near-tie margin {null['tie_margin']:.3g} "
                  f"(measured batching noise; null run, plain b={null['batch']}: "
                  f"{null['differ']}/{null['prompts']} differ, {null['beyond_noise']} beyond the noise)")
               + ("" if not failures else "; " + "; ".join(failures)))
    if trees["tree_steps"]:
        summary += (f"; {trees['tree_steps']} draft-tree steps verified, {trees['tree_later_sibling']} "
                    "taken off a later sibling")
    return summary


def tree_steps(reqs) -> dict:
    """How much draft-tree verification (verify/tree.py) the runs exercised, from their traces:
    steps whose drafts branched, and of those the steps whose accepted path left the first
    child somewhere (the paths a fault of a tree's positions, mask or walk breaks; the
    first-child line alone is a linear draft). A tree step's trace entry starts with its
    accepted path's tokens."""
    steps = later = tokens = 0
    for r in reqs:
        for (_, walked, acc, _), tree in zip(r.stats.trace, r.stats.trace_trees):
            if tree is None:
                continue
            steps += 1
            tokens += acc + 1
            toks, parents = tree
            first: dict[int, int] = {}
            for i, p in enumerate(parents):
                first.setdefault(p, i)
            line, node = [], -1
            while node in first and len(line) < acc:
                node = first[node]
                line.append(toks[node])
            later += line != walked[:acc]
    return {"tree_steps": steps, "tree_later_sibling": later, "tree_tokens": tokens}


def null_run(ctx: AuditContext, runs: GreedyRuns, margin_fn_for, tie: dict) -> dict:
    """On a backend whose numerics move with batching (tie_margin_for measured them), the
    deployment's own null run: plain decoding at the largest audited batch size against the
    plain batch-1 reference, no speculation. Its share of differing prompts is what a batch
    does to greedy output here; the speculative runs must not differ significantly more
    often (Fisher's exact test, as the endpoint audit does: audit/endpoint/null.py).

    The null is tested too: a plain divergence at a margin beyond the measured noise is not
    numerics but a broken batch in the deployment itself (the backend, its cache), with no
    speculation involved, and fails the check (`beyond_noise`, with the prompts). The tie
    margin stays the measured noise: were it widened to the null's largest divergence, a
    fault that breaks plain batching as well would excuse the speculative divergences it
    causes."""
    t0 = time.perf_counter()
    b, n = max(ctx.config.greedy_batch_sizes), len(ctx.prompt_ids)
    params = ctx.greedy_params()
    lengths = churn.mixed_lengths(n, params.max_new_tokens)  # the reference's own lengths
    reqs = [Request(ids, replace(params, max_new_tokens=m)) for ids, m in zip(ctx.prompt_ids, lengths)]
    rows = None  # the null run's row churn, as the speculative runs': it shares their bookkeeping
    if b > 1:  # plain decoding alone at batch 1 is the reference itself
        max_len = max(map(len, ctx.prompt_ids)) + params.max_new_tokens
        with ctx.progress.stage(f"equivalence: null run, plain b={b}", n) as bar:
            rows = churn.run_churned(ctx.engine(min(b, n), max_len, speculative=False, rule="rejection"), reqs,
                              f"{ctx.config.seed}/null/{b}", on_finish=lambda r: bar.advance())
    got = [r.output_ids for r in reqs] if b > 1 else [r.output_ids for r in runs.reference]
    cs = [compare(ctx.prompt_ids[i], ref.output_ids, g, margin_fn_for(i), tie["value"])
          for i, (ref, g) in enumerate(zip(runs.reference, got))]
    margins = sorted(c.margin for c in cs if c.margin is not None)
    beyond = [{"id": ctx.prompts[i].id, "first_divergence": c.first_divergence, "margin": c.margin}
              for i, c in enumerate(cs) if c.verdict == "divergence"]
    return {"batch": b, "prompts": n, "differ": sum(not c.exact for c in cs), "margins": margins,
            "beyond_noise": len(beyond), "beyond_noise_prompts": beyond,
            "tie_margin": tie["value"], "alpha": NULL_ALPHA, "churn": rows,
            "reference": "plain decoding, batch 1, greedy", "seconds": round(time.perf_counter() - t0, 1)}


def null_findings(tie: dict, null: dict | None, what: str = "plain decoding") -> tuple[list[str], bool]:
    """What the null run and the noise measurement say about the deployment itself:
    (failures, inconclusive). A null divergence beyond the noise fails; a measured noise
    above NOISE_CEILING makes the check inconclusive (it cannot tell numerics from a broken
    batch), which fails it too."""
    failures, inconclusive = [], False
    if null is not None and null["beyond_noise"]:
        where = ", ".join(f"{d['id']} (margin {d['margin']:.3g})" if d.get("margin") is not None else d["id"]
                          for d in null["beyond_noise_prompts"][:4])
        failures.append(f"null run: {what} at b={null['batch']} diverges from b=1 beyond the measured noise "
                        f"({tie['value']:.3g}) on {null['beyond_noise']}/{null['prompts']} prompts ({where}): "
                        "batching is broken in the deployment itself, with no speculation")
    gap = tie.get("noise_top2_gap")
    if gap is not None and gap > tie.get("ceiling", NOISE_CEILING):
        inconclusive = True
        failures.append(f"INCONCLUSIVE: the backend's measured batching noise moves a top-2 gap by {gap:.3g} "
                        f"(> {tie.get('ceiling', NOISE_CEILING):g}, more than rounding does): the batched path the "
                        "noise is measured on is itself suspect, and near-ties cannot be told from a broken batch")
    return failures, inconclusive


# -- from outside (endpoint mode: the state in endpoint/state.py) ------------------------------
def endpoint_equivalence_check(a: EndpointAudit) -> CheckResult:
    return _endpoint_equivalence(a.tests, a.nulls, a.base, a.reference_kind, a.ref_cfg is not None, a.alpha)


def _endpoint_equivalence(tests: list[endpoint_null.Comparison], nulls: dict[int, endpoint_null.Comparison],
                          base: EndpointRun, reference_kind: str, separable: bool, alpha: float) -> CheckResult:
    v = endpoint_null.verdict(tests, nulls, alpha)
    margins_known = base.logprobs
    per_batch, rows = [], []
    for t, lv in zip(tests, v["per_level"]):
        counts = {"identical": sum(r["exact"] for r in t.rows),
                  "near-tie": sum(r.get("verdict") == "near-tie" for r in t.rows)}
        counts["divergence"] = len(t.rows) - counts["identical"] - counts["near-tie"]
        n = len(t.rows)
        per_batch.append({"batch": t.concurrency, "rows_decoded_together": min(t.concurrency, n), "prompts": n,
                          "exact_match_rate": counts["identical"] / n if n else 0.0, **counts,
                          "null_exact_match_rate": 1 - lv["null_rate"] if lv["null_rate"] is not None else None,
                          **{k: lv[k] for k in ("null_divergences", "null_compared", "null_source", "fisher_p",
                                                "alpha", "beyond_null", "margin_p", "errors", "reasons")},
                          "passed": lv["passed"]})
        rows += [{"batch": t.concurrency, **r} for r in t.rows]
    null_rows = [{"batch": c, **r} for c, cmp in nulls.items() for r in cmp.rows]
    failures = v["failures"]
    summary = ("exact match (text) " + ", ".join(
        f"c{r['batch']} {r['exact_match_rate']:.0%} (null {r['null_exact_match_rate']:.0%})"
        if r["null_exact_match_rate"] is not None else f"c{r['batch']} {r['exact_match_rate']:.0%}"
        for r in per_batch)
        + (f"; null max margin {v['null_max_margin']:.3g}" if v["null_max_margin"] is not None
           else "; the null never diverged" if margins_known else "; no logprobs: margins unknown")
        + ("" if separable else "; NO reference: speculation not separable from batching")
        + ("" if not failures else "; " + "; ".join(failures)))
    figures = {"exact_match_by_batch": {str(r["batch"]): r["exact_match_rate"] for r in per_batch},
               "null_exact_match_by_batch": {str(s["concurrency"]): 1 - s["divergence_rate"]
                                             for s in v["null"] if s["divergence_rate"] is not None},
               "min_exact_match": min(r["exact_match_rate"] for r in per_batch),
               "divergences": sum(r["divergence"] for r in per_batch),
               "near_ties": sum(r["near-tie"] for r in per_batch),
               "null_divergences": sum(s["divergences"] for s in v["null"]),
               "null_max_margin": v["null_max_margin"], "null_margins": v["null_margins"],
               "test": f"per level: one-sided Fisher exact test on divergence counts, and an exact exceedance "
                       f"test of margins beyond the null's largest (alpha {alpha:g} over {2 * len(tests)} tests)",
               "alpha": alpha,
               "exact_match_threshold": min((r["null_exact_match_rate"] for r in per_batch
                                             if r["null_exact_match_rate"] is not None), default=1.0),
               "prompts": len(base.levels[0].results), "reference": reference_kind, "separable": separable,
               "compared_on": "text (batch = concurrent clients)", "reference_logprobs": margins_known}
    if not separable:
        figures["not_separable"] = ("no non-speculative reference: a divergence under load may be speculation "
                                    "or the server's batching numerics; only load invariance was tested")
    tables = [("Equivalence: null baseline (reference vs itself) beside the endpoint",
               ["batch", "endpoint divergences", "null divergences", "null source", "Fisher p",
                "beyond null's max margin", "exceedance p", "alpha", "failed requests", "passed"],
               [[r["batch"], f"{r['divergence']+r['near-tie']}/{r['prompts']}",
                 f"{r['null_divergences']}/{r['null_compared']}", r["null_source"], f"{r['fisher_p']:.3g}",
                 r["beyond_null"], f"{r['margin_p']:.3g}", f"{r['alpha']:.3g}", r["errors"], r["passed"]]
                for r in per_batch]),
              ("Equivalence: null divergences (top-2 margin of the base at the first divergence)",
               ["batch", "prompt", "slice", "first divergence", "top-2 margin"],
               [[r["batch"], r["id"], r["slice"], r["first_divergence"],
                 "-" if r["margin"] is None else f"{r['margin']:.3g}"]
                for r in null_rows if not r["exact"] and r["error"] is None][:40])]
    return CheckResult(not failures, summary, figures,
                       {"per_batch": per_batch, "prompts": rows, "null_prompts": null_rows, "null": v["null"],
                        "tables": tables})
