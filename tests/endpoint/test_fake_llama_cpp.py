"""The endpoint audit against a stand-in of llama-server that answers from the fixtures
(its /props, /slots, /metrics format and per-response timings): the kind, version,
drafter and the acceptance figures come from what the server publishes, per level and
per response, and agree. The real llama-server runs in tests/slow/test_llama_server.py."""

import json
import pathlib
import threading
import time

import pytest
from fastapi import FastAPI, Request
from starlette.responses import PlainTextResponse, StreamingResponse

from tests.server.helpers import free_socket
from verispec.audit.endpoint.runner import EndpointAuditConfig, run_endpoint_audit
from verispec.audit.suite import SuitePrompt

FIX = pathlib.Path(__file__).parent / "fixtures"
DRAFT, ACCEPTED, STEPS = 6, 3, 2  # per request: two verification steps, half the drafts kept


def fake_llama_server(speculative: bool) -> FastAPI:
    app = FastAPI()
    props = json.loads((FIX / "llamacpp_props.json").read_text())
    counts = {"drafts": 0, "draft": 0, "accepted": 0, "pos0": 0, "pos1": 0, "predicted": 0}

    @app.get("/props")
    async def get_props():
        return props

    @app.get("/slots")
    async def slots():
        return [{"id": i, "n_ctx": 512, "speculative": speculative, "is_processing": False} for i in range(8)]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "smol.gguf", "object": "model", "owned_by": "llamacpp"}]}

    @app.get("/metrics")
    async def metrics():
        page = (FIX / "llamacpp_metrics.txt").read_text()
        page = page.replace("num_draft_tokens_total 1600", f"num_draft_tokens_total {counts['draft']}")
        page = page.replace("num_accepted_tokens_total 480", f"num_accepted_tokens_total {counts['accepted']}")
        page = page.replace("num_drafts_total 400", f"num_drafts_total {counts['drafts']}")
        page = page.replace("tokens_predicted_total 1024", f"tokens_predicted_total {counts['predicted']}")
        page = page.replace('position="0"} 240', f'position="0"}} {counts["pos0"]}')
        page = page.replace('position="1"} 140', f'position="1"}} {counts["pos1"]}')
        return PlainTextResponse(page)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        words = (prompt + " ") * 2

        async def events():
            for w in words.split(" ")[:6]:
                lp = {"content": [{"id": hash(w) % 1000, "token": w + " ", "logprob": -0.1,
                                   "top_logprobs": [{"id": hash(w) % 1000, "token": w + " ", "logprob": -0.1},
                                                    {"id": 7, "token": "x", "logprob": -2.5}]}]}
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": w + " "},
                                                          "logprobs": lp}]}) + "\n\n"
            timings = {"prompt_n": 3, "predicted_n": 6, "predicted_ms": 10.0}
            if speculative:
                timings.update(draft_n=DRAFT, draft_n_accepted=ACCEPTED)
                counts.update(drafts=counts["drafts"] + STEPS, draft=counts["draft"] + DRAFT,
                              accepted=counts["accepted"] + ACCEPTED, pos0=counts["pos0"] + 2,
                              pos1=counts["pos1"] + 1)
            counts["predicted"] += 6
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6},
                                         "timings": timings}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _serve(app):
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    sock = free_socket()
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    return server, t, sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def servers():
    started = [_serve(fake_llama_server(True)), _serve(fake_llama_server(False))]
    yield started[0][3], started[1][3]
    for server, t, sock, _ in started:
        server.should_exit = True
        t.join(10)
        sock.close()


PROMPTS = [SuitePrompt(f"p{i}", ("a", "b")[i % 2], f"alpha beta {i}") for i in range(6)]


def test_llama_cpp_kind_counters_and_record(servers):
    spec, plain = servers
    report = run_endpoint_audit(EndpointAuditConfig(spec, reference_url=plain, concurrency=(1, 4), max_tokens=6),
                                                    PROMPTS)
    rec = report["record"]
    assert rec["server"]["kind"] == "llama.cpp" and rec["server"]["version"] == "b1-0d6a3b2"
    assert rec["drafter"]["name"] == "llama.cpp: speculative in 8 of 8 slots"
    assert rec["reference_server"]["speculative"]["slots_speculative"] == 0
    assert rec["server"]["sampler_defaults"]["top_k"] == 40  # recorded: what the server applies unless told
    sl = next(c for c in report["checks"] if c["name"] == "slices")["figures"]
    assert sl["pooled_acceptance_rate"] == pytest.approx(ACCEPTED / DRAFT)
    assert sl["pooled_mean_accepted_length"] == pytest.approx(1 + ACCEPTED / STEPS)
    assert sl["pooled_acceptance_per_position"] == pytest.approx([1.0, 0.5, 0.0, 0.0])  # positions 2, 3: never
    assert sl["responses_agree_with_counters"] is True and sl["figures_from"] == "/metrics counters (llama.cpp)"
    load = next(c for c in report["checks"] if c["name"] == "load")["details"]["points"]["short"]
    assert [p["server_counters"]["draft_tokens"] for p in load] == [DRAFT * 6, DRAFT * 6]  # per level
    eq = next(c for c in report["checks"] if c["name"] == "equivalence")
    assert eq["passed"] and eq["figures"]["reference_logprobs"] is True
