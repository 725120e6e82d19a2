"""The adaptive policy's cost model: what a target pass and a draft token cost on this
machine, measured once and kept on disk.

- CostModel: measured seconds of a target pass over B rows x T tokens per row (a grid,
  interpolated), and of a draft token when m rows draft.
- measure_costs(): times the grid (~1.5 s on SmolLM2 at batch 8, k = 8; the start-up tax
  the disk cache removes).
- CostCache / CostEntry: one JSON file per key under ``<cache>/costs/`` (``<cache>`` is
  ``$VERISPEC_CACHE``, default ``~/.cache/verispec``: models/presets.cache_dir()). The key
  is everything a timing depends on: the target's fingerprint (its weights and kernels;
  LlamaModel.fingerprint()), the drafter (kind, and a draft model's fingerprint, layer-skip's
  layer count, lookup's n-gram size), the kernels' backend, torch's version and thread
  count, the CPU model and core count, max_batch, k and the measurement's own settings.
  A file that is missing, unreadable, corrupt or written for another key reads as a miss
  (the grid is measured again and the file rewritten); writes go to a temporary file in
  the same folder, then os.replace(), so a reader sees the old entry or the new one whole.
- CostRefresher: the engine reports every step's measured times (observe_costs); when they
  drift from the entry beyond a tolerance, the entry is overwritten with the figures
  measured in the run (see its docstring), so the next start reads what this machine does
  now instead of timing it again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("verispec")

# bump when measure_costs() or the file layout changes: old entries then read as misses
COST_FORMAT = 2
MEASURE_CONTEXT = 160  # measure_costs(): tokens of cached context per row
MEASURE_REPEATS = 3  # measure_costs(): timings per shape (the median is kept)


def _interp(x, xs, ys):
    """Piecewise linear through (xs, ys); flat below the first point, linear beyond the last."""
    x = np.asarray(x, dtype=np.float64)
    xs, ys = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    y = np.interp(x, xs, ys)
    if len(xs) >= 2:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        y = np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), y)
    return y


def _isotonic(y, w) -> np.ndarray:
    """The non-decreasing sequence closest to y in weighted least squares (pool adjacent
    violators)."""
    vals, wts, cnt = [], [], []
    for yi, wi in zip(np.asarray(y, dtype=np.float64), np.asarray(w, dtype=np.float64)):
        vals.append(float(yi))
        wts.append(float(wi))
        cnt.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            v, wv, c = vals.pop(), wts.pop(), cnt.pop()
            vals[-1] = (vals[-1] * wts[-1] + v * wv) / (wts[-1] + wv)
            wts[-1] += wv
            cnt[-1] += c
    return np.repeat(vals, cnt)


@dataclass(frozen=True)
class CostModel:
    """Measured seconds.

    target_s[i][j]: one target forward over batch_pts[i] rows x token_pts[j] tokens per
    row (interpolated bilinearly between grid points, linearly beyond the last).
    draft_s[i]: the drafter's time per draft token when draft_rows[i] rows draft.
    """

    batch_pts: tuple[int, ...]
    token_pts: tuple[int, ...]
    target_s: tuple[tuple[float, ...], ...]  # [len(batch_pts)][len(token_pts)]
    draft_rows: tuple[int, ...]
    draft_s: tuple[float, ...]
    # a model-free drafter (prompt lookup): proposing costs ~nothing, so the policy asks
    # for max_k and settles the verified length per step from the drafts actually found
    draft_free: bool = False
    # the drafter takes a halt rule (drafters/__init__.py): the policy then sets a cap on
    # drafts and stops each row on the drafter's confidence in what it has drafted
    halts: bool = False

    def __post_init__(self):
        if len(self.target_s) != len(self.batch_pts) or any(len(r) != len(self.token_pts) for r in self.target_s):
            raise ValueError("target_s must be a len(batch_pts) x len(token_pts) grid")
        if len(self.draft_rows) != len(self.draft_s):
            raise ValueError("draft_rows and draft_s differ in length")

    @classmethod
    def from_total_tokens(cls, rows, secs, draft_rows, draft_s, *, max_batch: int = 64,
                          max_tokens: int = 17, draft_free: bool = False, halts: bool = False) -> "CostModel":
        """A synthetic model whose pass costs f(B * T), f piecewise linear through (rows, secs)."""
        bp, tp = tuple(range(1, max_batch + 1)), tuple(range(1, max_tokens + 1))
        grid = tuple(tuple(float(_interp(b * t, rows, secs)) for t in tp) for b in bp)
        return cls(bp, tp, grid, tuple(draft_rows), tuple(draft_s), draft_free=draft_free, halts=halts)

    def target(self, B: int, T):
        """Seconds of one target pass over B rows x T tokens (T: a number or an array)."""
        per_b = np.stack([_interp(T, self.token_pts, row) for row in self.target_s])  # [nB, *T]
        xs = np.asarray(self.batch_pts, dtype=np.float64)
        if len(xs) == 1:
            return per_b[0]
        x = max(float(B), xs[0])
        i = int(np.clip(np.searchsorted(xs, x) - 1, 0, len(xs) - 2))
        w = (x - xs[i]) / (xs[i + 1] - xs[i])
        return per_b[i] * (1.0 - w) + per_b[i + 1] * w

    def draft(self, rows):
        return np.where(np.asarray(rows) > 0, _interp(rows, self.draft_rows, self.draft_s), 0.0)

    def to_dict(self) -> dict:
        return {"batch_pts": list(self.batch_pts), "token_pts": list(self.token_pts),
                "target_s": [list(r) for r in self.target_s], "draft_rows": list(self.draft_rows),
                "draft_s": list(self.draft_s), "draft_free": self.draft_free, "halts": self.halts}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """The inverse of to_dict(); raises ValueError (or TypeError, KeyError) on anything a
        measurement cannot have produced: grid points not strictly increasing positive
        integers, times not finite and positive."""
        bp, tp, dr = (tuple(int(v) for v in d[n]) for n in ("batch_pts", "token_pts", "draft_rows"))
        for pts, raw in ((bp, d["batch_pts"]), (tp, d["token_pts"]), (dr, d["draft_rows"])):
            if not pts or list(pts) != list(raw) or pts[0] < 1 or any(b <= a for a, b in zip(pts, pts[1:])):
                raise ValueError("grid points must be strictly increasing positive integers")
        grid = tuple(tuple(float(t) for t in row) for row in d["target_s"])
        ds = tuple(float(t) for t in d["draft_s"])
        if not all(math.isfinite(t) and t > 0 for t in (*ds, *(t for row in grid for t in row))):
            raise ValueError("times must be finite and positive")
        if not isinstance(d["draft_free"], bool) or not isinstance(d["halts"], bool):
            raise ValueError("draft_free and halts must be booleans")
        return cls(bp, tp, grid, dr, ds, draft_free=d["draft_free"], halts=d["halts"])


def _batch_points(max_batch: int) -> list[int]:
    return sorted({1, 2, 4, 8, 16, 32, 64, 128} & set(range(1, max_batch + 1)) | {max_batch})


def _token_points(max_k: int) -> list[int]:
    return sorted({1, 2, 3, 5, 9, 17} & set(range(1, max_k + 2)) | {max_k + 1})


def measure_costs(target, drafter, max_batch: int, max_k: int, context: int = MEASURE_CONTEXT,
                  repeats: int = MEASURE_REPEATS) -> CostModel:
    """Time the target on B rows x T tokens over a grid up to (max_batch, max_k + 1),
    each row on a cached context, and the drafter on 1..max_batch rows. The grid is
    timed round-robin (a burst of load on a shared machine hits every shape alike);
    the median of `repeats` is kept."""
    from ..sampling import SamplingParams

    V = target.config.vocab_size
    bps, tps = _batch_points(max_batch), _token_points(max_k)
    cache = target.new_cache(max_batch, context + max_k + 1)
    rows = cache.alloc(max_batch)
    target.forward(torch.randint(0, V, (max_batch, context)), cache, rows, last_only=True)

    def target_pass(B, T, **kw):
        def f():
            target.forward(torch.randint(0, V, (B, T)), cache, rows[:B], **kw)
            cache.truncate(rows[:B], [context] * B)
        return f

    def timed_grid(fns):
        for f in fns:  # warm-up
            f()
        ts = [[] for _ in fns]
        for _ in range(repeats):
            for i, f in enumerate(fns):
                t = time.perf_counter()
                f()
                ts[i].append(time.perf_counter() - t)
        return [float(np.median(x)) for x in ts]

    shapes = [(b, t) for b in bps for t in tps]
    flat = timed_grid([target_pass(b, t) for b, t in shapes])
    # a non-decreasing fit over tokens per row: a wider pass never costs less, so a wider
    # shape timed cheaper is the machine's noise, and read raw it would price drafts below
    # their cost (the policy fits what it measures later the same way)
    grid = tuple(tuple(float(v) for v in _isotonic(flat[i * len(tps):(i + 1) * len(tps)], np.ones(len(tps))))
                 for i in range(len(bps)))
    d_pts = sorted({1, 2, 4, 8, 16, 32, max_batch} & set(range(1, max_batch + 1)))
    if drafter.draft_model is not None:  # a model of its own: one-token passes of it
        dm = drafter.draft_model
        dc = dm.new_cache(max(d_pts), context + 1)
        drows = dc.alloc(max(d_pts))
        dm.forward(torch.randint(0, V, (len(drows), context)).clamp(max=dm.config.vocab_size - 1), dc, drows)

        def dfwd(m):
            def f():
                dm.forward(torch.zeros(m, 1, dtype=torch.long), dc, drows[:m], last_only=True)
                dc.truncate(drows[:m], [context] * m)
            return f
        d_s = timed_grid([dfwd(m) for m in d_pts])
    elif drafter.draft_layers is not None:  # the target's first layers: partial one-token passes
        d_s = timed_grid([target_pass(m, 1, last_only=True, num_layers=drafter.draft_layers) for m in d_pts])
    else:  # model-free drafters (prompt lookup): one propose call for k = max_k, per token
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, V, (context + 192,), generator=g).tolist() for _ in range(max(d_pts))]
        greedy = SamplingParams()

        def prop(m):
            return lambda: drafter.propose(list(range(m)), seqs[:m], [max_k] * m, [greedy] * m, [None] * m)
        d_s = [t / max_k for t in timed_grid([prop(m) for m in d_pts])]
    free = drafter.draft_model is None and drafter.draft_layers is None
    return CostModel(tuple(bps), tuple(tps), grid, tuple(d_pts), tuple(d_s), draft_free=free,
                     halts=drafter.halts)


# -- the disk cache ---------------------------------------------------------------------

def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.split(":", 1)[0].strip() in ("model name", "Model", "Hardware"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def drafter_identity(drafter) -> dict:
    """What a drafter's timing depends on (Drafter.identity): its kind, and a draft model's
    fingerprint, layer-skip's layer count or lookup's n-gram size."""
    return drafter.identity()


def cost_key(target, drafter, max_batch: int, max_k: int) -> dict:
    """Everything measure_costs(target, drafter, max_batch, max_k) depends on (JSON-able)."""
    return {
        "format": COST_FORMAT,
        "target": target.fingerprint(),
        "backend": target.backend,
        "drafter": drafter_identity(drafter),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "max_batch": int(max_batch),
        "k": int(max_k),
        "measure": {"context": MEASURE_CONTEXT, "repeats": MEASURE_REPEATS},
    }


@dataclass(frozen=True)
class CostEntry:
    """One cost model's file: `path`, holding the model measured under `key`."""

    path: Path
    key: dict = field(compare=False)

    def load(self) -> CostModel | None:
        """The cached model, or None where the file is missing, unreadable, corrupt, of
        another format or written for another key (a hash collision, a hand-edited file)."""
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
            if doc.get("format") != COST_FORMAT or doc.get("key") != self.key:
                return None
            return CostModel.from_dict(doc["costs"])
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None

    def save(self, costs: CostModel, source: str) -> bool:
        """Write the entry atomically (a temporary file in the same folder, then
        os.replace()). source: "measured" (timed at start-up) or "refreshed" (the figures
        measured while decoding). A failed write (read-only or full disk) is logged, not
        raised: the next start measures again. Returns whether it was written."""
        doc = {"format": COST_FORMAT, "key": self.key, "source": source,
               "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "costs": costs.to_dict()}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
            os.replace(tmp, self.path)
            return True
        except OSError as e:
            log.warning("could not write the cost model cache %s: %s", self.path, e)
            try:
                tmp.unlink()
            except OSError:
                pass
            return False


@dataclass(frozen=True)
class CostCache:
    """Measured cost models on disk under `root`, one JSON file per key (see cost_key)."""

    root: Path

    @classmethod
    def default(cls) -> "CostCache":
        """``<cache>/costs``, <cache> being the models' cache (models/presets.cache_dir())."""
        from ..models.presets import cache_dir
        return cls(cache_dir() / "costs")

    def entry(self, target, drafter, max_batch: int, max_k: int) -> CostEntry:
        key = cost_key(target, drafter, max_batch, max_k)
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return CostEntry(Path(self.root) / f"{name}.json", key)


def cached_costs(target, drafter, max_batch: int, max_k: int,
                 cache: CostCache | None) -> tuple[CostModel, CostEntry | None]:
    """The cost model for (target, drafter, max_batch, max_k): read from `cache` where it
    holds one, else measured now (and written there). cache None: always measured."""
    if cache is None:
        return measure_costs(target, drafter, max_batch, max_k), None
    entry = cache.entry(target, drafter, max_batch, max_k)
    costs = entry.load()
    if costs is None:
        costs = measure_costs(target, drafter, max_batch, max_k)
        entry.save(costs, "measured")
    return costs, entry


class CostRefresher:
    """Keeps a cache entry in step with the step times the engine measures.

    The policy reports each step's measured time next to the time the entry's model gives
    for that step, per kind: "plain" (one-token passes), "wide" (passes over more tokens
    per row) and "draft" (draft tokens). Per kind, forgotten sums of both (kept `keep` per
    step of the kind: about 1 / (1 - keep) steps' memory) give a pooled ratio, measured over
    modelled:
    pooled, because single steps on a shared machine swing far more than a tolerance worth
    acting on. When a kind has `min_steps` steps' worth of record and its ratio departs from
    the one last written by more than a factor 1 +- tolerance, the entry is overwritten
    with the model rescaled by every kind's ratio, and with the pass times measured at the
    grid's own shapes pooled in (the policy's pass_seen, the same pooling as its
    _pass_costs). A failed write counts as written (the next try is min_steps steps away).
    Re-measuring instead would cost a start-up grid (seconds) in the middle of decoding,
    timed under whatever load made the figures drift.

    The model the running policy plans with is never swapped (its own running ratios
    already correct it): only the next start reads the refreshed figures. A machine whose
    load comes and goes rewrites the entry now and then (at most once per min_steps steps);
    each rewrite holds the latest figures this machine measured. A ratio that is off for
    good (the workload's contexts are longer than the measurement's) is written once, and
    the next start then matches it.
    """

    KINDS = ("plain", "wide", "draft")

    def __init__(self, entry: CostEntry, tolerance: float, min_steps: int, keep: float,
                 max_swing: float):
        self.entry = entry
        self.tolerance, self.min_steps, self.keep, self.max_swing = tolerance, min_steps, keep, max_swing
        self.sums = {k: [0.0, 0.0, 0.0] for k in self.KINDS}  # kind -> [measured s, modelled s, steps]
        self.written = {k: 1.0 for k in self.KINDS}  # the ratios the entry holds, relative to the model
        self.steps_since_write = 0
        self.refreshes = 0  # entries written

    def ratio(self, kind: str) -> float | None:
        measured, modelled, n = self.sums[kind]
        return measured / modelled if n > 0 and modelled > 0 else None

    def observe(self, pass_kind: str, pass_s: float, model_pass_s: float,
                draft_s: float | None = None, model_draft_s: float | None = None) -> None:
        """One step: its target pass ("plain" or "wide") measured at pass_s where the model
        says model_pass_s; and where it drafted (and the drafter's times are comparable),
        its drafting measured at draft_s where the model says model_draft_s."""
        self.steps_since_write += 1
        self._add(pass_kind, pass_s, model_pass_s)
        if draft_s is not None:
            self._add("draft", draft_s, model_draft_s)

    def _add(self, kind: str, measured_s: float, modelled_s: float) -> None:
        # a kind's sums are forgotten only by its own steps: a run that rarely drafts keeps
        # its few draft timings
        if not (math.isfinite(measured_s) and measured_s > 0 and math.isfinite(modelled_s) and modelled_s > 0):
            return
        measured_s = min(max(measured_s, modelled_s / self.max_swing), modelled_s * self.max_swing)
        s = self.sums[kind]
        s[0] = self.keep * s[0] + measured_s
        s[1] = self.keep * s[1] + modelled_s
        s[2] = self.keep * s[2] + 1.0

    def due(self) -> bool:
        """Whether the entry should be rewritten: min_steps steps since the last write, and a
        kind with min_steps steps' worth of record whose pooled ratio drifted from the one
        written beyond the tolerance."""
        if self.steps_since_write < self.min_steps:
            return False
        for kind in self.KINDS:
            r = self.ratio(kind)
            if r is not None and self.sums[kind][2] >= self.min_steps and \
                    abs(math.log(r / self.written[kind])) > math.log1p(self.tolerance):
                return True
        return False

    def refreshed(self, costs: CostModel, pass_seen: dict) -> CostModel:
        """`costs` rescaled by the pooled ratios (a kind without record keeps the ratio last
        written), with pass_seen's measurements (batch size -> (forgotten seconds [K+1],
        forgotten counts [K+1]) per tokens per row 1..K+1) pooled in at the grid's shapes."""
        r = {k: (self.ratio(k) if self.sums[k][2] > 0 else None) for k in self.KINDS}
        r = {k: (v if v is not None else self.written[k]) for k, v in r.items()}
        rows = []
        for b, row in zip(costs.batch_pts, costs.target_s):
            t = np.array([s * (r["plain"] if T == 1 else r["wide"]) for T, s in zip(costs.token_pts, row)])
            w = np.ones(len(t))
            seen = pass_seen.get(b)
            if seen is not None:
                secs, n = seen
                for j, T in enumerate(costs.token_pts):
                    if T - 1 < len(n) and n[T - 1] > 0:
                        t[j] = (t[j] + secs[T - 1]) / (1.0 + n[T - 1])
                        w[j] = 1.0 + n[T - 1]
            rows.append(tuple(float(v) for v in _isotonic(t, w)))
        return CostModel(costs.batch_pts, costs.token_pts, tuple(rows), costs.draft_rows,
                         tuple(float(s) * r["draft"] for s in costs.draft_s),
                         draft_free=costs.draft_free, halts=costs.halts)

    def refresh(self, costs: CostModel, pass_seen: dict) -> None:
        """Overwrite the entry with refreshed(costs, pass_seen); the ratios written become
        the reference for the next drift."""
        if self.entry.save(self.refreshed(costs, pass_seen), "refreshed"):
            self.refreshes += 1
        for k in self.KINDS:
            if self.sums[k][2] > 0:
                self.written[k] = self.ratio(k)
        self.steps_since_write = 0
