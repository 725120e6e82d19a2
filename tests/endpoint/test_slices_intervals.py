"""The endpoint audit's slices and load with intervals: every prompt timed against the
reference over several paired repeats at concurrency 1 (the order flipped repeat by repeat),
per-request acceptance from /metrics where the answers carry none (vLLM), and a speedup
that acceptance cannot explain reported as noise. The servers are stand-ins (FastAPI) that
answer as vLLM and llama.cpp do."""


import pytest

from tests.endpoint import audit_parser
from tests.endpoint.fake_vllm import fake_vllm
from tests.endpoint.test_fake_llama_cpp import fake_llama_server, _serve
from verispec.audit.endpoint.client import EndpointClient, EndpointConfig, audit_paired
from verispec.audit.endpoint.runner import EndpointAuditConfig, _speed_repeats, run_endpoint_audit
from verispec.audit.report import render_markdown
from verispec.audit.suite import SuitePrompt

TOKENS = 6
STEPS = 2  # verification steps per speculative request
# slice "drafts": every draft kept (4 tokens per verification); slice "misses": none kept
ACCEPTED = {"drafts": 6, "misses": 0}
PROMPTS = [SuitePrompt(f"p{i}", ("drafts", "misses")[i % 2], f"alpha beta {i}") for i in range(8)]


def behaviour(delay_s: float):
    """Every answer takes delay_s, whatever the slice; the slice decides what is accepted."""
    def behave(prompt: str):
        slice_ = "drafts" if int(prompt.split()[-1]) % 2 == 0 else "misses"
        return delay_s, STEPS, 6, ACCEPTED[slice_]
    return behave


@pytest.fixture(scope="module")
def vllm_servers():
    # the endpoint answers in half the reference's time on every slice: on "misses" no draft
    # is kept, so that speedup is not speculation's doing
    started = [_serve(fake_vllm(True, behaviour(0.02), TOKENS)), _serve(fake_vllm(False, behaviour(0.04), TOKENS))]
    yield started[0][3], started[1][3]
    for server, t, sock, _ in started:
        server.should_exit = True
        t.join(10)
        sock.close()


@pytest.fixture(scope="module")
def llama_servers():
    started = [_serve(fake_llama_server(True)), _serve(fake_llama_server(False))]
    yield started[0][3], started[1][3]
    for server, t, sock, _ in started:
        server.should_exit = True
        t.join(10)
        sock.close()


def _check(report, name):
    return next(c for c in report["checks"] if c["name"] == name)


def test_vllm_slices_get_per_request_acceptance_and_a_noise_verdict(vllm_servers):
    spec, plain = vllm_servers
    report = run_endpoint_audit(EndpointAuditConfig(spec, reference_url=plain, concurrency=(1, 2),
                                                    max_tokens=TOKENS, speed_repeats=3, only=("slices", "load")),
                                                    PROMPTS)
    runs = report["endpoint_runs"]["endpoint"]["levels"]
    # at concurrency 1 each answer carries the endpoint's counters over it alone; not above
    for r in runs[0]["results"]:
        assert r["server_info"] is None
        assert r["counter_spec"] == {"source": "vllm", "drafted": 6, "accepted": ACCEPTED[r["slice"]],
                                     "verify_steps": STEPS, "target_passes": None}
    assert all(r["counter_spec"] is None for r in runs[1]["results"])
    sl = _check(report, "slices")
    f, rows = sl["figures"], {r["slice"]: r for r in sl["details"]["slices"]}
    assert f["speed_repeats"] == 3 and f["pooled_pairs"] == 3 * len(PROMPTS)
    assert all(r["pairs"] == 3 * r["prompts"] for r in rows.values())
    assert rows["drafts"]["mean_accepted_length"] == pytest.approx(1 + 6 / STEPS)
    assert rows["misses"]["mean_accepted_length"] == pytest.approx(1.0)
    assert rows["drafts"]["figures_from"] == "/metrics counters per request (vllm)"
    # tokens per pass is what acceptance predicts from outside (an upper bound)
    assert rows["drafts"]["predicted"] == pytest.approx(4.0) and "upper bound" in f["predicted_from"]
    for r in rows.values():  # the endpoint answers in about half the time
        assert 1.3 < r["speedup"] < 3 and r["speedup_ci"][0] > 1
    assert rows["drafts"]["verdict"] == "faster"
    assert rows["misses"]["verdict"] == "noise" and rows["misses"]["speedup_text"].startswith("noise: ")
    assert f["noise_slices"] == ["misses"] and f["best_slice"] == f["worst_slice"] == "drafts"
    assert "1 noise" in sl["summary"]
    # the level's pooled counters stay the level's own: the repeats are not in them
    assert f["server_counters"]["draft_tokens"] == 6 * len(PROMPTS)
    assert f["pooled_mean_accepted_length"] == pytest.approx(1 + 3 / STEPS)
    load = _check(report, "load")["details"]["points"]["short"]
    assert [p["pairs"] for p in load] == [len(PROMPTS), len(PROMPTS) // 2]  # one a wave
    assert all(p["speedup_ci"] and p["verdict"] for p in load)
    md = render_markdown(report)
    assert "noise: " in md and "speedup [95% CI]" in md


def test_llama_cpp_answers_carry_their_own_figures(llama_servers):
    spec, plain = llama_servers
    report = run_endpoint_audit(EndpointAuditConfig(spec, reference_url=plain, concurrency=(1,), max_tokens=6,
                                                    speed_repeats=2, only=("slices",)), PROMPTS)
    assert all(r["counter_spec"] is None and r["server_info"]["drafted"] == 6
               for r in report["endpoint_runs"]["endpoint"]["levels"][0]["results"])
    sl = _check(report, "slices")
    f = sl["figures"]
    assert f["speed_repeats"] == 2 and f["pooled_pairs"] == 2 * len(PROMPTS)
    for r in sl["details"]["slices"]:
        assert r["figures_from"] == "responses (llama.cpp)" and r["acceptance_rate"] == pytest.approx(0.5)
        # no passes in a llama.cpp answer: each pass (the prefill's too) emits its accepted drafts
        # and one token, so 6 tokens with 3 accepted took 3 passes
        assert r["mean_accepted_length"] == pytest.approx(2.0) == r["predicted"]
        assert r["pairs"] == 2 * r["prompts"] and r["speedup_ci"] is not None and r["verdict"] is not None
    # the pooled row reads the level's counters: 1 + accepted / verification steps
    assert sl["details"]["pooled"]["predicted"] == pytest.approx(2.5)


def test_no_concurrency_1_level_means_no_repeats(llama_servers):
    spec, plain = llama_servers
    report = run_endpoint_audit(EndpointAuditConfig(spec, reference_url=plain, concurrency=(2,), max_tokens=6,
                                                    speed_repeats=3, only=("slices",)), PROMPTS)
    f = _check(report, "slices")["figures"]
    assert f["speed_repeats"] == 1 and f["pooled_pairs"] == len(PROMPTS)


def test_a_repeat_flips_the_order_of_every_wave(llama_servers, monkeypatch):
    spec, plain = llama_servers
    calls = []
    real = EndpointClient.complete

    async def logged(self, model, pid, slice_, prompt):
        calls.append("end" if self.cfg.url == spec else "ref")
        return await real(self, model, pid, slice_, prompt)
    monkeypatch.setattr(EndpointClient, "complete", logged)
    cfg = EndpointConfig(spec, max_tokens=6, concurrency=(1,))
    ref_cfg = EndpointConfig(plain, max_tokens=6)
    audit_paired(cfg, ref_cfg, PROMPTS[:4])
    audit_paired(cfg, ref_cfg, PROMPTS[:4], reference_first=True)
    assert calls == ["end", "ref", "ref", "end"] * 2 + ["ref", "end", "end", "ref"] * 2
    run, ref = audit_paired(cfg, ref_cfg, PROMPTS[:4])
    assert len(run.levels[0].wave_walls) == len(ref.levels[0].wave_walls) == 4
    assert sum(run.levels[0].wave_walls) == pytest.approx(run.levels[0].wall_s)


def test_speed_repeats_option():
    p = audit_parser()
    assert _speed_repeats(p.parse_args([])) == 3 and _speed_repeats(p.parse_args(["--quick"])) == 2
    assert _speed_repeats(p.parse_args(["--quick", "--speed-repeats", "5"])) == 5
    with pytest.raises(SystemExit):
        p.parse_args(["--speed-repeats", "0"])
    with pytest.raises(ValueError, match="speed_repeats"):
        run_endpoint_audit(EndpointAuditConfig("http://127.0.0.1:9", speed_repeats=0), PROMPTS)
