"""`run_audit`: the deployment checklist as one function.

    result = run_audit(AuditConfig(...))                       # loads target and drafter
    result = run_audit(cfg, target=loaded, drafter_factory=f,   # tests: tiny injected models
                       prompts=[SuitePrompt(...), ...])

Checks, in report order: lossy rule (no statistics needed); equivalence, after the greedy
runs (plain reference at batch 1 interleaved prompt by prompt with speculative batch 1,
then speculative at every other batch size, and with drafting forced); distribution;
seeded (seeded speculative output equals seeded plain output); stopping (stops and
length limits inside drafted runs end where plain decoding ends); drafter consistency,
corruption and slices, which read the greedy runs too; load; record. A check whose code
raises (a crash in the engine under audit) fails with the error in its details. With
`config.inject_fault` the speculative engine (the system under audit) runs inside the
fault; references and teacher-forced passes never do.
"""

from __future__ import annotations

import datetime
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from ..engine import GenerationParams, Request
from ..policy import FixedK
from ..verify import LOSSY_RULES
from . import consistency, corruption, distribution, load, record, seeded, speed, stopping
from .checks import CheckResult, verdict
from .context import AuditConfig, AuditContext, DrafterFactory, GreedyRuns, encode, select_prompts
from .endpoint.null import fisher_greater
from .equivalence import (EXACT_MATCH_MIN, NULL_ALPHA, compare, near_tie_allowance, reference_logits_at,
                          tie_margin_for)
from .progress import NullProgress
from .suite import SuitePrompt, load_suite


@dataclass
class AuditResult:
    verdict: str  # "pass" | "fail"
    checks: list[CheckResult]
    record: dict
    elapsed_s: float
    samples: list[dict] = field(default_factory=list)  # a few outputs, for the reader

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.passed]

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "failed_checks": self.failed,
                "elapsed_s": round(self.elapsed_s, 1), "checks": [c.to_dict() for c in self.checks],
                "record": self.record, "samples": self.samples}


def drafter_factory_from_spec(spec: str, target_model, tokenizer) -> tuple[DrafterFactory, Any]:
    """A factory for the drafter named by a CLI spec, and the draft model's files (or None).
    A draft model is loaded once; each engine gets a fresh drafter (its own cache) on it."""
    from ..drafters import make_drafter
    if spec == "none":
        raise ValueError("the audit needs a drafter: --draft lookup | layerskip:N | a draft model")
    if spec == "lookup" or spec.startswith(("lookup:", "layerskip:")):
        make_drafter(spec, target_model, tokenizer, max_rows=1, max_len=2)  # validate the spec now
        return (lambda rows, max_len: make_drafter(spec, target_model, tokenizer, max_rows=rows,
                                                   max_len=max_len)), None
    from ..drafters.draft_model import DraftModelDrafter, check_same_tokenizer
    from ..models import load_model
    loaded = load_model(spec, progress=False, backend=target_model.runtime)  # the target's backend
    check_same_tokenizer(loaded.tokenizer, tokenizer)
    V = target_model.config.vocab_size
    return (lambda rows, max_len: DraftModelDrafter(loaded.model, V, max_rows=rows, max_len=max_len,
                                                    name=spec)), loaded.files


def run_audit(config: AuditConfig, *, target=None, drafter_factory: DrafterFactory | None = None,
              draft_files=None, prompts: list[SuitePrompt] | None = None, progress=None) -> AuditResult:
    """Run every check. target: a LoadedModel-like object (model, tokenizer, files); None loads
    config.target. drafter_factory(max_rows, max_len) -> drafter; None builds config.draft
    (draft_files: the draft model's files, recorded). prompts: the suite; None loads config.suite."""
    t_start = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    progress = progress or NullProgress()
    if target is None:
        from ..models import load_model
        target = load_model(config.target, progress=False, batch_invariant=config.batch_invariant)
    model, tokenizer = target.model, target.tokenizer
    if drafter_factory is None:
        drafter_factory, draft_files = drafter_factory_from_spec(config.draft, model, tokenizer)
    suite = prompts if prompts is not None else load_suite(config.suite)
    chosen = select_prompts(suite, config.sizes.prompts_per_slice)
    chat = (config.prompt_format == "chat"
            or (config.prompt_format == "auto" and bool(getattr(tokenizer, "chat_template", None))))
    eos = getattr(tokenizer, "eos_token_id", None)
    stops = tuple(dict.fromkeys(tuple(model.config.eos_token_ids) + ((eos,) if eos is not None else ())))
    ctx = AuditContext(config=config, model=model, tokenizer=tokenizer, drafter_factory=drafter_factory,
                       suite=suite, prompts=chosen, prompt_ids=[encode(tokenizer, p.prompt, chat) for p in chosen],
                       chat=chat, stops=stops, progress=progress)

    checks: list[CheckResult] = []

    def attempt(name: str, fn) -> None:
        """Run one check; an exception in the system under audit fails that check."""
        t0 = time.perf_counter()
        try:
            check = fn()
        except Exception as e:  # noqa: BLE001 - whatever the engine raises is a finding
            check = CheckResult(name, False, f"raised {type(e).__name__}: {e}",
                                {"error": f"{type(e).__name__}: {e}"},
                                {"traceback": traceback.format_exc(limit=-6)})
        check.elapsed_s += time.perf_counter() - t0
        checks.append(check)
        progress.check_done(check)

    attempt("lossy-rule", lambda: lossy_rule_check(config))
    runs: list[GreedyRuns] = []  # the greedy runs, made by the equivalence step, read by three more

    greedy_failed: list[str] = []

    def get_runs() -> GreedyRuns:
        if not runs:
            try:
                runs.append(greedy_runs(ctx))
            except Exception as e:  # noqa: BLE001 - attempt() turns it into a failed check
                greedy_failed.append(f"{type(e).__name__}: {e}")
                raise
        return runs[0]

    def equivalence_step() -> CheckResult:
        return equivalence_check(ctx, get_runs())

    def on_runs(name: str, fn):
        def step() -> CheckResult:
            if greedy_failed:
                return CheckResult(name, False, "not run: the greedy runs failed (see equivalence)")
            return fn(ctx, get_runs())
        return step

    steps = [("equivalence", equivalence_step),
             ("distribution", lambda: distribution.distribution_check(ctx)),
             ("seeded", lambda: seeded.seeded_check(ctx)),
             ("stopping", on_runs("stopping", stopping.stopping_check)),
             ("drafter-consistency", on_runs("drafter-consistency", consistency.drafter_consistency_check)),
             ("corruption", on_runs("corruption", corruption.corruption_check)),
             ("slices", on_runs("slices", speed.slices_check)),
             ("load", lambda: load.load_check(ctx))]
    skipped = []
    for name, fn in steps:
        if (config.fail_fast and any(not c.passed for c in checks)) or (config.only and name not in config.only):
            skipped.append(name)  # --fail-fast: the verdict is already FAIL; --only: not asked for
        else:
            attempt(name, fn)
    rec = record.build_record(ctx, getattr(target, "files", None), draft_files, started)
    rec["checks_not_run"] = skipped
    attempt("record", lambda: record.record_check(rec))
    elapsed = time.perf_counter() - t_start
    rec["elapsed_s"] = round(elapsed, 1)
    return AuditResult(verdict=verdict(checks), checks=checks, record=rec, elapsed_s=elapsed,
                       samples=_samples(ctx, runs[0]) if runs else [])


# -- the lossy rule ------------------------------------------------------------------------
def lossy_rule_check(config: AuditConfig) -> CheckResult:
    lossy = config.rule in LOSSY_RULES
    summary = (f"rule {config.rule!r} is LOSSY: output is not distributed as the target's"
               if lossy else f"rule {config.rule!r} is exact")
    return CheckResult("lossy-rule", not lossy, summary,
                       {"rule": config.rule, "lossy": lossy, "lossy_rules": sorted(LOSSY_RULES)})


# -- greedy runs and equivalence -------------------------------------------------------------
def greedy_runs(ctx: AuditContext) -> GreedyRuns:
    t0 = time.perf_counter()
    params = ctx.greedy_params()
    max_len = max(map(len, ctx.prompt_ids)) + params.max_new_tokens
    n = len(ctx.prompt_ids)
    plain = ctx.engine(1, max_len, speculative=False, rule="rejection")
    spec1 = ctx.engine(1, max_len)
    # warm both engines up (first-call kernel setup) so neither pays it inside a timing
    warm = GenerationParams(max_new_tokens=4)
    plain.run([Request(ctx.prompt_ids[0][:8], warm)])
    with ctx.fault():
        spec1.run([Request(ctx.prompt_ids[0][:8], warm)])
    reference, spec = [], {1: []}
    with ctx.progress.stage("greedy: plain vs speculative, b=1", 2 * n) as bar:
        # interleaved prompt by prompt: both see the same machine load (slices compare them)
        for ids in ctx.prompt_ids:
            reference.append(plain.run([Request(ids, params)])[0])
            bar.advance()
            with ctx.fault():
                spec[1].append(spec1.run([Request(ids, params)])[0])
            bar.advance()
    for b in ctx.config.greedy_batch_sizes:
        if b == 1:
            continue
        reqs = [Request(ids, params) for ids in ctx.prompt_ids]
        with ctx.progress.stage(f"greedy: speculative, b={b}", n) as bar, ctx.fault():
            ctx.engine(min(b, n), max_len).run(reqs, on_finish=lambda r: bar.advance())
        spec[b] = reqs
    forced = None
    if ctx.config.policy != "fixed":  # the deployed policy may draft little: force drafting too
        b = max(ctx.config.greedy_batch_sizes)
        reqs = [Request(ids, params) for ids in ctx.prompt_ids]
        k = ctx.config.forced_k
        with ctx.progress.stage(f"greedy: speculative, fixed k={k}, b={b}", n) as bar, ctx.fault():
            ctx.engine(min(b, n), max_len, policy=FixedK(k)).run(reqs, on_finish=lambda r: bar.advance())
        forced = (b, reqs)
    return GreedyRuns(reference, spec, time.perf_counter() - t0, forced)


def equivalence_check(ctx: AuditContext, runs: GreedyRuns) -> CheckResult:
    margins: dict[tuple[int, int], Any] = {}  # (prompt, index) -> reference logits there

    def margin_fn_for(i):
        def fn(prompt, ref, index):
            if (i, index) not in margins:
                margins[(i, index)] = reference_logits_at(ctx.model, prompt, ref, index)
            return margins[(i, index)]
        return fn

    per_batch, rows, failures = [], [], []
    tie = tie_margin_for(ctx.model)  # fixed on fp32 backends, the measured noise on noisy ones
    null = null_run(ctx, runs, margin_fn_for, tie) if "noise_top2_gap" in tie else None
    configs = [(b, reqs, ctx.config.policy) for b, reqs in sorted(runs.speculative.items())]
    if runs.forced is not None:
        configs.append((runs.forced[0], runs.forced[1], f"fixed k={ctx.config.forced_k}"))
    alpha = NULL_ALPHA / len(configs)
    total = sum(len(reqs) for _, reqs, _ in configs)
    with ctx.progress.stage("equivalence: margins", total) as bar:
        for b, reqs, policy in configs:
            counts = {"identical": 0, "near-tie": 0, "divergence": 0}
            for i, (ref, got) in enumerate(zip(runs.reference, reqs)):
                c = compare(ctx.prompt_ids[i], ref.output_ids, got.output_ids, margin_fn_for(i),
                            tie["value"] if null is None else null["tie_margin"])
                counts[c.verdict] += 1
                rows.append({"batch": b, "policy": policy, "id": ctx.prompts[i].id,
                             "slice": ctx.prompts[i].slice, **c.to_dict()})
                bar.advance()
            n = len(reqs)
            rate = counts["identical"] / n
            # rate >= EXACT_MATCH_MIN, i.e. misses <= floor(5% of n) - but at least one near-tie
            # is tolerated, or 16 prompts would turn one benign numerical flip into a failure
            # batch-invariant mode promises bitwise identity: no near-tie is excused there
            allowance = 0 if ctx.config.batch_invariant else near_tie_allowance(n)
            if null is None:
                ok = counts["divergence"] == 0 and n - counts["identical"] <= allowance
                fisher = None
            else:  # a noisy backend: near-ties no more frequent than in its own null run
                fisher = fisher_greater(n - counts["identical"], n, null["differ"], null["prompts"])
                ok = counts["divergence"] == 0 and fisher >= alpha
            drafted = sum(r.stats.drafted for r in reqs)
            per_batch.append({"batch": b, "policy": policy, "rows_decoded_together": min(b, n), "prompts": n,
                              "exact_match_rate": rate, **counts, "drafted": drafted,
                              "accepted": sum(r.stats.accepted for r in reqs), "passed": ok,
                              **({} if fisher is None else {"fisher_p_vs_null": fisher, "alpha": alpha})})
            where = f"b={b}" if policy == ctx.config.policy else f"b={b} ({policy})"
            if counts["divergence"]:
                failures.append(f"{where}: {counts['divergence']} divergence(s) at a clear margin")
            elif not ok and fisher is not None:
                failures.append(f"{where}: {n - counts['identical']}/{n} differ against the null run's "
                                f"{null['differ']}/{null['prompts']} (Fisher p = {fisher:.2g} < {alpha:.2g})")
            elif not ok:
                failures.append(f"{where}: exact match {rate:.0%} < {EXACT_MATCH_MIN:.0%}")
    main = [r for r in per_batch if r["policy"] == ctx.config.policy]
    worst = min(per_batch, key=lambda r: r["exact_match_rate"])
    passed = not failures
    summary = ("exact match " + ", ".join(f"b{r['batch']} {r['exact_match_rate']:.0%}" for r in main)
               + "".join(f", b{r['batch']} {r['policy']} {r['exact_match_rate']:.0%}"
                         for r in per_batch if r not in main)
               + f"; {sum(r['drafted'] for r in per_batch)} drafts verified"
               + ("" if null is None else
                  f"; {tie.get('backend') or 'noisy backend'}: near-tie margin {null['tie_margin']:.3g} "
                  f"(measured batching noise {tie['value']:.3g}; null run, plain b={null['batch']}: "
                  f"{null['differ']}/{null['prompts']} differ)")
               + ("" if passed else "; " + "; ".join(failures)))
    figures = {"exact_match_by_batch": {str(r["batch"]): r["exact_match_rate"] for r in main},
               "forced_exact_match": next((r["exact_match_rate"] for r in per_batch if r not in main), None),
               "drafts_verified": sum(r["drafted"] for r in per_batch),
               "min_exact_match": worst["exact_match_rate"],
               "divergences": sum(r["divergence"] for r in per_batch),
               "near_ties": sum(r["near-tie"] for r in per_batch),
               "tie_margin": tie["value"] if null is None else null["tie_margin"], "tie_margin_source": tie,
               "null_run": null,
               "exact_match_threshold": EXACT_MATCH_MIN if null is None else None,
               "near_tie_allowance": near_tie_allowance(len(runs.reference)) if null is None else None,
               "prompts": len(runs.reference), "max_new_tokens": ctx.config.sizes.max_new_tokens,
               "reference": "plain decoding, batch 1, greedy", "greedy_seconds": round(runs.seconds, 1)}
    return CheckResult("equivalence", passed, summary, figures,
                       {"per_batch": per_batch, "prompts": rows})


def null_run(ctx: AuditContext, runs: GreedyRuns, margin_fn_for, tie: dict) -> dict:
    """On a backend whose numerics move with batching (tie_margin_for measured them), the
    deployment's own null run: plain decoding at the largest audited batch size against the
    plain batch-1 reference, no speculation. Its share of differing prompts is what a batch
    does to greedy output here; the speculative runs must not differ significantly more
    often (Fisher's exact test, as the endpoint audit does: audit/endpoint/null.py). The
    tie margin becomes the larger of the measured noise and the largest margin at which the
    null diverged: a speculative divergence beyond both is a bug."""
    t0 = time.perf_counter()
    b, n = max(ctx.config.greedy_batch_sizes), len(ctx.prompt_ids)
    params = ctx.greedy_params()
    reqs = [Request(ids, params) for ids in ctx.prompt_ids]
    if b > 1:  # plain decoding alone at batch 1 is the reference itself
        max_len = max(map(len, ctx.prompt_ids)) + params.max_new_tokens
        with ctx.progress.stage(f"equivalence: null run, plain b={b}", n) as bar:
            ctx.engine(min(b, n), max_len, speculative=False, rule="rejection").run(
                reqs, on_finish=lambda r: bar.advance())
    got = [r.output_ids for r in reqs] if b > 1 else [r.output_ids for r in runs.reference]
    cs = [compare(ctx.prompt_ids[i], ref.output_ids, g, margin_fn_for(i), tie["value"])
          for i, (ref, g) in enumerate(zip(runs.reference, got))]
    margins = sorted(c.margin for c in cs if c.margin is not None)
    return {"batch": b, "prompts": n, "differ": sum(not c.exact for c in cs), "margins": margins,
            "beyond_noise": sum(c.verdict == "divergence" for c in cs),
            "tie_margin": max([tie["value"], *margins]), "alpha": NULL_ALPHA,
            "reference": "plain decoding, batch 1, greedy", "seconds": round(time.perf_counter() - t0, 1)}


def _samples(ctx: AuditContext, runs: GreedyRuns) -> list[dict]:
    """One output per slice (reference and largest-batch speculative), for the reader."""
    out, seen = [], set()
    b_max = max(runs.speculative)
    for i, p in enumerate(ctx.prompts):
        if p.slice in seen:
            continue
        seen.add(p.slice)
        out.append({"id": p.id, "slice": p.slice, "prompt": p.prompt[:300],
                    "reference": ctx.decode(runs.reference[i].output_ids),
                    f"speculative_b{b_max}": ctx.decode(runs.speculative[b_max][i].output_ids)})
    return out
