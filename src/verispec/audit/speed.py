"""Acceptance and speed per task slice, from the greedy runs at batch 1: plain and
speculative decoding ran prompt by prompt, interleaved, in this process, so they saw the
same machine load. Tokens/s is end to end per request (prefill included) for both."""

from __future__ import annotations

from .checks import CheckResult
from .context import AuditContext, GreedyRuns


def _aggregate(name: str, plain: list, spec: list, k: int) -> dict:
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
    plain_tps = tok_p / t_p if t_p else None
    spec_tps = tok_s / t_s if t_s else None
    ks = [kb for r in spec for kb in r.stats.k_chosen]
    return {"slice": name, "prompts": len(spec), "tokens": tok_s,
            "mean_k_chosen": sum(ks) / len(ks) if ks else None,
            "steps_without_drafts": sum(kb == 0 for kb in ks) / len(ks) if ks else None,
            "mean_accepted_length": tok_s / passes if passes else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "acceptance_per_position": per_pos,
            "plain_tokens_per_s": plain_tps, "speculative_tokens_per_s": spec_tps,
            "speedup": spec_tps / plain_tps if plain_tps and spec_tps else None}


def slices_check(ctx: AuditContext, runs: GreedyRuns) -> CheckResult:
    k = ctx.config.k
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(ctx.prompts):
        groups.setdefault(p.slice, []).append(i)
    rows = [_aggregate(name, [runs.reference[i] for i in idx], [runs.speculative[1][i] for i in idx], k)
            for name, idx in groups.items()]
    pooled = _aggregate("all", runs.reference, runs.speculative[1], k)
    ranked = [r for r in rows if r["speedup"] is not None]
    best = max(ranked, key=lambda r: r["speedup"]) if ranked else None
    worst = min(ranked, key=lambda r: r["speedup"]) if ranked else None
    summary = (f"{ctx.config.policy} policy: pooled speedup {pooled['speedup']:.2f}x, "
               f"{pooled['mean_accepted_length']:.2f} tokens per target pass, "
               f"mean k chosen {pooled['mean_k_chosen']:.2f}")
    if best and worst:
        summary += (f"; best {best['slice']} {best['speedup']:.2f}x, "
                    f"worst {worst['slice']} {worst['speedup']:.2f}x")
    figures = {"pooled_speedup": pooled["speedup"],
               "pooled_mean_accepted_length": pooled["mean_accepted_length"],
               "pooled_acceptance_rate": pooled["acceptance_rate"],
               "best_slice": best and best["slice"], "worst_slice": worst and worst["slice"],
               "batch": 1, "k": k, "policy": ctx.config.policy, "drafter": ctx.config.draft,
               "pooled_mean_k_chosen": pooled["mean_k_chosen"],
               "max_new_tokens": ctx.config.sizes.max_new_tokens,
               "prompt_format": "chat template" if ctx.chat else "raw text",
               "timing": "end to end per request (prefill included), plain and speculative "
                         "interleaved prompt by prompt"}
    return CheckResult("slices", True, summary, figures, {"slices": rows, "pooled": pooled},
                       informational=True)
