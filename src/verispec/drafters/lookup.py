"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the
sequence's last n-gram (in the prompt or the text generated so far). No model, no q."""

from __future__ import annotations

import torch

from .base import Drafter


def lookup_continuation(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens continuing the longest suffix n-gram's most recent earlier match."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = tokens[n_tok - n:]
        # scan right to left, excluding the suffix itself
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                cont = tokens[start + n:start + n + k]
                if cont:
                    return cont
    return []


class PromptLookupDrafter(Drafter):
    name = "lookup"

    def __init__(self, max_ngram: int = 3):
        if max_ngram < 1:
            raise ValueError("lookup n-gram size must be >= 1")
        self.max_ngram = max_ngram

    @property
    def lookup_ngram(self) -> int:  # Drafter: drafts are prompt lookup's continuation
        return self.max_ngram

    def admit(self, rows, tokens):
        pass

    def prepare(self, rows, tokens):
        pass

    def propose(self, rows, tokens, k, sampling, generators):
        if self.hooks is not None:
            tokens = self.hooks.held(rows, self.hooks.sequences(tokens))
        K = max(k, default=0)
        out = torch.zeros(len(rows), K, dtype=torch.long)  # [B,K]
        n = torch.zeros(len(rows), dtype=torch.long)  # [B] drafts actually found
        for b, (seq, kb) in enumerate(zip(tokens, k)):
            cont = lookup_continuation(seq, kb, self.max_ngram) if kb else []
            out[b, :len(cont)] = torch.tensor(cont, dtype=torch.long)
            n[b] = len(cont)
        return out, None, n

    def rollback(self, rows, committed):
        pass

    def release(self, rows):
        if self.hooks is not None:
            self.hooks.released(rows)
