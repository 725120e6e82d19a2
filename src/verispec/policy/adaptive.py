"""Adaptive speculation: per step and per row, draft the number of tokens that
maximises the batch's expected tokens per second, so speculation can only help.

Inputs, all known before the step (the policy is non-anticipating: the target's
verdicts of a step reach it only through observe(), after the step):
- a cost model measured at start-up: target forward time as a function of the rows
  it processes (batch x tokens per row), and drafter time per drafting step as a
  function of the rows drafting;
- each row's running acceptance: an exponential average of the probability that a
  draft token is accepted given the ones before it were.

For a candidate choice "the m rows most likely to accept draft k tokens, the rest
draft none", expected emitted tokens are sum_b (1 + a_b + ... + a_b^k) and the cost
is k * t_draft(m) + t_target(B + m k); the best (m, k), k = 0 included, wins. Rows
whose drafts keep failing fall out of the top m; they are probed again with one
draft token after an interval that doubles with every failed probe.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class CostModel:
    """Seconds as piecewise-linear functions of row counts (interpolated, extrapolated linearly)."""

    target_rows: tuple[int, ...]  # rows processed by one target forward
    target_s: tuple[float, ...]
    draft_rows: tuple[int, ...]  # rows drafting in one drafter step
    draft_s: tuple[float, ...]

    @staticmethod
    def _interp(x, xs, ys):
        x = np.asarray(x, dtype=np.float64)
        xs, ys = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
        y = np.interp(x, xs, ys)
        if len(xs) >= 2:  # linear beyond the last point
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            y = np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), y)
        return y

    def target(self, rows):
        return self._interp(rows, self.target_rows, self.target_s)

    def draft(self, rows):
        return np.where(np.asarray(rows) > 0, self._interp(rows, self.draft_rows, self.draft_s), 0.0)


def _time(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def measure_costs(target, drafter, max_batch: int, max_k: int, context: int = 64) -> CostModel:
    """Time the target on 1..max_batch*(max_k+1) rows and the drafter on 1..max_batch rows."""
    from ..drafters.draft_model import DraftModelDrafter
    from ..drafters.layerskip import LayerSkipDrafter

    V = target.config.vocab_size
    n_max = max_batch * (max_k + 1)
    pts = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, n_max} & set(range(1, n_max + 1)) | {n_max})
    cache = target.new_cache(1, context + n_max)
    row = cache.alloc()
    target.forward(torch.randint(0, V, (1, context)), cache, row)

    def fwd(model, c, r, n, **kw):
        def f():
            model.forward(torch.randint(0, V, (1, n)), c, r, **kw)
            c.truncate(r, [context])
        return f
    t_s = [_time(fwd(target, cache, row, n)) for n in pts]
    d_pts = sorted({1, 2, 4, 8, 16, 32, max_batch} & set(range(1, max_batch + 1)))
    if isinstance(drafter, DraftModelDrafter):
        dm = drafter.model
        dc = dm.new_cache(max(d_pts), context + 1)
        rows = dc.alloc(max(d_pts))
        dm.forward(torch.randint(0, V, (len(rows), context)).clamp(max=dm.config.vocab_size - 1), dc, rows)

        def dfwd(m):
            def f():
                dm.forward(torch.zeros(m, 1, dtype=torch.long), dc, rows[:m], last_only=True)
                dc.truncate(rows[:m], [context] * m)
            return f
        d_s = [_time(dfwd(m)) for m in d_pts]
    elif isinstance(drafter, LayerSkipDrafter):
        d_s = [_time(fwd(target, cache, row, m, last_only=True, num_layers=drafter.num_layers)) for m in d_pts]
    else:  # prompt lookup and other model-free drafters: host-side work only
        d_s = [2e-5 * m for m in d_pts]
    return CostModel(tuple(pts), tuple(t_s), tuple(d_pts), tuple(d_s))


class _RowState:
    __slots__ = ("alpha", "idle", "probe_every", "probing")

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.idle = 0  # steps since this row last drafted
        self.probe_every = 8
        self.probing = False


class AdaptivePolicy:
    def __init__(self, costs: CostModel, max_k: int = 8, prior: float = 0.6, decay: float = 0.3,
                 min_probe: int = 8, max_probe: int = 128):
        if max_k < 1:
            raise ValueError("max_k must be >= 1")
        self.costs, self.max_k, self.prior, self.decay = costs, max_k, prior, decay
        self.min_probe, self.max_probe = min_probe, max_probe
        self.rows: dict[str, _RowState] = {}
        self.global_alpha = prior  # new rows start from what this drafter has done lately

    def _state(self, req) -> _RowState:
        st = self.rows.get(req.request_id)
        if st is None:
            st = self.rows[req.request_id] = _RowState(self.global_alpha)
        return st

    def expected_tokens(self, alphas: np.ndarray) -> np.ndarray:
        """alphas [B] -> E [B, max_k+1]: expected tokens emitted with k drafts (k = 0..max_k)."""
        powers = alphas[:, None] ** np.arange(self.max_k + 1)[None, :]  # [B, K+1]
        return np.cumsum(powers, axis=1)

    def best_choice(self, alphas: np.ndarray) -> list[int]:
        """The (m rows, k drafts) that maximises expected tokens per second."""
        B = len(alphas)
        order = np.argsort(-alphas, kind="stable")
        E = self.expected_tokens(alphas[order])  # [B, K+1] sorted by alpha
        gain = np.cumsum(E - 1.0, axis=0)  # [B, K+1]: extra tokens when the top m draft k
        m = np.arange(1, B + 1)[:, None]  # [B,1]
        k = np.arange(self.max_k + 1)[None, :]  # [1,K+1]
        tokens = B + gain  # [B, K+1]
        secs = self.costs.target(B + m * k) + k * self.costs.draft(m)  # [B, K+1]
        rate = tokens / secs
        base = B / float(self.costs.target(B))
        i, j = np.unravel_index(int(np.argmax(rate)), rate.shape)
        choice = [0] * B
        if rate[i, j] > base and j > 0:
            for b in order[: i + 1]:
                choice[int(b)] = int(j)
        return choice

    def choose(self, requests) -> list[int]:
        states = [self._state(r) for r in requests]
        choice = self.best_choice(np.array([s.alpha for s in states]))
        for s, idx in zip(states, range(len(states))):
            s.probing = False
            if choice[idx] == 0 and s.idle >= s.probe_every:
                choice[idx], s.probing = 1, True  # a rare, cheap probe of a row left out
        return choice

    def observe(self, requests, k, accepted) -> None:
        for r, kb, ab in zip(requests, k, accepted):
            st = self._state(r)
            if kb == 0:
                st.idle += 1
                continue
            # conditional acceptance: ab successes in a row, then a failure if ab < kb
            trials = ab + (1 if ab < kb else 0)
            rate = ab / trials
            w = 1.0 - (1.0 - self.decay) ** trials
            st.alpha = (1 - w) * st.alpha + w * rate
            self.global_alpha = 0.9 * self.global_alpha + 0.1 * rate
            if st.probing:
                st.probe_every = (self.min_probe if ab > 0
                                  else min(2 * st.probe_every, self.max_probe))
            st.idle = 0
        for r in requests:
            if r.finished:
                self.rows.pop(r.request_id, None)
