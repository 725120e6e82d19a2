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
        assert c.get("/health").json() == {"status": "ok"}
        ok = c.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200
        assert idle(wait_metrics(s.url, idle))
