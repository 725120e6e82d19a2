"""Statistical tests of the verification rules: the emitted tokens follow p.

Many draws in one vectorised batch (B rows = B independent trials), small V,
fixed seeds (deterministic). Glossary: B batch, K draft length, V vocab.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from verispec.verify import verify

N = 200_000  # draws per test (rows in one verify call)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def dirichlet(rng: np.random.Generator, shape: tuple[int, ...], V: int, alpha: float = 1.0):
    """[*shape, V] float32 probability vectors."""
    return torch.from_numpy(rng.dirichlet(np.full(V, alpha), size=shape)).float()


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Chi-square goodness of fit.

    observed: [N] tokens; expected: [V] expected counts (sums to N). Cells expected
    below 5 are pooled; a token seen where nothing was expected gives p-value 0.
    """
    V = expected.shape[0]
    obs = torch.bincount(observed, minlength=V).double().numpy()
    exp = expected.double().numpy()
    assert obs.shape == exp.shape, "token outside the vocabulary"
    assert abs(obs.sum() - exp.sum()) < 1e-6 * obs.sum()
    small = exp < 5
    if small.any():
        if exp[small].sum() == 0 and obs[small].sum() > 0:
            return 0.0
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
    exp = exp * (obs.sum() / exp.sum())
    return float(stats.chisquare(obs, exp).pvalue)


def draft_from(q: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Sample one token per row: q [B, K, V] -> [B, K]."""
    B, K, V = q.shape
    return torch.multinomial(q.reshape(B * K, V), 1, generator=g).reshape(B, K)


@pytest.mark.parametrize(
    "V, K, alpha, seed",
    [(16, 1, 1.0, 0), (16, 3, 1.0, 1), (8, 2, 0.3, 2), (5, 4, 3.0, 3)],
)
def test_rejection_first_token_follows_p(V, K, alpha, seed):
    rng = np.random.default_rng(seed)
    p = dirichlet(rng, (K + 1,), V, alpha).expand(N, K + 1, V)
    q = dirichlet(rng, (K,), V, alpha).expand(N, K, V)
    g = gen(seed)
    draft_tokens = draft_from(q, g)
    out, n = verify("rejection", p, q, draft_tokens, torch.full((N,), K), g)
    assert chi2_pvalue(out[:, 0], p[0, 0] * N) > 1e-3
    # Acceptance rate at position 0 is sum(min(p, q)) (binomial z-score).
    rate = torch.minimum(p[0, 0], q[0, 0]).sum().item()
    z = ((n >= 1).sum().item() - N * rate) / np.sqrt(N * rate * (1 - rate))
    assert abs(z) < 4.5


@pytest.mark.parametrize("drafter", ["constant", "row-dependent"])
def test_rejection_one_hot_drafter_first_token_follows_p(drafter):
    # draft_probs=None: a deterministic drafter (q one-hot at its token).
    V, K = 10, 2
    rng = np.random.default_rng(10)
    p = dirichlet(rng, (K + 1,), V).expand(N, K + 1, V)
    if drafter == "constant":
        draft_tokens = torch.tensor([[int(p[0, 0].argmax()), 3]]).expand(N, K)
    else:
        draft_tokens = torch.stack([torch.arange(N) % V, (torch.arange(N) * 7) % V], dim=1)
    out, n = verify("rejection", p, None, draft_tokens, torch.full((N,), K), gen(10))
    assert chi2_pvalue(out[:, 0], p[0, 0] * N) > 1e-3
    # Each row accepts its first draft token x with probability p(x).
    expected_accepts = p[0, 0][draft_tokens[:, 0]].double().sum().item()
    z = ((n >= 1).sum().item() - expected_accepts) / np.sqrt(expected_accepts)
    assert abs(z) < 4.5


def test_rejection_ragged_batch_and_zero_draft_rows_follow_p():
    V, K = 12, 3
    rng = np.random.default_rng(11)
    p = dirichlet(rng, (K + 1,), V).expand(N, K + 1, V)
    q = dirichlet(rng, (K,), V).expand(N, K, V)
    g = gen(11)
    draft_tokens = draft_from(q, g)
    num_drafts = torch.from_numpy(rng.integers(0, K + 1, size=N))
    out, n = verify("rejection", p, q, draft_tokens, num_drafts, g)
    assert chi2_pvalue(out[:, 0], p[0, 0] * N) > 1e-3
    zero = num_drafts == 0
    assert chi2_pvalue(out[zero, 0], p[0, 0] * zero.sum()) > 1e-3
    assert (n[zero] == 0).all()


def test_zero_draft_rows_sample_from_p():
    V, K = 16, 2
    rng = np.random.default_rng(12)
    p = dirichlet(rng, (K + 1,), V).expand(N, K + 1, V)
    zero = torch.zeros(N, dtype=torch.long)
    for rule in ("rejection", "typical-lossy"):
        out, n = verify(rule, p, None, torch.zeros(N, K, dtype=torch.long), zero, gen(12))
        assert chi2_pvalue(out[:, 0], p[0, 0] * N) > 1e-3, rule


@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_second_token_given_first_accepted_follows_p(with_q):
    # K = 2, target and drafter at position 1 depend on the token at position 0, as a
    # model's would: P1[x0] and Q1[x0]. Given draft x0 accepted, the second emitted
    # token (accepted x1, recovered, or, never here, bonus) must follow P1[x0].
    V, K = 6, 2
    rng = np.random.default_rng(13)
    P0, P1, P2 = dirichlet(rng, (), V), dirichlet(rng, (V,), V), dirichlet(rng, (V,), V)
    Q0, Q1 = dirichlet(rng, (), V), dirichlet(rng, (V,), V)
    g = gen(13)
    if with_q:
        x0 = torch.multinomial(Q0, N, replacement=True, generator=g)
        x1 = torch.multinomial(Q1[x0], 1, generator=g).squeeze(1)
        q = torch.stack([Q0.expand(N, V), Q1[x0]], dim=1)  # [N, K, V]
    else:  # one-hot drafter: x0 cycles, x1 = (x0 + 1) % V
        x0 = torch.arange(N) % V
        x1 = (x0 + 1) % V
        q = None
    p = torch.stack([P0.expand(N, V), P1[x0], P2[x1]], dim=1)  # [N, K+1, V]
    out, n = verify("rejection", p, q, torch.stack([x0, x1], 1), torch.full((N,), K), g)
    first = n >= 1
    assert first.sum() > N // 10
    # Joint table (x0, second token) against counts(x0) * P1[x0].
    cells = out[first, 0] * V + out[first, 1]
    counts_x0 = torch.bincount(out[first, 0], minlength=V).double()
    expected = (counts_x0[:, None] * P1.double()).reshape(-1)
    assert chi2_pvalue(cells, expected) > 1e-3


def test_typical_lossy_is_caught_where_rejection_passes():
    # Flat-ish p: the typical threshold is far below every p(x), so every draft token
    # is accepted and the first emitted token follows the drafter's q instead of p.
    V, K = 8, 1
    rng = np.random.default_rng(14)
    p = dirichlet(rng, (K + 1,), V, alpha=50.0).expand(N, K + 1, V)
    q = dirichlet(rng, (K,), V, alpha=0.5).expand(N, K, V)
    g = gen(14)
    draft_tokens = draft_from(q, g)
    num_drafts = torch.full((N,), K)
    out, _ = verify("typical-lossy", p, q, draft_tokens, num_drafts, gen(15))
    assert chi2_pvalue(out[:, 0], p[0, 0] * N) < 1e-6
    out, _ = verify("rejection", p, q, draft_tokens, num_drafts, gen(15))
    assert chi2_pvalue(out[:, 0], p[0, 0] * N) > 1e-3


def test_chi2_harness_rejects_a_classic_bug():
    # A sampler that, on rejection, samples from p instead of the residual (a known
    # implementation bug) is biased; the harness must see it.
    V = 8
    rng = np.random.default_rng(16)
    p0 = dirichlet(rng, (), V)
    q0 = dirichlet(rng, (), V, alpha=0.5)
    g = gen(16)
    x = torch.multinomial(q0, N, replacement=True, generator=g)
    accept = torch.rand(N, generator=g) * q0[x] < p0[x]
    buggy = torch.where(accept, x, torch.multinomial(p0, N, replacement=True, generator=g))
    assert chi2_pvalue(buggy, p0 * N) < 1e-6
