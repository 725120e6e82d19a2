"""Load sweep: throughput and per-token latency of speculative vs plain decoding at several
batch sizes and at a short and a long context, and the crossover batch size where
speculation stops paying.

Each load point is ONE engine: B rows are prefilled once, then the same rows decode in
alternating phases, plain (k = 0) and speculative (k drafts), in ABBA order, so both are
timed on the same cache, context lengths and machine load. Requests run at fixed length
(EOS ignored) so no row leaves the batch while it is measured.

A point's speedup is paired: step j of a round's plain phase with step j of the same
round's speculative phase, each as seconds per token emitted (step time / tokens the step
added over its B rows); the geometric mean of the pairs' ratios, with its t interval
(stats.speedup_interval). Its prediction: what the point's tokens per target pass predict
with the cost model's costs at B rows (speed.predicted_from_costs).
"""

from __future__ import annotations

import time

from ..engine import GenerationParams, PromptCache, Request
from ..policy import PolicyWrapper
from .checks import CheckResult
from .context import AuditContext, encode
from .endpoint.state import EndpointAudit
from .endpoint.client import EndpointRun, LevelRun
from .speed import interval_figures, predicted_from_costs, tokens_per_pass, verdict_counts
from .stats import predicted_speedup, speedup_interval
from .suite import slices


class PhasedPolicy(PolicyWrapper):
    """Policy (see policy/): the audited policy (fixed k or adaptive) in the speculative
    phase, 0 drafts in the plain one. The sweep flips `speculative` between engine steps."""

    def __init__(self, inner):
        super().__init__(inner)
        self.speculative = False

    def choose(self, requests):
        return self.inner.choose(requests) if self.speculative else [0] * len(requests)

    def observe(self, requests, k, accepted):
        if self.speculative:
            self.inner.observe(requests, k, accepted)


def context_prompts(ctx: AuditContext, rows: int, n_tokens: int) -> list[list[int]]:
    """rows prompts of about n_tokens tokens each (after prompt formatting): a real task from
    the suite at the end, so the answer is like the slices' (not a copy of the context),
    preceded by other suite texts concatenated as a document to reach the length."""
    texts = [p.prompt for p in ctx.suite]
    groups = list(slices(ctx.suite).values())
    by_slice = [g[i].prompt for i in range(max(map(len, groups))) for g in groups if i < len(g)]
    sized = [(t, len(encode(ctx.tokenizer, t, ctx.chat))) for t in by_slice]  # slices round-robin
    tasks = [ts for ts in sized if ts[1] <= 0.6 * n_tokens] or [min(sized, key=lambda ts: ts[1])]
    out = []
    for r in range(rows):
        task, task_len = tasks[r % len(tasks)]
        budget = n_tokens - task_len - 2  # room for the filler and its separator
        filler: list[int] = []
        j = r + 1
        while len(filler) < budget:
            filler += list(ctx.tokenizer(texts[j % len(texts)] + "\n\n")["input_ids"])
            j += 1
        text = (ctx.decode(filler[:budget]) + "\n\n" + task) if budget > 0 else task
        out.append(encode(ctx.tokenizer, text, ctx.chat))
    return out


def measure_point(ctx: AuditContext, batch: int, prompts: list[list[int]], prompt_caches=None) -> dict:
    """prompt_caches: (target's, draft model's) PromptCache shared by the sweep's points, so a
    prompt two points share is prefilled once (prefill is not timed here)."""
    sizes, k = ctx.config.sizes, ctx.config.k
    steps, rounds = sizes.load_steps, sizes.load_rounds
    max_new = 2 * (k + 2) + rounds * steps * (k + 2) + 1  # warm-up + every phase, k+1 per spec step
    engine = ctx.engine(batch, max(map(len, prompts)) + max_new, wrap=PhasedPolicy, prompt_caches=prompt_caches)
    policy = engine.policy
    reqs = [Request(p, GenerationParams(max_new_tokens=max_new, ignore_eos=True)) for p in prompts]
    for r in reqs:
        engine.add(r)
    # speculative? -> per round, per step: (seconds, tokens emitted over the B rows)
    timed: dict[bool, list[list[tuple[float, int]]]] = {False: [], True: []}
    ks: list[int] = []  # drafts each row verified in each speculative step

    def phase(speculative: bool, n_steps: int, record: bool) -> None:
        policy.speculative = speculative
        steps = []
        for _ in range(n_steps):
            before = sum(len(r.output_ids) for r in reqs)
            seen = [len(r.stats.k_chosen) for r in reqs]  # steps each row has recorded
            t0 = time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - t0, sum(len(r.output_ids) for r in reqs) - before))
            if record and speculative:
                ks.extend(k for r, n in zip(reqs, seen) for k in r.stats.k_chosen[n:])
        if len(engine.running) != batch:
            raise RuntimeError("a load-sweep row finished while being measured")  # sizes bug
        if record:
            timed[speculative].append(steps)

    phase(False, 1, record=False)  # prefill + first plain step
    phase(True, 1, record=False)  # warm the drafter
    for rnd in range(rounds):
        order = (False, True) if rnd % 2 == 0 else (True, False)  # ABBA
        for speculative in order:
            phase(speculative, steps, record=True)
    for r in list(engine.running):
        engine.cancel(r)
    plain_steps = [st for rnd in timed[False] for st in rnd]
    spec_steps = [st for rnd in timed[True] for st in rnd]
    tok_p, s_p = sum(t for _, t in plain_steps), sum(s for s, _ in plain_steps)
    tok_s, s_s = sum(t for _, t in spec_steps), sum(s for s, _ in spec_steps)
    plain_tps, spec_tps = tok_p / s_p, tok_s / s_s
    # pairs: step j of a round's plain phase with step j of its speculative phase
    sp = speedup_interval([s / t if t else None for s, t in plain_steps],
                          [s / t if t else None for s, t in spec_steps])
    mal = tok_s / (len(spec_steps) * batch)
    mean_k = sum(ks) / len(ks) if ks else None
    costs = ctx.cost_model(batch, max(map(len, prompts)) + max_new)
    return {"batch": batch, "prompt_tokens": round(sum(map(len, prompts)) / len(prompts)),
            "plain_tokens_per_s": plain_tps, "speculative_tokens_per_s": spec_tps,
            # time between two tokens of one row: B / throughput
            "plain_ms_per_token": 1000 * batch / plain_tps, "speculative_ms_per_token": 1000 * batch / spec_tps,
            "mean_accepted_length": mal, "mean_k_chosen": mean_k,
            **interval_figures(sp, predicted_from_costs(costs, batch, mal, mean_k))}


def crossover(points: list[dict]) -> int | None:
    """Smallest batch size from which speculation no longer pays (speedup < 1 there and at
    every larger measured size); None when it pays at the largest measured size."""
    points = sorted(points, key=lambda p: p["batch"])
    cross = None
    for p in reversed(points):
        if p["speedup"] >= 1:
            break
        cross = p["batch"]
    return cross


def load_check(ctx: AuditContext) -> CheckResult:
    sizes = ctx.config.sizes
    batches = sorted(set(ctx.config.batch_sizes))
    plan = [("short", sizes.short_context, b) for b in batches]
    plan += [("long", sizes.long_context, b) for b in batches
             if sizes.long_max_batch is None or b <= sizes.long_max_batch]
    points: dict[str, list[dict]] = {"short": [], "long": []}
    # a point's rows are the first rows of the next larger point's: prefilled once
    caches = (PromptCache(max_tokens=1 << 16), PromptCache(max_tokens=1 << 16))
    with ctx.progress.stage("load sweep", len(plan)) as bar:
        for name, n_tokens, b in plan:
            points[name].append(measure_point(ctx, b, context_prompts(ctx, b, n_tokens), caches))
            bar.advance()
    cross = {name: crossover(pts) for name, pts in points.items() if pts}
    words = []
    for name, c in cross.items():
        if c is None:
            words.append(f"{name} context: speculation pays up to b={points[name][-1]['batch']} (no crossover)")
        elif c == points[name][0]["batch"]:
            words.append(f"{name} context: speculation does not pay even at b={c}")
        else:
            words.append(f"{name} context: stops paying at b={c}")
    every = [p for pts in points.values() for p in pts]
    counts = verdict_counts(every)
    if counts:
        words.append(f"of {len(every)} points {counts}")
    figures = {"crossover_batch": cross,
               "verdicts": {name: {str(p["batch"]): p["verdict"] for p in pts} for name, pts in points.items() if pts},
               "contexts_tokens": {"short": sizes.short_context, "long": sizes.long_context},
               "batch_sizes": batches, "long_context_batch_sizes": [b for n, _, b in plan if n == "long"],
               "k": ctx.config.k, "steps_per_phase": sizes.load_steps, "rounds": sizes.load_rounds,
               "method": "one engine per point; plain and speculative phases alternate (ABBA) on the "
                         "same prefilled rows; fixed-length requests",
               "pairs": "step j of a round's plain phase with step j of its speculative phase, as seconds "
                        "per token emitted; 95% t interval of the mean log ratio",
               "predicted_from": "tokens per target pass and the cost model's target and draft costs at the "
                                 "point's batch size"}
    return CheckResult(True, "; ".join(words), figures, {"points": points}, informational=True)


# -- from outside (endpoint mode: the state in endpoint/state.py) ------------------------------
def endpoint_load_check(a: EndpointAudit) -> CheckResult:
    return _endpoint_load(a.run, a.reference)


def _wave_pairs(lv: LevelRun, ref: LevelRun | None) -> list[tuple[float, float]]:
    """(plain, speculative) seconds per token of each wave both sides answered in full: the
    wave's wall time over its completion tokens."""
    if ref is None or not lv.waves or not lv.wave_walls or ref.waves != lv.waves or not ref.wave_walls:
        return []
    out = []
    for idx, wall, ref_wall in zip(lv.waves, lv.wave_walls, ref.wave_walls):
        got, base = [lv.results[i] for i in idx], [ref.results[i] for i in idx]
        if all(r.ok and r.completion_tokens for r in got + base):
            out.append((ref_wall / sum(r.completion_tokens for r in base),
                        wall / sum(r.completion_tokens for r in got)))
    return out


def _endpoint_load(run: EndpointRun, reference: EndpointRun | None) -> CheckResult:
    ref_by_c = {lv.concurrency: lv for lv in reference.levels} if reference else {}
    points = []
    for lv in run.levels:
        ok = [r for r in lv.results if r.ok]
        ref = ref_by_c.get(lv.concurrency)
        s_tps = lv.completion_tokens / lv.wall_s if lv.wall_s else None
        p_tps = ref.completion_tokens / ref.wall_s if ref and ref.wall_s else None

        def ms_per_token(results):
            v = [1000 * r.latency_s / r.completion_tokens for r in results if r.ok and r.completion_tokens]
            return sum(v) / len(v) if v else None
        mal = tokens_per_pass(lv.spec) if lv.spec and not lv.spec.from_gauges else None
        pairs = _wave_pairs(lv, ref)
        sp = speedup_interval([p for p, _ in pairs], [s for _, s in pairs]) if pairs else None
        points.append({"batch": lv.concurrency,
                       "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok) / len(ok) if ok else 0,
                       "plain_tokens_per_s": p_tps, "speculative_tokens_per_s": s_tps,
                       "plain_ms_per_token": ms_per_token(ref.results) if ref else None,
                       "speculative_ms_per_token": ms_per_token(lv.results),
                       "mean_accepted_length": mal, **interval_figures(sp, predicted_speedup(mal)),
                       "server_counters": lv.spec.to_dict() if lv.spec else None})
    below = [p["batch"] for p in points if p["speedup"] is not None and p["speedup"] < 1]
    summary = ("throughput per load level: " + ", ".join(
        f"c{p['batch']} {p['speculative_tokens_per_s'] or 0:.1f} tok/s"
        + (f" ({p['speedup_text']})" if p["speedup"] else "") for p in points)
        + (f"; slower than the reference from concurrency {below[0]}" if below else ""))
    counts = verdict_counts(points)
    if counts:
        summary += f"; of {len(points)} levels {counts}"
    return CheckResult(True, summary,
                       {"crossover_concurrency": below[0] if below else None,
                        "verdicts": {"short": {str(p["batch"]): p["verdict"] for p in points}},
                        "pairs": "one per wave: its wall time per completion token, endpoint and reference",
                        "interval": "95% t interval of the mean log ratio over the waves",
                        "predicted_from": "tokens per target pass: an upper bound (the server's step costs are not known)"},
                       {"points": {"short": points}}, informational=True)
