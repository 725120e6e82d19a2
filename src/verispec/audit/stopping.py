"""The stopping check: speculative output ends exactly where plain output ends, when the
stop falls inside a run of accepted drafts, and max_new_tokens is honoured exactly.

Built from the greedy reference (plain decoding, batch 1): for each prompt, a token of its
reference output becomes the request's stop token, so plain decoding with that stop ends
right after the token's first occurrence, and a second request asks for exactly m new
tokens (m below the reference's length), so it must end after m. The speculative engine
runs both at the largest audited batch size, under the deployed policy and with a fixed
k. On repetitive prompts the stop token and the m-th token land inside drafted runs; the
check counts how often (a stop that never fell inside drafts proved little). Prompts whose
greedy speculative output already diverged (near-ties) before the cut are left out."""

from __future__ import annotations

from ..engine import GenerationParams, Request
from ..policy import FixedK
from .checks import CheckResult
from .context import AuditContext, GreedyRuns
from .equivalence import first_divergence


def _inside_drafts(r: Request) -> bool:
    """Whether the request's last token (its stop or its m-th token) was a drafted position
    of its last step: an accepted draft, with the rule's verdict on later drafts discarded."""
    if not r.stats.trace:
        return False
    n0, drafts, acc, _ = r.stats.trace[-1]
    j = len(r.prompt_ids) + len(r.output_ids) - 1 - n0  # its index in that step's emitted run
    return j < min(acc, len(drafts))


def stopping_check(ctx: AuditContext, runs: GreedyRuns) -> CheckResult:
    cfg = ctx.config
    b = max(cfg.greedy_batch_sizes)
    spec_b = runs.speculative[b]
    cases = []  # (prompt index, params, expected output, expected finish reason)
    forced = runs.forced[1] if runs.forced is not None else spec_b
    for i, (ref, got, got_forced) in enumerate(zip(runs.reference, spec_b, forced)):
        out = ref.output_ids
        ds = [d for d in (first_divergence(out, got.output_ids), first_divergence(out, got_forced.output_ids))
              if d is not None]
        safe = min(ds, default=len(out))  # the greedy runs agree on out[:safe]
        if safe < 4:
            continue
        tok = out[(safe - 1) // 2 + 1]
        cut = out.index(tok)
        stops = tuple(dict.fromkeys(ctx.stops + (tok,)))
        cases.append((i, GenerationParams(max_new_tokens=len(out) + 8, stop_token_ids=stops), out[:cut + 1],
                      "stop"))
        m = max(2, (2 * safe) // 3)
        if all(t not in ctx.stops for t in out[:m]):
            cases.append((i, GenerationParams(max_new_tokens=m, stop_token_ids=ctx.stops), out[:m], "length"))
    if not cases:
        return CheckResult("stopping", False, "INCONCLUSIVE: no reference output long enough to cut",
                           {"cases": 0})
    configs = [(None, cfg.policy)]
    if cfg.policy != "fixed":
        configs.append((FixedK(cfg.forced_k), f"fixed k={cfg.forced_k}"))
    max_len = max(map(len, ctx.prompt_ids)) + max(p.max_new_tokens for _, p, _, _ in cases)
    per_config, bad = [], []
    for policy, label in configs:
        reqs = [Request(ctx.prompt_ids[i], params) for i, params, _, _ in cases]
        with ctx.progress.stage(f"stopping: speculative, {label}, b={b}", len(reqs)) as bar, ctx.fault():
            ctx.engine(min(b, len(reqs)), max_len, policy=policy).run(reqs, on_finish=lambda r: bar.advance())
        wrong = inside = 0
        for (i, params, want, reason), r in zip(cases, reqs):
            ok = r.output_ids == want and r.finish_reason == reason
            inside += _inside_drafts(r)
            if not ok:
                wrong += 1
                bad.append({"policy": label, "id": ctx.prompts[i].id, "expected_reason": reason,
                            "got_reason": r.finish_reason, "expected_tokens": len(want),
                            "got_tokens": len(r.output_ids), "first_divergence": first_divergence(want, r.output_ids)})
        per_config.append({"batch": b, "policy": label, "cases": len(reqs), "wrong": wrong,
                           "ended_inside_drafts": inside, "drafted": sum(r.stats.drafted for r in reqs)})
    inside = sum(c["ended_inside_drafts"] for c in per_config)
    wrong = sum(c["wrong"] for c in per_config)
    passed = wrong == 0 and inside > 0
    if wrong:
        summary = (f"{wrong} of {sum(c['cases'] for c in per_config)} cut requests end elsewhere than plain "
                   "decoding's (a stop or length limit mishandled inside accepted drafts)")
    elif not inside:
        summary = "INCONCLUSIVE: no stop or length limit fell inside a drafted run"
    else:
        summary = (f"{sum(c['cases'] for c in per_config)} requests cut by a stop token or max_new_tokens end "
                   f"exactly where plain decoding ends; {inside} of the cuts fell inside drafted runs")
    figures = {"cases": len(cases), "batch": b, "wrong": wrong, "ended_inside_drafts": inside,
               "reference": "plain greedy decoding at batch 1, cut at a stop token or length"}
    return CheckResult("stopping", passed, summary, figures, {"per_config": per_config, "wrong": bad[:40]})
