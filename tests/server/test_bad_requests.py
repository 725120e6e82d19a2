"""A table of bad requests: each gets the right status and an OpenAI-style error body,
and the server stays healthy (and still answers a good request) after each."""

import json

import httpx
import pytest

from tests.server.helpers import MODEL, LiveServer, make_state

KEY = "sk-test-key"
MAX_LEN = 128
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}
C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0}
MSG = [{"role": "user", "content": "hi"}]


def body(**kw):
    out = {**OK, **kw}
    return {k: v for k, v in out.items() if v is not ...}


def chat(**kw):
    out = {"model": MODEL, "messages": MSG, "max_tokens": 4, **kw}
    return {k: v for k, v in out.items() if v is not ...}


# (name, method, path, payload: dict (sent as JSON) | bytes (raw), extra headers, status, param, code)
CASES = [
    ("not JSON", "POST", C, b"{not json", {}, 400, None, "invalid_json"),
    ("invalid UTF-8", "POST", C, b'{"prompt": "\xff\xfe"}', {}, 400, None, "invalid_encoding"),
    ("JSON array body", "POST", C, b"[1, 2]", {}, 400, None, "invalid_json"),
    ("NaN literal", "POST", C, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', {}, 400, None,
     "invalid_json"),
    ("deeply nested JSON", "POST", C, b"[" * 100_000 + b"]" * 100_000, {}, 400, None, "invalid_json"),
    ("wrong content type", "POST", C, json.dumps(OK).encode(), {"Content-Type": "text/plain"}, 415, None,
     "unsupported_media_type"),
    ("body too large", "POST", C, json.dumps(body(prompt="a" * 5_000_000)).encode(), {}, 413, None,
     "request_too_large"),
    ("missing prompt", "POST", C, body(prompt=...), {}, 400, "prompt", "missing_required_parameter"),
    ("prompt is a number", "POST", C, body(prompt=5), {}, 400, "prompt", "invalid_type"),
    ("empty prompt", "POST", C, body(prompt=""), {}, 400, "prompt", "invalid_value"),
    ("empty prompt list", "POST", C, body(prompt=[]), {}, 400, "prompt", "invalid_value"),
    ("batched prompts", "POST", C, body(prompt=["a", "b"]), {}, 400, "prompt", "unsupported_parameter"),
    ("token id out of vocabulary", "POST", C, body(prompt=[1, 2, 10_000]), {}, 400, "prompt", "invalid_value"),
    ("lone surrogate in prompt", "POST", C, b'{"prompt": "a\\ud800b", "max_tokens": 2}', {}, 400, "prompt",
     "invalid_value"),
    ("max_tokens is a string", "POST", C, body(max_tokens="5"), {}, 400, "max_tokens", "invalid_type"),
    ("max_tokens is a float", "POST", C, body(max_tokens=5.5), {}, 400, "max_tokens", "invalid_type"),
    ("negative max_tokens", "POST", C, body(max_tokens=-3), {}, 400, "max_tokens", "invalid_value"),
    ("zero max_tokens", "POST", C, body(max_tokens=0), {}, 400, "max_tokens", "invalid_value"),
    ("max_tokens over the context", "POST", C, body(max_tokens=MAX_LEN), {}, 400, "max_tokens",
     "context_length_exceeded"),
    ("huge prompt", "POST", C, body(prompt="word " * 2000), {}, 400, "prompt", "context_length_exceeded"),
    ("temperature -1", "POST", C, body(temperature=-1), {}, 400, "temperature", "invalid_value"),
    ("temperature is a string", "POST", C, body(temperature="hot"), {}, 400, "temperature", "invalid_type"),
    ("temperature is a bool", "POST", C, body(temperature=True), {}, 400, "temperature", "invalid_type"),
    ("top_p 2", "POST", C, body(top_p=2), {}, 400, "top_p", "invalid_value"),
    ("top_p 0", "POST", C, body(top_p=0), {}, 400, "top_p", "invalid_value"),
    ("n=2", "POST", C, body(n=2), {}, 400, "n", "unsupported_parameter"),
    ("stop is a number", "POST", C, body(stop=123), {}, 400, "stop", "invalid_type"),
    ("stop list holds a number", "POST", C, body(stop=["a", 1]), {}, 400, "stop", "invalid_type"),
    ("empty stop string", "POST", C, body(stop=""), {}, 400, "stop", "invalid_value"),
    ("stream is a string", "POST", C, body(stream="yes"), {}, 400, "stream", "invalid_type"),
    ("seed is a string", "POST", C, body(seed="abc"), {}, 400, "seed", "invalid_type"),
    ("seed out of range", "POST", C, body(seed=2 ** 70), {}, 400, "seed", "invalid_value"),
    ("logprobs", "POST", C, body(logprobs=2), {}, 400, "logprobs", "unsupported_parameter"),
    ("echo", "POST", C, body(echo=True), {}, 400, "echo", "unsupported_parameter"),
    ("unknown rule", "POST", C, body(verispec={"rule": "fast"}), {}, 400, "verispec.rule", "invalid_value"),
    ("lossy rule not enabled", "POST", C, body(temperature=0.5, verispec={"rule": "typical-lossy"}), {}, 400,
     "verispec.rule", "invalid_value"),
    ("unknown verispec field", "POST", C, body(verispec={"speculat": False}), {}, 400, "verispec", "invalid_value"),
    ("unknown model", "POST", C, body(model="gpt-4"), {}, 404, "model", "model_not_found"),
    ("missing API key", "POST", C, OK, {"Authorization": None}, 401, None, "invalid_api_key"),
    ("wrong API key", "POST", C, OK, {"Authorization": "Bearer sk-wrong"}, 401, None, "invalid_api_key"),
    ("not a bearer token", "POST", C, OK, {"Authorization": f"Basic {KEY}"}, 401, None, "invalid_api_key"),
    ("models without API key", "GET", "/v1/models", None, {"Authorization": None}, 401, None, "invalid_api_key"),
    ("chat: missing messages", "POST", CHAT, chat(messages=...), {}, 400, "messages",
     "missing_required_parameter"),
    ("chat: empty messages", "POST", CHAT, chat(messages=[]), {}, 400, "messages", "invalid_value"),
    ("chat: unknown role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), {}, 400,
     "messages", "invalid_value"),
    ("chat: content is a number", "POST", CHAT, chat(messages=[{"role": "user", "content": 3}]), {}, 400,
     "messages", "invalid_type"),
    ("chat: messages is a string", "POST", CHAT, chat(messages="hi"), {}, 400, "messages", "invalid_type"),
    ("chat: n=2", "POST", CHAT, chat(n=2), {}, 400, "n", "unsupported_parameter"),
    ("chat: logprobs", "POST", CHAT, chat(logprobs=True), {}, 400, "logprobs", "unsupported_parameter"),
    ("chat: huge conversation", "POST", CHAT, chat(messages=[{"role": "user", "content": "x" * 500}]), {}, 400,
     "messages", "context_length_exceeded"),
    ("unknown route", "POST", "/v1/embeddings", OK, {}, 404, None, "not_found"),
    ("wrong method", "GET", C, None, {}, 405, None, "method_not_allowed"),
]


@pytest.fixture(scope="module")
def http():
    with LiveServer(make_state(drafter="draft", k=3, max_len=MAX_LEN, api_key=KEY)) as s:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            yield c


def test_table_is_large_enough():
    assert len(CASES) >= 20


@pytest.mark.parametrize("name,method,path,payload,headers,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_bad_request(http, name, method, path, payload, headers, status, param, code):
    h = {**JSON, **AUTH, **headers}
    h = {k: v for k, v in h.items() if v is not None}
    if isinstance(payload, dict):
        payload = json.dumps(payload).encode()
    r = http.request(method, path, content=payload, headers=h)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert (err["param"], err["code"]) == (param, code), err
    assert http.get("/health").json() == {"status": "ok"}


def test_still_serving_after_the_table(http):
    r = http.post(C, json=OK, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    m = http.get("/metrics").text
    assert 'status="400"' in m and 'status="401"' in m and 'status="404"' in m
