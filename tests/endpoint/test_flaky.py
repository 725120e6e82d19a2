"""The endpoint audit survives a server that errors, cuts streams and sends junk: the
answers it could not get are recorded as errors, the equivalence check calls the level
inconclusive (a failure), and nothing raises; an unreachable server is a clear error."""

import json
import threading
import time

import pytest
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tests.endpoint import audit_parser
from tests.server.helpers import free_socket
from verispec.audit.endpoint.runner import EndpointAuditConfig, cmd_endpoint_audit, run_endpoint_audit
from verispec.audit.suite import SuitePrompt


def flaky_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "flaky", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse("<html>this is not Prometheus text</html>\n")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        if "ERR" in prompt:
            return JSONResponse({"error": {"message": "internal error", "type": "server_error"}}, status_code=500)

        async def events():
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": prompt[::-1]}}]}) + "\n\n"
            if "CUT" in prompt:
                raise RuntimeError("connection dropped mid-stream")
            if "JUNK" in prompt:
                yield "data: {not json\n\n"
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                                         "usage": {"prompt_tokens": 3, "completion_tokens": 4}}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def flaky():
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(flaky_app(), log_level="critical", lifespan="off"))
    sock = free_socket()
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    t.join(10)
    sock.close()


PROMPTS = [SuitePrompt("ok1", "a", "fine prompt"), SuitePrompt("err", "a", "ERR please"),
           SuitePrompt("cut", "b", "CUT here"), SuitePrompt("junk", "b", "JUNK chunk"),
           SuitePrompt("ok2", "b", "another fine one")]


def test_errors_and_cut_streams_are_recorded_not_raised(flaky, tmp_path):
    report = run_endpoint_audit(EndpointAuditConfig(flaky, reference_url=flaky, concurrency=(1, 2), max_tokens=8,
                                                    sampled_tokens=40), PROMPTS)
    eq = next(c for c in report["checks"] if c["name"] == "equivalence")
    assert not eq["passed"] and "inconclusive" in eq["summary"]
    rows = {(r["batch"], r["id"]): r for r in eq["details"]["prompts"]}
    assert rows[(1, "ok1")]["exact"] and rows[(2, "ok2")]["exact"]
    assert rows[(1, "err")]["error"].startswith("base: HTTP 500")
    assert rows[(2, "cut")]["error"] and rows[(2, "junk")]["error"]
    results = {r["id"]: r for r in report["endpoint_runs"]["endpoint"]["levels"][0]["results"]}
    assert "malformed stream chunk" in results["junk"]["error"]
    assert results["cut"]["error"]  # a cut stream is an error, never a short "answer"
    # no logprobs at all: the distribution check is inconclusive, a failure that says why
    d = next(c for c in report["checks"] if c["name"] == "distribution")
    assert not d["passed"] and d["summary"].startswith("inconclusive")
    from verispec.audit.report import write_reports
    paths = write_reports(report, tmp_path / "r")  # and the report still renders
    assert "inconclusive" in paths["md"].read_text()
    assert report["record"]["server"]["kind"] == "unknown"
    assert any("unparseable" in n for n in report["record"]["server"]["notes"])


def test_unreachable_endpoint_is_a_clear_error(tmp_path, capsys):
    sock = free_socket()  # bound, never listening: connection refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    suite = tmp_path / "s.jsonl"
    suite.write_text(json.dumps({"id": "a", "slice": "x", "prompt": "hi"}) + "\n")
    p = audit_parser()
    rc = cmd_endpoint_audit(p.parse_args(["--suite", str(suite), "--out", str(tmp_path / "r"), "--endpoint", url]))
    sock.close()
    assert rc == 2
    err = capsys.readouterr().err
    assert "cannot audit" in err and "ConnectError" in err
