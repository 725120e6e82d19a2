"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models,
/health and /metrics, on FastAPI.

`create_app(state)` takes a ServerState (or a function that makes one), so the engine,
the model and the tokenizer are injected: `verispec serve` builds them from presets,
tests from tiny random models. `make_server(state, ...)` wraps it in a uvicorn server
whose SIGTERM (or first Ctrl-C) drains: new requests get 503, those in flight finish
or, after `drain_timeout_s`, fail with 503 "server shutting down"; then it exits (0).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import math
import secrets
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from .. import __version__
from ..drafters.suffix_tree import scope_of
from ..engine import GenerationParams
from ..sampling import SamplingParams
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import Metrics
from .protocol import (
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    Speculation,
    check_chat,
    check_completion,
    logprobs_wanted,
    parse,
    resolve_speculation,
    stop_list,
    top_k_of,
)
from .worker import EngineWorker, RequestHandle, ServerRequest

log = logging.getLogger("verispec.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
# after the drain: what uvicorn then gives connections to finish writing (failed requests
# answer at once; this bounds a client that does not read its stream)
SHUTDOWN_GRACE_S = 5.0


@dataclass(frozen=True)
class ServerConfig:
    model_name: str  # the id clients send as "model"
    api_key: str | None = None  # when set, /v1/* and /metrics need "Authorization: Bearer <key>"
    # further keys, each a tenant of its own: a drafter that learns across requests (suffix
    # decoding's global cache) drafts for a request only from text sent with the same key
    more_api_keys: tuple[str, ...] = ()
    metrics_public: bool = False  # True: /metrics answers without the API key
    max_queue: int = 64  # requests waiting for a row beyond the running batch; more -> 429
    max_body_bytes: int = 4 * 2 ** 20
    drafter: str | None = None  # label shown in /v1/models, /metrics and responses
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's and tokenizer's EOS ids
    drain_timeout_s: float = 30.0  # SIGTERM: how long requests in flight may take to finish

    def __post_init__(self):
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if not (math.isfinite(self.drain_timeout_s) and self.drain_timeout_s >= 0):
            raise ValueError(f"drain_timeout_s must be a finite number >= 0, got {self.drain_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (None: no key)")
        if self.more_api_keys and self.api_key is None:
            raise ValueError("more_api_keys needs api_key (the first key)")
        if any(not k for k in self.more_api_keys):
            raise ValueError("an API key must not be empty")

    @property
    def api_keys(self) -> tuple[str, ...]:
        return () if self.api_key is None else (self.api_key, *self.more_api_keys)


class ServerState:
    """Everything a running server holds: the engine (owned by its worker thread), the
    tokenizer, configuration and metrics.

    The engine runs a PerRequestPolicy (worker.py) around the policy chosen, so that rows
    whose request says "speculate": false draft k = 0: whoever builds the engine wraps its
    policy before building it (cli/serve.py's build_state; tests' make_state)."""

    def __init__(self, engine, tokenizer, config: ServerConfig):
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.k = engine.policy.max_k if engine.drafter is not None else 0
        # "adaptive" (k is a cap) or "fixed"
        self.policy = engine.policy.name if self.k > 0 else "none"
        self.rule = engine.config.rule
        self.lossy = engine.config.lossy and self.k > 0
        self.max_len = engine.config.max_len
        self.vocab_size = engine.target.config.vocab_size
        if config.stop_token_ids is not None:
            self.stop_token_ids = tuple(config.stop_token_ids)
        else:
            eos = tuple(engine.target.config.eos_token_ids)
            tok_eos = getattr(tokenizer, "eos_token_id", None)
            self.stop_token_ids = tuple(dict.fromkeys(eos + ((tok_eos,) if tok_eos is not None else ())))
        # no token decodes to more characters than this: a longer text cannot fit the context
        self.max_token_chars = max(1, max(len(tokenizer.decode([i])) for i in range(self.vocab_size)))
        self.metrics = Metrics(config.model_name, {
            "drafter": config.drafter or ("none" if engine.drafter is None else engine.drafter.name),
            "k": str(self.k), "policy": self.policy, "rule": self.rule, "lossy": str(self.lossy).lower(),
            "max_batch": str(engine.config.max_batch), "max_len": str(self.max_len)})
        self.worker = EngineWorker(engine, self.metrics, config.max_queue)
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="verispec-tokenize")
        self._score_pool = ThreadPoolExecutor(1, thread_name_prefix="verispec-score")
        self.created = int(time.time())
        # shutdown (event loop only): draining refuses new requests; drain_expired also
        # refuses those that were still being tokenized when the drain timeout ran out
        self.draining = False
        self.drain_expired = False
        self.in_flight = 0  # generation requests from acceptance to their response's end

    def start(self) -> None:
        self.worker.start()

    def close(self) -> None:
        self.worker.stop()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # -- request checks ------------------------------------------------------------
    def authorize(self, request: Request) -> str | None:
        """Checks the request's key; -> its scope (a hash of the key, None without keys),
        which a drafter that learns across requests keeps each tenant's text apart by."""
        keys = self.config.api_keys
        if not keys:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise OpenAIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        sent = token.strip().encode()
        # every key compared, so the time taken does not say which key came close
        matched = [k for k in keys if hmac.compare_digest(sent, k.encode())]
        if not matched:
            raise OpenAIError(401, "incorrect API key provided", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
        return scope_of(matched[0])

    def check_open(self) -> None:
        """503 while the server drains (SIGTERM): it takes no new generation requests."""
        if self.draining:
            raise OpenAIError(503, "server shutting down: not accepting new requests", type="server_error",
                              code="server_shutting_down", headers={"Connection": "close", "Retry-After": "1"})

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests (503); give those in flight up to timeout_s seconds to finish,
        then fail the rest with 503 "server shutting down" and wait (bounded) for their
        answers to go out."""
        loop = asyncio.get_running_loop()
        self.draining = True
        log.warning("draining: %d request(s) in flight, up to %g s; new requests get 503",
                    self.in_flight, timeout_s)
        deadline = loop.time() + timeout_s
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            log.warning("drain timeout (%g s): failing %d request(s) still in flight", timeout_s, self.in_flight)
            self.drain_expired = True
            self.worker.fail_all((503, f"server shutting down: the request did not finish within the "
                                       f"{timeout_s:g} s drain timeout", "server_shutting_down"))
            deadline = loop.time() + SHUTDOWN_GRACE_S
            while self.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.05)
        log.warning("drained (%d request(s) still answering)", self.in_flight)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise OpenAIError(404, f"the model '{model}' does not exist; this server serves "
                                   f"'{self.config.model_name}'", param="model", code="model_not_found")

    # -- tokenization (one worker thread: off the event loop, one tokenizer user at a time) --
    async def _in_pool(self, fn: Callable, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def _check_text(self, text: str, param: str, n_chars: int | None = None) -> None:
        """Checks on the event loop before tokenizing (in the pool): valid Unicode, and a
        length that can fit the context. No token decodes to more than max_token_chars
        characters, so a text of n characters holds at least n / max_token_chars tokens;
        twice the context's worth is sure to exceed it (a normalizer may drop some
        characters), so it is refused without tokenizing (the body limit bounds the rest)."""
        if text and not text.isascii():  # ASCII holds no surrogate: skip the copy
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise OpenAIError(400, f"'{param}' is not valid Unicode (it holds a lone surrogate)",
                                  param=param, code="invalid_value") from None
        n = len(text) if n_chars is None else n_chars
        if n > 2 * self.max_len * self.max_token_chars:  # sure to exceed: skip tokenizing
            raise self.context_error(n // self.max_token_chars, None, param)

    async def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list):
            if len(prompt) == 0:
                raise OpenAIError(400, "'prompt' must not be empty", param="prompt", code="invalid_value")
            if isinstance(prompt[0], (str, list)):
                if len(prompt) != 1:
                    raise OpenAIError(400, "one prompt per request: batched prompts are not supported "
                                           "(send them as separate requests; the server batches them)",
                                      param="prompt", code="unsupported_parameter")
                prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise OpenAIError(400, "'prompt' must not be empty", param="prompt", code="invalid_value")
            self._check_text(prompt, "prompt")
            ids = list(await self._in_pool(lambda: self.tokenizer(prompt)["input_ids"]))
        else:
            ids = list(prompt)
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise OpenAIError(400, f"token ids must be in [0, {self.vocab_size})", param="prompt",
                                  code="invalid_value")
        if not ids:
            raise OpenAIError(400, "the prompt tokenizes to no tokens", param="prompt", code="invalid_value")
        return ids

    def _score(self, prompt_ids: list[int], token_ids: list[int], top: int) -> list[dict]:
        """The target's log-probabilities of each emitted token and its `top` likeliest
        alternatives (temperature 1, no top-k/top-p/min-p): one teacher-forced pass over
        prompt + answer in a fresh one-row cache (the engine's cache is not touched)."""
        import torch
        if not token_ids:
            return []
        target = self.engine.target
        ids = list(prompt_ids) + list(token_ids)
        cache = target.new_cache(1, len(ids))
        rows = cache.alloc()
        logits = target.forward(torch.tensor([ids[:-1]], dtype=torch.long), cache, rows)  # [1,T-1,V]
        lp = torch.log_softmax(logits[0, len(prompt_ids) - 1:].double(), dim=-1)  # [M,V]
        chosen = lp.gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1).tolist()  # sync: M floats
        top_v, top_i = lp.topk(top, dim=-1) if top else (lp[:, :0], lp[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()  # sync: M x top

        def entry(i: int, v: float) -> dict:
            text = self.tokenizer.decode([i])
            return {"id": i, "token": text, "logprob": v, "bytes": list(text.encode("utf-8"))}
        return [{**entry(t, c), "top_logprobs": [entry(i, v) for i, v in zip(ti, tv)]}
                for t, c, ti, tv in zip(token_ids, chosen, top_i, top_v)]

    async def score(self, prompt_ids: list[int], token_ids: list[int], top: int) -> list[dict]:
        return await asyncio.get_running_loop().run_in_executor(self._score_pool, self._score, prompt_ids,
                                                                token_ids, top)

    async def chat_ids(self, req: ChatRequest) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                              param="messages", code="unsupported_model")
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
            self._check_text(content, f"messages[{i}].content")
            messages.append({"role": m.role, "content": content})
        self._check_text("", "messages", n_chars=sum(len(m["content"]) for m in messages))

        def apply():
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

        try:
            return await self._in_pool(apply)
        except Exception as e:  # noqa: BLE001 - a template that refuses these messages
            raise OpenAIError(400, f"the chat template rejected the messages: {e}", param="messages",
                              code="invalid_value") from None

    def context_error(self, n_prompt: int, max_tokens: int | None, param: str) -> OpenAIError:
        """max_tokens None: the prompt alone is known to hold at least n_prompt tokens."""
        asks = (f"has more than {n_prompt} prompt tokens" if max_tokens is None else
                f"has {n_prompt} prompt tokens and asks for {max_tokens} new tokens ({n_prompt + max_tokens} in all)")
        return OpenAIError(400, f"this model's maximum context length is {self.max_len} tokens; the request "
                                f"{asks}. Shorten the prompt or reduce max_tokens.",
                           param=param, code="context_length_exceeded")


# -- HTTP plumbing -------------------------------------------------------------------

def _error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _discard_body(request: Request, limit: int, timeout_s: float = 5.0) -> None:
    """Read and drop the body of a request refused before it was parsed (401, or 503 while
    draining, which also closes the connection). Answering while the client is still
    sending its body, then closing, makes the kernel reset the connection, and the
    client loses the answer. Bounded: at most `limit` bytes, `timeout_s` seconds."""
    async def drain() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return

    try:
        await asyncio.wait_for(drain(), timeout_s)
    except (ClientDisconnect, asyncio.TimeoutError):
        pass


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> dict:
    ctype = request.headers.get("content-type")
    if ctype is None or ctype.split(";")[0].strip().lower() != "application/json":
        raise OpenAIError(415, f"Content-Type must be application/json (got {ctype!r})",
                          code="unsupported_media_type")
    clen = request.headers.get("content-length", "")
    too_large = OpenAIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    if clen.isdigit() and int(clen) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OpenAIError(400, f"the request body is not valid UTF-8 (byte {e.start})",
                          code="invalid_encoding") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise OpenAIError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno}, "
                               f"column {e.colno})", code="invalid_json") from None
    except (ValueError, RecursionError) as e:
        raise OpenAIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _SSE(StreamingResponse):
    """Server-sent events whose `on_close` callbacks run however the stream ends (done,
    error, client gone), so a disconnect always frees the row."""

    def __init__(self, content, on_close: Callable[[], None], headers: dict):
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.on_close = [on_close]

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for fn in self.on_close:
                fn()


class _CountResponses:
    """ASGI middleware: verispec_requests_total{endpoint, status}; 499 = client went away."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [None]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        failed = True
        try:
            await self.app(scope, receive, send_status)
            failed = False
        finally:  # no response started: 500 if the app raised (answered outside), else 499
            path = scope.get("path", "")
            self.metrics.http_response(path if path in ENDPOINTS else "other",
                                       status[0] or (500 if failed else 499))


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# -- the app -------------------------------------------------------------------------

def create_app(state: ServerState | Callable[[], ServerState]) -> FastAPI:
    """The app serving `state` (or the ServerState that calling `state` makes). Its routes
    are `router`'s: module-level handlers that find the state at `request.app.state.verispec`."""
    if not isinstance(state, ServerState):
        state = state()
    app = FastAPI(title="verispec", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.verispec = state
    _add_error_handlers(app)
    app.add_middleware(_CountResponses, metrics=state.metrics)
    app.include_router(router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    state: ServerState = app.state.verispec
    state.start()
    try:
        yield
    finally:
        state.close()


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, the framework's own included, answers with OpenAI's error body."""
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _server_error)


async def _openai_error(request: Request, e: OpenAIError) -> JSONResponse:
    return _error_response(e)


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return _error_response(OpenAIError(e.status_code, str(e.detail), code=code))


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    return _error_response(OpenAIError(400, str(e), code="invalid_value"))


async def _server_error(request: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return _error_response(OpenAIError(500, "internal server error", type="server_error"))


# -- routes --------------------------------------------------------------------------

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.verispec


@router.get("/health")
async def health(request: Request):
    state = _state(request)
    if state.draining:
        return JSONResponse({"status": "draining", "reason": "the server is shutting down"},
                            status_code=503)
    if not state.worker.alive:
        return JSONResponse({"status": "error", "reason": "the engine thread is not running"},
                            status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def metrics_text(request: Request):
    state = _state(request)
    if not state.config.metrics_public:
        state.authorize(request)
    return PlainTextResponse(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)


@router.get("/v1/models")
async def models(request: Request):
    state = _state(request)
    state.authorize(request)
    return {"object": "list", "data": [{
        "id": state.config.model_name, "object": "model", "created": state.created, "owned_by": "verispec",
        "max_model_len": state.max_len,
        "verispec": {"version": __version__, "drafter": state.metrics.info["drafter"], "k": state.k,
                     "policy": state.policy, "rule": state.rule, "lossy": state.lossy}}]}


@router.post("/tokenize")
async def tokenize(request: Request):
    """A text's token ids under the served model's tokenizer, as llama.cpp's and vLLM's
    /tokenize give them (the audit tokenizes outputs with the reference's own
    tokenizer): {"content" or "prompt": text, "add_special" / "add_special_tokens":
    bool, default false} -> {"tokens": [...], "count": n}; or, as vLLM's, {"messages":
    [...]} -> the ids of the chat template with the generation prompt, as a chat request
    would be prefilled."""
    state = _state(request)
    state.authorize(request)
    body = await read_json(request, state.config.max_body_bytes)  # a JSON object
    if "messages" in body:
        chat = parse(ChatRequest, {"messages": body["messages"]})
        ids = await state.chat_ids(chat)
        return {"tokens": ids, "count": len(ids)}
    text = body.get("content", body.get("prompt"))
    if not isinstance(text, str):
        raise OpenAIError(400, "'content' (or 'prompt') must be a string", param="content",
                          code="invalid_value")
    special = body.get("add_special", body.get("add_special_tokens", False))
    if not isinstance(special, bool):
        raise OpenAIError(400, "'add_special' must be a boolean", param="add_special", code="invalid_value")
    state._check_text(text, "content", None)
    ids = list(await state._in_pool(lambda: state.tokenizer(text, add_special_tokens=special)["input_ids"]))
    return {"tokens": ids, "count": len(ids)}


@router.post("/v1/completions")
async def completions(request: Request):
    return await _tracked(request, _completions)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await _tracked(request, _chat_completions)


# -- generation ----------------------------------------------------------------------

async def _tracked(request: Request, handler) -> Response:
    """Generation requests: refused while draining, else counted in flight until
    their answer is complete (a stream: until it closes). handler(state, request, scope),
    scope: the tenant that authorize() found the request's key to be."""
    state = _state(request)
    try:
        scope = state.authorize(request)
        state.check_open()
    except OpenAIError:
        await _discard_body(request, state.config.max_body_bytes)
        raise
    state.in_flight += 1
    try:
        response = await handler(state, request, scope)
    except BaseException:
        state.in_flight -= 1
        raise
    if isinstance(response, _SSE):
        response.on_close.append(functools.partial(_request_done, state))
    else:
        state.in_flight -= 1
    return response


def _request_done(state: ServerState) -> None:
    state.in_flight -= 1


async def _completions(state: ServerState, request: Request, scope: str | None) -> Response:
    req = parse(CompletionRequest, await read_json(request, state.config.max_body_bytes))
    check_completion(req)
    state.check_model(req.model)
    ids = await state.prompt_ids(req.prompt)
    max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    return await _generate(state, request, scope, req, ids, max_tokens, chat=False)


async def _chat_completions(state: ServerState, request: Request, scope: str | None) -> Response:
    req = parse(ChatRequest, await read_json(request, state.config.max_body_bytes))
    check_chat(req)
    state.check_model(req.model)
    ids = await state.chat_ids(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:  # OpenAI's chat default: whatever the context leaves
        max_tokens = max(1, state.max_len - len(ids))
    return await _generate(state, request, scope, req, ids, max_tokens, chat=True)


async def _generate(state: ServerState, request: Request, scope: str | None, req, ids: list[int],
                    max_tokens: int, chat: bool) -> Response:
    """One generation request, in phases: 1. it fits the context; 2. its speculation and
    sampling are settled; 3. the engine thread takes it; 4. its answer streams, or is
    awaited and answered whole."""
    # 1. fits the context
    if len(ids) + max_tokens > state.max_len:
        param = "messages" if chat else "prompt"
        raise state.context_error(len(ids), max_tokens, "max_tokens" if len(ids) < state.max_len else param)
    # 2. speculation and sampling
    spec, params = _settle(state, req, max_tokens)
    handle = RequestHandle(ServerRequest(ids, params, speculate=spec.speculate, scope=scope), state.tokenizer,
                           stop_list(req.stop), asyncio.get_running_loop(), rule=spec.rule)
    # 3. into the engine
    _submit(state, handle)
    # 4. the answer
    headers = {"x-verispec-lossy": "true"} if spec.lossy else {}
    meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
            "model": state.config.model_name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _SSE(_stream(state, handle, meta, spec, chat, ids, include_usage, logprobs_wanted(req, chat)),
                    handle.cancel, headers)
    if not await _answered(request, handle):
        return Response(status_code=499)  # the client is gone; nobody reads this
    if handle.finish_reason == "error":
        raise _engine_error(handle)
    return JSONResponse(await _completion_body(state, req, ids, handle, spec, meta, chat), headers=headers)


def _settle(state: ServerState, req, max_tokens: int) -> tuple[Speculation, GenerationParams]:
    """The request's speculation (resolve_speculation) and generation parameters; what
    the engine's own checks refuse is the client's error (400)."""
    temperature = 1.0 if req.temperature is None else req.temperature
    spec = resolve_speculation(state.rule, state.engine.drafter is not None, temperature, req.verispec,
                               seed=req.seed)
    seed = req.seed
    if seed is None and temperature > 0 and state.rule == "coupled":
        # a coupled engine keys every sampled row on a seed: give it one from OS entropy
        # here, so that the rule resolved above (coupled, or rejection if asked) is the
        # one the engine runs
        seed = secrets.randbits(63)
    try:
        sampling = SamplingParams(temperature=temperature, top_k=top_k_of(req, state.vocab_size),
                                  top_p=1.0 if req.top_p is None else req.top_p,
                                  min_p=0.0 if req.min_p is None else req.min_p,
                                  seed=seed, coupled=spec.keyed)
        params = GenerationParams(max_new_tokens=max_tokens, sampling=sampling,
                                  stop_token_ids=() if req.ignore_eos else state.stop_token_ids,
                                  ignore_eos=bool(req.ignore_eos))
    except ValueError as e:
        raise OpenAIError(400, f"invalid sampling parameters: {e}", code="invalid_value") from None
    return spec, params


def _submit(state: ServerState, handle: RequestHandle) -> None:
    """Hands the request to the engine thread, or refuses it: 503 once the drain has timed
    out or while the engine thread is down, 429 at capacity."""
    if state.drain_expired:
        raise OpenAIError(503, "server shutting down: not accepting new requests", type="server_error",
                          code="server_shutting_down", headers={"Connection": "close"})
    if not state.worker.alive:
        raise OpenAIError(503, "the engine thread is not running", type="server_error", code="engine_down")
    if not state.worker.try_submit(handle):
        raise OpenAIError(429, f"the server is at capacity ({state.engine.config.max_batch} running, "
                               f"{state.config.max_queue} queued); retry later",
                          type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})


async def _answered(request: Request, handle: RequestHandle) -> bool:
    """Waits for the request's end or the client's disconnect, then frees its row;
    False: the client is gone (or the request was cancelled) before the end."""
    try:
        waiter = asyncio.ensure_future(handle.wait())
        watcher = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            watcher.cancel()
        return handle.finish_reason is not None and handle.finish_reason != "cancelled"
    finally:
        handle.cancel()  # a no-op when the engine already let go of the request


def _engine_error(handle: RequestHandle) -> OpenAIError:
    """The error a request that ended with finish_reason "error" answers with."""
    status, message, code = handle.error
    return OpenAIError(status, message, type="server_error" if status >= 500 else "invalid_request_error",
                       code=code)


def _usage(n_prompt: int, handle: RequestHandle) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": handle.completion_tokens,
            "total_tokens": n_prompt + handle.completion_tokens}


async def _completion_body(state: ServerState, req, ids: list[int], handle: RequestHandle, spec: Speculation,
                           meta: dict, chat: bool) -> dict:
    """The whole answer of a request that was not streamed."""
    top = logprobs_wanted(req, chat)
    lps = _logprobs_object(await state.score(ids, handle.token_ids, top), chat) if top is not None else None
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": handle.text},
                  "logprobs": lps, "finish_reason": handle.finish_reason}
    else:
        choice = {"index": 0, "text": handle.text, "logprobs": lps, "finish_reason": handle.finish_reason}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = [None] + [_prompt_logprob(e) for e in await state.score(
                ids[:1], ids[1:], req.prompt_logprobs)]
    return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
            "usage": _usage(len(ids), handle), "verispec": _verispec_info(state, spec, handle)}


def _verispec_info(state: ServerState, spec: Speculation, handle: RequestHandle) -> dict:
    return {"speculate": spec.speculate, "rule": spec.rule, "lossy": spec.lossy,
            "drafter": state.metrics.info["drafter"] if spec.speculate else None,
            "k": state.k if spec.speculate else 0, **handle.stats.to_dict()}


async def _stream(state: ServerState, handle: RequestHandle, meta: dict, spec: Speculation, chat: bool,
                  prompt_ids: list[int], include_usage: bool, top: int | None):
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, first: bool = False, logprobs=None, **extra) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return _sse({**meta, "object": obj, "choices": [choice], **extra})

    if chat:
        yield chunk(None, None, first=True)
    while True:
        kind, value = await handle.events.get()
        if kind == "text":
            yield chunk(value, None)
            continue
        if value == "error":
            yield _sse(_engine_error(handle).body())
        elif value != "cancelled":
            if top is not None:  # scored once the answer is complete: one chunk, every token
                yield chunk(None, None, logprobs=_logprobs_object(
                    await state.score(prompt_ids, handle.token_ids, top), chat))
            yield chunk(None, value, verispec=_verispec_info(state, spec, handle))
            if include_usage:
                yield _sse({**meta, "object": obj, "choices": [], "usage": _usage(len(prompt_ids), handle)})
        yield "data: [DONE]\n\n"
        return


def _prompt_logprob(e: dict) -> dict:
    """vLLM's prompt_logprobs entry: {token id: {logprob, rank, decoded_token}} for the
    scored token and its likeliest alternatives (rank 1: the most probable)."""
    out = {str(t["id"]): {"logprob": t["logprob"], "rank": r, "decoded_token": t["token"]}
           for r, t in enumerate(e["top_logprobs"], 1)}
    # outside the listed alternatives: the scored token is listed too, its rank not computed
    out.setdefault(str(e["id"]), {"logprob": e["logprob"], "rank": None, "decoded_token": e["token"]})
    return out


def _logprobs_object(entries: list[dict], chat: bool) -> dict:
    """OpenAI's logprobs object: chat {"content": [...]}; completions the legacy lists."""
    if chat:
        return {"content": entries}
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "token_ids": [e["id"] for e in entries]}


# -- running it ----------------------------------------------------------------------

def make_server(state: ServerState, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """A uvicorn server for `state` whose SIGTERM drains (see ServerState.drain) and then
    exits normally; a second signal stops at once, as uvicorn does. Run it with
    `.run(sockets=...)`; `.started` and `.should_exit` are uvicorn's."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self, config):
            super().__init__(config)
            self._loop: asyncio.AbstractEventLoop | None = None
            self._draining = False

        async def serve(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets=sockets)

        def handle_exit(self, sig, frame):
            # the first SIGTERM/SIGINT once serving: drain, then exit as if asked to (not
            # re-raised at the end, so the exit status is 0). Before start-up, or a second
            # signal: uvicorn's own handling (stop now).
            if self._draining or not self.started or self.should_exit or self._loop is None:
                if self._draining:
                    self.force_exit = True
                return super().handle_exit(sig, frame)
            self._draining = True
            log.warning("received %s: draining", signal.Signals(sig).name)
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

        async def _drain(self):
            try:
                await state.drain(state.config.drain_timeout_s)
            finally:
                self.should_exit = True

    config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    return DrainingServer(config)
