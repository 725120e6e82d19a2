"""One request's failure never touches another's: a row whose logits are not finite, a
drafter or a forward pass that raises on one row's input, or a prefill that fails ends
that request alone with finish_reason "error" and a message; every other request goes
on and emits exactly what it emits without the failing one."""

import pytest
import torch

from tests.engine.test_engine_tiny import V, _prompts
from tests.tiny import native_from_hf, tiny_hf
from verispec.drafters.lookup import PromptLookupDrafter
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.policy import FixedK
from verispec.sampling import SamplingParams

PROMPTS = _prompts(12, seed=31)  # up to 39 tokens, and at most 14 new ones
BAD_LEN = 77  # the failing request's prompt length: no other row ever holds this many tokens


@pytest.fixture(scope="module")
def target():
    return native_from_hf(tiny_hf("llama", seed=2, vocab=V, embed_scale=20.0))


def _bad_rows(cache, rows, x, num_new, prefill: bool):
    """[B] bool: the rows of this pass that hold the failing request. A verify pass of it
    starts from BAD_LEN - 1 cached tokens; its prefill writes BAD_LEN - 1 tokens."""
    rows = torch.as_tensor(rows).reshape(-1)
    n = torch.as_tensor(num_new if num_new is not None else [x.shape[1]] * len(rows)).reshape(-1)
    if prefill:
        return n == BAD_LEN - 1
    return (cache.lengths[rows] >= BAD_LEN - 1) & (n < BAD_LEN - 1)


class NanForBad:
    """The model, except the failing request's verify passes get NaN logits."""

    prefill = False

    def __init__(self, model):
        self.model, self.config = model, model.config

    def new_cache(self, *a, **kw):
        return self.model.new_cache(*a, **kw)

    def forward(self, x, cache, rows, num_new=None, **kw):
        bad = _bad_rows(cache, rows, x, num_new, self.prefill)  # before the pass moves lengths
        out = self.model.forward(x, cache, rows, num_new, **kw)
        if bad.any():
            out = out.clone()
            self.poison(out, bad)
        return out

    def poison(self, out, bad):
        out[bad] = float("nan")


class OneLogitForBad(NanForBad):
    """One logit of the failing request's first verified position is set to `value` (the
    engine's finiteness check must see a single bad entry among the vocabulary's)."""

    value = float("inf")

    def poison(self, out, bad):
        out[bad, 0, 7] = self.value  # a verify pass: [B, K+1, V]


class RaisingForBad(NanForBad):
    def forward(self, x, cache, rows, num_new=None, **kw):
        if bool(_bad_rows(cache, rows, x, num_new, self.prefill).any()):
            raise RuntimeError("kernel fault on this input")
        return self.model.forward(x, cache, rows, num_new, **kw)


class RaisingPrefill(RaisingForBad):
    prefill = True


class PoisonedLookup(PromptLookupDrafter):
    def propose(self, rows, tokens, k, sampling, generators, **kw):
        if any(len(t) >= BAD_LEN for t in tokens):
            raise IndexError("drafter bug on this row")
        return super().propose(rows, tokens, k, sampling, generators, **kw)


def _reqs(prompts, temperature=0.0):
    return [Request(p, GenerationParams(max_new_tokens=10 + i % 5, sampling=SamplingParams(
        temperature=temperature, seed=None if temperature == 0 else 50 + i))) for i, p in enumerate(prompts)]


def _reference(target, temperature):
    eng = Engine(target, PromptLookupDrafter(2), FixedK(3), EngineConfig(max_batch=4, max_len=128))
    return [r.output_ids for r in eng.run(_reqs(PROMPTS, temperature))]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("fault", ["nan-logits", "one-inf-logit", "one-neg-inf-logit", "one-nan-logit",
                                   "forward-raises", "drafter-raises", "prefill-raises"])
def test_one_failing_row_fails_alone(target, fault, temperature):
    ref = _reference(target, temperature)
    one = {"one-inf-logit": float("inf"), "one-neg-inf-logit": float("-inf"), "one-nan-logit": float("nan")}
    model = {"nan-logits": NanForBad, "forward-raises": RaisingForBad,
             "drafter-raises": lambda m: m, "prefill-raises": RaisingPrefill,
             **{f: type("One", (OneLogitForBad,), {"value": v}) for f, v in one.items()}}[fault](target)
    drafter = PoisonedLookup(2) if fault == "drafter-raises" else PromptLookupDrafter(2)
    eng = Engine(model, drafter, FixedK(3), EngineConfig(max_batch=4, max_len=128))
    reqs = _reqs(PROMPTS, temperature)
    bad_prompt = (PROMPTS[2] * BAD_LEN)[:BAD_LEN]
    bad = Request(bad_prompt, GenerationParams(max_new_tokens=8, sampling=reqs[2].params.sampling))
    all_reqs = reqs[:2] + [bad] + reqs[2:]
    eng.run(all_reqs)
    assert bad.finish_reason == "error" and bad.error and "other requests were not affected" in bad.error
    assert [r.output_ids for r in reqs] == ref
    assert all(r.finish_reason in ("stop", "length") for r in reqs)
    assert eng.cache.rows_in_use == 0 and not eng.running and not eng.waiting


def test_a_failure_in_a_single_row_batch_frees_the_row(target):
    eng = Engine(RaisingForBad(target), None, FixedK(0), EngineConfig(max_batch=1, max_len=128))
    bad = Request((PROMPTS[1] * BAD_LEN)[:BAD_LEN], GenerationParams(max_new_tokens=4))
    good = Request(PROMPTS[0], GenerationParams(max_new_tokens=4))
    eng.run([bad, good])
    assert bad.finish_reason == "error" and "RuntimeError" in bad.error
    assert good.finish_reason in ("stop", "length") and len(good.output_ids) >= 1
    assert eng.cache.rows_in_use == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("contiguous", [True, False])
def test_finite_positions_flags_every_non_finite_position(dtype, contiguous):
    """The engine's finiteness check (numpy on contiguous float32, torch elsewhere) flags a
    position exactly when one of its logits is NaN, +inf or -inf."""
    from verispec.engine.core import finite_positions
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 1000, generator=g, dtype=torch.float64).to(dtype) * 30
    x[0, 1, 999] = float("nan")
    x[1, 0, 0] = float("inf")
    x[2, 3, 500] = -float("inf")
    if not contiguous:
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    want = torch.isfinite(x).all(-1).tolist()
    assert finite_positions(x) == want
    assert sum(not f for row in want for f in row) == 3
