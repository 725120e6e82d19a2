"""The engine: continuous batching around one short, linear speculative step.

Invariant between steps, for every running request r on cache row r.row:
    r.tokens[-1] is the *pending* token (sampled, not yet in the target cache), and
    target cache length == len(r.tokens) - 1.
A plain decoding step is the same step with k = 0 drafts for every row.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from ..policy import FixedK
from ..sampling import keyed_gumbel, logits_to_probs
from ..verify import LOSSY_RULES, RULES, verify
from .prompt_cache import prefill
from .request import Request


class ContextLengthError(ValueError):
    """A prompt plus max_new_tokens does not fit the engine's context."""


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 8  # rows decoded together
    max_len: int = 2048  # prompt + generated tokens per row
    rule: str = "rejection"  # verification rule; see verify/

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


class Engine:
    def __init__(self, target, drafter=None, policy=None, config: EngineConfig = EngineConfig(),
                 prompt_cache=None):
        self.target = target
        self.prompt_cache = prompt_cache  # engine.prompt_cache.PromptCache: prefills to reuse
        self.drafter = drafter
        self.policy = policy if policy is not None else FixedK(0 if drafter is None else 4)
        if drafter is None and self.policy.max_k > 0:
            raise ValueError("a policy that drafts needs a drafter")
        self.config = config
        slack = self.policy.max_k + 1  # a verify pass may write past the last kept token
        self.cache = target.new_cache(config.max_batch, config.max_len + slack)
        if hasattr(drafter, "bind_cache"):
            drafter.bind_cache(self.cache)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.times = StepTimes()

    # -- lifecycle -------------------------------------------------------------
    def add(self, req: Request) -> None:
        total = len(req.prompt_ids) + req.params.max_new_tokens
        if total > self.config.max_len:
            raise ContextLengthError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.params.max_new_tokens}) "
                f"= {total} exceeds the context of {self.config.max_len} tokens")
        V = self.target.config.vocab_size
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= V:
            raise ValueError(f"prompt token ids must lie in the vocabulary [0, {V})")
        sp = req.params.sampling
        if self.config.rule == "coupled" and not sp.greedy and not sp.coupled:
            seed = sp.seed if sp.seed is not None else int(torch.randint(2 ** 62, ()))
            req.params = replace(req.params, sampling=replace(sp, coupled=True, seed=seed))
        if req.generator is None:
            req.generator = req.params.sampling.make_generator()
        self.waiting.append(req)

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
        self.cache.free([req.row])
        if self.drafter is not None:
            self.drafter.release([req.row])

    def _admit(self) -> None:
        new = []
        while self.waiting and len(self.running) + len(new) < self.config.max_batch:
            new.append(self.waiting.popleft())
        if not new:
            return
        t0 = time.perf_counter()
        rows = self.cache.alloc(len(new))
        for r, row in zip(new, rows):
            r.row, r._t0 = row, t0
        try:  # prefill all but the pending token (the last prompt token)
            prefill(self.target, self.cache, rows, [r.prompt_ids[:-1] for r in new], self.prompt_cache)
            if self.drafter is not None:
                self.drafter.admit(rows, [r.tokens for r in new])
        except Exception:  # nobody holds these rows now: free them before reporting the failure
            for r in new:
                self._finish(r, "error")
            raise
        self.running.extend(new)
        self.times.prefill_s += time.perf_counter() - t0

    # -- the step ----------------------------------------------------------------
    def step(self) -> list[Request]:
        """One propose -> verify -> accept -> commit step for every running row.
        Returns the requests that finished in this step."""
        self._admit()
        reqs = self.running
        if not reqs:
            return []
        t0 = time.perf_counter()
        B, rows = len(reqs), [r.row for r in reqs]
        n0 = [len(r.tokens) for r in reqs]  # sequence lengths; cache holds n0 - 1
        # 1. how many drafts per row: the policy's choice, capped by what the row can still emit
        k = self.policy.choose(reqs) if self.drafter is not None else [0] * B
        k = [max(0, min(kb, r.params.max_new_tokens - len(r.output_ids) - 1)) for kb, r in zip(k, reqs)]
        # 2. propose
        K = max(k)
        t1 = time.perf_counter()
        # a policy may stop rows while they draft, on the drafter's own confidence
        halt = getattr(self.policy, "halt", None) if getattr(self.drafter, "halts", False) else None
        if K > 0:
            kw = {} if halt is None else {"halt": lambda i, active, conf: halt(reqs, k, i, active, conf)}
            drafts, q, num = self.drafter.propose(rows, [r.tokens for r in reqs], k,
                                                   [r.params.sampling for r in reqs],
                                                   [r.generator for r in reqs], **kw)
            if halt is not None:
                k = num.tolist()  # where the policy stopped a row is what it asked for
        else:
            drafts, q, num = torch.zeros(B, 0, dtype=torch.long), None, torch.zeros(B, dtype=torch.long)
        t2 = time.perf_counter()
        # 3. verify all rows in ONE target pass over [pending, d_1..d_k]; a drafter may
        #    find fewer drafts than asked (prompt lookup without a match): no pass pays
        #    for padding columns that no row uses
        if K > 0 and hasattr(self.policy, "trim"):  # a policy may settle k once drafts are found
            num = torch.minimum(num, torch.tensor(self.policy.trim(reqs, num.tolist()), dtype=torch.long))
            k = num.tolist()  # what the policy settled on is what it asked for
        K = int(num.max())
        drafts = drafts[:, :K]
        q = None if q is None else q[:, :K]
        x = torch.cat([self._pending_tokens(reqs), drafts], dim=1)  # [B,K+1]
        logits = self.target.forward(x, self.cache, rows, (num + 1).tolist())  # [B,K+1,V]
        t3 = time.perf_counter()
        # 4. accept per row: greedy rows together, sampled rows each with its own random
        #    source (a generator, or noise keyed on (seed, position) for coupled rows)
        out = torch.full((B, K + 1), -1, dtype=torch.long)  # [B,K+1]
        n_acc = torch.zeros(B, dtype=torch.long)  # [B]
        greedy = [b for b, r in enumerate(reqs) if r.params.sampling.greedy]
        if greedy:
            gi = torch.tensor(greedy)
            o, a = verify("greedy", logits[gi], None, drafts[gi], num[gi], None)
            out[gi], n_acc[gi] = o, a
        for b, r in enumerate(reqs):
            if r.params.sampling.greedy:
                continue
            p = logits_to_probs(logits[b:b + 1], r.params.sampling)  # [1,K+1,V]
            qb = None if q is None else q[b:b + 1, :, :p.shape[-1]]
            sp = r.params.sampling
            if sp.coupled:
                noise = keyed_gumbel(sp.seed, range(n0[b], n0[b] + K + 1), p.shape[-1])[None]
                o, a = verify("coupled", p, None, drafts[b:b + 1], num[b:b + 1], noise)
            else:
                rule = "rejection" if self.config.rule == "coupled" else self.config.rule
                o, a = verify(rule, p, qb, drafts[b:b + 1], num[b:b + 1], r.generator)
            out[b], n_acc[b] = o[0], a[0]
        # 5. commit: append emitted tokens, apply stops, roll caches back to each row's length
        out_l, acc_l = out.tolist(), n_acc.tolist()  # sync: one transfer for the whole batch
        num_l, drafts_l = num.tolist(), drafts.tolist()
        committed, finished, n_out = [], [], 0
        for b, r in enumerate(reqs):
            emitted = out_l[b][:acc_l[b] + 1]
            r.stats.record_step(num_l[b], acc_l[b])
            r.stats.trace.append((n0[b], drafts_l[b][:num_l[b]], acc_l[b], k[b]))
            reason = None
            for tok in emitted:
                r.output_ids.append(tok)
                if not r.params.ignore_eos and tok in r.params.stop_token_ids:
                    reason = "stop"
                    break
                if len(r.output_ids) >= r.params.max_new_tokens:
                    reason = "length"
                    break
            n_out += len(r.output_ids) - r.stats.generated_tokens
            r.stats.generated_tokens = len(r.output_ids)
            committed.append(self._committed_length(r))
            if reason:
                finished.append((r, reason))
        self.cache.truncate(rows, committed)
        if self.drafter is not None:
            self.drafter.rollback(rows, committed)
        for r, reason in finished:
            self._finish(r, reason)
        # after the step: the policy never sees verdicts early. It learns from what it
        # asked for: a draft the drafter could not find (no lookup match) counts as a
        # rejected one, since the step paid for it in the same way
        self.policy.observe(reqs, k, acc_l)
        if hasattr(self.policy, "observe_costs"):  # measured times refine a cost model
            self.policy.observe_costs(B, K + 1, sum(kb > 0 for kb in k), max(k), t2 - t1, t3 - t2)
        done = {id(r) for r, _ in finished}
        self.running = [r for r in reqs if id(r) not in done]
        t4 = time.perf_counter()
        self.times.draft_s += t2 - t1
        self.times.verify_forward_s += t3 - t2
        self.times.other_s += (t1 - t0) + (t4 - t3)
        self.times.steps += 1
        self.times.per_step.append((B, int(num.sum()), n_out, t4 - t0))
        return [r for r, _ in finished]

    # Two small seams, kept as methods so that engine/faults.py can break them on purpose.
    def _pending_tokens(self, reqs: list[Request]) -> torch.Tensor:
        return torch.tensor([[r.tokens[-1]] for r in reqs])  # [B,1]

    def _committed_length(self, r: Request) -> int:
        return len(r.tokens) - 1  # everything but the new pending token

    def run(self, requests: list[Request], on_finish=None) -> list[Request]:
        """Decode requests to completion with continuous batching (rows refill as others end)."""
        for r in requests:
            self.add(r)
        while self.has_work:
            for r in self.step():
                if on_finish is not None:
                    on_finish(r)
        return requests
