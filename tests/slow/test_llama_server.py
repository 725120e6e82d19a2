"""The endpoint audit against llama.cpp's own server (slow): SmolLM2-135M (the preset's
Q4_1 GGUF) served by llama-server built from the pinned sdist, plain and with prompt-lookup
speculation (ngram-simple), 8 slots, greedy.

* plain vs plain (the null run): equivalence passes at concurrency 1 and 8, whatever the
  server's batching does to its numerics: that is what the null measures;
* speculative vs plain: the server is named with its version, and the acceptance
  figures in the report are the counters' own, as scraped here around the audit.
"""

from __future__ import annotations

import pytest

from tests.llama_server import NGRAM, LlamaServer, binary
from verispec.audit.endpoint.counters import spec_counters
from verispec.audit.suite import load_suite

pytestmark = pytest.mark.slow
LEVELS = (1, 8)


@pytest.fixture(scope="module")
def gguf():
    from verispec.models.presets import PresetNotInstalledError, get_preset, locate_parts
    try:
        return locate_parts(get_preset("smollm2-135m"))[0]
    except PresetNotInstalledError as e:
        pytest.skip(f"SmolLM2 preset not installed: {e}")


@pytest.fixture(scope="module")
def servers(gguf):
    exe, why = binary()
    if exe is None:
        pytest.skip(f"llama-server unavailable: {why}")
    with LlamaServer(gguf) as plain, LlamaServer(gguf, spec=NGRAM) as spec:
        yield plain, spec


@pytest.fixture(scope="module")
def prompts():
    by_slice: dict[str, list] = {}
    for p in load_suite("default"):
        by_slice.setdefault(p.slice, []).append(p)
    return [p for ps in by_slice.values() for p in ps[:2]]  # 16 prompts, every slice


def _audit(url, ref, prompts, **kw):
    from verispec.audit.endpoint.runner import EndpointAuditConfig, run_endpoint_audit
    return run_endpoint_audit(EndpointAuditConfig(url, reference_url=ref, max_tokens=48, concurrency=LEVELS, **kw),
                                                  prompts)


def _all_but(*names):
    from verispec.audit.checks import selectable
    return tuple(n for n in selectable("endpoint") if n not in names)


def test_null_run_passes_equivalence(servers, prompts):
    plain, _ = servers
    report = _audit(plain.url, plain.url, prompts, only=("equivalence",))
    eq = next(c for c in report["checks"] if c["name"] == "equivalence")
    assert eq["passed"], eq["summary"]
    assert [r["batch"] for r in eq["details"]["per_batch"]] == list(LEVELS)
    assert all(r["errors"] == 0 for r in eq["details"]["per_batch"])
    assert report["record"]["server"]["kind"] == "llama.cpp"
    assert "no speculation" in report["record"]["drafter"]["name"]


def test_speculative_run_reports_the_counters(servers, prompts):
    _, spec = servers
    plain = servers[0]
    import httpx
    before = spec_counters(httpx.get(spec.url + "/metrics").text)
    # the greedy runs of every level and nothing else: the floor's search and the slices'
    # further timed pairs are requests of their own, outside the load check's levels
    report = _audit(spec.url, plain.url, prompts, speed_repeats=1,
                    only=_all_but("speedup-floor", "seeded", "stopping"))  # these two send requests of their own
    after = spec_counters(httpx.get(spec.url + "/metrics").text)
    total = after.delta(before)
    rec = report["record"]
    props = httpx.get(spec.url + "/props").json()
    assert rec["server"]["kind"] == "llama.cpp" and rec["server"]["version"] == props["build_info"]
    assert "speculative in 8 of 8 slots" in rec["drafter"]["name"]
    load = next(c for c in report["checks"] if c["name"] == "load")
    levels = [p["server_counters"] for p in load["details"]["points"]["short"]]
    assert total.draft_tokens > 0
    # the report's per-level counters add up to what the server counted over the audit
    assert sum(lv["draft_tokens"] for lv in levels) == total.draft_tokens
    assert sum(lv["accepted_tokens"] for lv in levels) == total.accepted_tokens
    assert sum(lv["drafts"] for lv in levels) == total.drafts
    sl = next(c for c in report["checks"] if c["name"] == "slices")["figures"]
    c1 = levels[0]
    assert sl["pooled_acceptance_rate"] == pytest.approx(c1["accepted_tokens"] / c1["draft_tokens"])
    assert sl["pooled_mean_accepted_length"] == pytest.approx(1 + c1["accepted_tokens"] / c1["drafts"])
    assert sl["pooled_acceptance_per_position"] == pytest.approx(
        [a / c1["drafts"] for a in c1["accepted_per_position"]])
    assert sl["responses_agree_with_counters"] is True  # timings.draft_n summed == the counters
    eq = next(c for c in report["checks"] if c["name"] == "equivalence")
    print(eq["summary"], sl)
    assert eq["passed"], eq["summary"]


def test_sampled_distribution_of_the_speculative_server(servers, prompts):
    """At temperature 1 with every llama.cpp sampler setting sent as off: llama-server sends
    no logprobs for the tokens of a speculative verification step (its tools/server sets
    none: "TODO: set result.probs"), so the check counts them, says they are untested and
    does not pass; the tokens that do carry logprobs follow them (the top-20 + tail PIT)."""
    from verispec.audit.endpoint.client import EndpointConfig
    from verispec.audit.endpoint.sampled import distribution_figures, sampled_run
    _, spec = servers
    run = sampled_run(EndpointConfig(spec.url, max_tokens=48), "llama.cpp", prompts, 1024, 8)
    f = distribution_figures(run)
    print({k: v for k, v in f.items() if k not in ("histogram", "tests")})
    assert f["failed_answers"] == 0 and f["unscored_tokens"] == 0
    drafted = sum((r.server_info or {}).get("drafted") or 0 for lv in run.levels for r in lv.results)
    accepted = sum((r.server_info or {}).get("accepted") or 0 for lv in run.levels for r in lv.results)
    assert drafted > 0  # the sampled answers were speculative
    # every emitted token is either scored or counted as sent without logprobs
    assert f["n"] + f["tokens_without_logprobs"] == f["emitted_tokens"]
    # a verification step's tokens come without logprobs (a step may stop an answer at its
    # length limit after counting drafts as accepted, so no exact match with `accepted`)
    print(f"drafted {drafted}, accepted {accepted}, sent without logprobs {f['tokens_without_logprobs']}")
    assert accepted > 0 and f["tokens_without_logprobs"] > 0
    assert f["n"] >= 300 and f["p_value"] > 1e-3, f  # what is scored follows the logprobs
    assert not f["passed"] and "no logprobs for" in f["reason"]  # the untested tokens are no pass
