"""The bridge between asyncio and the engine: one thread owns the Engine and steps it.

    event loop                                 engine thread
    ----------                                 -------------
    worker.try_submit(handle) --("add")-->     engine.add(req)
    worker.cancel(handle)     --("cancel")-->  engine.cancel(req)      (frees the row)
                                               engine.step()  ... one step for all rows
    handle._on_step(ids, ...) <--call_soon_threadsafe-- new tokens of every row, per step

Commands go through a thread-safe FIFO and are applied between steps, so requests
join and leave the running batch between steps. Only the engine thread touches the
Engine. Text (detokenization, stop strings) is made on the event loop by the handle.

A row the engine ends with finish_reason "error" (its step failed: non-finite logits,
an exception while drafting or verifying that row) reaches its handle as a 500 with
the engine's message; the other rows go on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..engine import Request
from ..policy import PolicyWrapper
from .metrics import Metrics
from .protocol import same_rule
from .text import IncrementalDecoder, StopStrings

log = logging.getLogger("verispec.server")


@dataclass
class ServerRequest(Request):
    """An engine request with the server's per-request speculation switch."""

    speculate: bool = True


class PerRequestPolicy(PolicyWrapper):
    """Wraps the served engine's policy (same max_k, so the same cache slack): rows whose
    request turned speculation off draft k = 0. Its requests are ServerRequests."""

    def choose(self, requests: list[ServerRequest]) -> list[int]:
        ks = self.inner.choose(requests)
        return [k if r.speculate else 0 for k, r in zip(ks, requests)]


@dataclass
class StepStats:
    """What the HTTP side reports about a request's speculation (snapshot per step)."""

    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0
    generated: int = 0

    def to_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "target_passes": self.target_passes,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
                "mean_accepted_length": self.generated / self.target_passes if self.target_passes else None}


class RequestHandle:
    """The event-loop side of one request. Receives token ids per step; makes text.

    Events on `events`: ("text", str) as text becomes final, then exactly one
    ("end", finish_reason) where finish_reason is "stop", "length", "cancelled" or
    "error" (then `error` holds (http status, message, error code)).

    `rule` is the verification rule the server resolved for the request; the worker
    refuses the request if the engine would verify it with another one.
    """

    def __init__(self, req: ServerRequest, tokenizer, stops: list[str], loop: asyncio.AbstractEventLoop,
                 rule: str | None = None):
        self.req = req
        self.loop = loop
        self.rule = rule
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = StopStrings(stops)
        self.events: asyncio.Queue = asyncio.Queue()
        self.finish_reason: str | None = None
        self.error: tuple[int, str, str] | None = None
        self.completion_tokens = 0
        self.token_ids: list[int] = []  # every token emitted (logprobs are scored over them)
        self.stats = StepStats()
        self.worker: EngineWorker | None = None
        self._engine_done = False  # the engine has let go of the request, or was told to
        self._done = asyncio.Event()

    @property
    def text(self) -> str:
        return self.stops.text

    def _end(self, reason: str) -> None:
        self.finish_reason = reason
        self.events.put_nowait(("end", reason))
        self._done.set()

    async def wait(self) -> str:
        await self._done.wait()
        return self.finish_reason

    def cancel(self) -> None:
        """The client went away (or the answer is complete): free the row. Idempotent."""
        if self.finish_reason is None:
            self._end("cancelled")
        self._release_row("cancelled")

    def _release_row(self, reason: str) -> None:
        if not self._engine_done and self.worker is not None:
            self._engine_done = True
            self.worker.cancel(self, reason)

    # called on the event loop by the engine thread, via call_soon_threadsafe
    def _on_step(self, ids: list[int], engine_reason: str | None, stats: StepStats,
                 error: tuple[int, str, str] | None) -> None:
        if engine_reason is not None or error is not None:
            self._engine_done = True
        if self.finish_reason is not None:
            return  # already ended here (stop string, disconnect): late tokens are dropped
        if error is not None:
            self.error = error
            self._end("error")
            return
        self.completion_tokens += len(ids)
        self.token_ids += ids
        self.stats = stats
        final = engine_reason is not None
        delta = self.decoder.add(ids) + (self.decoder.flush() if final else "")
        out, hit = self.stops.feed(delta, final=final)
        if out:
            self.events.put_nowait(("text", out))
        if hit:
            self._end("stop")
            self._release_row("stop")  # the row may still be running: free it
        elif final:
            self._end(engine_reason)


@dataclass
class _Entry:
    handle: RequestHandle
    sent: int = 0  # output tokens already delivered
    seen: StepStats = field(default_factory=StepStats)  # stats already counted in metrics


class EngineWorker:
    """Owns the Engine on one thread. Capacity = running rows + max_queue waiting."""

    def __init__(self, engine, metrics: Metrics, max_queue: int):
        self.engine = engine
        self.metrics = metrics
        self.capacity = engine.config.max_batch + max_queue
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._outstanding = 0  # submitted and not yet out of the engine (guarded by _lock)
        self._active: dict[int, _Entry] = {}  # engine thread only
        self._thread: threading.Thread | None = None

    # -- called from the event loop ----------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._cmds.put(("stop", None))
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def try_submit(self, handle: RequestHandle) -> bool:
        """Queue a request; False (answer 429) when running + waiting is at capacity."""
        with self._lock:
            if self._outstanding >= self.capacity:
                return False
            self._outstanding += 1
        handle.worker = self
        self._cmds.put(("add", handle))
        return True

    def cancel(self, handle: RequestHandle, reason: str = "cancelled") -> None:
        """Take a request out of the engine; reason is what /metrics counts ("stop": a stop string)."""
        self._cmds.put(("cancel", handle, reason))

    def fail_all(self, error: tuple[int, str, str]) -> None:
        """Fail every request the engine holds or will be handed before this (a drain that
        ran out of time); the thread keeps running."""
        self._cmds.put(("fail", error))

    # -- the engine thread ---------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if self._iterate():
                    return
            except Exception:  # noqa: BLE001 - the thread must outlive any one failure
                log.exception("engine worker error; failing the requests it holds")
                self._abort((500, "internal error in the engine worker; the request was cancelled",
                             "engine_error"))

    def _iterate(self) -> bool:
        """Apply pending commands, then run one step. True when told to stop."""
        eng = self.engine
        try:  # block only while idle; between steps take whatever arrived
            cmd = self._cmds.get(timeout=1.0) if not eng.has_work else self._cmds.get_nowait()
        except queue.Empty:
            cmd = None
        while cmd is not None:
            if cmd[0] == "stop":
                self._abort((503, "server shutting down: the request was cancelled", "server_shutting_down"))
                return True
            if cmd[0] == "fail":
                self._abort(cmd[1])
            else:
                self._apply(*cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                cmd = None
        if eng.has_work:
            self._step()
        self._publish_gauges()
        return False

    def _apply(self, op: str, handle: RequestHandle, reason: str = "cancelled") -> None:
        req = handle.req
        if op == "add":
            try:
                self.engine.add(req)
            except ValueError as e:  # ContextLengthError and friends; checked before, kept as a guard
                self._deliver([(handle, [], None, StepStats(), (400, str(e), "invalid_value"))])
                self._release()
                return
            self._active[id(req)] = _Entry(handle)
            actual = self.engine.rule_for(req)
            if handle.rule is not None and not same_rule(handle.rule, actual, req.speculate):
                # never serve a request with a rule other than the one it is told it gets
                log.error("request %s: the server resolved rule %r but the engine would verify it "
                          "with %r; refused", req.request_id, handle.rule, actual)
                self.engine.cancel(req)
                self._leave(self._active[id(req)], "error")
                self._deliver([(handle, [], None, StepStats(), (
                    500, f"internal error: this request resolved to verification rule {handle.rule!r} "
                         f"but the engine would verify it with {actual!r}; refused rather than served "
                         f"with another rule", "rule_mismatch"))])
        elif op == "cancel":
            entry = self._active.get(id(req))
            if entry is not None:
                self.engine.cancel(req)
                self._leave(entry, reason)

    def _step(self) -> None:
        eng = self.engine
        t0 = time.perf_counter()
        rows = len(eng.running) + min(len(eng.waiting), eng.config.max_batch - len(eng.running))
        try:
            eng.step()
        except Exception:  # a bug or a broken model: fail this batch, keep serving the queue
            log.exception("engine step failed; cancelling the requests in the batch")
            waiting = {id(r) for r in eng.waiting}
            self._abort((500, "internal error in the engine step; the request was cancelled", "engine_error"),
                        keep=lambda r: id(r) in waiting)
            return
        self.metrics.step(time.perf_counter() - t0, rows)
        out = []
        for entry in list(self._active.values()):
            r = entry.handle.req
            n = len(r.output_ids)
            if n == entry.sent and not r.finished:
                continue
            s = r.stats
            stats = StepStats(s.drafted, s.accepted, s.target_passes, n)
            seen = entry.seen
            self.metrics.tokens(n - entry.sent, stats.target_passes - seen.target_passes,
                                sum(1 for k in s.k_chosen[seen.target_passes:] if k > 0),
                                stats.drafted - seen.drafted, stats.accepted - seen.accepted)
            error = None
            if r.finished and r.finish_reason == "error":  # this row's step failed; the others go on
                why = r.error or "the engine step failed for this request"
                log.warning("request %s failed: %s", r.request_id, why)
                error = (500, why, "generation_failed")
            out.append((entry.handle, r.output_ids[entry.sent:n], r.finish_reason if r.finished else None,
                        stats, error))
            entry.sent, entry.seen = n, stats
            if r.finished:
                self._leave(entry, r.finish_reason)
        self._deliver(out)

    def _leave(self, entry: _Entry, reason: str) -> None:
        """A request is out of the engine (finished or cancelled): its row is free."""
        r = entry.handle.req
        del self._active[id(r)]
        self.metrics.request_end(reason, len(r.prompt_ids), r.stats.drafted_per_position,
                                 r.stats.accepted_per_position)
        self._release()

    def _release(self) -> None:
        with self._lock:
            self._outstanding -= 1

    def _abort(self, error: tuple[int, str, str], keep=lambda r: False) -> None:
        """Fail and evict every active request but those `keep` spares (still waiting)."""
        out = []
        for entry in list(self._active.values()):
            r = entry.handle.req
            if keep(r):
                continue
            try:
                self._evict(r)
            except Exception:  # noqa: BLE001 - keep freeing the others
                log.exception("could not free the row of %s", r.request_id)
            self._leave(entry, "error")
            out.append((entry.handle, [], None, StepStats(), error))
        self._deliver(out)
        self._publish_gauges()

    def _evict(self, r) -> None:
        """engine.cancel, plus the case it cannot see: a failure inside admission leaves a
        request holding a row while in neither the waiting queue nor the running batch."""
        eng = self.engine
        limbo = r not in eng.waiting and r not in eng.running
        eng.cancel(r)
        if limbo and r.row is not None and bool(eng.cache.in_use[r.row]):
            eng.cache.free([r.row])
            if eng.drafter is not None:
                eng.drafter.release([r.row])

    def _publish_gauges(self) -> None:
        eng = self.engine
        with self._lock:
            outstanding = self._outstanding
        self.metrics.gauges(queue_depth=max(0, outstanding - len(eng.running)), running=len(eng.running),
                            rows_in_use=eng.cache.rows_in_use,
                            drafter_cache=None if eng.drafter is None else eng.drafter.cache_stats())

    def _deliver(self, items: list) -> None:
        by_loop: dict = {}
        for item in items:
            by_loop.setdefault(item[0].loop, []).append(item)
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_dispatch, batch)
            except RuntimeError:  # the event loop is closed (shutdown): nobody is listening
                pass


def _dispatch(batch: list) -> None:
    for handle, ids, reason, stats, error in batch:
        handle._on_step(ids, reason, stats, error)
