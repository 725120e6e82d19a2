"""Adaptive speculation: per step and per row, draft the number of tokens that
maximises the batch's expected tokens per second, so speculation can only help.

Inputs, all known before the step (the policy is non-anticipating: the target's
verdicts of a step reach it only through observe(), after the step):
- a cost model measured on this machine (policy/costs.py: timed at the first start,
  then read from a disk cache, which is rewritten when the times measured while decoding
  drift from it): the target forward's time as a function of the batch's shape (B rows
  x T tokens per row; the engine pads every row of a step to the step's longest draft,
  so a step whose longest draft is k costs target(B, k + 1) whichever rows draft), and
  the drafter's time per draft token as a function of the rows drafting;
- each row's running acceptance per draft position: the probability that draft i is
  accepted given drafts 1..i-1 were, from exponentially forgotten counts. Per position,
  because acceptance is not geometric: a prompt-lookup draft that survives its first
  tokens is usually a copy that goes on. The figure per position is the drafter's
  (learned over every row; a position nobody tried takes the rate of the one before
  it, with a little optimism where the record is thin) times the row's own level
  (accepted over expected, shrunk toward 1). So a new row starts from what the drafter
  has done lately (a drafter that never pays is not re-learned with every request),
  and a row that accepts its first drafts well is expected to accept later ones well
  before it has tried them (or it would never try them).

For a candidate choice "the m rows most likely to accept draft k tokens, the rest
draft none", expected emitted tokens are sum_b (1 + a_b1 + a_b1 a_b2 + ...) and the
cost is k * t_draft(m) + t_target(B, k + 1); the best (m, k), k = 0 included, wins, and
a choice must beat plain decoding's rate by a margin (AdaptiveConfig.min_gain, 5%: the
cost model is a measurement, not the truth). Rows whose drafts keep failing fall out of
the top m; they are probed again with one draft token after an interval that doubles with every
failed probe and is never so short that probes cost the batch over 1% of its time.
Probes are gathered into shared steps (a probe pays for a padded pass, which then
costs the same for every row that probes in it).

With a drafter that drafts token by token and knows its own probabilities (a draft
model, layer-skip: CostModel.halts), the k chosen for a drafting row is a cap and the
row stops on the drafter's confidence (halt()): after each draft, P(every draft so far
is accepted) comes from a calibration of the drafter's probability of its token against
what the target accepted at that confidence before, and the row goes on while its next
draft is expected to bring tokens faster than the engine has been emitting them. The best k moves
from prompt to prompt and from token to token; a cap plus a stopping rule on the
drafter's own probabilities follows it within a step, which a k chosen from averages
cannot. Stopping on the drafter's probabilities is allowed: the verdicts of the step
never enter it, so the output distribution is unchanged. The calibration lives in
policy/calibration.py.

Every tunable (margins, forgetting factors, probe intervals, optimism) is a field of
AdaptiveConfig (policy/config.py), built at the edge and passed in.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from .base import Policy
from .calibration import CONF_EDGES, CONF_MIDS, ConfidenceCalibration
from .config import AdaptiveConfig
from .costs import CostEntry, CostModel, CostRefresher, _isotonic, measure_costs

# CostModel, measure_costs, CONF_EDGES and _isotonic are imported from here by tests and benchmarks
__all__ = ["AdaptiveConfig", "AdaptivePolicy", "CONF_EDGES", "CONF_MIDS", "CostModel", "measure_costs"]


class _RowState:
    """A row's record per draft position: exponentially forgotten counts of drafts
    accepted (s) and tried (n) at that position, given the ones before it were accepted."""

    __slots__ = ("s", "n", "idle", "probe_every", "probing", "edits")

    def __init__(self, max_k: int, min_probe: int):
        self.s = np.zeros(max_k)  # [K]
        self.n = np.zeros(max_k)  # [K]
        self.idle = 0  # steps since this row last drafted
        self.probe_every = min_probe
        self.probing = False
        self.edits = 0  # times the record changed (a plan resting on it is stale)

    def assume(self, alpha, trials: float = 1e6) -> None:
        """Set the row's record to `trials` drafts per position at acceptance alpha (tests)."""
        self.n[:] = trials
        self.s[:] = np.asarray(alpha, dtype=np.float64) * trials
        self.edits += 1


class AdaptivePolicy(Policy):
    """See the module docstring. costs: the cost model; max_k: the most drafts per row and
    step; config: the tunables (AdaptiveConfig()'s defaults unless given); overrides:
    AdaptiveConfig fields to replace in it (AdaptivePolicy(costs, max_k=4, prior=0.0));
    cost_entry: the disk-cache entry `costs` came from (policy/costs.py), refreshed when
    the step times observe_costs() reports drift from it (None: no cache)."""

    name = "adaptive"

    def __init__(self, costs: CostModel, max_k: int = 8, config: AdaptiveConfig | None = None, *,
                 cost_entry: CostEntry | None = None, **overrides):
        if max_k < 1:
            raise ValueError("max_k must be >= 1")
        cfg = replace(config or AdaptiveConfig(), **overrides)
        self.config = cfg
        self.costs, self.max_k = costs, max_k
        self.halts = costs.halts  # halt() stops rows on the drafter's confidence
        self.trims = costs.draft_free  # trim() settles k on the drafts a model-free drafter found
        self.refresher = None if cost_entry is None else CostRefresher(
            cost_entry, cfg.drift_tolerance, cfg.drift_min_steps, cfg.drift_keep, cfg.max_swing)
        self._cache: dict[int, tuple] = {}
        self._costs_now: dict[int, tuple] = {}  # _pass_costs per batch size until the next measurement
        self._version = 0  # bumped whenever a draft is observed (row records, drafter figures)
        self._memo = None  # (request ids, records' versions, steps it may still serve, plan): _planned()
        self.scale = {"plain": 1.0, "wide": 1.0, "draft": 1.0}  # measured / modelled time
        self.rows: dict[str, _RowState] = {}
        # the drafter's record over every row, per draft position (forgotten per row-step)
        self.gs, self.gn = np.zeros(max_k), np.zeros(max_k)
        # calibration of the drafter's confidence: P(draft accepted | drafts before it were,
        # the drafter gave it probability c), per bin of c, from forgotten counts (halt())
        self.calibration = ConfidenceCalibration(cfg.conf_keep, cfg.conf_strength)
        self._conf: dict = {}  # request_id -> the step's draft confidences so far
        # realised tokens per second per batch size: the rate a marginal draft must beat
        # in halt(); until a batch size has one, the plan's. It is forgotten sums of
        # tokens over forgotten sums of seconds (the renewal rate), not an average of
        # per-step rates, which a short step that emits much would pull up
        self.rate_seen: dict[int, float] = {}
        self._rate_sums: dict[int, tuple[float, float]] = {}
        self._emitted = None  # (batch, tokens) of the step observe() saw last
        # measured target pass times per batch size and tokens per row: forgotten sums
        # of seconds and counts per shape. They join the cost model's figures (worth one
        # measurement each), whose few timings on a shared machine can misshape the cost
        # of one more column
        self.pass_seen: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._step = None  # (request ids, alphas [B,K], planned rate) of the step being drafted
        # whether the model-free drafter estimates each draft's acceptance (found_conf,
        # bind_drafter()): such a drafter is asked every step and trim() settles k on its
        # calibrated estimates
        self.confident = False

    # read-only shortcuts to the config figures tests read off the policy
    min_probe = property(lambda self: self.config.min_probe)
    probe_budget = property(lambda self: self.config.probe_budget)
    replan_every = property(lambda self: self.config.replan_every)
    conf_keep = property(lambda self: self.config.conf_keep)

    # the calibration's records, [bins] each (policy/calibration.py)
    @property
    def cs(self) -> np.ndarray:
        return self.calibration.cs

    @cs.setter
    def cs(self, v) -> None:
        self.calibration.cs = v

    @property
    def cn(self) -> np.ndarray:
        return self.calibration.cn

    @cn.setter
    def cn(self, v) -> None:
        self.calibration.cn = v

    def _state(self, req) -> _RowState:
        st = self.rows.get(req.request_id)
        if st is None:
            st = self.rows[req.request_id] = _RowState(self.max_k, self.config.min_probe)
        return st

    @property
    def global_alpha(self) -> np.ndarray:
        """[K]: the drafter's acceptance per draft position over every row lately. Each
        position's record is shrunk toward the position before it (the first toward the
        prior), so a position no row has tried yet takes the rate of the last one tried,
        not a fixed guess."""
        g, prev, c = np.empty(self.max_k), self.config.prior, self.config.global_strength
        for i in range(self.max_k):
            g[i] = prev = (self.gs[i] + c * prev) / (self.gn[i] + c)
        return g

    def _optimistic_global(self) -> np.ndarray:
        """[K]: global_alpha plus config.optimism (0.5) standard errors. A position past
        the k chosen so far is never tried, so an estimate that came out low on a few
        unlucky drafts would never be corrected; a little optimism where the record is
        thin makes the policy try it, and vanishes as the record grows."""
        g = self.global_alpha
        cfg = self.config
        return np.minimum(g + cfg.optimism * np.sqrt(g * (1.0 - g) / (self.gn + cfg.global_strength)), 1.0)

    def _alphas(self, states) -> np.ndarray:
        """[B, K]: each row's P(draft i accepted | the drafts before it were), as the
        drafter's figure per position times the row's level: the row's accepted drafts
        over those the drafter's figures expected of it (a ratio shrunk toward 1). A new
        row follows the drafter; a row with a record follows it; and the shape across
        positions (prompt lookup's all-or-nothing copies) comes from every row's drafts."""
        g = self._optimistic_global()  # [K]
        S = np.stack([st.s for st in states])  # [B,K]
        N = np.stack([st.n for st in states])  # [B,K]
        c = self.config.row_strength
        level = (S.sum(1) + c) / (N @ g + c)  # [B]
        return np.clip(level[:, None] * g[None, :], 0.0, 1.0)

    def _per_position(self, alphas) -> np.ndarray:
        """[B] (one acceptance for every position) or [B, max_k] -> [B, max_k]."""
        a = np.asarray(alphas, dtype=np.float64)
        return np.repeat(a[:, None], self.max_k, axis=1) if a.ndim == 1 else a

    def expected_tokens(self, alphas) -> np.ndarray:
        """alphas [B] or [B, max_k] -> E [B, max_k+1]: expected tokens emitted with k
        drafts (k = 0..max_k): 1 + a_1 + a_1 a_2 + ... + a_1...a_k."""
        a = self._per_position(alphas)
        survive = np.cumprod(a, axis=1)  # [B, K]: P(first i drafts all accepted)
        return np.cumsum(np.concatenate([np.ones((len(a), 1)), survive], axis=1), axis=1)

    def best_choice(self, alphas) -> list[int]:
        """The (m rows, k drafts) that maximises expected tokens per second; for each k,
        the m rows are those that gain most from k drafts."""
        return self._plan(alphas)[0]

    def _plan(self, alphas) -> tuple[list[int], float]:
        """best_choice and its modelled rate (tokens per second)."""
        E = self.expected_tokens(alphas)  # [B, K+1]
        B = len(E)
        order = np.argsort(-(E - 1.0), axis=0, kind="stable")  # [B, K+1]: rows by gain, per k
        gain = np.cumsum(np.take_along_axis(E - 1.0, order, axis=0), axis=0)  # top m draft k
        k = np.arange(self.max_k + 1)[None, :]  # [1,K+1]
        tokens = B + gain  # [B, K+1]
        t_pass, t_draft = self._pass_costs(B)
        secs = t_pass[None, :] + k * t_draft[:, None]  # [B, K+1] (a padded pass + m rows drafting)
        rate = tokens / secs
        base = B / float(t_pass[0])
        i, j = np.unravel_index(int(np.argmax(rate)), rate.shape)
        choice = [0] * B
        if rate[i, j] > base * (1.0 + self.config.min_gain) and j > 0:
            for b in order[: i + 1, j]:
                choice[int(b)] = int(j)
            return choice, float(rate[i, j])
        return choice, base

    def calibrated(self, conf) -> np.ndarray:
        """P(a draft is accepted | the drafts before it were), given the drafter's own
        probability of it (conf, array-like): ConfidenceCalibration.calibrated()."""
        return self.calibration.calibrated(conf)

    def halt(self, requests, k: list[int], i: int, active: list[int], conf) -> list[bool]:
        """Called by the drafter after it drafted position i (0-based) for the rows
        `active` (indices into requests), with its probability of each drafted token:
        which rows stop there. A row's next draft is worth P(all its drafts so far are
        accepted, given their confidences) x P(the next one is, from the row's record)
        tokens; one more draft position costs a draft pass over the rows that go on plus
        the wider target pass. The rows that go on are the top m by worth, for the m
        whose total worth beats that cost at the rate the engine has been emitting tokens
        at for this batch size (the plan's rate until it has a record): a step grows
        while its marginal tokens come faster than the average ones, which is what raises
        the long-run rate (and, rate updated step by step, converges on the best rule).
        Only the drafter's probabilities and what was known before the step are used:
        the rule is non-anticipating."""
        for b, cb in zip(active, conf):
            self._conf.setdefault(requests[b].request_id, []).append(float(cb))
        going = [j for j, b in enumerate(active) if k[b] > i + 1 and i + 1 < self.max_k]
        if not self.halts or not going:
            return [False] * len(active)
        ids = [r.request_id for r in requests]
        if self._step is None or self._step[0] != ids:  # called without this step's choose()
            alphas = self._alphas([self._state(r) for r in requests])
            self._step = (ids, alphas, self._plan(alphas)[1])
        _, alphas, rate = self._step
        B = len(requests)
        rate = self.rate_seen.get(B, rate)
        worth = np.array([float(np.prod(self.calibrated(self._conf[ids[active[j]]])))
                          * alphas[active[j], i + 1] for j in going])  # [G]
        order = np.argsort(-worth, kind="stable")
        t_pass, t_draft = self._pass_costs(B)
        widen = max(float(t_pass[i + 2]) - float(t_pass[i + 1]), 0.0)
        m = np.arange(1, len(going) + 1)
        value = np.cumsum(worth[order]) - rate * (widen + t_draft[m - 1])  # [G]
        best = int(np.argmax(value))
        stop = [True] * len(active)
        if value[best] > 0:
            for j in order[: best + 1]:
                stop[going[int(j)]] = False
        return stop

    def _model_costs(self, B: int):
        """The cost model's figures: (target pass over B rows x 1..max_k+1 tokens [K+1],
        draft token for 1..B rows drafting [B]), memoised."""
        c = self._cache.get(B)
        if c is None:
            c = self._cache[B] = (np.asarray(self.costs.target(B, np.arange(1.0, self.max_k + 2))),
                                  np.asarray(self.costs.draft(np.arange(1, B + 1))))
        return c

    def _pass_costs(self, B: int):
        """The engine's measured pass times where it has them (this batch size, these
        tokens per row); elsewhere the cost model's figures rescaled by what it has measured.
        Memoised until observe_costs() records a measurement (choose, trim, halt and
        probe_interval ask several times a step, and the step is a few ms on a small model)."""
        c = self._costs_now.get(B)
        if c is None:
            c = self._costs_now[B] = self._fresh_pass_costs(B)
        return c

    def _fresh_pass_costs(self, B: int):
        t_pass, t_draft = self._model_costs(B)
        t_pass = t_pass * np.where(np.arange(len(t_pass)) == 0, self.scale["plain"], self.scale["wide"])
        seen = self.pass_seen.get(B)
        if seen is not None:
            # each shape: its measurements pooled with the rescaled model's figure; then
            # a non-decreasing fit over tokens per row (a wider pass never costs less), so
            # one slow spell at one shape reads as noise, not as a wall the policy would
            # never cross again to correct it
            secs, n = seen
            t_pass = _isotonic((t_pass + secs) / (1.0 + n), 1.0 + n)
        return t_pass, t_draft * self.scale["draft"]

    def observe_costs(self, B: int, tokens_per_row: int, drafting_rows: int, drafts: int,
                      draft_s: float, verify_s: float) -> None:
        """Measured times of the step just taken (from the engine): the target pass over
        B rows x tokens_per_row took verify_s; drafting `drafts` tokens for drafting_rows
        rows took draft_s. Running ratios of measured to modelled time (one-token passes,
        wider passes, drafting) rescale the cost model, so a start-up timing that was
        off, or a machine whose load changed, stops steering the choice; and the pass time
        at this exact shape is kept (pass_seen) to replace the start-up figure. Timings
        are not verdicts: using them keeps the policy non-anticipating. With a disk-cache
        entry, the same measurements feed its CostRefresher, which rewrites the entry when
        they drift from it (policy/costs.py)."""
        cfg = self.config
        if self._emitted is not None and self._emitted[0] == B and draft_s + verify_s > 0:
            tok, sec = self._rate_sums.get(B, (0.0, 0.0))
            tok = cfg.rate_keep * tok + self._emitted[1]
            sec = cfg.rate_keep * sec + draft_s + verify_s
            self._rate_sums[B] = (tok, sec)
            self.rate_seen[B] = tok / sec
        self._emitted = None
        t_pass, t_draft = self._model_costs(B)
        T = min(max(tokens_per_row, 1), len(t_pass))
        key = "plain" if T == 1 else "wide"
        now = float(t_pass[T - 1]) * self.scale[key]  # the rescaled model: a bound for one step's weight
        self._update_scale(key, verify_s / float(t_pass[T - 1]))
        if math.isfinite(verify_s) and verify_s > 0:
            secs, n = self.pass_seen.setdefault(B, (np.zeros(len(t_pass)), np.zeros(len(t_pass))))
            secs[T - 1] *= cfg.pass_keep
            n[T - 1] *= cfg.pass_keep
            # one stalled step must not swing it
            secs[T - 1] += min(max(verify_s, now / cfg.max_swing), cfg.max_swing * now)
            n[T - 1] += 1.0
            self._costs_now.clear()
        if drafts > 0 and drafting_rows > 0:
            self._update_scale("draft", draft_s / (drafts * float(t_draft[min(drafting_rows, B) - 1])))
        if self.refresher is not None:
            self._watch_drift(key, verify_s, float(t_pass[T - 1]), drafting_rows, drafts, draft_s,
                              float(t_draft[min(max(drafting_rows, 1), B) - 1]))

    def _watch_drift(self, key, verify_s, model_s, drafting_rows, drafts, draft_s, model_draft_s) -> None:
        """Feed the cache entry's refresher one step (see CostRefresher). A model-free
        drafter's draft times are left out: the engine reports the drafts verified (after
        trim()), while proposing was asked for max_k, so their ratio is not the drafter's."""
        r = self.refresher
        if drafts > 0 and drafting_rows > 0 and not self.costs.draft_free:
            r.observe(key, verify_s, model_s, draft_s, drafts * model_draft_s)
        else:
            r.observe(key, verify_s, model_s)
        if r.due():
            r.refresh(self.costs, self.pass_seen)

    def _update_scale(self, key: str, ratio: float) -> None:
        if math.isfinite(ratio) and ratio > 0:
            s = self.config.max_swing
            ratio = min(max(ratio, 1.0 / s), s)  # one stalled step must not swing the model
            w = self.config.scale_weight
            self.scale[key] = (1 - w) * self.scale[key] + w * ratio
            self._costs_now.clear()

    def probe_interval(self, B: int) -> int:
        """Idle steps before a row left out is probed: min_probe, or longer where a probe
        is dear. Its wider pass and its draft token must cost the batch under probe_budget
        (0.5%) of its time per interval: with rows out of phase, probes gather in about two
        steps per interval, which keeps them near 1%."""
        cfg = self.config
        t, d = self._pass_costs(B)
        extra = (float(t[1]) - float(t[0]) + float(d[0])) / float(t[0]) if len(t) > 1 else 0.0
        return min(max(cfg.min_probe, int(np.ceil(extra / cfg.probe_budget))), 100 * cfg.max_probe)

    def _planned(self, ids, states):
        """(alphas, plan, probe floor) for this step: the plan is choose()'s (choice,
        rate), or for a model-free drafter whether asking can pay. Reused from the last
        step while nothing it rests on moved: the same requests, and no draft observed
        since (row records and the drafter's figures only change when a row drafts),
        for at most replan_every steps (the cost model drifts with every measurement).
        Planning is a few dozen small numpy operations that run with caches cold after
        each target pass: ~0.3 ms a step measured, 1% of a SmolLM2 step at batch 4, paid
        every step by a policy that has settled on drafting nothing."""
        key = (self._version, tuple(st.edits for st in states))
        m = self._memo
        if m is not None and m[0] == ids and m[1] == key and m[2] > 0:
            self._memo = (ids, key, m[2] - 1, m[3])
            return m[3]
        alphas = self._alphas(states)
        plan = self._asking_can_pay(alphas) if self.costs.draft_free else self._plan(alphas)
        out = (alphas, plan, self.probe_interval(len(states)))
        self._memo = (ids, key, self.config.replan_every - 1, out)
        return out

    def choose(self, requests) -> list[int]:
        self._conf.clear()
        self._step = None
        states = [self._state(r) for r in requests]
        for s in states:
            s.probing = False
        ids = [r.request_id for r in requests]
        alphas, plan, floor = self._planned(ids, states)
        if self.costs.draft_free:  # trim() decides once drafts are found
            self._step = (ids, alphas, 0.0)  # trim() reuses them
            if plan or self.confident or any(s.idle >= max(s.probe_every, floor) for s in states):
                return [self.max_k] * len(requests)
            return [0] * len(requests)
        choice, rate = list(plan[0]), plan[1]
        self._step = (ids, alphas, rate)
        # a rare, cheap probe of rows left out; when one row is due, the rows halfway to
        # their own probe join it, so probes share padded passes instead of each
        # costing the whole batch a wider pass on a step of its own
        if any(c == 0 and s.idle >= max(s.probe_every, floor) for c, s in zip(choice, states)):
            for i, s in enumerate(states):
                if choice[i] == 0 and 2 * s.idle >= max(s.probe_every, floor):
                    choice[i], s.probing = 1, True
        if self.halts:  # rows that draft may go up to max_k; halt() stops each one
            choice = [self.max_k if c > 0 and not s.probing else c for c, s in zip(choice, states)]
        return choice

    def _asking_can_pay(self, alphas) -> bool:
        """For a model-free drafter: whether proposing can pay this step. Asking is cheap,
        not free (the drafter's measured time per token x max_k). It is skipped when no
        j drafts per row could beat plain decoding even if every row found max_k drafts,
        which bounds what trim() could make of any drafts found."""
        B = len(alphas)
        E = self.expected_tokens(alphas)  # [B, K+1]
        t_pass, t_draft = self._pass_costs(B)
        ask = self.max_k * float(t_draft[B - 1])
        rate = E.sum(0) / (t_pass + ask)  # [K+1]: every row verifies j drafts
        return bool(rate[1:].max() > B / float(t_pass[0]) * (1.0 + self.config.min_gain))

    def trim(self, requests, found: list[int], conf: list | None = None, parents: list | None = None) -> list[int]:
        """For a model-free drafter, after proposing and before verifying: how many of the
        drafts found per row to verify. The drafts found are the drafter's own output, not
        the target's verdict, so deciding on them keeps the policy non-anticipating. Every
        row keeps up to j drafts, for the j that maximises expected tokens per second of a
        pass over j + 1 tokens per row (rows without a match cost that pass nothing more).
        The engine calls it only where self.trims (a model-free drafter's cost model); for
        any other drafter it keeps what was found. With conf (the drafter's own estimate
        per draft found, Drafter.found_conf), _trim_confident() decides instead, and prices
        a draft tree (parents) node by node."""
        if not self.trims:
            return list(found)
        if conf is not None and self.confident:
            return self._trim_confident(requests, found, conf, parents)
        states = [self._state(r) for r in requests]
        B, J = len(states), min(max(found, default=0), self.max_k)
        ids = [r.request_id for r in requests]
        m = self._memo
        floor = m[3][2] if m is not None and m[0] == ids else self.probe_interval(B)
        for s, fb in zip(states, found):
            if fb == 0 and s.idle >= max(s.probe_every, floor):
                s.idle = 0  # a probe that found nothing to draft was taken: the next is an interval away
        if J == 0:  # nothing found anywhere: a plain step (observe() counts it as idle)
            for s in states:
                s.probing = False
            return [0] * B
        alphas = self._step[1] if self._step is not None and self._step[0] == ids else self._alphas(states)
        E = self.expected_tokens(alphas)  # [B, K+1]
        f = np.minimum(np.asarray(found), J)
        tokens = np.take_along_axis(E, np.minimum(f[:, None], np.arange(J + 1)[None, :]), axis=1).sum(0)  # [J+1]
        t_pass = self._pass_costs(B)[0][: J + 1]
        rate = tokens / t_pass
        j = int(np.argmax(rate))
        if rate[j] <= rate[0] * (1.0 + self.config.min_gain):
            j = 0
        due = [b for b, s in enumerate(states) if f[b] > 0 and s.idle >= max(s.probe_every, floor)]
        for s in states:
            s.probing = False
        if j == 0 and due:
            j = 1
            for b in due:
                states[b].probing = True
        return [int(min(fb, j)) for fb in f]

    def bind_drafter(self, drafter) -> None:
        """A model-free drafter that estimates its drafts' acceptance (suffix decoding) is
        asked every step: its proposals cost microseconds and its estimates say where to
        draft, which the per-position record of a drafter that is rarely asked cannot."""
        self.confident = bool(self.costs.draft_free and drafter is not None and drafter.estimates_acceptance)

    def _trim_confident(self, requests, found: list[int], conf: list, parents: list | None = None) -> list[int]:
        """trim() for a drafter that estimates each draft's acceptance (suffix decoding's
        counts): draft i of row b is accepted, given the drafts before it were, with the
        calibrated probability of its estimate (the calibration learns from every verdict,
        starting from "the estimates are right"), and every row keeps up to j drafts for
        the j that maximises expected tokens per second of a pass over j + 1 tokens per
        row, j = 0 unless that beats plain decoding by min_gain. No probes: a row whose
        drafter is confident drafts, and its verdicts correct the calibration. Only the
        drafter's estimates and past verdicts enter, so the rule stays non-anticipating.

        A draft tree (parents: node i's parent, -1 the root, best-first) is priced the same
        way: a node is reached and accepted with its calibrated estimate times its parent's
        probability, the expected tokens of a kept prefix are 1 plus the sum over its nodes,
        and a node costs what one more token per row costs the pass (the measured cost of a
        pass by its token count): width and depth come out of the same choice of j."""
        B = len(found)
        J = min(max(found, default=0), self.max_k)
        states = [self._state(r) for r in requests]
        for s in states:
            s.probing = False
        if J == 0:
            return [0] * B
        f = np.minimum(np.asarray(found), J)
        reach = np.zeros((B, J))  # [B, J] P(node i of row b is reached and accepted)
        for b in range(B):
            c = list(conf[b])[: int(f[b])]
            if not c:
                continue
            a = self.calibrated(np.clip(c, 0.0, 1.0))
            par = None if parents is None else parents[b]
            for i, ai in enumerate(a):
                p = i - 1 if par is None else par[i]
                reach[b, i] = ai * (1.0 if p < 0 else reach[b, p])
        E = np.concatenate([np.ones((B, 1)), 1.0 + np.cumsum(reach, axis=1)], axis=1)  # [B, J+1]
        t_pass = self._pass_costs(B)[0][: J + 1]
        rate = E.sum(0) / t_pass
        j = int(np.argmax(rate))
        if rate[j] <= rate[0] * (1.0 + self.config.min_gain):
            j = 0
        kept = [int(min(fb, j)) for fb in f]
        for r, kb, c in zip(requests, kept, conf):
            if kb:  # observe() records them against the verdicts
                self._conf[r.request_id] = [float(x) for x in list(c)[:kb]]
        return kept

    def observe_tree(self, requests, parents, accepted) -> None:
        """A draft tree's verdict for the calibration: a node was tried when its parent was
        reached (the root always is) and kept when it lies on the accepted path."""
        for b, acc in accepted.items():
            rid = requests[b].request_id
            conf = self._conf.pop(rid, None)
            if not conf:
                continue
            on = set(acc)
            par = parents[b][:len(conf)]
            tried = [i for i, p in enumerate(par) if p < 0 or p in on]
            self.calibration.record([conf[i] for i in tried], np.array([float(i in on) for i in tried]))

    def observe(self, requests, k, accepted) -> None:
        """The step's outcome: k[b] the drafts asked of row b as the engine settled them
        (where halt() stopped the row, or what trim() kept of the drafts found: then never
        more than were drafted), accepted[b] how many of them the target accepted. A row
        with k[b] = 0 was idle (nothing asked, or trim() kept nothing); a row that drafted
        records positions 1..accepted[b] as accepted and the next one, if k[b] reached it,
        as rejected."""
        cfg = self.config
        self._emitted = (len(requests), sum(accepted) + len(requests))
        for r, kb, ab in zip(requests, k, accepted):
            st = self._state(r)
            if kb == 0:
                st.idle += 1
                continue
            self._version += 1
            st.edits += 1
            # conditional acceptance per position: positions 1..ab accepted, position
            # ab+1 rejected if ab < kb; later positions were not tried
            n = min(ab + (1 if ab < kb else 0), self.max_k)
            seen = np.zeros(n)
            seen[:ab] = 1.0
            st.s *= 1.0 - cfg.decay  # forget a little per step drafted
            st.n *= 1.0 - cfg.decay
            st.s[:n] += seen
            st.n[:n] += 1.0
            self.gs *= cfg.global_keep
            self.gn *= cfg.global_keep
            self.gs[:n] += seen
            self.gn[:n] += 1.0
            conf = self._conf.pop(r.request_id, None)
            if conf:  # the confidence calibration: drafts tried, accepted or not
                self.calibration.record(conf[:n], seen)
            if st.probing:
                st.probe_every = (cfg.min_probe if ab > 0
                                  else min(2 * st.probe_every, cfg.max_probe))
            st.idle = 0
        for r in requests:
            if r.finished:
                self.rows.pop(r.request_id, None)
