"""Request lifecycle on a live server with a deliberately slow tiny target (a sleep per
forward pass): 429 when the queue is full, disconnects (streaming or not) free the row,
stop strings free the row, a failing engine step fails only its batch."""

import asyncio
import time

import httpx
import pytest

from tests.server.helpers import MODEL, LiveServer, make_state, metric

LONG = {"model": MODEL, "prompt": "abc", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


def wait_metrics(url: str, cond, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics").text
        if cond(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def idle(text: str) -> bool:
    return all(metric(text, n) == 0 for n in ("verispec_cache_rows_in_use", "verispec_num_requests_running",
                                              "verispec_num_requests_waiting"))


@pytest.fixture(scope="module")
def server():
    # 1 row + 1 queued = capacity 2; each forward sleeps 20 ms, so LONG lasts >= 4 s
    with LiveServer(make_state(drafter="draft", k=2, max_batch=1, max_queue=1, delay_s=0.02)) as s:
        yield s


def test_queue_full_answers_429_and_recovers(server):
    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            async with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r1:
                lines = r1.aiter_lines()  # keep the iterator: dropping it would close the stream
                assert r1.status_code == 200 and (await lines.__anext__()).startswith("data: ")
                async with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r2:
                    assert r2.status_code == 200  # queued behind the running row
                    r3 = await c.post("/v1/completions", json=LONG)
                    assert r3.status_code == 429
                    assert r3.json()["error"]["code"] == "queue_full" and r3.headers["retry-after"] == "1"
                    for _ in range(100):  # gauges are published by the engine thread after each step
                        text = (await c.get("/metrics")).text
                        if metric(text, "verispec_num_requests_waiting") == 1:
                            break
                        await asyncio.sleep(0.05)
                    assert metric(text, "verispec_num_requests_waiting") == 1
                    assert metric(text, "verispec_cache_rows_in_use") == 1
        # both streams were closed mid-way: their rows and queue places are free again
    asyncio.run(go())
    text = wait_metrics(server.url, idle)
    assert idle(text)
    assert metric(text, "verispec_requests_total", status="429") >= 1
    r = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 3}, timeout=30)
    assert r.status_code == 200


def test_non_stream_disconnect_frees_the_row(server):
    before = metric(httpx.get(server.url + "/metrics").text, "verispec_request_finish_total", reason="cancelled")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.5))
    text = wait_metrics(server.url, lambda t: idle(t) and metric(
        t, "verispec_request_finish_total", reason="cancelled") > before)
    assert idle(text)
    assert metric(text, "verispec_request_finish_total", reason="cancelled") == before + 1
    assert metric(text, "verispec_requests_total", endpoint="/v1/completions", status="499") >= 1


def test_stream_disconnect_frees_the_row(server):
    before = metric(httpx.get(server.url + "/metrics").text, "verispec_request_finish_total", reason="cancelled")
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                "ignore_eos": True, "temperature": 0, "stream": True}) as r:
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data: ")
                if n == 3:
                    break
    text = wait_metrics(server.url, lambda t: idle(t) and metric(
        t, "verispec_request_finish_total", reason="cancelled") > before)
    assert idle(text)
    assert metric(text, "verispec_request_finish_total", reason="cancelled") == before + 1


def test_stop_string_frees_the_row(server):
    full = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 12}, timeout=30).json()
    text = full["choices"][0]["text"]
    stop = text[3:5]
    r = httpx.post(server.url + "/v1/completions", json={**LONG, "stop": stop}, timeout=30).json()
    assert r["choices"][0] == {"index": 0, "text": text[:text.find(stop)], "logprobs": None, "finish_reason": "stop"}
    m = wait_metrics(server.url, idle)
    assert idle(m) and metric(m, "verispec_request_finish_total", reason="stop") >= 1


class FailingTarget:
    """The tiny target, except that a forward pass containing token `bad` raises."""

    def __init__(self, inner, bad):
        self.inner, self.bad, self.config = inner, bad, inner.config

    def new_cache(self, *a, **kw):
        return self.inner.new_cache(*a, **kw)

    def forward(self, tokens, *a, **kw):
        if bool((tokens == self.bad).any()):
            raise RuntimeError("injected failure")
        return self.inner.forward(tokens, *a, **kw)


@pytest.mark.parametrize("prompt", ["ab~", "a~bc"], ids=["fails-in-verify", "fails-in-prefill"])
def test_a_failing_step_fails_its_batch_and_the_server_goes_on(prompt):
    state = make_state(drafter="lookup", max_batch=2)
    state.engine.target = FailingTarget(state.engine.target, bad=ord("~") - 32)  # any forward holding "~"
    with LiveServer(state) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert r.json()["error"]["code"] == "generation_failed" and "injected failure" in r.json()["error"]["message"]
        assert c.get("/health").json() == {"status": "ok"}
        ok = c.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200
        assert idle(wait_metrics(s.url, idle))


class NaNTarget:
    """The tiny target, except that rows whose input holds token `bad` get NaN logits."""

    def __init__(self, inner, bad):
        self.inner, self.bad, self.config = inner, bad, inner.config

    def new_cache(self, *a, **kw):
        return self.inner.new_cache(*a, **kw)

    def forward(self, tokens, *a, **kw):
        logits = self.inner.forward(tokens, *a, **kw)
        rows = (tokens == self.bad).any(-1)  # [B]
        return logits.masked_fill(rows[:, None, None], float("nan")) if bool(rows.any()) else logits


def test_a_row_with_non_finite_logits_fails_alone():
    """The engine ends a row whose logits are not finite with finish_reason "error"; the
    worker answers that request 500 (a stream: an error event), counts it, and the rows
    decoding beside it finish equal to plain decoding."""
    import json

    from tests.server.helpers import CharTokenizer, reference_text
    good = [("abc", 40), ("hello there", 30)]
    refs = [reference_text(p, n) for p, n in good]
    tok = CharTokenizer()
    bad = next(c for c in "~}|{`^" if all(c not in t for t, _ in refs))  # a character no good row emits
    state = make_state(drafter="lookup", max_batch=4, delay_s=0.01)
    state.engine.target = NaNTarget(state.engine.target, bad=tok.encode(bad)[0])

    async def go(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async def stream(prompt, n, temperature):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": temperature, "stream": True}
                events = []
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                return events

            async def post(prompt, n, temperature):
                return await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": n,
                                                            "temperature": temperature})
            return await asyncio.gather(
                stream(good[0][0], good[0][1], 0), post(good[1][0], good[1][1], 0),
                post("xy" + bad, 8, 0), post("zz" + bad, 8, 1.0), stream("q" + bad, 8, 0.7))

    with LiveServer(state) as s:
        before = metric(httpx.get(s.url + "/metrics").text, "verispec_request_finish_total", reason="error")
        s0, p1, bad_greedy, bad_sampled, bad_stream = asyncio.run(go(s.url))
        text0 = "".join(json.loads(e)["choices"][0]["text"] for e in s0[:-1] if json.loads(e).get("choices"))
        assert s0[-1] == "[DONE]" and (text0, json.loads(s0[-2])["choices"][0]["finish_reason"]) == refs[0]
        assert p1.status_code == 200
        assert (p1.json()["choices"][0]["text"], p1.json()["choices"][0]["finish_reason"]) == refs[1]
        for r in (bad_greedy, bad_sampled):
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["type"] == "server_error" and err["code"] == "generation_failed"
            assert "not finite" in err["message"] and "other requests were not affected" in err["message"]
        assert bad_stream[-1] == "[DONE]"
        err = json.loads(bad_stream[-2])["error"]
        assert err["code"] == "generation_failed" and "not finite" in err["message"]
        m = wait_metrics(s.url, idle)
        assert idle(m)
        assert metric(m, "verispec_request_finish_total", reason="error") == before + 3
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}
