"""Audit any OpenAI-compatible endpoint (verispec serve, llama.cpp, vLLM, SGLang, ...) from outside.

An async client (httpx) sends the suite's prompts at temperature 0, at each load level
(number of concurrent clients), and records per prompt: the text, finish reason, token
counts, latency and time to first token; with `logprobs=True`, the chosen tokens'
log-probabilities and top-2 margins where the server returns them. Around each level it
scrapes the server's Prometheus /metrics and reports the speculative-decoding counters
that llama.cpp, vLLM and verispec expose, as differences over the level (SGLang's gauges
are sampled during it); each answer's own speculative fields are kept (counters.py).
A request that fails (HTTP error, refused, cut mid-stream, junk in the stream) is recorded
with its error; nothing here raises for one bad answer.

    run = audit_endpoint(EndpointConfig("http://127.0.0.1:8000"), prompts)
    ref = audit_endpoint(EndpointConfig("http://127.0.0.1:8000", concurrency=(1,),
                                        extra_body={"verispec": {"speculate": False}}), prompts)
    rows = null.compare(ref.levels[0].results, run.levels[-1].results, 8).rows  # per prompt, vs the reference

For speed, `audit_paired(cfg, ref_cfg, prompts)` times the endpoint and its reference side
by side (alternating waves of requests, see run_paired), so that a speedup is a ratio of
two measurements taken moments apart, not of two runs minutes apart.

The comparison is on text: OpenAI responses carry no token ids. Nothing here knows the
model; the offline audit's report is built from these records by the audit package.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Iterable

import httpx

from .counters import MetricsParseError, SpecCounters, response_spec, server_kind, spec_counters

# -- the client ----------------------------------------------------------------------------

@dataclass(frozen=True)
class EndpointConfig:
    url: str  # the server's base URL, with or without a trailing /v1
    model: str | None = None  # None: the first id in /v1/models
    api_key: str | None = None
    chat: bool = True  # /v1/chat/completions (the server applies its chat template) or /v1/completions
    max_tokens: int = 64
    concurrency: tuple[int, ...] = (1, 8)  # load levels: concurrent clients
    logprobs: bool = False  # ask for logprobs (top_logprobs alternatives); dropped if the server refuses them
    top_logprobs: int = 2
    temperature: float = 0.0  # 0: greedy; > 0 with `sampler` holding every other sampler setting
    sampler: dict | None = None  # sent as is (top_k, top_p, min_p, penalties, ...: explicit, server by server)
    timeout_s: float = 300.0
    extra_body: dict | None = None  # e.g. {"verispec": {"speculate": False}}: the reference on one server

    @property
    def base(self) -> str:
        u = self.url.rstrip("/")
        return u[:-3] if u.endswith("/v1") else u


@dataclass
class PromptResult:
    id: str
    slice: str
    text: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_s: float | None = None  # request sent -> last byte
    ttft_s: float | None = None  # request sent -> first text
    error: str | None = None  # "HTTP 400: ..." or "ReadTimeout: ..."
    tokens: list[str] | None = None  # token texts, where the server returns logprobs
    token_logprobs: list[float] | None = None  # chosen tokens' logprobs, likewise
    top2_margins: list[float | None] | None = None  # logprob(top1) - logprob(top2) per token
    token_ids: list[int | None] | None = None  # the emitted tokens' ids where the server gives them
    top: list[list[tuple]] | None = None  # per token: [(id or token text, logprob), ...] as returned
    server_info: dict | None = None  # the response's speculative fields (counters.response_spec), if any
    scored_by: list[str | None] | None = None  # per token: whose logprobs are in `top` (rescore.py), if known
    prompt_ids: list[int] | None = None  # the prompt as the server tokenized it, where it says (rescore.py)
    # where the response has no speculative fields (vLLM): the endpoint's /metrics counters'
    # difference over this request alone, read around it (run_paired at concurrency 1),
    # in response_spec's form
    counter_spec: dict | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class LevelRun:
    concurrency: int
    wall_s: float
    results: list[PromptResult]
    spec: SpecCounters | None  # counters over this level only (differences)
    waves: list[list[int]] | None = None  # run_paired: the prompts (indices) of each wave, timed together
    wave_walls: list[float] | None = None  # run_paired: each wave's wall time, in the order of `waves`

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens or 0 for r in self.results if r.ok)

    def summary(self) -> dict:
        lat = [r.latency_s for r in self.results if r.ok and r.latency_s is not None]
        ttft = [r.ttft_s for r in self.results if r.ok and r.ttft_s is not None]
        return {"concurrency": self.concurrency, "requests": len(self.results),
                "errors": sum(not r.ok for r in self.results), "wall_s": self.wall_s,
                "completion_tokens": self.completion_tokens,
                "tokens_per_s": self.completion_tokens / self.wall_s if self.wall_s else None,
                "latency_p50_s": statistics.median(lat) if lat else None,
                "latency_p95_s": _quantile(lat, 0.95), "ttft_p50_s": statistics.median(ttft) if ttft else None,
                "spec": self.spec.to_dict() if self.spec else None, "waves": self.waves,
                "wave_walls": self.wave_walls}


@dataclass
class EndpointRun:
    url: str
    model: str
    kind: str  # "verispec" | "vllm" | "sglang" | "unknown" (from /metrics)
    logprobs: bool  # whether the server returned logprobs
    levels: list[LevelRun]
    conventions: dict | None = None  # scorer -> sampled.Convention of its top-n lists (the T > 0 check)

    def to_dict(self) -> dict:
        return {"url": self.url, "model": self.model, "kind": self.kind, "logprobs": self.logprobs,
                "levels": [{**lv.summary(), "results": [asdict(r) for r in lv.results]} for lv in self.levels]}


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class _LogprobsRefused(Exception):
    pass


class EndpointClient:
    def __init__(self, cfg: EndpointConfig):
        self.cfg = cfg
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.http = httpx.AsyncClient(base_url=cfg.base, headers=headers, timeout=cfg.timeout_s,
                                      limits=httpx.Limits(max_connections=max(cfg.concurrency) + 4))
        self.logprobs = cfg.logprobs

    async def aclose(self):
        await self.http.aclose()

    async def model(self) -> str:
        if self.cfg.model:
            return self.cfg.model
        r = await self.http.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    async def metrics(self) -> str | None:
        try:
            r = await self.http.get("/metrics")
        except httpx.HTTPError:
            return None
        return r.text if r.status_code == 200 else None

    def _body(self, model: str, prompt: str) -> tuple[str, dict]:
        body = {"model": model, "max_tokens": self.cfg.max_tokens, "temperature": self.cfg.temperature,
                "stream": True, "stream_options": {"include_usage": True}, **(self.cfg.sampler or {}),
                **(self.cfg.extra_body or {})}
        if self.cfg.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            if self.logprobs:
                body.update(logprobs=True, top_logprobs=self.cfg.top_logprobs)
            return "/v1/chat/completions", body
        body["prompt"] = prompt
        if self.logprobs:
            body["logprobs"] = self.cfg.top_logprobs
        return "/v1/completions", body

    async def complete(self, model: str, pid: str, slice_: str, prompt: str) -> PromptResult:
        """One streamed request; a refusal of logprobs switches them off and retries once."""
        try:
            return await self._complete(model, pid, slice_, prompt)
        except _LogprobsRefused:
            self.logprobs = False
            return await self._complete(model, pid, slice_, prompt)

    async def _complete(self, model, pid, slice_, prompt) -> PromptResult:
        """One streamed request read chunk by chunk into its PromptResult; what goes wrong is
        the result's error (a refusal of logprobs raises _LogprobsRefused)."""
        res = PromptResult(pid, slice_)
        path, body = self._body(model, prompt)
        got = _Streamed(time.perf_counter())
        try:
            async with self.http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    detail = (await r.aread()).decode("utf-8", "replace")
                    if r.status_code == 400 and self.logprobs and "logprobs" in detail:
                        raise _LogprobsRefused()
                    res.error = f"HTTP {r.status_code}: {detail[:500]}"
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    error = self._take_chunk(res, data, got)
                    if error is not None:
                        res.error = error
                        return res
        except (httpx.HTTPError, httpx.StreamError) as e:  # refused, reset, cut mid-stream, timed out
            res.error = f"{type(e).__name__}: {e}"
            return res
        if res.finish_reason is None:
            res.error = "the stream ended without a finish reason (connection cut?)"
            return res
        res.latency_s = time.perf_counter() - got.t0
        res.text = "".join(got.parts)
        if got.lps:
            res.tokens, res.token_logprobs, res.top2_margins = got.toks, got.lps, got.margins
            res.token_ids, res.top = got.ids, got.tops
        return res

    def _take_chunk(self, res: PromptResult, data: str, got: "_Streamed") -> str | None:
        """One stream chunk's fields into res and got; -> why it ends the answer in error
        (None: the stream goes on)."""
        try:
            obj = json.loads(data)
        except ValueError:
            return f"malformed stream chunk: {data[:200]!r}"
        if not isinstance(obj, dict):
            return f"malformed stream chunk: {data[:200]!r}"
        if "error" in obj:
            return f"stream error: {obj['error']}"
        if obj.get("prompt_token_ids"):  # vLLM, asked for return_token_ids
            res.prompt_ids = list(obj["prompt_token_ids"])
        if obj.get("usage"):
            res.prompt_tokens = obj["usage"].get("prompt_tokens")
            res.completion_tokens = obj["usage"].get("completion_tokens")
        spec = response_spec(obj)
        if spec is not None:
            res.server_info = spec
        for ch in obj.get("choices") or []:
            text = (ch.get("delta") or {}).get("content") if self.cfg.chat else ch.get("text")
            if text:
                if res.ttft_s is None:
                    res.ttft_s = time.perf_counter() - got.t0
                got.parts.append(text)
            if ch.get("prompt_token_ids"):  # vLLM completions put them in the choice
                res.prompt_ids = list(ch["prompt_token_ids"])
            if ch.get("finish_reason"):
                res.finish_reason = ch["finish_reason"]
            _collect_logprobs(ch.get("logprobs"), self.cfg.chat, got.toks, got.lps, got.margins, got.ids, got.tops)
        return None


@dataclass
class _Streamed:
    """What a streamed answer has sent so far: its text in parts and, per token, its text,
    logprob, top-2 margin, id and listed alternatives (_collect_logprobs)."""

    t0: float  # when the request was sent
    parts: list[str] = field(default_factory=list)
    toks: list = field(default_factory=list)
    lps: list = field(default_factory=list)
    margins: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    tops: list = field(default_factory=list)


TOKEN_ID_PREFIX = "token_id:"  # vLLM's token text under return_tokens_as_token_ids


def token_key(token):
    """A listed token's key: its id where the server wrote one as "token_id:N" (vLLM asked for
    ids), else the token as given (an id or a text)."""
    if isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX) and token[len(TOKEN_ID_PREFIX):].isdigit():
        return int(token[len(TOKEN_ID_PREFIX):])
    return token


def _collect_logprobs(lp, chat: bool, toks: list, lps: list, margins: list, ids: list, tops: list) -> None:
    """Chat: {"content": [{"token", "logprob", "id"?, "top_logprobs": [{"token", "logprob", "id"?}]}]};
    completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "token_ids"?}.
    A token is keyed by its id where the server gives one (llama.cpp and verispec as "id",
    vLLM as "token_id:N" texts when asked), else by its text."""
    if not lp:
        return
    if chat:
        for item in lp.get("content") or []:
            tok = item.get("token") or ""
            key = token_key(tok)
            toks.append(tok)
            lps.append(item.get("logprob"))
            ids.append(item.get("id", key if isinstance(key, int) else None))
            top = [(t.get("id", token_key(t.get("token"))), t.get("logprob")) for t in item.get("top_logprobs") or []]
            tops.append(top)
            vals = sorted((v for _, v in top if v is not None), reverse=True)
            margins.append(vals[0] - vals[1] if len(vals) >= 2 else None)
    else:
        tl, texts, tids = lp.get("top_logprobs") or [], lp.get("tokens") or [], lp.get("token_ids") or []
        for i, v in enumerate(lp.get("token_logprobs") or []):
            tok = texts[i] if i < len(texts) else ""
            key = token_key(tok)
            toks.append(tok)
            lps.append(v)
            ids.append(tids[i] if i < len(tids) else key if isinstance(key, int) else None)
            top = [(token_key(k), x) for k, x in (tl[i] or {}).items()] if i < len(tl) else []
            tops.append(top)
            vals = sorted((x for _, x in top if x is not None), reverse=True)
            margins.append(vals[0] - vals[1] if len(vals) >= 2 else None)


async def run_endpoint(cfg: EndpointConfig, prompts: Iterable, on_result=None) -> EndpointRun:
    """Every prompt at every load level. prompts: objects with .id, .slice, .prompt
    (audit.suite.SuitePrompt). on_result(level, PromptResult) is called as answers arrive."""
    prompts = list(prompts)
    client = EndpointClient(cfg)
    try:
        model, kind = await _open(client)
        levels = []
        for conc in cfg.concurrency:
            before = _counters(await client.metrics())
            results: list[PromptResult | None] = [None] * len(prompts)
            todo = iter(range(len(prompts)))  # shared: each prompt is taken by one worker

            async def worker(level: int, todo, results: list) -> None:
                for i in todo:
                    p = prompts[i]
                    results[i] = await client.complete(model, p.id, p.slice, p.prompt)
                    if on_result is not None:
                        on_result(level, results[i])

            sampler = _start_gauges(client, before)
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(conc, todo, results) for _ in range(min(conc, len(prompts)) or 1)))
            wall = time.perf_counter() - t0
            levels.append(LevelRun(conc, wall, results, await _level_counters(client, before, sampler, results)))
        return EndpointRun(cfg.base, model, kind, client.logprobs, levels)
    finally:
        await client.aclose()


async def run_paired(cfg: EndpointConfig, ref_cfg: EndpointConfig, prompts: Iterable,
                     reference_first: bool = False) -> tuple[EndpointRun, EndpointRun]:
    """The endpoint and its reference timed side by side, for speedups that drift cancels in.

    At each level c (cfg.concurrency; the reference runs at the same levels) the prompts go
    in waves of c consecutive prompts, each wave's requests started together: the wave to
    the endpoint, then the same wave to the reference, the order alternating wave by wave
    (reference_first: the reference leads the first wave, so a repeat flips every wave's
    order). Whatever slows the machine for a while (other jobs, a throttled core) then
    slows both halves of a pair alike and cancels in their ratio, and an order effect (the
    second request of a pair finding caches warm) cancels over the waves. Never both at
    once: a wave has the machine to itself. A level's wall time is the sum of its waves',
    per side; each wave's own is kept (LevelRun.wave_walls).

    A server shared by both (a verispec endpoint with speculation switched off per
    request) has its /metrics read around each of the endpoint's own waves, so that the
    reference's requests are not in the endpoint's counters; separate servers are read
    around the level. At concurrency 1 a wave is one request: where its response carries
    no speculative fields (vLLM), the endpoint's counters read around the wave are that
    request's own, kept as its PromptResult.counter_spec (separate servers are then read
    around each wave too, until a response carries its own fields or a page has no
    counters). Every GET (/v1/models, /metrics) goes through a client of its own: a POST
    right after a GET on the same keep-alive connection waits ~40 ms for a delayed ACK,
    which would land in the timing of the request after each scrape. Returns (endpoint
    run, reference run)."""
    prompts = list(prompts)
    clients = [EndpointClient(cfg), EndpointClient(replace(ref_cfg, concurrency=cfg.concurrency))]
    scrapers = [EndpointClient(c.cfg) for c in clients]
    try:
        sides = _Sides(clients, scrapers, [await _open(c) for c in scrapers], cfg.base == ref_cfg.base)
        levels: list[list[LevelRun]] = [[], []]
        for conc in cfg.concurrency:
            for s, level in enumerate(await _paired_level(sides, prompts, conc, reference_first)):
                levels[s].append(level)
        return tuple(EndpointRun(c.cfg.base, model, kind, c.logprobs, lv)
                     for c, (model, kind), lv in zip(clients, sides.opened, levels))
    finally:
        for c in clients + scrapers:
            await c.aclose()


@dataclass(frozen=True)
class _Sides:
    """run_paired's two sides (0: the endpoint, 1: its reference): the clients that send the
    requests, those that read /metrics, and each server's (model id, kind)."""

    clients: list[EndpointClient]
    scrapers: list[EndpointClient]
    opened: list[tuple[str, str]]
    shared: bool  # one server for both: counters read around each wave, else around the level


@dataclass
class _Pairing:
    """One level of run_paired as its waves run, per side: the answers, each wave's wall
    time, and the counters summed over the waves (a shared server)."""

    results: list[list[PromptResult | None]]
    walls: list[list[float]]
    total: list[SpecCounters | None]
    per_request: bool  # the endpoint's counters still read around each of its one-request waves


async def _paired_level(sides: _Sides, prompts: list, conc: int, reference_first: bool) -> tuple[LevelRun, LevelRun]:
    """One level of run_paired: the prompts in waves of conc, each wave to both sides, the
    order alternating wave by wave; -> (the endpoint's level, the reference's)."""
    n = len(prompts)
    lv = _Pairing([[None] * n, [None] * n], [[], []], [None, None], conc == 1)
    before = [None if sides.shared else _counters(await c.metrics()) for c in sides.scrapers]
    samplers = [None if sides.shared else _start_gauges(c, b) for c, b in zip(sides.scrapers, before)]
    waves = [range(i, min(i + conc, n)) for i in range(0, n, conc)]
    for w, wave in enumerate(waves):
        for s in ((0, 1) if (w % 2 == 0) != reference_first else (1, 0)):
            await _paired_wave(sides, lv, s, prompts, wave)
    out = []
    for s in (0, 1):
        spec = lv.total[s] if sides.shared else await _level_counters(sides.scrapers[s], before[s], samplers[s],
                                                                      lv.results[s])
        out.append(LevelRun(conc, sum(lv.walls[s]), lv.results[s], spec, [list(w) for w in waves], lv.walls[s]))
    return out[0], out[1]


async def _paired_wave(sides: _Sides, lv: _Pairing, s: int, prompts: list, wave: range) -> None:
    """One wave's requests to side s, started together and timed together; the counters read
    around them where the server is shared, and the endpoint's around each request at
    concurrency 1."""
    client, scraper, (model, _) = sides.clients[s], sides.scrapers[s], sides.opened[s]
    read = sides.shared or (lv.per_request and s == 0)
    b = _counters(await scraper.metrics()) if read else None
    t0 = time.perf_counter()
    got = await asyncio.gather(*(client.complete(model, prompts[i].id, prompts[i].slice, prompts[i].prompt)
                                 for i in wave))
    lv.walls[s].append(time.perf_counter() - t0)
    for i, r in zip(wave, got):
        lv.results[s][i] = r
    if not read:
        return
    d = await _level_counters(scraper, b, None, got)
    if sides.shared:
        lv.total[s] = _plus(lv.total[s], d)
    if lv.per_request and s == 0:
        _attach_counters(got[0], b, d)
        # separate servers: no further scrapes where they tell nothing new (no counters,
        # answers with their own fields, gauges)
        lv.per_request = sides.shared or not (b is None or got[0].server_info is not None
                                              or (d is not None and d.from_gauges))


def _attach_counters(r: PromptResult, before: SpecCounters | None, d: SpecCounters | None) -> None:
    """r.counter_spec from the counters' difference d over r alone, where r's response has no
    speculative fields and d counts drafts (not SGLang's gauges)."""
    if not r.ok or r.server_info is not None or before is None or d is None or d.from_gauges \
            or d.draft_tokens is None:
        return

    def n(x):
        return None if x is None else int(round(x))
    r.counter_spec = {"source": d.source, "drafted": n(d.draft_tokens), "accepted": n(d.accepted_tokens),
                      "verify_steps": n(d.drafts), "target_passes": n(d.target_passes)}


async def _open(client: "EndpointClient") -> tuple[str, str]:
    """(model id, server kind by its /metrics) of a client's server."""
    model = await client.model()
    first = await client.metrics()
    return model, (server_kind(first) if first is not None else "unknown")


def _start_gauges(client: "EndpointClient", before: SpecCounters | None):
    """SGLang: gauges move with each batch, so sample them while a level runs (else None)."""
    if before is not None and before.from_gauges:
        return asyncio.create_task(_sample_gauges(client, before.gauge_samples))
    return None


async def _level_counters(client: "EndpointClient", before: SpecCounters | None, sampler,
                         results: list[PromptResult] | None = None) -> SpecCounters | None:
    """The counters' differences since `before`, once settled (None without counters);
    `results`: the answers of the interval, whose tokens the counters must have counted."""
    if sampler is not None:
        sampler.cancel()
    expect = None
    if results is not None and all(r.ok and r.completion_tokens is not None for r in results):
        expect = sum(r.completion_tokens for r in results)
    after = await _settled_counters(client, before, expect)
    if after is not None and before is not None:
        after.gauge_samples = before.gauge_samples
    return after.delta(before) if after else None


def _plus(a: SpecCounters | None, b: SpecCounters | None) -> SpecCounters | None:
    """The sum of two intervals' counter differences (None + x = x)."""
    if a is None or b is None:
        return b if a is None else a
    return a.plus(b)


GAUGE_SAMPLE_S = 0.5


async def _sample_gauges(client: "EndpointClient", out: list) -> None:
    """Append SGLang's acceptance gauges every GAUGE_SAMPLE_S while a level runs."""
    t0 = time.perf_counter()
    while True:
        c = _counters(await client.metrics())
        if c is not None:
            out.append({"t_s": round(time.perf_counter() - t0, 2), "accept_length": c.accept_length_gauge,
                        "accept_rate": c.accept_rate_gauge})
        await asyncio.sleep(GAUGE_SAMPLE_S)


async def _settled_counters(client: "EndpointClient", before: SpecCounters | None = None,
                            expect_tokens: int | None = None, tries: int = 10,
                            wait_s: float = 0.2) -> SpecCounters | None:
    """The counters once two scrapes in a row agree: llama.cpp adds a request's counts when
    its slot is released, which can come just after the last byte of its answer. At once
    when the generated-token counter has moved by `expect_tokens` since `before` (the
    answers' own usage): llama.cpp, vLLM and verispec add the speculative counts with
    (or before) the generated tokens, so all of them are in."""
    last = _counters(await client.metrics())
    if (last is not None and before is not None and expect_tokens is not None
            and last.generation_tokens is not None and before.generation_tokens is not None
            and last.generation_tokens - before.generation_tokens == expect_tokens):
        return last
    for _ in range(tries):
        if last is None:
            return None
        await asyncio.sleep(wait_s)
        now = _counters(await client.metrics())
        if now is not None and now.to_dict() == last.to_dict():
            return now
        last = now
    return last


def _counters(page: str | None) -> SpecCounters | None:
    """The page's speculative counters; None when there is no page, no counters, or a page
    that is not Prometheus text (the audit then reports the figures as unavailable)."""
    try:
        return spec_counters(page) if page else None
    except MetricsParseError:
        return None


def audit_endpoint(cfg: EndpointConfig, prompts: Iterable, on_result=None) -> EndpointRun:
    """Synchronous wrapper of run_endpoint."""
    return asyncio.run(run_endpoint(cfg, prompts, on_result))


def audit_paired(cfg: EndpointConfig, ref_cfg: EndpointConfig, prompts: Iterable,
                 reference_first: bool = False) -> tuple[EndpointRun, EndpointRun]:
    """Synchronous wrapper of run_paired: (endpoint run, reference run)."""
    return asyncio.run(run_paired(cfg, ref_cfg, prompts, reference_first))


def first_divergence(a: str, b: str) -> int | None:
    """Index of the first differing character (None when equal)."""
    if a == b:
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
