"""logprobs from verispec serve: the target's own log-probabilities of each emitted token
(temperature 1, before truncation), scored by a teacher-forced pass once the answer is
complete; equal to an offline forward pass, with or without speculation, streamed or not."""

import httpx
import pytest
import torch

from tests.server.helpers import CharTokenizer, LiveServer, make_state, target_model


@pytest.fixture(scope="module")
def server():
    with LiveServer(make_state(drafter="draft", k=3)) as s:
        yield s


def _offline(prompt_ids, out_ids, top):
    model = target_model()
    ids = prompt_ids + out_ids
    cache = model.new_cache(1, len(ids))
    logits = model.forward(torch.tensor([ids[:-1]]), cache, cache.alloc())
    lp = torch.log_softmax(logits[0, len(prompt_ids) - 1:].double(), -1)
    return lp.gather(-1, torch.tensor(out_ids)[:, None]).squeeze(-1).tolist(), lp.topk(top, -1).indices.tolist()


@pytest.mark.parametrize("speculate", [True, False])
def test_completion_logprobs_are_the_targets(server, speculate):
    tok = CharTokenizer()
    body = {"prompt": "hello there", "max_tokens": 10, "temperature": 1.0, "seed": 5, "logprobs": 3,
            "verispec": {"speculate": speculate}}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    lp = r["choices"][0]["logprobs"]
    out = lp["token_ids"]
    assert len(out) == r["usage"]["completion_tokens"] and tok.decode(out, skip_special_tokens=True) == \
        r["choices"][0]["text"]
    chosen, top = _offline(tok.encode("hello there"), out, 3)
    assert lp["token_logprobs"] == pytest.approx(chosen, abs=1e-5)
    assert [list(d) for d in lp["top_logprobs"]] == [[tok.decode([i]) for i in t] for t in top]


def test_chat_stream_logprobs(server):
    body = {"messages": [{"role": "user", "content": "abc abc"}], "max_tokens": 8, "temperature": 0,
            "stream": True, "logprobs": True, "top_logprobs": 2}
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(__import__("json").loads(line[6:]))
    entries = [e for c in chunks for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert entries and "".join(e["token"] for e in entries if e["id"] != CharTokenizer.eos_token_id) == text
    for e in entries:  # greedy: the emitted token is the top one
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["id"] == e["id"]
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
