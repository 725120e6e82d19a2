"""The calibration probe: drafts designed so that the verification rule's acceptance
probability is known and informative, whatever the deployed drafter.

The calibration test (stats.py) gains nothing from a draft kept with probability a = 0 or
a = 1, and most of a deployed drafter's drafts are of that kind: prompt lookup copies
text the target either continues with near certainty or not at all, and a weak drafter's
drafts are mostly rejected outright. Against a relaxed threshold min(1, c p/q) a draft
carries the most evidence at a = 1/c, where the relaxed rule keeps it always and the exact
rule with probability 1/c: per draft, the squared shift over the variance is
(1 - a)/a = c - 1 there.

The probe is a draft model that *is* the target (its own KV cache, prefilled and caught up
like any draft model's) drawing from a fractional nucleus of the target's own distribution
p (after the request's temperature / top-k / top-p / min-p): over tokens in descending p,
q(x) = p(x) / m until the cumulative mass reaches m, the token at the boundary takes the
rest of q's mass, and every later token q = 0. Every draft inside the nucleus then has
p/q = m exactly: the exact rule keeps it with probability m. Where the top token alone has
p > m, q is one-hot at it and a = p(top).

The drafts run through the engine's own draft-model path and verify pass, so a fault in
verification, residual sampling, bonus sampling or the per-row bookkeeping moves the test;
drafter-side faults are the deployed drafter's business (the other half of the check).
The audit recomputes q from the teacher-forced target with `nucleus_q`, never from the
engine's record.
"""

from __future__ import annotations

from functools import partial

import torch

from ..drafters.draft_model import DraftModelDrafter


CANDIDATES = 256  # nucleus_q sorts only this many top tokens when they hold the nucleus


def nucleus_q(p: torch.Tensor, mass: float) -> torch.Tensor:
    """p [..., V] -> q [..., V]: p/mass over the top tokens (descending p, ties by id) until
    their mass reaches `mass`, the boundary token the remainder, 0 beyond."""
    if not 0.0 < mass <= 1.0:
        raise ValueError(f"nucleus mass must be in (0, 1], got {mass}")
    shape = p.shape
    pd = p.double().reshape(-1, shape[-1])  # [N,V]
    q = torch.zeros_like(pd)
    V = pd.shape[-1]
    # the top CANDIDATES tokens hold the nucleus of most rows: sort those only (a full sort
    # of the vocabulary is the probe's main cost), re-ordered by (-p, id)
    top, idx = torch.topk(pd, min(CANDIDATES, V), dim=-1)  # [N,C]
    idx, perm = idx.sort(-1)
    top = top.gather(-1, perm)
    order = torch.sort(-top, dim=-1, stable=True).indices
    top, idx = top.gather(-1, order), idx.gather(-1, order)
    cand_q, reached = _nucleus_sorted(top, mass)
    # exact only when the nucleus ends strictly above the last candidate's p (no tie with a
    # token left out); other rows take the full sort
    full = ~reached if V > CANDIDATES else torch.zeros(len(pd), dtype=torch.bool)
    q[~full] = torch.zeros_like(pd[~full]).scatter(-1, idx[~full], cand_q[~full])
    if bool(full.any()):
        order = torch.sort(-pd[full], dim=-1, stable=True).indices  # ties by id
        sq, _ = _nucleus_sorted(pd[full].gather(-1, order), mass)
        q[full] = torch.zeros_like(pd[full]).scatter(-1, order, sq)
    q = q / q.sum(-1, keepdim=True)
    return q.reshape(shape).to(p.dtype)


def _nucleus_sorted(sp: torch.Tensor, mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """sp [N,C] probabilities in descending order -> (their q [N,C], whether the nucleus
    closed inside these C with its boundary token's p above the last one's)."""
    before = sp.cumsum(-1) - sp  # mass of the tokens ahead of each one
    qs = torch.where(before + sp <= mass, sp / mass,
                     ((mass - before) / mass).clamp_min(0.0))  # inside, boundary, beyond
    # the boundary: the first token whose cumulative mass reaches the mass
    b = torch.searchsorted(sp.cumsum(-1), torch.full((len(sp), 1), mass, dtype=sp.dtype)).clamp(max=sp.shape[-1] - 1)
    reached = (sp.cumsum(-1)[:, -1] >= mass) & (sp.gather(-1, b).squeeze(-1) > sp[:, -1])
    return qs, reached


def acceptance(p_d: float, q_d: float) -> float:
    """The exact rule's probability of keeping a draft d: min(1, p(d)/q(d))."""
    if q_d <= 0.0:
        return 1.0 if p_d > 0 else 0.0
    return min(1.0, p_d / q_d)


def probe_drafter(target_model, vocab: int, *, max_rows: int, max_len: int, mass: float) -> DraftModelDrafter:
    """A draft model on the target itself, drawing from nucleus_q(p, mass)."""
    return DraftModelDrafter(target_model, vocab, max_rows=max_rows, max_len=max_len,
                             name=f"probe:nucleus-{mass:g}", q_transform=partial(nucleus_q, mass=mass))
