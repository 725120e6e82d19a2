"""The sampling-parameters check (audit/sampling_params.py): the processed distribution
computed from raw top-n logprobs against hand computation, its PIT, and the check end to end:
it passes a correct verispec server and a correct vLLM-like sampler, and fails a verispec
server that ignores temperature and filters where it verifies drafts and vLLM-like samplers
with the known bugs (vllm-project/vllm#10198, #42744, #18902, temperature applied twice)."""

from __future__ import annotations

import math
import random
import threading
import time

import pytest

from tests.endpoint.fake_vllm_sampler import fake_vllm_sampler
from tests.server.helpers import LiveServer, free_socket
from verispec.audit.endpoint.client import EndpointConfig
from verispec.audit.endpoint.kinds import ServerInfo
from verispec.audit.endpoint.state import EndpointAudit
from verispec.audit.sampling_params import (
    SETTINGS,
    Setting,
    Support,
    bias_setting,
    endpoint_sampling_params_check,
    pit_processed,
    processed_distribution,
)
from verispec.audit.stats import test_uniform
from verispec.audit.suite import SuitePrompt


def _listed(probs: list[float], rest: int = 16) -> list[tuple[int, float]]:
    """[(id, logprob)] for the given probabilities, then `rest` tokens far below them."""
    return [(i, math.log(p)) for i, p in enumerate(probs)] + [(100 + i, -30.0 - i) for i in range(rest)]


# -- the processed distribution, by hand -----------------------------------------------------

def test_temperature_and_top_k_renormalise_over_the_k_most_probable():
    got = processed_distribution(_listed([0.5, 0.3, 0.1]), 19, Setting("t", 0.5, 2), {})
    w0, w1 = 0.5 ** 2, 0.3 ** 2  # p^(1/T)
    assert got.keys == [0, 1]
    assert got.probs == pytest.approx([w0 / (w0 + w1), w1 / (w0 + w1)])


def test_top_p_keeps_each_token_whose_mass_before_it_is_below_top_p():
    # over the top 4 renormalised (0.95): masses before 0, .526, .842, .947 -> keep 2 at top_p 0.7
    got = processed_distribution(_listed([0.5, 0.3, 0.1, 0.05]), 19, Setting("t", 1.0, 4, top_p=0.7), {})
    assert got.keys == [0, 1] and got.probs == pytest.approx([0.5 / 0.8, 0.3 / 0.8])


def test_min_p_keeps_tokens_within_its_ratio_of_the_top_token():
    got = processed_distribution(_listed([0.5, 0.3, 0.1, 0.05]), 19, Setting("t", 1.0, 4, min_p=0.25), {})
    assert got.keys == [0, 1]  # 0.1 / 0.5 = 0.2 < 0.25
    # temperature comes first: at T = 0.5 the ratio of 0.3 to 0.5 is 0.36 and stays; at T = 0.25, 0.13 goes
    assert processed_distribution(_listed([0.5, 0.3]), 19, Setting("t", 0.25, 2, min_p=0.2), {}).keys == [0]


def test_min_p_before_or_after_top_p_is_the_server_kinds_order():
    listed, s = _listed([0.4, 0.3, 0.2, 0.1]), Setting("t", 1.0, 4, top_p=0.75, min_p=0.4)
    # vLLM: min_p (drops 0.1) first, then top_p over .444 .333 .222 keeps two
    assert processed_distribution(listed, 19, s, {}, "min_p-first").keys == [0, 1]
    # verispec: top_p over the four keeps three (masses before 0, .4, .7), then min_p keeps them
    assert processed_distribution(listed, 19, s, {}, "min_p-last").keys == [0, 1, 2]


def test_frequency_and_presence_penalties_use_the_output_counts():
    s = Setting("t", 1.0, 3, frequency_penalty=1.0, presence_penalty=0.5)
    got = processed_distribution(_listed([0.5, 0.3, 0.1]), 19, s, {0: 2, 1: 1, 7: 4})
    z = {0: math.log(0.5) - 2 - 0.5, 1: math.log(0.3) - 1 - 0.5, 2: math.log(0.1)}
    total = sum(math.exp(v) for v in z.values())
    order = sorted(z, key=lambda k: -z[k])
    assert got.keys == order and got.probs == pytest.approx([math.exp(z[k]) / total for k in order])


def test_logit_bias_is_added_before_top_k():
    s = Setting("t", 1.0, 2, logit_bias=((2, 3.0), (0, -3.0)))
    got = processed_distribution(_listed([0.5, 0.3, 0.1]), 19, s, {})
    z = {2: math.log(0.1) + 3, 1: math.log(0.3)}
    total = sum(math.exp(v) for v in z.values())
    assert got.keys == [2, 1] and got.probs == pytest.approx([math.exp(z[2]) / total, math.exp(z[1]) / total])


def test_a_support_the_list_does_not_determine_is_left_out():
    # a tie at the top-k boundary
    assert isinstance(processed_distribution(_listed([0.4, 0.3, 0.3]), 19, Setting("t", 1.0, 2), {}), str)
    # a positive bias on an unlisted token could lift it above the k-th listed one
    s = Setting("t", 1.0, 3, logit_bias=((555, 44.0),))  # the 19th bucket is at -45
    assert isinstance(processed_distribution(_listed([0.5, 0.3, 0.1]), 19, s, {}), str)
    # vLLM's -9999.0 (a masked token, --logprobs-mode processed_*) is no logprob
    masked = [(0, -0.5), (1, -1.0)] + [(100 + i, -9999.0) for i in range(17)]
    assert isinstance(processed_distribution(masked, 19, Setting("t", 1.0, 2), {}), str)
    # fewer listed entries than top_k + 1
    assert isinstance(processed_distribution(_listed([0.5, 0.3], rest=0), 19, Setting("t", 1.0, 2), {}), str)
    # a top-p boundary at the mass before a token
    assert isinstance(processed_distribution(_listed([0.5, 0.3, 0.2]), 19, Setting("t", 1.0, 3, top_p=0.5), {}), str)


def test_only_the_draw_independent_entries_count():
    # vLLM chat lists the top 19 plus the sampled token: the 20th entry is not a bucket, so
    # with 19 buckets it cannot widen the support or be part of it
    listed = _listed([0.5, 0.3, 0.1], rest=17)
    assert len(processed_distribution(listed, 19, Setting("t", 1.0, 18), {}).keys) == 18
    assert isinstance(processed_distribution(listed, 19, Setting("t", 1.0, 19), {}), str)


# -- the PIT ---------------------------------------------------------------------------------

def test_pit_is_the_cdf_before_the_token_plus_a_uniform_share_of_it():
    sup, rng = Support(["a", "b", "c"], [0.5, 0.3, 0.2]), random.Random(0)
    assert 0.0 <= pit_processed(sup, "a", rng) <= 0.5
    assert 0.5 <= pit_processed(sup, "b", rng) <= 0.8
    assert 0.8 <= pit_processed(sup, "c", rng) <= 1.0
    assert pit_processed(sup, "d", rng) is None  # outside the support


def test_pit_is_uniform_for_the_right_sampler_and_not_for_a_wrong_one():
    rng = random.Random(1)
    listed = _listed([0.35, 0.25, 0.15, 0.1, 0.08, 0.04, 0.03])
    s = Setting("t", 0.6, 5)
    sup = processed_distribution(listed, 19, s, {})
    right = [pit_processed(sup, rng.choices(sup.keys, sup.probs)[0], rng) for _ in range(3000)]
    assert test_uniform(right).p_value > 1e-3
    untempered = processed_distribution(listed, 19, Setting("t", 1.0, 5), {})  # temperature skipped
    wrong = [pit_processed(sup, rng.choices(untempered.keys, untempered.probs)[0], rng) for _ in range(3000)]
    assert test_uniform(wrong).p_value < 1e-6


def test_the_bias_setting_moves_the_most_emitted_tokens():
    from collections import Counter
    s = bias_setting(Counter({5: 10, 6: 9, 7: 8}), Counter({5: 50, 8: 40, 9: 30, 7: 1}))
    # down on the two emitted most, up on the two others listed most
    assert dict(s.logit_bias) == {5: -3.0, 6: -3.0, 8: 2.0, 9: 2.0} and s.top_k <= 18
    assert bias_setting(Counter({5: 1}), Counter({5: 3})) is None
    assert all(st.top_k <= 18 for st in SETTINGS)  # below vLLM chat's 19 draw-independent entries


# -- end to end ------------------------------------------------------------------------------

PROMPTS = [SuitePrompt(f"p{i}", "s", t) for i, t in enumerate(["abc abc abc abc", "hello hello", "one, two, three"])]


def _audit(url: str, kind: str, tokens: int, max_tokens: int) -> EndpointAudit:
    cfg = EndpointConfig(url, model="m" if kind == "vllm" else None, max_tokens=max_tokens, concurrency=(4,),
                         logprobs=True)
    return EndpointAudit(info=ServerInfo(kind), ref_info=None, cfg=cfg, ref_cfg=None, reference_kind="none",
                         prompts=PROMPTS, chat=True, max_tokens=max_tokens, concurrency=(4,), suite_spec="test",
                         suite_size=len(PROMPTS), started="now", alpha=1e-3, sampled_tokens=tokens,
                         score_with="endpoint", min_verified_drafts=0, seed=7)


def test_a_server_whose_logprobs_are_not_known_raw_is_not_applicable():
    for kind in ("llama.cpp", "sglang", "unknown"):  # no request is made: the URL answers nothing
        result = endpoint_sampling_params_check(_audit("http://127.0.0.1:9", kind, 100, 8))
        assert result.informational and result.passed and result.summary.startswith("not applicable")
    assert endpoint_sampling_params_check(_audit("http://127.0.0.1:9", "vllm", 0, 8)) is None  # no sampling


def _settings(result) -> dict:
    return {r["label"].split(" logit_bias")[0] + (" bias" if "logit_bias" in r["label"] else ""): r
            for r in result.figures["settings"]}


def _verispec_state(fault: str | None):
    """The tiny target with the draft model (k = 3), optionally with a fault in its engine."""
    from tests.server.helpers import CharTokenizer, V, draft_model, target_model
    from verispec.audit.faults import build
    from verispec.drafters.draft_model import DraftModelDrafter
    from verispec.engine import Engine, EngineConfig
    from verispec.policy import FixedK
    from verispec.server import ServerConfig, ServerState
    from verispec.server.worker import PerRequestPolicy
    parts = (target_model(), DraftModelDrafter(draft_model(), V, max_rows=4, max_len=512), PerRequestPolicy(FixedK(3)),
             EngineConfig(max_batch=4, max_len=400))
    engine = build(fault).engine(*parts) if fault else Engine(*parts)
    return ServerState(engine, CharTokenizer(), ServerConfig(model_name="tiny", drafter="draft"))


@pytest.mark.parametrize("fault", [None, "verify-untempered"])
def test_verispec_server_passes_and_fails_when_verification_ignores_the_settings(fault):
    with LiveServer(_verispec_state(fault)) as server:
        result = endpoint_sampling_params_check(_audit(server.url, "verispec", 1500, 48))
    rows = _settings(result)
    # verispec refuses penalties and logit_bias: reported, not failed
    assert rows["top_k=8 frequency 1.0 presence 0.5"]["passed"] is None
    assert "refused" in rows["top_k=8 frequency 1.0 presence 0.5"]["reason"]
    tested = [r for r in rows.values() if r["passed"] is not None]
    assert len(tested) == 4 and all(r["emitted_tokens"] >= 300 for r in tested), result.figures
    if fault is None:
        assert result.passed, result.summary
        assert all(r["scored"] >= 150 for r in tested)
        assert all(r["out_of_support"] == 0 for r in tested)
    else:
        # the raw softmax at every verified position: tokens outside top-k, and a flatter PIT
        assert not result.passed
        assert not rows["T=0.6 top_k=10"]["passed"] and rows["T=0.6 top_k=10"]["out_of_support"] > 0


def _serve(app):
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    sock = free_socket()
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.02)
    return server, t, sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


# each fault, and the setting that must catch it: min_p, penalties and top_p skipped at drafted
# positions emit tokens outside the support; the temperature applied twice (0.6 -> 0.36) piles
# the drafted positions' PIT near 0
FAULTS = {None: None, "bias-min-p": "top_k=15 min_p=0.1", "penalties": "top_k=8 frequency 1.0 presence 0.5",
          "untempered": "T=0.8 top_k=12 top_p=0.8", "temperature-twice": "T=0.6 top_k=10"}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_vllm_like_sampler_passes_and_each_bug_fails_its_setting(fault):
    server, t, sock, url = _serve(fake_vllm_sampler(fault))
    try:
        result = endpoint_sampling_params_check(_audit(url, "vllm", 2400, 64))
    finally:
        server.should_exit = True
        t.join(10)
        sock.close()
    rows = _settings(result)
    assert len(rows) == 6 and all(r["scored"] >= 150 for r in rows.values()), result.figures
    if fault is None:
        assert result.passed, result.summary
        # the drafted test runs where answers repeat (penalties discourage it)
        assert sum("pit-drafted" in r for r in rows.values()) >= 4, result.figures
        return
    assert not result.passed
    assert not rows[FAULTS[fault]]["passed"], (fault, rows[FAULTS[fault]])
    if fault == "bias-min-p":  # logit_bias skipped at drafted positions too
        assert not rows["top_k=8 bias"]["passed"], rows["top_k=8 bias"]
