"""The sampled distribution from outside: temperature 1 from the endpoint, scored with
top-n logprobs, a randomised PIT over the top-n tokens plus one tail bucket.

Requests are sampled at temperature 1 with every other sampler setting sent explicitly
as off (servers have non-trivial defaults: llama.cpp applies top-k 40, top-p 0.95 and
min-p 0.05 unless told otherwise), so the emitted token at each position is a draw from
the target's own distribution p when the sampler is exact. Each emitted token x is then
scored against the list returned with it: order the listed tokens by descending logprob,
keep as buckets the m most probable of them, and put every other token in one tail bucket
of mass 1 - S_m (S_m the buckets' mass); then

    u = F(x-) + U * p(x)  (x in a bucket)      u = S_m + U * (1 - S_m)  (x in the tail)

with U ~ Uniform(0, 1) drawn here. Under an exact sampler u is exactly Uniform(0, 1) when
the buckets are fixed before the draw, so m is the number of entries the server lists
whatever it draws (Convention): servers differ there. llama.cpp and verispec list the
top n of p, so m = n. vLLM always lists the sampled token: chat completions return n
entries, the top n-1 plus the sampled token (the top n when it is among them), and
completions the top n plus the sampled token as an (n+1)-th entry when it is outside
them, so m = n-1 and n. Counting a listed sampled token as a bucket would move the tail's
mass onto the draws that landed there (the tail then never receives a draw, and u piles up
just above S_n): the PIT would accuse an exact server. A server of an unknown kind gets
m = n-1, draw-independent under each of those conventions. The check records the rule and
what the answers showed (entries per token, how often the sampled token was listed).
A sampler that favours likely or drafted tokens (typical acceptance, a relaxed threshold)
piles u near 0. A Kolmogorov-Smirnov test (audit.stats.test_uniform) of all u decides, at
ALPHA.

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
from dataclasses import dataclass, field, replace

from ...drafters.lookup import lookup_continuation

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


@dataclass(frozen=True)
class Convention:
    """Which of a server's listed alternatives are listed whatever it draws."""

    name: str
    buckets: int  # m: the m most probable listed entries are draw-independent
    rule: str  # the convention in words, for the report
    max_entries: int | None = None  # the most entries a list may hold under it (None: not stated)
    sampled_always_listed: bool = False  # every list holds the sampled token

    def to_dict(self) -> dict:
        return {"name": self.name, "buckets": self.buckets, "rule": self.rule}

    def contradicted_by(self, entries_per_token: dict[int, int], listed: int, tokens: int) -> str | None:
        """Why the answers do not follow this convention (None: they do)."""
        most = max(entries_per_token, default=0)
        if self.max_entries is not None and most > self.max_entries:
            return f"a list held {most} entries where the convention allows {self.max_entries}"
        if self.sampled_always_listed and listed < tokens:
            return f"the sampled token was listed for {listed} of {tokens} tokens, not always"
        return None


def logprob_convention(kind: str, chat: bool, n: int = TOP_LOGPROBS) -> Convention:
    """The convention of a server kind's top-n alternatives when asked for n of them (each
    measured on the real server's answers: tests/slow and the report's observation)."""
    if kind in ("llama.cpp", "verispec"):
        return Convention("top-n", n, f"the top {n} of p before sampling, whatever was drawn: all {n} are buckets",
                          max_entries=n)
    if kind == "vllm" and chat:
        return Convention("top-(n-1)+sampled", n - 1,
                          f"the sampled token is always listed: {n} entries, the top {n - 1} plus the sampled token "
                          f"(the top {n} when it is among them): the {n - 1} most probable are buckets",
                          max_entries=n, sampled_always_listed=True)
    if kind == "vllm":
        return Convention("top-n+sampled", n,
                          f"the top {n} plus the sampled token as an ({n}+1)-th entry when it is outside them: "
                          f"the {n} most probable are buckets", max_entries=n + 1, sampled_always_listed=True)
    if kind == "reference-prompt-logprobs":
        return Convention("top-n+token", n, f"prompt_logprobs: the top {n} plus the scored token when it is outside "
                                            f"them: the {n} most probable are buckets", max_entries=n + 1)
    return Convention("unknown: top-(n-1)", n - 1,
                      f"convention not measured for server kind {kind!r}: the {n - 1} most probable entries, "
                      "draw-independent whether the server lists the top n, the top n plus the sampled token, "
                      "or the top n-1 plus it")


# what a sampled request adds per server kind so that answers carry token ids (texts collide:
# two ids can detokenize to the same text, and a top-logprobs dict keyed by text merges them)
TOKEN_IDS_REQUEST = {"vllm": {"return_tokens_as_token_ids": True, "return_token_ids": True}}


def pit_top_n(chosen, top: list[tuple], rng: random.Random, buckets: int | None = None) -> tuple[float, bool] | None:
    """(u, whether x fell in a bucket) for one emitted token `chosen` (id or text, matching
    the keys of `top`), `top` the [(key, logprob)] alternatives returned with it, of which
    the `buckets` most probable are buckets (None: all); None when the list is empty or
    malformed."""
    pairs = [(k, lp) for k, lp in top if lp is not None and math.isfinite(lp)]
    if not pairs:
        return None
    pairs.sort(key=lambda kv: -kv[1])  # descending p; the server's order breaks ties (a stable sort)
    if sum(math.exp(lp) for _, lp in pairs) > 1.0 + 1e-4:  # not log-probabilities of one distribution
        return None
    pairs = pairs[:buckets] if buckets is not None else pairs
    if not pairs:
        return None
    probs = [math.exp(lp) for _, lp in pairs]
    listed = min(sum(probs), 1.0)
    before = 0.0
    for (k, _), p in zip(pairs, probs):
        if k == chosen:
            return min(1.0, before + rng.random() * p), True
        before += p
    return min(1.0, listed + rng.random() * (1.0 - listed)), False


# Prompts whose answers copy text from the prompt, so that the deployment's drafter proposes
# (prompt lookup and suffix drafters draft only on a match; a draft model agrees most where
# the answer is predictable): a sampled phase of the suite's open questions alone can verify
# few drafts at temperature 1 (vLLM ngram on SmolLM2: 774 draft tokens in 2,029 emitted,
# 3% accepted), and a check that verified few drafts has little power over the verifier.
# The sampled phase takes these in turn with the suite's prompts; exactness holds for any prompt.
DRAFTING_PROMPTS = (
    "Repeat this text exactly: the cat sat on the mat and the dog sat on the log and the bird sat on the tree.",
    "Copy the following list, one item per line: red, green, blue, yellow, orange, purple, black, white.",
    "Say 'hello world' ten times.",
    "Write the numbers from 1 to 30 separated by commas.",
    "Rewrite this JSON with the age changed to 31: {\"name\": \"Ada\", \"age\": 30, \"city\": \"London\", "
    "\"languages\": [\"English\", \"French\"]}",
    "Quote the first sentence of this paragraph, then summarise it: The river rose all night. By morning the "
    "bridge was gone, and the village was cut off from the road to the market town.",
    "Fix the typo and repeat the sentence: The quick brown fox jumsp over the lazy dog near the river bank.",
    "Continue the pattern for three more lines: A1 B2 C3, A1 B2 C3, A1 B2 C3,",
)


def drafting_mix(prompts: list) -> list:
    """The suite's prompts and DRAFTING_PROMPTS, taken in turn (the sampled phase's prompts)."""
    from ..suite import SuitePrompt
    extra = [SuitePrompt(f"copy-{i:02d}", "copy (sampled phase)", t) for i, t in enumerate(DRAFTING_PROMPTS)]
    out = []
    for i in range(max(len(prompts), len(extra))):
        out += ([prompts[i]] if i < len(prompts) else []) + ([extra[i]] if i < len(extra) else [])
    return out


# prompt lookup as vLLM's `ngram` and llama.cpp's ngram drafters configure it: the token that
# followed the most recent earlier match of the last 4..2 tokens
LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM = 4, 2
LOOKUP_MIN_POSITIONS = 30  # fewer positions with a lookup candidate: the test is not run
# The PIT of the tokens at positions where prompt lookup has a candidate, tested on its own:
# whether a position has one is fixed by the context before the draw, so under an exact
# sampler these PITs are as uniform as the rest, while a verifier fault that only touches
# drafted positions (vLLM's CPU build dividing them by uninitialised temperatures,
# vllm-project/vllm#55005) is diluted in the pooled PIT by every position without a draft.
DRAFTED_MIN_POSITIONS = 100


def lookup_test(points: list[tuple[float, bool]]) -> dict | None:
    """The drafted-token test over positions where prompt lookup has a candidate d (fixed by
    the context before the draw, so whatever the server drafted there, an exact sampler
    emits d with probability p(d)): the number of positions that emitted d against the sum
    of p(d), a two-sided normal test (variance sum p(1-p)). A relaxed acceptance rule emits
    a drafted token more often than p (min(1, c p) for prompt lookup, whose q is one-hot);
    None with fewer than LOOKUP_MIN_POSITIONS positions."""
    from scipy.stats import norm
    if len(points) < LOOKUP_MIN_POSITIONS:
        return None
    hits = sum(x for _, x in points)
    expected = sum(p for p, _ in points)
    var = sum(p * (1 - p) for p, _ in points)
    z = (hits - expected) / math.sqrt(var) if var > 0 else 0.0
    return {"positions": len(points), "emitted_candidate": hits, "expected": expected, "z": z,
            "p_value": float(2 * norm.sf(abs(z)))}


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
                   top_logprobs=TOP_LOGPROBS, concurrency=(concurrency,),
                   extra_body={**(cfg.extra_body or {}), **TOKEN_IDS_REQUEST.get(kind, {})} or None)
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
    conventions = got_run.conventions or {ENDPOINT: logprob_convention(kind, cfg.chat)}
    return EndpointRun(got_run.url, got_run.model, got_run.kind, got_run.logprobs, levels, conventions)


@dataclass
class _Scores:
    """What scoring a run's answers gathers, token by token (filled in order: the PITs draw
    from one random stream)."""

    us: list[float] = field(default_factory=list)  # the PIT of every scored token
    listed: int = 0  # scored tokens that fell in a bucket (the rest in the tail)
    unscored: int = 0  # tokens whose list was empty or malformed
    errors: int = 0  # failed answers
    # (p(d), emitted d) where prompt lookup has a candidate d, and the PITs of the tokens there
    lookup_points: list[tuple[float, bool]] = field(default_factory=list)
    drafted_us: list[float] = field(default_factory=list)
    scorers: dict[str, int] = field(default_factory=dict)  # scored tokens per scorer ("endpoint" / "reference")
    per_token: dict[str, str] = field(default_factory=dict)  # answers that say per token who scored it (rescore.py)
    emitted: int = 0  # tokens the server says it emitted
    without: int = 0  # ... of which came with no logprobs at all
    # the endpoint's lists, as they came: entries per list, how often the sampled token was listed
    entries_per_token: dict[int, int] = field(default_factory=dict)
    sampled_listed: int = 0
    endpoint_tokens: int = 0


def distribution_figures(run: EndpointRun, seed: int = 0, alpha: float = ALPHA, min_tokens: int = 200) -> dict:
    """The PIT test over every scored token of the run, and what it rests on."""
    rng = random.Random(seed)
    conventions = {ENDPOINT: logprob_convention(run.kind, True), REFERENCE: logprob_convention("llama.cpp", True),
                   **(run.conventions or {})}
    answers = [r for lv in run.levels for r in lv.results]
    sc = _Scores()
    for r in answers:
        _score_answer(sc, r, rng, conventions)
    figures = _rests_on(sc, answers, conventions, alpha)
    gap = _coverage_gap(sc)
    contradiction = conventions[ENDPOINT].contradicted_by(sc.entries_per_token, sc.sampled_listed, sc.endpoint_tokens)
    figures["observed"]["follows_convention"] = contradiction is None
    if len(sc.us) < min_tokens:
        figures.update(ks_statistic=None, p_value=None, passed=False, reason=_too_few(sc, answers, min_tokens, gap))
        return figures
    broken = (f"the endpoint's lists do not follow the {conventions[ENDPOINT].name} convention ({contradiction})"
              if contradiction else None)
    _test(figures, sc, alpha, gap, broken)
    return figures


def _score_answer(sc: _Scores, r, rng: random.Random, conventions: dict) -> None:
    """One answer's tokens into sc, in order: each token's prompt-lookup point (where its ids
    give the context), then its PIT against the list it came with."""
    if not r.ok:
        sc.errors += 1
        return
    got_n = len(r.tokens or [])
    n_emitted = r.completion_tokens if r.completion_tokens is not None else got_n
    sc.emitted += max(n_emitted, got_n)
    sc.without += max(0, n_emitted - got_n)
    ids = r.token_ids or [None] * len(r.tokens or [])
    who = r.scored_by or [ENDPOINT] * len(r.tokens or [])
    marks = []
    known = all(isinstance(t, int) for t in ids) and len(ids) == got_n  # the context, for prompt lookup
    context = list(r.prompt_ids or []) if known else None
    for tid, text, top, by in zip(ids, r.tokens or [], r.top or [], who):
        convention = conventions[by or ENDPOINT]
        cand = _lookup_point(sc, context, tid, top, convention.buckets) if context is not None else None
        marks.append(_score_token(sc, tid, text, top, by, bool(cand), rng, convention.buckets))
    if r.scored_by is not None:
        sc.per_token[r.id] = "".join(marks)


def _lookup_point(sc: _Scores, context: list[int], tid: int, top: list[tuple], buckets: int) -> list[int] | None:
    """Prompt lookup's candidate d at this position (None: none); where d is among the
    draw-independent entries its (p(d), emitted d) joins sc. The context then takes the token."""
    cand = lookup_continuation(context, 1, LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM)
    listed = sorted((kv for kv in top if kv[1] is not None and math.isfinite(kv[1])),
                    key=lambda kv: -kv[1])[:buckets] if top else []
    p_cand = next((math.exp(lp) for k, lp in listed if k == cand[0]), None) if cand else None
    if p_cand is not None:  # d among the draw-independent entries: its p is known, not chosen by the draw
        sc.lookup_points.append((min(p_cand, 1.0), tid == cand[0]))
    context.append(tid)
    return cand


def _score_token(sc: _Scores, tid, text: str, top: list[tuple], by: str | None, drafted: bool,
                 rng: random.Random, buckets: int) -> str:
    """One token's PIT into sc (drafted: prompt lookup has a candidate there); -> its mark
    in scored_by_token."""
    if not top:  # listed, but with no logprobs (llama.cpp's native answer, a verification step's token)
        sc.without += 1
        return "-"
    by_id = tid is not None and all(isinstance(k, int) for k, _ in top)
    key = tid if by_id else text  # the alternatives' own keys: ids, else texts
    if (by or ENDPOINT) == ENDPOINT:
        sc.endpoint_tokens += 1
        sc.entries_per_token[len(top)] = sc.entries_per_token.get(len(top), 0) + 1
        sc.sampled_listed += any(k == key for k, _ in top)
    got = pit_top_n(key, top, rng, buckets)
    if got is None:
        sc.unscored += 1
        return "?"
    sc.us.append(got[0])
    if drafted:
        sc.drafted_us.append(got[0])
    sc.listed += got[1]
    sc.scorers[by or ENDPOINT] = sc.scorers.get(by or ENDPOINT, 0) + 1
    return "r" if by == REFERENCE else "e"


def _rests_on(sc: _Scores, answers: list, conventions: dict, alpha: float) -> dict:
    """The figures every verdict rests on: what was scored, by whom, under which convention,
    and what the endpoint's lists showed."""
    by_ref = sc.scorers.get(REFERENCE, 0)
    figures = {"temperature": 1.0, "n": len(sc.us), "alpha": alpha, "answers": len(answers),
               "failed_answers": sc.errors, "unscored_tokens": sc.unscored, "tail_tokens": len(sc.us) - sc.listed,
               "top_logprobs": TOP_LOGPROBS,
               "scored_with": ("the endpoint's own top-n logprobs (not a separate reference)" if not by_ref else
                               f"the reference's top-n logprobs for {by_ref} tokens, the endpoint's own for "
                               f"{sc.scorers.get(ENDPOINT, 0)} (separate-reference scoring, rescore.py)"),
               "scorers": {ENDPOINT: sc.scorers.get(ENDPOINT, 0), REFERENCE: by_ref},
               "order": "descending logprob, one tail bucket for every token not in a bucket",
               "convention": {who: c.to_dict() for who, c in conventions.items()
                              if who == ENDPOINT or sc.scorers.get(who)},
               "observed": {"entries_per_token": dict(sorted(sc.entries_per_token.items())),
                            "sampled_token_listed": sc.sampled_listed, "endpoint_scored_tokens": sc.endpoint_tokens},
               "acceptance_rate": None, "mean_accepted_length": None,
               "emitted_tokens": sc.emitted, "tokens_without_logprobs": sc.without}
    if sc.per_token:
        figures["scored_by_token"] = {"legend": "per emitted token: e = the endpoint's own logprobs, r = the "
                                                "reference's, - = none (not tested), ? = malformed list",
                                      "answers": sc.per_token}
    return figures


def _coverage_gap(sc: _Scores) -> str:
    """The tokens sent without logprobs, in words.

    A token sent with no logprobs cannot be scored, and which tokens lack them is not
    chance: llama.cpp's server (0.3.36's vendored tools/server) sets none for the tokens
    of a speculative verification step (its source leaves result.probs unset there), so what is left to
    score are the tokens decoded without a draft. Their PITs are still exact under an
    exact sampler (whether a step drafts is fixed before its token is sampled), so a
    failure of the rest is evidence; a pass says nothing of the missing tokens."""
    return (f"the server returned no logprobs for {sc.without} of {sc.emitted} emitted tokens (llama.cpp sends "
            "none for tokens from a speculative verification step)"
            + (", nor did the reference" if sc.scorers.get(REFERENCE, 0) or sc.per_token else "")
            + ": those tokens are not tested")


def _too_few(sc: _Scores, answers: list, min_tokens: int, gap: str) -> str:
    """Why fewer than min_tokens tokens were scored: the check is inconclusive."""
    first_error = next((r.error for r in answers if r.error), None)
    if answers and sc.errors == len(answers):  # nothing to score: say why the requests failed
        return f"inconclusive: all {sc.errors} sampled requests failed (first: {first_error})"
    if not sc.us:
        return f"inconclusive: {len(sc.us)} scored tokens (< {min_tokens}); the server returned no usable logprobs"
    return f"inconclusive: only {len(sc.us)} scored tokens" + (f"; {gap}" if sc.without else "")


def _test(figures: dict, sc: _Scores, alpha: float, gap: str, broken: str | None) -> None:
    """The tests into figures, Bonferroni over those run: the PIT of every scored token, the
    PIT where prompt lookup has a candidate and the drafted-token test (each where enough
    positions have one). gap: the tokens without logprobs, in words; broken: how the lists
    break their convention (None: they follow it)."""
    from ..stats import test_uniform
    t = test_uniform(sc.us)
    lk = lookup_test(sc.lookup_points)
    td = test_uniform(sc.drafted_us) if len(sc.drafted_us) >= DRAFTED_MIN_POSITIONS else None
    n_tests = 1 + (lk is not None) + (td is not None)
    a = alpha / n_tests  # Bonferroni over the tests run
    reasons = _reasons(sc, t, td, lk, a, gap, broken)
    figures.update(ks_statistic=t.ks_statistic, p_value=t.p_value, passed=not reasons, histogram=t.histogram,
                   mean_u=sum(sc.us) / len(sc.us), reason="; ".join(reasons) or None)
    figures["tests"] = [{"test": "pit", "kind": "KS vs Uniform(0,1), top-n + tail", "n": t.n,
                         "statistic": t.ks_statistic, "p_value": t.p_value, "alpha": a,
                         "passed": t.passed(a), "histogram": t.histogram}]
    if td is not None:
        figures["tests"].append({"test": "pit-drafted", "kind": "KS vs Uniform(0,1) where prompt lookup has a "
                                 "candidate", "n": td.n, "statistic": td.ks_statistic, "p_value": td.p_value,
                                 "alpha": a, "passed": td.passed(a), "histogram": td.histogram})
    if lk:
        figures["tests"].append({"test": "drafted-token", "kind": "emitted == prompt-lookup candidate vs sum p(d), "
                                 "two-sided normal", "n": lk["positions"], "statistic": lk["z"],
                                 "p_value": lk["p_value"], "alpha": a, "passed": lk["p_value"] >= a,
                                 "emitted_candidate": lk["emitted_candidate"], "expected": lk["expected"]})
    figures.update(correction=f"Bonferroni over {n_tests} tests" if n_tests > 1 else "one test", lookup=lk or {
        "positions": len(sc.lookup_points), "note": f"not run: fewer than {LOOKUP_MIN_POSITIONS} positions with a "
                                                    "prompt-lookup candidate among the draw-independent entries"},
        drafted_positions=len(sc.drafted_us),
        verified_drafts="not visible from outside", min_verified_drafts="-")


def _reasons(sc: _Scores, t, td, lk: dict | None, a: float, gap: str, broken: str | None) -> list[str]:
    """Why the check fails (empty: it passes): a test below its alpha, failed answers, too
    many tokens without logprobs, lists that break their convention."""
    reasons = [] if t.passed(a) else [f"KS p = {t.p_value:.3g} < {a:g}: the sampled tokens do not follow the logprobs"]
    if sc.errors:
        reasons.append(f"{sc.errors} sampled request(s) failed")
    if td is not None and not td.passed(a):
        reasons.append(f"KS p = {td.p_value:.3g} < {a:g} over the {td.n} tokens where prompt lookup has a "
                       "candidate: the tokens emitted where a drafter proposes do not follow the logprobs")
    if lk and lk["p_value"] < a:
        reasons.append(f"drafted-token test p = {lk['p_value']:.3g} < {a:g}: where prompt lookup proposes d, d was "
                       f"emitted {lk['emitted_candidate']} times against {lk['expected']:.1f} expected from p(d) "
                       f"({lk['positions']} positions, z = {lk['z']:.1f})")
    if sc.without > MISSING_LOGPROBS_TOLERANCE * sc.emitted:  # a pass of a selected subset is no pass
        reasons.append(f"inconclusive: {gap}")
    if broken:  # the buckets would then depend on the draw: the PIT means nothing
        reasons.append(f"inconclusive: {broken}")
    return reasons
