"""Separate-reference scoring for the temperature-1 check (sampled.py): the endpoint's
emitted tokens scored by a non-speculative reference server of the same model, where
the endpoint sent no logprobs of its own (or for every token, when asked).

Why: llama-server sends no probabilities for the tokens of a speculative verification
step, so scored with its own logprobs only the tokens decoded without a draft are tested,
and the check is inconclusive. A reference that decodes without drafts has every
position's distribution; both servers serving the same model file, its distribution is
the endpoint's target distribution (up to the batching numerics the null measures).

How, through llama.cpp's native API on both servers (its OpenAI routes refuse ``echo``,
"Only no echo is supported", so there are no prompt logprobs: one request a position):

1. the prompt as token ids: a chat prompt through the endpoint's own template
   (``POST /apply-template``), then ``POST /tokenize`` on the endpoint with add_special
   and parse_special, as llama.cpp's chat and completion routes tokenize;
2. the answer: ``POST /completion`` to the endpoint with that token-id prompt, n_predict
   = max_tokens, temperature 1 and every other sampler setting off (sampled.SAMPLER_OFF),
   n_probs = TOP_LOGPROBS, return_tokens, not streamed. It holds every emitted token's id
   and, per token, the top-n logprobs; a verification step's tokens come with an empty
   list (and a logprob of 0, from the probability 1 llama.cpp leaves there), read here as
   "no logprobs", never as a probability;
3. a position j to score: ``POST /completion`` to the reference with the prompt ids plus
   the first j emitted ids as a token-id prompt, n_predict = 1, the same sampler settings,
   n_probs = TOP_LOGPROBS, cache_prompt (the slot keeps the prefix: a position costs about
   one token's pass). Its ``completion_probabilities[0].top_logprobs`` are the reference's
   top-n before sampling: the softmax of its logits, temperature 1. A draw that ends inside
   a multi-byte character comes with no entry; the position is asked again with the draw
   forced onto an ASCII token (``logit_bias``), which leaves that list as it is.

No text is tokenized again anywhere: the reference is given the ids the endpoint emitted
(a detokenized answer need not tokenize back to the same ids). Positions are scored in
order per answer, answers `concurrency` at a time.

Scorers (`--score-with`): "auto" scores by the reference only the tokens that came without
logprobs; "reference" every token (the endpoint's own logprobs are kept aside, not used);
"endpoint" never asks the reference (the runner then takes sampled.py's own path; here it
leaves those tokens unscored, as they came). Each scored token records which
scorer it used (PromptResult.scored_by), and the check counts them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import httpx

from .client import EndpointConfig, EndpointRun, LevelRun, PromptResult, _collect_logprobs, _counters
from .counters import response_spec
from .sampled import (ENDPOINT, REFERENCE, TOKEN_IDS_REQUEST, TOP_LOGPROBS, logprob_convention, sampled_run,
                      sampler_settings)

SCORERS = ("auto", ENDPOINT, REFERENCE)
SCORE_TRIES = 4  # forced draws asked of the reference for one position's top-n (score_position)
FORCE_BIAS = 100.0  # a logit bias that makes one token the draw: e^100 outweighs any vocabulary


class RescoreUnsupported(ValueError):
    """Separate-reference scoring cannot run against these servers (and why)."""


def supported(kind: str, ref_kind: str | None) -> str | None:
    """None when the endpoint and the reference can be scored this way, else why not."""
    if ref_kind is None:
        return "no --reference-endpoint to score with"
    if kind != ref_kind or kind not in ("llama.cpp", "vllm"):
        return (f"separate-reference scoring needs two llama.cpp servers (token-id prompts to /completion, "
                f"return_tokens) or two vLLM servers (return_token_ids, prompt_logprobs); endpoint: {kind}, "
                f"reference: {ref_kind}")
    return None


class _Native:
    """llama.cpp's native routes on one server."""

    def __init__(self, cfg: EndpointConfig, concurrency: int):
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.http = httpx.AsyncClient(base_url=cfg.base, headers=headers, timeout=cfg.timeout_s,
                                      limits=httpx.Limits(max_connections=concurrency + 4))
        self._ascii: list[int | None] = []  # ascii_token's answer, once asked

    async def post(self, path: str, body: dict) -> dict:
        r = await self.http.post(path, json=body)
        if r.status_code != 200:
            raise httpx.HTTPStatusError(f"HTTP {r.status_code} from {path}: {r.text[:300]}", request=r.request,
                                        response=r)
        return r.json()

    async def tokenize(self, text: str, special: bool) -> list[int]:
        """`text` as token ids (special: with BOS and special tokens parsed, as llama.cpp's
        chat and completion routes tokenize a prompt)."""
        got = (await self.post("/tokenize", {"content": text, "add_special": special,
                                             "parse_special": special}))["tokens"]
        return [t if isinstance(t, int) else t["id"] for t in got]

    async def ascii_token(self) -> int | None:
        """The id of a token that is one ASCII character ("a"), None where the vocabulary has
        none: a draw forced onto it always ends on a whole character (score_position)."""
        if not self._ascii:
            try:
                got = await self.tokenize("a", special=False)
            except (httpx.HTTPError, KeyError, TypeError, ValueError):
                got = []  # a server without /tokenize: its draws are left free
            self._ascii = [got[0] if len(got) == 1 else None]
        return self._ascii[0]

    async def aclose(self):
        await self.http.aclose()


async def prompt_ids(api: _Native, prompt: str, chat: bool) -> list[int]:
    """The prompt as the endpoint's token ids (its own chat template for a chat prompt)."""
    text = prompt
    if chat:
        text = (await api.post("/apply-template", {"messages": [{"role": "user", "content": prompt}]}))["prompt"]
    return await api.tokenize(text, special=True)


def _top(entry: dict) -> list[tuple[int, float]]:
    """[(id, logprob)] of one completion_probabilities entry ([] where the server set none)."""
    return [(t["id"], t["logprob"]) for t in entry.get("top_logprobs") or [] if "id" in t and "logprob" in t]


def _body(ids: list[int], n_predict: int, sampler: dict) -> dict:
    return {"prompt": ids, "n_predict": n_predict, "temperature": 1.0, **sampler, "n_probs": TOP_LOGPROBS,
            "post_sampling_probs": False, "return_tokens": True, "stream": False, "cache_prompt": True}


def align_entries(tokens: list[int], entries: list[dict]) -> list[dict] | None:
    """completion_probabilities aligned to the emitted token ids: one entry per token, {} for a
    token the server listed no entry for; None where the entries are no subsequence of the ids.

    llama-server (0.3.36's tools/server) adds a token to its answer's list only once the text
    so far ends in a complete UTF-8 character: a token that stops inside a multi-byte
    character (a byte-fallback token) gets no entry, the token that completes the character
    gets one with its own id and logprobs (measured: 48 tokens, 37 entries, at temperature 1
    on SmolLM2). An entry is kept at a token only where every way of placing the entries
    in order puts it there (its leftmost and rightmost placement agree); a token left
    without one is scored by the reference, like a verification step's token."""
    def placement(positions, want) -> list[int] | None:  # greedy: each entry at its first match
        at = []
        for i in positions:
            if len(at) < len(want) and want[len(at)].get("id") == tokens[i]:
                at.append(i)
        return at if len(at) == len(want) else None

    left = placement(range(len(tokens)), entries)
    right = placement(range(len(tokens) - 1, -1, -1), entries[::-1])
    if left is None or right is None:
        return None
    out: list[dict] = [{} for _ in tokens]
    for k, (lo, hi) in enumerate(zip(left, right[::-1])):
        if lo == hi:
            out[lo] = entries[k]
    return out


async def sample_answer(api: _Native, pid: str, slice_: str, ids: list[int], max_tokens: int,
                        sampler: dict) -> PromptResult:
    """One temperature-1 answer from the endpoint's /completion, every token with its id."""
    res = PromptResult(pid, slice_)
    t0 = time.perf_counter()
    obj = await api.post("/completion", _body(ids, max_tokens, sampler))
    probs = obj.get("completion_probabilities") or []
    got = [p.get("id") for p in probs]
    if obj.get("tokens") is not None and obj["tokens"] != got:
        aligned = align_entries(obj["tokens"], probs)
        if aligned is None:
            res.error = (f"/completion's tokens ({len(obj['tokens'])}) and completion_probabilities "
                         f"({len(got)}) disagree: the entries are not the emitted ids in order")
            return res
        probs, got = aligned, list(obj["tokens"])
    res.latency_s = time.perf_counter() - t0
    res.text = obj.get("content", "")
    res.finish_reason = "length" if obj.get("stop_type") == "limit" else "stop"
    res.prompt_tokens = obj.get("tokens_evaluated")
    res.completion_tokens = obj.get("tokens_predicted", len(got))
    res.tokens = [p.get("token", "") for p in probs]
    res.top = [_top(p) for p in probs]
    res.token_ids = got
    res.token_logprobs = [p.get("logprob") if t else None for p, t in zip(probs, res.top)]
    res.top2_margins = [t[0][1] - t[1][1] if len(t) >= 2 else None for t in res.top]
    res.scored_by = [ENDPOINT if t else None for t in res.top]
    res.server_info = response_spec(obj)
    res.prompt_ids = list(ids)
    return res


async def score_position(ref: _Native, ids: list[int], sampler: dict) -> list[tuple[int, float]]:
    """The reference's top-n logprobs of the token after `ids` ([] if it sent none)."""
    # The reference lists no entry for a draw that ends inside a multi-byte character: a
    # token that starts one (SmolLM2's 10813, the first two bytes of an emoji, is drawn 74%
    # of the time after a run of emoji), so asking for more draws can fail (eight in a row
    # did, in a CI run). Its top-n before sampling are the softmax of its raw logits, which
    # no sampler setting touches (tools/server's get_token_probabilities), so after one
    # free draw the draw is forced onto an ASCII token by logit_bias: the same list, always
    # listed (tests/endpoint/test_rescore_llama_server.py checks both on the real server).
    obj = await ref.post("/completion", _body(ids, 1, sampler))
    probs = obj.get("completion_probabilities") or []
    if probs:
        return _top(probs[0])
    forced = await ref.ascii_token()
    for _ in range(SCORE_TRIES):  # more than one only where the server ignores the bias
        body = _body(ids, 1, sampler)
        if forced is not None:
            body["logit_bias"] = [[forced, FORCE_BIAS]]
        obj = await ref.post("/completion", body)
        probs = obj.get("completion_probabilities") or []
        if probs:
            return _top(probs[0])
    return []


async def _one(api: _Native, ref: _Native, p, chat: bool, max_tokens: int, sampler: dict, scorer: str,
               cache: dict) -> PromptResult:
    try:
        if p.prompt not in cache:
            cache[p.prompt] = await prompt_ids(api, p.prompt, chat)
        ids = cache[p.prompt]
        r = await sample_answer(api, p.id, p.slice, ids, max_tokens, sampler)
        if not r.ok:
            return r
        for j in range(len(r.token_ids)):
            if scorer == REFERENCE or (scorer == "auto" and not r.top[j]):
                r.top[j] = await score_position(ref, ids + r.token_ids[:j], sampler)
                r.scored_by[j] = REFERENCE if r.top[j] else None
        return r
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
        return PromptResult(p.id, p.slice, error=f"{type(e).__name__}: {e}")


async def run_rescored(cfg: EndpointConfig, ref_cfg: EndpointConfig, prompts: list,
                       scorer: str = "auto") -> EndpointRun:
    """The prompts' temperature-1 answers from the endpoint, scored as the module says;
    cfg.concurrency[0] answers at a time."""
    if scorer not in (ENDPOINT, REFERENCE, "auto"):
        raise ValueError(f"scorer must be one of {SCORERS}, got {scorer!r}")
    conc = cfg.concurrency[0]
    api, ref = _Native(cfg, conc), _Native(ref_cfg, conc)
    sampler = sampler_settings("llama.cpp")
    cache: dict = {}
    sem = asyncio.Semaphore(conc)

    async def bounded(p):
        async with sem:
            return await _one(api, ref, p, cfg.chat, cfg.max_tokens, sampler, scorer, cache)
    try:
        model = cfg.model or (await api.http.get("/v1/models")).json()["data"][0]["id"]
        before = await _endpoint_counters(api)
        t0 = time.perf_counter()
        results = list(await asyncio.gather(*(bounded(p) for p in prompts)))
        wall = time.perf_counter() - t0
        after = await _endpoint_counters(api)  # llama.cpp adds a request's counts at its slot's release
        spec = after.delta(before) if after is not None else None
    finally:
        await api.aclose()
        await ref.aclose()
    return EndpointRun(cfg.base, model, "llama.cpp", True, [LevelRun(conc, wall, results, spec)])


async def vllm_answer(api: _Native, model: str, p, chat: bool, max_tokens: int, sampler: dict) -> PromptResult:
    """One temperature-1 answer from a vLLM endpoint, not streamed, with the prompt's and the
    answer's token ids (return_token_ids) and every alternative keyed by id."""
    res = PromptResult(p.id, p.slice)
    body = {"model": model, "max_tokens": max_tokens, "temperature": 1.0, **sampler, "stream": False,
            "return_token_ids": True, **TOKEN_IDS_REQUEST["vllm"]}
    if chat:
        path = "/v1/chat/completions"
        body.update(messages=[{"role": "user", "content": p.prompt}], logprobs=True, top_logprobs=TOP_LOGPROBS)
    else:
        path = "/v1/completions"
        body.update(prompt=p.prompt, logprobs=TOP_LOGPROBS)
    t0 = time.perf_counter()
    obj = await api.post(path, body)
    res.latency_s = time.perf_counter() - t0
    ch = obj["choices"][0]
    prompt = obj.get("prompt_token_ids") or ch.get("prompt_token_ids")
    if not prompt or ch.get("token_ids") is None:
        res.error = "the answer has no prompt_token_ids / token_ids (vLLM before return_token_ids?)"
        return res
    toks, lps, margins, ids, tops = [], [], [], [], []
    _collect_logprobs(ch.get("logprobs"), chat, toks, lps, margins, ids, tops)
    if ids != list(ch["token_ids"]):
        res.error = f"logprobs' token ids ({len(ids)}) are not the answer's token_ids ({len(ch['token_ids'])})"
        return res
    res.text = (ch.get("message") or {}).get("content") if chat else ch.get("text")
    res.finish_reason = ch.get("finish_reason")
    res.prompt_tokens = (obj.get("usage") or {}).get("prompt_tokens", len(prompt))
    res.completion_tokens = (obj.get("usage") or {}).get("completion_tokens", len(ids))
    res.tokens, res.token_logprobs, res.top2_margins, res.token_ids, res.top = toks, lps, margins, ids, tops
    res.scored_by = [ENDPOINT if t else None for t in tops]
    res.prompt_ids = list(prompt)
    return res


async def vllm_score(ref: _Native, model: str, prompt: list[int], answer: list[int],
                     sampler: dict) -> list[list[tuple[int, float]]]:
    """The reference's top-n logprobs at every answer position, from one request: the prompt
    and the answer as a token-id prompt, scored by prompt_logprobs (the top n plus the
    scored token where it is outside them: reference-prompt-logprobs convention)."""
    body = {"model": model, "prompt": list(prompt) + list(answer), "max_tokens": 1, "temperature": 1.0, **sampler,
            "prompt_logprobs": TOP_LOGPROBS, "stream": False}
    got = (await ref.post("/v1/completions", body))["choices"][0]["prompt_logprobs"]
    return [[(int(k), v["logprob"]) for k, v in (got[len(prompt) + j] or {}).items()] for j in range(len(answer))]


async def run_rescored_vllm(cfg: EndpointConfig, ref_cfg: EndpointConfig, prompts: list,
                            scorer: str = "auto") -> EndpointRun:
    """run_rescored for two vLLM servers: answers from the endpoint (vllm_answer), every
    token scored by the reference in one prompt_logprobs request per answer where asked."""
    conc = cfg.concurrency[0]
    api, ref = _Native(cfg, conc), _Native(ref_cfg, conc)
    sampler = sampler_settings("vllm")
    sem = asyncio.Semaphore(conc)

    async def one(p, model, ref_model) -> PromptResult:
        async with sem:
            try:
                r = await vllm_answer(api, model, p, cfg.chat, cfg.max_tokens, sampler)
                todo = [j for j in range(len(r.token_ids or [])) if scorer == REFERENCE
                        or (scorer == "auto" and not r.top[j])]
                if r.ok and todo:
                    scored = await vllm_score(ref, ref_model, r.prompt_ids, r.token_ids, sampler)
                    for j in todo:
                        r.top[j] = scored[j]
                        r.scored_by[j] = REFERENCE if scored[j] else None
                return r
            except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
                return PromptResult(p.id, p.slice, error=f"{type(e).__name__}: {e}")
    try:
        model = cfg.model or (await api.http.get("/v1/models")).json()["data"][0]["id"]
        ref_model = ref_cfg.model or (await ref.http.get("/v1/models")).json()["data"][0]["id"]
        before = await _endpoint_counters(api)
        t0 = time.perf_counter()
        results = list(await asyncio.gather(*(one(p, model, ref_model) for p in prompts)))
        wall = time.perf_counter() - t0
        after = await _endpoint_counters(api)
        spec = after.delta(before) if after is not None else None
    finally:
        await api.aclose()
        await ref.aclose()
    conventions = {ENDPOINT: logprob_convention("vllm", cfg.chat),
                   REFERENCE: logprob_convention("reference-prompt-logprobs", False)}
    return EndpointRun(cfg.base, model, "vllm", True, [LevelRun(conc, wall, results, spec)], conventions)


async def _endpoint_counters(api: _Native):
    """The endpoint's speculative counters now, once two scrapes agree (None without /metrics)."""
    last = None
    for _ in range(10):
        try:
            r = await api.http.get("/metrics")
        except httpx.HTTPError:
            return None
        now = _counters(r.text) if r.status_code == 200 else None
        if now is None or (last is not None and now.to_dict() == last.to_dict()):
            return now
        last = now
        await asyncio.sleep(0.2)
    return last


def rescored_sampled_run(cfg: EndpointConfig, ref_cfg: EndpointConfig, prompts: list, tokens: int,
                         concurrency: int, scorer: str = "auto", kind: str = "llama.cpp") -> EndpointRun:
    """sampled.sampled_run (the token budget, prompts in turn) with answers from run_rescored
    (two llama.cpp servers) or run_rescored_vllm (two vLLM servers)."""
    if scorer not in SCORERS:
        raise ValueError(f"scorer must be one of {SCORERS}, got {scorer!r}")
    rescored = run_rescored_vllm if kind == "vllm" else run_rescored

    def run(scfg: EndpointConfig, batch: list) -> EndpointRun:
        return asyncio.run(rescored(scfg, replace(ref_cfg, extra_body=None), batch, scorer))
    return sampled_run(cfg, kind, prompts, tokens, concurrency, run=run)
