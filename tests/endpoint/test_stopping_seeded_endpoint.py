"""The stopping and seeded checks from outside (audit/stopping.py, audit/seeded.py, endpoint
halves) against a live tiny verispec server: a correct server passes both; a proxy in front of
it that breaks a promise the way real servers did fails each. The proxy corrupts only the
endpoint's own requests (those without "verispec": {"speculate": false}), so the reference
(the same server with speculation off) stays correct, as a deployment's plain server would:

* stop-leak (sgl-project/sglang#31599): the stop strings are dropped, so the text goes on past them;
* max-tokens-overrun: a few tokens more than max_tokens are asked for;
* seed-ignored (vllm-project/vllm#17498, #6038): the seed is dropped, so each answer is a fresh draw."""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse
from starlette.routing import Route

from tests.server.helpers import LiveServer, Served, make_state
from verispec.audit.endpoint.runner import EndpointAuditConfig, run_endpoint_audit
from verispec.audit.registry import SEEDED, STOPPING
from verispec.audit.stopping import CUT_LAST
from verispec.audit.suite import SuitePrompt

PROMPTS = [SuitePrompt(f"s{i}", "x", t) for i, t in enumerate(["abc abc abc abc", "the quick brown fox"])]


def _corrupting_proxy(upstream: str, corrupt):
    """Every request forwarded to upstream; a POST body of the endpoint's own passes through corrupt(body)."""
    async def handle(request):
        body = await request.body()
        if request.method == "POST" and body:
            obj = json.loads(body)
            if (obj.get("verispec") or {}).get("speculate") is not False:
                body = json.dumps(corrupt(obj)).encode()
        client = httpx.AsyncClient(base_url=upstream, timeout=120)
        r = await client.send(client.build_request(request.method, request.url.path, content=body,
                                                   headers={"content-type": "application/json"}), stream=True)

        async def close():
            await r.aclose()
            await client.aclose()
        return StreamingResponse(r.aiter_raw(), status_code=r.status_code,
                                 media_type=r.headers.get("content-type"), background=BackgroundTask(close))
    return Starlette(routes=[Route("/{path:path}", handle, methods=["GET", "POST"])])


def _drop(key):
    return lambda body: {k: v for k, v in body.items() if k != key}


def _overrun(body):
    """A limit inside the answer (the cuts' own, at most stopping.CUT_LAST) overshot by 3 tokens."""
    return {**body, "max_tokens": body["max_tokens"] + 3} if body.get("max_tokens", 99) <= CUT_LAST else body


@pytest.fixture(scope="module")
def server():
    with LiveServer(make_state(drafter="draft", k=3, max_batch=4)) as good:
        yield good


def _check(url: str, name: str) -> dict:
    report = run_endpoint_audit(EndpointAuditConfig(url, only=(name,), max_tokens=48, concurrency=(1, 4)), PROMPTS)
    return next(c for c in report["checks"] if c["name"] == name)


@pytest.mark.parametrize("name", [STOPPING.name, SEEDED.name])
def test_a_correct_server_passes(server, name):
    c = _check(server.url, name)
    assert c["status"] == "pass", c["summary"]
    if name == STOPPING.name:
        f = c["figures"]
        assert f["cases_stop_string"] > 0 and f["cases_max_tokens"] > 0 and f["judged"] > 0 and f["wrong"] == 0
        assert f["sides"] == ["endpoint c=1", "endpoint c=4"] and f["drafted"] > 0
    else:
        assert c["figures"]["drafts_verified"] > 0 and c["figures"]["divergences"] == 0
        assert [r["batch"] for r in c["details"]["per_config"]] == [1, 4]


@pytest.mark.parametrize("corrupt, why", [(_drop("stop"), "the stop string is in the text"),
                                          (_overrun, "tokens for max_tokens")])
def test_a_server_that_mishandles_stops_fails(server, corrupt, why):
    with Served(_corrupting_proxy(server.url, corrupt)) as proxy:
        c = _check(proxy.url, STOPPING.name)
    assert c["status"] == "fail", c["summary"]
    assert c["figures"]["wrong"] > 0
    assert any(why in r["why"] for r in c["details"]["wrong"]), c["details"]["wrong"]


def test_a_server_that_ignores_seeds_fails(server):
    with Served(_corrupting_proxy(server.url, _drop("seed"))) as proxy:
        c = _check(proxy.url, SEEDED.name)
    assert c["status"] == "fail", c["summary"]
    alone = c["details"]["per_config"][0]
    assert not alone["passed"] and alone["divergence"] > 1


def test_a_seed_promise_is_stated_per_kind():
    from types import SimpleNamespace

    from verispec.audit.seeded import _seed_promise
    kind = lambda k, rule=None: SimpleNamespace(info=SimpleNamespace(kind=k, speculative={"rule": rule}))  # noqa: E731
    assert _seed_promise(kind("vllm")) and _seed_promise(kind("verispec", "rejection"))
    assert _seed_promise(kind("verispec", "typical-lossy")) is None and _seed_promise(kind("tgi")) is None
