"""Batch-invariant mode (LlamaModel(..., batch_invariant=True)) on tiny random models.

A row's logits are bitwise the same alone, in a ragged batch and inside a T=5 verify
pass; so greedy and coupled speculative decoding with every drafter emit exactly the
tokens of plain decoding at batch 1, at batch sizes 1 to 32. The target has near-tied
token pairs, so last-bit differences flip greedy tokens: the default mode, which is
not batch-invariant, is shown to diverge on the same checks.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.engine.test_engine_tiny import _prompts
from tests.tiny import tiny_hf
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.layerskip import LayerSkipDrafter
from verispec.drafters.lookup import PromptLookupDrafter
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.models.attention import (NotBatchInvariantError, invariant_attention, invariant_silu,
                                       sdpa_attention)
from verispec.models.config import ModelConfig
from verispec.models.llama import LlamaModel, _rms_norm
from verispec.policy import FixedK
from verispec.sampling import SamplingParams, logits_to_probs

V = 97
BATCHES = [1, 2, 4, 8, 16, 32]
MODES = ["greedy", 0.7, 1.0]  # greedy, and coupled sampling at these temperatures
PROMPTS = _prompts(32, seed=9)  # lengths 1..39, half of them repetitive
MAX_NEW = [6 + (i * 7) % 19 for i in range(32)]  # rows end at different times


def _state(seed: int, noise: float = 0.0) -> tuple[ModelConfig, dict]:
    hf = tiny_hf("qwen2", seed=seed, vocab=V)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(20.0)  # tokens matter: varied, non-repeating output
        w = hf.lm_head.weight  # [V, E]
        w.mul_(3.0)  # peaked distributions, so drafts are often right
        # near-tied token pairs: the logits of 2i and 2i+1 differ by ~1e-6 relative, a few
        # reduction-order roundings, so the last bits of the hidden state pick the winner
        w[1::2] = w[0:-1:2] * (1 + 1e-6 * torch.randn(w[1::2].shape, generator=g))
        for p in hf.parameters():  # the draft model: the target plus relative noise
            p.add_(torch.randn(p.shape, generator=g) * noise * p.abs().mean())
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    return cfg, {k: v.detach().clone() for k, v in hf.state_dict().items()}


@pytest.fixture(scope="module")
def weights():
    return _state(0), _state(0, noise=0.1)  # target, and a draft model close to it


@pytest.fixture(scope="module")
def models(weights):
    (cfg, sd), (dcfg, dsd) = weights
    draft = LlamaModel(dcfg, dict(dsd))  # the draft's numerics never decide emitted tokens
    return {bi: LlamaModel(cfg, dict(sd), batch_invariant=bi) for bi in (False, True)}, draft


# -- building blocks ----------------------------------------------------------------------

def _row_invariant(f, x):
    """f on each row alone == f on the whole batch, bitwise."""
    whole = f(x)
    return all(torch.equal(f(x[i:i + 1])[0], whole[i]) for i in range(x.shape[0]))


def test_primitives_are_row_invariant():
    g = torch.Generator().manual_seed(0)
    for E in (64, 97, 576, 1536):
        x = torch.randn(37, E, generator=g) * 3
        w = torch.randn(E, generator=g)
        assert _row_invariant(lambda t: _rms_norm(t, w, 1e-5), x), E
        assert _row_invariant(invariant_silu, x), E
        assert _row_invariant(torch.exp, x), E
        # exp must not depend on where an element sits (vectorised body or tail)
        flat = x.flatten()
        assert all(torch.equal(torch.exp(flat[o:o + n]), torch.exp(flat)[o:o + n])
                   for o, n in ((0, 1), (3, 17), (5, 33), (100, 1000))), E
        for sp in (SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=1.0, top_k=20)):
            assert _row_invariant(lambda t: logits_to_probs(t, sp), x), (E, sp)
    assert torch.allclose(invariant_silu(x), F.silu(x), rtol=1e-6, atol=1e-7)


def test_invariant_attention_equals_exact_key_slices():
    """Each query's output equals the query computed alone against exactly its visible
    keys, bitwise, whatever the batch, T and S; and is close to SDPA."""
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, T, S, D = 5, 6, 2, 7, 50, 16
    q, k, v = (torch.randn(*s, generator=g) for s in ((B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, D)))
    start = torch.tensor([43, 0, 10, 31, 2])  # ragged rows
    mask = (torch.arange(S)[None, None] <= (start[:, None] + torch.arange(T))[:, :, None])[:, None]
    out = invariant_attention(q, k, v, mask, 0.25)
    torch.testing.assert_close(out, sdpa_attention(q, k, v, mask, 0.25), rtol=1e-5, atol=1e-6)
    for b in range(B):
        for t in range(T):
            n = int(start[b]) + t + 1
            one = invariant_attention(q[b:b + 1, :, t:t + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                                      torch.ones(1, 1, 1, n, dtype=torch.bool), 0.25)
            assert torch.equal(one[0, :, 0], out[b, :, t]), (b, t)


def _logits_four_ways(model, seq, others):
    """Logits at positions 20..29 of seq [30], computed: alone, one token per pass; alone,
    in one T=30 pass; in a ragged batch (other rows of other lengths, prefilled together),
    one token per pass; in the same ragged batch in T=5 verify passes, the other rows
    holding different numbers of valid tokens."""
    g = torch.Generator().manual_seed(5)
    cache = model.new_cache(16, 80)
    out = {}
    row = cache.alloc()
    model.forward(seq[None, :20], cache, row)
    out["alone, T=1"] = torch.stack([model.forward(seq[None, t:t + 1], cache, row)[0, 0]
                                     for t in range(20, 30)])
    out["alone, one T=30 pass"] = model.forward(seq[None], cache, cache.alloc())[0, 20:]
    for T in (1, 5):
        rows = cache.alloc(1 + len(others))
        lens = [20] + [len(o) for o in others]
        x = torch.zeros(len(rows), max(lens), dtype=torch.long)
        for i, s in enumerate([seq[:20]] + others):
            x[i, :len(s)] = s
        model.forward(x, cache, rows, lens)
        got = []
        for t0 in range(20, 30, T):
            x = torch.randint(0, V, (len(rows), T), generator=g)
            x[0] = seq[t0:t0 + T]
            num = [T] + [int(n) for n in torch.randint(0, T + 1, (len(others),), generator=g)]
            got.append(model.forward(x, cache, rows, num)[0])
        out[f"ragged batch, T={T}"] = torch.cat(got)
    return out


def test_logits_alone_vs_ragged_batch_vs_verify_pass(models):
    by_mode, _ = models
    g = torch.Generator().manual_seed(2)
    seq = torch.randint(0, V, (30,), generator=g)
    others = [torch.randint(0, V, (n,), generator=g) for n in (7, 33, 12, 1)]
    inv = _logits_four_ways(by_mode[True], seq, others)
    ref = inv["alone, T=1"]
    for name, logits in inv.items():
        assert torch.equal(logits, ref), name
    # the default mode (SDPA) is not bitwise invariant on the same check, only close
    default = _logits_four_ways(by_mode[False], seq, others)
    assert not all(torch.equal(x, default["alone, T=1"]) for x in default.values())
    for x in default.values():
        torch.testing.assert_close(x, default["alone, T=1"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ref, default["alone, T=1"], rtol=1e-4, atol=1e-5)  # same model


def test_fallback_linear_backend_is_refused(weights, monkeypatch):
    monkeypatch.setenv("VERISPEC_LINEAR", "torch")
    cfg, sd = weights[0]
    with pytest.raises(NotBatchInvariantError, match="not batch-invariant"):
        LlamaModel(cfg, dict(sd), batch_invariant=True)
    LlamaModel(cfg, dict(sd))  # the default mode still works on the fallback


# -- the engine: speculative == plain at batch 1, at every batch size -----------------------

def _run(target, drafter, k, batch, mode):
    sampled = mode != "greedy"
    eng = Engine(target, drafter, FixedK(k),
                 EngineConfig(max_batch=batch, max_len=128, rule="coupled" if sampled else "greedy"))
    reqs = [Request(p, GenerationParams(max_new_tokens=m, sampling=SamplingParams(
        temperature=mode, top_p=0.95, seed=1000 + i) if sampled else SamplingParams()))
        for i, (p, m) in enumerate(zip(PROMPTS, MAX_NEW))]
    eng.run(reqs)
    assert eng.cache.rows_in_use == 0
    return reqs


@pytest.fixture(scope="module")
def plain(models):
    """Plain decoding at batch 1: every mode in the invariant numerics, greedy in the default."""
    by_mode, _ = models
    runs = [(True, m) for m in MODES] + [(False, "greedy")]
    return {(bi, m): [r.output_ids for r in _run(by_mode[bi], None, 0, 1, m)] for bi, m in runs}


def _drafter(name, target, draft, batch):
    return {"draft": lambda: DraftModelDrafter(draft, V, max_rows=batch, max_len=140),
            "layerskip": lambda: LayerSkipDrafter(target, 2),
            "lookup": lambda: PromptLookupDrafter(2)}[name]()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("drafter", ["draft", "layerskip", "lookup"])
def test_speculative_equals_plain_batch1_at_every_batch_size(models, plain, drafter, mode):
    by_mode, draft = models
    target = by_mode[True]
    ref = plain[(True, mode)]
    for batch in BATCHES:
        reqs = _run(target, _drafter(drafter, target, draft, batch), 3, batch, mode)
        got = [r.output_ids for r in reqs]
        exact = sum(a == b for a, b in zip(got, ref))
        assert exact == len(ref), f"{drafter}, batch {batch}, {mode}: {exact}/{len(ref)} exact"
        assert sum(r.stats.drafted for r in reqs) > 0
        if drafter != "lookup":
            assert sum(r.stats.accepted for r in reqs) > 0


def test_plain_equals_plain_batch1_at_every_batch_size(models, plain):
    target = models[0][True]
    for mode in MODES:
        for batch in (4, 32):
            assert [r.output_ids for r in _run(target, None, 0, batch, mode)] == plain[(True, mode)]


def test_default_mode_diverges_on_the_same_check(models, plain):
    """Without the invariant mode, speculative greedy at batch 8 differs from plain
    decoding at batch 1 on this near-tied model (every difference a near-tie, not a bug)."""
    by_mode, draft = models
    target = by_mode[False]
    reqs = _run(target, _drafter("draft", target, draft, 8), 3, 8, "greedy")
    ref = plain[(False, "greedy")]
    differing = sum(r.output_ids != o for r, o in zip(reqs, ref))
    assert differing > 0, "the default mode happened to be bitwise invariant here"
