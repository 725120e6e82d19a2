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
from dataclasses import dataclass

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


@dataclass(frozen=True)
class _Prompts:
    """The seeded requests' prompts, settings and lengths: the same in the plain, null and
    speculative runs."""

    chosen: list[int]  # indices into the suite
    prompt_ids: list[list[int]]
    sampling: list[SamplingParams]
    lengths: list[int]  # each prompt's own max_new_tokens (churn.mixed_lengths)
    max_new: int
    stops: tuple[int, ...]

    @property
    def n(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_len(self) -> int:
        return max(map(len, self.prompt_ids)) + self.max_new

    def requests(self) -> list[Request]:
        return [Request(ids, GenerationParams(max_new_tokens=m, sampling=sp, stop_token_ids=self.stops))
                for ids, sp, m in zip(self.prompt_ids, self.sampling, self.lengths)]


@dataclass(frozen=True)
class _Bar:
    """What a speculative run's differences from plain decoding are judged by."""

    noise: float  # the backend's tie margin, in logits
    per_t: bool  # measured: a logit-gap noise d moves the gap of log p by d / T
    null: dict | None  # the null run (a backend whose numerics move with batching), else None
    alpha: float  # NULL_ALPHA over the configurations
    allowance: int  # near-ties excused without a null run

    def margin(self, sp: SamplingParams) -> float:
        return self.noise / sp.temperature if self.per_t else self.noise


def seeded_check(ctx: AuditContext) -> CheckResult:
    """Seeded speculative output against seeded plain decoding at batch 1, at every audited
    batch size (and with drafting forced), judged against the backend's own null run where
    its numerics move with batching."""
    cfg = ctx.config
    if cfg.rule in LOSSY_RULES or cfg.rule == "greedy":
        return CheckResult(True, f"not applicable: rule {cfg.rule!r} makes no promise for seeded "
                           "sampled requests", {"applicable": False, "rule": cfg.rule}, informational=True)
    t0 = time.perf_counter()
    ps = _prompts(ctx)
    plain = _run_plain(ctx, ps)
    configs = [(b, None, cfg.policy) for b in cfg.greedy_batch_sizes]
    if cfg.policy != "fixed":
        configs.append((max(cfg.greedy_batch_sizes), FixedK(cfg.forced_k), f"fixed k={cfg.forced_k}"))
    allowance = 0 if cfg.batch_invariant else near_tie_allowance(ps.n)
    tie = tie_margin_for(ctx.model)
    per_t = "noise_top2_gap" in tie  # a measured logit-gap noise d moves the gap of log p by d / T
    null = _null_run(ctx, ps, plain, tie["value"]) if per_t and not cfg.batch_invariant else None
    bar = _Bar(tie["value"], per_t, null, NULL_ALPHA / len(configs), allowance)
    per_config, rows, failures = [], [], []
    for b, policy, label in configs:
        row, failure = _run_config(ctx, ps, plain, b, policy, label, bar, rows)
        per_config.append(row)
        failures += [failure] if failure else []
    found, inconclusive = null_findings(tie, null, "seeded plain decoding") if per_t else ([], False)
    drafted = sum(r["drafted"] for r in per_config)
    passed = not failures and not found and drafted > 0
    summary = _summary(cfg, ps.n, per_config, failures, found, null)
    figures = {"applicable": True, "temperature": cfg.temperature, "temperatures": list(cfg.temperatures),
               "settings": [{**st.to_dict(), "values": st.describe(), "prompts": len(range(i, ps.n, len(cfg.settings)))}
                            for i, st in enumerate(cfg.settings)],
               "prompts": ps.n, "max_new_tokens": ps.max_new,
               "drafts_verified": drafted, "tie_margin": tie["value"], "tie_margin_source": tie,
               "tie_margin_scaling": "divided by each request's temperature" if per_t else None,
               "near_tie_allowance": allowance if null is None else None, "null_run": null,
               "inconclusive": inconclusive,
               "divergences": sum(r["divergence"] for r in per_config),
               "near_ties": sum(r["near-tie"] for r in per_config),
               "reference": "seeded plain decoding, batch 1", "seconds": round(time.perf_counter() - t0, 1)}
    return CheckResult(passed, summary, figures, {"per_config": per_config, "prompts": rows})


def _prompts(ctx: AuditContext) -> _Prompts:
    """The prompts (every slice keeps one: the first of each slice, then the second of each,
    ...), each with an audited sampling setting in turn and its own length."""
    cfg = ctx.config
    rank, seen = [], {}
    for p in ctx.prompts:
        rank.append(seen.get(p.slice, 0))
        seen[p.slice] = rank[-1] + 1
    order = sorted(range(len(ctx.prompt_ids)), key=lambda i: (rank[i], i))
    chosen = order[:cfg.sizes.seeded_prompts] if cfg.sizes.seeded_prompts else order
    n = len(chosen)
    # the audited sampling settings in turn (filters included: keyed noise over a filtered p
    # must pick the same token in both decoders)
    sampling = [cfg.sampling_of(i, cfg.seed * 7_919 + 104_729 * i) for i in range(n)]
    lengths = mixed_lengths(n, cfg.sizes.seeded_max_new)
    return _Prompts(chosen, [ctx.prompt_ids[i] for i in chosen], sampling, lengths, cfg.sizes.seeded_max_new,
                    ctx.stops)


def _run_plain(ctx: AuditContext, ps: _Prompts) -> list[Request]:
    """The reference: seeded plain decoding at batch 1."""
    plain = ps.requests()
    temps = ", ".join(st.label for st in ctx.config.settings)
    with ctx.progress.stage(f"seeded: plain, {temps}, b=1", ps.n) as bar:
        ctx.engine(1, ps.max_len, speculative=False, rule="rejection").run(plain, on_finish=lambda r: bar.advance())
    return plain


def _null_run(ctx: AuditContext, ps: _Prompts, plain: list[Request], noise: float) -> dict:
    """A backend whose numerics move with batching: its own null run, seeded plain decoding
    at the largest audited batch size against seeded plain at batch 1 (as the equivalence
    check's null run): near-ties no more frequent than there. The margin stays the measured
    noise (in logits), and a null divergence beyond it fails (null_findings)."""
    cfg, n = ctx.config, ps.n
    b_null = max(cfg.greedy_batch_sizes)
    null_reqs, null_churn = ps.requests(), None
    if b_null > 1:
        with ctx.progress.stage(f"seeded: null run, plain b={b_null}", n) as bar:
            null_churn = run_churned(ctx.engine(min(b_null, n), ps.max_len, speculative=False, rule="rejection"),
                                     null_reqs, f"{cfg.seed}/seeded-null/{b_null}",
                                     on_finish=lambda r: bar.advance())
    else:
        null_reqs = plain
    sampling = ps.sampling
    cs = [compare(ps.prompt_ids[i], ref.output_ids, got.output_ids, _keyed_margin(ctx, sampling[i]),
                  noise / sampling[i].temperature) for i, (ref, got) in enumerate(zip(plain, null_reqs))]
    logit_margins = sorted(c.margin * sampling[i].temperature for i, c in enumerate(cs) if c.margin is not None)
    beyond = [{"id": ctx.prompts[ps.chosen[i]].id, "first_divergence": c.first_divergence,
               "margin": None if c.margin is None else c.margin * sampling[i].temperature}
              for i, c in enumerate(cs) if c.verdict == "divergence"]
    return {"batch": b_null, "prompts": n, "differ": sum(not c.exact for c in cs),
            "margins_in_logits": logit_margins, "beyond_noise": len(beyond), "beyond_noise_prompts": beyond,
            "tie_margin": noise, "alpha": NULL_ALPHA, "churn": null_churn,
            "reference": "seeded plain decoding, batch 1"}


def _run_config(ctx: AuditContext, ps: _Prompts, plain: list[Request], b: int, policy, label: str, bar: _Bar,
                rows: list) -> tuple[dict, str | None]:
    """The seeded requests speculative under one configuration at batch b, each output
    compared with plain's: -> (its row of counts, why it fails or None); outputs that
    differ go to rows."""
    cfg, n = ctx.config, ps.n
    reqs = ps.requests()
    with ctx.progress.stage(f"seeded: speculative, {label}, b={b}", n) as pbar:
        churn = run_churned(ctx.engine(min(b, n), ps.max_len, policy=policy), reqs, f"{cfg.seed}/seeded/{label}/{b}",
                            on_finish=lambda r: pbar.advance(), policy=label)
    counts = {"identical": 0, "near-tie": 0, "divergence": 0}
    for i, (ref, got) in enumerate(zip(plain, reqs)):
        c = compare(ps.prompt_ids[i], ref.output_ids, got.output_ids, _keyed_margin(ctx, ps.sampling[i]),
                    bar.margin(ps.sampling[i]))
        counts[c.verdict] += 1
        if c.verdict != "identical":
            rows.append({"batch": b, "policy": label, "id": ctx.prompts[ps.chosen[i]].id, **c.to_dict()})
    ok, fisher = against_null(counts, n, bar.null, bar.alpha, bar.allowance)  # a noisy backend: against its null
    drafted = sum(r.stats.drafted for r in reqs)
    row = {"batch": b, "policy": label, "prompts": n, **counts, "drafted": drafted,
           "accepted": sum(r.stats.accepted for r in reqs), "passed": ok, "churn": churn,
           **({} if fisher is None else {"fisher_p_vs_null": fisher, "alpha": bar.alpha})}
    if ok:
        return row, None
    return row, (f"b={b} ({label}): {n - counts['identical']} of {n} differ, {counts['divergence']} at a clear margin"
                 + ("" if fisher is None or counts["divergence"] else
                    f", against the null run's {bar.null['differ']}/{n} (Fisher p = {fisher:.2g} < {bar.alpha:.2g})"))


def _summary(cfg, n: int, per_config: list[dict], failures: list[str], found: list[str], null: dict | None) -> str:
    """The line a person reads first: what differs, or no draft verified, or where the
    output matched plain decoding."""
    drafted = sum(r["drafted"] for r in per_config)
    if failures or found:
        return "; ".join(found + (["seeded speculative output differs from seeded plain output: "
                                   + "; ".join(failures)] if failures else []))
    if drafted == 0:
        return "INCONCLUSIVE: no draft was verified in any seeded run"
    where = [f"b{r['batch']}" + ("" if r["policy"] == cfg.policy else f" {r['policy']}") for r in per_config]
    if null is not None and any(r["near-tie"] for r in per_config):
        differ = ", ".join(f"{w} {r['near-tie']}" for w, r in zip(where, per_config))
        head = f"seeded output equal to seeded plain decoding but for near-ties ({differ} of {n})"
    else:
        head = "seeded output identical to seeded plain decoding"
    temps = ", ".join(st.label for st in cfg.settings)
    return (f"{head} for {n} prompts at " + ", ".join(where) + f" (settings {temps}, {drafted} drafts verified)"
            + ("" if null is None else
               f"; near-ties as often as the null run's (plain b={null['batch']}: {null['differ']}/{n} differ)"))



# -- from outside: any OpenAI-compatible server that promises per-request seeds ------------------
#
# Seeded requests under speculation have broken: vllm-project/vllm#17498 and #6038 ignored
# per-request seeds, vllm-project/vllm#10863 misindexed the generators when seeded and
# unseeded requests shared a batch ("I!!!!!!!! will"). From outside, temperature-1 requests
# with a seed, on prompts that copy text (so drafts are verified), go alone twice and once
# mixed with unseeded requests at the highest load level, and must answer the same every
# time. A difference at the target's near-tie (top-2 logprob margin at the first differing
# token within the margins at which the reference, asked the same, differs from itself) is
# numerics, not a seed.

# the promise each server kind states for a request's `seed`; kinds not listed promise none
SEED_PROMISE = {
    "vllm": "per-request seed: the request's own generator, whatever shares its batch",
    "verispec": "per-request seed: noise keyed on (seed, position), the same tokens at any batch, drafts or not",
    "llama.cpp": "per-request seed: the slot's sampler is seeded with it; its numerics move with the slots in use "
                 "(ggml-org/llama.cpp#6950), so a batch is judged only against a reference's null",
}
SEEDS_PER_PROMPT = 2
SEEDED_PROMPTS = {True: (2, 0), False: (4, 2)}  # quick, full: (copying prompts, audited prompts)


def _seed_promise(a) -> str | None:
    """What the server promises a seeded sampled request (None: nothing, the check does not apply)."""
    rule = (a.info.speculative or {}).get("rule")
    if a.info.kind == "verispec" and (rule in LOSSY_RULES or rule == "greedy"):
        return None  # a lossy rule samples its own way; a greedy server refuses sampled requests
    return SEED_PROMISE.get(a.info.kind)


def _sampled_cfg(cfg, kind: str, seed: int | None):
    """Temperature 1, every other sampler setting off, logprobs with token ids; `seed` in the body."""
    from dataclasses import replace

    from .endpoint.sampled import TOKEN_IDS_REQUEST, sampler_settings
    extra = {**(cfg.extra_body or {}), **TOKEN_IDS_REQUEST.get(kind, {}), **({} if seed is None else {"seed": seed})}
    return replace(cfg, temperature=1.0, sampler=sampler_settings(kind), logprobs=True, top_logprobs=2,
                   concurrency=(1,), extra_body=extra or None)


def _seeded_requests(a) -> list[tuple]:
    """(prompt, seed) pairs: each copying prompt with SEEDS_PER_PROMPT seeds of the audit's seed."""
    from dataclasses import replace

    from .stopping import copy_prompts, quick_audit
    prompts = copy_prompts(a, *SEEDED_PROMPTS[quick_audit(a)], "seeds")
    seeds = [(a.seed * 7_919 + 104_729 * i) % 2 ** 31 + 1 for i in range(SEEDS_PER_PROMPT * len(prompts))]
    pairs = [(p, seeds[SEEDS_PER_PROMPT * i + j]) for i, p in enumerate(prompts) for j in range(SEEDS_PER_PROMPT)]
    return [(replace(p, id=f"{p.id}@seed={s}"), s) for p, s in pairs]


def _side_runs(cfg, kind: str, reqs: list[tuple], top: int) -> tuple[list, list, list | None, list]:
    """One server's seeded answers: alone (concurrency 1) twice, then mixed at `top` with an
    unseeded request of the same prompt beside each seeded one, before it or after it in
    turn (so the seeded rows sit at different batch positions); -> (first, second, the seeded
    answers from the batch or None at top 1, every answer)."""
    from dataclasses import replace

    from .stopping import send_each
    alone = [send_each([(_sampled_cfg(cfg, kind, s), p) for p, s in reqs], 1) for _ in range(2)]
    if top < 2:
        return alone[0], alone[1], None, alone[0] + alone[1]
    mixed, at = [], []
    for k, (p, s) in enumerate(reqs):
        pair = [(_sampled_cfg(cfg, kind, s), p), (_sampled_cfg(cfg, kind, None), replace(p, id=f"{p.id}/unseeded"))]
        at.append(len(mixed) + k % 2)
        mixed += pair if k % 2 == 0 else pair[::-1]
    got = send_each(mixed, top)
    return alone[0], alone[1], [got[i] for i in at], alone[0] + alone[1] + got


def _level_row(test, null, null_max: float | None, label: str, judged: bool, drafted) -> dict:
    """One comparison's row (registry's seeded table): a difference within the null's margins
    is a near-tie; clear differences beyond the null's own count plus near_tie_allowance fail."""
    from .endpoint.null import Comparison
    rows = test.divergences
    for r in rows:
        r["verdict"] = ("near-tie" if r["margin"] is not None and null_max is not None and r["margin"] <= null_max
                        else "divergence")
    near = sum(r["verdict"] == "near-tie" for r in rows)
    n, d0 = len(test.compared), len((null or Comparison(0)).divergences)
    ok = not test.errors and (not judged or len(rows) - near <= d0 + near_tie_allowance(max(n, 1)))
    return {"batch": test.concurrency, "policy": label, "prompts": len(test.rows), "identical": n - len(rows),
            "near-tie": near, "divergence": len(rows) - near, "errors": test.errors, "drafted": drafted,
            "null_differ": None if null is None else d0, "judged": judged, "passed": ok,
            "differ": [{k: r[k] for k in ("id", "first_divergence", "margin", "verdict")} for r in rows[:10]]}


def endpoint_seeded_check(a) -> CheckResult | None:
    """Seeded temperature-1 requests alone twice and in a batch mixed with unseeded ones: the
    same answer every time, but for near-ties the reference shows too (not applicable where
    the server kind promises nothing for a seed)."""
    from .endpoint.null import compare as compare_answers
    from .stopping import drafted_in
    promise = _seed_promise(a)
    if promise is None:
        return CheckResult(True, f"not applicable: a {a.info.kind} server states no per-request seed to hold it to: "
                                 "seeds not tested", {"applicable": False}, informational=True)
    reqs, top, kind = _seeded_requests(a), max(a.concurrency), a.info.kind
    first, second, batch, every = _side_runs(a.cfg, kind, reqs, top)
    tests = [compare_answers(first, second, 1)] + ([compare_answers(first, batch, top)] if batch else [])
    nulls = [None] * len(tests)
    if a.ref_cfg is not None:  # the reference asked the same: what numerics alone change
        r1, r2, rb, _ = _side_runs(a.ref_cfg, a.ref_info.kind if a.ref_info else kind, reqs, top)
        nulls = [compare_answers(r1, r2, 1)] + ([compare_answers(r1, rb, top)] if rb else [])
    margins = [m for c in nulls if c is not None for m in c.margins]
    null_max = max(margins) if margins else None
    labels = ["alone, asked twice", "mixed with unseeded requests"]
    # a batch whose numerics move with its slots (llama.cpp) is judged only against a null
    judged = [True, a.ref_cfg is not None or kind != "llama.cpp"]
    drafted = drafted_in(every)
    per = [_level_row(t, nl, null_max, lab, j, drafted if i == 0 else None)
           for i, (t, nl, lab, j) in enumerate(zip(tests, nulls, labels, judged))]
    return _endpoint_result(a, promise, reqs, per, drafted, null_max)


def _endpoint_result(a, promise: str, reqs: list[tuple], per: list[dict], drafted, null_max) -> CheckResult:
    """The verdict and the line a person reads first."""
    failed = [r for r in per if not r["passed"]]
    n = len(reqs)
    where = "; ".join(f"{r['policy']} (c={r['batch']}): {r['prompts'] - r['identical']} of {r['prompts']} differ"
                      + (f", {r['near-tie']} at near-ties" if r["near-tie"] else "")
                      + (f", {r['errors']} failed" if r["errors"] else "")
                      + ("" if r["judged"] else ", not judged: no null") for r in per)
    if failed:
        summary = "a seeded request's answer changes with its neighbours or its repeat: " + where
    else:
        summary = f"{n} seeded requests answer the same each time: {where}"
    summary += "" if a.ref_cfg is not None else "; no reference: near-ties not separable, an allowance instead"
    figures = {"applicable": True, "promise": promise, "temperature": 1.0, "prompts": n,
               "seeds": sorted({s for _, s in reqs}), "divergences": sum(r["divergence"] for r in per),
               "near_ties": sum(r["near-tie"] for r in per), "errors": sum(r["errors"] for r in per),
               "drafts_verified": drafted, "null_max_margin": null_max,
               "reference": a.reference_kind, "concurrency": max(a.concurrency)}
    return CheckResult(not failed, summary, figures, {"per_config": per})
