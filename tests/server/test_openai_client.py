"""The official `openai` client against a live server on 127.0.0.1 (tiny models, a draft
model with k=3): completions and chat, streaming and not, all equal to offline plain
decoding; stop strings, seeds, the speculation override and error mapping."""

import openai
import pytest

from tests.server.helpers import MODEL, LiveServer, make_state, reference_text

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def server():
    with LiveServer(make_state(drafter="draft", k=3)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]


def test_completion(client):
    want, reason = reference_text(PROMPT, 24)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == reason
    assert r.usage.prompt_tokens == len(PROMPT) and r.usage.completion_tokens == 24
    info = r.model_extra["verispec"]
    assert info["speculate"] and info["drafted"] > 0 and info["target_passes"] < 24  # it really speculated


def test_completion_stream(client):
    want, reason = reference_text(PROMPT, 24)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat(client):
    want, reason = reference_text("Say something", 20, chat=True)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say something"}],
                                       max_tokens=20, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == reason


def test_chat_stream(client):
    want, reason = reference_text("Say something", 20, chat=True)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say something"}], max_tokens=20, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert chunks[-1].usage.completion_tokens == len(want) or reason == "stop"


def test_speculation_off_is_the_same_answer(client):
    want, _ = reference_text(PROMPT, 24)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                  extra_body={"verispec": {"speculate": False}})
    assert r.choices[0].text == want
    info = r.model_extra["verispec"]
    assert not info["speculate"] and info["drafted"] == 0 and info["target_passes"] == 24


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text(client, stream):
    full, _ = reference_text(PROMPT, 24)
    stop = full[8:10]  # a stop string that first occurs at index full.find(stop) <= 8
    want = full[:full.find(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "@@@@"],
                                  stream=stream)
    if stream:
        chunks = list(r)
        text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        text, reason = r.choices[0].text, r.choices[0].finish_reason
    assert (text, reason) == (want, "stop")


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9,
                                         seed=seed).choices[0].text
    a, b = sample(7), sample(7)
    assert a == b
    assert any(sample(s) != a for s in (8, 9, 10))


def test_rule_override(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.8, seed=1,
                                  extra_body={"verispec": {"rule": "rejection"}})
    assert r.model_extra["verispec"]["rule"] == "rejection" and not r.model_extra["verispec"]["lossy"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.8,
                                  extra_body={"verispec": {"rule": "typical-lossy"}})
    assert "not enabled" in e.value.body["message"]


def test_errors_map_to_client_exceptions(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-nope", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10_000)
    assert e.value.body["code"] == "context_length_exceeded"
    with openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0) as c2:
        assert c2.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices
