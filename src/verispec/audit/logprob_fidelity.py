"""Logprob fidelity from outside: the logprobs a speculative endpoint reports for the tokens
it emitted agree with a reference's teacher-forced scoring of the same tokens (the same
prompt and the answer's earlier tokens), within the deployment's own numerical noise.

The bugs of this class leave the text exact and the logprobs wrong: llama-server's
speculative loop sets a drafted token's probability to 1 "to be set later" and never sets
it (ggml-org/llama.cpp#27972; the vendored server of llama-cpp-python 0.3.36 sends no
logprobs at all for the tokens of a verification step), a logprob of 0.0 reported for
accepted draft tokens, or the logprobs of the neighbouring position reported at an
accepted run's positions. Clients that read logprobs (confidence, perplexity, the
distribution check's PIT) then read the drafter's bookkeeping, not the model.

1. The answers: the sampled phase (EndpointAudit.sampled: temperature 1, top-20 logprobs,
   token ids). Tokens the server says it emitted (usage) but listed no logprobs for, or
   listed with an empty list of alternatives, are counted: more than
   sampled.MISSING_LOGPROBS_TOLERANCE of them fails the check (the llama.cpp#27972 class).
2. The reference, teacher-forced over each answer's token ids (no text is tokenized again):
   vLLM and verispec: one completions request per answer with prompt + answer as a
   token-id prompt and ``prompt_logprobs`` (vLLM's extension; verispec's server computes
   it with the same teacher-forced pass as its logprobs); llama.cpp: its OpenAI routes
   have no prompt logprobs, so one /completion request per position
   (rescore.score_position), at most LLAMA_POSITIONS positions, half of them at tokens
   listed with no alternatives (a placeholder's value is compared, not only counted).
   The scoring server is the reference when it is a server of the endpoint's kind
   (verispec: its own server with speculation off), else the endpoint itself: a prompt is
   prefilled, never speculated, so its prompt scoring is a valid reference.
3. The noise: a null run of NULL_TOKENS tokens sampled by the scoring server itself, its
   own logprobs against its own teacher-forced scoring of the same tokens. Where that
   server is the speculative endpoint, only one-token answers count (their token follows
   the prefill: no draft was verified before it), so a speculation bug cannot widen the
   tolerance that is meant to catch it.
4. The decision a person can check: with tolerance = max(TOLERANCE_FLOOR, TOLERANCE_FACTOR
   x the null's 99th percentile of |endpoint - reference|), at most SHARE_LIMIT of the
   compared emitted tokens, and of the listed alternatives both sides list, may differ by
   more. Shares are also given at positions where prompt lookup has a candidate (where an
   n-gram drafter drafts: sampled.py's lookup) and the rest.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, replace

import httpx

from ..drafters.lookup import lookup_continuation
from .checks import CheckResult
from .endpoint.client import EndpointConfig, PromptResult
from .endpoint.rescore import _Native, prompt_ids as llama_prompt_ids, score_position
from .endpoint.sampled import (ENDPOINT, LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM, MISSING_LOGPROBS_TOLERANCE,
                               TOP_LOGPROBS, drafting_mix, sampled_run, sampler_settings)

TOLERANCE_FLOOR = 0.05  # nats: below this a difference is numerics whatever the null says
TOLERANCE_FACTOR = 10.0
SHARE_LIMIT = 0.01  # the share of compared logprobs allowed beyond the tolerance
MIN_COMPARED = 100  # fewer compared tokens: inconclusive
MIN_NULL = 50  # fewer tokens in the null: the noise is not measured, inconclusive
NULL_TOKENS = 256
LLAMA_POSITIONS = 150  # llama.cpp scores one position a request: the cap of the check
LLAMA_NULL_POSITIONS = 100  # ... and of its null
EXAMPLES = 8
PROMPT_SCORED = ("vllm", "verispec")  # kinds that score a token-id prompt with prompt_logprobs
MISSING_CAUSE = "a speculative verification step's tokens sent without their logprobs"


@dataclass(frozen=True)
class Diff:
    """One logprob the endpoint reported against the reference's for the same token at the
    same position: the emitted token's own, or an alternative both sides listed."""

    answer: str
    position: int
    token: int
    text: str
    endpoint: float
    reference: float
    drafted: bool  # prompt lookup has a candidate at this position
    alternative: bool = False

    @property
    def abs(self) -> float:
        return abs(self.endpoint - self.reference)

    def to_dict(self) -> dict:
        return {"answer": self.answer, "position": self.position, "token_id": self.token, "token": self.text,
                "endpoint_logprob": round(self.endpoint, 5), "reference_logprob": round(self.reference, 5),
                "difference": round(self.endpoint - self.reference, 5), "drafted": self.drafted,
                "alternative": self.alternative}


# -- pure: coverage, positions, differences, tolerance, verdict -----------------------------
def emitted(r: PromptResult) -> int:
    """Tokens the server says it emitted (usage), or listed if more."""
    return max(r.completion_tokens or 0, len(r.tokens or []))


def has_logprobs(r: PromptResult, j: int) -> bool:
    """Whether token j came with its own logprobs: a value and, where the endpoint's list is
    kept (rescore.py may put the reference's in its place), a list of alternatives."""
    if r.token_logprobs is None or j >= len(r.token_logprobs) or r.token_logprobs[j] is None:
        return False
    own = r.scored_by is None or r.scored_by[j] in (None, ENDPOINT)
    return not own or bool(r.top and r.top[j])


def without_logprobs(r: PromptResult) -> int:
    return emitted(r) - sum(has_logprobs(r, j) for j in range(len(r.tokens or [])))


def aligned(r: PromptResult) -> bool:
    """Every emitted token listed with its id: the answer can be teacher-forced."""
    ids = r.token_ids or []
    return r.ok and bool(ids) and len(ids) == emitted(r) and all(isinstance(t, int) for t in ids)


def drafted_positions(prompt: list[int], answer: list[int]) -> list[bool]:
    """Per answer position: whether prompt lookup has a candidate there (sampled.py's lookup:
    where an n-gram drafter drafts, fixed by the context before the token)."""
    context, out = list(prompt), []
    for t in answer:
        out.append(bool(lookup_continuation(context, 1, LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM)))
        context.append(t)
    return out


def differences(r: PromptResult, ref: dict[int, list[tuple]], drafted: list[bool]) -> tuple[list[Diff], int]:
    """The answer's logprobs against the reference's lists (position -> [(id, logprob)]):
    the emitted token's own value and every alternative listed by both; -> (diffs, positions
    whose token the reference did not list)."""
    out, unlisted = [], 0
    for j, got in sorted(ref.items()):
        lp = r.token_logprobs[j] if r.token_logprobs and j < len(r.token_logprobs) else None
        theirs = {k: v for k, v in got if isinstance(k, int) and v is not None and math.isfinite(v)}
        tid, text = r.token_ids[j], (r.tokens or [""] * (j + 1))[j]
        if lp is None or tid not in theirs:
            unlisted += lp is not None
            continue
        out.append(Diff(r.id, j, tid, text, lp, theirs[tid], drafted[j]))
        if r.scored_by is None or r.scored_by[j] in (None, ENDPOINT):  # the endpoint's own list
            out += [Diff(r.id, j, k, "", v, theirs[k], drafted[j], True) for k, v in (r.top or [])[j]
                    if isinstance(k, int) and k != tid and k in theirs and v is not None and math.isfinite(v)]
    return out, unlisted


def quantiles(xs: list[float]) -> dict:
    """p50 / p90 / p99 / max of xs (None where empty)."""
    if not xs:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, math.ceil(p * len(s)) - 1)]
    return {"n": len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": s[-1]}


def tolerance(null: list[float]) -> float:
    """max(TOLERANCE_FLOOR, TOLERANCE_FACTOR x the null's 99th percentile of |difference|)."""
    p99 = quantiles(null)["p99"]
    return max(TOLERANCE_FLOOR, TOLERANCE_FACTOR * (p99 or 0.0))


def share_over(diffs: list[Diff], tol: float) -> dict:
    """Compared, over the tolerance, and their share, in all and split by drafted positions."""
    def one(ds: list[Diff]) -> dict:
        over = sum(d.abs > tol for d in ds)
        return {"compared": len(ds), "over": over, "share": over / len(ds) if ds else None}
    return {"all": one(diffs), "drafted": one([d for d in diffs if d.drafted]),
            "not_drafted": one([d for d in diffs if not d.drafted])}


@dataclass
class Tally:
    """What comparing a run's answers with the reference gathered."""

    diffs: list[Diff]  # the emitted tokens' and the shared alternatives' differences
    answers: int = 0
    failed: int = 0  # answers that came back with an error
    emitted: int = 0  # tokens the server says it emitted
    without: int = 0  # ... of which came without logprobs
    unaligned: int = 0  # answers whose tokens are not all listed with ids: not teacher-forced
    unlisted: int = 0  # tokens with a logprob that the reference's list left out (llama.cpp's top-n)


def tally(answers: list[PromptResult], scored: dict[str, dict[int, list[tuple]]],
          prompts: dict[str, list[int]]) -> Tally:
    """Compare every answer with its reference lists (answer id -> position -> list); prompts:
    answer id -> its prompt ids (for the lookup split)."""
    t = Tally([], answers=len(answers))
    for r in answers:
        if not r.ok:
            t.failed += 1
            continue
        t.emitted += emitted(r)
        t.without += without_logprobs(r)
        if r.id not in scored or not aligned(r):  # its tokens are not all listed with ids, or its scoring failed
            t.unaligned += 1
            continue
        got, unlisted = differences(r, scored[r.id], drafted_positions(prompts[r.id], r.token_ids))
        t.diffs += got
        t.unlisted += unlisted
    return t


def judge(t: Tally, null: list[Diff], about: dict) -> CheckResult:
    """The verdict: missing logprobs beyond MISSING_LOGPROBS_TOLERANCE, too few compared
    tokens, or more than SHARE_LIMIT of the emitted tokens' (or of the shared alternatives')
    logprobs beyond their tolerance fail. about: what scored and what the null was."""
    tokens, alts = [d for d in t.diffs if not d.alternative], [d for d in t.diffs if d.alternative]
    # the null's emitted tokens set the tokens' tolerance, its shared alternatives the alternatives'
    tol = tolerance([d.abs for d in null if not d.alternative])
    tol_alt = tolerance([d.abs for d in null if d.alternative])
    st, sa = share_over(tokens, tol), share_over(alts, tol_alt)
    reasons = []
    if t.without > MISSING_LOGPROBS_TOLERANCE * t.emitted:
        reasons.append(f"{t.without} of {t.emitted} emitted tokens ({t.without / max(t.emitted, 1):.1%}) came "
                       f"without logprobs: {known_class('llama.cpp')}")
    if t.failed:
        reasons.append(f"{t.failed} of {t.answers} sampled requests failed")
    for what, s, limit in (("emitted tokens", st, tol), ("listed alternatives", sa, tol_alt)):
        if s["all"]["compared"] and s["all"]["share"] > SHARE_LIMIT:
            reasons.append(f"{s['all']['over']} of {s['all']['compared']} {what} ({s['all']['share']:.1%}; drafted "
                           f"positions {_pct(s['drafted']['share'])}, the rest {_pct(s['not_drafted']['share'])}) "
                           f"differ from the reference by more than {limit:.3g} ({known_class(None)})")
    n_null = sum(not d.alternative for d in null)
    if len(tokens) < MIN_COMPARED and not reasons:
        reasons.append(f"inconclusive: {len(tokens)} emitted tokens compared (< {MIN_COMPARED})")
    if n_null < MIN_NULL and not reasons:
        reasons.append(f"inconclusive: the null compared {n_null} tokens (< {MIN_NULL}): the noise is not measured")
    figures = _figures(t, null, about, (tol, st), (tol_alt, sa))
    worst = sorted(t.diffs, key=lambda d: -d.abs)[:EXAMPLES]
    summary = "; ".join(reasons) if reasons else (
        f"{len(tokens)} emitted tokens and {len(alts)} listed alternatives agree with the reference: "
        f"{st['all']['over']} tokens beyond {tol:.3g} ({_pct(st['all']['share'])} <= {SHARE_LIMIT:.0%})")
    return CheckResult(not reasons, summary, figures, {"largest_differences": [d.to_dict() for d in worst]})


def known_class(server: str | None) -> str:
    """The known bug a finding resembles, in words (the report's table of known bug classes
    lists every catalogued bug of this check: audit/known_bugs.py, which imports the registry
    and so cannot be imported here)."""
    if server is not None:
        return f"the class of ggml-org/llama.cpp#27972: {MISSING_CAUSE}"
    return "logprobs that are not the target's at those positions (the report lists the known bugs of this class)"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _figures(t: Tally, null: list[Diff], about: dict, tok: tuple[float, dict], alt: tuple[float, dict]) -> dict:
    tokens = [d.abs for d in t.diffs if not d.alternative]
    return {**about,
            "rule": (f"fail when more than {SHARE_LIMIT:.0%} of the compared emitted tokens (or of the alternatives "
                     f"both sides list) differ from the reference by more than the tolerance, or more than "
                     f"{MISSING_LOGPROBS_TOLERANCE:.0%} of the emitted tokens come without logprobs"),
            "tolerance": tok[0], "tolerance_alternatives": alt[0],
            "tolerance_rule": f"max({TOLERANCE_FLOOR}, {TOLERANCE_FACTOR:g} x the null's 99th percentile of "
                              "|endpoint - reference| logprob)",
            "null_quantiles": quantiles([d.abs for d in null if not d.alternative]),
            "null_quantiles_alternatives": quantiles([d.abs for d in null if d.alternative]),
            "tokens_compared": len(tokens), "tokens": tok[1], "alternatives": alt[1],
            "difference_quantiles": quantiles(tokens),
            "emitted_tokens": t.emitted, "tokens_without_logprobs": t.without,
            "share_without_logprobs": t.without / t.emitted if t.emitted else None,
            "answers": t.answers, "failed_answers": t.failed, "answers_not_teacher_forced": t.unaligned,
            "tokens_not_listed_by_reference": t.unlisted}


# -- the reference's scoring ------------------------------------------------------------------
@dataclass(frozen=True)
class Scorer:
    """The server that scores token-id prompts teacher-forced, and how."""

    cfg: EndpointConfig
    kind: str  # "vllm" / "verispec": prompt_logprobs, one request an answer; "llama.cpp": one a position
    own: bool  # it is the speculative endpoint itself (no separate reference of its kind)

    def describe(self) -> str:
        how = ("one /completion request per position (rescore.score_position), at most "
               f"{LLAMA_POSITIONS} positions" if self.kind == "llama.cpp"
               else "prompt_logprobs over prompt + answer as a token-id prompt, one request per answer")
        who = "the endpoint itself (a prompt is prefilled, not speculated)" if self.own else \
            f"the reference at {self.cfg.base}" + (" (speculation off)" if self.cfg.extra_body else "")
        return f"{who}: {how}"


def scorer_for(a) -> Scorer | None:
    """The reference when it is a server of the endpoint's kind, else the endpoint itself;
    None where the kind has no way to score a token-id prompt here."""
    kind = a.info.kind
    if kind not in PROMPT_SCORED + ("llama.cpp",):
        return None
    if a.ref_cfg is not None and (a.ref_info is None or a.ref_info.kind == kind):
        return Scorer(a.ref_cfg, kind, own=False)  # ref_info None: the same verispec server, speculation off
    return Scorer(replace(a.cfg, extra_body=None), kind, own=True)


async def _prompt_ids(api: _Native, s: Scorer, model: str, prompt: str) -> list[int]:
    """The prompt as the scoring server tokenizes it (its chat template for a chat prompt)."""
    if s.kind == "llama.cpp":
        return await llama_prompt_ids(api, prompt, s.cfg.chat)
    body = ({"messages": [{"role": "user", "content": prompt}]} if s.cfg.chat
            else {"prompt": prompt, "add_special_tokens": True, "add_special": True})
    got = await api.post("/tokenize", {"model": model, **body})
    return [t if isinstance(t, int) else t["id"] for t in got["tokens"]]


async def _score(api: _Native, s: Scorer, model: str, prompt: list[int], answer: list[int],
                 positions: list[int]) -> dict[int, list[tuple]]:
    """The scoring server's [(id, logprob)] at each asked answer position, teacher-forced."""
    sampler = sampler_settings(s.kind)
    if s.kind == "llama.cpp":
        return {j: await score_position(api, prompt + answer[:j], sampler) for j in positions}
    body = {"model": model, "prompt": prompt + answer, "max_tokens": 1, "temperature": 1.0, **sampler,
            "prompt_logprobs": TOP_LOGPROBS, "stream": False, **(s.cfg.extra_body or {})}
    got = (await api.post("/v1/completions", body))["choices"][0]["prompt_logprobs"]
    return {j: [(int(k), v["logprob"]) for k, v in (got[len(prompt) + j] or {}).items()] for j in positions}


def positions(answers: list[PromptResult], s: Scorer, cap: int, seed: int) -> dict[str, list[int]]:
    """The positions to score per aligned answer: all where scoring is one request an answer;
    llama.cpp: at most `cap` of the tokens with a logprob value, half of them (where there are)
    at tokens listed without alternatives, drawn by the seed."""
    ok = [r for r in answers if aligned(r)]
    if s.kind != "llama.cpp":
        return {r.id: list(range(len(r.token_ids))) for r in ok}
    valued = [(r.id, j) for r in ok for j in range(len(r.token_ids)) if r.token_logprobs[j] is not None]
    bare = {(r.id, j) for r in ok for j in range(len(r.token_ids)) if not has_logprobs(r, j)}
    rng = random.Random(seed)
    placeholders = [p for p in valued if p in bare]
    pick = rng.sample(placeholders, min(len(placeholders), cap // 2))
    rest = [p for p in valued if p not in bare]
    pick += rng.sample(rest, min(len(rest), cap - len(pick)))
    out: dict[str, list[int]] = {r.id: [] for r in ok}
    for rid, j in sorted(pick):
        out[rid].append(j)
    return out


async def score_answers(s: Scorer, answers: list[PromptResult], prompts: dict[str, str], todo: dict[str, list[int]],
                        concurrency: int) -> tuple[dict[str, dict[int, list]], dict[str, list[int]]]:
    """The reference's lists at the asked positions of each answer, and each answer's prompt
    ids; an answer whose scoring fails is left out (answers_not_teacher_forced counts it)."""
    api, sem = _Native(s.cfg, concurrency), asyncio.Semaphore(concurrency)
    scored, pids, cache = {}, {}, {}

    async def one(r: PromptResult, model: str) -> None:
        async with sem:
            if not todo[r.id]:
                scored[r.id], pids[r.id] = {}, []
                return
            try:
                text = prompts[r.id.rsplit("#", 1)[0]]
                if r.prompt_ids:
                    pids[r.id] = list(r.prompt_ids)
                else:
                    if text not in cache:
                        cache[text] = await _prompt_ids(api, s, model, text)
                    pids[r.id] = cache[text]
                scored[r.id] = await _score(api, s, model, pids[r.id], list(r.token_ids), todo[r.id])
            except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError):
                scored.pop(r.id, None)
    try:
        model = s.cfg.model or (await api.http.get("/v1/models")).json()["data"][0]["id"]
        await asyncio.gather(*(one(r, model) for r in answers if r.id in todo))
    finally:
        await api.aclose()
    return scored, pids


# -- the check --------------------------------------------------------------------------------
def compare_run(s: Scorer, answers: list[PromptResult], prompts: dict[str, str], cap: int, seed: int,
                concurrency: int) -> Tally:
    """The answers against the scorer's teacher-forced lists."""
    todo = positions(answers, s, cap, seed)
    scored, pids = asyncio.run(score_answers(s, answers, prompts, todo, concurrency))
    return tally(answers, scored, pids)


def null_run(a, s: Scorer, prompts: list) -> tuple[Tally, str]:
    """The scoring server's own sampled logprobs against its own teacher-forced scoring of the
    same tokens: the noise of the deployment with no speculative bug in it. Where the scorer is
    the speculative endpoint, one-token answers (their token follows the prefill: no draft
    was verified before it)."""
    cfg = replace(s.cfg, max_tokens=1) if s.own else s.cfg
    run = sampled_run(cfg, s.kind, prompts, NULL_TOKENS, max(a.concurrency))
    answers = [r for lv in run.levels for r in lv.results]
    t = compare_run(s, answers, {p.id: p.prompt for p in prompts}, LLAMA_NULL_POSITIONS, a.seed + 1,
                    max(a.concurrency))
    what = ("one-token answers of the endpoint (each token follows the prefill, no draft before it)" if s.own
            else f"answers of the reference at {s.cfg.base}" + (" with speculation off" if s.cfg.extra_body else ""))
    n = sum(not d.alternative for d in t.diffs)
    return t, f"{n} tokens sampled at temperature 1 from {what}, their own logprobs against the same teacher-forced scoring"


def endpoint_logprobs_check(a) -> CheckResult | None:
    """The sampled phase's logprobs against the reference's teacher-forced scoring (module
    docstring); None where the endpoint's kind has no way to score a token-id prompt, or
    where no temperature-1 tokens are sampled (--sampled-tokens 0)."""
    s = scorer_for(a)
    if s is None or not a.sampled_tokens:
        return None
    run = a.sampled()
    answers = [r for lv in run.levels for r in lv.results]
    if not run.logprobs or not any(v is not None for r in answers for v in r.token_logprobs or []):
        return CheckResult(True, "not applicable: the server lists no logprobs", {"applicable": False},
                           informational=True)
    prompts = drafting_mix(a.prompts)
    t = compare_run(s, answers, {p.id: p.prompt for p in prompts}, LLAMA_POSITIONS, a.seed, max(a.concurrency))
    null, null_what = null_run(a, s, prompts)
    about = {"applicable": True, "reference": s.describe(), "null": null_what,
             "null_failed_answers": null.failed, "null_tokens_without_logprobs": null.without}
    return judge(t, null.diffs, about)
