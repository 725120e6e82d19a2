"""Acceptance and speed per task slice at batch 1, each speedup with its interval and the
speedup its acceptance predicts.

Timing. Every audited prompt is timed plain and speculative side by side, speed_repeats
times (AuditSizes): repeat 1 is the greedy runs' (runner.greedy_runs: plain, then
speculative, prompt by prompt); each further repeat runs the prompt on a fresh batch-1
plain engine and a fresh speculative one with the same GenerationParams, back to back,
the order flipped repeat by repeat (ABBA), so that an order effect cancels over the
repeats and a drift of the machine cancels within a pair. A *pair* is one (prompt,
repeat); its ratio is plain seconds per token over speculative seconds per token, end to
end per request (prefill included) on both sides. A slice's speedup is the geometric mean
of its pairs' ratios with a t interval (stats.speedup_interval).

Prediction. What the measured tokens per target pass predict with this machine's step
costs (the cost model of the adaptive policy, ctx.cost_model, whatever the policy): a
plain decode costs target(1, 1), a speculative step target(1, k + 1) and k draft tokens (none
for a drafter the cost model calls free: prompt lookup), k the mean drafts per step. A
speedup its acceptance cannot explain is judged "noise" (stats.judge_speedup) and never
reported as a win.
"""

from __future__ import annotations

from ..engine import GenerationParams, Request
from .checks import CheckResult
from .context import AuditContext, GreedyRuns
from .stats import Speedup, judge_speedup, predicted_speedup, speedup_interval, speedup_text

# the verdicts that rank a slice as best or worst: a measured difference (or its absence)
RANKED = ("faster", "slower", "even")


def predicted_from_costs(costs, batch: int, tokens_per_pass: float | None, mean_k: float | None) -> float | None:
    """The speedup tokens_per_pass predicts at mean_k drafts per step on `batch` rows under
    costs (policy.costs.CostModel); None without a tokens-per-pass figure."""
    if tokens_per_pass is None:
        return None
    k = mean_k or 0.0
    draft_s = 0.0 if costs.draft_free else k * float(costs.draft(batch))
    return predicted_speedup(tokens_per_pass, float(costs.target(batch, 1)), float(costs.target(batch, k + 1)),
                             draft_s)


def interval_figures(sp: Speedup | None, predicted: float | None) -> dict:
    """A row's speedup figures: the estimate, its interval (None with fewer than two pairs),
    the pairs, what acceptance predicts, the verdict (stats.judge_speedup; None where no
    pair was timed) and the text the report prints."""
    verdict = judge_speedup(sp, predicted) if sp is not None else None
    text = speedup_text(sp, verdict, predicted)
    if sp is not None and predicted is None:
        text += " (acceptance unknown: noise cannot be told)"
    return {"speedup": sp.estimate if sp else None,
            "speedup_ci": [sp.low, sp.high] if sp and sp.pairs > 1 else None,
            "pairs": sp.pairs if sp else 0, "predicted": predicted, "verdict": verdict,
            "speedup_text": text}


def verdict_counts(rows: list[dict]) -> str:
    """'2 slices noise, 1 not resolved' ('' when every row was judged)."""
    noise = sum(r["verdict"] == "noise" for r in rows)
    unresolved = sum(r["verdict"] == "unresolved" for r in rows)
    parts = ([f"{noise} noise (acceptance cannot explain the speedup)"] if noise else []) + \
        ([f"{unresolved} not resolved at this budget"] if unresolved else [])
    return ", ".join(parts)


def _s_per_token(r: Request) -> float | None:
    return r.stats.time_s / len(r.output_ids) if r.output_ids else None


def _aggregate(name: str, plain: list[Request], spec: list[Request], prompts: int, k: int, costs) -> dict:
    """plain[j], spec[j]: the j-th pair's two requests, repeat by repeat (the first `prompts`
    pairs: the greedy runs'). Acceptance, tokens per pass and tokens/s pool every repeat;
    "tokens" is what the slice's prompts generate (the greedy run's outputs)."""
    tok_p = sum(len(r.output_ids) for r in plain)
    tok_s = sum(len(r.output_ids) for r in spec)
    t_p = sum(r.stats.time_s for r in plain)
    t_s = sum(r.stats.time_s for r in spec)
    drafted = sum(r.stats.drafted for r in spec)
    accepted = sum(r.stats.accepted for r in spec)
    passes = sum(r.stats.target_passes for r in spec)
    per_pos = []
    for i in range(k):
        d = sum(r.stats.drafted_per_position[i] for r in spec if len(r.stats.drafted_per_position) > i)
        a = sum(r.stats.accepted_per_position[i] for r in spec if len(r.stats.accepted_per_position) > i)
        per_pos.append(a / d if d else None)
    ks = [kb for r in spec for kb in r.stats.k_chosen]
    mean_k = sum(ks) / len(ks) if ks else None
    mal = tok_s / passes if passes else None
    sp = speedup_interval([_s_per_token(r) for r in plain], [_s_per_token(r) for r in spec])
    return {"slice": name, "prompts": prompts, "tokens": sum(len(r.output_ids) for r in spec[:prompts]),
            "mean_k_chosen": mean_k,
            "steps_without_drafts": sum(kb == 0 for kb in ks) / len(ks) if ks else None,
            "mean_accepted_length": mal,
            "acceptance_rate": accepted / drafted if drafted else None,
            "acceptance_per_position": per_pos,
            "plain_tokens_per_s": tok_p / t_p if t_p else None,
            "speculative_tokens_per_s": tok_s / t_s if t_s else None,
            **interval_figures(sp, predicted_from_costs(costs, 1, mal, mean_k))}


def repeat_runs(ctx: AuditContext, runs: GreedyRuns) -> list[tuple[list[Request], list[Request]]]:
    """(plain, speculative) requests of each repeat, in prompt order: the greedy runs' at
    batch 1, then ctx.config.sizes.speed_repeats - 1 more on fresh engines, each prompt
    with its greedy run's GenerationParams (so the outputs are the same)."""
    out = [(runs.reference, runs.speculative[1])]
    extra = ctx.config.sizes.speed_repeats - 1
    if extra < 1:
        return out
    params = [r.params for r in runs.reference]
    max_len = max(map(len, ctx.prompt_ids)) + ctx.greedy_params().max_new_tokens  # as the greedy runs'
    engines = {False: ctx.engine(1, max_len, speculative=False, rule="rejection"), True: ctx.engine(1, max_len)}
    warm = GenerationParams(max_new_tokens=4)  # first-call kernel setup, outside every timing
    for e in engines.values():
        e.run([Request(ctx.prompt_ids[0][:8], warm)])
    n = len(ctx.prompt_ids)
    with ctx.progress.stage(f"slices: {extra} more timings of plain vs speculative, b=1", 2 * n * extra) as bar:
        for rep in range(1, extra + 1):
            got: dict[bool, list[Request]] = {False: [], True: []}
            # the greedy runs time plain first: repeat 2 speculative first, and so on (ABBA)
            order = (True, False) if rep % 2 == 1 else (False, True)
            for ids, p in zip(ctx.prompt_ids, params):
                for speculative in order:
                    got[speculative].append(engines[speculative].run([Request(ids, p)])[0])
                    bar.advance()
            out.append((got[False], got[True]))
    return out


def slices_check(ctx: AuditContext, runs: GreedyRuns) -> CheckResult:
    k = ctx.config.k
    repeats = repeat_runs(ctx, runs)
    max_len = max(map(len, ctx.prompt_ids)) + ctx.greedy_params().max_new_tokens
    costs = ctx.cost_model(1, max_len)
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(ctx.prompts):
        groups.setdefault(p.slice, []).append(i)

    def pairs(idx):
        return [plain[i] for plain, _ in repeats for i in idx], [spec[i] for _, spec in repeats for i in idx]

    rows = [_aggregate(name, *pairs(idx), len(idx), k, costs) for name, idx in groups.items()]
    pooled = _aggregate("all", *pairs(range(len(ctx.prompts))), len(ctx.prompts), k, costs)
    ranked = [r for r in rows if r["verdict"] in RANKED]
    best = max(ranked, key=lambda r: r["speedup"]) if ranked else None
    worst = min(ranked, key=lambda r: r["speedup"]) if ranked else None
    # requests of the further repeats whose output is not their greedy run's (greedy: none)
    differ = sum(a.output_ids != b.output_ids for plain, spec in repeats[1:]
                 for a, b in zip(plain + spec, repeats[0][0] + repeats[0][1]))
    summary = (f"{ctx.config.policy} policy, {pooled['pairs']} pairs ({len(ctx.prompts)} prompts x "
               f"{len(repeats)} repeats): pooled speedup {pooled['speedup_text']}, "
               f"{pooled['mean_accepted_length']:.2f} tokens per target pass (predicts "
               f"{pooled['predicted']:.2f}x), mean k chosen {pooled['mean_k_chosen']:.2f}"
               if pooled["mean_accepted_length"] is not None else
               f"{ctx.config.policy} policy: pooled speedup {pooled['speedup_text']}, no target pass counted")
    if best and worst:
        summary += (f"; best {best['slice']} {best['speedup_text']}, "
                    f"worst {worst['slice']} {worst['speedup_text']}")
    counts = verdict_counts(rows)
    if counts:
        summary += f"; of {len(rows)} slices {counts}"
    figures = {"pooled_speedup": pooled["speedup"], "pooled_speedup_ci": pooled["speedup_ci"],
               "pooled_verdict": pooled["verdict"], "pooled_predicted": pooled["predicted"],
               "pooled_pairs": pooled["pairs"],
               "pooled_mean_accepted_length": pooled["mean_accepted_length"],
               "pooled_acceptance_rate": pooled["acceptance_rate"],
               "best_slice": best and best["slice"], "worst_slice": worst and worst["slice"],
               "noise_slices": [r["slice"] for r in rows if r["verdict"] == "noise"],
               "unresolved_slices": [r["slice"] for r in rows if r["verdict"] == "unresolved"],
               "batch": 1, "k": k, "policy": ctx.config.policy, "drafter": ctx.config.draft,
               "pooled_mean_k_chosen": pooled["mean_k_chosen"],
               "max_new_tokens": ctx.config.sizes.max_new_tokens, "speed_repeats": len(repeats),
               "repeat_outputs_differ": differ,
               "prompt_format": "chat template" if ctx.chat else "raw text",
               "timing": "end to end per request (prefill included); each prompt plain and speculative back "
                         "to back, once per repeat, the order flipped repeat by repeat; a pair is one prompt "
                         "in one repeat",
               "interval": "95% t interval of the mean log ratio over the pairs",
               "predicted_from": "tokens per target pass and the cost model's target and draft costs at "
                                 "batch 1 (draft cost " + ("none: a model-free drafter)" if costs.draft_free
                                                           else "measured)")}
    return CheckResult(True, summary, figures, {"slices": rows, "pooled": pooled}, informational=True)
