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
from .endpoint.state import EndpointAudit
from .endpoint.client import EndpointRun, PromptResult
from .endpoint.counters import SpecCounters
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


def ranking_text(rows: list[dict], best: str | None, worst: str | None, speedups: bool = True) -> str:
    """The best and worst of the slices `rows` as the summary and headline name them, among
    the ranked slices only (a resolved speedup: RANKED; by acceptance where no speedup was
    timed), so that one ranked slice is not called both best and worst. speedups: each name
    with its speedup text."""
    timed = any(r["speedup"] is not None for r in rows)
    ranked = [r for r in rows if r["verdict"] in RANKED] if timed else rows
    if best is None or not ranked:
        return "no slice resolved"
    by_name = {r["slice"]: r for r in rows}

    def named(name):
        return f"{name} {by_name[name]['speedup_text']}" if speedups and timed else name
    if len(ranked) == 1:
        return f"1 slice {'resolved' if timed else 'ranked'}: {named(best)}"
    return f"best {named(best)}, worst {named(worst)}"


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
    summary += "; " + ranking_text(rows, best and best["slice"], worst and worst["slice"])
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


# -- from outside (endpoint mode: the state in endpoint/state.py) ------------------------------
def endpoint_slices_check(a: EndpointAudit) -> CheckResult:
    return _endpoint_slices(a.run, a.reference, a.speed_runs)


def _tps(results: list[PromptResult]) -> float | None:
    toks = sum(r.completion_tokens or 0 for r in results if r.ok)
    secs = sum(r.latency_s or 0.0 for r in results if r.ok)
    return toks / secs if secs else None


def _answer_s_per_token(r: PromptResult) -> float | None:
    """Seconds per completion token of one answer, end to end (None: failed or empty)."""
    if not r.ok or not r.completion_tokens or not r.latency_s:
        return None
    return r.latency_s / r.completion_tokens


def _request_spec(r: PromptResult) -> tuple[dict, str] | None:
    """One answer's speculative figures and where they come from: its response's own
    fields, else the endpoint's /metrics difference over it alone (client.run_paired)."""
    if r.server_info:
        return r.server_info, "responses"
    if r.counter_spec:
        return r.counter_spec, "/metrics counters per request"
    return None


def _response_sums(results: list[PromptResult]) -> dict | None:
    """Per-request speculative figures summed over answers (None when no answer had any)."""
    infos = [x for r in results if r.ok and (x := _request_spec(r)) is not None]
    if not infos:
        return None

    def total(key):
        vals = [i.get(key) for i, _ in infos]
        return sum(vals) if vals and all(v is not None for v in vals) else None
    return {"source": infos[0][0].get("source"), "via": infos[0][1], "responses": len(infos),
            "drafted": total("drafted"), "accepted": total("accepted"), "verify_steps": total("verify_steps"),
            "target_passes": total("target_passes")}


def _slice_row(name: str, spec: list[PromptResult], plain: list[PromptResult] | None,
               counters: SpecCounters | None = None, pairs: list[tuple] | None = None) -> dict:
    """One slice's figures from each answer's own speculative figures (_request_spec); the
    pooled row takes the level's /metrics counters where the server has them (and says
    which). pairs: (plain, speculative) seconds per token of each prompt in each repeat,
    timed side by side: the speedup and its interval. What acceptance predicts is tokens per
    target pass, an upper bound: the server's step costs are not known from outside."""
    sums = _response_sums(spec)
    toks = sum(r.completion_tokens or 0 for r in spec if r.ok)
    rate = mal = None
    source = None
    if sums:
        if sums["drafted"]:
            rate = sums["accepted"] / sums["drafted"]
        if sums["target_passes"]:
            mal = toks / sums["target_passes"]
        elif sums["verify_steps"]:
            mal = 1 + sums["accepted"] / sums["verify_steps"]
        elif sums["accepted"] is not None and toks > sums["accepted"]:
            # llama.cpp counts no passes: each (the prefill's included) emits its accepted
            # drafts and one token of its own
            mal = toks / (toks - sums["accepted"])
        source = f"{sums['via']} ({sums['source']})"
    per_pos: list = []
    gauges = None
    if counters is not None and not counters.from_gauges:
        rate = counters.acceptance_rate if counters.draft_tokens else rate
        mal = tokens_per_pass(counters) or mal
        per_pos = [a for a in counters.acceptance_per_position if a is not None]
        source = f"/metrics counters ({counters.source})"
    elif counters is not None:
        gauges = {"accept_length_gauge": counters.accept_length_gauge, "accept_rate_gauge": counters.accept_rate_gauge,
                  "samples": counters.gauge_samples,
                  "note": "SGLang gauges: last-batch values sampled during the run, not this level's figures"}
    s_tps, p_tps = _tps(spec), (_tps(plain) if plain else None)
    sp = speedup_interval([p for p, _ in pairs], [s for _, s in pairs]) if pairs else None
    return {"slice": name, "prompts": len(spec), "tokens": toks, "mean_accepted_length": mal, "acceptance_rate": rate,
            "acceptance_per_position": per_pos, "plain_tokens_per_s": p_tps, "figures_from": source,
            "response_sums": sums, "gauges": gauges, "speculative_tokens_per_s": s_tps,
            **interval_figures(sp, predicted_speedup(mal))}


def tokens_per_pass(spec: SpecCounters) -> float | None:
    """Tokens per target pass where the server counts passes (verispec), else
    1 + accepted / verification steps (vLLM, llama.cpp; bonus token included)."""
    return spec.tokens_per_target_pass or spec.mean_acceptance_length


def _counters_agree(sums: dict | None, counters: SpecCounters | None) -> bool | None:
    """Do the answers' own fields add up to the /metrics counters' differences?"""
    if not sums or counters is None or counters.from_gauges or sums["drafted"] is None:
        return None
    return (sums["drafted"] == counters.draft_tokens and sums["accepted"] == counters.accepted_tokens)


def _endpoint_slices(run: EndpointRun, reference: EndpointRun | None,
                     speed_runs: list[tuple[EndpointRun, EndpointRun]] = ()) -> CheckResult:
    """Per slice at the first level; speedups from every prompt's pairs: the paired run's
    and each of speed_runs' (further paired runs at concurrency 1)."""
    level = run.levels[0]
    plain = reference.levels[0].results if reference else None
    repeats = ([(level.results, plain)] if plain else []) + [(e.levels[0].results, r.levels[0].results)
                                                             for e, r in speed_runs]

    def pairs(idx):
        return [(_answer_s_per_token(ref[i]), _answer_s_per_token(got[i])) for got, ref in repeats for i in idx]
    names = list(dict.fromkeys(r.slice for r in level.results))
    rows = []
    for name in names:
        idx = [i for i, r in enumerate(level.results) if r.slice == name]
        rows.append(_slice_row(name, [level.results[i] for i in idx], [plain[i] for i in idx] if plain else None,
                               pairs=pairs(idx)))
    pooled = _slice_row("pooled", level.results, plain, level.spec, pairs(range(len(level.results))))
    agree = _counters_agree(pooled["response_sums"], level.spec)
    measured = [r for r in rows if r["speedup"] is not None]
    if measured:  # best and worst among the slices whose speedup says something
        ranked, key = [r for r in measured if r["verdict"] in RANKED], (lambda r: r["speedup"])
    else:  # no reference: by acceptance alone
        ranked, key = rows, (lambda r: r["mean_accepted_length"] or 0)
    best, worst = (max(ranked, key=key)["slice"], min(ranked, key=key)["slice"]) if ranked else (None, None)
    summary = (f"concurrency {level.concurrency}"
               + (f", {pooled['pairs']} pairs ({len(level.results)} prompts x {len(repeats)} repeats)"
                  if repeats else "")
               + ": pooled speedup "
               + (pooled["speedup_text"] if pooled["speedup"] else "n/a (no separate reference)")
               + (f", {pooled['mean_accepted_length']:.2f} tokens/target pass" if pooled["mean_accepted_length"]
                  else "")
               + (f", acceptance {pooled['acceptance_rate']:.1%}" if pooled["acceptance_rate"] is not None else "")
               + (f" (from {pooled['figures_from']})" if pooled["figures_from"] else
                  ", acceptance unknown: the server publishes no speculative counters")
               + ("" if agree is None else "; responses agree with /metrics" if agree
                  else "; responses DISAGREE with /metrics"))
    counts = verdict_counts(rows)
    if counts:
        summary += f"; of {len(rows)} slices {counts}"
    figures = {"pooled_speedup": pooled["speedup"], "pooled_speedup_ci": pooled["speedup_ci"],
               "pooled_verdict": pooled["verdict"], "pooled_predicted": pooled["predicted"],
               "pooled_pairs": pooled["pairs"], "speed_repeats": len(repeats),
               "pooled_mean_accepted_length": pooled["mean_accepted_length"],
               "pooled_acceptance_rate": pooled["acceptance_rate"],
               "pooled_acceptance_per_position": pooled["acceptance_per_position"],
               "figures_from": pooled["figures_from"], "responses_agree_with_counters": agree,
               "best_slice": best, "worst_slice": worst, "gauges": pooled["gauges"],
               "noise_slices": [r["slice"] for r in rows if r["verdict"] == "noise"],
               "unresolved_slices": [r["slice"] for r in rows if r["verdict"] == "unresolved"],
               "timing": "end to end per request; each prompt to the endpoint and to the reference back to back "
                         "(client.run_paired), once per repeat, the order flipped repeat by repeat; a pair is "
                         "one prompt in one repeat",
               "interval": "95% t interval of the mean log ratio over the pairs",
               "predicted_from": "tokens per target pass: an upper bound (the server's step costs are not known)",
               "server_counters": level.spec.to_dict() if level.spec else None}
    return CheckResult(True, summary, figures, {"slices": rows, "pooled": pooled}, informational=True)
