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
