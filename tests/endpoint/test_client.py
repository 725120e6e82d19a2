"""The endpoint audit client: suite prompts at temperature 0 under concurrency against a
live server, /metrics speculative counters of verispec, vLLM and SGLang."""

import pytest

from tests.server.helpers import LiveServer, make_state, reference_text
from verispec.audit.suite import SuitePrompt
from verispec.audit.endpoint.client import (EndpointClient, EndpointConfig, audit_endpoint, audit_paired,
                                            first_divergence)
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


def test_paired_run_alternates_waves_and_keeps_the_counters_apart(server, monkeypatch):
    """run_paired: each wave of c prompts to one side, then to the other, the order
    alternating; on a shared server each side's counters hold only its own requests."""
    calls = []
    real = EndpointClient.complete

    async def logged(self, model, pid, slice_, prompt):
        calls.append(("ref" if self.cfg.extra_body else "end", pid))
        return await real(self, model, pid, slice_, prompt)
    monkeypatch.setattr(EndpointClient, "complete", logged)
    cfg = EndpointConfig(server.url, chat=False, max_tokens=12, concurrency=(1, 3), logprobs=True)
    ref_cfg = EndpointConfig(server.url, chat=False, max_tokens=12, logprobs=True,
                             extra_body={"verispec": {"speculate": False}})
    run, ref = audit_paired(cfg, ref_cfg, PROMPTS)
    c1 = [side for side, _ in calls[:2 * len(PROMPTS)]]
    assert c1 == ["end", "ref", "ref", "end"] * (len(PROMPTS) // 2)  # one prompt a wave, order alternating
    c3 = calls[2 * len(PROMPTS):]
    assert [side for side, _ in c3[:6]] == ["end"] * 3 + ["ref"] * 3 and [side for side, _ in c3[6:9]] == ["ref"] * 3
    assert {pid for _, pid in c3[:3]} == {pid for _, pid in c3[3:6]} == {"p0", "p1", "p2"}
    for lv, rv in zip(run.levels, ref.levels):
        n = lv.concurrency
        assert lv.waves == rv.waves == [list(range(i, min(i + n, len(PROMPTS)))) for i in range(0, len(PROMPTS), n)]
        assert [r.id for r in lv.results] == [r.id for r in rv.results] == [p.id for p in PROMPTS]
        assert all(r.ok for r in lv.results + rv.results)
        assert [r.text for r in lv.results] == [r.text for r in rv.results]  # greedy: speculation is invisible
        # the reference's plain rows are not in the endpoint's counters, nor the drafts in the reference's
        assert lv.spec.generation_tokens == sum(r.completion_tokens for r in lv.results)
        assert rv.spec.generation_tokens == sum(r.completion_tokens for r in rv.results)
        assert lv.spec.draft_tokens == sum(r.server_info["drafted"] for r in lv.results) > 0
        assert rv.spec.draft_tokens == 0 and lv.wall_s > 0 and rv.wall_s > 0
    assert run.to_dict()["levels"][1]["waves"] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_counter_intervals_add_up():
    from verispec.audit.endpoint.counters import SpecCounters
    a = SpecCounters("verispec", 2, 6, 3, [2, 1], [2, 2, 2], 10, 5)
    b = SpecCounters("verispec", 1, 3, 2, [1, 1, 0], [1, 1, 1], 4, 2)
    s = a.plus(b)
    assert (s.drafts, s.draft_tokens, s.accepted_tokens, s.generation_tokens, s.target_passes) == (3, 9, 5, 14, 7)
    assert s.accepted_per_position == [3, 2, 0] and s.drafted_per_position == [3, 3, 3]
    with pytest.raises(ValueError, match="cannot add"):
        a.plus(SpecCounters("vllm", 1, 1, 1))


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
