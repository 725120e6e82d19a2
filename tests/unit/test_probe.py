"""The calibration probe's q (audit/probe.py): a distribution whose every draft inside the
nucleus is kept by the exact rule with probability exactly the nucleus mass."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from verispec.audit.probe import acceptance, nucleus_q


@st.composite
def distributions(draw):
    V = draw(st.integers(2, 40))
    logits = torch.tensor(draw(st.lists(st.floats(-8, 8), min_size=V, max_size=V)), dtype=torch.float64)
    if draw(st.booleans()):  # some zeros, as top-k / top-p leave
        cut = draw(st.integers(1, V))
        logits[torch.argsort(logits)[: V - cut]] = float("-inf")
    return logits.softmax(-1)


@settings(max_examples=300, deadline=None)
@given(p=distributions(), mass=st.floats(0.05, 0.99))
def test_nucleus_q_is_a_distribution_with_ratio_mass_inside(p, mass):
    q = nucleus_q(p, mass)
    assert torch.all(q >= 0) and abs(float(q.sum()) - 1) < 1e-9
    assert torch.all(q[p == 0] == 0)  # never drafts a token the target cannot emit
    order = torch.sort(-p, stable=True).indices
    sp, sq = p[order], q[order]
    before = sp.cumsum(0) - sp
    inside = before + sp <= mass
    # inside the nucleus p/q is the mass exactly: the exact rule keeps such a draft w.p. mass
    assert torch.allclose(sp[inside] / sq[inside], torch.full_like(sp[inside], mass), rtol=1e-9)
    if sp[0] > mass:  # the top token alone is past the mass: q one-hot there, a = p(top)
        assert float(sq[0]) == pytest.approx(1.0) and acceptance(float(sp[0]), float(sq[0])) == pytest.approx(float(sp[0]))
    # the expected acceptance sum_x q(x) min(1, p/q) equals sum_x min(p, q): at least the mass
    assert float(torch.minimum(p, q).sum()) >= mass - 1e-9


def test_nucleus_q_known_values():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = nucleus_q(p, 0.8)
    assert torch.allclose(q, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    q = nucleus_q(p, 0.6)  # 0.5 inside, the boundary token takes the rest of q
    assert torch.allclose(q, torch.tensor([0.5 / 0.6, 0.1 / 0.6, 0.0, 0.0]))
    assert acceptance(0.5, float(q[0])) == pytest.approx(0.6)
    assert acceptance(0.3, float(q[1])) == 1.0
    q = nucleus_q(torch.tensor([0.05, 0.9, 0.05]), 0.8)
    assert torch.equal(q, torch.tensor([0.0, 1.0, 0.0]))
    q = nucleus_q(torch.tensor([[0.25, 0.25, 0.25, 0.25]]), 0.5)  # ties: by token id, batched
    assert torch.allclose(q, torch.tensor([[0.5, 0.5, 0.0, 0.0]]))


@pytest.mark.parametrize("mass", [0.0, 1.5, -0.1])
def test_nucleus_q_refuses_a_mass_outside_0_1(mass):
    with pytest.raises(ValueError, match="nucleus mass"):
        nucleus_q(torch.tensor([0.5, 0.5]), mass)


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])
def test_nucleus_q_candidate_shortcut_equals_the_full_sort(scale, monkeypatch):
    """Rows whose nucleus closes inside the top CANDIDATES tokens skip the full sort; the
    result is the same q, ties with a token left out included."""
    from verispec.audit import probe
    g = torch.Generator().manual_seed(int(scale * 10))
    p = (torch.randn(48, 1000, generator=g, dtype=torch.float64) * scale).softmax(-1)
    p[0] = 0.0
    p[0, :600] = 1 / 600  # 600 equal tokens: the candidates end inside a tie
    fast = nucleus_q(p, 0.8)
    monkeypatch.setattr(probe, "CANDIDATES", 10 ** 9)
    assert torch.equal(fast, nucleus_q(p, 0.8))
