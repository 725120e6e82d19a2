"""Layer-skip self-draft: the target's first N layers, then its final norm and LM head.

It shares the target's weights and KV cache (no extra weights in memory). Drafting
writes layers < N at the positions after the row's committed length; the target's
verification pass then rewrites those positions for every layer, so proposing ends
by rolling the shared cache back to where it started.
"""

from __future__ import annotations

import torch

from .base import Drafter, apply_halt, draft_from_logits


class LayerSkipDrafter(Drafter):
    halts = True  # propose() takes a halt rule (see drafters/__init__.py)

    def __init__(self, target, num_layers: int):
        if not target.partial_layers:  # the CausalLM protocol says whether it can
            from ..models.ggml import LAYER_SKIP_UNSUPPORTED, UnsupportedFeatureError
            raise UnsupportedFeatureError(f"{target.runtime} backend: {LAYER_SKIP_UNSUPPORTED}")
        L = target.config.num_layers
        if not 1 <= num_layers < L:
            raise ValueError(f"layerskip:N needs 1 <= N < {L} (the target's layer count), got {num_layers}")
        self.target = target
        self.num_layers = num_layers
        self.name = f"layerskip:{num_layers}"
        self.cache = None  # bound by the engine: the target's cache

    def map_models(self, fn) -> None:
        self.target = fn(self.target)

    @property
    def draft_layers(self) -> int:  # Drafter: drafts are the target's first num_layers layers
        return self.num_layers

    def bind_cache(self, cache) -> None:
        self.cache = cache

    def admit(self, rows, tokens):
        pass

    def prepare(self, rows, tokens):
        pass

    def propose(self, rows, tokens, k, sampling, generators, halt=None):
        if self.hooks is not None:
            tokens = self.hooks.held(rows, self.hooks.sequences(tokens))
        B, K = len(rows), max(k, default=0)
        V = self.target.config.vocab_size
        out = torch.zeros(B, K, dtype=torch.long)  # [B,K]
        # only the rejection-style rules read q: greedy rows draft the argmax (q one-hot,
        # which None says cheaply) and seeded rows draw with the keyed noise the target verifies with
        need_q = any(not (sampling[b].greedy or sampling[b].keyed) for b in range(B) if k[b] > 0)
        probs = torch.zeros(B, K, V) if need_q else None  # [B,K,V]
        num = torch.tensor(k, dtype=torch.long)  # [B]
        active = [b for b in range(B) if k[b] > 0]
        if not active:
            return out, probs, num
        start = self.cache.lengths[[rows[b] for b in active]].clone()  # [B'] committed lengths
        x = torch.tensor([[tokens[b][-1]] for b in active])  # [B',1] pending tokens
        act_rows = [rows[b] for b in active]
        for i in range(K):
            logits = self.target.forward(x, self.cache, act_rows, last_only=True,
                                         num_layers=self.num_layers)
            conf = draft_from_logits(logits, active, i, tokens, sampling, generators, out, probs,
                                     confidence=halt is not None, hooks=self.hooks)
            active = apply_halt(halt, i, active, k, conf, num)
            if not active:
                break
            act_rows = [rows[b] for b in active]
            x = out[active, i:i + 1]
        all_rows = [rows[b] for b in range(B) if k[b] > 0]
        self.cache.truncate(all_rows, start)
        return out, probs, num

    def rollback(self, rows, committed):
        pass  # the target's own rollback covers the shared cache

    def release(self, rows):
        if self.hooks is not None:
            self.hooks.released(rows)
