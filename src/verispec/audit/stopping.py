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

from dataclasses import dataclass, replace

from ..engine import GenerationParams, Request
from ..policy import FixedK
from .checks import CheckResult
from .context import AuditContext, GreedyRuns
from .endpoint.client import EndpointConfig
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



# -- from outside: any OpenAI-compatible server ------------------------------------------------
#
# Servers have mishandled stops inside accepted runs: sgl-project/sglang#31599 checked
# max_new_tokens before the stop, leaked the tokens after an EOS and emitted the bonus token
# past it. From outside, a greedy answer of the reference is cut by a stop string, a length
# limit and (where the kind takes them) a stop token id that fall inside it, on prompts that
# copy text (long accepted runs), and the endpoint must end exactly where that cut ends.

# the per-request stop token ids parameter, per server kind: verispec serve and llama-server
# have none (verispec ignores unknown fields, so sending it there would prove nothing)
STOP_IDS_PARAM = {"vllm": "stop_token_ids", "sglang": "stop_token_ids"}
CUT_FIRST, CUT_LAST = 5, 40  # cuts fall at these token positions of the answer, or its 1/8..2/3 by characters
STOP_CHARS = (4, 6, 8, 12)  # a stop string's lengths, tried in turn until one first occurs at the cut


def quick_audit(a) -> bool:
    """Whether the endpoint audit runs at the quick audit's sizes (--quick)."""
    return a.quick


def copy_prompts(a, copies: int, suite: int, tag: str) -> list:
    """Prompts whose answers copy text from the prompt (long accepted runs under any drafter):
    `copies` of sampled.DRAFTING_PROMPTS, then `suite` of the audited prompts."""
    from .endpoint.sampled import DRAFTING_PROMPTS
    from .suite import SuitePrompt
    return ([SuitePrompt(f"copy-{i:02d}", f"copy ({tag})", t) for i, t in enumerate(DRAFTING_PROMPTS[:copies])]
            + list(a.prompts[:suite]))


def send_each(requests: list[tuple], concurrency: int) -> list:
    """[(EndpointConfig, prompt)]: each request with its own settings (seed, stop, max_tokens),
    at most `concurrency` in flight, started in list order; -> their PromptResults in order."""
    import asyncio
    return asyncio.run(_send_each(requests, concurrency))


async def _send_each(requests: list[tuple], concurrency: int) -> list:
    import asyncio
    from dataclasses import replace

    from .endpoint.client import EndpointClient
    first = EndpointClient(replace(requests[0][0], concurrency=(1,)))
    try:
        model = await first.model()
    finally:
        await first.aclose()
    gate = asyncio.Semaphore(concurrency)

    async def one(cfg, p):
        async with gate:
            client = EndpointClient(replace(cfg, model=model, concurrency=(1,)))
            try:
                return await client.complete(model, p.id, p.slice, p.prompt)
            finally:
                await client.aclose()
    return list(await asyncio.gather(*(one(cfg, p) for cfg, p in requests)))


def drafted_in(results: list) -> int | None:
    """Draft tokens the answers say were verified (None: no answer says; vLLM without
    --per-request-spec-decode-metrics)."""
    got = [r.server_info["drafted"] for r in results if r.ok and r.server_info and r.server_info.get("drafted")
           is not None]
    return sum(got) if got else None


@dataclass(frozen=True)
class _Cut:
    """One stopped request: what it adds to the greedy request, and where a correct server ends it."""

    prompt: object  # suite.SuitePrompt
    what: str  # "stop string" | "max_tokens" | "stop token id"
    value: object  # the stop string, the limit or the id
    extra: dict  # what the request body adds (stop, stop_token_ids)
    max_tokens: int
    want_text: str | None  # None: not known from the answer's token texts (then the reference's)
    want_reason: str
    want_tokens: int | None  # the completion_tokens a correct server reports (None: per its convention)

    def cfg(self, base: EndpointConfig) -> EndpointConfig:
        return replace(base, max_tokens=self.max_tokens, logprobs=self.what != "stop string",
                       extra_body={**(base.extra_body or {}), **self.extra} or None)

    def row(self, g, why: str, side: str) -> dict:
        return {"prompt": self.prompt.id, "side": side, "cut": self.what, "value": self.value,
                "expected_end": None if self.want_text is None else self.want_text[-30:],
                "got_end": (g.text or "")[-30:] if g.ok else None, "expected_reason": self.want_reason,
                "got_reason": g.finish_reason, "completion_tokens": g.completion_tokens, "why": why}


def _texts(r) -> list[str] | None:
    """The answer's token texts where they join to its text (vLLM asked for ids writes "token_id:N")."""
    return list(r.tokens) if r.tokens and "".join(r.tokens) == (r.text or "") else None


def _ids(r) -> list[int] | None:
    return list(r.token_ids) if r.token_ids and all(isinstance(t, int) for t in r.token_ids) else None


def _cuts(p, base, kind: str, rng) -> list[_Cut]:
    """The cuts of one prompt's unstopped greedy answer `base`: a stop string, a length limit
    and (where the kind takes them) a stop token id, each at a position inside the answer
    after which the answer goes on."""
    text, texts, ids = base.text or "", _texts(base), _ids(base)
    n = base.completion_tokens or len(base.tokens or []) or 0
    cuts = []
    lo, hi = max(len(text) // 8, 1), (2 * len(text)) // 3
    for c in rng.sample(range(lo, hi), min(8, max(0, hi - lo))):
        s = next((text[c:c + k] for k in STOP_CHARS if c + k < len(text) and text[c:c + k].strip()
                  and text.find(text[c:c + k]) == c), None)
        if s is not None:
            cuts.append(_Cut(p, "stop string", s, {"stop": [s]}, base_max(base), text[:c], "stop", None))
            break
    if n > CUT_FIRST + 1:
        m = rng.randrange(CUT_FIRST, min(CUT_LAST, n - 1) + 1)
        cuts.append(_Cut(p, "max_tokens", m, {}, m, "".join(texts[:m]) if texts else None, "length", m))
    param = STOP_IDS_PARAM.get(kind)
    if param and ids and n > CUT_FIRST + 1:
        firsts = [j for j in range(CUT_FIRST, min(CUT_LAST, len(ids) - 1) + 1) if ids.index(ids[j]) == j]
        if firsts:
            j = rng.choice(firsts)  # the id's first occurrence: a correct server stops there, with its text dropped
            cuts.append(_Cut(p, "stop token id", ids[j], {param: [ids[j]]}, base_max(base),
                             "".join(texts[:j]) if texts else None, "stop", None))
    return cuts


def base_max(base) -> int:
    """max_tokens of a stopped request: room beyond the unstopped answer, so only the stop ends it."""
    return (base.completion_tokens or len(base.tokens or []) or 0) + 16


def _greedy(cfg: EndpointConfig, kind: str) -> EndpointConfig:
    """Greedy requests with token ids where the kind gives them on request."""
    from .endpoint.sampled import TOKEN_IDS_REQUEST
    return replace(cfg, temperature=0.0, sampler=None, logprobs=True, concurrency=(1,),
                   extra_body={**(cfg.extra_body or {}), **TOKEN_IDS_REQUEST.get(kind, {})} or None)


def _problems(cut: _Cut, g, want: str | None, unstopped: str) -> list[str]:
    """Why one stopped answer is wrong (empty: it ends where it must). The properties hold for
    any server; the end and the finish reason are the cut's (want: the text, None: unknown)."""
    if not g.ok:
        return [f"request failed: {g.error}"]
    text, out = g.text or "", []
    if g.completion_tokens is not None and g.completion_tokens > cut.max_tokens:
        out.append(f"{g.completion_tokens} tokens for max_tokens {cut.max_tokens}")
    if cut.what == "stop string" and cut.value in text:
        out.append("the stop string is in the text")
    ids = _ids(g)
    if cut.what == "stop token id" and ids and cut.value in ids and ids.index(cut.value) < len(ids) - 1:
        out.append(f"{len(ids) - 1 - ids.index(cut.value)} tokens after the stop token id")
    if not unstopped.startswith(text):
        out.append("the text is not a prefix of the unstopped greedy answer")
    elif want is not None and text != want:
        out.append(f"ends at character {len(text)}, expected {len(want)}")
    if g.finish_reason != cut.want_reason:
        out.append(f"finish_reason {g.finish_reason!r}, expected {cut.want_reason!r}")
    if cut.want_tokens is not None and g.completion_tokens not in (None, cut.want_tokens):
        out.append(f"completion_tokens {g.completion_tokens}, expected {cut.want_tokens}")
    return out


def _expected(cut: _Cut, r) -> tuple[str | None, bool]:
    """(the text a correct endpoint returns, whether the reference's own stopped answer r agrees
    with the cut); r None: no separate reference. Where the cut's text is unknown (token texts
    not given), the reference's stopped answer is it."""
    if r is None:
        return cut.want_text, True
    agrees = r.ok and r.finish_reason == cut.want_reason and (cut.want_text is None or r.text == cut.want_text)
    return (cut.want_text if cut.want_text is not None else r.text if agrees else None), agrees


def endpoint_stopping_check(a) -> CheckResult:
    """Greedy answers cut inside by a stop string, max_tokens and a stop token id, sent to the
    endpoint alone and at the highest load level: each ends where the reference's cut ends."""
    import random
    kind, quick = a.info.kind, quick_audit(a)
    prompts = copy_prompts(a, *((2, 1) if quick else (6, 4)), "stops")
    ref_cfg, cfg = _greedy(a.ref_cfg or a.cfg, kind), _greedy(a.cfg, kind)
    base = send_each([(ref_cfg, p) for p in prompts], 1)
    own = send_each([(cfg, p) for p in prompts], 1) if a.ref_cfg else base
    comparable = [(p, b) for p, b, e in zip(prompts, base, own) if b.ok and e.ok and b.text == e.text]
    leaks = _end_of_text_leaks(prompts, base, own) if a.ref_cfg else []
    rng = random.Random(a.seed)
    cuts = [c for p, b in comparable for c in _cuts(p, b, kind, rng)]
    if not cuts and leaks:
        return _stopping_result(a, prompts, comparable, cuts, [], 0, 0, leaks, [], drafted_in(own))
    if not cuts:
        return CheckResult(False, f"INCONCLUSIVE: no greedy answer to cut ({len(comparable)} of {len(prompts)} "
                           "prompts answered alike by the endpoint and the reference)",
                           {"cases": 0, "prompts": len(prompts), "comparable_prompts": len(comparable)},
                           {"errors": [r.error for r in base + own if not r.ok][:5]})
    unstopped = {p.id: b.text for p, b in comparable}
    top = max(a.concurrency)
    sides = [("endpoint c=1", cfg, 1)] + ([(f"endpoint c={top}", cfg, top)] if top > 1 else [])
    ref = send_each([(c.cfg(ref_cfg), c.prompt) for c in cuts], 1) if a.ref_cfg else [None] * len(cuts)
    rows, judged, sent, disagree = list(leaks), 0, len(cuts) if a.ref_cfg else 0, []
    for side, scfg, conc in sides:
        got = send_each([(c.cfg(scfg), c.prompt) for c in cuts], conc)
        sent += len(got)
        for c, g, r in zip(cuts, got, ref):
            want, agrees = _expected(c, r)
            if not agrees and side == sides[0][0]:
                disagree.append(c.row(r, "the reference's own stopped answer ends elsewhere", "reference"))
            judged += want is not None
            rows += [c.row(g, "; ".join(why), side) for why in [_problems(c, g, want, unstopped[c.prompt.id])] if why]
    return _stopping_result(a, prompts, comparable, cuts, sides, sent, judged, rows, disagree, drafted_in(own))


def _end_of_text_leaks(prompts, base, own) -> list[dict]:
    """Unstopped greedy answers that run on past the end-of-text where the reference's ends
    (finish "stop"): the reference's whole text, then more. A near-tie could flip the end-of-text
    token itself, but an answer that repeats the reference to its end and goes on is the
    signature of an end-of-text inside an accepted run that did not end the request
    (sgl-project/sglang#31599); such a prompt is not set aside as numerics."""
    out = []
    for p, b, e in zip(prompts, base, own):
        if b.ok and e.ok and b.finish_reason == "stop" and b.text and e.text != b.text and \
                (e.text or "").startswith(b.text):
            out.append({"prompt": p.id, "side": "endpoint c=1 (no stop sent)", "cut": "end of text", "value": None,
                        "expected_end": b.text[-30:], "got_end": (e.text or "")[-30:], "expected_reason": "stop",
                        "got_reason": e.finish_reason, "completion_tokens": e.completion_tokens,
                        "why": f"the answer runs on for {len(e.text) - len(b.text)} characters past the end-of-text "
                               "where the reference's answer ends"})
    return out


def _stopping_result(a, prompts, comparable, cuts, sides, sent, judged, rows, disagree, drafted) -> CheckResult:
    """The verdict: no stopped answer wrong, no request failed, at least one judged against a known end."""
    failed = sum(r["why"].startswith("request failed") for r in rows)
    wrong = len(rows) - failed
    kinds = {w: sum(c.what == w for c in cuts) for w in ("stop string", "max_tokens", "stop token id")}
    cases = f"{len(cuts)} cuts ({', '.join(f'{n} {w}' for w, n in kinds.items() if n)}) of {len(comparable)} prompts"
    if wrong:
        ex = rows[0]
        summary = (f"{wrong} stopped answers end elsewhere than the cut ({cases}): e.g. {ex['prompt']} "
                   f"{ex['cut']} {ex['value']!r} at {ex['side']}: {ex['why']}")
    elif failed:
        summary = f"INCONCLUSIVE: {failed} stopped requests failed ({cases})"
    elif not judged:
        summary = f"INCONCLUSIVE: no cut's end is known ({cases}: the answers' token texts were not given)"
    else:
        sent_to = " and ".join(s for s, _, _ in sides)
        summary = (f"every stopped answer ends where the cut ends: {cases}, sent to the {sent_to}; {judged} of "
                   f"{len(cuts) * len(sides)} judged against a known end (the rest on max_tokens, prefix and finish)")
    if len(comparable) < len(prompts):
        summary += f"; {len(prompts) - len(comparable)} prompts not comparable (greedy answers differ: numerics)"
    figures = {"prompts": len(prompts), "comparable_prompts": len(comparable), "cases": len(cuts), **{
        f"cases_{w.replace(' ', '_')}": n for w, n in kinds.items()}, "sent": sent, "judged": judged, "wrong": wrong,
        "failed_requests": failed, "reference_disagrees": len(disagree), "sides": [s for s, _, _ in sides],
        "stop_ids_param": STOP_IDS_PARAM.get(a.info.kind), "drafted": drafted if drafted is not None else
        "not visible from outside", "reference": a.reference_kind}
    return CheckResult(not rows and judged > 0, summary, figures,
                       {"wrong": rows[:20], "reference_disagrees": disagree[:10],
                        "cuts": [{"prompt": c.prompt.id, "cut": c.what, "value": c.value} for c in cuts]})
