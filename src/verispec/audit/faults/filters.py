"""Faults of the sampling filters: a verify pass that applies top-k, top-p or min-p in
another place or order than plain decoding does (sampling.py: temperature, then top-k and
top-p on the tempered logits, then min-p relative to the top token left).

Such a verifier is exact without filters, so an audit that samples without them passes
it; under a deployment's filters its p has mass where plain decoding's has none, and the
tokens it emits there fail the distribution check's outside-support count. Only a verify
pass over drafts is broken: a one-token step, and so plain decoding, stays correct.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ...engine.hooks import StepHooks
from ...sampling import logits_to_probs
from .catalogue import register
from ..registry import DISTRIBUTION


def _verifies_drafts(logits: torch.Tensor, params) -> bool:
    """Whether logits [1,K+1,V] are a sampled row's verify pass over drafts (K > 0)."""
    return logits.dim() == 3 and logits.shape[1] > 1 and not params.greedy


class _FiltersBeforeTemperature(StepHooks):
    @staticmethod
    def verify_probs(logits, params):  # the filters cut the untempered distribution
        filtered = params.top_k or params.top_p < 1.0 or params.min_p > 0.0
        if not (filtered and _verifies_drafts(logits, params)):
            return logits_to_probs(logits, params)
        kept = logits_to_probs(logits, replace(params, temperature=1.0)) > 0
        return logits_to_probs(logits.float().masked_fill(~kept, float("-inf")),
                               replace(params, top_k=0, top_p=1.0, min_p=0.0))


class _MinPOffAtDrafts(StepHooks):
    @staticmethod
    def verify_probs(logits, params):  # min-p kept at the pass's last position only
        p = logits_to_probs(logits, params)
        if _verifies_drafts(logits, params) and params.min_p > 0.0:
            p[:, :-1] = logits_to_probs(logits[:, :-1], replace(params, min_p=0.0))
        return p


register("verify-filters-before-temperature",
         "a verify pass over drafts applies top-k, top-p and min-p to the untempered logits, then "
         "the temperature (plain decoding: the temperature first)",
         DISTRIBUTION, lambda c: {"step": _FiltersBeforeTemperature()})
register("verify-min-p-dropped-at-drafts",
         "a verify pass over drafts drops min-p at the drafts' positions (its last position keeps it)",
         DISTRIBUTION, lambda c: {"step": _MinPOffAtDrafts()})
