"""The stopping check: speculative output ends exactly where plain output ends, when the
stop falls inside a run of accepted drafts, and max_new_tokens is honoured exactly.

Built from the greedy reference (plain decoding, batch 1): for each prompt, a token of its
reference output becomes the request's stop token, so plain decoding with that stop ends
right after the token's first occurrence, and a second request asks for exactly m new
tokens (m below the reference's length), so it must end after m. The speculative engine
runs both at the largest audited batch size, under the deployed policy and with a fixed
k. On repetitive prompts the stop token and the m-th token land inside drafted runs; the
check counts how often (a stop that never fell inside drafts proved little). Prompts whose
greedy speculative output already diverged (near-ties) before the cut are left out. On a
backend whose numerics move with batching (ggml) the rerun here can flip a near-tie before
the cut that the greedy runs did not; a request whose tokens changed there, at a top-2 gap
below the backend's measured noise, is set aside and reported (an end in the wrong place,
or a change at a clear margin, still fails)."""

from __future__ import annotations

from ..engine import GenerationParams, Request
from ..policy import FixedK
from .checks import CheckResult
from .context import AuditContext, GreedyRuns
from .equivalence import first_divergence, reference_logits_at, tie_margin_for, top2_margin


def _inside_drafts(r: Request) -> bool:
    """Whether the request's stop token was an accepted draft of its last step with the
    step's run going on past it (later drafts and the bonus token must be dropped)."""
    if not r.stats.trace:
        return False
    n0, drafts, acc, _ = r.stats.trace[-1]
    j = len(r.prompt_ids) + len(r.output_ids) - 1 - n0  # its index in that step's emitted run
    return j < min(acc, len(drafts))


def _limit_in_drafted_step(r: Request) -> bool:
    """Whether the length limit was reached by a step that verified drafts: an exact engine
    drafts at most max_new_tokens - len(output) - 1 there, so its run ends on the limit; an
    engine that drafts one more or checks the limit late overshoots."""
    if not r.stats.trace:
        return False
    _, drafts, acc, _ = r.stats.trace[-1]
    return bool(drafts) and acc == len(drafts)


def _accepted_positions(r: Request) -> list[int]:
    """Output indices of r that were accepted drafts (a step's run went on past them)."""
    P, out = len(r.prompt_ids), []
    for n0, drafts, acc, _ in r.stats.trace:
        out += [n0 - P + i for i in range(min(acc, len(drafts)))]
    return out


def _cut(out: list[int], safe: int, drafted: list[int]) -> tuple[int, int]:
    """-> (stop position, length) to cut a reference output at: positions where the greedy
    speculative run had accepted drafts (so a correct engine's run goes on past the cut),
    the stop token's first occurrence in the output, else the middle and 2/3 of `safe`."""
    inside = [j for j in drafted if 2 <= j < safe]
    stop = next((j for j in inside[len(inside) // 2:] + inside if out.index(out[j]) == j), None)
    if stop is None:
        stop = out.index(out[(safe - 1) // 2 + 1])
    length = inside[(2 * len(inside)) // 3] + 1 if inside else max(2, (2 * safe) // 3)
    return stop, length


def _near_tie_flip(ctx: AuditContext, i: int, want: list[int], got: list[int], tie_margin: float) -> bool:
    """Whether got differs from want by a changed token (not a length: an early or late end
    is never excused) where the batch-1 reference's top-2 logit gap is below tie_margin."""
    d = first_divergence(want, got)
    if d is None or d >= min(len(want), len(got)):
        return False
    return top2_margin(reference_logits_at(ctx.model, ctx.prompt_ids[i], want, d)) < tie_margin


def _cases(ctx: AuditContext, runs: GreedyRuns, spec_b: list) -> list[tuple]:
    """The cut requests: (prompt index, params, expected output, expected finish reason), each
    reference output cut by a stop token and by a length limit where the greedy runs agree."""
    cases = []  # (prompt index, params, expected output, expected finish reason)
    forced = runs.forced[1] if runs.forced is not None else spec_b
    for i, (ref, got, got_forced) in enumerate(zip(runs.reference, spec_b, forced)):
        out = ref.output_ids
        ds = [d for d in (first_divergence(out, got.output_ids), first_divergence(out, got_forced.output_ids))
              if d is not None]
        safe = min(ds, default=len(out))  # the greedy runs agree on out[:safe]
        if safe < 4:
            continue
        cut, m = _cut(out, safe, _accepted_positions(got_forced))
        tok = out[cut]
        stops = tuple(dict.fromkeys(ctx.stops + (tok,)))
        cases.append((i, GenerationParams(max_new_tokens=len(out) + 8, stop_token_ids=stops), out[:cut + 1],
                      "stop"))
        if all(t not in ctx.stops for t in out[:m]):
            cases.append((i, GenerationParams(max_new_tokens=m, stop_token_ids=ctx.stops), out[:m], "length"))
    return cases


def _run_config(ctx: AuditContext, cases: list[tuple], b: int, max_len: int, policy, label: str, tie: dict,
                noisy: bool, bad: list, excused: list) -> dict:
    """The cut requests under one policy at batch b: its row of counts; wrong and excused
    requests go to bad and excused."""
    reqs = [Request(ctx.prompt_ids[i], params) for i, params, _, _ in cases]
    with ctx.progress.stage(f"stopping: speculative, {label}, b={b}", len(reqs)) as bar:
        ctx.engine(min(b, len(reqs)), max_len, policy=policy).run(reqs, on_finish=lambda r: bar.advance())
    wrong = inside = limits = near = 0
    for (i, params, want, reason), r in zip(cases, reqs):
        ok = r.output_ids == want and r.finish_reason == reason
        if not ok and noisy and _near_tie_flip(ctx, i, want, r.output_ids, tie["value"]):
            near += 1  # the output changed before the cut, at a near-tie: numerics, not a stop
            excused.append({"policy": label, "id": ctx.prompts[i].id,
                            "first_divergence": first_divergence(want, r.output_ids)})
            continue
        if reason == "stop":
            inside += _inside_drafts(r)
        else:
            limits += _limit_in_drafted_step(r)
        if not ok:
            wrong += 1
            bad.append({"policy": label, "id": ctx.prompts[i].id, "expected_reason": reason,
                        "got_reason": r.finish_reason, "expected_tokens": len(want),
                        "got_tokens": len(r.output_ids), "first_divergence": first_divergence(want, r.output_ids)})
    return {"batch": b, "policy": label, "cases": len(reqs), "wrong": wrong, "near_ties": near,
            "stops_inside_drafts": inside, "limits_in_drafted_steps": limits,
            "drafted": sum(r.stats.drafted for r in reqs)}


def stopping_check(ctx: AuditContext, runs: GreedyRuns) -> CheckResult:
    cfg = ctx.config
    b = max(cfg.greedy_batch_sizes)
    spec_b = runs.speculative[b]
    cases = _cases(ctx, runs, spec_b)
    if not cases:
        return CheckResult(False, "INCONCLUSIVE: no reference output long enough to cut",
                           {"cases": 0})
    configs = [(None, cfg.policy)]
    if cfg.policy != "fixed":
        configs.append((FixedK(cfg.forced_k), f"fixed k={cfg.forced_k}"))
    max_len = max(map(len, ctx.prompt_ids)) + max(p.max_new_tokens for _, p, _, _ in cases)
    per_config, bad, excused = [], [], []
    # on a backend whose numerics move with batching (ggml), this batch can flip a near-tie
    # before the cut that the greedy runs above did not: such a request shows nothing about
    # stops (its tokens changed before them) and is set aside, not counted wrong
    tie = tie_margin_for(ctx.model)
    noisy = "noise_top2_gap" in tie and not cfg.batch_invariant
    for policy, label in configs:
        per_config.append(_run_config(ctx, cases, b, max_len, policy, label, tie, noisy, bad, excused))
    inside = sum(c["stops_inside_drafts"] for c in per_config)
    limits = sum(c["limits_in_drafted_steps"] for c in per_config)
    wrong = sum(c["wrong"] for c in per_config)
    near = sum(c["near_ties"] for c in per_config)
    passed = wrong == 0 and inside + limits > 0
    if wrong:
        summary = (f"{wrong} of {sum(c['cases'] for c in per_config) - near} cut requests end elsewhere than plain "
                   "decoding's (a stop or length limit mishandled inside accepted drafts)")
    elif not inside + limits:
        summary = "INCONCLUSIVE: no stop fell inside an accepted run, no length limit in a drafted step"
    else:
        summary = (f"{sum(c['cases'] for c in per_config) - near} requests cut by a stop token or max_new_tokens end "
                   f"exactly where plain decoding ends; {inside} stops fell inside accepted runs, "
                   f"{limits} length limits were reached by a fully accepted run"
                   + (f"; {near} set aside: their tokens changed before the cut at a near-tie "
                      f"(margin < the backend's measured noise {tie['value']:.3g})" if near else ""))
    figures = {"cases": len(cases), "batch": b, "wrong": wrong, "stops_inside_drafts": inside,
               "limits_in_drafted_steps": limits, "near_ties_set_aside": near, "tie_margin": tie["value"],
               "reference": "plain greedy decoding at batch 1, cut at a stop token or length"}
    return CheckResult(passed, summary, figures, {"per_config": per_config, "wrong": bad[:40], "near_ties": excused[:40]})
