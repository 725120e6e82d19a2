"""The seeded check: the promise of the exact rules for seeded requests (sampling.py). A
seeded request samples with noise keyed on (seed, position) and is verified by the
coupled rule, so speculative decoding must emit byte for byte the tokens seeded plain
decoding emits, at every audited batch size, under the deployed policy and with drafting
forced. A first divergence is a near-tie (numerics) when the reference's top-2 margin of
log p + g there is below the backend's tie margin (tie_margin_for, as in the greedy
equivalence check); a measured margin is divided by the request's temperature, since a
logit gap moved by d moves the gap of log p by d / T."""

from __future__ import annotations

import time

import torch

from ..engine import GenerationParams, Request
from ..policy import FixedK
from ..sampling import SamplingParams, keyed_gumbel, logits_to_probs
from ..verify import LOSSY_RULES
from .checks import CheckResult
from .churn import mixed_lengths, run_churned
from .context import AuditContext
from .stats import against_null
from .equivalence import NULL_ALPHA, compare, near_tie_allowance, null_findings, reference_logits_at, tie_margin_for


def _keyed_margin(ctx: AuditContext, sp: SamplingParams):
    def fn(prompt, ref, index):
        logits = reference_logits_at(ctx.model, prompt, ref, index)  # [V]
        p = logits_to_probs(logits[None], sp)[0].double()
        g = keyed_gumbel(sp.seed, [len(prompt) + index], p.shape[-1])[0]
        return torch.log(p) + g  # the scores whose argmax is the token; top-2 gap = margin
    return fn


def seeded_check(ctx: AuditContext) -> CheckResult:
    cfg = ctx.config
    if cfg.rule in LOSSY_RULES or cfg.rule == "greedy":
        return CheckResult(True, f"not applicable: rule {cfg.rule!r} makes no promise for seeded "
                           "sampled requests", {"applicable": False, "rule": cfg.rule}, informational=True)
    t0 = time.perf_counter()
    max_new = cfg.sizes.seeded_max_new
    # every slice keeps a prompt: the first of each slice, then the second of each, ...
    rank, seen = [], {}
    for p in ctx.prompts:
        rank.append(seen.get(p.slice, 0))
        seen[p.slice] = rank[-1] + 1
    order = sorted(range(len(ctx.prompt_ids)), key=lambda i: (rank[i], i))
    chosen = order[:cfg.sizes.seeded_prompts] if cfg.sizes.seeded_prompts else order
    prompt_ids = [ctx.prompt_ids[i] for i in chosen]
    n = len(prompt_ids)
    # the audited sampling settings in turn (filters included: keyed noise over a filtered p
    # must pick the same token in both decoders)
    sampling = [cfg.sampling_of(i, cfg.seed * 7_919 + 104_729 * i) for i in range(n)]

    lengths = mixed_lengths(n, max_new)  # each prompt's own, in the plain, null and speculative runs alike

    def requests():
        return [Request(ids, GenerationParams(max_new_tokens=m, sampling=sp, stop_token_ids=ctx.stops))
                for ids, sp, m in zip(prompt_ids, sampling, lengths)]

    max_len = max(map(len, prompt_ids)) + max_new
    plain = requests()
    temps = ", ".join(st.label for st in cfg.settings)
    with ctx.progress.stage(f"seeded: plain, {temps}, b=1", n) as bar:
        ctx.engine(1, max_len, speculative=False, rule="rejection").run(plain, on_finish=lambda r: bar.advance())
    configs = [(b, None, cfg.policy) for b in cfg.greedy_batch_sizes]
    if cfg.policy != "fixed":
        configs.append((max(cfg.greedy_batch_sizes), FixedK(cfg.forced_k), f"fixed k={cfg.forced_k}"))
    per_config, rows, failures = [], [], []
    allowance = 0 if cfg.batch_invariant else near_tie_allowance(n)
    tie = tie_margin_for(ctx.model)
    per_t = "noise_top2_gap" in tie  # a measured logit-gap noise d moves the gap of log p by d / T
    noise = tie["value"]  # in logits
    null = None
    if per_t and not cfg.batch_invariant:
        # a backend whose numerics move with batching: its own null run, seeded plain decoding
        # at the largest audited batch size against seeded plain at batch 1 (as the
        # equivalence check's null run): near-ties no more frequent than there. The margin
        # stays the measured noise, and a null divergence beyond it fails (null_findings)
        b_null = max(cfg.greedy_batch_sizes)
        null_reqs, null_churn = requests(), None
        if b_null > 1:
            with ctx.progress.stage(f"seeded: null run, plain b={b_null}", n) as bar:
                null_churn = run_churned(ctx.engine(min(b_null, n), max_len, speculative=False, rule="rejection"),
                                         null_reqs, f"{cfg.seed}/seeded-null/{b_null}",
                                         on_finish=lambda r: bar.advance())
        else:
            null_reqs = plain
        cs = [compare(prompt_ids[i], ref.output_ids, got.output_ids, _keyed_margin(ctx, sampling[i]),
                      noise / sampling[i].temperature) for i, (ref, got) in enumerate(zip(plain, null_reqs))]
        logit_margins = sorted(c.margin * sampling[i].temperature for i, c in enumerate(cs) if c.margin is not None)
        beyond = [{"id": ctx.prompts[chosen[i]].id, "first_divergence": c.first_divergence,
                   "margin": None if c.margin is None else c.margin * sampling[i].temperature}
                  for i, c in enumerate(cs) if c.verdict == "divergence"]
        null = {"batch": b_null, "prompts": n, "differ": sum(not c.exact for c in cs),
                "margins_in_logits": logit_margins, "beyond_noise": len(beyond), "beyond_noise_prompts": beyond,
                "tie_margin": noise, "alpha": NULL_ALPHA, "churn": null_churn,
                "reference": "seeded plain decoding, batch 1"}
    alpha = NULL_ALPHA / len(configs)

    def margin_for(sp: SamplingParams) -> float:
        return noise / sp.temperature if per_t else noise
    for b, policy, label in configs:
        reqs = requests()
        with ctx.progress.stage(f"seeded: speculative, {label}, b={b}", n) as bar:
            churn = run_churned(ctx.engine(min(b, n), max_len, policy=policy), reqs, f"{cfg.seed}/seeded/{label}/{b}",
                                on_finish=lambda r: bar.advance(), policy=label)
        counts = {"identical": 0, "near-tie": 0, "divergence": 0}
        for i, (ref, got) in enumerate(zip(plain, reqs)):
            c = compare(prompt_ids[i], ref.output_ids, got.output_ids, _keyed_margin(ctx, sampling[i]),
                        margin_for(sampling[i]))
            counts[c.verdict] += 1
            if c.verdict != "identical":
                rows.append({"batch": b, "policy": label, "id": ctx.prompts[chosen[i]].id, **c.to_dict()})
        ok, fisher = against_null(counts, n, null, alpha, allowance)  # a noisy backend: against its null
        drafted = sum(r.stats.drafted for r in reqs)
        per_config.append({"batch": b, "policy": label, "prompts": n, **counts, "drafted": drafted,
                           "accepted": sum(r.stats.accepted for r in reqs), "passed": ok, "churn": churn,
                           **({} if fisher is None else {"fisher_p_vs_null": fisher, "alpha": alpha})})
        if not ok:
            failures.append(f"b={b} ({label}): {n - counts['identical']} of {n} differ, "
                            f"{counts['divergence']} at a clear margin"
                            + ("" if fisher is None or counts["divergence"] else
                               f", against the null run's {null['differ']}/{n} (Fisher p = {fisher:.2g} < {alpha:.2g})"))
    found, inconclusive = null_findings(tie, null, "seeded plain decoding") if per_t else ([], False)
    drafted = sum(r["drafted"] for r in per_config)
    passed = not failures and not found and drafted > 0
    if failures or found:
        summary = "; ".join(found + (["seeded speculative output differs from seeded plain output: "
                                      + "; ".join(failures)] if failures else []))
    elif drafted == 0:
        summary = "INCONCLUSIVE: no draft was verified in any seeded run"
    else:
        where = [f"b{r['batch']}" + ("" if r["policy"] == cfg.policy else f" {r['policy']}") for r in per_config]
        if null is not None and any(r["near-tie"] for r in per_config):
            differ = ", ".join(f"{w} {r['near-tie']}" for w, r in zip(where, per_config))
            head = f"seeded output equal to seeded plain decoding but for near-ties ({differ} of {n})"
        else:
            head = "seeded output identical to seeded plain decoding"
        summary = (f"{head} for {n} prompts at " + ", ".join(where) + f" (settings {temps}, {drafted} drafts verified)"
                   + ("" if null is None else
                      f"; near-ties as often as the null run's (plain b={null['batch']}: {null['differ']}/{n} differ)"))
    figures = {"applicable": True, "temperature": cfg.temperature, "temperatures": list(cfg.temperatures),
               "settings": [{**st.to_dict(), "values": st.describe(), "prompts": len(range(i, n, len(cfg.settings)))}
                            for i, st in enumerate(cfg.settings)],
               "prompts": n, "max_new_tokens": max_new,
               "drafts_verified": drafted, "tie_margin": tie["value"], "tie_margin_source": tie,
               "tie_margin_scaling": "divided by each request's temperature" if per_t else None,
               "near_tie_allowance": allowance if null is None else None, "null_run": null,
               "inconclusive": inconclusive,
               "divergences": sum(r["divergence"] for r in per_config),
               "near_ties": sum(r["near-tie"] for r in per_config),
               "reference": "seeded plain decoding, batch 1", "seconds": round(time.perf_counter() - t0, 1)}
    return CheckResult(passed, summary, figures, {"per_config": per_config, "prompts": rows})
