"""The drafter protocol (documented in drafters/__init__.py), the drafter's seams
(DrafterHooks) and the drawing and halting steps the drafters with a model share."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..sampling import SamplingParams, logits_to_probs, sample_token
from ..verify.rules import argmax_last


class DrafterHooks:
    """What a drafter reads of the sequences and reports of its q. These methods are the
    correct behaviour: a test or the audit's fault suite (audit/faults/) sets a subclass
    that breaks one seam on purpose as Drafter.hooks, on that drafter alone. A drafter
    without hooks skips sequences(), held(), released() and reported_q(), which change
    nothing."""

    def sequences(self, tokens: list[list[int]]) -> list[list[int]]:
        """The sequences propose() drafts from, by a drafter that reads them whole every
        step (prompt lookup, layer-skip)."""
        return tokens

    def held(self, rows: list[int], tokens: list[list[int]]) -> list[list[int]]:
        """The sequences propose() drafts from as the drafter's per-row state holds them:
        tokens[i], the sequence of the request now on rows[i], and nothing of the requests
        that had the row before it (released() voids what they left)."""
        return tokens

    def released(self, rows: list[int]) -> None:
        """The rows' requests left the batch (Drafter.release): what the drafter holds for
        them is void."""

    def unseen(self, seq: list[int], cached: int) -> list[int]:
        """Tokens of seq that a drafter with its own cache (a draft model) has not fed yet,
        `cached` being what that cache holds: the pending token, plus the last draft token
        when the previous step accepted all drafts (the catch-up)."""
        return seq[cached:]

    def reported_q(self, q: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The q [V] recorded for a draft drawn from q (logits [V]: the drafter's own)."""
        return q

    def drawn_q(self, q: torch.Tensor) -> torch.Tensor:
        """The distribution [V] a sampled draft is drawn from, q being the one it reports."""
        return q


CORRECT_HOOKS = DrafterHooks()  # holds no state: shared by the drafters without hooks


class Drafter(ABC):
    """Base of every drafter: the protocol's five methods to implement (drafters/__init__.py),
    and the capabilities a caller may use stated here with their defaults, so that no caller
    probes a drafter for them."""

    name: str = "drafter"
    halts: bool = False  # propose() takes a halt rule (the adaptive policy's stopping rule)
    reuses_prefills: bool = False  # its prefills can be served from a models.prefill.PromptCache
    # after propose(): per row, its own P(draft i accepted | the drafts before it were), for
    # a model-free drafter that counts (suffix decoding); None: no estimate
    found_conf: list | None = None
    estimates_acceptance: bool = False  # propose() sets found_conf
    # the most branches a proposal may have (a draft tree, verify/tree.py); 1: linear drafts.
    # With more, propose() sets found_parents: per row, each draft's parent index (-1: the
    # pending token), best-first, so that any prefix of a row's drafts is a tree
    tree_width: int = 1
    found_parents: list | None = None

    prompt_cache = None  # with reuses_prefills: the PromptCache its prefills read and fill
    hooks: DrafterHooks | None = None  # None: the correct behaviour, with nothing to call

    # What a greedy draft of this drafter is, and so what it costs and how the audit
    # recomputes it (drafter consistency, the cost model): a draft model's argmax
    # (draft_model: its CausalLM), the argmax of the target's first draft_layers layers, or
    # the continuation prompt lookup copies over n-grams of at most lookup_ngram tokens. A
    # drafter stating none of them drafts without a model (free to run, nothing to replay).
    draft_model = None
    draft_layers: int | None = None
    lookup_ngram: int | None = None
    # A model-free drafter whose drafts are a function of the request's own prefix and of
    # settings it keeps (suffix decoding without its global cache): replica() gives the
    # audit a fresh one that recomputes them. Prompt lookup is recomputed from lookup_ngram.
    replayable: bool = False

    def replica(self) -> "Drafter":
        """A fresh drafter with this one's settings and nothing learnt from other requests
        (replayable drafters only): admitted a request's prompt on a row, its propose() from
        each later prefix of the request drafts what a correct drafter of this kind drafts."""
        raise ValueError(f"drafter {self.name!r} is not replayable: its drafts depend on more than the request")

    def map_models(self, fn) -> None:
        """Replace each model this drafter drafts with by fn(model) (a view of it: the audit's
        fault suite gives the drafter under audit broken positions this way). A drafter
        without a model has nothing to replace."""

    def identity(self) -> dict:
        """What this drafter's timing depends on, the key of the measured-costs cache."""
        if self.draft_model is not None:
            return {"kind": "draft-model", "model": self.draft_model.fingerprint(),
                    "backend": self.draft_model.backend}
        if self.draft_layers is not None:
            return {"kind": "layerskip", "num_layers": self.draft_layers}
        if self.lookup_ngram is not None:
            return {"kind": "lookup", "max_ngram": self.lookup_ngram}
        return {"kind": f"{type(self).__module__}.{type(self).__qualname__}"}

    def bind_cache(self, cache) -> None:
        """The engine's target cache, once, before any request (a drafter that drafts from
        the target's own cache, layer-skip, keeps it; the others need nothing of it)."""

    @abstractmethod
    def admit(self, rows: list[int], tokens: list[list[int]]) -> None: ...

    def admit_scopes(self, rows: list[int], scopes: list[str | None]) -> None:
        """Right after admit(): the scope of each row's request (Request.scope, a hash of its
        API key; None: key-less). A drafter that keeps text across requests drafts for a
        request only from its own scope's; the others need nothing of it."""

    def learn(self, rows: list[int], tokens: list[list[int]]) -> None:
        """Before release(): the rows' requests finished (stop or length) with these whole
        sequences. A drafter that learns from earlier requests (suffix decoding's global
        cache) keeps them; the others need nothing of it."""

    def cache_stats(self) -> dict | None:
        """The size of what the drafter keeps across requests (suffix decoding's global cache:
        SuffixCache.stats()), for the server's metrics; None where it keeps nothing."""
        return None

    @abstractmethod
    def prepare(self, rows: list[int], tokens: list[list[int]]) -> None: ...

    @abstractmethod
    def propose(self, rows: list[int], tokens: list[list[int]], k: list[int],
                sampling: list[SamplingParams], generators: list
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]: ...

    @abstractmethod
    def rollback(self, rows: list[int], committed: list[int]) -> None: ...

    @abstractmethod
    def release(self, rows: list[int]) -> None: ...


def draft_from_logits(logits: torch.Tensor, active: list[int], i: int, tokens, sampling, generators,
                      out: torch.Tensor, probs: torch.Tensor | None, confidence: bool = False,
                      transform=None, hooks: DrafterHooks | None = None) -> list[float] | None:
    """Fill draft position i for the active rows from the drafter's logits [B',V].

    Greedy rows take the argmax (one vectorised call); sampled rows draw from q with
    their own random source and, where the rule needs it, record q in probs [B,K,V].
    With confidence=True, returns the drafter's probability of each drafted token
    (greedy rows: the softmax's top probability; sampled rows: q of the token drawn).
    `transform(q) -> q'` replaces a sampled row's q before the draw (the audit's probe
    drafter: audit/probe.py); q' is what is drawn from and what the rule reads.
    hooks: the drafter's (hooks.reported_q decides what probs records).
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
            probs[b, i, :q.shape[-1]] = q if hooks is None else hooks.reported_q(q, logits[j])
        out[b, i] = sample_token(q if hooks is None else hooks.drawn_q(q), sp, generators[b], len(tokens[b]) + i)
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
