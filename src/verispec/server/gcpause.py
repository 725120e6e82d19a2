"""CPython's cyclic garbage collector, as the server sees it: every collection pauses
every thread that needs the GIL (the engine's step, the HTTP handlers), so its pauses are
the server's latency and are measured; and what start-up built is frozen out of them.

A full collection walks every object the collector tracks. After start-up those are
mostly torch's, the tokenizer's and the model's, alive for the whole process: about
370,000 objects when serving SmolLM2, and up to 186 ms a full collection over them on
this project's CPU machines.
freeze_startup_heap() moves them to the permanent generation, which collections skip,
as vLLM's freeze_gc_heap does after its server starts.
"""

from __future__ import annotations

import gc
import threading
import time
from collections import deque

GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class GCPauses:
    """A histogram of collection pauses by generation, fed by a gc callback.

    The callback takes no lock: a collection can start inside any locked section of any
    thread, this object's own reader included, and waiting on a lock there would deadlock.
    It appends (generation, seconds) to a deque, which is atomic, and readers fold the
    deque into the totals under a lock the callback never takes."""

    def __init__(self) -> None:
        self._started = 0.0
        self._pending: deque[tuple[int, float]] = deque(maxlen=100_000)
        self._lock = threading.Lock()
        self.clear()

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()  # collections never overlap: one slot is enough
        elif self._started:
            self._pending.append((info.get("generation", 2), time.perf_counter() - self._started))
            self._started = 0.0

    def clear(self) -> None:
        """Start counting afresh (the server calls this once, before it serves, so that its
        figures are the serving's and not the loading's)."""
        with self._lock:
            self._pending.clear()
            self._buckets = {g: [0] * len(GC_BUCKETS) for g in range(3)}
            self._count = dict.fromkeys(range(3), 0)
            self._sum = dict.fromkeys(range(3), 0.0)
            self._max = 0.0

    def snapshot(self) -> dict:
        """{"buckets": {gen: cumulative counts per GC_BUCKETS}, "count": {gen: n},
        "sum": {gen: seconds}, "max": the longest pause in seconds, "frozen": objects in the
        permanent generation}."""
        with self._lock:
            while self._pending:  # only readers pop, and they hold the lock
                g, s = self._pending.popleft()
                self._count[g] += 1
                self._sum[g] += s
                self._max = max(self._max, s)
                for i, le in enumerate(GC_BUCKETS):
                    if s <= le:
                        self._buckets[g][i] += 1
            return {"buckets": {g: list(b) for g, b in self._buckets.items()}, "count": dict(self._count),
                    "sum": dict(self._sum), "max": self._max, "frozen": gc.get_freeze_count()}


_pauses: GCPauses | None = None
_install_lock = threading.Lock()


def gc_pauses() -> GCPauses:
    """The process's one recorder, its callback installed on first use (the collector is
    the process's, so every server in the process shares it)."""
    global _pauses
    with _install_lock:
        if _pauses is None:
            _pauses = GCPauses()
            gc.callbacks.append(_pauses.callback)
        return _pauses


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage (freezing it would keep it forever), then
    move every object alive now to the permanent generation. Objects made later are
    tracked and collected as before. The pauses recorded so far were loading's, and are
    dropped. Returns the number of frozen objects."""
    gc.collect()
    gc.freeze()
    gc_pauses().clear()
    return gc.get_freeze_count()
