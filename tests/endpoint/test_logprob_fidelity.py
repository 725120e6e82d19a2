"""Logprob fidelity from outside (audit/logprob_fidelity.py): the comparison on hand-made
answers (a tolerance set by the null, shares over it split by drafted positions, missing
logprobs fail as the llama.cpp#27972 class), and the endpoint audit against a live tiny
verispec server, which passes, behind a proxy that rewrites the logprobs of its speculative
answers as the known bugs do, which fails."""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from starlette.responses import Response

from tests.server.helpers import LiveServer, Served, make_state
from verispec.audit import logprob_fidelity as lf
from verispec.audit.endpoint.client import EndpointConfig, PromptResult
from verispec.audit.endpoint.runner import EndpointAuditConfig, run_endpoint_audit
from verispec.audit.registry import LOGPROBS
from verispec.audit.suite import SuitePrompt

V = 12


def _answer(rid: str, n: int, seed: int, noise: float = 0.0, top: int = 5) -> tuple[PromptResult, dict, list[int]]:
    """An answer of n tokens sampled from random distributions over V ids, with the endpoint's
    logprobs (the true ones plus `noise`) and the reference's full lists per position; the
    prompt repeats a pattern, so prompt lookup has candidates at some positions."""
    rng = np.random.default_rng(seed)
    r = PromptResult(rid, "s", completion_tokens=n, tokens=[], token_logprobs=[], token_ids=[], top=[])
    ref = {}
    for j in range(n):
        lp = np.log(rng.dirichlet(np.full(V, 0.5)))
        x = int(rng.choice(V, p=np.exp(lp) / np.exp(lp).sum()))
        ref[j] = [(i, float(lp[i])) for i in range(V)]
        mine = lp + rng.normal(0, noise, V) if noise else lp
        r.tokens.append(f"t{x}")
        r.token_ids.append(x)
        r.token_logprobs.append(float(mine[x]))
        r.top.append([(int(i), float(mine[i])) for i in np.argsort(-lp)[:top]])
    return r, ref, [1, 2, 3, 1, 2, 3, 1, 2]


ZERO_NULL = [lf.Diff("n", j, 0, "", -1.0, -1.0, False) for j in range(lf.MIN_NULL)]


def _judge(answers, refs, prompts, null=ZERO_NULL):
    t = lf.tally(answers, refs, prompts)
    return lf.judge(t, null, {"reference": "hand-made"})


def _many(k: int = 4, n: int = 60, **kw):
    got = [_answer(f"a{i}#0", n, i, **kw) for i in range(k)]
    return [g[0] for g in got], {g[0].id: g[1] for g in got}, {g[0].id: g[2] for g in got}


def test_tolerance_comes_from_the_null_with_a_floor():
    assert lf.tolerance([]) == lf.TOLERANCE_FLOOR
    assert lf.tolerance([0.001] * 100) == lf.TOLERANCE_FLOOR
    assert lf.tolerance([0.0] * 98 + [0.02, 0.5]) == pytest.approx(0.2)  # the 99th percentile, not the max
    q = lf.quantiles([float(i) for i in range(1, 101)])
    assert (q["p50"], q["p99"], q["max"]) == (50.0, 99.0, 100.0)


def test_exact_logprobs_pass_and_numerics_within_the_null_pass():
    answers, refs, prompts = _many()
    c = _judge(answers, refs, prompts)
    assert c.passed, c.summary
    f = c.figures
    assert f["tokens_compared"] == 240 and f["tokens"]["all"]["over"] == 0 and f["tokens_without_logprobs"] == 0
    assert f["alternatives"]["all"]["compared"] > 0 and f["tokens"]["drafted"]["compared"] > 0
    # noise of 0.01 nats: beyond the floor of 0.05 almost never; a null that saw it sets the scale
    answers, refs, prompts = _many(noise=0.01)
    null = [lf.Diff("n", j, 0, "", 0.0, x, False) for j, x in enumerate(np.random.default_rng(9).normal(0, 0.01, 300))]
    c = _judge(answers, refs, prompts, null)
    assert c.passed, c.summary
    assert 0.2 < c.figures["tolerance"] < 0.4 and c.figures["null_quantiles"]["n"] == 300


def test_placeholder_zero_logprobs_fail_with_the_share_and_examples():
    answers, refs, prompts = _many()
    for r in answers:
        for j in range(0, len(r.token_logprobs), 3):
            r.token_logprobs[j] = 0.0  # "logprobs-placeholder": an accepted draft reported as p = 1
    c = _judge(answers, refs, prompts)
    assert not c.passed
    over = c.figures["tokens"]["all"]
    assert over["compared"] == 240 and 0.25 < over["share"] <= 80 / 240
    assert "differ from the reference" in c.summary and "emitted tokens" in c.summary
    worst = c.details["largest_differences"]
    assert len(worst) == lf.EXAMPLES and all(w["endpoint_logprob"] == 0.0 for w in worst)
    assert worst[0]["difference"] > 1.0 and {"answer", "position", "token_id", "reference_logprob"} <= set(worst[0])


def test_one_wrong_token_in_a_hundred_is_within_the_limit_and_two_are_not():
    answers, refs, prompts = _many(k=2, n=100)  # 200 tokens
    answers[0].token_logprobs[5] = 0.0 if refs[answers[0].id][5][answers[0].token_ids[5]][1] < -0.1 else -5.0
    assert _judge(answers, refs, prompts).passed
    for j in (7, 9):
        r = answers[1]
        r.token_logprobs[j] = refs[r.id][j][r.token_ids[j]][1] - 1.0
    c = _judge(answers, refs, prompts)
    assert not c.passed and c.figures["tokens"]["all"]["over"] == 3


def test_shifted_alternatives_fail_even_where_the_token_is_right():
    answers, refs, prompts = _many()
    for r in answers:  # "logprobs-shifted" on the alternatives only: the neighbour's list
        r.top = r.top[1:] + r.top[:1]
    c = _judge(answers, refs, prompts)
    assert not c.passed and "listed alternatives" in c.summary
    assert c.figures["tokens"]["all"]["over"] == 0 and c.figures["alternatives"]["all"]["share"] > 0.05


def test_tokens_without_logprobs_fail_as_the_llama_cpp_class():
    answers, refs, prompts = _many()
    for r in answers:  # a verification step's tokens: counted by usage, never listed
        r.completion_tokens += 20
    c = _judge(answers, refs, prompts)
    assert not c.passed
    assert c.figures["tokens_without_logprobs"] == 80 and c.figures["share_without_logprobs"] == pytest.approx(0.25)
    assert "80 of 320 emitted tokens (25.0%) came without logprobs" in c.summary
    assert "llama.cpp#27972" in c.summary
    assert c.figures["answers_not_teacher_forced"] == 4  # their ids are not all known


def test_a_token_listed_with_no_alternatives_counts_as_without_logprobs():
    answers, refs, prompts = _many()
    for r in answers:
        for j in range(0, 60, 10):
            r.top[j] = []  # llama.cpp's "to be set later": the value stays, the list is empty
    c = _judge(answers, refs, prompts)
    assert not c.passed and c.figures["tokens_without_logprobs"] == 24


def test_too_few_compared_tokens_or_no_null_is_inconclusive():
    answers, refs, prompts = _many(k=1, n=30)
    c = _judge(answers, refs, prompts)
    assert not c.passed and c.summary.startswith("inconclusive") and "emitted tokens compared" in c.summary
    answers, refs, prompts = _many()
    c = _judge(answers, refs, prompts, null=ZERO_NULL[:10])
    assert not c.passed and "the noise is not measured" in c.summary


def test_llama_cpp_positions_are_capped_with_half_at_bare_tokens():
    answers, _, _ = _many(k=4, n=60)
    for r in answers:
        for j in range(0, 60, 6):
            r.top[j] = []
    s = lf.Scorer(EndpointConfig("http://x"), "llama.cpp", own=False)
    got = lf.positions(answers, s, 40, seed=1)
    picked = [(rid, j) for rid, js in got.items() for j in js]
    assert len(picked) == 40 and sum(j % 6 == 0 for _, j in picked) == 20
    assert lf.positions(answers, s, 40, seed=1) == got  # drawn by the seed
    assert sum(map(len, lf.positions(answers, lf.Scorer(EndpointConfig("http://x"), "vllm", False), 40, 1).values())) == 240


def test_drafted_positions_follow_prompt_lookup():
    assert lf.drafted_positions([5, 6, 7, 5, 6], [9, 4]) == [True, False]  # a candidate, whatever was emitted
    assert lf.drafted_positions([1, 2, 3], [4]) == [False]


# -- against a live tiny verispec server ----------------------------------------------------------
PROMPTS = [SuitePrompt(f"s{i}", ("a", "b")[i % 2], t) for i, t in enumerate(
    ["abc abc abc", "hello there", "the quick brown fox", "one, two, three", "lorem ipsum dolor", "xyzzy plugh"])]


def _placeholder(content: list) -> list:
    return [{**e, "logprob": 0.0} if j % 3 == 1 else e for j, e in enumerate(content)]


def _shifted(content: list) -> list:
    """The neighbour's logprobs at two positions in four (an accepted run reported one off)."""
    return [{**e, "logprob": content[j + 1]["logprob"], "top_logprobs": content[j + 1]["top_logprobs"]}
            if j % 4 in (1, 2) and j + 1 < len(content) else e for j, e in enumerate(content)]


def _dropped(content: list) -> list:
    return [e for j, e in enumerate(content) if j % 4 != 3]


def _rewrite(text: str, corrupt) -> str:
    """A chat answer (streamed or not) with its logprobs' content list passed through corrupt."""
    def one(obj: dict) -> dict:
        for ch in obj.get("choices") or []:
            if (ch.get("logprobs") or {}).get("content"):
                ch["logprobs"]["content"] = corrupt(ch["logprobs"]["content"])
        return obj
    if not text.startswith("data:"):
        return json.dumps(one(json.loads(text)))
    lines = [("data: " + json.dumps(one(json.loads(ln[5:]))) if ln.startswith("data:") and "[DONE]" not in ln
              else ln) for ln in text.split("\n")]
    return "\n".join(lines)


def proxy(upstream: str, corrupt) -> FastAPI:
    """A proxy that rewrites the logprobs of the speculative answers (requests that do not
    switch speculation off and ask for no prompt_logprobs) and forwards everything else."""
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request):
        body = await request.body()
        async with httpx.AsyncClient(base_url=upstream, timeout=300) as c:
            r = await c.request(request.method, "/" + path, content=body,
                                headers={"content-type": request.headers.get("content-type", "application/json")})
        text = r.text
        req = json.loads(body) if body else {}
        speculative = (req.get("verispec") or {}).get("speculate", True) and "prompt_logprobs" not in req
        if path.endswith("chat/completions") and r.status_code == 200 and speculative:
            text = _rewrite(text, corrupt)
        return Response(text, status_code=r.status_code, media_type=r.headers.get("content-type"))
    return app


@pytest.fixture(scope="module")
def server():
    with LiveServer(make_state(drafter="draft", k=3, max_batch=4)) as s:
        yield s.url


def _audit(url: str) -> dict:
    report = run_endpoint_audit(EndpointAuditConfig(url, chat=True, max_tokens=24, concurrency=(2,),
                                                    sampled_tokens=300, only=(LOGPROBS.name,)), PROMPTS)
    return next(c for c in report["checks"] if c["name"] == LOGPROBS.name)


def test_a_correct_speculative_server_passes(server):
    c = _audit(server)
    f = c["figures"]
    assert c["passed"], c["summary"]
    assert f["tokens_compared"] >= 300 and f["tokens_without_logprobs"] == 0 and f["failed_answers"] == 0
    assert f["alternatives"]["all"]["compared"] > 1000 and f["tokens"]["drafted"]["compared"] > 0
    assert f["null_quantiles"]["n"] >= 200 and f["tolerance"] == lf.TOLERANCE_FLOOR
    assert "speculation off" in f["reference"] and math.isclose(f["difference_quantiles"]["max"], 0.0, abs_tol=1e-6)


@pytest.mark.parametrize("corrupt,why", [(_placeholder, "emitted tokens"), (_shifted, "emitted tokens"),
                                         (_dropped, "without logprobs")])
def test_rewritten_logprobs_fail(server, corrupt, why):
    with Served(proxy(server, corrupt)) as p:
        c = _audit(p.url)
    assert not c["passed"] and why in c["summary"], c["summary"]
    f = c["figures"]
    assert f["null_quantiles"]["p99"] < 1e-6  # the null (speculation off) is untouched: the scale stays tight
    if corrupt is _dropped:
        assert 0.2 < f["share_without_logprobs"] < 0.3 and "llama.cpp#27972" in c["summary"]
    else:
        assert f["tokens"]["all"]["share"] > 0.1 and c["details"]["largest_differences"]


def test_a_server_that_lists_no_logprobs_is_not_applicable_and_an_unknown_kind_is_not_run():
    from types import SimpleNamespace

    from verispec.audit.endpoint.client import EndpointRun, LevelRun
    answers = [PromptResult("s0#0", "a", text="abc", completion_tokens=3)]
    run = EndpointRun("http://x", "m", "vllm", False, [LevelRun(1, 1.0, answers, None)])
    a = SimpleNamespace(info=SimpleNamespace(kind="vllm"), ref_info=None, ref_cfg=None, cfg=EndpointConfig("http://x"),
                        sampled=lambda: run, sampled_tokens=256)
    c = lf.endpoint_logprobs_check(a)
    assert c.passed and c.informational and c.summary == "not applicable: the server lists no logprobs"
    a.info.kind = "tgi"
    assert lf.endpoint_logprobs_check(a) is None
    a.info.kind, a.sampled_tokens = "vllm", 0  # --sampled-tokens 0: no sampled phase to read
    assert lf.endpoint_logprobs_check(a) is None
