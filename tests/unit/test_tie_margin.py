"""The audit's near-tie margin per backend (audit/equivalence.tie_margin_for): fixed on the
fp32 native runtime, the backend's own measured batching noise on one that declares noisy
numerics, and a wider margin still fails a real fault.

A stand-in noisy backend: the tiny native model whose logits move with the width of the
pass (as llama.cpp's Q4_K kernels do), by a known, small amount."""

from __future__ import annotations

import pytest
import torch

from tests.audit_tiny import TINY_SIZES, CharTokenizer, one_thread, tiny_audit, tiny_drafter_factory, tiny_models, tiny_suite
from verispec.audit.context import AuditConfig
from verispec.audit.stats import fisher_greater
from verispec.audit.equivalence import TIE_MARGIN, tie_margin_for
from verispec.audit.equivalence import NULL_ALPHA
from verispec.audit.runner import run_audit
from verispec.models import LoadedModel
from verispec.models.noise import batching_noise

WOBBLE = 0.002  # the largest logit move of a one-token pass against a wider one (below the
# tiny model's margins where a fault diverges: 0.003 and up)


class PassWidthNoise:
    """Delegates to a CausalLM; a one-token pass adds WOBBLE * (v / V) to logit v, so a gap
    between two tokens moves by up to WOBBLE with the pass width, never with the cache."""

    noisy_numerics = True

    def __init__(self, model, wobble: float = WOBBLE):
        self._m, self.wobble = model, wobble
        self.forwards = 0

    def __getattr__(self, name):
        return getattr(self._m, name)

    def forward(self, tokens, cache, rows, num_new=None, **kw):
        self.forwards += 1
        out = self._m.forward(tokens, cache, rows, num_new, **kw)
        if tokens.shape[1] == 1:
            V = out.shape[-1]
            out = out + self.wobble * torch.arange(V, dtype=out.dtype) / V
        return out


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def models():
    return tiny_models()


def test_fp32_backend_keeps_the_fixed_margin(models):
    tie = tie_margin_for(models[0])
    assert tie["value"] == TIE_MARGIN and tie["source"].startswith("fixed")


def test_noisy_backend_gets_its_measured_noise_once(models):
    noisy = PassWidthNoise(models[0])
    tie = tie_margin_for(noisy)
    assert tie["value"] == pytest.approx(batching_noise(noisy, seeds=(0, 1, 2))["margin"])
    assert TIE_MARGIN < tie["value"] <= WOBBLE + 1e-6  # what the stand-in moves, measured
    assert tie["noise_top2_gap"] == tie["value"] and "models/noise.py" in tie["source"]
    n = noisy.forwards
    assert tie_margin_for(noisy) == tie and noisy.forwards == n  # measured once per model


def _only_equivalence(noisy, models, fault=None):
    cfg = AuditConfig(target="tiny-llama", draft="tiny-draft-model", k=3, policy="fixed",
                      batch_sizes=(1, 4, 8), sizes=TINY_SIZES, inject_fault=fault,
                      only=("equivalence", "drafter-consistency"))
    return run_audit(cfg, target=LoadedModel(noisy, CharTokenizer(), None),
                     drafter_factory=tiny_drafter_factory((noisy, models[1])), prompts=tiny_suite())


def test_audit_records_the_measured_margin_and_still_fails_a_fault(models):
    noisy = PassWidthNoise(models[0])
    ok = _only_equivalence(noisy, models)
    eq = next(c for c in ok.checks if c.name == "equivalence")
    assert eq.passed, eq.summary
    assert eq.figures["tie_margin"] == tie_margin_for(noisy)["value"] > TIE_MARGIN
    assert eq.figures["tie_margin_source"]["source"].startswith("measured")
    assert eq.figures["null_run"]["batch"] == 8 and eq.figures["null_run"]["beyond_noise"] == 0
    bad = _only_equivalence(noisy, models, fault="rollback-off-by-one")
    eq = next(c for c in bad.checks if c.name == "equivalence")
    assert not eq.passed and eq.figures["divergences"] > 0, eq.summary
    assert bad.verdict == "fail"


def test_near_ties_far_more_often_than_the_null_run_fail(models):
    """Noise that only speculation's wide passes see (plain batching never does): every
    divergence lies inside the measured noise, but 9 of 12 prompts differ where the null run
    differs on none, and Fisher's test rejects that (at wobble 0.5, 6 of 12 under row churn's
    mixed lengths: p = 0.007, short of the 0.0033 the three runs share)."""
    noisy = PassWidthNoise(models[0], wobble=0.8)
    result = _only_equivalence(noisy, models)
    eq = next(c for c in result.checks if c.name == "equivalence")
    assert not eq.passed and eq.figures["divergences"] == 0, eq.summary
    assert "differ against the null run" in eq.summary
    null = eq.figures["null_run"]
    for row in eq.details["per_batch"]:
        differ = row["prompts"] - row["identical"]
        p = fisher_greater(differ, row["prompts"], null["differ"], null["prompts"])
        assert row["fisher_p_vs_null"] == pytest.approx(p)
        assert row["passed"] == (p >= NULL_ALPHA / len(eq.details["per_batch"]))


def test_native_audit_figures_unchanged(models):
    result = tiny_audit(models, batch_sizes=(1, 4))
    eq = next(c for c in result.checks if c.name == "equivalence")
    assert eq.figures["tie_margin"] == TIE_MARGIN
    assert eq.figures["tie_margin_source"]["source"].startswith("fixed")


def _only(noisy, models, checks, fault=None):
    cfg = AuditConfig(target="tiny-llama", draft="tiny-draft-model", k=3, policy="fixed",
                      batch_sizes=(1, 4, 8), sizes=TINY_SIZES, inject_fault=fault, only=checks)
    result = run_audit(cfg, target=LoadedModel(noisy, CharTokenizer(), None),
                       drafter_factory=tiny_drafter_factory((noisy, models[1])), prompts=tiny_suite())
    return {c.name: c for c in result.checks}


def test_seeded_and_stopping_on_a_noisy_backend_use_its_noise_and_still_fail_their_faults(models):
    """On a backend that declares noisy numerics, the seeded check runs its own null run
    (seeded plain at the largest batch size) and the stopping check sets aside requests whose
    tokens changed at a near-tie before the cut; the faults each check exists for still fail."""
    noisy = PassWidthNoise(models[0])
    ok = _only(noisy, models, ("seeded", "stopping"))
    seeded, stopping = ok["seeded"], ok["stopping"]
    assert seeded.passed and stopping.passed, (seeded.summary, stopping.summary)
    null = seeded.figures["null_run"]
    assert null["batch"] == 8 and null["tie_margin"] >= tie_margin_for(noisy)["value"]
    assert seeded.figures["near_tie_allowance"] is None
    assert all("fisher_p_vs_null" in r for r in seeded.details["per_config"])
    assert stopping.figures["tie_margin"] == tie_margin_for(noisy)["value"]
    assert stopping.figures["near_ties_set_aside"] < stopping.figures["cases"]
    bad = _only(noisy, models, ("seeded",), fault="keyed-noise-misaligned")["seeded"]
    assert not bad.passed and bad.figures["divergences"] > 0, bad.summary
    for fault in ("stop-only-at-run-end", "length-off-by-one"):
        bad = _only(noisy, models, ("stopping",), fault=fault)["stopping"]
        assert not bad.passed and bad.figures["wrong"] > 0, (fault, bad.summary)


def test_stopping_never_sets_aside_an_end_in_the_wrong_place(models):
    """A request that ends early or runs on (a length difference) is never a near-tie,
    whatever the margin; only a changed token below the margin is."""
    from verispec.audit.stopping import _near_tie_flip

    class Ctx:
        model = models[0]
        prompt_ids = [[5, 6, 7]]
    want = [8, 9, 10, 11]
    assert not _near_tie_flip(Ctx, 0, want, want[:2], tie_margin=1e9)  # ended early
    assert not _near_tie_flip(Ctx, 0, want, want + [12], tie_margin=1e9)  # ran on past the stop
    assert _near_tie_flip(Ctx, 0, want, [8, 3, 10, 11], tie_margin=1e9)  # a changed token, any margin
    assert not _near_tie_flip(Ctx, 0, want, [8, 3, 10, 11], tie_margin=0.0)  # no margin: never


def test_a_fault_that_breaks_plain_batching_fails_the_null_not_widens_the_margin(models):
    """A backend fault (audit/faults/null.py) that every engine runs, plain references
    included: the null run diverges beyond the measured noise, which fails equivalence with
    the prompts named; the margin stays the measured noise, so the speculative divergences
    the same fault causes are not excused as near-ties."""
    noisy = PassWidthNoise(models[0])
    result = _only_equivalence(noisy, models, fault="backend-neighbour-bleed")
    eq = next(c for c in result.checks if c.name == "equivalence")
    null = eq.figures["null_run"]
    assert not eq.passed and null["beyond_noise"] > 0, eq.summary
    assert "null run: plain decoding at b=8 diverges" in eq.summary
    assert len(null["beyond_noise_prompts"]) == null["beyond_noise"]
    assert null["tie_margin"] == eq.figures["tie_margin"] == tie_margin_for(noisy)["value"]
    assert eq.figures["divergences"] > 0  # the speculative runs' divergences count as such


def test_seeded_null_beyond_the_noise_fails(models):
    noisy = PassWidthNoise(models[0])
    seeded = _only(noisy, models, ("seeded",), fault="backend-neighbour-bleed")["seeded"]
    assert not seeded.passed and seeded.figures["null_run"]["beyond_noise"] > 0, seeded.summary
    assert "null run: seeded plain decoding" in seeded.summary


def test_noise_beyond_the_ceiling_is_inconclusive(models):
    """A batched path so noisy that its measurement cannot tell rounding from a broken batch
    (here the stand-in moves a gap by ~4.8 logits) makes equivalence inconclusive, which fails."""
    from verispec.audit.equivalence import NOISE_CEILING
    noisy = PassWidthNoise(models[0], wobble=5.0)
    assert tie_margin_for(noisy)["noise_top2_gap"] > NOISE_CEILING
    eq = next(c for c in _only_equivalence(noisy, models).checks if c.name == "equivalence")
    assert not eq.passed and eq.figures["inconclusive"] and "INCONCLUSIVE" in eq.summary, eq.summary
    assert "multi-row cache" in eq.figures["tie_margin_source"]["code_path"]
