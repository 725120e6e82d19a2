"""Literal and property tests of the verification rules (verispec.verify).

Glossary: B batch, K draft length, V vocab.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.verify import (
    LOSSY_RULES,
    RESIDUAL_EPS,
    RULES,
    VerifyResult,
    sample_from_probs,
    verify,
)
from verispec.verify.rules import argmax_last


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def target_from_argmax(best: list[list[int]], V: int) -> torch.Tensor:
    """[B, K+1, V] probs whose argmax at [b, i] is best[b][i] (a softmax of logits)."""
    best_t = torch.tensor(best)  # [B, K+1]
    logits = torch.zeros(*best_t.shape, V)
    logits.scatter_(-1, best_t[..., None], 3.0)
    return logits.softmax(-1)


def dirichlet(rng: np.random.Generator, shape: tuple[int, ...], V: int) -> torch.Tensor:
    """[*shape, V] float32 probability vectors."""
    return torch.from_numpy(rng.dirichlet(np.ones(V), size=shape)).float()


# ---------------------------------------------------------------- greedy, literal


def test_greedy_literal_batch_with_ragged_rows():
    V = 5
    # Per row: argmax of the target at positions 0..K (K = 3).
    best = [
        [2, 4, 1, 3],  # row 0: all 3 drafts match -> bonus 3
        [2, 4, 1, 3],  # row 1: mismatch at position 1 -> recovered argmax 4
        [0, 1, 2, 3],  # row 2: no drafts -> only the bonus at position 0
        [2, 4, 1, 3],  # row 3: 1 draft; padding equals the argmax and must be ignored
        [1, 0, 0, 0],  # row 4: mismatch at position 0 -> recovered argmax 1
    ]
    target = target_from_argmax(best, V)
    draft_tokens = torch.tensor(
        [[2, 4, 1], [2, 0, 1], [-1, -1, -1], [2, 4, 1], [3, 0, 0]]
    )
    num_drafts = torch.tensor([3, 3, 0, 1, 3])
    out, n = verify("greedy", target, None, draft_tokens, num_drafts, None)
    assert n.tolist() == [3, 1, 0, 1, 0]
    assert out.tolist() == [
        [2, 4, 1, 3],
        [2, 4, -1, -1],
        [0, -1, -1, -1],
        [2, 4, -1, -1],
        [1, -1, -1, -1],
    ]
    assert out.dtype == torch.long and n.dtype == torch.long


def test_greedy_accepts_logits_and_ignores_draft_probs_and_generator():
    logits = torch.tensor([[[0.0, 9.0, -3.0], [5.0, -1.0, 2.0]]])  # [1, 2, 3]
    draft_probs = torch.tensor([[[1.0, 0.0, 0.0]]])  # says nothing about acceptance
    out, n = verify("greedy", logits, draft_probs, torch.tensor([[1]]), torch.tensor([1]), gen(0))
    assert out.tolist() == [[1, 0]] and n.tolist() == [1]


def test_greedy_zero_width_draft():
    target = target_from_argmax([[3], [1]], V=4)  # [2, 1, 4]: K = 0
    out, n = verify("greedy", target, None, torch.zeros(2, 0, dtype=torch.long),
                    torch.zeros(2, dtype=torch.long), None)
    assert out.tolist() == [[3], [1]] and n.tolist() == [0, 0]


def test_greedy_zero_width_draft_refuses_a_draft_count():
    """K = 0 takes a short path; it still refuses a row that claims drafts."""
    target = target_from_argmax([[3], [1]], V=4)
    with pytest.raises(ValueError, match="num_drafts"):
        verify("greedy", target, None, torch.zeros(2, 0, dtype=torch.long), torch.tensor([0, 1]), None)


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 4), K1=st.integers(1, 4), V=st.integers(1, 40), levels=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       transpose=st.booleans())
def test_argmax_last_is_torch_argmax_ties_included(B, K1, V, levels, seed, dtype, transpose):
    """argmax_last (numpy on contiguous float32) picks torch.argmax's index: the lowest id
    among ties; few distinct values make ties common."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (B, K1, V), generator=g).to(dtype)
    if transpose:  # a non-contiguous view takes torch's own path
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    got = argmax_last(x)
    assert got.dtype == torch.long and got.shape == (B, K1)
    assert torch.equal(got, x.argmax(-1))


def test_argmax_last_on_a_152k_vocabulary_with_a_tie():
    x = torch.zeros(2, 151936)
    x[0, 70000] = x[0, 90000] = 5.0  # tie: the lower id
    x[1, -1] = 1.0
    assert argmax_last(x).tolist() == [70000, 151935]


def test_result_is_named_tuple():
    target = target_from_argmax([[0, 1]], V=2)
    res = verify("greedy", target, None, torch.tensor([[0]]), torch.tensor([1]), None)
    assert isinstance(res, VerifyResult)
    assert res.tokens.tolist() == [[0, 1]] and res.num_accepted.tolist() == [1]


# ---------------------------------------------------------------- rejection


def test_rejection_p_equals_q_accepts_everything_over_many_seeds():
    rng = np.random.default_rng(1)
    B, K, V = 64, 4, 7
    p = dirichlet(rng, (B, K + 1), V)
    q = p[:, :K].clone()
    num_drafts = torch.tensor([k % (K + 1) for k in range(B)])
    for seed in range(50):
        g = gen(seed)
        draft_tokens = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
        out, n = verify("rejection", p, q, draft_tokens, num_drafts, g)
        assert torch.equal(n, num_drafts)
        pos = torch.arange(K)
        keep = pos < num_drafts[:, None]
        assert torch.equal(out[:, :K][keep], draft_tokens[keep])
        bonus = out[torch.arange(B), num_drafts]
        assert (p[torch.arange(B), num_drafts].gather(1, bonus[:, None]) > 0).all()


def test_rejection_zero_sum_residual_falls_back_to_p():
    # q > p at the draft token while max(0, p - q) is all zeros (q overshoots p, as
    # rounding can do). Rejection happens with probability 1/2 and must not
    # produce NaN or an error; the recovered token comes from p.
    B, V = 2000, 4
    p = torch.tensor([0.5, 0.5, 0.0, 0.0]).expand(B, 2, V)
    q = torch.tensor([1.0, 1.0, 0.0, 0.0]).expand(B, 1, V)
    draft_tokens = torch.zeros(B, 1, dtype=torch.long)
    out, n = verify("rejection", p, q, draft_tokens, torch.ones(B, dtype=torch.long), gen(3))
    rejected = n == 0
    assert 0.4 < rejected.float().mean() < 0.6
    assert set(out[rejected, 0].tolist()) == {0, 1}  # sampled from p, not from zeros
    assert (out[:, 0] >= 0).all() and (out[:, 0] <= 1).all()


def test_rejection_tiny_residual_is_not_normalised_into_a_rare_token():
    # The residual is 1e-9 at token 2 only. Normalising it would make token 2 (p = 1e-9)
    # the recovered token every time; the guard samples from p instead.
    B, V = 2000, 4
    p_row = torch.tensor([0.5, 0.5 - 1e-9, 1e-9, 0.0], dtype=torch.float64)
    q_row = torch.tensor([0.5, 1.0, 0.0, 0.0], dtype=torch.float64)
    assert (p_row - q_row).clamp_min(0).sum() <= RESIDUAL_EPS
    p = p_row.expand(B, 2, V)
    q = q_row.expand(B, 1, V)
    draft_tokens = torch.ones(B, 1, dtype=torch.long)
    out, n = verify("rejection", p, q, draft_tokens, torch.ones(B, dtype=torch.long), gen(4))
    rejected = n == 0
    assert rejected.sum() > 500
    assert (out[rejected, 0] != 2).all()
    assert set(out[rejected, 0].tolist()) == {0, 1}


def test_rejection_p_equals_one_hot_q_with_none_draft_probs():
    # One-hot drafter and a target certain of the draft token: residual is all zeros,
    # every draft is accepted.
    B, K, V = 16, 3, 5
    target = target_from_argmax([[1, 2, 3, 4]] * B, V)
    target = (target == target.max(-1, keepdim=True).values).float()  # exact one-hot
    draft_tokens = torch.tensor([[1, 2, 3]] * B)
    out, n = verify("rejection", target, None, draft_tokens, torch.full((B,), K), gen(0))
    assert (n == K).all() and (out == torch.tensor([1, 2, 3, 4])).all()


def test_rejection_none_draft_probs_equals_explicit_one_hot():
    rng = np.random.default_rng(5)
    B, K, V = 300, 3, 6
    p = dirichlet(rng, (B, K + 1), V)
    draft_tokens = torch.from_numpy(rng.integers(0, V, size=(B, K)))
    num_drafts = torch.from_numpy(rng.integers(0, K + 1, size=B))
    one_hot = torch.nn.functional.one_hot(draft_tokens, V).float()
    a = verify("rejection", p, None, draft_tokens, num_drafts, gen(11))
    b = verify("rejection", p, one_hot, draft_tokens, num_drafts, gen(11))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    # The recovered token of a one-hot drafter is never the rejected draft token.
    rejected = a.num_accepted < num_drafts
    rows = torch.arange(B)[rejected]
    j = a.num_accepted[rejected]
    assert (a.tokens[rows, j] != draft_tokens[rows, j]).all()


def test_rejection_q_zero_accepts_when_p_positive_and_never_when_p_zero():
    V = 3
    p = torch.tensor([[[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]]).expand(200, 2, V)
    q = torch.tensor([[[1.0, 0.0, 0.0]]]).expand(200, 1, V)
    ones = torch.ones(200, dtype=torch.long)
    out, n = verify("rejection", p, q, torch.ones(200, 1, dtype=torch.long), ones, gen(0))
    assert (n == 1).all()  # q(1) = 0, p(1) = 0.5: p/q = +inf
    out, n = verify("rejection", p, q, torch.zeros(200, 1, dtype=torch.long), ones, gen(0))
    assert (n == 0).all()  # p(0) = 0: never accepted
    assert (out[:, 0] != 0).all()


def test_rows_without_drafts_draw_nothing_for_acceptance():
    rng = np.random.default_rng(7)
    B, K, V = 50, 3, 9
    p = dirichlet(rng, (B, K + 1), V)
    q = dirichlet(rng, (B, K), V)
    draft_tokens = torch.from_numpy(rng.integers(0, V, size=(B, K)))
    zero = torch.zeros(B, dtype=torch.long)
    g1, g2 = gen(21), gen(21)
    out, n = verify("rejection", p, q, draft_tokens, zero, g1)
    expected = sample_from_probs(p[:, 0], g2)  # exactly the draws of the bonus tokens
    assert torch.equal(out[:, 0], expected) and (n == 0).all() and (out[:, 1:] == -1).all()
    assert torch.equal(g1.get_state(), g2.get_state())


def source(rule, target_probs, seed):
    """The rule's random source: keyed Gumbel noise for coupled, a generator otherwise."""
    if rule == "coupled":
        g = gen(seed)
        u = torch.rand(target_probs.shape, generator=g).clamp_(min=1e-20)
        return -torch.log(-torch.log(u))
    return gen(seed)


def test_padding_of_rows_without_drafts_does_not_change_anything():
    rng = np.random.default_rng(8)
    B, K, V = 40, 2, 5
    p = dirichlet(rng, (B, K + 1), V)
    q = dirichlet(rng, (B, K), V)
    num_drafts = torch.from_numpy(rng.integers(0, K + 1, size=B))
    draft_tokens = torch.from_numpy(rng.integers(0, V, size=(B, K)))
    pad = torch.arange(K) >= num_drafts[:, None]
    other = draft_tokens.masked_fill(pad, -1)
    for rule in RULES:
        a = verify(rule, p, q, draft_tokens, num_drafts, source(rule, p, 2))
        b = verify(rule, p, q, other, num_drafts, source(rule, p, 2))
        assert torch.equal(a.tokens, b.tokens), rule
        assert (a.num_accepted <= num_drafts).all()


@pytest.mark.parametrize("rule", ["rejection", "typical-lossy"])
def test_same_seed_same_output_other_seed_other_output(rule):
    rng = np.random.default_rng(9)
    B, K, V = 200, 3, 8
    p = dirichlet(rng, (B, K + 1), V)
    q = dirichlet(rng, (B, K), V)
    draft_tokens = torch.from_numpy(rng.integers(0, V, size=(B, K)))
    num_drafts = torch.from_numpy(rng.integers(0, K + 1, size=B))
    a = verify(rule, p, q, draft_tokens, num_drafts, gen(123))
    b = verify(rule, p, q, draft_tokens, num_drafts, gen(123))
    c = verify(rule, p, q, draft_tokens, num_drafts, gen(124))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    assert not torch.equal(a.tokens, c.tokens)


# ---------------------------------------------------------------- typical-lossy


def test_typical_lossy_literal():
    # Position 0: uniform p over 4 -> threshold min(0.09, 0.3 * 1/4) = 0.075 < 0.25:
    # accepted although the drafter gave it probability 0.001 (q is ignored).
    # Position 1: p = [.97, .01, .01, .01] -> threshold 0.09 > 0.01: token 1 rejected.
    p = torch.tensor([[[0.25] * 4, [0.97, 0.01, 0.01, 0.01], [0.0, 0.0, 1.0, 0.0]]])
    q = torch.tensor([[[0.997, 0.001, 0.001, 0.001], [0.0, 1.0, 0.0, 0.0]]])
    out, n = verify("typical-lossy", p, q, torch.tensor([[3, 1]]), torch.tensor([2]), gen(0))
    assert n.tolist() == [1]
    assert out[0, 0].item() == 3 and out[0, 2].item() == -1
    assert out[0, 1].item() in (0, 1, 2, 3)
    # Both accepted -> bonus sampled from the one-hot p at position 2.
    out, n = verify("typical-lossy", p, q, torch.tensor([[3, 0]]), torch.tensor([2]), gen(0))
    assert n.tolist() == [2] and out.tolist() == [[3, 0, 2]]


def test_typical_lossy_threshold_parameters():
    p = torch.tensor([[[0.25] * 4, [0.25] * 4]])
    fn = RULES["typical-lossy"]
    args = (p, None, torch.tensor([[0]]), torch.tensor([1]))
    assert fn(*args, gen(0)).num_accepted.item() == 1
    assert fn(*args, gen(0), posterior_alpha=2.0, posterior_threshold=0.5).num_accepted.item() == 0


def test_rule_registry():
    assert set(RULES) == {"rejection", "greedy", "coupled", "typical-lossy"}
    assert LOSSY_RULES == frozenset({"typical-lossy"})
    assert LOSSY_RULES <= set(RULES)


# ---------------------------------------------------------------- errors


def test_unknown_rule_names_the_valid_ones():
    with pytest.raises(ValueError) as e:
        verify("speculative", torch.ones(1, 1, 2) / 2, None,
               torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, dtype=torch.long), gen(0))
    for name in RULES:
        assert name in str(e.value)


def _ok_inputs():
    B, K, V = 2, 3, 5
    return dict(
        target_probs=torch.full((B, K + 1, V), 1.0 / V),
        draft_probs=torch.full((B, K, V), 1.0 / V),
        draft_tokens=torch.zeros(B, K, dtype=torch.long),
        num_drafts=torch.tensor([3, 1]),
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(target_probs=torch.ones(2, 4)), "target_probs"),
        (dict(target_probs=torch.ones(2, 4, 5, dtype=torch.long)), "target_probs"),
        (dict(draft_tokens=torch.zeros(2, 2, dtype=torch.long)), "draft_tokens"),
        (dict(draft_tokens=torch.zeros(2, 3)), "draft_tokens"),
        (dict(draft_probs=torch.ones(2, 3, 4)), "draft_probs"),
        (dict(draft_probs=torch.ones(2, 4, 5)), "draft_probs"),
        (dict(num_drafts=torch.tensor([1, 1, 1])), "num_drafts"),
        (dict(num_drafts=torch.tensor([4, 0])), "num_drafts"),
        (dict(num_drafts=torch.tensor([-1, 0])), "num_drafts"),
        (dict(num_drafts=torch.tensor([1.0, 0.0])), "num_drafts"),
        (dict(draft_tokens=torch.tensor([[0, 5, 0], [0, 0, 0]])), "draft_tokens"),
        (dict(draft_tokens=torch.tensor([[0, 0, 0], [-1, 0, 0]])), "draft_tokens"),
    ],
)
@pytest.mark.parametrize("rule", sorted(RULES))
def test_bad_inputs_raise_clear_errors(rule, change, match):
    kwargs = {**_ok_inputs(), **change}
    with pytest.raises(ValueError, match=match):
        verify(rule, kwargs["target_probs"], kwargs["draft_probs"], kwargs["draft_tokens"],
               kwargs["num_drafts"], source(rule, torch.ones(2, 4, 5), 0))


def test_padding_out_of_range_is_allowed():
    kw = _ok_inputs()
    tokens = torch.tensor([[0, 1, 2], [4, -1, 99]])  # row 1 has one draft
    for rule in RULES:
        out, n = verify(rule, kw["target_probs"], kw["draft_probs"], tokens, kw["num_drafts"],
                        source(rule, kw["target_probs"], 0))
        assert (out[1, 2:] == -1).all()


@pytest.mark.parametrize("rule", ["rejection", "typical-lossy"])
def test_sampling_rules_need_a_generator(rule):
    kw = _ok_inputs()
    with pytest.raises(ValueError, match="Generator"):
        verify(rule, kw["target_probs"], None, kw["draft_tokens"], kw["num_drafts"], None)


# ---------------------------------------------------------------- properties


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 5),
    K=st.integers(0, 4),
    V=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
    rule=st.sampled_from(sorted(RULES)),
    with_q=st.booleans(),
)
def test_output_invariants(B, K, V, seed, rule, with_q):
    rng = np.random.default_rng(seed)
    p = dirichlet(rng, (B, K + 1), V)
    p = p * torch.from_numpy(rng.random((B, K + 1, V)) > 0.3)  # some zero-probability tokens
    p[..., 0] += 1e-3  # keep every row non-empty
    p = p / p.sum(-1, keepdim=True)
    q = dirichlet(rng, (B, K), V) if with_q else None
    num_drafts = torch.from_numpy(rng.integers(0, K + 1, size=B))
    draft_tokens = torch.from_numpy(rng.integers(0, V, size=(B, K)))
    pad = torch.arange(K) >= num_drafts[:, None]
    draft_tokens = draft_tokens.masked_fill(pad, -1)

    out, n = verify(rule, p, q, draft_tokens, num_drafts, source(rule, p, seed))

    assert out.shape == (B, K + 1) and n.shape == (B,)
    assert ((n >= 0) & (n <= num_drafts)).all()
    pos = torch.arange(K + 1)
    assert (out[pos > n[:, None]] == -1).all()
    assert torch.equal(out[:, :K][pos[:K] < n[:, None]], draft_tokens[pos[:K] < n[:, None]])
    # Accepted draft tokens have positive target probability under every rule.
    acc = pos[:K] < n[:, None]  # [B, K]
    p_acc = p[:, :K].gather(-1, draft_tokens.clamp_min(0)[..., None]).squeeze(-1)
    assert (p_acc[acc] > 0).all()
    rows = torch.arange(B)
    last = out[rows, n]
    assert ((last >= 0) & (last < V)).all()
    # The recovered or bonus token always has positive target probability.
    assert (p[rows, n].gather(1, last[:, None]) > 0).all()
    if rule == "greedy":
        assert torch.equal(last, p[rows, n].argmax(-1))


# ---------------------------------------------------------------- coupled


def test_coupled_emits_the_gumbel_argmax_tokens():
    """Whatever the drafts, the emitted tokens are argmax(log p + g) at each position."""
    rng = np.random.default_rng(21)
    B, K, V = 64, 4, 9
    p = dirichlet(rng, (B, K + 1), V)
    g = source("coupled", p, 5)
    target_tok = (torch.log(p) + g).argmax(-1)  # [B, K+1]
    # drafts right with probability 0.7 per position: ragged acceptance
    right = torch.from_numpy(rng.random((B, K)) < 0.7)
    drafts = torch.where(right, target_tok[:, :K], (target_tok[:, :K] + 1) % V)
    num = torch.from_numpy(rng.integers(0, K + 1, size=B))
    out, n = verify("coupled", p, None, drafts, num, g)
    for b in range(B):
        emitted = out[b, : n[b] + 1]
        assert torch.equal(emitted, target_tok[b, : n[b] + 1])
        first_wrong = int((~right[b, : num[b]]).nonzero()[0]) if (~right[b, : num[b]]).any() else int(num[b])
        assert n[b] == first_wrong


def test_coupled_needs_noise():
    kw = _ok_inputs()
    with pytest.raises(ValueError, match="keyed Gumbel noise"):
        verify("coupled", kw["target_probs"], None, kw["draft_tokens"], kw["num_drafts"], gen(0))
