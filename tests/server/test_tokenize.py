"""verispec serve's /tokenize: the served tokenizer's ids of a text, in the shape llama.cpp and
vLLM answer (the endpoint audit tokenizes outputs with the reference's own tokenizer), and a
clear 400 for a body it cannot use."""

import httpx
import pytest

from tests.server.helpers import CharTokenizer, LiveServer, make_state


@pytest.fixture(scope="module")
def server():
    with LiveServer(make_state(drafter=None, api_key="k")) as s:
        yield s


def test_tokenize_answers_the_tokenizers_ids(server):
    h = {"Authorization": "Bearer k"}
    for body in ({"content": "hi there"}, {"prompt": "hi there", "add_special_tokens": False}):
        r = httpx.post(server.url + "/tokenize", json=body, headers=h)
        assert r.status_code == 200 and r.json() == {"tokens": CharTokenizer().encode("hi there"), "count": 8}


@pytest.mark.parametrize("body, status", [({"content": 3}, 400), ({}, 400), ({"content": "x", "add_special": "yes"}, 400),
                                         ([1, 2], 400)])
def test_tokenize_refuses_what_it_cannot_use(server, body, status):
    r = httpx.post(server.url + "/tokenize", json=body, headers={"Authorization": "Bearer k"})
    assert r.status_code == status and "error" in r.json()


def test_tokenize_needs_the_key(server):
    assert httpx.post(server.url + "/tokenize", json={"content": "x"}).status_code == 401


def test_tokenize_messages_gives_the_chat_prompts_ids(server):
    msgs = [{"role": "user", "content": "hi there"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": msgs}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 200
    assert r.json()["tokens"] == CharTokenizer().apply_chat_template(msgs, add_generation_prompt=True)
    bad = httpx.post(server.url + "/tokenize", json={"messages": "hi there"},
                     headers={"Authorization": "Bearer k"})
    assert bad.status_code == 400 and "error" in bad.json()


def test_prompt_logprobs_score_every_prompt_token_as_vllm_lists_them(server):
    """The reference's score of a text (the audit's corruption perplexity): each prompt token
    after the first, the same logprob as the answer's own logprobs give it when it is emitted."""
    h = {"Authorization": "Bearer k"}
    tok = CharTokenizer()
    ids = tok.encode("the cat sat")
    r = httpx.post(server.url + "/v1/completions", headers=h,
                   json={"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    pl = r.json()["choices"][0]["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for t, entry in zip(ids[1:], pl[1:]):
        assert str(t) in entry and all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        ranked = sorted((v["rank"], v["logprob"]) for v in entry.values() if v["rank"] is not None)
        assert [r for r, _ in ranked] == [1, 2] and ranked[0][1] >= ranked[1][1]
    # the same tokens scored as an answer: the answer's own logprobs after the first token
    a = httpx.post(server.url + "/v1/completions", headers=h,
                   json={"prompt": ids[:1], "max_tokens": len(ids) - 1, "temperature": 0, "logprobs": 0,
                         "ignore_eos": True}).json()["choices"][0]["logprobs"]
    greedy = a["token_ids"]
    got = httpx.post(server.url + "/v1/completions", headers=h,
                     json={"prompt": ids[:1] + greedy, "max_tokens": 1, "prompt_logprobs": 0}).json()
    scored = [e[str(t)]["logprob"] for t, e in zip(greedy, got["choices"][0]["prompt_logprobs"][1:])]
    assert scored == pytest.approx(a["token_logprobs"], abs=1e-5)


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 21}, {"prompt_logprobs": -1},
                                   {"prompt_logprobs": 0, "stream": True}])
def test_prompt_logprobs_refused_clearly(server, extra):
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": "Bearer k"},
                   json={"prompt": "ab", "max_tokens": 1, **extra})
    assert r.status_code == 400 and "prompt_logprobs" in r.text
