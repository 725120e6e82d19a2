"""Row churn for the audit's runs: requests that arrive while others decode and ask for
different lengths, so the engine's row bookkeeping is exercised as a server's is.

A batch whose requests all arrive at once and share one length never reaches that
bookkeeping: at a batch size >= the number of requests no row is ever taken twice, and
below it a freed row is taken again at the very next step (the queue waits) or never
(the queue is empty). Faults in what a row carries from one request to the next (state
cleared lazily, per-row buffers updated by diffing one step's batch against the last)
show only when a row sits free while other rows decode and is then taken by a request
that arrives later, at another length. The schedule here makes that happen at every
batch size:

* mixed lengths: request i asks for FRACTIONS[i % 3] of the configured max_new_tokens
  (whole, whole, a third; never below 2). They are a property of the prompt, so a
  comparison's plain reference takes the same lengths (`mixed_lengths`) and outputs stay
  comparable token for token;
* staggered arrivals: the requests, in a seeded order, arrive in waves of
  min(batch, ceil(n / 2)), wave j from step j * L // 2 on (L the longest length), each
  request a seeded 0..L // 6 steps after its wave's start. Within a wave the short requests
  end first and leave gaps between rows still decoding; the next wave takes the rows that
  sat free. A shortest request joins the first wave at step 0, handed over second so that
  it takes row 1 and its end leaves a gap between rows 0 and 2 still decoding: it ends within as many steps as it asks tokens (a step emits at least one), so when it asks
  at most L // 2 (mixed_lengths' third does) and there are two requests or more, the second
  wave arrives after it ended and takes a row used before, at any batch size.

`run_churned` runs a list of requests on an engine this way and returns what the engine
counted (engine/core.py RowChurn): rows reused, rows reused after sitting free, steps with
a free row between running rows, steps mixing sequence lengths.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# of the configured max_new_tokens, request by request: two in three keep it whole, so a
# fault that shows only late in a sequence keeps its chances (a draft model's missed
# catch-up surfaced past token 18 of 24 in the tiny audit); one in three ends early, so
# rows are freed while the others decode
FRACTIONS = (1.0, 1.0, 1 / 3)


def mixed_lengths(n: int, max_new: int) -> list[int]:
    """max_new_tokens of requests 0..n-1: FRACTIONS of max_new in turn, at least 2 (and at
    most max_new: a max_new below 2 stays as it is)."""
    return [min(max_new, max(2, round(max_new * FRACTIONS[i % len(FRACTIONS)]))) for i in range(n)]


@dataclass(frozen=True)
class Schedule:
    """In what order, and at which step of the run, the requests are added."""

    order: list[int]  # request indices in the order they are handed to the engine
    arrivals: list[int]  # arrival step of each request, by request index


def schedule(lengths: list[int], batch: int, seed: int | str) -> Schedule:
    """Staggered arrivals for requests of these max_new_tokens on `batch` rows, seeded (see
    the module docstring)."""
    rng = random.Random(seed)
    n, L = len(lengths), max(lengths, default=0)
    size = max(1, min(batch, math.ceil(n / 2)))
    spacing, jitter = max(1, L // 2), L // 6
    order = rng.sample(range(n), n)
    if n:
        # the shortest request is handed over second, so it takes row 1 and frees it while
        # rows 0 and 2 still decode: a gap in the running rows even in a batch of one wave
        first = min(order, key=lambda i: lengths[i])
        order.remove(first)
        order.insert(min(1, len(order)), first)
    arrivals = [0] * n
    for j, i in enumerate(order[2:], start=2):
        arrivals[i] = (j // size) * spacing + rng.randint(0, jitter)
    order.sort(key=lambda i: arrivals[i])  # stable: ties keep the seeded order
    return Schedule(order, arrivals)


def counted(engine) -> dict:
    """The engine's churn counters and step count now (subtract two to get a run's)."""
    return {**engine.churn.counts(), "steps": engine.times.steps}


def since(engine, before: dict, **labels) -> dict:
    """The churn of what the engine did since counted() gave `before`, as the report shows
    a run's: the caller's labels, the engine's max_batch as "batch", "steps" and the
    engine's counts (RowChurn.counts)."""
    now = counted(engine)
    return {**labels, "batch": engine.config.max_batch, **{k: now[k] - before[k] for k in now}}


def run_churned(engine, requests: list, seed: int | str, on_finish=None, **labels) -> dict:
    """Decode requests on engine with staggered arrivals (their own max_new_tokens are the
    lengths; mixed_lengths makes them mixed) -> this run's churn: as since() gives it, plus
    "requests" and "arrival_span", the last arrival step."""
    plan = schedule([r.params.max_new_tokens for r in requests], engine.config.max_batch, seed)
    before = counted(engine)
    engine.run([requests[i] for i in plan.order], on_finish, [plan.arrivals[i] for i in plan.order])
    return {**since(engine, before, **labels), "requests": len(requests),
            "arrival_span": max(plan.arrivals, default=0)}


def note(run: dict) -> str:
    """What a run's churn did not reach, in words ('' when it reused rows and had gaps)."""
    missing = [] if run.get("reused_rows") else ["NO row reused"]
    if not run.get("gapped_steps"):
        missing.append("no gapped step (one row: none possible)" if run["batch"] == 1 else "NO gapped step")
    return ", ".join(missing)


def shortfalls(runs: list[dict]) -> list[str]:
    """The runs that reused no row, or had no gap at a batch size that allows one, in words:
    the report says so rather than pass in silence."""
    out = []
    for r in runs:
        missing = [] if r.get("reused_rows") else ["no row reused"]
        if r["batch"] > 1 and not r.get("gapped_steps"):
            missing.append("no gapped step")
        if missing:
            out.append(f"b={r['batch']}" + (f" ({r['policy']})" if r.get("policy") else "") + ": " + ", ".join(missing))
    return out
