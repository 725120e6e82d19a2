"""Faults in the backend itself: a batched forward that is wrong for plain decoding too.

Every engine on the model runs such a fault, plain references included, so the null run
(plain decoding at the largest batch against plain batch 1, audit/equivalence.py) shares
it. On a backend with noisy numerics the null once set the near-tie margin; a fault that
makes plain batching diverge then widened the margin until the speculative divergences it
causes counted as numerics. These faults prove that the null is tested as well: a plain
divergence beyond the backend's measured noise fails the check instead.

The batch-1 passes the audit teacher-forces with, and the single-row passes of the noise
measurement (models/noise.py), are not touched: the faults need two rows in one pass.
"""

from __future__ import annotations

import torch

from .catalogue import register
from ..registry import EQUIVALENCE


class BackendView:
    """A CausalLM (models/__init__.py) that is the model with its forward replaced by
    `forward(model, tokens, cache, rows, num_new, **kw)`, and backend_fault naming the fault;
    the rest of the protocol is the model's own (same weights, same caches)."""

    backend_fault: str  # the fault's name, set per view

    def __init__(self, model, forward, name: str):
        self._model, self._forward, self.backend_fault = model, forward, name
        self.config = model.config

    def forward(self, tokens, cache, rows, num_new=None, **kw) -> torch.Tensor:
        return self._forward(self._model, tokens, cache, rows, num_new, **kw)

    def new_cache(self, max_rows: int, max_len: int):
        return self._model.new_cache(max_rows, max_len)

    def fingerprint(self) -> str:
        return self._model.fingerprint()

    backend = property(lambda self: self._model.backend)
    runtime = property(lambda self: self._model.runtime)
    partial_layers = property(lambda self: self._model.partial_layers)
    noisy_numerics = property(lambda self: self._model.noisy_numerics)
    supports_trees = property(lambda self: self._model.supports_trees)


def _rows_list(rows) -> list[int]:
    return rows.tolist() if isinstance(rows, torch.Tensor) else [int(r) for r in rows]


def _reordered(model, tokens, cache, rows, num_new, **kw):
    # the logits come back in ascending cache-row order, whatever order the rows were fed in
    out = model.forward(tokens, cache, rows, num_new, **kw)
    rows = _rows_list(rows)
    order = sorted(range(len(rows)), key=rows.__getitem__)
    return out if order == list(range(len(rows))) else out[order]


def _bleed(model, tokens, cache, rows, num_new, **kw):
    # every row but the first reads a quarter of the first row's activations at the head
    out = model.forward(tokens, cache, rows, num_new, **kw)
    if out.shape[0] < 2:
        return out
    out = out.clone()
    out[1:] = 0.75 * out[1:] + 0.25 * out[:1]
    return out


register("backend-rows-reordered",
         "the backend returns a pass's logits in ascending cache-row order instead of the order the "
         "rows were fed in: wrong only once a freed row is reused and the running rows are out of "
         "order, in plain decoding as much as in speculative",
         EQUIVALENCE, lambda c: {"backend": lambda m: BackendView(m, _reordered, "backend-rows-reordered")})
register("backend-neighbour-bleed",
         "in a pass over two or more rows, the backend mixes a quarter of the first row's logits into "
         "every other row's: plain batched decoding diverges as well, so the null run shares the fault",
         EQUIVALENCE, lambda c: {"backend": lambda m: BackendView(m, _bleed, "backend-neighbour-bleed")})
