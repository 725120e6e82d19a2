"""Acceptance calibration from outside: does the server accept each drafted token exactly as
often as the target's p of it says?

Where the server's drafts can be replayed from its answers (a prompt-lookup drafter: vLLM's
``ngram``; endpoint/replay.py, identified by the server's own counters), every drafted
position of every sampled answer is visible with its drafted token d and whether the answer
accepted it. With a one-hot draft, the exact rule accepts d with probability p(d) at that
position, so

    Z = sum_i w_i (a_i - p_i) / sqrt(sum_i w_i^2 p_i (1 - p_i))

is a sum of martingale differences over the positions (each p_i and w_i fixed by the
context before the draw) and is N(0, 1) for an exact server, whatever the prompts. A relaxed
rule that accepts with min(1, c p) moves it by sum_i w_i (min(1, c p_i) - p_i); the weight
w_i = 1 / max(1 - p_i, 0.2) is the score of c at p below 0.8 (a rejection at p = 0.7 is
2.4 times less likely under c = 1.25) and flat above, where min(1, c p) saturates, so the
positions where acceptance is neither certain nor hopeless carry the test. The test is
two-sided: a server that accepts less often than p also emits d too rarely.

p_i comes from the answer's own top-n list at that position, only where d is one of the
list's draw-independent entries (sampled.logprob_convention): whether it is there is fixed
before the draw, so dropping the other positions (p(d) below the n-th entry's) selects
nothing by outcome.

Sampling goes on where the sampled phase left the test short of its power: further rounds of
the prompts that gave the most information per token (the variance of Z per emitted token),
until the test detects the target relaxation (c = 1.25 quick, 1.1 full) with 95% power or its
token cap is spent; stopping on the accumulated variance, never on Z, keeps Z's null law.
The report gives the smallest c the test detects with 95% power at the tokens it spent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .checks import CheckResult
from .endpoint.replay import NgramDrafter, replay
from .endpoint.sampled import logprob_convention, sampled_run
from .endpoint.state import EndpointAudit

ALPHA = 1e-3  # the distribution tests' alpha: a verdict of "lossy" must be beyond doubt
POWER = 0.95
# further rounds are sampled until the power against the target c reaches this (above POWER:
# the power is itself an estimate, so the audit that stops there still holds 95%)
POWER_TO_STOP = 0.97
NULL_REPS = 20000  # replays of the exact server behind the verdict's critical value
TARGET_C = {True: 1.25, False: 1.1}  # quick audit, full audit: the relaxation it must catch
EXTRA_TOKENS = {True: 6000, False: 20000}  # the most further tokens it may sample for that
MIN_POSITIONS = 100
W_FLOOR = 0.2  # w = 1 / max(1 - p, W_FLOOR)
GRID = (1.02, 1.05, 1.075, 1.1, 1.15, 1.2, 1.25, 1.35, 1.5, 2.0)


@dataclass
class Positions:
    """The drafted positions the answers show: p(d), accepted, and each answer's share."""

    p: list[float] = field(default_factory=list)
    a: list[bool] = field(default_factory=list)
    unlisted: int = 0  # drafted positions whose d was not among the draw-independent entries
    info_by_prompt: dict[str, list[float]] = field(default_factory=dict)  # prompt -> [variance of Z, tokens]

    def add(self, p: float, accepted: bool, prompt: str) -> None:
        self.p.append(p)
        self.a.append(accepted)
        w = weight(p)
        self.info_by_prompt.setdefault(prompt, [0.0, 0])[0] += w * w * p * (1 - p)


def weight(p: float) -> float:
    return 1.0 / max(1.0 - p, W_FLOOR)


def z_test(ps: list[float], acc: list[bool]) -> tuple[float, float, float]:
    """(Z, sum of w (a - p), its null standard deviation) over the positions."""
    num = sum(weight(p) * (a - p) for p, a in zip(ps, acc))
    sd = math.sqrt(sum(weight(p) ** 2 * p * (1 - p) for p in ps))
    return (num / sd if sd > 0 else 0.0), num, sd


def null_critical(ps: list[float], alpha: float = ALPHA, reps: int = NULL_REPS, seed: int = 0):
    """|Z| of `reps` replays of an exact server at these positions (each a ~ Bernoulli(p)),
    sorted, and the critical value at alpha: the verdict's yardstick. Z's tails at a few
    hundred positions with weights up to 5 are heavier than the normal's (the normal critical
    value rejects an exact server in about 0.12-0.15% of replays at alpha 0.1%), so the
    rule is read off the null replays themselves."""
    import numpy as np
    p = np.asarray(ps, dtype=float)
    w = 1.0 / np.maximum(1.0 - p, W_FLOOR)
    sd0 = float(np.sqrt((w * w * p * (1 - p)).sum())) or 1.0
    rng, out = np.random.default_rng(seed), []
    for start in range(0, reps, 2000):  # in blocks: reps x positions booleans at once would be large
        acc = rng.random((min(2000, reps - start), len(p))) < p
        out.append(np.abs(((acc - p) * w).sum(axis=1) / sd0))
    null = np.sort(np.concatenate(out)) if out else np.zeros(0)
    return null, float(np.quantile(null, 1 - alpha)) if len(null) else float("inf")


def mc_p_value(null, z: float) -> float:
    """The share of null replays at least as extreme as z (the replay counts as one of them)."""
    import numpy as np
    return float((1 + len(null) - np.searchsorted(null, abs(z), side="left")) / (1 + len(null)))


def power(ps: list[float], c: float, alpha: float = ALPHA, zc: float | None = None) -> float:
    """The chance that the two-sided test rejects when the server accepts with min(1, c p)
    at these positions (normal approximation of Z under c), at the critical value zc (None:
    the normal one at alpha)."""
    from scipy.stats import norm
    sd0 = math.sqrt(sum(weight(p) ** 2 * p * (1 - p) for p in ps))
    if sd0 == 0:
        return 0.0
    shift = sum(weight(p) * (min(1.0, c * p) - p) for p in ps)
    sd1 = math.sqrt(sum(weight(p) ** 2 * min(1.0, c * p) * (1 - min(1.0, c * p)) for p in ps)) or 1e-12
    zc = norm.isf(alpha / 2) if zc is None else zc
    return float(norm.sf((zc * sd0 - shift) / sd1) + norm.cdf((-zc * sd0 - shift) / sd1))


def replayed_rates(ps: list[float], cs=(1.0,) + GRID, reps: int = 2000, seed: int = 1,
                   alpha: float = ALPHA, zc: float | None = None) -> dict[str, float]:
    """The share of `reps` replays whose test rejects, the outcomes at the audit's own
    positions drawn as a server accepting with min(1, c p) would (c = 1: the exact server:
    the false-alarm rate), for each c: the normal approximation of `power` checked by
    simulation."""
    import numpy as np
    from scipy.stats import norm
    p = np.asarray(ps, dtype=float)
    if not len(p):
        return {}
    w = 1.0 / np.maximum(1.0 - p, W_FLOOR)
    sd0 = float(np.sqrt((w * w * p * (1 - p)).sum()))
    zc = norm.isf(alpha / 2) if zc is None else zc
    rng, out = np.random.default_rng(seed), {}
    for c in cs:
        acc = rng.random((reps, len(p))) < np.minimum(1.0, c * p)
        z = ((acc - p) * w).sum(axis=1) / sd0 if sd0 else np.zeros(reps)
        out[f"{c:g}"] = float((np.abs(z) > zc).mean())
    return out


def smallest_detectable(ps: list[float], alpha: float = ALPHA, zc: float | None = None) -> float | None:
    return next((c for c in GRID if power(ps, c, alpha, zc) >= POWER), None)


# the configurations tried, most common first (vLLM's documented example first)
CANDIDATES = tuple(NgramDrafter(k, lo, hi) for k, lo, hi in
                   [(4, 2, 4), (3, 2, 4), (5, 2, 4), (2, 2, 4), (4, 1, 4), (4, 2, 5), (4, 3, 4), (4, 2, 3), (5, 3, 5),
                    (6, 2, 4), (8, 2, 4), (3, 1, 3), (5, 1, 5), (2, 1, 2), (1, 1, 3), (4, 1, 3), (6, 3, 6), (8, 3, 8)])


# server kinds whose drafters the replay does not reproduce, and why (the check says so)
NOT_REPLAYED = {"llama.cpp": "llama-server's drafters (a draft model, or its ngram types with their own match "
                             "rules) are not replayed from outside",
                "verispec": "verispec's drafters draft per row under its policy, not by a fixed prompt-lookup rule; "
                            "its own audit tests acceptance offline"}


def _replayable(r) -> bool:
    return (r.ok and bool(r.prompt_ids) and bool(r.token_ids) and all(isinstance(t, int) for t in r.token_ids)
            and r.top is not None and len(r.top) == len(r.token_ids))


def identify(levels: list, candidates=CANDIDATES) -> tuple[NgramDrafter | None, str]:
    """The prompt-lookup configuration whose replay gives the drafts and draft tokens that the
    server's counters counted over the first level whose every answer can be replayed (None,
    why not)."""
    lv = next((lv for lv in levels if lv.spec is not None and lv.spec.drafts is not None and lv.results
               and all(_replayable(r) for r in lv.results)), None)
    if lv is None:
        return None, ("no sampled round with speculative counters and every answer's prompt and token ids "
                      "(the server must publish vLLM-style counters and return token ids)")
    for d in candidates:
        reps = [replay(d, r.prompt_ids, r.token_ids) for r in lv.results]
        if sum(x.drafts for x in reps) == lv.spec.drafts and sum(x.draft_tokens for x in reps) == lv.spec.draft_tokens:
            return d, ""
    return None, (f"no prompt-lookup configuration of {len(candidates)} tried reproduces the server's counters "
                  f"({lv.spec.drafts:.0f} drafts, {lv.spec.draft_tokens:.0f} draft tokens over {len(lv.results)} "
                  "answers): its drafts are not reproducible from outside")


def drafter_of(a: EndpointAudit, levels: list) -> tuple[NgramDrafter | None, str]:
    """The prompt-lookup drafter the server's counters confirm (found once per audit, for the
    acceptance and counter checks alike), or None and why not."""
    if a.drafter_replay is not None:
        return a.drafter_replay, ""
    if a.info.kind in NOT_REPLAYED:
        return None, NOT_REPLAYED[a.info.kind]
    a.drafter_replay, why = identify(levels)
    return a.drafter_replay, why


def collect(answers: list, drafter: NgramDrafter, buckets: int, into: Positions | None = None) -> Positions:
    """Every drafted position of the answers whose d is among the draw-independent entries."""
    pos = into or Positions()
    for r in answers:
        if not _replayable(r):
            continue
        prompt = r.id.split("#")[0]
        tokens = pos.info_by_prompt.setdefault(prompt, [0.0, 0])
        tokens[1] += len(r.token_ids)
        for idx, d, accepted in replay(drafter, r.prompt_ids, r.token_ids).outcomes():
            listed = sorted((kv for kv in r.top[idx] if kv[1] is not None and math.isfinite(kv[1])),
                            key=lambda kv: -kv[1])[:buckets]
            p = next((math.exp(lp) for k, lp in listed if k == d), None)
            if p is None:
                pos.unlisted += 1
            else:
                pos.add(min(p, 1.0), accepted, prompt)
    return pos


def _answers(run) -> list:
    return [r for lv in run.levels for r in lv.results]


def _more(a: EndpointAudit, pos: Positions, drafter: NgramDrafter, buckets: int, target: float) -> list:
    """Further sampled rounds, of the prompts with the most information per token, until the
    test has POWER against the target relaxation or the cap is spent; -> the runs made."""
    from .endpoint.sampled import drafting_mix
    by_id = {p.id: p for p in drafting_mix(a.prompts)}
    cap, spent, runs = EXTRA_TOKENS[a.quick], 0, []
    while power(pos.p, target, zc=null_critical(pos.p, reps=4000)[1]) < POWER_TO_STOP and spent < cap:
        ranked = sorted((pid for pid in pos.info_by_prompt if pid in by_id),
                        key=lambda pid: -pos.info_by_prompt[pid][0] / max(1, pos.info_by_prompt[pid][1]))
        chosen = [by_id[pid] for pid in ranked[:max(2, len(ranked) // 3)]]
        if not chosen:
            break
        run = sampled_run(a.cfg, a.info.kind, chosen, min(2000, cap - spent), max(a.concurrency))
        runs.append(run)
        got = sum(len(r.token_ids or []) for r in _answers(run) if r.ok)
        if not got:
            break
        spent += got
        collect(_answers(run), drafter, buckets, pos)
    return runs


def figures_of(pos: Positions, alpha: float = ALPHA) -> dict:
    """The test and its power over the positions gathered: Z against its null replays."""
    from scipy.stats import norm
    z, excess, sd = z_test(pos.p, pos.a)
    n = len(pos.p)
    null, zc = null_critical(pos.p, alpha)
    return {"positions": n, "unlisted_positions": pos.unlisted, "accepted": sum(pos.a),
            "expected_accepted": sum(pos.p), "acceptance": sum(pos.a) / n if n else None,
            "predicted_acceptance": sum(pos.p) / n if n else None, "z": z, "weighted_excess": excess,
            "null_sd": sd, "p_value": mc_p_value(null, z) if sd else None,
            "p_normal": float(2 * norm.sf(abs(z))) if sd else None, "critical_z": zc, "null_replays": len(null),
            "alpha": alpha, "weight": f"1 / max(1 - p, {W_FLOOR})",
            "power_vs_relaxed": {f"{c:g}": power(pos.p, c, alpha, zc) for c in GRID},
            "smallest_c_95": smallest_detectable(pos.p, alpha, zc),
            "replayed_rates": replayed_rates(pos.p, alpha=alpha, zc=zc)}


def endpoint_acceptance_check(a: EndpointAudit) -> CheckResult | None:
    if not a.sampled_tokens:
        return None
    srun = a.sampled()
    if not any(lv.spec is not None and lv.spec.drafts for lv in srun.levels):
        return CheckResult(True, "not applicable: the endpoint published no speculative counters over the sampled "
                                 "phase (it does not draft, or does not say): acceptance not tested",
                           {"applicable": False}, informational=True)
    drafter, why = drafter_of(a, srun.levels)
    if drafter is None:
        return CheckResult(True, f"not applicable: {why}; acceptance not tested", {"applicable": False, "why": why},
                           informational=True)
    buckets = logprob_convention(a.info.kind, a.chat).buckets
    pos = collect(_answers(srun), drafter, buckets)
    target = TARGET_C[a.quick]
    a.acceptance_runs = _more(a, pos, drafter, buckets, target)
    f = {"applicable": True, "drafter": drafter.label, "target_c": target, "rounds_added": len(a.acceptance_runs),
         "tokens_added": sum(len(r.token_ids or []) for run in a.acceptance_runs for r in _answers(run) if r.ok),
         **figures_of(pos)}
    if f["positions"] < MIN_POSITIONS:
        return CheckResult(False, f"inconclusive: {f['positions']} drafted positions with p(d) listed "
                                  f"(< {MIN_POSITIONS})", f)
    return CheckResult(f["p_value"] >= ALPHA, _summary(f), f,
                       {"top_prompts": sorted(((k, v[0] / max(1, v[1])) for k, v in pos.info_by_prompt.items()),
                                              key=lambda kv: -kv[1])[:8]})


def _summary(f: dict) -> str:
    c95 = f["smallest_c_95"]
    reach = (f"detects a relaxed rule min(1, c p/q) from c = {c95:g} with 95% power" if c95 else
             f"below 95% power even at c = {GRID[-1]:g}")
    what = (f"accepted {f['accepted']} of {f['positions']} drafted tokens where p predicts "
            f"{f['expected_accepted']:.1f} (z = {f['z']:.2f}, p = {f['p_value']:.3g}, alpha {f['alpha']:g})")
    if f["p_value"] < f["alpha"]:
        side = "more" if f["z"] > 0 else "less"
        return (f"the server accepts drafted tokens {side} often than the target's p allows: {what}; "
                "the signature of a relaxed (lossy) acceptance rule" if side == "more" else
                f"the server accepts drafted tokens {side} often than the target's p allows: {what}")
    return f"{what}; {reach} ({f['drafter']}, replayed and confirmed by the server's counters)"
