"""Statistics that let the audit fail: the randomised probability integral transform,
and a calibration test of the verified draft tokens.

PIT. For every emitted token x with the target's exact distribution p at its position
(teacher-forced), u = F(x-) + U * p(x), with U ~ Uniform(0,1) independent and F the CDF
over tokens ordered by *descending p* (ties by token id). The order is a function of p,
itself a function of the past, so under an exact sampler the u values are still i.i.d.
Uniform(0,1) whatever p is. Ordered by descending p, a sampler biased toward likely
tokens (typical acceptance, a relaxed threshold, drafts of a confident drafter) piles
mass near 0, where an order by token id scatters it over [0, 1] and averages it out.

Calibration. A verified draft token d (one the rule looked at: every accepted draft and
the first rejected one) is kept with probability exactly a = min(1, p(d)/q(d)) under
exact rejection sampling (q one-hot: a = p(d)). Over n verified drafts,
z = sum(1{kept} - a) / sqrt(sum a (1 - a)) is asymptotically standard normal; a relaxed
threshold, a recovered token drawn from p (which may equal d), or a q that is not the one
the drafts were drawn from all move it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats as sps


def randomized_pit(probs: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """probs [N,V] exact target distributions, tokens [N] emitted -> u [N] in [0,1], the CDF
    taken over tokens in descending-p order (ties by token id)."""
    probs = probs.double()
    px = probs.gather(-1, tokens[:, None])  # [N,1]
    ids = torch.arange(probs.shape[-1], device=probs.device)
    before = (probs > px) | ((probs == px) & (ids[None, :] < tokens[:, None]))  # [N,V]
    cdf_before = (probs * before).sum(-1)  # F(x-) [N]
    u = torch.rand(tokens.shape[0], generator=generator, dtype=torch.float64)
    return (cdf_before + u * px.squeeze(-1)).clamp(0.0, 1.0)


@dataclass(frozen=True)
class CalibrationTest:
    """z-test of verified drafts' acceptance against its exact probability (two-sided)."""

    n: int  # verified draft tokens
    kept: int
    expected: float  # sum of a
    z: float
    p_value: float

    def passed(self, alpha: float) -> bool:
        return self.p_value > alpha

    def to_dict(self) -> dict:
        return {"n": self.n, "kept": self.kept, "expected": self.expected, "z": self.z, "p_value": self.p_value}


def calibration_test(accept_prob, kept) -> CalibrationTest:
    """accept_prob [n] exact acceptance probabilities a, kept [n] 0/1 outcomes."""
    a = np.asarray(accept_prob, dtype=np.float64)
    k = np.asarray(kept, dtype=np.float64)
    if a.shape != k.shape or a.size == 0:
        raise ValueError("need one outcome per acceptance probability, and at least one")
    var = float((a * (1 - a)).sum())
    diff = float(k.sum() - a.sum())
    if var <= 1e-12:  # every a is 0 or 1: any outcome off it is impossible under the null
        z = 0.0 if abs(diff) < 0.5 else float(np.sign(diff) * 1e9)  # finite, for JSON
    else:
        z = diff / var ** 0.5
    p = float(2 * sps.norm.sf(abs(z)))
    return CalibrationTest(n=int(a.size), kept=int(k.sum()), expected=float(a.sum()), z=float(z), p_value=p)


calibration_test.__test__ = False


@dataclass(frozen=True)
class UniformityTest:
    n: int
    ks_statistic: float
    p_value: float
    histogram: list[int]  # counts in 20 equal bins of [0,1]

    def passed(self, alpha: float = 1e-3) -> bool:
        return self.p_value > alpha

    def to_dict(self) -> dict:
        return {"n": self.n, "ks_statistic": self.ks_statistic, "p_value": self.p_value,
                "histogram": self.histogram}


def test_uniform(u) -> UniformityTest:
    """Kolmogorov-Smirnov test of u against Uniform(0,1)."""
    u = np.asarray(u, dtype=np.float64)
    if u.size == 0:
        raise ValueError("no samples to test")
    res = sps.kstest(u, "uniform")
    hist, _ = np.histogram(u, bins=20, range=(0.0, 1.0))
    return UniformityTest(n=int(u.size), ks_statistic=float(res.statistic), p_value=float(res.pvalue),
                          histogram=hist.tolist())


test_uniform.__test__ = False


@dataclass(frozen=True)
class TailTest:
    """One-sided binomial test of the share of PIT values above 1 - tail (exactly `tail`
    under the null). Over descending p, a token the sampler should (almost) never emit lands
    there: a recovered token drawn outside the residual, a garbage token. KS, which looks at
    the whole CDF, is slow to see such a spike."""

    n: int
    tail: float
    count: int
    p_value: float

    def passed(self, alpha: float) -> bool:
        return self.p_value > alpha


def tail_test(u, tail: float = 0.01) -> TailTest:
    u = np.asarray(u, dtype=np.float64)
    if u.size == 0:
        raise ValueError("no samples to test")
    k = int((u > 1.0 - tail).sum())
    return TailTest(n=int(u.size), tail=tail, count=k,
                    p_value=float(sps.binomtest(k, int(u.size), tail, alternative="greater").pvalue))


tail_test.__test__ = False  # not a pytest test, despite the name


@dataclass(frozen=True)
class TwoTailTest:
    """Two-sided binomial tests of the count of PIT values below t and of those above 1 - t
    (each a share of exactly t under the null), for each t of `cuts`. A drafter that draws
    from a filtered q while it reports q unfiltered leaves q's far tail empty: a deficit
    there, which a test of an excess alone passes; one that draws sharper than it reports
    piles its draws below t and thins them above 1 - t. p_value: the smallest of the
    2 len(cuts) p-values times their number (Bonferroni), a valid p-value whatever their
    dependence (the cuts are nested)."""

    n: int
    cuts: tuple[float, ...]
    below: tuple[int, ...]  # per cut t: values below t
    above: tuple[int, ...]  # per cut t: values above 1 - t
    p_value: float
    worst: str  # the count that gave the smallest p-value, against its expectation

    def passed(self, alpha: float) -> bool:
        return self.p_value > alpha


def two_tail_test(u, cuts: tuple[float, ...] = (0.01, 0.05, 0.2)) -> TwoTailTest:
    u = np.asarray(u, dtype=np.float64)
    if u.size == 0:
        raise ValueError("no samples to test")
    n = int(u.size)
    below = tuple(int((u < t).sum()) for t in cuts)
    above = tuple(int((u > 1.0 - t).sum()) for t in cuts)
    found = [(float(sps.binomtest(k, n, t).pvalue), f"{k} {side} {edge:g} ({n * t:.1f} expected)")
             for t, lo, hi in zip(cuts, below, above) for k, side, edge in ((lo, "below", t), (hi, "above", 1 - t))]
    p, worst = min(found)
    return TwoTailTest(n=n, cuts=tuple(cuts), below=below, above=above, p_value=min(1.0, p * len(found)),
                       worst=worst)


two_tail_test.__test__ = False  # not a pytest test, despite the name


def fisher_greater(d_test: int, n_test: int, d_null: int, n_null: int) -> float:
    """One-sided p-value that the test run differs from its base more often than the null
    run did (Fisher's exact test on [[d, n - d], [d0, n0 - d0]])."""
    if n_test == 0 or n_null == 0:
        return 1.0
    return float(sps.fisher_exact([[d_test, n_test - d_test], [d_null, n_null - d_null]], alternative="greater")[1])


def against_null(counts: dict, n: int, null: dict | None, alpha: float, allowance: int) -> tuple[bool, float | None]:
    """The verdict on one configuration's comparisons with the reference (counts of
    identical, near-tie, divergence over n prompts): no divergence at a clear margin, and
    then either at most `allowance` near-ties (no null run: an fp32 backend whose only
    differences are rare ties) or, where a null run measured what batching alone does
    (null["differ"] of null["prompts"]), differing prompts no more frequent than there
    (one-sided Fisher p >= alpha). -> (passed, the Fisher p or None)."""
    differ = n - counts["identical"]
    if null is None:
        return counts["divergence"] == 0 and differ <= allowance, None
    p = fisher_greater(differ, n, null["differ"], null["prompts"])
    return counts["divergence"] == 0 and p >= alpha, p


def relaxed_power(accept_prob, c: float, alpha: float) -> float:
    """The calibration test's power (normal approximation) against a relaxed rule that keeps
    each draft with probability min(1, c a) instead of its exact a, at level alpha (two-sided),
    over the verified drafts whose exact acceptance probabilities are accept_prob [n]. A draft
    kept with a = 0 or a = 1 carries no evidence; one at a = 1/c carries the most."""
    a = np.asarray(accept_prob, dtype=np.float64)
    if a.size == 0:
        return 0.0
    ac = np.minimum(1.0, c * a)
    var0, var1 = float((a * (1 - a)).sum()), float((ac * (1 - ac)).sum())
    shift = float((ac - a).sum())
    if var0 <= 1e-12:
        return 1.0 if shift >= 0.5 else 0.0
    z = float(sps.norm.isf(alpha / 2))
    sd0, sd1 = var0 ** 0.5, max(var1, 1e-12) ** 0.5
    return float(sps.norm.cdf((shift - z * sd0) / sd1) + sps.norm.cdf((-shift - z * sd0) / sd1))


# -- speedups with their intervals ------------------------------------------------------------
@dataclass(frozen=True)
class Speedup:
    """A speedup of speculative over plain decoding measured as n side-by-side pairs (each
    pair: the same work timed plain and speculative moments apart, in alternating order).
    estimate: the geometric mean of the pairs' ratios (plain seconds per token / speculative
    seconds per token); low, high: its (1 - alpha) Student-t interval on the log scale, so a
    pair's drift cancels in its own ratio and the interval reflects how much the pairs
    disagree. With one pair the interval is (0, inf): nothing is resolved."""

    estimate: float
    low: float
    high: float
    pairs: int
    alpha: float = 0.05

    def to_dict(self) -> dict:
        return {"speedup": self.estimate, "ci_low": self.low, "ci_high": self.high, "pairs": self.pairs,
                "confidence": 1 - self.alpha}


def speedup_interval(plain_s_per_token, spec_s_per_token, alpha: float = 0.05) -> Speedup | None:
    """The speedup of paired timings (seconds per token, plain and speculative, one pair per
    item); None without a usable pair. Pairs with a non-positive time are dropped."""
    r = [p / s for p, s in zip(plain_s_per_token, spec_s_per_token) if p and s and p > 0 and s > 0]
    if not r:
        return None
    logs = np.log(np.asarray(r, dtype=np.float64))
    m = float(logs.mean())
    if len(r) < 2:
        return Speedup(float(np.exp(m)), 0.0, float("inf"), 1, alpha)
    half = float(sps.t.ppf(1 - alpha / 2, len(r) - 1) * logs.std(ddof=1) / np.sqrt(len(r)))
    return Speedup(float(np.exp(m)), float(np.exp(m - half)), float(np.exp(m + half)), len(r), alpha)


def predicted_speedup(tokens_per_pass: float | None, decode_s: float | None = None,
                      pass_s: float | None = None, draft_s: float = 0.0) -> float | None:
    """What acceptance predicts: tokens_per_pass tokens for one verify pass (pass_s) and its
    drafting (draft_s), against one token per plain decode (decode_s). Never above
    tokens_per_pass: a verify pass does at least a decode's work, so a measured pass cheaper
    than a decode is the timing's noise, and a speedup above tokens per pass is not
    speculation's doing. Without costs, that bound is the prediction."""
    if tokens_per_pass is None:
        return None
    if decode_s is None or pass_s is None or pass_s + draft_s <= 0:
        return float(tokens_per_pass)
    return float(tokens_per_pass * decode_s / max(pass_s + draft_s, decode_s))


def judge_speedup(sp: Speedup | None, predicted: float | None, tolerance: float = 0.05) -> str:
    """How a measured speedup may be reported:
    "noise": above 1 + tolerance while its acceptance predicts at most 1 + tolerance
             (not speculation's doing: order, drift or a single timing);
    "faster" / "slower": the whole interval above / below 1;
    "unresolved": the interval is wider than +-tolerance around the estimate and holds 1
                  (not resolved at this budget);
    "even": the interval holds 1 and is narrow: no difference beyond tolerance."""
    if sp is None:
        return "unresolved"
    if predicted is not None and sp.estimate > 1 + tolerance and predicted <= 1 + tolerance:
        return "noise"
    if sp.low > 1:
        return "faster"
    if sp.high < 1:
        return "slower"
    if sp.high > (1 + tolerance) * sp.estimate or sp.low < sp.estimate / (1 + tolerance):
        return "unresolved"
    return "even"


def speedup_text(sp: Speedup | None, verdict: str, predicted: float | None = None) -> str:
    """The speedup as the report prints it: a number with its interval, or why it is none."""
    if sp is None:
        return "not measured"
    ci = f"[{sp.low:.2f}, {sp.high:.2f}]" if sp.pairs > 1 else "[no interval: 1 pair]"
    if verdict == "noise":
        return (f"noise: {sp.estimate:.2f}x {ci} measured, acceptance predicts "
                f"{predicted:.2f}x at most" if predicted is not None else f"noise: {sp.estimate:.2f}x {ci}")
    if verdict == "unresolved":
        return f"not resolved at this budget: {sp.estimate:.2f}x {ci}"
    return f"{sp.estimate:.2f}x {ci}"
