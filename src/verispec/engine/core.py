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
from ..verify import LOSSY_RULES, PAD, RULES
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


# The step's phases (Engine._step) pass records: each phase reads the records before it and
# returns its own, frozen, which no later phase changes.


@dataclass(frozen=True)
class StepRows:
    """The rows a step decodes, as they stand when it starts."""

    reqs: list[Request]
    rows: list[int]  # their cache rows
    n0: list[int]  # their sequence lengths; the target cache holds n0 - 1
    t0: float  # the step's start

    @classmethod
    def of(cls, reqs: list[Request]) -> "StepRows":
        return cls(reqs, [r.row for r in reqs], [len(r.tokens) for r in reqs], time.perf_counter())

    @property
    def B(self) -> int:
        return len(self.reqs)


@dataclass(frozen=True)
class Drafts:
    """What _propose produces: the drafts one target pass verifies."""

    asked: list[int]  # drafts per row asked of the drafter (the policy's choice, capped)
    k: list[int]  # drafts per row as the policy settled them (a halt or a trim): what observe() is told
    K: int  # the widest row's drafts found (the verify pass is K + 1 wide)
    drafts: torch.Tensor  # [B,K] long
    q: torch.Tensor | None  # [B,K,V] the drafter's q, or None (one-hot)
    num: torch.Tensor  # [B] drafts found per row
    num_l: list[int]  # num as a list (one sync, read per row by every later phase)
    # a draft tree step (some row's drafts branch; verify/tree.py): each row's node parents (a
    # chain for a linear row); None: every row drafts linearly
    parents: list[list[int]] | None
    prep_s: float  # the drafter's deferred prefill (counted as prefill)
    t_start: float  # drafting starts
    t_end: float  # drafting ends


@dataclass(frozen=True)
class TargetPass:
    """What _verify produces: the target's logits over each row's [pending, drafts]."""

    logits: torch.Tensor  # [B,K+1,V]
    depth: torch.Tensor | None  # [B,K+1] each slot's depth in a tree step; None: linear
    failed: dict[int, str]  # row index -> why it failed (its logits are not finite)
    t_end: float  # the pass ends


@dataclass(frozen=True)
class Verdict:
    """What _accept_rows produces: each row's emitted tokens."""

    out: torch.Tensor  # [B,K+1] emitted tokens (PAD past a row's run)
    n_acc: torch.Tensor  # [B] accepted drafts
    failed: dict[int, str]  # row index -> why it failed, in the pass or in its verdict
    paths: dict[int, list[int]]  # a tree step: row index -> the slots it keeps (root first)


@dataclass(frozen=True)
class Committed:
    """What _commit produces: the step's outcome once its tokens are appended."""

    ended: list[Request]  # the requests that finished in the step
    acc_l: list[int]  # accepted drafts per row
    n_out: int  # tokens appended


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
        if width > 1 and not target.supports_trees:
            raise ValueError(f"drafter {drafter.name!r} proposes trees of {width} branches, which this "
                             f"{target.runtime} backend cannot verify in one pass "
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
        """One step over the running rows: each phase takes the records it reads and returns
        its own (StepRows, Drafts, TargetPass, Verdict, Committed)."""
        s = StepRows.of(reqs)
        d = self._propose(s, self._choose(s))  # 1-2. how many drafts per row; the drafts
        t = self._verify(s, d)  # 3. one target pass over [pending, drafts]
        v = self._accept_rows(s, d, t)  # 4. each row's verdict
        c = self._commit(s, d, v)  # 5. append, stop, roll back: the commit point
        self._observe(s, d, t, v, c)  # 6. the policy learns the outcome; times
        return c.ended

    def _choose(self, s: StepRows) -> list[int]:
        """How many drafts per row: the policy's choice, capped by what the row can still emit."""
        k = self.policy.choose(s.reqs) if self.drafter is not None else [0] * s.B
        return [max(0, min(kb, self._draft_budget(r))) for kb, r in zip(k, s.reqs)]

    def _propose(self, s: StepRows, k: list[int]) -> Drafts:
        """The drafts, k[b] asked for row b. Work the drafter deferred until a row drafts (a
        draft model's prefill) is done first and counted as prefill. A policy that halts stops
        rows while a drafter that takes a halt rule drafts, on the drafter's own confidence;
        one that trims settles how many of the drafts found to verify. Either way Drafts.k is
        what the policy settled on, which is what observe() is told it asked for."""
        reqs, rows = s.reqs, s.rows
        prep_s = 0.0
        if max(k) > 0:
            tp = time.perf_counter()
            drafting = [b for b in range(s.B) if k[b] > 0]
            self.drafter.prepare([rows[b] for b in drafting], [reqs[b].tokens for b in drafting])
            prep_s = time.perf_counter() - tp
            self.times.prefill_s += prep_s
        t_start = time.perf_counter()
        settled = k
        halt = self.policy.halt if self.policy.halts and self.drafter.halts else None
        if max(k) > 0:
            kw = {} if halt is None else {"halt": lambda i, active, conf: halt(reqs, k, i, active, conf)}
            drafts, q, num = self.drafter.propose(rows, [r.tokens for r in reqs], k,
                                                   [r.params.sampling for r in reqs],
                                                   [r.generator for r in reqs], **kw)
            if halt is not None:
                settled = num.tolist()
        else:
            drafts, q, num = torch.zeros(s.B, 0, dtype=torch.long), None, torch.zeros(s.B, dtype=torch.long)
        t_end = time.perf_counter()  # trimming counts with the verify pass
        parents = self.drafter.found_parents if max(k) > 0 else None  # a tree per row, or None
        if max(k) > 0 and self.policy.trims:
            kw = {}
            if self.drafter.found_conf is not None:  # the drafter's own estimates, where it has them
                kw["conf"] = self.drafter.found_conf
            if parents is not None:
                kw["parents"] = parents
            kept = self.policy.trim(reqs, num.tolist(), **kw)
            num = torch.minimum(num, torch.tensor(kept, dtype=torch.long))
            settled = num.tolist()
        tree = None
        if parents is not None:  # a kept prefix of a best-first tree is a tree
            trimmed = [list(p[:n]) for p, n in zip(parents, num.tolist())]
            if not all(is_chain(p) for p in trimmed):
                tree = trimmed
        # a drafter may find fewer drafts than asked (prompt lookup without a match): no
        # pass pays for padding columns that no row uses
        K = int(num.max())
        return Drafts(asked=list(k), k=settled, K=K, drafts=drafts[:, :K], q=None if q is None else q[:, :K],
                      num=num, num_l=num.tolist(), parents=tree, prep_s=prep_s, t_start=t_start, t_end=t_end)

    def _verify(self, s: StepRows, d: Drafts) -> TargetPass:
        """All rows in ONE target pass over [pending, d_1..d_k]; a row whose logits are not
        finite at the positions it verifies fails alone."""
        pending = self._pending_tokens(s.reqs, self.times.steps)  # [B,1]
        x = torch.cat([pending, d.drafts], dim=1) if d.K else pending  # [B,K+1]
        depth = None
        if d.parents is None:
            logits = self.target.forward(x, self.cache, s.rows, [n + 1 for n in d.num_l])  # [B,K+1,V]
        else:
            depth, visible = self._tree_layout(d.parents, d.K + 1)  # [B,K+1], [B,K+1,K+1]
            logits = self.target.forward(x, self.cache, s.rows, [n + 1 for n in d.num_l],
                                         tree=(depth, visible))
        t_end = time.perf_counter()
        finite = finite_positions(logits)  # sync: [B][K+1] flags
        failed = {b: "the model's logits are not finite" for b in range(s.B)
                  if not all(finite[b][:d.num_l[b] + 1])}
        return TargetPass(logits, depth, failed, t_end)

    def _accept_rows(self, s: StepRows, d: Drafts, t: TargetPass) -> Verdict:
        """Accept per row: greedy rows together, sampled rows each with its own random
        source (noise keyed on (seed, position) for seeded rows, else a generator). A row
        whose sampling distribution is not finite, or whose rule raises, fails alone."""
        if d.parents is not None:
            return self._accept_tree(s, d, t)
        B, K, logits, drafts, num = s.B, d.K, t.logits, d.drafts, d.num
        failed = dict(t.failed)
        greedy = [b for b, r in enumerate(s.reqs) if r.params.sampling.greedy and b not in failed]
        if len(greedy) == B:  # every row greedy: no copy of the logits
            out, n_acc = self._verify_rule("greedy", logits, None, drafts, num, None)
            return Verdict(out, n_acc, failed, {})
        out = torch.full((B, K + 1), PAD, dtype=torch.long)  # [B,K+1]
        n_acc = torch.zeros(B, dtype=torch.long)  # [B]
        if greedy:
            gi = torch.tensor(greedy)
            out[gi], n_acc[gi] = self._verify_rule("greedy", logits[gi], None, drafts[gi], num[gi], None)
        for b, r in enumerate(s.reqs):
            sp = r.params.sampling
            if sp.greedy or b in failed:
                continue
            try:
                p = self._verify_probs(logits[b:b + 1], sp)  # [1,K+1,V]
                if not bool(torch.isfinite(p[0, :int(num[b]) + 1]).all()):
                    raise FloatingPointError("the sampling distribution is not finite")
                o, a = self._accept_sampled(b, r, p, d.q, drafts, num, s.n0[b], K)
            except Exception as e:  # noqa: BLE001 - this row fails; the batch goes on
                failed[b] = f"{type(e).__name__}: {e}"
                continue
            out[b], n_acc[b] = o[0], a[0]
        return Verdict(out, n_acc, failed, {})

    def _accept_sampled(self, b: int, r: Request, p, q, drafts, num, n0: int, K: int):
        """Verify sampled row b (p [1,K+1,V]) with rule_for(r); coupled rows use the noise
        keyed on (seed, sequence index) at indices n0..n0+K."""
        rule = self.rule_for(r)
        if rule == "coupled":
            noise = self._coupled_noise(r, n0, K, p.shape[-1])[None]  # [1,K+1,V]
            return self._verify_rule("coupled", p, None, drafts[b:b + 1], num[b:b + 1], noise)
        qb = None if q is None else q[b:b + 1, :, :p.shape[-1]]  # [1,K,V]
        return self._verify_rule(rule, p, qb, drafts[b:b + 1], num[b:b + 1], r.generator)

    def _coupled_noise(self, r: Request, n0: int, depth: int, V: int) -> torch.Tensor:
        """[depth+1,V]: the noise keyed on (r's seed, sequence index) at indices n0..n0+depth,
        which seeded plain decoding adds to log p there. A chain's draft i and a tree's node at
        depth i both read row i."""
        return self._keyed_noise(r.params.sampling.seed, range(n0, n0 + depth + 1), V)

    def _accept_tree(self, s: StepRows, d: Drafts, t: TargetPass) -> Verdict:
        """Accept a draft tree per row (verify/tree.walk): at each node the target's token is
        drawn as plain decoding draws it there (greedy: the argmax; seeded: the argmax of
        log p plus the noise keyed on (seed, sequence index), which depends on the node's
        depth; otherwise one draw from p with the request's generator), and the walk goes on
        while that token is a child. A row that fails fails alone."""
        B, K = s.B, d.K
        out = torch.full((B, K + 1), PAD, dtype=torch.long)  # [B,K+1]
        n_acc = torch.zeros(B, dtype=torch.long)  # [B]
        failed, paths = dict(t.failed), {}
        depth_l = t.depth.tolist()
        drafts_l = d.drafts.tolist()
        for b, r in enumerate(s.reqs):
            if b in failed:
                continue
            n = d.num_l[b]
            sp = r.params.sampling
            try:
                rule = self.rule_for(r)
                if rule == "greedy":
                    best = argmax_last(t.logits[b, :n + 1].contiguous()).tolist()
                    draw = lambda slot, dp, best=best: best[slot]  # noqa: E731
                else:
                    p = self._verify_probs(t.logits[b:b + 1, :n + 1], sp)[0]  # [n+1,V]
                    if not bool(torch.isfinite(p).all()):
                        raise FloatingPointError("the sampling distribution is not finite")
                    if rule == "coupled":
                        at = depth_l[b][:n + 1]  # each slot's depth
                        noise = self._coupled_noise(r, s.n0[b], max(at), p.shape[-1])  # [dmax+1,V]
                        best = argmax_last((torch.log(p.double()) + noise[torch.tensor(at)]).contiguous()).tolist()
                        draw = lambda slot, dp, best=best: best[slot]  # noqa: E731
                    else:  # one draw per emitted token from the request's generator, as plain decoding
                        g = r.generator
                        draw = lambda slot, dp, p=p, g=g: int(torch.multinomial(p[slot], 1, generator=g))  # noqa: E731
                w = self._tree_walk(d.parents[b], drafts_l[b][:n], draw)
            except Exception as e:  # noqa: BLE001 - this row fails; the batch goes on
                failed[b] = f"{type(e).__name__}: {e}"
                continue
            out[b, :len(w.tokens)] = torch.tensor(w.tokens)
            n_acc[b] = w.accepted
            paths[b] = w.slots
        return Verdict(out, n_acc, failed, paths)

    def _commit(self, s: StepRows, d: Drafts, v: Verdict) -> Committed:
        """Append emitted tokens, apply stops, roll caches back to each row's length; end
        the rows that finished or failed.

        Atomic: the tokens are appended first (the stop and length rules read the output
        as it grows), then the caches and the drafter roll back; if either raises, every
        row's output goes back to its length before the step and the exception reaches
        step(), whose undo and retry then see outputs and caches that agree. Once both
        succeeded the step is committed: nothing after it (the stats, ending rows,
        the policy's observation) may send the step back to be taken again."""
        reqs = s.reqs
        out_l, acc_l = v.out.tolist(), v.n_acc.tolist()  # sync: one transfer for the whole batch
        before = [len(r.output_ids) for r in reqs]
        committed, finished = [], []
        try:
            for b, r in enumerate(reqs):
                if b in v.failed:  # keeps its pre-step length; freed below
                    committed.append(s.n0[b] - 1)
                    continue
                reason = self._append(r, out_l[b][:acc_l[b] + 1])
                committed.append(self._committed_length(r))
                if reason:
                    finished.append((r, reason))
            if v.paths:  # a tree step: each row's accepted path into place first
                kept = sorted(v.paths)
                self.cache.keep_slots([s.rows[b] for b in kept], [s.n0[b] - 1 for b in kept],
                                      [v.paths[b] for b in kept])
            self.cache.truncate(s.rows, committed)
            if self.drafter is not None:
                self.drafter.rollback(s.rows, committed)
        except Exception:
            for r, n in zip(reqs, before):
                del r.output_ids[n:]
            raise
        n_out = self._record(s, d, v, acc_l)
        ended = []
        for r, reason in finished:
            self._end(r, reason, ended)
        for b, why in v.failed.items():
            self._end(reqs[b], "error", ended, why)
        done = {id(r) for r in ended}
        self.running = [r for r in reqs if id(r) not in done]
        return Committed(ended, acc_l, n_out)

    def _record(self, s: StepRows, d: Drafts, v: Verdict, acc_l: list[int]) -> int:
        """The committed step in each row's stats (and, with config.trace, in its trace;
        without it, the step spends nothing on the trace). -> tokens appended."""
        trace = self._trace_lists(d) if self.config.trace else None
        n_out = 0
        for b, r in enumerate(s.reqs):
            if b in v.failed:
                continue
            n = d.num_l[b]
            tree = d.parents[b] if d.parents is not None and not is_chain(d.parents[b]) else None
            r.stats.record_step(n, acc_l[b], None if tree is None else max(tree_depths(tree), default=0))
            if trace is not None:
                drafts_l, qd_l, above_l = trace
                if tree is None:
                    r.stats.trace.append((s.n0[b], drafts_l[b][:n], acc_l[b], d.k[b]))
                    r.stats.trace_trees.append(None)
                else:
                    r.stats.trace.append((s.n0[b], _walked_branch(tree, drafts_l[b][:n], v.paths[b]),
                                          acc_l[b], d.k[b]))
                    r.stats.trace_trees.append((drafts_l[b][:n], list(tree)))
                r.stats.trace_asked.append(d.asked[b])
                if self.rule_for(r) not in ("rejection", "typical-lossy"):  # rules that draw with a generator
                    r.stats.draft_q.append(None)
                    r.stats.draft_q_above.append(None)
                else:  # no q from the drafter: q is one-hot at its draft (prompt lookup, a tree's nodes)
                    r.stats.draft_q.append(qd_l[b][:n] if qd_l is not None and tree is None else [1.0] * n)
                    r.stats.draft_q_above.append(above_l[b][:n] if above_l is not None else None)
            n_out += len(r.output_ids) - r.stats.generated_tokens
            r.stats.generated_tokens = len(r.output_ids)
        return n_out

    @staticmethod
    def _trace_lists(d: Drafts) -> tuple[list, list | None, list | None]:
        """The step's drafts [B][K]; q(d) of each, for the audit's calibration test; and the
        mass q puts on the tokens ranked before d (descending q, ties by id), for its test
        that the drafts are samples of the q the verifier read. None without a q (one-hot)."""
        drafts_l = d.drafts.tolist()
        if d.q is None or not d.drafts.numel():
            return drafts_l, None, None
        qd = d.q.gather(-1, d.drafts[..., None])  # [B,K,1]
        ids = torch.arange(d.q.shape[-1])
        before = (d.q > qd) | ((d.q == qd) & (ids < d.drafts[..., None]))  # [B,K,V]
        return drafts_l, qd.squeeze(-1).tolist(), (d.q * before).sum(-1).tolist()

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

    def _observe(self, s: StepRows, d: Drafts, t: TargetPass, v: Verdict, c: Committed) -> None:
        """After the step, the policy learns its outcome (never earlier: it sees no verdict
        before it chose): d.k as settled in _propose, accepted drafts per row, and times.
        The step is committed by now: a policy that raises here is logged and the step
        stands (taking it again would emit its tokens twice)."""
        draft_s, verify_s = d.t_end - d.t_start, t.t_end - d.t_end
        try:
            if v.paths:
                self.policy.observe_tree(s.reqs, d.parents, {b: [sl - 1 for sl in p[1:]] for b, p in v.paths.items()})
            self.policy.observe(s.reqs, d.k, c.acc_l)
            self.policy.observe_costs(s.B, d.K + 1, sum(kb > 0 for kb in d.k), max(d.k), draft_s, verify_s)
        except Exception:  # noqa: BLE001 - a learning failure does not undo a committed step
            log.exception("the policy's observe() raised after a committed step; the step stands")
        t_end = time.perf_counter()
        self.times.draft_s += draft_s
        self.times.verify_forward_s += verify_s
        self.times.other_s += (d.t_start - s.t0 - d.prep_s) + (t_end - t.t_end)
        self.times.steps += 1
        if s.B > 1:  # one row has neither a gap nor another length
            self.churn.gapped_steps += max(s.rows) - min(s.rows) >= s.B  # rows are distinct
            self.churn.mixed_length_steps += min(s.n0) != max(s.n0)
        self.times.per_step.append((s.B, sum(d.num_l), c.n_out, t_end - s.t0 - d.prep_s))  # prefill left out

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
