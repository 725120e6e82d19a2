"""The sampled distribution from outside: temperature 1 from the endpoint, scored with
top-n logprobs, a randomised PIT over the top-n tokens plus one tail bucket.

Requests are sampled at temperature 1 with every other sampler setting sent explicitly
as off (servers have non-trivial defaults: llama.cpp applies top-k 40, top-p 0.95 and
min-p 0.05 unless told otherwise), so the emitted token at each position is a draw from
the target's own distribution p when the sampler is exact. Each emitted token x is then
scored against the top-n list returned with it: order the n listed tokens by descending
logprob and put every other token in one tail bucket of mass 1 - sum(top-n); then

    u = F(x-) + U * p(x)  (x listed)      u = S_n + U * (1 - S_n)  (x in the tail)

with U ~ Uniform(0, 1) drawn here and S_n the listed mass. The buckets partition the
vocabulary by a rule fixed before the draw (the top n of p), so under an exact sampler u
is exactly Uniform(0, 1) whatever n is; a sampler that favours likely or drafted tokens
(typical acceptance, a relaxed threshold) piles u near 0. A Kolmogorov-Smirnov test
(audit.stats.test_uniform) of all u decides, at ALPHA.

Which logprobs: the endpoint's own by default (``scored_with`` says so in the report). They
are the target's distribution as the server computes it (llama.cpp: its verify batch's
logits; verispec: a teacher-forced pass over prompt + answer); a server whose logprobs are
not its sampling distribution is not caught that way. With a llama.cpp endpoint and a
llama.cpp reference, rescore.py scores the tokens sent without logprobs (or every token,
``--score-with reference``) by the reference instead, one request a position; the report
counts the tokens per scorer and marks each token's (``scored_by_token``).
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

from .client import EndpointConfig, EndpointRun, audit_endpoint

ALPHA = 1e-3
TOP_LOGPROBS = 20  # the most OpenAI's API allows

# every sampler setting each server kind knows, set to "off"; temperature is sent separately
OFF = {"top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
SAMPLER_OFF = {
    "llama.cpp": {**OFF, "top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "dry_multiplier": 0.0,
                  "xtc_probability": 0.0, "mirostat": 0, "top_n_sigma": -1.0},
    "vllm": {**OFF, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0},
    "sglang": {**OFF, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0},
    "tgi": {**OFF},
    "verispec": {**OFF, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "typical_p": 1.0},
}


def sampler_settings(kind: str) -> dict:
    """What a sampled request sends beside temperature 1 for a server of this kind."""
    return dict(SAMPLER_OFF.get(kind, OFF))


def pit_top_n(chosen, top: list[tuple], rng: random.Random) -> tuple[float, bool] | None:
    """(u, whether x was listed) for one emitted token `chosen` (id or text, matching the
    keys of `top`), `top` the [(key, logprob)] alternatives returned with it; None when
    the list is empty or malformed."""
    pairs = [(k, lp) for k, lp in top if lp is not None and math.isfinite(lp)]
    if not pairs:
        return None
    pairs.sort(key=lambda kv: -kv[1])  # descending p; the server's order breaks ties (a stable sort)
    probs = [math.exp(lp) for _, lp in pairs]
    listed = sum(probs)
    if listed > 1.0 + 1e-4:  # not log-probabilities of one distribution
        return None
    listed = min(listed, 1.0)
    before = 0.0
    for (k, _), p in zip(pairs, probs):
        if k == chosen:
            return min(1.0, before + rng.random() * p), True
        before += p
    return min(1.0, listed + rng.random() * (1.0 - listed)), False


ENDPOINT, REFERENCE = "endpoint", "reference"  # who scored a token: its own logprobs, or the reference's

# the share of emitted tokens that may come without logprobs before the check is inconclusive
MISSING_LOGPROBS_TOLERANCE = 0.01


# sampled answers, at most, as a multiple of those that `tokens` needs at max_tokens each
MAX_ANSWERS_FACTOR = 4


def sampled_run(cfg: EndpointConfig, kind: str, prompts: list, tokens: int, concurrency: int,
                run=None) -> EndpointRun:
    """Temperature-1 answers (prompts taken in turn, repeated) until at least `tokens` tokens
    were emitted. Answers that end at an end-of-text token are shorter than max_tokens, so
    after the first round (tokens / max_tokens answers) more rounds ask for the shortfall at
    the answers' mean length so far, up to MAX_ANSWERS_FACTOR times the first round's
    count; a round with no answer at all ends it (the check then says what failed).
    One level per round in the returned run. run(cfg, prompts) -> EndpointRun asks for the
    answers (default: client.audit_endpoint; rescore.py passes its own)."""
    run_round = run or audit_endpoint
    per = max(1, cfg.max_tokens)
    first = max(1, math.ceil(tokens / per))
    cap = MAX_ANSWERS_FACTOR * first
    scfg = replace(cfg, temperature=1.0, sampler=sampler_settings(kind), logprobs=True,
                   top_logprobs=TOP_LOGPROBS, concurrency=(concurrency,))
    levels, asked, emitted = [], 0, 0
    while not asked or (emitted < tokens and asked < cap):
        mean = emitted / asked if asked and emitted else per
        n = first if not asked else min(cap - asked, max(1, math.ceil((tokens - emitted) / mean)))
        batch = [replace(p, id=f"{p.id}#{i // len(prompts)}") for i, p in
                 ((i, prompts[i % len(prompts)]) for i in range(asked, asked + n))]
        got_run = run_round(scfg, batch)
        levels += got_run.levels
        asked += n
        got = [r for lv in got_run.levels for r in lv.results if r.ok]
        if not got:
            break
        emitted += sum(r.completion_tokens if r.completion_tokens is not None else len(r.tokens or []) for r in got)
    return EndpointRun(got_run.url, got_run.model, got_run.kind, got_run.logprobs, levels)


def distribution_figures(run: EndpointRun, seed: int = 0, alpha: float = ALPHA, min_tokens: int = 200) -> dict:
    """The PIT test over every scored token of the run, and what it rests on."""
    from ..stats import test_uniform
    rng = random.Random(seed)
    us, listed, unscored, errors = [], 0, 0, 0
    scorers: dict[str, int] = {}  # scored tokens per scorer ("endpoint" / "reference")
    per_token: dict[str, str] = {}  # answers that say per token who scored it (rescore.py)
    emitted, without = 0, 0  # tokens the server says it emitted; those that came with no logprobs at all
    answers = [r for lv in run.levels for r in lv.results]
    for r in answers:
        if not r.ok:
            errors += 1
            continue
        got_n = len(r.tokens or [])
        n_emitted = r.completion_tokens if r.completion_tokens is not None else got_n
        emitted += max(n_emitted, got_n)
        without += max(0, n_emitted - got_n)
        ids = r.token_ids or [None] * len(r.tokens or [])
        who = r.scored_by or [ENDPOINT] * len(r.tokens or [])
        marks = []
        for tid, text, top, by in zip(ids, r.tokens or [], r.top or [], who):
            if not top:  # listed, but with no logprobs (llama.cpp's native answer, a verification step's token)
                without += 1
                marks.append("-")
                continue
            by_id = tid is not None and all(isinstance(k, int) for k, _ in top)
            got = pit_top_n(tid if by_id else text, top, rng)  # the alternatives' own keys: ids, else texts
            if got is None:
                unscored += 1
                marks.append("?")
                continue
            us.append(got[0])
            listed += got[1]
            scorers[by or ENDPOINT] = scorers.get(by or ENDPOINT, 0) + 1
            marks.append("r" if by == REFERENCE else "e")
        if r.scored_by is not None:
            per_token[r.id] = "".join(marks)
    by_ref = scorers.get(REFERENCE, 0)
    figures = {"temperature": 1.0, "n": len(us), "alpha": alpha, "answers": len(answers), "failed_answers": errors,
               "unscored_tokens": unscored, "tail_tokens": len(us) - listed, "top_logprobs": TOP_LOGPROBS,
               "scored_with": ("the endpoint's own top-n logprobs (not a separate reference)" if not by_ref else
                               f"the reference's top-n logprobs for {by_ref} tokens, the endpoint's own for "
                               f"{scorers.get(ENDPOINT, 0)} (separate-reference scoring, rescore.py)"),
               "scorers": {ENDPOINT: scorers.get(ENDPOINT, 0), REFERENCE: by_ref},
               "order": "descending logprob, one tail bucket for the unlisted tokens",
               "acceptance_rate": None, "mean_accepted_length": None,
               "emitted_tokens": emitted, "tokens_without_logprobs": without}
    if per_token:
        figures["scored_by_token"] = {"legend": "per emitted token: e = the endpoint's own logprobs, r = the "
                                                "reference's, - = none (not tested), ? = malformed list",
                                      "answers": per_token}
    # A token sent with no logprobs cannot be scored, and which tokens lack them is not
    # chance: llama.cpp's server (0.3.36's vendored tools/server) sets none for the tokens
    # of a speculative verification step (its source leaves result.probs unset there), so what is left to
    # score are the tokens decoded without a draft. Their PITs are still exact under an
    # exact sampler (whether a step drafts is fixed before its token is sampled), so a
    # failure of the rest is evidence; a pass says nothing of the missing tokens.
    coverage_gap = (f"the server returned no logprobs for {without} of {emitted} emitted tokens (llama.cpp sends "
                    "none for tokens from a speculative verification step)"
                    + (", nor did the reference" if by_ref or per_token else "") + ": those tokens are not tested")
    if len(us) < min_tokens:
        figures.update(ks_statistic=None, p_value=None, passed=False,
                       reason=f"inconclusive: {len(us)} scored tokens (< {min_tokens}); the server returned "
                              "no usable logprobs" if not us else f"inconclusive: only {len(us)} scored tokens"
                              + (f"; {coverage_gap}" if without else ""))
        return figures
    t = test_uniform(us)
    reasons = ([] if t.passed(alpha) else [f"KS p = {t.p_value:.3g} < {alpha:g}: the sampled tokens do not follow "
                                           "the logprobs"]) + ([f"{errors} sampled request(s) failed"] if errors else [])
    if without > MISSING_LOGPROBS_TOLERANCE * emitted:  # a pass of a selected subset is no pass
        reasons.append(f"inconclusive: {coverage_gap}")
    figures.update(ks_statistic=t.ks_statistic, p_value=t.p_value, passed=not reasons, histogram=t.histogram,
                   mean_u=sum(us) / len(us), reason="; ".join(reasons) or None)
    figures["tests"] = [{"test": "pit", "kind": "KS vs Uniform(0,1), top-n + tail", "n": t.n,
                         "statistic": t.ks_statistic, "p_value": t.p_value, "alpha": alpha,
                         "passed": t.passed(alpha), "histogram": t.histogram}]
    figures.update(correction="one test", verified_drafts="not visible from outside", min_verified_drafts="-")
    return figures
