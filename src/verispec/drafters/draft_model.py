"""A second, smaller model with the same tokenizer drafts autoregressively.

It keeps its own KV cache, rows aligned with the target's, prefilled when a row first
drafts (prepare(), not on admission: a row the policy never lets draft, where the draft
model cannot pay, costs no draft prefill). Its cache may lag the sequence: every proposal
first feeds the tokens the draft has not seen yet (the pending token, plus the last draft
token after a step that accepted every draft and added a bonus token: the "catch-up"; or
every token since a row last drafted, when the policy let it rest), then drafts one token
per forward pass.
"""

from __future__ import annotations

import torch

from ..models.prefill import prefill
from .base import CORRECT_HOOKS, Drafter, apply_halt, draft_from_logits


class TokenizerMismatchError(ValueError):
    pass


def check_same_tokenizer(draft_tok, target_tok) -> None:
    if draft_tok is None or target_tok is None:
        return
    if draft_tok.get_vocab() != target_tok.get_vocab():
        raise TokenizerMismatchError(
            "the draft model's tokenizer differs from the target's: speculative decoding "
            "needs both to share one vocabulary (pick a draft from the same model family)")


class DraftModelDrafter(Drafter):
    halts = True  # propose() takes a halt rule (see drafters/__init__.py)
    reuses_prefills = True

    def __init__(self, model, target_vocab: int, *, max_rows: int, max_len: int,
                 draft_tokenizer=None, target_tokenizer=None, name: str = "draft-model",
                 q_transform=None):
        check_same_tokenizer(draft_tokenizer, target_tokenizer)
        if model.config.vocab_size > target_vocab:
            raise TokenizerMismatchError(
                f"draft vocabulary ({model.config.vocab_size}) is larger than the target's ({target_vocab})")
        self.model = model
        self.name = name
        self.target_vocab = target_vocab
        self.q_transform = q_transform  # q -> the distribution drafts are drawn from (None: q)
        self.cache = model.new_cache(max_rows, max_len)
        self.prompt_cache = None  # models.prefill.PromptCache: prefills to reuse

    def map_models(self, fn) -> None:
        self.model = fn(self.model)

    @property
    def draft_model(self):  # Drafter: drafts are this model's
        return self.model

    def admit(self, rows, tokens):
        """Take the rows, empty: their prefill waits until they draft (prepare())."""
        self.cache.claim(rows)

    def prepare(self, rows, tokens):
        """Prefill the rows whose draft cache is still empty with their sequence but its
        pending (last) token, as the engine does for the target, batched and through the
        prompt cache: the proposal then feeds one token, and the engine times this as
        prefill, not as a drafting step. Rows already prefilled are left to the catch-up."""
        fresh = [(r, t) for r, t in zip(rows, tokens) if int(self.cache.lengths[r]) == 0 and len(t) > 1]
        if fresh:
            prefill(self.model, self.cache, [r for r, _ in fresh], [t[:-1] for _, t in fresh], self.prompt_cache)

    def propose(self, rows, tokens, k, sampling, generators, halt=None):
        if self.hooks is not None:
            tokens = self.hooks.held(rows, tokens)
        B, K = len(rows), max(k, default=0)
        out = torch.zeros(B, K, dtype=torch.long)  # [B,K]
        # only the rejection-style rules read q: greedy rows draft the argmax (q one-hot,
        # which None says cheaply) and seeded rows draw with the keyed noise the target verifies with
        need_q = any(not (sampling[b].greedy or sampling[b].keyed) for b in range(B) if k[b] > 0)
        probs = torch.zeros(B, K, self.target_vocab) if need_q else None  # [B,K,V]
        num = torch.tensor(k, dtype=torch.long)  # [B]
        active = [b for b in range(B) if k[b] > 0]
        if not active:
            return out, probs, num
        # 1. catch up: feed what the draft cache has not seen, pending token included
        lens = self.cache.lengths  # [R] CPU
        unseen = (CORRECT_HOOKS if self.hooks is None else self.hooks).unseen
        feeds = [unseen(tokens[b], int(lens[rows[b]])) for b in active]
        T = max(map(len, feeds))
        x = torch.zeros(len(active), T, dtype=torch.long)  # [B',T]
        for i, f in enumerate(feeds):
            x[i, :len(f)] = torch.tensor(f)
        act_rows = [rows[b] for b in active]
        logits = self.model.forward(x, self.cache, act_rows, [len(f) for f in feeds], last_only=True)
        # 2. draft one token per pass; rows leave once they have k[b] drafts, or when
        #    the halt rule stops them on the draft's own confidence
        for i in range(K):
            conf = draft_from_logits(logits, active, i, tokens, sampling, generators, out, probs,
                                     confidence=halt is not None, transform=self.q_transform, hooks=self.hooks)
            active = apply_halt(halt, i, active, k, conf, num)
            if not active:
                break
            logits = self.model.forward(out[active, i:i + 1], self.cache,
                                        [rows[b] for b in active], last_only=True)
        return out, probs, num

    def rollback(self, rows, committed):
        """The draft cache keeps at most the committed tokens (it may lag them: catch-up)."""
        lens = self.cache.lengths
        rows = list(rows)
        self.cache.truncate(rows, [min(int(lens[r]), c) for r, c in zip(rows, committed)])

    def release(self, rows):
        self.cache.free(rows)
        if self.hooks is not None:
            self.hooks.released(rows)
