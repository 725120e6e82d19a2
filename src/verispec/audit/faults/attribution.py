"""Faults in the verify pass's handling of a drafter's q: code that only drafters with a q
run (layer-skip, a draft model, and the audit's calibration probe), never prompt lookup.

They test attribution: the distribution check's samples come from two code paths, the
deployed drafter and the calibration probe (a draft model on the target). With a drafter
that has a q, the deployed drafter's own samples fail; with prompt lookup only the probe's
do, and the report must say so (the failed tests by code path, audit/distribution.py),
rather than blame the deployment's drafter for code it never runs.
"""

from __future__ import annotations

import torch

from ...engine.hooks import StepHooks
from .catalogue import register
from ..registry import DISTRIBUTION

Q_FLOOR = 0.05


class _QFloored(StepHooks):
    def verify(self, rule, p, q, drafts, num, generator):  # a "safe" floor under q, renormalised
        if q is not None:
            q = q.clamp_min(Q_FLOOR)
            q = q / q.sum(-1, keepdim=True)
        return super().verify(rule, p, q, drafts, num, generator)


class _QOneDraftLate(StepHooks):
    def verify(self, rule, p, q, drafts, num, generator):  # draft i read against draft i+1's q
        if q is not None and q.shape[1] > 1:
            q = torch.cat([q[:, 1:], q[:, -1:]], dim=1)
        return super().verify(rule, p, q, drafts, num, generator)


register("verify-q-floored",
         f"the verify pass floors the drafter's q at {Q_FLOOR:g} (renormalised) before the rule reads it: "
         "drafts of small q are kept too seldom and the residual is wrong; only drafters with a q run it",
         DISTRIBUTION, lambda c: {"step": _QFloored()})
register("verify-q-one-draft-late",
         "the verify pass reads each draft against the next draft's q (the last against its own): an "
         "off-by-one in the q the rule reads; only drafters with a q run it",
         DISTRIBUTION, lambda c: {"step": _QOneDraftLate()})
