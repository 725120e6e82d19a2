"""The drafts' two-sided tail test (stats.two_tail_test): it holds its level on uniform PIT
values, and it sees a deficit in the top of q, what a drafter that draws from a filtered q
while it reports q unfiltered leaves, where the one-sided tail test and KS do not."""

import numpy as np
from scipy import stats as sps

from verispec.audit.distribution import ALPHA, DRAFT_TAIL_CUTS
from verispec.audit.stats import tail_test, test_uniform, two_tail_test

ALPHA_EACH = ALPHA / 26  # the tiny audit's per-test alpha (m = 26 tests with data)


def _with_top_deficit(rng, n: int, top: float = 0.05, kept: float = 0.6) -> np.ndarray:
    """n PIT values, uniform but for the top `top` of [0,1], where only `kept` of the draws
    that would land there remain (a 1 - kept deficit)."""
    u = rng.random(2 * n)
    u = u[(u <= 1 - top) | (rng.random(u.size) < kept)]
    return u[:n]


def test_two_tail_test_holds_its_level():
    """Over 600 uniform samples of 1,500 the share of p-values at or below alpha is not
    above alpha (one-sided binomial test at 1e-3), at two levels: Bonferroni over the six
    counts is conservative and the binomial tests are discrete, so it sits below."""
    rng = np.random.default_rng(0)
    p = np.array([two_tail_test(rng.random(1500), DRAFT_TAIL_CUTS).p_value for _ in range(600)])
    for alpha in (0.05, 0.01):
        hits = int((p <= alpha).sum())
        assert sps.binomtest(hits, p.size, alpha, alternative="greater").pvalue > 1e-3, (alpha, hits)
    assert (p <= 0.2).mean() > 0.05  # not a test that never rejects


def test_two_tail_test_sees_a_deficit_in_the_top_five_percent():
    """A 40% deficit above 0.95 over 3,500 drafts (the size of a quick audit's drafts): the
    two-sided test fails it at the tiny audit's alpha in most draws, the one-sided test of
    an excess never, and KS seldom."""
    rng = np.random.default_rng(1)
    runs = [_with_top_deficit(rng, 3500) for _ in range(100)]
    two = np.mean([two_tail_test(u, DRAFT_TAIL_CUTS).p_value <= ALPHA_EACH for u in runs])
    one = np.mean([tail_test(u, 0.01).p_value <= ALPHA_EACH for u in runs])
    ks = np.mean([test_uniform(u).p_value <= ALPHA_EACH for u in runs])
    assert two >= 0.8 and one == 0.0 and ks <= 0.2, (two, one, ks)


def test_two_tail_test_sees_draws_sharper_than_reported():
    """Draws at a lower temperature than the q reported pile up below t: an excess at the
    likely end fails it (the worst count is named)."""
    rng = np.random.default_rng(2)
    u = np.concatenate([rng.random(1400), rng.random(100) * 0.01])  # 100 extra draws of q's mode
    t = two_tail_test(u, DRAFT_TAIL_CUTS)
    assert t.p_value <= ALPHA_EACH and " below 0.01 " in t.worst, t


def test_two_tail_test_counts():
    t = two_tail_test(np.array([0.001, 0.03, 0.5, 0.9, 0.97, 0.995]), (0.01, 0.05))
    assert t.below == (1, 2) and t.above == (1, 2) and t.n == 6 and 0 < t.p_value <= 1
