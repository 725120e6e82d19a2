"""Corruption judged from outside catches a server that truly corrupts its output: `verispec
serve` on SmolLM2 with prompt lookup and a row-bookkeeping fault from the project's fault
list (audit/faults/ `row-leak`: a row's pending token leaks into its neighbour's verify
input every 5th step), audited with only the corruption check against a clean plain
`verispec serve` as the reference. The leak garbles some outputs at concurrency 8; the
check must flag them beyond the null (the reference diverging from itself), scored by the
reference's own tokens and prompt_logprobs, never by the faulty server's own logprobs.

About 3 minutes on 2 cores: two servers start (~20 s each), then 16 prompts at c = 8."""

from __future__ import annotations

import pytest

from tests.verispec_server import VerispecServer
from verispec.audit.context import select_prompts
from verispec.audit.suite import load_suite

pytestmark = pytest.mark.slow


def serve(*args: str):
    return VerispecServer("smollm2-135m", "--threads", "1", *args)


@pytest.fixture(scope="module")
def converted():
    from verispec.models.presets import get_preset, is_converted
    if not is_converted(get_preset("smollm2-135m")):
        pytest.skip("SmolLM2 preset not converted (verispec models pull smollm2-135m)")


def test_a_row_leak_fails_corruption_from_outside(converted):
    from verispec.audit.endpoint.runner import EndpointAuditConfig, run_endpoint_audit

    prompts = select_prompts(load_suite("default"), 2)
    with serve() as plain, serve("--draft", "lookup", "--inject-fault", "row-leak") as faulty:
        report = run_endpoint_audit(EndpointAuditConfig(faulty, reference_url=plain, max_tokens=64,
                                                        concurrency=(8,), only=("corruption",)), prompts)
    corruption = next(c for c in report["checks"] if c["name"] == "corruption")
    assert not corruption["passed"], corruption["summary"]
    assert corruption["figures"]["tokens"] == "the reference's tokens (verispec /tokenize)"
    flagged = corruption["details"]["flagged"]
    assert flagged and all(f["reference"] and f["text"] != f["reference"] for f in flagged)
    # garbled text, not a missing score: the reference scored the faulty server's output
    assert any(s.startswith(("perplexity", "repeated", "repetition loop", "character run"))
               for f in flagged for s in f["signatures"])
    assert not corruption["details"]["null_flagged"]  # the clean reference never looked corrupt
