"""Arbitrary per-row acceptance patterns: a fake drafter proposes the reference's next
token with a per-row probability (else a wrong token). Whatever the pattern, greedy
speculative output equals the plain reference in every row."""

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.tiny import assert_varied, native_from_hf, tiny_hf
from verispec.drafters import Drafter
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.policy import FixedK

V = 61
_M = {}


def _target():
    if "t" not in _M:
        _M["t"] = native_from_hf(tiny_hf("llama", seed=11, vocab=V, embed_scale=20.0))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 25, (12,), generator=g)]
        eng = Engine(_M["t"], config=EngineConfig(max_batch=12, max_len=80))
        reqs = [Request(p, GenerationParams(max_new_tokens=30)) for p in prompts]
        eng.run(reqs)
        _M["ref"] = {tuple(p): r.output_ids for p, r in zip(prompts, reqs)}
        assert_varied([r.output_ids for r in reqs])
    return _M["t"], _M["ref"]


class OracleDrafter(Drafter):
    """Proposes the reference continuation, each token right with probability rate[row]."""

    name = "oracle"

    def __init__(self, ref, rates, seed):
        self.ref, self.rates, self.g = ref, rates, torch.Generator().manual_seed(seed)
        self.prompt_len = {}

    def admit(self, rows, tokens):
        for r, t in zip(rows, tokens):
            self.prompt_len[r] = t

    def prepare(self, rows, tokens):
        pass

    def propose(self, rows, tokens, k, sampling, generators):
        K = max(k)
        out = torch.zeros(len(rows), K, dtype=torch.long)
        for b, (row, seq) in enumerate(zip(rows, tokens)):
            prompt = self.prompt_len[row]
            cont = self.ref[tuple(prompt)]
            done = len(seq) - len(prompt)  # generated tokens so far, pending included
            for i in range(k[b]):
                right = cont[done + i] if done + i < len(cont) else 0
                ok = float(torch.rand(1, generator=self.g)) < self.rates[row % len(self.rates)]
                out[b, i] = right if ok else (right + 1 + int(torch.randint(0, V - 1, (1,), generator=self.g))) % V
        return out, None, torch.tensor(k)

    def rollback(self, rows, committed):
        pass

    def release(self, rows):
        pass


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 12), k=st.integers(1, 6),
       rates=st.lists(st.sampled_from([0.0, 0.3, 0.7, 0.95, 1.0]), min_size=1, max_size=12),
       seed=st.integers(0, 2**16))
def test_any_acceptance_pattern_equals_reference(batch, k, rates, seed):
    target, ref = _target()
    eng = Engine(target, OracleDrafter(ref, rates, seed), FixedK(k), EngineConfig(max_batch=batch, max_len=80))
    reqs = [Request(list(p), GenerationParams(max_new_tokens=len(out))) for p, out in ref.items()]
    eng.run(reqs)
    for r in reqs:
        assert r.output_ids == ref[tuple(r.prompt_ids)]
    assert eng.cache.rows_in_use == 0
