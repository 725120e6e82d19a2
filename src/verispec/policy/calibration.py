"""Calibration of a drafter's confidence: P(a draft is accepted | the drafts before it in
the step were, the drafter gave it probability c), learned from what the target accepted.

The records are exponentially forgotten counts per bin of c (CONF_EDGES). A bin's figure is
its record shrunk toward a logistic curve sigma(a + b logit(c)) fitted over every bin, with a
Gaussian prior around (0, 1) (a calibrated drafter), so a bin with little record follows the
drafter's calibration as a whole. The adaptive policy's halt() rule reads it; only the
drafter's own probabilities and past verdicts enter, never the verdicts of the step being
drafted.
"""

from __future__ import annotations

import numpy as np

# bins of the drafter's confidence in a draft (its probability of the drafted token)
CONF_EDGES = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98])
CONF_MIDS = (CONF_EDGES + np.append(CONF_EDGES[1:], 1.0)) / 2.0

# the logistic curve's prior: mean (offset 0, slope 1: a calibrated drafter) and precision.
# The slope is held more firmly than the offset, so records in a few bins move the curve
# rather than tilt it
CURVE_PRIOR_MEAN = np.array([0.0, 1.0])
CURVE_PRIOR_PRECISION = np.array([1.0, 10.0])
MIN_SLOPE = 0.05  # acceptance does not fall as confidence rises


def conf_bin(conf) -> np.ndarray:
    """The CONF_EDGES bin of each confidence."""
    c = np.atleast_1d(np.asarray(conf, dtype=np.float64))
    return np.clip(np.searchsorted(CONF_EDGES, c, side="right") - 1, 0, len(CONF_EDGES) - 1)


def calibration_curve(s: np.ndarray, n: np.ndarray) -> np.ndarray:
    """[bins]: sigma(a + b logit(c)) at each bin's middle, (a, b) the maximum a posteriori fit
    to the bins' records (s accepted of n tried, [bins] each) by a few Newton steps. A draft
    model of the target's family is underconfident (its pick is the target's more often than
    it believes), a poorly matched one overconfident; two numbers learn either from a few
    dozen drafts."""
    x = np.log(CONF_MIDS / (1.0 - CONF_MIDS))  # [bins] logit of each bin's middle
    X = np.stack([np.ones_like(x), x], axis=1)  # [bins, 2]
    w0, lam = CURVE_PRIOR_MEAN, CURVE_PRIOR_PRECISION

    def objective(w):  # log posterior
        z = X @ w
        return float(s @ z - n @ np.logaddexp(0.0, z) - 0.5 * float(lam @ (w - w0) ** 2))

    w, f = w0.copy(), objective(w0)
    for _ in range(20):  # Newton with step halving: the posterior is concave
        p = 1.0 / (1.0 + np.exp(-(X @ w)))
        grad = X.T @ (s - n * p) - lam * (w - w0)
        H = (X * (n * p * (1.0 - p))[:, None]).T @ X + np.diag(lam)
        step = np.linalg.solve(H, grad)
        t = 1.0
        while t > 1e-3 and objective(w + t * step) < f:
            t /= 2.0
        w_new = w + t * step
        f_new = objective(w_new)
        if f_new < f:
            break
        w, done = w_new, f_new - f < 1e-9
        f = f_new
        if done:
            break
    w[1] = max(w[1], MIN_SLOPE)
    return 1.0 / (1.0 + np.exp(-(X @ w)))


class ConfidenceCalibration:
    """The records and the fitted curve. cs, cn [bins]: forgotten counts of drafts accepted
    and tried per bin (edited in place by record(); tests may edit them too: the curve is
    refitted whenever they changed)."""

    def __init__(self, keep: float, strength: float):
        self.keep = keep  # records kept per draft observed
        self.strength = strength  # drafts' worth of weight of the fitted curve in a bin's figure
        self.cs = np.zeros(len(CONF_EDGES))  # [bins]
        self.cn = np.zeros(len(CONF_EDGES))  # [bins]
        self._fit = None  # (records it was fitted to, curve [bins])

    def record(self, conf, accepted) -> None:
        """Drafts tried in one row's step: conf [n] the drafter's probabilities, accepted [n]
        1.0 for the accepted drafts (a prefix), 0.0 for the rejected one."""
        idx = conf_bin(conf)
        keep = self.keep ** len(idx)
        self.cs *= keep
        self.cn *= keep
        np.add.at(self.cs, idx, np.asarray(accepted, dtype=np.float64)[:len(idx)])
        np.add.at(self.cn, idx, 1.0)

    def curve(self) -> np.ndarray:
        """[bins]: the logistic fit to the current records (refitted after they change)."""
        key = self.cs.tobytes() + self.cn.tobytes()
        if self._fit is None or self._fit[0] != key:
            self._fit = (key, calibration_curve(self.cs, self.cn))
        return self._fit[1]

    def calibrated(self, conf) -> np.ndarray:
        """P(a draft is accepted | the drafts before it were), given the drafter's own
        probability of it (conf, array-like): the bin's forgotten record, shrunk toward the
        fitted curve."""
        i = conf_bin(conf)
        c = self.strength
        return (self.cs[i] + c * self.curve()[i]) / (self.cn[i] + c)
