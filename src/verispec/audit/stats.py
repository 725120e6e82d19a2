"""Statistics that let the audit fail: the randomised probability integral transform.

For every emitted token x with the target's exact distribution p at its position
(teacher-forced), u = F(x-) + U * p(x), with F the CDF over the token-id order and
U ~ Uniform(0,1) independent. Under an exact sampler the u values are i.i.d.
Uniform(0,1), whatever p is; a biased sampler (typical acceptance, thresholds below
1, an unnormalised residual) shifts mass and the Kolmogorov-Smirnov test sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats as sps


def randomized_pit(probs: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """probs [N,V] exact target distributions, tokens [N] emitted -> u [N] in [0,1]."""
    probs = probs.double()
    cdf_before = probs.cumsum(-1).gather(-1, tokens[:, None]).squeeze(-1) - probs.gather(
        -1, tokens[:, None]).squeeze(-1)  # F(x-) [N]
    px = probs.gather(-1, tokens[:, None]).squeeze(-1)  # [N]
    u = torch.rand(tokens.shape[0], generator=generator, dtype=torch.float64)
    return (cdf_before + u * px).clamp(0.0, 1.0)


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


test_uniform.__test__ = False  # not a pytest test, despite the name
