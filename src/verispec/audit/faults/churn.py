"""Faults of row churn: what a row carries from one request to the next.

Both keep per-row state that is updated lazily, against the batch of the next step, so
a row refilled at once is handled and a row that sits free while other rows decode, then
takes a request that arrived later, is not. An audit whose requests all arrive at once
never makes such a row: below the batch size a freed row is refilled at the next step
from the queue (or, the queue empty, never again), and at or above it no row is freed
before the run drains. The audit's row churn (audit/churn.py: staggered arrivals, mixed
lengths) makes them at every batch size.
"""

from __future__ import annotations

import torch

from ...drafters.base import DrafterHooks
from ...engine.hooks import StepHooks
from .catalogue import register
from ..registry import DRAFTER_CONSISTENCY, EQUIVALENCE


class _RowsClearedLazily(DrafterHooks):
    """The drafter keeps each row's tokens (written over what the row held: the history
    prompt lookup matches in, the pending token layer-skip drafts from, the feed a draft
    model catches up with) and clears a released row at its next proposal, but only if the
    row is in that proposal's batch."""

    def __init__(self):
        self.rows: dict[int, list[int]] = {}  # row -> the tokens held for it
        self.freed: set[int] = set()  # rows released since the last proposal

    def released(self, rows):
        self.freed.update(rows)

    def held(self, rows, tokens):
        for row in self.freed.intersection(rows):  # a freed row not in this batch keeps its tokens
            del self.rows[row]
        self.freed.clear()
        out = []
        for row, seq in zip(rows, tokens):
            old = self.rows.get(row, [])
            self.rows[row] = seq = seq + old[len(seq):]  # a shorter request leaves the old tail
            out.append(seq)
        return out


class _RejoinedRowUnchanged(StepHooks):
    """The verify pass reads each row's pending token from a per-row buffer that the engine
    updates by diffing the step's batch against the previous step's: a row with the same
    request (its new pending token) or another one (a refilled row) is written, and so is a
    row never used; a row that was empty in the previous step reads as unchanged."""

    def __init__(self):
        self.slots: dict[int, int] = {}  # row -> the pending token the buffer holds
        self.last: dict[int, object] = {}  # row -> its request in the previous step

    def pending_tokens(self, reqs, step):
        for r in reqs:
            if r.row in self.last or r.row not in self.slots:
                self.slots[r.row] = r.tokens[-1]
        self.last = {r.row: r for r in reqs}
        return torch.tensor([[self.slots[r.row]] for r in reqs])


register("draft-row-cleared-lazily",
         "a drafter keeps each row's tokens and clears a freed row at its next proposal only if "
         "the row is in that batch: a row that sits free while others decode keeps its previous "
         "occupant's tokens, and the next request there drafts from that tail until it outgrows it "
         "(prompt lookup matches in it, layer-skip drafts from its last token, a draft model feeds "
         "it). Only under row churn: a batch that arrives at once refills a freed row at the next "
         "step or never",
         DRAFTER_CONSISTENCY, lambda c: {"drafter": _RowsClearedLazily()})
register("rejoined-row-stale-input",
         "the verify input is a per-row buffer updated by diffing each step's batch against the "
         "previous one: a row that was empty in the previous step reads as unchanged, so a request "
         "admitted into a row that sat free is verified from its previous occupant's last pending "
         "token. Only under row churn: a batch that arrives at once refills a freed row at the next "
         "step or never",
         EQUIVALENCE, lambda c: {"step": _RejoinedRowUnchanged()})
