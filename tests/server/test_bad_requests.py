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
    ("temperature below the floor", "POST", C, body(temperature=0.001), {}, 400, "temperature", "invalid_value"),
    ("temperature 1e-39", "POST", C, body(temperature=1e-39), {}, 400, "temperature", "invalid_value"),
    ("temperature 2.5", "POST", C, body(temperature=2.5), {}, 400, "temperature", "invalid_value"),
    ("temperature 1e999 (inf)", "POST", C, b'{"model": "tiny", "prompt": "x", "temperature": 1e999}', {}, 400,
     "temperature", "invalid_value"),
    ("temperature NaN as a string", "POST", C, body(temperature="NaN"), {}, 400, "temperature", "invalid_type"),
    ("top_p 2", "POST", C, body(top_p=2), {}, 400, "top_p", "invalid_value"),
    ("top_p 0", "POST", C, body(top_p=0), {}, 400, "top_p", "invalid_value"),
    ("top_p -1e999", "POST", C, b'{"model": "tiny", "prompt": "x", "top_p": -1e999}', {}, 400, "top_p",
     "invalid_value"),
    ("top_k -2", "POST", C, body(top_k=-2), {}, 400, "top_k", "invalid_value"),
    ("top_k is a float", "POST", C, body(top_k=2.5), {}, 400, "top_k", "invalid_type"),
    ("min_p 1.5", "POST", C, body(min_p=1.5), {}, 400, "min_p", "invalid_value"),
    ("min_p -0.1", "POST", C, body(min_p=-0.1), {}, 400, "min_p", "invalid_value"),
    ("repetition_penalty", "POST", C, body(repetition_penalty=1.2), {}, 400, "repetition_penalty",
     "unsupported_parameter"),
    ("min_tokens", "POST", C, body(min_tokens=5), {}, 400, "min_tokens", "unsupported_parameter"),
    ("stop string too long", "POST", C, body(stop=["x" * 257]), {}, 400, "stop", "invalid_value"),
    ("too many stop strings", "POST", C, body(stop=[str(i) for i in range(17)]), {}, 400, "stop",
     "invalid_value"),
    ("seed below int64", "POST", C, body(seed=-(2 ** 63) - 1), {}, 400, "seed", "invalid_value"),
    ("seed above uint64", "POST", C, body(seed=2 ** 64), {}, 400, "seed", "invalid_value"),
    ("rule coupled without a seed", "POST", C, body(temperature=0.7, verispec={"rule": "coupled"}), {}, 400,
     "verispec.rule", "invalid_value"),
    ("n=2", "POST", C, body(n=2), {}, 400, "n", "unsupported_parameter"),
    ("stop is a number", "POST", C, body(stop=123), {}, 400, "stop", "invalid_type"),
    ("stop list holds a number", "POST", C, body(stop=["a", 1]), {}, 400, "stop", "invalid_type"),
    ("empty stop string", "POST", C, body(stop=""), {}, 400, "stop", "invalid_value"),
    ("stream is a string", "POST", C, body(stream="yes"), {}, 400, "stream", "invalid_type"),
    ("seed is a string", "POST", C, body(seed="abc"), {}, 400, "seed", "invalid_type"),
    ("seed out of range", "POST", C, body(seed=2 ** 70), {}, 400, "seed", "invalid_value"),
    ("logprobs above 20", "POST", C, body(logprobs=21), {}, 400, "logprobs", "invalid_value"),
    ("logprobs with a stop string", "POST", C, body(logprobs=2, stop="x"), {}, 400, "logprobs",
     "unsupported_parameter"),
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
    ("metrics without API key", "GET", "/metrics", None, {"Authorization": None}, 401, None, "invalid_api_key"),
    ("metrics with a wrong API key", "GET", "/metrics", None, {"Authorization": "Bearer sk-wrong"}, 401, None,
     "invalid_api_key"),
    ("chat: missing messages", "POST", CHAT, chat(messages=...), {}, 400, "messages",
     "missing_required_parameter"),
    ("chat: empty messages", "POST", CHAT, chat(messages=[]), {}, 400, "messages", "invalid_value"),
    ("chat: unknown role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), {}, 400,
     "messages", "invalid_value"),
    ("chat: content is a number", "POST", CHAT, chat(messages=[{"role": "user", "content": 3}]), {}, 400,
     "messages", "invalid_type"),
    ("chat: messages is a string", "POST", CHAT, chat(messages="hi"), {}, 400, "messages", "invalid_type"),
    ("chat: n=2", "POST", CHAT, chat(n=2), {}, 400, "n", "unsupported_parameter"),
    ("chat: top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), {}, 400, "top_logprobs",
     "invalid_value"),
    ("chat: top_logprobs above 20", "POST", CHAT, chat(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs",
     "invalid_value"),
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


@pytest.mark.parametrize("params", [
    {"temperature": 0.01}, {"temperature": 2}, {"temperature": 1, "top_k": 10 ** 30}, {"temperature": 1, "top_k": -1},
    {"temperature": 1, "min_p": 1}, {"temperature": 1, "min_p": 0.2, "top_p": 1e-9}, {"seed": -(2 ** 63)},
    {"seed": 2 ** 64 - 1, "temperature": 0.5}, {"stop": ["x" * 256] * 16}, {"repetition_penalty": 1},
], ids=str)
def test_edges_that_are_valid(http, params):
    """The edges of each valid range are served (a huge top_k keeps every token)."""
    r = http.post(C, json=body(**params), headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_still_serving_after_the_table(http):
    r = http.post(C, json=OK, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    m = http.get("/metrics", headers=AUTH).text
    assert 'status="400"' in m and 'status="401"' in m and 'status="404"' in m


class CountingTokenizer:
    """The character tokenizer, counting the characters it is asked to tokenize."""

    def __init__(self, inner):
        self.inner, self.chars = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, text):
        self.chars += len(text)
        return self.inner(text)

    def apply_chat_template(self, messages, **kw):
        self.chars += sum(len(m["content"]) for m in messages)
        return self.inner.apply_chat_template(messages, **kw)


class BlockingTokenizer(CountingTokenizer):
    """Holds the tokenizing thread until the test lets it go, so that "the event loop
    answers while a prompt is tokenized" is checked without any timing."""

    def __init__(self, inner):
        super().__init__(inner)
        import threading
        self.started, self.release = threading.Event(), threading.Event()

    def _hold(self):
        self.started.set()
        assert self.release.wait(30), "the test never released the tokenizer"

    def __call__(self, text):
        self._hold()
        return super().__call__(text)

    def apply_chat_template(self, messages, **kw):
        self._hold()
        return super().apply_chat_template(messages, **kw)


def test_a_large_prompt_never_blocks_the_event_loop():
    """A 2.5 MB prompt that passes the length guard (here: tokens up to 10,000 characters
    long) is tokenized off the event loop: while its tokenizer is held mid-call, /health
    answers (were it tokenized on the loop, the probe would time out). Then the tokenizer
    is let go and the prompt is refused (too long)."""
    import threading
    state = make_state(drafter=None, max_len=MAX_LEN)
    state.tokenizer = tok = BlockingTokenizer(state.tokenizer)
    state.max_token_chars = 10_000  # 2 * 128 * 10,000 chars: the guard lets 2.5 MB through
    prompt = "abcdefghij" * 250_000
    with LiveServer(state) as s, httpx.Client(base_url=s.url, timeout=5) as c:
        result = {}

        def big():
            result["r"] = httpx.post(s.url + C, json=body(prompt=prompt), timeout=60)
        t = threading.Thread(target=big, daemon=True)
        t.start()
        try:
            assert tok.started.wait(30), "the prompt never reached the tokenizer"
            for _ in range(3):  # the tokenizer is held: the loop must still answer
                assert c.get("/health").json() == {"status": "ok"}
            assert not tok.release.is_set() and t.is_alive()
        finally:
            tok.release.set()
        t.join(60)
        r = result["r"]
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert tok.chars >= len(prompt)


def test_the_length_guard_refuses_without_tokenizing():
    state = make_state(drafter=None, max_len=MAX_LEN)
    state.tokenizer = CountingTokenizer(state.tokenizer)
    with LiveServer(state) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        r = c.post(C, json=body(prompt="x" * 3_000_000))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        # many messages, each short enough alone, too long together
        msgs = [{"role": "user", "content": "y" * (MAX_LEN * state.max_token_chars)}] * 8
        r = c.post(CHAT, json=chat(messages=msgs))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["param"] == "messages"
        assert state.tokenizer.chars == 0
