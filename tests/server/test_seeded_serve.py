"""`verispec serve`: a seeded request at temperature 0.7 or 1.0 gives the same tokens with
speculation off, with each drafter (draft model, layer-skip, prompt lookup), with a fixed
and an adaptive k, at batch 1, 8 and 32, all equal to offline seeded plain decoding; and
a server that runs the rejection rule reports these rows as verified by `coupled`."""

import concurrent.futures as cf

import httpx
import pytest

from tests.server.helpers import (MODEL, V, CharTokenizer, LiveServer, draft_model, plain_reference,
                                  target_model)
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.layerskip import LayerSkipDrafter
from verispec.drafters.lookup import PromptLookupDrafter
from verispec.engine import Engine, EngineConfig
from verispec.policy import FixedK
from verispec.policy.adaptive import AdaptivePolicy, CostModel
from verispec.sampling import SamplingParams
from verispec.server import ServerConfig, ServerState
from verispec.server.worker import PerRequestPolicy

TOK = CharTokenizer()
PROMPTS = [f"{w} {i}: " + " ".join([w] * (1 + i % 4)) for i, w in
           enumerate(["alpha", "the fox", "0123", "abc", "hello world", "x=1;", "def f(", "lorem"] * 4)]
MAX_TOKENS = [8 + (i * 5) % 17 for i in range(len(PROMPTS))]
SEEDS = [2 ** 40 + 977 * i for i in range(len(PROMPTS))]


def _state(kind, policy, batch, k=3):
    target = target_model()
    d = {"none": lambda: None,
         "draft": lambda: DraftModelDrafter(draft_model(), V, max_rows=batch, max_len=256 + k + 2),
         "layerskip": lambda: LayerSkipDrafter(target, 2),
         "lookup": lambda: PromptLookupDrafter(3)}[kind]()
    if d is None:
        pol = FixedK(0)
    elif policy == "fixed":
        pol = FixedK(k)
    else:
        halts = kind in ("draft", "layerskip")
        pol = AdaptivePolicy(CostModel.from_total_tokens((1, 64, 1024), (1.0, 1.0, 3.0), (1, 64), (0.05, 0.08),
                                                         halts=halts, draft_free=kind == "lookup"), max_k=k)
    engine = Engine(target, d, PerRequestPolicy(pol), EngineConfig(max_batch=batch, max_len=256))
    return ServerState(engine, TOK, ServerConfig(model_name=MODEL, max_queue=64, drafter=None if d is None else kind))


@pytest.fixture(scope="module")
def references():
    out = {}
    for t in (0.7, 1.0):
        sampling = [SamplingParams(temperature=t, seed=s) for s in SEEDS]
        out[t] = plain_reference([TOK.encode(p) for p in PROMPTS], MAX_TOKENS, sampling=sampling)
    return out


def _ask_all(url, temperature):
    def ask(i):
        body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS[i], "temperature": temperature,
                "seed": SEEDS[i]}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    with cf.ThreadPoolExecutor(16) as pool:
        return list(pool.map(ask, range(len(PROMPTS))))


CONFIGS = [("none", "fixed")] + [(d, p) for d in ("draft", "layerskip", "lookup") for p in ("fixed", "adaptive")]


@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("kind, policy", CONFIGS)
def test_seeded_requests_give_the_same_tokens(references, kind, policy, batch):
    with LiveServer(_state(kind, policy, batch)) as server:
        drafted = 0
        for t in (0.7, 1.0):
            got = _ask_all(server.url, t)
            for body, (ids, reason) in zip(got, references[t]):
                choice = body["choices"][0]
                assert choice["text"] == TOK.decode(ids, skip_special_tokens=True)
                assert choice["finish_reason"] == reason
                assert body["verispec"]["rule"] == "coupled"
                drafted += body["verispec"]["drafted"]
        assert kind == "none" or drafted > 0, "speculation must really run"
