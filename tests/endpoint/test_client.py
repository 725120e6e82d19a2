"""The endpoint audit client: suite prompts at temperature 0 under concurrency against a
live server, /metrics speculative counters of verispec, vLLM and SGLang."""

import pytest

from tests.server.helpers import LiveServer, make_state, reference_text
from verispec.audit.suite import SuitePrompt
from verispec.audit.endpoint.client import EndpointConfig, audit_endpoint, first_divergence
from verispec.audit.endpoint.null import compare
from verispec.audit.endpoint.counters import MetricsParseError, parse_prometheus

PROMPTS = [SuitePrompt(f"p{i}", "letters" if i % 2 else "words", text) for i, text in enumerate(
    ["hello there", "abc abc abc", "the quick brown fox", "zz", "one, two, three", "lorem ipsum", "q", "xyzzy"])]


@pytest.fixture(scope="module")
def server():
    with LiveServer(make_state(drafter="draft", k=3, max_batch=4)) as s:
        yield s


def test_endpoint_run_under_concurrency(server):
    cfg = EndpointConfig(server.url + "/v1", chat=False, max_tokens=12, concurrency=(1, 4), logprobs=True)
    run = audit_endpoint(cfg, PROMPTS)
    assert run.model == "tiny" and run.kind == "verispec"
    assert run.logprobs is True  # verispec scores each answer with the target (temperature 1)
    for level in run.levels:
        assert [r.id for r in level.results] == [p.id for p in PROMPTS]
        for p, r in zip(PROMPTS, level.results):
            assert r.ok, r.error
            want, reason = reference_text(p.prompt, 12)
            assert (r.text, r.finish_reason) == (want, reason)  # equal to plain decoding
            assert r.latency_s > 0 and r.completion_tokens >= 1
            assert len(r.token_ids) == r.completion_tokens and all(m is not None and m >= 0 for m in r.top2_margins)
            assert all(t[0][0] == w for t, w in zip(r.top, r.tokens))  # greedy: the emitted token is top-1
        s = level.summary()
        assert s["errors"] == 0 and s["tokens_per_s"] > 0
        assert level.spec.source == "verispec" and level.spec.draft_tokens > 0
        assert 0 < level.spec.acceptance_rate < 1
        assert len(level.spec.acceptance_per_position) == 3
    # the same server as its own reference: speculation off
    ref = audit_endpoint(EndpointConfig(server.url, chat=False, max_tokens=12, concurrency=(1,),
                                        extra_body={"verispec": {"speculate": False}}), PROMPTS)
    assert ref.levels[0].spec.draft_tokens == 0
    rows = compare(ref.levels[0].results, run.levels[-1].results, 4).rows
    assert all(r["error"] is None and r["exact"] for r in rows)
    assert run.to_dict()["levels"][1]["concurrency"] == 4


def test_chat_and_errors_are_recorded(server):
    run = audit_endpoint(EndpointConfig(server.url, model="tiny", chat=True, max_tokens=8, concurrency=(2,)),
                         PROMPTS[:3])
    assert all(r.ok and r.text is not None for r in run.levels[0].results)
    bad = audit_endpoint(EndpointConfig(server.url, model="nope", chat=True, concurrency=(1,)), PROMPTS[:1])
    assert bad.levels[0].results[0].error.startswith("HTTP 404")


def test_prometheus_parser_and_divergence():
    s = parse_prometheus('# TYPE a_total counter\na_total{x="q\\"uote",position="1"} 2\n# c\nb 1.5e3 1700000000\n')
    assert s == [("a_total", {"x": 'q"uote', "position": "1"}, 2.0), ("b", {}, 1500.0)]
    with pytest.raises(MetricsParseError, match="unparseable"):
        parse_prometheus("garbage line\n")
    assert first_divergence("abc", "abc") is None
    assert first_divergence("abc", "abd") == 2 and first_divergence("ab", "abc") == 2


def test_server_package_does_not_import_the_audit():
    """server/ is verispec's own HTTP API: the endpoint audit lives under audit/endpoint/."""
    import pathlib
    import re

    import verispec.server
    root = pathlib.Path(verispec.server.__file__).parent
    offenders = [f"{p.name}: {line.strip()}" for p in root.glob("*.py") for line in p.read_text().splitlines()
                 if re.match(r"\s*(from\s+(\.\.|verispec\.)audit|import\s+verispec\.audit)", line)]
    assert offenders == []
    assert not (root / "endpoint_audit.py").exists() and not (root / "client_audit.py").exists()
