"""The server with the adaptive policy (the CLI's default): answers equal offline plain
decoding, alone and under concurrent load, and it says which policy it runs."""

import concurrent.futures as cf

import httpx
import openai
import pytest

from tests.server.helpers import MODEL, LiveServer, make_state, reference_text
from verispec.cli import build_parser
from verispec.policy import FixedK, make_policy
from verispec.policy.adaptive import AdaptivePolicy

PROMPTS = ["the quick brown fox", "hello world, hello world, hello", "0123456789 0123", "abc abc abc abc"]


@pytest.fixture(scope="module")
def server():
    with LiveServer(make_state(drafter="draft", k=6, max_batch=4, policy="adaptive")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_reports_the_policy(server):
    info = httpx.get(server.url + "/v1/models").json()["data"][0]["verispec"]
    assert info["policy"] == "adaptive" and info["k"] == 6
    assert 'policy="adaptive"' in httpx.get(server.url + "/metrics").text


def test_completions_equal_plain_decoding_under_load(client):
    def ask(p):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=30, temperature=0)
        return r.choices[0].text, r.model_extra["verispec"]

    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, PROMPTS * 2))
    for (text, info), p in zip(got, PROMPTS * 2):
        assert text == reference_text(p, 30)[0]
        assert info["speculate"]
    assert sum(info["drafted"] for _, info in got) > 0  # it really speculated


def test_stream_equals_plain_decoding(client):
    want, _ = reference_text(PROMPTS[0], 24)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == want


def test_make_policy():
    assert isinstance(make_policy("fixed", None, object(), 4, 3), FixedK)
    assert make_policy("adaptive", None, None, 4, 3).max_k == 0  # no drafter: plain decoding
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("greedy-k", None, object(), 4, 3)


def test_serve_cli_defaults_to_adaptive():
    args = build_parser().parse_args(["serve", "--target", "x", "--draft", "lookup"])
    assert args.policy == "adaptive"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--target", "x", "--policy", "bogus"])
    assert AdaptivePolicy.name == "adaptive" and FixedK.name == "fixed"
