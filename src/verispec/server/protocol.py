"""The OpenAI request bodies we accept, their validation, and OpenAI-style errors.

Types are strict (no "5" -> 5 coercion, no true -> 1); unknown fields are ignored as
OpenAI-compatible servers do; parameters we cannot honour answer 400 instead of
being silently dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..sampling import MIN_TEMPERATURE
from ..verify import LOSSY_RULES, RULES

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string: bounds the tail the stop matcher holds back
MAX_TEMPERATURE = 2.0  # OpenAI's range
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1  # what torch.Generator.manual_seed accepts


class OpenAIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unsupported(param: str, what: str | None = None) -> OpenAIError:
    return OpenAIError(400, f"{what or param} is not supported by verispec serve", param=param,
                       code="unsupported_parameter")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class VerispecOptions(BaseModel):
    """The extra body field ``"verispec": {...}``: per-request speculation override."""

    model_config = ConfigDict(strict=True, extra="forbid")
    speculate: Optional[bool] = None  # false: plain decoding for this request (k = 0)
    rule: Optional[str] = None  # a verification rule; see resolve_speculation


class StreamOptions(_Strict):
    include_usage: Optional[bool] = False


Number = Optional[float]


class _Common(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Number = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)  # 0, or >= MIN_TEMPERATURE
    top_p: Number = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=-1)  # vLLM extension; -1 or 0 = off; >= vocab = off
    min_p: Number = Field(default=None, ge=0.0, le=1.0)  # vLLM / llama.cpp extension; 0 = off
    n: Optional[int] = Field(default=None, ge=1)
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: Number = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Number = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict] = None
    user: Optional[str] = None
    ignore_eos: Optional[bool] = False  # vLLM extension: generate exactly max_tokens
    # vLLM / llama.cpp sampler extensions that verispec does not implement: refused unless
    # neutral, so that a client never gets a distribution other than the one it asked for
    repetition_penalty: Number = None
    typical_p: Number = None
    min_tokens: Optional[int] = None
    verispec: Optional[VerispecOptions] = None


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    # vLLM's extension: the target's logprob of every prompt token (after the first) and of
    # its `prompt_logprobs` likeliest alternatives; how an audit scores a text by this server
    prompt_logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list] = None
    response_format: Optional[dict] = None


def parse(model: type[BaseModel], body: dict) -> BaseModel:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        # a union reports the branch it tried ("prompt.str"); name the field the client sent
        param = loc[0] if loc else None
        where = ".".join(x for x in loc if x not in ("str", "list[int]", "list[str]", "list[list[int]]",
                                                        "list[TextPart]", "int", "float", "bool"))
        kind = err["type"]
        if kind == "missing":
            msg, code = f"missing required parameter '{where or param}'", "missing_required_parameter"
        else:
            msg = f"invalid value for '{where or param}': {err['msg']}"
            code = "invalid_type" if kind.endswith("_type") else "invalid_value"
        raise OpenAIError(400, msg, param=param, code=code) from None


def check_common(req: _Common) -> None:
    """Parameters that type-check but that verispec cannot honour."""
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "typical_p"):
        v = getattr(req, name)
        if v is not None and not math.isfinite(v):  # a JSON number like 1e999 parses as inf
            raise OpenAIError(400, f"'{name}' must be a finite number", param=name, code="invalid_value")
    t = req.temperature
    if t is not None and 0.0 < t < MIN_TEMPERATURE:
        raise OpenAIError(400, f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE} "
                               f"(got {t!r}); send 0 for greedy decoding", param="temperature",
                          code="invalid_value")
    if req.repetition_penalty not in (None, 1.0):
        raise unsupported("repetition_penalty", "repetition_penalty other than 1")
    if req.typical_p not in (None, 1.0):
        raise unsupported("typical_p", "typical_p other than 1 (locally typical sampling)")
    if req.min_tokens not in (None, 0):
        raise unsupported("min_tokens", "min_tokens other than 0")
    if req.n not in (None, 1):
        raise OpenAIError(400, "only n=1 is supported", param="n", code="unsupported_parameter")
    if req.presence_penalty or req.frequency_penalty:
        raise unsupported("presence_penalty" if req.presence_penalty else "frequency_penalty")
    if req.logit_bias:
        raise unsupported("logit_bias")
    stops = stop_list(req.stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise OpenAIError(400, f"at most {MAX_STOP_STRINGS} stop strings are supported", param="stop",
                          code="invalid_value")
    if any(s == "" for s in stops):
        raise OpenAIError(400, "stop strings must not be empty", param="stop", code="invalid_value")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise OpenAIError(400, f"stop strings may be at most {MAX_STOP_CHARS} characters long (one has "
                               f"{longest})", param="stop", code="invalid_value")


def top_k_of(req: _Common, vocab_size: int) -> int:
    """The engine's top_k (0 = off): -1 and 0 are off, and so is any k >= the vocabulary
    (it keeps every token), so an arbitrarily large integer never reaches a tensor op."""
    k = req.top_k or 0
    return 0 if k < 0 or k >= vocab_size else k


def stop_list(stop) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


MAX_TOP_LOGPROBS = 20


def _check_logprobs(req: _Common, top: int, param: str) -> None:
    """logprobs are the target's own (temperature 1, before top-k/top-p/min-p), scored by a
    teacher-forced pass over prompt + answer once the answer is complete; one per token
    emitted, so a stop string (which may end the text inside a token) is refused with them."""
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise OpenAIError(400, f"{param} must be between 0 and {MAX_TOP_LOGPROBS}, got {top}", param=param,
                          code="invalid_value")
    if stop_list(req.stop):
        raise unsupported(param, "logprobs together with stop strings")


def logprobs_wanted(req: _Common, chat: bool) -> int | None:
    """How many alternatives per token the request asked for (None: no logprobs)."""
    if chat:
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def check_completion(req: CompletionRequest) -> None:
    check_common(req)
    if req.logprobs is not None:
        _check_logprobs(req, req.logprobs, "logprobs")
    if req.echo:
        raise unsupported("echo")
    if req.prompt_logprobs is not None:
        if not 0 <= req.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise OpenAIError(400, f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got "
                                   f"{req.prompt_logprobs}", param="prompt_logprobs", code="invalid_value")
        if req.stream:
            raise unsupported("prompt_logprobs", "prompt_logprobs with stream")
    if req.best_of not in (None, 1):
        raise unsupported("best_of", "best_of > 1")
    if req.suffix:
        raise unsupported("suffix")


def check_chat(req: ChatRequest) -> None:
    check_common(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    if req.logprobs:
        _check_logprobs(req, req.top_logprobs or 0, "top_logprobs")
    if req.tools:
        raise unsupported("tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise unsupported("response_format", "structured output (response_format)")


# -- per-request speculation --------------------------------------------------------

@dataclass(frozen=True)
class Speculation:
    """What a request is served with: whether its row drafts, the rule that verifies it,
    and where its randomness comes from."""

    speculate: bool  # False: k = 0 for this row (plain decoding)
    rule: str  # the rule that verifies this row ("greedy" for temperature-0 rows)
    lossy: bool  # True only for typical-lossy with drafts on a sampled row
    keyed: bool = False  # noise keyed on (seed, position) (SamplingParams(coupled=True)), else a generator


def same_rule(resolved: str, engine_rule: str, speculate: bool) -> bool:
    """Whether the engine's rule for a row is the one the server resolved. A row that
    drafts nothing samples the target exactly with its generator under rejection and
    typical-lossy alike (neither has a draft token to judge), so those two agree there."""
    if resolved == engine_rule:
        return True
    return not speculate and {resolved, engine_rule} <= {"rejection", "typical-lossy"}


def resolve_speculation(server_rule: str, has_drafter: bool, temperature: float,
                        opts: VerispecOptions | None, seed: int | None = None) -> Speculation:
    """The per-request override. Honoured exactly or refused, never substituted:

    * speculate=false: the row drafts nothing; output is plain decoding.
    * temperature 0: the engine verifies greedy rows by argmax whatever the server rule,
      and every rule reduces to that, so any known rule is accepted; never lossy.
    * temperature > 0, no rule asked: a seeded request on a rejection or coupled server
      is sampled with noise keyed on (seed, position), verified by "coupled" (the same
      tokens with or without speculation); an unseeded one gets the server's rule
      (a coupled server keys it on a seed from OS entropy). A typical-lossy server
      applies its own rule to every sampled request, seeded or not (flagged lossy).
    * rule "coupled": keyed noise, so it needs a seed (400 without one), and a server
      whose rule is not typical-lossy (that one verifies every sampled row its own way).
    * rule "rejection": rejection sampling with a generator (seeded from the seed when
      there is one); on a typical-lossy server the row drafts nothing (k = 0), which
      samples the target exactly.
    * a lossy rule the server was not started with, "greedy" with temperature > 0, or
      any sampled request on a greedy server: refused (400).
    """
    opts = opts or VerispecOptions()
    speculate = has_drafter and opts.speculate is not False
    asked = opts.rule
    rule = asked if asked is not None else server_rule
    if rule not in RULES:
        raise OpenAIError(400, f"unknown verification rule {rule!r}; valid: {', '.join(RULES)}",
                          param="verispec.rule", code="invalid_value")
    if temperature == 0.0:
        return Speculation(speculate, "greedy", False)
    if server_rule == "greedy":
        raise OpenAIError(400, "this server verifies with rule 'greedy' (temperature 0 only); "
                               "send temperature 0 or start it with --verify rejection",
                          param="temperature", code="invalid_value")
    if rule == "greedy":
        raise OpenAIError(400, "rule 'greedy' verifies temperature-0 requests only; send temperature 0 "
                               "or use rule 'rejection'", param="verispec.rule", code="invalid_value")
    if rule in LOSSY_RULES and rule != server_rule:
        raise OpenAIError(400, f"lossy rule {rule!r} is not enabled on this server (it runs "
                               f"{server_rule!r}); start it with --verify {rule} to use it",
                          param="verispec.rule", code="invalid_value")
    if asked == "coupled":
        if seed is None:
            raise OpenAIError(400, "rule 'coupled' needs a seed: it samples with noise keyed on (seed, "
                                   "position); send \"seed\" or use rule 'rejection'",
                              param="verispec.rule", code="invalid_value")
        if server_rule in LOSSY_RULES:
            raise OpenAIError(400, f"rule 'coupled' is not available on this server: it runs the lossy "
                                   f"rule {server_rule!r} for every sampled request; use rule 'rejection' "
                                   f"(exact, no drafts here)", param="verispec.rule", code="invalid_value")
    if asked is None and server_rule != "typical-lossy" and (seed is not None or server_rule == "coupled"):
        rule = "coupled"
    if rule == "coupled":
        return Speculation(speculate, "coupled", False, keyed=True)
    if rule in LOSSY_RULES:  # the server's own rule
        return Speculation(speculate, rule, speculate)
    if server_rule in LOSSY_RULES:  # an exact rule on a lossy server: no drafts, so exact sampling
        return Speculation(False, rule, False)
    return Speculation(speculate, rule, False)
