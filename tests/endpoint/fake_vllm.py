"""A stand-in for vLLM's OpenAI server (FastAPI), answering as vLLM does: no speculative
fields in a response, the spec_decode counters in /metrics (only with speculation), updated
once a request has finished. `behave(prompt) -> (delay_s, verification steps, draft tokens,
accepted tokens)` sets each answer's time and what the counters add for it; every answer
repeats the prompt's words up to `tokens` tokens, with logprobs where asked."""

from __future__ import annotations

import asyncio
import json
from typing import Callable

from fastapi import FastAPI, Request
from starlette.responses import PlainTextResponse, StreamingResponse


def fake_vllm(speculative: bool, behave: Callable[[str], tuple[float, int, int, int]], tokens: int) -> FastAPI:
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
        delay, steps, drafted, accepted = behave(prompt)
        logprobs = body.get("logprobs")

        async def events():
            await asyncio.sleep(delay)
            for w in (prompt.split() * 3)[:tokens]:
                ch = {"index": 0, "delta": {"content": w + " "}}
                if logprobs:
                    ch["logprobs"] = {"content": [{"token": w, "logprob": -0.5,
                                                   "top_logprobs": [{"token": w, "logprob": -0.5}]}]}
                yield "data: " + json.dumps({"choices": [ch]}) + "\n\n"
            counts["gen"] += tokens
            if speculative:
                counts.update(drafts=counts["drafts"] + steps, draft=counts["draft"] + drafted,
                              accepted=counts["accepted"] + accepted)
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 3,
                                                                 "completion_tokens": tokens}}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app
