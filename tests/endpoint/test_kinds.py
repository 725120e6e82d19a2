"""Parsers of other servers' answers, on fixtures taken from their sources and docs
(tests/endpoint/fixtures/README.md says where each comes from)."""

import json
import pathlib

import pytest

from verispec.audit.endpoint.counters import MetricsParseError, response_spec, server_kind, spec_counters
from verispec.audit.endpoint.kinds import from_llama_cpp, from_sglang, from_tgi, from_verispec, from_vllm

FIX = pathlib.Path(__file__).parent / "fixtures"


def text(name):
    return (FIX / name).read_text()


def doc(name):
    return json.loads(text(name))


def test_llama_cpp_counters():
    page = text("llamacpp_metrics.txt")
    assert server_kind(page) == "llama.cpp"
    c = spec_counters(page)
    assert c.source == "llama.cpp" and not c.from_gauges
    assert (c.drafts, c.draft_tokens, c.accepted_tokens) == (400, 1600, 480)
    assert c.acceptance_rate == pytest.approx(0.3)
    assert c.mean_acceptance_length == pytest.approx(1 + 480 / 400)  # per verification step, bonus included
    assert c.acceptance_per_position == pytest.approx([0.6, 0.35, 0.175, 0.075])  # steps accepting position i
    assert c.generation_tokens == 1024
    later = spec_counters(page.replace("num_drafts_total 400", "num_drafts_total 410")
                          .replace("num_draft_tokens_total 1600", "num_draft_tokens_total 1640")
                          .replace('position="0"} 240', 'position="0"} 246'))
    d = later.delta(c)
    assert (d.drafts, d.draft_tokens, d.accepted_tokens) == (10, 40, 0)
    assert d.accepted_per_position == [6, 0, 0, 0]


def test_llama_cpp_props_and_timings():
    info = from_llama_cpp(doc("llamacpp_props.json"))
    assert info.kind == "llama.cpp" and info.version == "b1-0d6a3b2"
    assert info.speculative == {"speculative.types": "ngram_simple"}
    assert info.settings["total_slots"] == 8 and info.settings["n_ctx"] == 2048
    assert info.sampler_defaults["top_k"] == 40 and info.sampler_defaults["min_p"] == 0.05
    assert from_llama_cpp(doc("vllm_version.json")) is None
    spec = response_spec(doc("llamacpp_chat_final_chunk.json"))
    assert spec == {"source": "llama.cpp", "drafted": 96, "accepted": 33, "verify_steps": None,
                    "target_passes": None}
    # llama.cpp leaves draft_n out when the request drafted nothing: zero, not unknown
    plain = doc("llamacpp_chat_final_chunk.json")
    del plain["timings"]["draft_n"], plain["timings"]["draft_n_accepted"]
    assert response_spec(plain)["drafted"] == 0
    assert response_spec({"choices": [{"delta": {"content": "x"}}]}) is None


def test_vllm_counters_version_and_per_request_metrics():
    page = text("vllm_metrics.txt")
    assert server_kind(page) == "vllm"
    c = spec_counters(page)
    assert c.source == "vllm" and c.acceptance_rate == 0.5 and c.mean_acceptance_length == 2.5
    assert c.acceptance_per_position == [0.8, 0.45, 0.25]
    assert c.generation_tokens == 4096  # not confused with the _created gauge
    v = from_vllm(doc("vllm_version.json"))
    assert v.kind == "vllm" and v.version == "0.11.2"
    spec = response_spec(doc("vllm_response.json"))
    assert spec == {"source": "vllm", "drafted": 129, "accepted": 10, "verify_steps": 43, "target_passes": None}


def test_sglang_gauges_are_gauges():
    page = text("sglang_metrics.txt")
    assert server_kind(page) == "sglang"
    g = spec_counters(page)
    assert g.source == "sglang" and g.from_gauges
    assert g.accept_length_gauge == 2.65 and g.accept_rate_gauge == 0.55
    # no level figures from gauges: acceptance and tokens per pass stay unknown
    assert g.acceptance_rate is None and g.mean_acceptance_length is None
    assert g.to_dict()["from_gauges"] is True
    info = from_sglang(doc("sglang_server_info.json"))
    assert info.kind == "sglang" and info.version == "0.5.4"
    assert info.speculative["speculative_algorithm"] == "EAGLE"
    assert info.speculative["speculative_num_draft_tokens"] == 16
    assert info.settings["max_running_requests"] == 48
    assert from_vllm(doc("sglang_server_info.json")) is None


def test_tgi_and_verispec_documents():
    t = from_tgi(doc("tgi_info.json"))
    assert t.kind == "tgi" and t.version == "3.0.0" and t.settings["model_id"] == "bigscience/blomm-560m"
    assert from_tgi(doc("llamacpp_props.json")) is None
    v = from_verispec({"data": [{"id": "tiny", "verispec": {"version": "0.1.0", "drafter": "lookup", "k": 4,
                                                            "policy": "fixed", "rule": "rejection", "lossy": False}}]})
    assert v.kind == "verispec" and v.speculative["rule"] == "rejection" and v.version == "0.1.0"
    assert from_verispec({"data": [{"id": "m"}]}) is None and from_verispec({"oops": 1}) is None


def test_bad_pages():
    assert spec_counters("# HELP x y\n# TYPE x counter\nx_total 3\n") is None
    with pytest.raises(MetricsParseError):
        spec_counters("<html>not metrics</html>\n")
