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
