"""The speedup floor from outside, against stand-in servers that answer as vLLM does (no
speculative fields in a response, counters in /metrics): acceptance per request from the
counters' difference guides the search, the edits that defeat the stand-in's drafter are
found and confirmed side by side, and --min-speedup gates on the interval."""

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from starlette.responses import PlainTextResponse, StreamingResponse

from tests.endpoint.test_fake_llama_cpp import _serve
from verispec.audit.endpoint.runner import run_endpoint_audit
from verispec.audit.floor import FloorBudget
from verispec.audit.report import render_markdown
from verispec.audit.suite import SuitePrompt

TOKENS = 8
PROMPTS = [SuitePrompt(f"{s}-{i}", s, f"{s} question {i}: describe the parser and its cache in detail")
           for s in ("code", "chat", "math") for i in range(2)]
# the stand-in drafter loses on the edits aimed at it: another script, or a trap phrase
DEFEATED = ("Write your whole answer in", "more lines of the form", "Never reuse", "Do not quote", "Restate each")


def defeated(prompt: str) -> bool:
    return any(m in prompt for m in DEFEATED)


def fake_vllm(speculative: bool) -> FastAPI:
    app = FastAPI()
    counts = {"gen": 0, "drafts": 0, "draft": 0, "accepted": 0}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "vllm"}]}

    @app.get("/metrics")
    async def metrics():
        lines = ["# TYPE vllm:generation_tokens_total counter",
                 f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {counts["gen"]}']
        if speculative:
            for name, key in (("num_drafts", "drafts"), ("num_draft_tokens", "draft"),
                              ("num_accepted_tokens", "accepted")):
                lines += [f"# TYPE vllm:spec_decode_{name}_total counter",
                          f'vllm:spec_decode_{name}_total{{engine="0",model_name="m"}} {counts[key]}']
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        bad = defeated(prompt)
        # plain: 40 ms a request; speculative: 20 ms where its drafts land, 60 ms where not
        delay = (0.06 if bad else 0.02) if speculative else 0.04
        lp = body.get("logprobs")

        async def events():
            await asyncio.sleep(delay)
            for w in (prompt.split() * 3)[:TOKENS]:
                ch = {"index": 0, "delta": {"content": w + " "}}
                if lp:
                    ch["logprobs"] = {"content": [{"token": w, "logprob": -0.5, "top_logprobs": [
                        {"token": w, "logprob": -0.5}]}]}
                yield "data: " + json.dumps({"choices": [ch]}) + "\n\n"
            counts["gen"] += TOKENS
            if speculative:
                counts.update(drafts=counts["drafts"] + 4, draft=counts["draft"] + 16,
                              accepted=counts["accepted"] + (1 if bad else 4))
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 3,
                                                                 "completion_tokens": TOKENS}}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def servers():
    started = [_serve(fake_vllm(True)), _serve(fake_vllm(False))]
    yield started[0][3], started[1][3]
    for server, t, sock, _ in started:
        server.should_exit = True


def audit(servers, **kw):
    spec, plain = servers
    return run_endpoint_audit(spec, PROMPTS, reference_url=plain, only=("speedup-floor",), seed=kw.pop("seed", 0),
                              sampled_tokens=0, **kw)


def floor_of(report):
    return next(c for c in report["checks"] if c["name"] == "speedup-floor")


def test_the_search_finds_and_confirms_what_defeats_the_drafter(servers, monkeypatch):
    monkeypatch.setattr(FloorBudget, "quick", classmethod(lambda cls: cls(
        seeds=4, candidates=8, max_new_tokens=TOKENS, population=3, confirm=2, repeats=3)))
    report = audit(servers, seed=2)
    f = floor_of(report)
    fig = f["figures"]
    assert fig["search"]["guide"] == "per request: /metrics counters (vllm)"
    cands = {d["id"]: d for d in f["details"]["candidates"]}
    assert all(d["drafted"] == 16 for d in cands.values())  # the counters' difference around each request
    assert cands[fig["floor_prompt"]]["edits"] and defeated(cands[fig["floor_prompt"]]["text"])
    assert fig["floor"] < 0.85 and fig["floor_ci_high"] < 1  # ~40/60 ms, confirmed over 3 pairs
    assert f["passed"] and f["informational"]
    md = render_markdown(report)
    assert "Speedup floor: the worst prompts found" in md and fig["floor_prompt"] in md
    # the same seed and budget evaluate the same prompts
    again = floor_of(audit(servers, seed=2))
    assert [d["text"] for d in again["details"]["candidates"]] == [d["text"] for d in cands.values()]


def test_min_speedup_gates_on_the_interval(servers, monkeypatch):
    monkeypatch.setattr(FloorBudget, "quick", classmethod(lambda cls: cls(
        seeds=4, candidates=8, max_new_tokens=TOKENS, population=3, confirm=2, repeats=3)))
    gated = audit(servers, seed=2, min_speedup=0.95)
    f = floor_of(gated)
    assert not f["passed"] and f["figures"]["below_min_speedup"] and gated["verdict"] == "fail"
    assert floor_of(audit(servers, seed=2, min_speedup=0.3))["passed"]


def test_without_a_reference_the_floor_says_why_not(servers):
    spec, _ = servers
    report = run_endpoint_audit(spec, PROMPTS, only=("speedup-floor",), sampled_tokens=0)
    f = floor_of(report)
    assert f["passed"] and "no plain reference" in f["summary"]
