"""The speedup floor from outside, against stand-in servers that answer as vLLM does (no
speculative fields in a response, counters in /metrics): acceptance per request from the
counters' difference guides the search, the edits that defeat the stand-in's drafter are
found and confirmed side by side, and --min-speedup gates on the interval."""

import pytest

from tests.endpoint.fake_vllm import fake_vllm
from tests.endpoint.test_fake_llama_cpp import _serve
from verispec.audit.endpoint.runner import EndpointAuditConfig, run_endpoint_audit
from verispec.audit.floor import FloorBudget
from verispec.audit.report import render_markdown
from verispec.audit.suite import SuitePrompt

TOKENS = 8
PROMPTS = [SuitePrompt(f"{s}-{i}", s, f"{s} question {i}: describe the parser and its cache in detail")
           for s in ("code", "chat", "math") for i in range(2)]
# the stand-in drafter loses on the edits aimed at it: another script, or a trap phrase
DEFEATED = ("Write your whole answer in", "more lines of the form", "Never reuse", "Do not quote", "Restate each")


def defeated(prompt: str) -> bool:
    return any(m in prompt for m in DEFEATED)


def behave(prompt: str):
    """plain: 100 ms a request; speculative: 50 ms where its drafts land (4 of 4 kept per
    step), 250 ms where they do not (1 of 16 in all): far enough apart that a busy machine's
    jitter cannot hide them."""
    bad = defeated(prompt)
    return (0.25 if bad else 0.05), 4, 16, (1 if bad else 4)


def plain(prompt: str):
    return 0.1, 0, 0, 0


@pytest.fixture(scope="module")
def servers():
    started = [_serve(fake_vllm(True, behave, TOKENS)), _serve(fake_vllm(False, plain, TOKENS))]
    yield started[0][3], started[1][3]
    for server, t, sock, _ in started:
        server.should_exit = True


def audit(servers, **kw):
    spec, plain = servers
    return run_endpoint_audit(EndpointAuditConfig(spec, reference_url=plain, only=("speedup-floor",),
                                                  seed=kw.pop("seed", 0), sampled_tokens=0, **kw), PROMPTS)


def floor_of(report):
    return next(c for c in report["checks"] if c["name"] == "speedup-floor")


def test_the_search_finds_and_confirms_what_defeats_the_drafter(servers, monkeypatch):
    monkeypatch.setattr(FloorBudget, "quick", classmethod(lambda cls: cls(
        seeds=4, candidates=8, max_new_tokens=TOKENS, population=3, confirm=2, repeats=4)))
    report = audit(servers, seed=2)
    f = floor_of(report)
    fig = f["figures"]
    assert fig["search"]["guide"] == "per request: /metrics counters (vllm)"
    cands = {d["id"]: d for d in f["details"]["candidates"]}
    assert all(d["drafted"] == 16 for d in cands.values())  # the counters' difference around each request
    assert cands[fig["floor_prompt"]]["edits"] and defeated(cands[fig["floor_prompt"]]["text"])
    assert fig["floor"] < 0.6 and fig["floor_ci_high"] < 1  # ~100/250 ms, confirmed over 4 pairs
    assert f["passed"] and f["informational"]
    md = render_markdown(report)
    assert "Speedup floor: the worst prompts found" in md and fig["floor_prompt"] in md
    # the same seed and budget evaluate the same prompts
    again = floor_of(audit(servers, seed=2))
    assert [d["text"] for d in again["details"]["candidates"]] == [d["text"] for d in cands.values()]


def test_min_speedup_gates_on_the_interval(servers, monkeypatch):
    monkeypatch.setattr(FloorBudget, "quick", classmethod(lambda cls: cls(
        seeds=4, candidates=8, max_new_tokens=TOKENS, population=3, confirm=2, repeats=4)))
    gated = audit(servers, seed=2, min_speedup=0.95)
    f = floor_of(gated)
    assert not f["passed"] and f["figures"]["below_min_speedup"] and gated["verdict"] == "fail"
    assert floor_of(audit(servers, seed=2, min_speedup=0.3))["passed"]


def test_without_a_reference_the_floor_says_why_not(servers):
    spec, _ = servers
    report = run_endpoint_audit(EndpointAuditConfig(spec, only=("speedup-floor",), sampled_tokens=0), PROMPTS)
    f = floor_of(report)
    assert f["passed"] and "no plain reference" in f["summary"]


def test_floor_settle_is_checked_at_the_edge():

    from tests.endpoint import audit_parser
    ap = audit_parser()
    assert ap.parse_args(["--floor-settle", "2"]).floor_settle == 2.0
    for bad in ("-1", "x", "61"):
        with pytest.raises(SystemExit):
            ap.parse_args(["--floor-settle", bad])
