"""A stand-in for vLLM's chat route that samples for real: a fixed Markov model over V tokens
(the raw logits at a position depend on the previous token), each request's sampling
settings applied over the whole vocabulary in vLLM 0.32.0's order (v1/sample/sampler.py:
logit_bias, penalties on output-token counts, temperature, min_p, top_k, top_p), and raw
logprobs listed as vLLM's chat route lists them: the top n-1 plus the sampled token (the top
n when it is among them), keyed "token_id:N". This is its own implementation, written from
vLLM's code over full-vocabulary arrays, not the audit's computation from 20 entries.

`fault` re-creates a bug at the positions where prompt lookup (on the answer so far) has a
candidate, the positions a prompt-lookup drafter verifies:
  "bias-min-p" (vllm-project/vllm#42744): logit_bias and min_p are not applied there;
  "penalties" (vllm-project/vllm#18902): frequency and presence penalties are not applied;
  "untempered" (vllm-project/vllm#10198): temperature, top_p and penalties are not applied;
  "temperature-twice": the logits are divided by the temperature twice there."""

from __future__ import annotations

import itertools
import json

import numpy as np
from fastapi import FastAPI, Request
from starlette.responses import StreamingResponse

from verispec.drafters.lookup import lookup_continuation

V = 40


def raw_logits_table(seed: int = 0) -> np.ndarray:
    """[V, V]: the raw logits after each previous token (peaky: answers repeat n-grams, so
    prompt lookup has candidates)."""
    return 2.5 * np.random.default_rng(seed).standard_normal((V, V))


def vllm_probs(raw: np.ndarray, body: dict, output: list[int], skip: set[str]) -> np.ndarray:
    """The distribution vLLM samples from: raw [V] logits, the request body, the output so far;
    skip: the steps a fault leaves out."""
    x = raw.astype(np.float64).copy()
    if "bias" not in skip:
        for t, b in (body.get("logit_bias") or {}).items():
            x[int(t)] += b
    if "penalties" not in skip:
        counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=V)
        x -= body.get("frequency_penalty", 0.0) * counts
        x -= body.get("presence_penalty", 0.0) * (counts > 0)
    if "temperature" not in skip:
        x /= body["temperature"]
        if "temperature-twice" in skip:
            x /= body["temperature"]
    if body.get("min_p", 0.0) > 0 and "min_p" not in skip:
        p = np.exp(x - x.max())
        p /= p.sum()
        x[p < p.max() * body["min_p"]] = -np.inf
    k = body.get("top_k", -1)
    if 0 < k < V:
        x[x < np.sort(x)[V - k]] = -np.inf
    if body.get("top_p", 1.0) < 1.0 and "top_p" not in skip:
        order = np.argsort(x, kind="stable")  # ascending, as vLLM's apply_top_k_top_p
        ps = np.exp(x[order] - x.max())
        cum = np.cumsum(ps / ps.sum())
        mask = cum <= 1 - body["top_p"]
        mask[-1] = False
        x[order[mask]] = -np.inf
    p = np.exp(x - x.max())
    return p / p.sum()


SKIPS = {None: set(), "bias-min-p": {"bias", "min_p"}, "penalties": {"penalties"},
         "untempered": {"temperature", "top_p", "penalties"}, "temperature-twice": {"temperature-twice"}}


def _entries(raw_lp: np.ndarray, tok: int, n: int) -> list[dict]:
    top = [int(i) for i in np.argsort(-raw_lp, kind="stable")[:n]]
    if tok not in top:
        top = top[:n - 1] + [tok]
    return [{"token": f"token_id:{i}", "logprob": float(raw_lp[i])} for i in top]


def fake_vllm_sampler(fault: str | None = None, seed: int = 0) -> FastAPI:
    app = FastAPI()
    table = raw_logits_table(seed)
    streams = itertools.count(1000 * seed)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "vllm"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        rng = np.random.default_rng(next(streams))
        prev, out, chunks = sum(map(ord, body["messages"][-1]["content"])) % V, [], []
        for _ in range(body["max_tokens"]):
            raw = table[prev]
            raw_lp = raw - raw.max() - np.log(np.exp(raw - raw.max()).sum())
            drafted = bool(lookup_continuation(out, 1, 4, 2))
            p = vllm_probs(raw, body, out, SKIPS[fault] if drafted else set())
            tok = int(rng.choice(V, p=p))
            entry = {"token": f"token_id:{tok}", "logprob": float(raw_lp[tok]),
                     "top_logprobs": _entries(raw_lp, tok, body.get("top_logprobs") or 0)}
            chunks.append({"choices": [{"index": 0, "delta": {"content": f"t{tok} "},
                                        "logprobs": {"content": [entry]} if body.get("logprobs") else None}]})
            out.append(tok)
            prev = tok
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        chunks.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(out)}})

        async def events():
            for c in chunks:
                yield "data: " + json.dumps(c) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app
