"""The audit's statistics: the descending-p randomised PIT is exact under the null and
sees a bias toward likely tokens that the token-id order averages out; the calibration
z-test is exact under the null and catches a relaxed acceptance threshold."""

import numpy as np
import torch

from verispec.audit.stats import calibration_test, randomized_pit, test_uniform


def _dists(n, V, g):
    logits = torch.randn(n, V, generator=g, dtype=torch.float64) * 2.5
    return logits.softmax(-1)


def _id_order_pit(p, x, g):
    before = p.cumsum(-1).gather(-1, x[:, None]).squeeze(-1) - p.gather(-1, x[:, None]).squeeze(-1)
    return before + torch.rand(len(x), generator=g, dtype=torch.float64) * p.gather(-1, x[:, None]).squeeze(-1)


def test_descending_pit_is_uniform_under_the_null():
    g = torch.Generator().manual_seed(0)
    for trial in range(5):
        p = _dists(4000, 50, g)
        x = torch.multinomial(p, 1, generator=g).squeeze(-1)
        assert test_uniform(randomized_pit(p, x, g).numpy()).passed(1e-3)


def test_descending_pit_ties_are_ordered_by_id():
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.25, 0.25, 0.5]], dtype=torch.float64).expand(3, 3)
    u = randomized_pit(p, torch.tensor([2, 0, 1]), g)
    assert 0 <= u[0] <= 0.5 and 0.5 <= u[1] <= 0.75 and 0.75 <= u[2] <= 1.0


def test_bias_toward_likely_tokens_is_seen_in_descending_order_only():
    """Sampling from p^1.15 (a mild pull toward likely tokens) over 3,000 tokens."""
    g = torch.Generator().manual_seed(2)
    p = _dists(3000, 64, g)
    biased = p ** 1.15
    x = torch.multinomial(biased / biased.sum(-1, keepdim=True), 1, generator=g).squeeze(-1)
    assert not test_uniform(randomized_pit(p, x, g).numpy()).passed(1e-3)
    assert test_uniform(_id_order_pit(p, x, g).numpy()).p_value > 1e-3  # what the old order saw


def test_calibration_null_and_relaxed_threshold():
    rng = np.random.default_rng(3)
    ratio = rng.uniform(0.0, 1.5, 3000)  # p/q of each verified draft
    a = np.minimum(1.0, ratio)
    null_p = [calibration_test(a, rng.random(a.size) < a).p_value for _ in range(50)]
    assert min(null_p) > 1e-4 and np.mean(null_p) > 0.3
    relaxed = rng.random(a.size) < np.minimum(1.0, 1.25 * ratio)
    res = calibration_test(a, relaxed)
    assert res.z > 0 and not res.passed(1e-3)


def test_calibration_degenerate_variance():
    assert calibration_test([1.0, 1.0, 0.0], [1, 1, 0]).passed(1e-3)
    assert not calibration_test([1.0, 0.0], [1, 1]).passed(1e-3)


def test_tail_test_is_exact_under_the_null_and_sees_a_spike():
    import numpy as np

    from verispec.audit.stats import tail_test
    rng = np.random.default_rng(0)
    p = [tail_test(rng.random(500)).p_value for _ in range(2000)]
    assert 0.02 < np.mean(np.asarray(p) <= 0.05) <= 0.05  # one-sided binomial: at most alpha (discrete)
    u = rng.random(500)
    u[:25] = 1.0 - rng.random(25) * 1e-3  # 5% of tokens from outside the distribution
    assert tail_test(u).p_value < 1e-4


def test_relaxed_power_matches_simulation():
    """The calibration test's stated power against a relaxed rule min(1, c a) agrees with
    the share of simulated relaxed samples the test rejects, and draws at a = 0 or 1 carry none."""
    import numpy as np
    from verispec.audit.stats import relaxed_power
    rng = np.random.default_rng(0)
    a = rng.choice([0.0, 1.0, 0.3, 0.6, 0.8], size=400)
    for c, alpha in ((1.25, 1e-3), (2.0, 1e-4)):
        stated = relaxed_power(a, c, alpha)
        hits = sum(calibration_test(a, rng.random(a.size) < np.minimum(1, c * a)).p_value < alpha
                   for _ in range(400))
        assert abs(hits / 400 - stated) < 0.08, (c, stated, hits / 400)
    assert relaxed_power(np.array([0.0, 1.0] * 50), 2.0, 1e-3) == 0.0
    assert relaxed_power(np.array([]), 2.0, 1e-3) == 0.0
    assert relaxed_power(np.full(300, 0.5), 2.0, 1e-3) > 0.999
