"""Test-only fault injection: the bugs that break batched speculative decoding in the
wild, each switched on by name inside a `with inject(name):` block, so the audit can
prove it catches them. Nothing here runs unless a test or `verispec audit
--inject-fault` asks for it."""

from __future__ import annotations

import contextlib
import inspect

import torch

FAULTS = {
    "rollback-off-by-one": "KV rollback keeps one token too few after each step",
    "positions-not-realigned": "positions of every row continue from the batch's longest row",
    "residual-not-normalised": "recovered tokens drawn from the unnormalised residual by inverse CDF",
    "draft-no-catchup": "the draft cache skips the last draft token after a bonus token",
    "row-leak": "a row's pending token leaks into its neighbour's verify input every 5th step",
}


@contextlib.contextmanager
def inject(name: str):
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; faults: {', '.join(FAULTS)}")
    from ..drafters import draft_model
    from ..models import llama
    from ..verify import rules
    from . import core

    patches: list[tuple[object, str, object]] = []

    def patch(obj, attr, value):
        patches.append((obj, attr, inspect.getattr_static(obj, attr)))  # keeps staticmethod
        setattr(obj, attr, value)

    if name == "rollback-off-by-one":
        patch(core.Engine, "_committed_length", lambda self, r: len(r.tokens) - 2)
    elif name == "positions-not-realigned":
        patch(llama, "_positions", lambda start, T: start.max() + torch.arange(T)[None].expand(len(start), T))
    elif name == "residual-not-normalised":
        def inverse_cdf(probs, generator):  # assumes sum(probs) == 1: wrong for a raw residual
            u = torch.rand(probs.shape[0], 1, generator=generator, dtype=probs.dtype)
            return torch.searchsorted(probs.cumsum(-1), u).squeeze(-1).clamp(max=probs.shape[-1] - 1)
        patch(rules, "sample_from_probs", inverse_cdf)
    elif name == "draft-no-catchup":
        patch(draft_model.DraftModelDrafter, "_unseen",
              staticmethod(lambda seq, cached: seq[max(cached, len(seq) - 1):]))
    elif name == "row-leak":
        original = core.Engine._pending_tokens

        def leaky(self, reqs):
            x = original(self, reqs)
            if len(reqs) > 1 and self.times.steps % 5 == 4:
                x[0] = x[1].clone()
            return x
        patch(core.Engine, "_pending_tokens", leaky)
    try:
        yield
    finally:
        for obj, attr, old in reversed(patches):
            setattr(obj, attr, old)
