"""The engine: continuous batching around one short, linear speculative step.

Invariant between steps, for every running request r on cache row r.row:
    r.tokens[-1] is the *pending* token (sampled, not yet in the target cache), and
    target cache length == len(r.tokens) - 1.
A plain decoding step is the same step with k = 0 drafts for every row.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..policy import FixedK
from ..verify import LOSSY_RULES, RULES
from ..verify.rules import argmax_last
from ..verify.tree import depths as tree_depths, is_chain
from ..models.prefill import prefill
from .hooks import CORRECT, StepHooks
from .request import Request

log = logging.getLogger(__name__)


class ContextLengthError(ValueError):
    """A prompt plus max_new_tokens does not fit the engine's context."""


def finite_positions(logits: torch.Tensor) -> list[list[bool]]:
    """[B,K+1,V] -> [B][K+1]: whether every logit at the position is finite. A sum over the
    vocabulary is finite only if every term is (NaN and inf propagate; finite logits would
    have to exceed ~1e33 to overflow it): ~15x cheaper than isfinite().all() over 152k. On
    contiguous float32 CPU logits numpy sums them: right after a decode has streamed the
    weights through the caches, 100 us against torch's 240 us at batch 1."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        return np.isfinite(logits.detach().numpy().sum(-1)).tolist()
    return logits.sum(-1).isfinite().tolist()


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 8  # rows decoded together
    max_len: int = 2048  # prompt + generated tokens per row
    rule: str = "rejection"  # verification rule; see verify/
    # record each step's drafts, accepted count and q(d) per request (RequestStats.trace and
    # draft_q) for the audit's checks that replay them; off, the step spends nothing on it
    trace: bool = False

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"unknown verification rule {self.rule!r}; valid: {', '.join(RULES)}")
        if self.max_batch < 1 or self.max_len < 2:
            raise ValueError("max_batch must be >= 1 and max_len >= 2")

    @property
    def lossy(self) -> bool:
        return self.rule in LOSSY_RULES


@dataclass
class StepTimes:
    """Where step time goes; bookkeeping = all but model forwards."""

    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_forward_s: float = 0.0
    other_s: float = 0.0
    steps: int = 0
    # recent steps: (batch, drafts verified, tokens emitted, seconds)
    per_step: deque = field(default_factory=lambda: deque(maxlen=4096))

    def to_dict(self) -> dict:
        total = self.prefill_s + self.draft_s + self.verify_forward_s + self.other_s
        return {"prefill_s": self.prefill_s, "draft_s": self.draft_s,
                "verify_forward_s": self.verify_forward_s, "bookkeeping_s": self.other_s,
                "steps": self.steps,
                "bookkeeping_fraction": self.other_s / total if total else None}


@dataclass
class RowChurn:
    """How this engine's cache rows turned over: what a changing, ragged batch exercises
    (rows freed and taken again at other lengths, free rows between running ones) and a
    batch that starts together and drains never does. The audit reads it (audit/churn.py)
    to show that its runs reached that bookkeeping. Ints bumped once per admitted request,
    once per ended request and once per step, from lists the step has already built."""

    reused_rows: int = 0  # admissions into a cache row an earlier request of this engine used
    # ... of which into a row that sat free through at least one step (not refilled at once)
    reused_after_idle: int = 0
    gapped_steps: int = 0  # steps whose running rows, sorted, leave a free row between two of them
    mixed_length_steps: int = 0  # steps whose rows held sequences of different lengths
    freed_in: dict = field(default_factory=dict)  # row -> the step its last request ended in

    def counts(self) -> dict:
        return {"reused_rows": self.reused_rows, "reused_after_idle": self.reused_after_idle,
                "gapped_steps": self.gapped_steps, "mixed_length_steps": self.mixed_length_steps}


@dataclass(eq=False)
class StepRecord:
    """What one step knows, filled in phase by phase (Engine._step)."""

    reqs: list[Request]
    t0: float  # the step's start
    k: list[int] = field(default_factory=list)  # drafts per row, as the policy settled it
    asked: list[int] = field(default_factory=list)  # drafts per row asked of the drafter (before halt/trim)
    K: int = 0  # the widest row's drafts found (the verify pass is K + 1 wide)
    drafts: torch.Tensor | None = None  # [B,K] long
    q: torch.Tensor | None = None  # [B,K,V] the drafter's q, or None (one-hot)
    num: torch.Tensor | None = None  # [B] drafts found per row
    num_l: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [B,K+1,V]
    out: torch.Tensor | None = None  # [B,K+1] emitted tokens (-1 past a row's run)
    n_acc: torch.Tensor | None = None  # [B] accepted drafts
    acc_l: list[int] = field(default_factory=list)
    failed: dict = field(default_factory=dict)  # row index -> why it failed
    n_out: int = 0  # tokens appended in the commit
    prep_s: float = 0.0  # the drafter's deferred prefill (counted as prefill)
    committed: bool = False  # the commit point passed: tokens appended, caches rolled back
    t_draft: float = 0.0  # drafting starts
    t_verify: float = 0.0  # drafting ends
    t_accept: float = 0.0  # the verify pass ends

    # a draft tree step (some row's drafts branch; verify/tree.py): each row's node parents
    # (a chain for a linear row), the slots' depths [B,K+1] and each row's kept slots
    parents: list[list[int]] | None = None
    depth: torch.Tensor | None = None
    paths: dict = field(default_factory=dict)  # row index -> slots kept (root first)

    B: int = 0
    rows: list[int] = field(default_factory=list)
    n0: list[int] = field(default_factory=list)  # sequence lengths; the cache holds n0 - 1

    def __post_init__(self):
        self.B, self.rows, self.n0 = len(self.reqs), [r.row for r in self.reqs], [len(r.tokens) for r in self.reqs]


class Engine:
    def __init__(self, target, drafter=None, policy=None, config: EngineConfig = EngineConfig(),
                 prompt_cache=None, hooks: StepHooks | None = None):
        self.target = target
        self.prompt_cache = prompt_cache  # models.prefill.PromptCache: prefills to reuse
        self.drafter = drafter
        self.policy = policy if policy is not None else FixedK(0 if drafter is None else 4)
        if drafter is None and self.policy.max_k > 0:
            raise ValueError("a policy that drafts needs a drafter")
        self.config = config
        slack = self.policy.max_k + 1  # a verify pass may write past the last kept token
        self.cache = target.new_cache(config.max_batch, config.max_len + slack)
        if drafter is not None:
            drafter.bind_cache(self.cache)
            self.policy.bind_drafter(drafter)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.times = StepTimes()
        self.churn = RowChurn()
        # the step's seams (engine/hooks.py), bound once: without hooks the step calls the
        # correct behaviour as directly as its own methods
        self.hooks = h = CORRECT if hooks is None else hooks
        self._draft_budget, self._pending_tokens, self._append = h.draft_budget, h.pending_tokens, h.append
        self._committed_length, self._verify_probs, self._keyed_noise = h.committed_length, h.verify_probs, h.keyed_noise
        self._verify_rule = h.verify
        self._tree_layout, self._tree_walk = h.tree_layout, h.tree_walk
        width = 1 if drafter is None else drafter.tree_width
        if width > 1 and not getattr(target, "supports_trees", False):
            raise ValueError(f"drafter {drafter.name!r} proposes trees of {width} branches, which this "
                             f"{getattr(target, 'runtime', 'model')} backend cannot verify in one pass "
                             "(ggml in batch-invariant mode keeps one sequence per row): use width=1")
        if width > 1 and config.lossy:
            raise ValueError(f"rule {config.rule!r} verifies linear drafts only; draft trees need an exact rule")

    # -- lifecycle -------------------------------------------------------------
    def add(self, req: Request) -> None:
        self._check(req)
        sp = req.params.sampling
        if self.config.rule == "coupled" and not sp.greedy and sp.seed is None:
            # an unseeded request on a coupled engine: a seed from OS entropy (never the
            # global torch RNG, which starts from the same state in every process)
            seed = secrets.randbits(63)
            req.params = replace(req.params, sampling=replace(sp, coupled=True, seed=seed))
        if req.generator is None:
            req.generator = req.params.sampling.make_generator()
        req.rule = self._resolve_rule(req.params.sampling)
        self.waiting.append(req)

    def _check(self, req: Request) -> None:
        """Refuse a request this engine cannot decode (ContextLengthError, ValueError)."""
        total = len(req.prompt_ids) + req.params.max_new_tokens
        if total > self.config.max_len:
            raise ContextLengthError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.params.max_new_tokens}) "
                f"= {total} exceeds the context of {self.config.max_len} tokens")
        V = self.target.config.vocab_size
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= V:
            raise ValueError(f"prompt token ids must lie in the vocabulary [0, {V})")
        sp = req.params.sampling
        if self.config.rule == "greedy" and not sp.greedy:
            raise ValueError(f"rule 'greedy' verifies temperature-0 requests only (this one has "
                             f"temperature {sp.temperature}); use rule 'rejection' or 'coupled'")

    def cancel(self, req: Request) -> None:
        """Stop a request; its row is freed now (call between steps)."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self._finish(req, "cancelled")
            self.running.remove(req)
        req.finished, req.finish_reason = True, req.finish_reason or "cancelled"

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _finish(self, req: Request, reason: str) -> None:
        req.finished, req.finish_reason = True, reason
        req.stats.time_s = time.perf_counter() - req._t0
        self.churn.freed_in[req.row] = self.times.steps  # the step ending it has not been counted yet
        self.cache.free([req.row])
        if self.drafter is not None:
            if reason in ("stop", "length"):  # text a client received whole, and nothing failed
                try:
                    self.drafter.learn([req.row], [req.tokens])
                except Exception:  # noqa: BLE001 - a cache that fails to learn costs speed, never a request
                    log.exception("drafter %s failed to learn from a finished request", self.drafter.name)
            self.drafter.release([req.row])

    def _admit(self) -> list[Request]:
        """Move waiting requests into free rows and prefill them. Returns the requests
        whose admission failed (finish_reason "error"); a batched prefill that raises is
        taken again one request at a time, so only the request that fails fails."""
        new = []
        while self.waiting and len(self.running) + len(new) < self.config.max_batch:
            new.append(self.waiting.popleft())
        if not new:
            return []
        t0 = time.perf_counter()
        rows = self.cache.alloc(len(new))
        churn, step = self.churn, self.times.steps
        for r, row in zip(new, rows):
            r.row, r._t0 = row, t0
            if row in churn.freed_in:
                churn.reused_rows += 1
                churn.reused_after_idle += step - churn.freed_in[row] > 1
        groups = [new]
        failed = []
        while groups:
            group = groups.pop()
            try:
                self._prefill(group)
                self.running.extend(group)
            except Exception:  # noqa: BLE001 - split the group until the failing request is alone
                if len(group) == 1:
                    self._fail(group[0])
                    failed.append(group[0])
                else:
                    groups += [[r] for r in group]
        self.times.prefill_s += time.perf_counter() - t0
        return failed

    def _prefill(self, group: list[Request]) -> None:
        """Prefill all but the pending token (the last prompt token) of each request."""
        rows = [r.row for r in group]
        self.cache.truncate(rows, [0] * len(rows))
        if self.drafter is not None:
            self.drafter.rollback(rows, [0] * len(rows))
        prefill(self.target, self.cache, rows, [r.prompt_ids[:-1] for r in group], self.prompt_cache)
        if self.drafter is not None:
            self.drafter.admit(rows, [r.tokens for r in group])
            self.drafter.admit_scopes(rows, [r.scope for r in group])

    # -- the step ----------------------------------------------------------------
    def step(self) -> list[Request]:
        """One propose -> verify -> accept -> commit step for every running row.
        Returns the requests that finished in this step (finish_reason "error" for a
        row that failed: its `error` says why; the other rows are not touched).

        A step that raises for the whole batch (a drafter or a model forward failing
        on one row's input) is undone and taken again one row at a time, so the row
        that fails fails alone. Undoing is a length change: every cache row goes back
        to what it held before the step. Only a step that raises before its commit point
        comes back here; _commit then leaves every output as it was (see _commit)."""
        failed = self._admit()
        reqs = self.running
        if not reqs:
            return failed
        lengths = [len(r.tokens) - 1 for r in reqs]
        try:
            return failed + self._step(reqs)
        except Exception:  # noqa: BLE001 - isolate the row that fails (below)
            if len(reqs) == 1:
                self._undo(reqs, lengths)
                self._fail(reqs[0])
                self.running = []
                return failed + reqs
            self._undo(reqs, lengths)
        finished = failed
        for r in list(reqs):
            self.running = [r]
            try:
                finished += self._step([r])
            except Exception:  # noqa: BLE001 - this row's own failure
                self._undo([r], [len(r.tokens) - 1])
                self._fail(r)
                finished.append(r)
        self.running = [r for r in reqs if not r.finished]
        return finished

    def _undo(self, reqs: list[Request], lengths: list[int]) -> None:
        rows = [r.row for r in reqs]
        self.cache.truncate(rows, [min(int(self.cache.lengths[row]), n) for row, n in zip(rows, lengths)])
        if self.drafter is not None:
            self.drafter.rollback(rows, lengths)

    def _fail(self, r: Request, why: str | None = None) -> None:
        """End one row with finish_reason "error"; the message names the exception."""
        if why is None:
            import sys
            e = sys.exc_info()[1]
            why = f"{type(e).__name__}: {e}" if e is not None else "unknown error"
        r.error = f"the engine step failed for this request ({why}); other requests were not affected"
        self._finish(r, "error")

    def _step(self, reqs: list[Request]) -> list[Request]:
        """One step over the running rows, as named phases over one record (StepRecord)."""
        s = StepRecord(reqs, time.perf_counter())
        self._choose(s)
        self._propose(s)
        self._verify(s)
        self._accept_rows(s)
        finished = self._commit(s)
        self._observe(s)
        return finished

    def _choose(self, s: "StepRecord") -> None:
        """How many drafts per row: the policy's choice, capped by what the row can still emit."""
        k = self.policy.choose(s.reqs) if self.drafter is not None else [0] * s.B
        s.k = [max(0, min(kb, self._draft_budget(r))) for kb, r in zip(k, s.reqs)]
        s.asked = list(s.k)

    def _propose(self, s: "StepRecord") -> None:
        """The drafts. Work the drafter deferred until a row drafts (a draft model's
        prefill) is done first and counted as prefill. A policy that halts stops rows while
        a drafter that takes a halt rule drafts, on the drafter's own confidence; one that
        trims settles how many of the drafts found to verify. Either way s.k becomes what
        the policy settled on, which is what observe() is told it asked for."""
        reqs, rows, k = s.reqs, s.rows, s.k
        if max(k) > 0:
            tp = time.perf_counter()
            drafting = [b for b in range(s.B) if k[b] > 0]
            self.drafter.prepare([rows[b] for b in drafting], [reqs[b].tokens for b in drafting])
            s.prep_s = time.perf_counter() - tp
            self.times.prefill_s += s.prep_s
        s.t_draft = time.perf_counter()
        halt = self.policy.halt if self.policy.halts and self.drafter.halts else None
        if max(k) > 0:
            kw = {} if halt is None else {"halt": lambda i, active, conf: halt(reqs, k, i, active, conf)}
            drafts, q, num = self.drafter.propose(rows, [r.tokens for r in reqs], k,
                                                   [r.params.sampling for r in reqs],
                                                   [r.generator for r in reqs], **kw)
            if halt is not None:
                s.k = num.tolist()
        else:
            drafts, q, num = torch.zeros(s.B, 0, dtype=torch.long), None, torch.zeros(s.B, dtype=torch.long)
        s.t_verify = time.perf_counter()  # trimming counts with the verify pass
        parents = self.drafter.found_parents if max(k) > 0 else None  # a tree per row, or None
        if max(k) > 0 and self.policy.trims:
            kw = {}
            if self.drafter.found_conf is not None:  # the drafter's own estimates, where it has them
                kw["conf"] = self.drafter.found_conf
            if parents is not None:
                kw["parents"] = parents
            kept = self.policy.trim(reqs, num.tolist(), **kw)
            num = torch.minimum(num, torch.tensor(kept, dtype=torch.long))
            s.k = num.tolist()
        if parents is not None:  # a kept prefix of a best-first tree is a tree
            trimmed = [list(p[:n]) for p, n in zip(parents, num.tolist())]
            if not all(is_chain(p) for p in trimmed):
                s.parents = trimmed
        # a drafter may find fewer drafts than asked (prompt lookup without a match): no
        # pass pays for padding columns that no row uses
        s.K = int(num.max())
        s.drafts, s.num, s.num_l = drafts[:, :s.K], num, num.tolist()
        s.q = None if q is None else q[:, :s.K]

    def _verify(self, s: "StepRecord") -> None:
        """All rows in ONE target pass over [pending, d_1..d_k]; a row whose logits are not
        finite at the positions it verifies fails alone."""
        pending = self._pending_tokens(s.reqs, self.times.steps)  # [B,1]
        x = torch.cat([pending, s.drafts], dim=1) if s.K else pending  # [B,K+1]
        if s.parents is None:
            s.logits = self.target.forward(x, self.cache, s.rows, [n + 1 for n in s.num_l])  # [B,K+1,V]
        else:
            s.depth, visible = self._tree_layout(s.parents, s.K + 1)  # [B,K+1], [B,K+1,K+1]
            s.logits = self.target.forward(x, self.cache, s.rows, [n + 1 for n in s.num_l],
                                           tree=(s.depth, visible))
        s.t_accept = time.perf_counter()
        finite = finite_positions(s.logits)  # sync: [B][K+1] flags
        s.failed = {b: "the model's logits are not finite" for b in range(s.B)
                    if not all(finite[b][:s.num_l[b] + 1])}

    def _accept_rows(self, s: "StepRecord") -> None:
        """Accept per row: greedy rows together, sampled rows each with its own random
        source (noise keyed on (seed, position) for seeded rows, else a generator). A row
        whose sampling distribution is not finite, or whose rule raises, fails alone."""
        B, K, logits, drafts, num = s.B, s.K, s.logits, s.drafts, s.num
        if s.parents is not None:
            return self._accept_tree(s)
        greedy = [b for b, r in enumerate(s.reqs) if r.params.sampling.greedy and b not in s.failed]
        if len(greedy) == B:  # every row greedy: no copy of the logits
            s.out, s.n_acc = self._verify_rule("greedy", logits, None, drafts, num, None)
            return
        s.out = torch.full((B, K + 1), -1, dtype=torch.long)  # [B,K+1]
        s.n_acc = torch.zeros(B, dtype=torch.long)  # [B]
        if greedy:
            gi = torch.tensor(greedy)
            s.out[gi], s.n_acc[gi] = self._verify_rule("greedy", logits[gi], None, drafts[gi], num[gi], None)
        for b, r in enumerate(s.reqs):
            sp = r.params.sampling
            if sp.greedy or b in s.failed:
                continue
            try:
                p = self._verify_probs(logits[b:b + 1], sp)  # [1,K+1,V]
                if not bool(torch.isfinite(p[0, :int(num[b]) + 1]).all()):
                    raise FloatingPointError("the sampling distribution is not finite")
                o, a = self._accept(b, r, p, s.q, drafts, num, s.n0[b], K)
            except Exception as e:  # noqa: BLE001 - this row fails; the batch goes on
                s.failed[b] = f"{type(e).__name__}: {e}"
                continue
            s.out[b], s.n_acc[b] = o[0], a[0]

    def _accept_tree(self, s: "StepRecord") -> None:
        """Accept a draft tree per row (verify/tree.walk): at each node the target's token is
        drawn as plain decoding draws it there (greedy: the argmax; seeded: the argmax of
        log p plus the noise keyed on (seed, sequence index), which depends on the node's
        depth; otherwise one draw from p with the request's generator), and the walk goes on
        while that token is a child. A row that fails fails alone."""
        B, K = s.B, s.K
        s.out = torch.full((B, K + 1), -1, dtype=torch.long)
        s.n_acc = torch.zeros(B, dtype=torch.long)
        depth_l = s.depth.tolist()
        drafts_l = s.drafts.tolist()
        for b, r in enumerate(s.reqs):
            if b in s.failed:
                continue
            n = s.num_l[b]
            sp = r.params.sampling
            try:
                rule = self.rule_for(r)
                if rule == "greedy":
                    best = argmax_last(s.logits[b, :n + 1].contiguous()).tolist()
                    draw = lambda slot, d, best=best: best[slot]  # noqa: E731
                else:
                    p = self._verify_probs(s.logits[b:b + 1, :n + 1], sp)[0]  # [n+1,V]
                    if not bool(torch.isfinite(p).all()):
                        raise FloatingPointError("the sampling distribution is not finite")
                    if rule == "coupled":
                        dmax = max(depth_l[b][:n + 1])
                        noise = self._keyed_noise(sp.seed, range(s.n0[b], s.n0[b] + dmax + 1), p.shape[-1])
                        at = torch.tensor(depth_l[b][:n + 1])
                        best = argmax_last((torch.log(p.double()) + noise[at]).contiguous()).tolist()
                        draw = lambda slot, d, best=best: best[slot]  # noqa: E731
                    else:  # one draw per emitted token from the request's generator, as plain decoding
                        g = r.generator
                        draw = lambda slot, d, p=p, g=g: int(torch.multinomial(p[slot], 1, generator=g))  # noqa: E731
                w = self._tree_walk(s.parents[b], drafts_l[b][:n], draw)
            except Exception as e:  # noqa: BLE001 - this row fails; the batch goes on
                s.failed[b] = f"{type(e).__name__}: {e}"
                continue
            s.out[b, :len(w.tokens)] = torch.tensor(w.tokens)
            s.n_acc[b] = w.accepted
            s.paths[b] = w.slots

    def _commit(self, s: "StepRecord") -> list[Request]:
        """Append emitted tokens, apply stops, roll caches back to each row's length; end
        the rows that finished or failed. -> the requests that finished.

        Atomic: the tokens are appended first (the stop and length rules read the output
        as it grows), then the caches and the drafter roll back; if either raises, every
        row's output goes back to its length before the step and the exception reaches
        step(), whose undo and retry then see outputs and caches that agree. Once both
        succeeded the step is committed: nothing after it (the stats, ending rows,
        the policy's observation) may send the step back to be taken again."""
        reqs = s.reqs
        out_l, s.acc_l = s.out.tolist(), s.n_acc.tolist()  # sync: one transfer for the whole batch
        before = [len(r.output_ids) for r in reqs]
        committed, finished = [], []
        try:
            for b, r in enumerate(reqs):
                if b in s.failed:  # keeps its pre-step length; freed below
                    committed.append(s.n0[b] - 1)
                    continue
                reason = self._append(r, out_l[b][:s.acc_l[b] + 1])
                committed.append(self._committed_length(r))
                if reason:
                    finished.append((r, reason))
            if s.paths:  # a tree step: each row's accepted path into place first
                kept = sorted(s.paths)
                self.cache.keep_slots([s.rows[b] for b in kept], [s.n0[b] - 1 for b in kept],
                                      [s.paths[b] for b in kept])
            self.cache.truncate(s.rows, committed)
            if self.drafter is not None:
                self.drafter.rollback(s.rows, committed)
        except Exception:
            for r, n in zip(reqs, before):
                del r.output_ids[n:]
            raise
        s.committed = True
        self._record(s)
        ended = []
        for r, reason in finished:
            self._end(r, reason, ended)
        for b, why in s.failed.items():
            self._end(reqs[b], "error", ended, why)
        done = {id(r) for r in ended}
        self.running = [r for r in reqs if id(r) not in done]
        return ended

    def _record(self, s: "StepRecord") -> None:
        """The committed step in each row's stats (and, with config.trace, in its trace;
        without it, the step spends nothing on the trace)."""
        trace = self._trace_lists(s) if self.config.trace else None
        for b, r in enumerate(s.reqs):
            if b in s.failed:
                continue
            n = s.num_l[b]
            tree = s.parents[b] if s.parents is not None and not is_chain(s.parents[b]) else None
            r.stats.record_step(n, s.acc_l[b], None if tree is None else max(tree_depths(tree), default=0))
            if trace is not None:
                drafts_l, qd_l, above_l = trace
                if tree is None:
                    r.stats.trace.append((s.n0[b], drafts_l[b][:n], s.acc_l[b], s.k[b]))
                    r.stats.trace_trees.append(None)
                else:
                    r.stats.trace.append((s.n0[b], _walked_branch(tree, drafts_l[b][:n], s.paths[b]),
                                          s.acc_l[b], s.k[b]))
                    r.stats.trace_trees.append((drafts_l[b][:n], list(tree)))
                r.stats.trace_asked.append(s.asked[b])
                if self.rule_for(r) not in ("rejection", "typical-lossy"):  # rules that draw with a generator
                    r.stats.draft_q.append(None)
                    r.stats.draft_q_above.append(None)
                else:  # no q from the drafter: q is one-hot at its draft (prompt lookup, a tree's nodes)
                    r.stats.draft_q.append(qd_l[b][:n] if qd_l is not None and tree is None else [1.0] * n)
                    r.stats.draft_q_above.append(above_l[b][:n] if above_l is not None else None)
            s.n_out += len(r.output_ids) - r.stats.generated_tokens
            r.stats.generated_tokens = len(r.output_ids)

    @staticmethod
    def _trace_lists(s: "StepRecord") -> tuple[list, list | None, list | None]:
        """The step's drafts [B][K]; q(d) of each, for the audit's calibration test; and the
        mass q puts on the tokens ranked before d (descending q, ties by id), for its test
        that the drafts are samples of the q the verifier read. None without a q (one-hot)."""
        drafts_l = s.drafts.tolist()
        if s.q is None or not s.drafts.numel():
            return drafts_l, None, None
        qd = s.q.gather(-1, s.drafts[..., None])  # [B,K,1]
        ids = torch.arange(s.q.shape[-1])
        before = (s.q > qd) | ((s.q == qd) & (ids < s.drafts[..., None]))  # [B,K,V]
        return drafts_l, qd.squeeze(-1).tolist(), (s.q * before).sum(-1).tolist()

    def _end(self, r: Request, reason: str, ended: list, why: str | None = None) -> None:
        """End a row after the commit. Its tokens are committed; if freeing its rows
        raises, the request ends with an error saying so and the others go on."""
        try:
            if reason == "error":
                self._fail(r, why)
            else:
                self._finish(r, reason)
        except Exception as e:  # noqa: BLE001 - after the commit: this row's failure alone
            r.finished, r.finish_reason = True, "error"
            r.error = (f"freeing the request's rows failed after its tokens were committed "
                       f"({type(e).__name__}: {e}); other requests were not affected")
        ended.append(r)

    def _observe(self, s: "StepRecord") -> None:
        """After the step, the policy learns its outcome (never earlier: it sees no verdict
        before it chose): s.k as settled in _propose, accepted drafts per row, and times.
        The step is committed by now: a policy that raises here is logged and the step
        stands (taking it again would emit its tokens twice)."""
        draft_s, verify_s = s.t_verify - s.t_draft, s.t_accept - s.t_verify
        try:
            if s.paths:
                self.policy.observe_tree(s.reqs, s.parents, {b: [sl - 1 for sl in p[1:]] for b, p in s.paths.items()})
            self.policy.observe(s.reqs, s.k, s.acc_l)
            self.policy.observe_costs(s.B, s.K + 1, sum(kb > 0 for kb in s.k), max(s.k), draft_s, verify_s)
        except Exception:  # noqa: BLE001 - a learning failure does not undo a committed step
            log.exception("the policy's observe() raised after a committed step; the step stands")
        t_end = time.perf_counter()
        self.times.draft_s += draft_s
        self.times.verify_forward_s += verify_s
        self.times.other_s += (s.t_draft - s.t0 - s.prep_s) + (t_end - s.t_accept)
        self.times.steps += 1
        if s.B > 1:  # one row has neither a gap nor another length
            self.churn.gapped_steps += max(s.rows) - min(s.rows) >= s.B  # rows are distinct
            self.churn.mixed_length_steps += min(s.n0) != max(s.n0)
        self.times.per_step.append((s.B, sum(s.num_l), s.n_out, t_end - s.t0 - s.prep_s))  # prefill left out

    def rule_for(self, r: Request) -> str:
        """The rule that verifies request r's rows, as add() resolved it."""
        return r.rule if r.rule is not None else self._resolve_rule(r.params.sampling)

    def _resolve_rule(self, sp) -> str:
        """Greedy at temperature 0; typical-lossy on an engine that runs it; coupled for a
        seeded (keyed) request, so its tokens are those of seeded plain decoding; rejection
        (with the request's generator) otherwise."""
        if sp.greedy:
            return "greedy"
        if self.config.rule == "typical-lossy":
            return "typical-lossy"
        return "coupled" if sp.keyed else "rejection"

    def _accept(self, b: int, r: Request, p, q, drafts, num, n0: int, K: int):
        """Verify sampled row b (p [1,K+1,V]) with rule_for(r); coupled rows use the noise
        keyed on (seed, sequence index) at indices n0..n0+K."""
        rule = self.rule_for(r)
        if rule == "coupled":
            noise = self._keyed_noise(r.params.sampling.seed, range(n0, n0 + K + 1), p.shape[-1])[None]  # [1,K+1,V]
            return self._verify_rule("coupled", p, None, drafts[b:b + 1], num[b:b + 1], noise)
        qb = None if q is None else q[b:b + 1, :, :p.shape[-1]]  # [1,K,V]
        return self._verify_rule(rule, p, qb, drafts[b:b + 1], num[b:b + 1], r.generator)

    def run(self, requests: list[Request], on_finish=None, arrivals: list[int] | None = None) -> list[Request]:
        """Decode requests to completion with continuous batching (rows refill as others end).

        arrivals: arrivals[i] is the step of this run at which requests[i] is added (those
        of one step in list order); None adds every request now. The run counts one step
        per step() and, while nothing is running or waiting, jumps to the next arrival: it
        takes no idle steps. Every request is checked before the first step, so a request
        the engine refuses raises before anything is decoded."""
        if arrivals is None:
            for r in requests:
                self.add(r)
            while self.has_work:
                for r in self.step():
                    if on_finish is not None:
                        on_finish(r)
            return requests
        if len(arrivals) != len(requests) or any(a < 0 for a in arrivals):
            raise ValueError(f"arrivals needs one step >= 0 per request ({len(requests)} requests, "
                             f"{len(arrivals)} arrivals)")
        for r in requests:
            self._check(r)
        due = deque(sorted(zip(arrivals, range(len(requests)))))  # (step, index), in arrival order
        step = 0
        while due or self.has_work:
            if not self.has_work:
                step = max(step, due[0][0])
            while due and due[0][0] <= step:
                self.add(requests[due.popleft()[1]])
            for r in self.step():
                if on_finish is not None:
                    on_finish(r)
            step += 1
        return requests


def _walked_branch(parents: list[int], tokens: list[int], slots: list[int]) -> list[int]:
    """The branch of a draft tree a verdict ran along, as a linear draft: the accepted
    path's tokens, then below the node where the walk stopped its first child, that child's
    first child, and so on (the trace's entry for a tree step: its accepted count and its
    first rejected draft read as they do for a linear one)."""
    first: dict[int, int] = {}
    for i, p in enumerate(parents):
        first.setdefault(p, i)
    line = [tokens[sl - 1] for sl in slots[1:]]
    node = slots[-1] - 1  # -1: the root
    while node in first:
        node = first[node]
        line.append(tokens[node])
    return line
