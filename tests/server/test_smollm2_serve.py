"""`verispec serve` end to end with SmolLM2-135M: the real CLI in a subprocess on
127.0.0.1, the official openai client, greedy answers equal to offline plain decoding."""

from pathlib import Path

import httpx
import openai
import pytest

from tests.server.helpers import metric
from tests.verispec_server import VerispecServer

ROOT = Path(__file__).resolve().parents[2]
PRESET = "smollm2-135m"
MAX_LEN = 512

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    with VerispecServer(PRESET, "--draft", "lookup", "--k", "3", "--max-batch", "4", "--max-len", str(MAX_LEN)) as url:
        yield url


@pytest.fixture(scope="module")
def reference():
    """Offline plain decoding (no drafter) with the same model, stop ids and chat template."""
    from verispec.engine import Engine, EngineConfig, GenerationParams, Request
    from verispec.models import load_model
    from verispec.policy import FixedK

    loaded = load_model(PRESET, progress=False)
    tok, model = loaded.tokenizer, loaded.model
    stops = tuple(dict.fromkeys(tuple(model.config.eos_token_ids) + (tok.eos_token_id,)))

    def run(text: str, max_tokens: int, chat: bool) -> tuple[str, str]:
        if chat:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = tok(text)["input_ids"]
        eng = Engine(model, None, FixedK(0), EngineConfig(max_batch=1, max_len=MAX_LEN))
        (r,) = eng.run([Request(ids, GenerationParams(max_new_tokens=max_tokens, stop_token_ids=stops))])
        return tok.decode(r.output_ids, skip_special_tokens=True), r.finish_reason
    return run


def test_chat_and_completion_equal_plain_decoding(server, reference):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
    q = "Say 'thank you' in French, Spanish and Japanese."
    want, reason = reference(q, 32, chat=True)
    r = client.chat.completions.create(model=PRESET, messages=[{"role": "user", "content": q}], max_tokens=32,
                                       temperature=0)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want, reason)
    chunks = list(client.chat.completions.create(model=PRESET, messages=[{"role": "user", "content": q}],
                                                 max_tokens=32, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want  # incremental = full decode

    code = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    want, reason = reference(code, 32, chat=False)
    chunks = list(client.completions.create(model=PRESET, prompt=code, max_tokens=32, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    plain = client.completions.create(model=PRESET, prompt=code, max_tokens=32, temperature=0,
                                      extra_body={"verispec": {"speculate": False}})
    assert plain.choices[0].text == want and plain.model_extra["verispec"]["drafted"] == 0

    m = httpx.get(server + "/metrics").text
    assert metric(m, "verispec_spec_decode_num_draft_tokens_total") > 0
    assert metric(m, "verispec_cache_rows_in_use") == 0
