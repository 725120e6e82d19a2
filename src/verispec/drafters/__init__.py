"""Drafters propose tokens; the policy (policy/) decides how many.

Drafter protocol (all row arguments are KV-cache rows of the engine's target cache)::

    name: str
    admit(rows, tokens)                 new requests joined on these rows
    prepare(rows, tokens)               these rows draft in this step, for the first time or
        again: work a drafter deferred until a row drafts (the draft model's prefill) is
        done here, and the engine counts it as prefill, not as drafting. A row the policy
        never lets draft costs such a drafter nothing.
    propose(rows, tokens, k, sampling, generators[, halt])
        -> draft_tokens [B,K] long, draft_probs [B,K,V] | None, num_drafts [B] long
        tokens[b] is the row's whole sequence so far; its last token is the pending
        one (not yet in the target's cache). k[b] drafts for row b (0 allowed).
        num_drafts[b] <= k[b]: a drafter may find fewer (prompt lookup without a match).
        draft_probs None means the drafter has no distribution (q is one-hot).
    halts: bool                         (optional) propose takes `halt`: after drafting
        position i for the rows `active` (indices into rows), it calls
        halt(i, active, conf) -> list[bool], conf[j] being the drafter's own probability
        of the token it drafted for row active[j]; rows answered True stop at i + 1
        drafts. Only the drafter's probabilities reach the rule, never the target's
        verdicts, so a policy deciding there stays non-anticipating.
    rollback(rows, committed)           the target kept committed[b] tokens in cache
    release(rows)                       the rows' requests left the batch
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..sampling import SamplingParams, logits_to_probs, sample_token
from ..verify.rules import argmax_last


class Drafter(Protocol):
    name: str

    def admit(self, rows: list[int], tokens: list[list[int]]) -> None: ...

    def prepare(self, rows: list[int], tokens: list[list[int]]) -> None: ...

    def propose(self, rows: list[int], tokens: list[list[int]], k: list[int],
                sampling: list[SamplingParams], generators: list
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]: ...

    def rollback(self, rows: list[int], committed: list[int]) -> None: ...

    def release(self, rows: list[int]) -> None: ...


def draft_from_logits(logits: torch.Tensor, active: list[int], i: int, tokens, sampling, generators,
                      out: torch.Tensor, probs: torch.Tensor | None, confidence: bool = False,
                      transform=None) -> list[float] | None:
    """Fill draft position i for the active rows from the drafter's logits [B',V].

    Greedy rows take the argmax (one vectorised call); sampled rows draw from q with
    their own random source and, where the rule needs it, record q in probs [B,K,V].
    With confidence=True, returns the drafter's probability of each drafted token
    (greedy rows: the softmax's top probability; sampled rows: q of the token drawn).
    `transform(q) -> q'` replaces a sampled row's q before the draw (the audit's probe
    drafter: audit/probe.py); q' is what is drawn from and what the rule reads.
    """
    best = argmax_last(logits).tolist()  # sync: one per draft position for the whole batch
    conf = None
    if confidence:  # p(argmax) = exp(max - logsumexp), every row at once
        lf = logits.float()
        conf = torch.exp(lf.amax(-1) - torch.logsumexp(lf, -1)).tolist()  # [B']
    for j, b in enumerate(active):
        sp = sampling[b]
        if sp.greedy:
            out[b, i] = best[j]
            continue
        q = logits_to_probs(logits[j], sp)  # [V]
        if transform is not None:
            q = transform(q)
        if probs is not None:
            probs[b, i, :q.shape[-1]] = q
        out[b, i] = sample_token(q, sp, generators[b], len(tokens[b]) + i)
        if conf is not None:
            conf[j] = float(q[out[b, i]])
    return conf


def apply_halt(halt, i: int, active: list[int], k: list[int], conf, num: torch.Tensor) -> list[int]:
    """After draft position i: the rows of `active` that draft position i + 1. Rows that
    reached k[b] stop; with a halt rule, so do those it stops (num[b] = i + 1 for them)."""
    if halt is None:
        return [b for b in active if k[b] > i + 1]
    stop = halt(i, active, conf)
    going = []
    for b, s in zip(active, stop):
        if s and k[b] > i + 1:
            num[b] = i + 1
        elif k[b] > i + 1:
            going.append(b)
    return going


def make_drafter(spec: str | None, target, target_tokenizer, *, max_rows: int, max_len: int,
                 progress: bool = True):
    """Build a drafter from a CLI/server spec: None|'none', 'lookup[:N]', 'layerskip:N',
    or a model (preset name, directory, GGUF file, hub id), loaded on the target's backend."""
    if spec is None or spec == "none":
        return None
    if spec == "lookup" or spec.startswith("lookup:"):
        from .lookup import PromptLookupDrafter
        n = int(spec.split(":", 1)[1]) if ":" in spec else 3
        return PromptLookupDrafter(max_ngram=n)
    if spec.startswith("layerskip:"):
        from .layerskip import LayerSkipDrafter
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"layerskip:N needs an integer layer count, got {spec!r}") from None
        return LayerSkipDrafter(target, n)
    from ..models import load_model
    from .draft_model import DraftModelDrafter
    loaded = load_model(spec, progress=progress, backend=getattr(target, "runtime", None))
    return DraftModelDrafter(loaded.model, target.config.vocab_size, max_rows=max_rows,
                             max_len=max_len, draft_tokenizer=loaded.tokenizer,
                             target_tokenizer=target_tokenizer, name=spec)
