"""Server metrics, exposed in the Prometheus text format by prometheus_client.

Counters and the step histogram are written by the engine thread and the HTTP
middleware and read by /metrics; one lock guards them all, and a custom collector
turns one consistent snapshot of them into metric families (a registry per server,
never the process-global one, so several servers in one process do not mix).
Speculative-decoding counters follow vLLM's names with a ``verispec_`` prefix, so a
dashboard or the endpoint audit reads verispec, vLLM, SGLang and llama.cpp the same way.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .gcpause import GC_BUCKETS, gc_pauses

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


class Metrics:
    def __init__(self, model_name: str, info: dict):
        self.model_name = model_name
        self.info = info  # constant labels of verispec_info: drafter, k, rule, lossy
        self.lock = threading.Lock()
        self.http = defaultdict(int)  # (endpoint, status) -> count
        self.finished = defaultdict(int)  # finish reason -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.target_passes = 0  # verification (or plain) forward passes, summed over rows
        self.num_drafts = 0  # (request, step) pairs that drafted at least one token
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.drafted_per_pos: list[int] = []
        self.accepted_per_pos: list[int] = []
        self.steps = 0
        self.step_sum = 0.0
        self.step_buckets = [0] * len(STEP_BUCKETS)
        self.step_rows_sum = 0
        self.queue_depth = 0
        self.running = 0
        self.rows_in_use = 0
        self.drafter_cache: dict | None = None  # the drafter's shared cache (suffix decoding), if any
        self.gc = gc_pauses()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    # -- writers -----------------------------------------------------------------
    def http_response(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.http[(endpoint, status)] += 1

    def step(self, seconds: float, rows: int) -> None:
        with self.lock:
            self.steps += 1
            self.step_sum += seconds
            self.step_rows_sum += rows
            for i, le in enumerate(STEP_BUCKETS):
                if seconds <= le:
                    self.step_buckets[i] += 1

    def tokens(self, generated: int, passes: int, drafts: int, drafted: int, accepted: int) -> None:
        with self.lock:
            self.generation_tokens += generated
            self.target_passes += passes
            self.num_drafts += drafts
            self.draft_tokens += drafted
            self.accepted_tokens += accepted

    def request_end(self, reason: str, prompt_tokens: int, drafted_per_pos: list[int],
                    accepted_per_pos: list[int]) -> None:
        with self.lock:
            self.finished[reason] += 1
            self.prompt_tokens += prompt_tokens
            for total, add in ((self.drafted_per_pos, drafted_per_pos),
                               (self.accepted_per_pos, accepted_per_pos)):
                if len(total) < len(add):
                    total.extend([0] * (len(add) - len(total)))
                for i, n in enumerate(add):
                    total[i] += n

    def gauges(self, queue_depth: int, running: int, rows_in_use: int, drafter_cache: dict | None = None) -> None:
        with self.lock:
            self.queue_depth, self.running, self.rows_in_use = queue_depth, running, rows_in_use
            self.drafter_cache = drafter_cache

    # -- reader ------------------------------------------------------------------
    def snapshot(self) -> dict:
        with self.lock:
            return {
                "generation_tokens": self.generation_tokens, "prompt_tokens": self.prompt_tokens,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "target_passes": self.target_passes, "queue_depth": self.queue_depth,
                "running": self.running, "rows_in_use": self.rows_in_use,
                "finished": dict(self.finished), "http": dict(self.http),
            }

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4: CONTENT_TYPE)."""
        return generate_latest(self.registry).decode("utf-8")

    def families(self) -> list:
        """All metric families from one locked read of the counters."""
        with self.lock:
            return self._families_locked()

    def _families_locked(self) -> list:
        """The families in the order /metrics lists them: traffic, speculation, occupancy,
        engine steps, garbage-collector pauses."""
        out = _Families(self.model_name)
        self._traffic(out)
        self._speculation(out)
        self._occupancy(out)
        self._steps(out)
        self._gc_pauses(out)
        return out.families

    def _traffic(self, out: _Families) -> None:
        out.gauge("verispec_info", "Server configuration (constant 1).", [(self.info, 1)])
        out.counter("verispec_requests_total", "HTTP responses by endpoint and status code.",
                    [({"endpoint": e, "status": str(s)}, n) for (e, s), n in sorted(self.http.items())])
        out.counter("verispec_request_finish_total", "Generation requests that left the engine, by finish reason.",
                    [({"reason": r}, n) for r, n in sorted(self.finished.items())])
        out.counter("verispec_prompt_tokens_total", "Prompt tokens of requests that left the engine.",
                    [({}, self.prompt_tokens)])
        out.counter("verispec_generation_tokens_total", "Generated tokens.", [({}, self.generation_tokens)])
        out.counter("verispec_target_passes_total", "Target forward passes per row (one per step per running row).",
                    [({}, self.target_passes)])

    def _speculation(self, out: _Families) -> None:
        out.counter("verispec_spec_decode_num_drafts_total", "Row-steps that verified at least one draft token.",
                    [({}, self.num_drafts)])
        out.counter("verispec_spec_decode_num_draft_tokens_total", "Draft tokens proposed.",
                    [({}, self.draft_tokens)])
        out.counter("verispec_spec_decode_num_accepted_tokens_total", "Draft tokens accepted.",
                    [({}, self.accepted_tokens)])
        out.counter("verispec_spec_decode_num_accepted_tokens_per_pos_total",
                    "Accepted draft tokens by draft position (0 = first draft).",
                    [({"position": str(i)}, n) for i, n in enumerate(self.accepted_per_pos)])
        out.counter("verispec_spec_decode_num_draft_tokens_per_pos_total", "Proposed draft tokens by draft position.",
                    [({"position": str(i)}, n) for i, n in enumerate(self.drafted_per_pos)])
        rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
        out.gauge("verispec_spec_decode_acceptance_rate",
                  "Accepted / proposed draft tokens since start (0 when nothing was drafted).", [({}, rate)])
        mal = self.generation_tokens / self.target_passes if self.target_passes else 0.0
        out.gauge("verispec_spec_decode_mean_accepted_length",
                  "Generated tokens per target pass since start (1.0 = plain decoding).", [({}, mal)])
        out.gauge("verispec_spec_decode_acceptance_per_position",
                  "Acceptance rate by draft position (requests that left the engine).",
                  [({"position": str(i)}, a / d if d else 0.0)
                   for i, (a, d) in enumerate(zip(self.accepted_per_pos, self.drafted_per_pos))])

    def _occupancy(self, out: _Families) -> None:
        out.gauge("verispec_num_requests_waiting", "Requests queued for a free row (queue depth).",
                  [({}, self.queue_depth)])
        out.gauge("verispec_num_requests_running", "Requests holding a row of the running batch.",
                  [({}, self.running)])
        out.gauge("verispec_cache_rows_in_use", "KV-cache rows held (active rows).", [({}, self.rows_in_use)])
        dc = self.drafter_cache
        if dc is None:  # no drafter, or one without a cache shared across requests
            return
        # suffix decoding's global cache: its size against its bound, in trie nodes
        out.gauge("verispec_suffix_cache_nodes", "Trie nodes held by the suffix drafter's global cache.",
                  [({}, dc["nodes"])])
        out.gauge("verispec_suffix_cache_max_nodes", "The suffix drafter's global cache bound, in trie nodes.",
                  [({}, dc["max_nodes"])])
        out.gauge("verispec_suffix_cache_sequences", "Finished requests held by the suffix drafter's global cache.",
                  [({}, dc["sequences"])])
        out.gauge("verispec_suffix_cache_scopes", "API-key scopes (one trie each) in the suffix drafter's global cache.",
                  [({}, dc["scopes"])])
        out.counter("verispec_suffix_cache_evictions_total",
                    "Sequences the suffix drafter's global cache evicted to stay under its bound.",
                    [({}, dc["evictions"])])

    def _steps(self, out: _Families) -> None:
        h = HistogramMetricFamily("verispec_step_duration_seconds", "Wall time of one engine step (all running rows).",
                                  labels=["model_name"])
        h.add_metric([self.model_name], [(repr(le), n) for le, n in zip(STEP_BUCKETS, self.step_buckets)]
                     + [("+Inf", self.steps)], self.step_sum)
        out.families.append(h)
        out.counter("verispec_step_rows_total", "Running rows summed over engine steps.", [({}, self.step_rows_sum)])

    def _gc_pauses(self, out: _Families) -> None:
        g = self.gc.snapshot()
        h = HistogramMetricFamily("verispec_gc_pause_seconds",
                                  "Pauses of the Python garbage collector, which stop every thread, by generation, "
                                  "since the server began serving.",
                                  labels=["model_name", "generation"])
        for gen in sorted(g["count"]):
            h.add_metric([self.model_name, str(gen)],
                         [(repr(le), n) for le, n in zip(GC_BUCKETS, g["buckets"][gen])] + [("+Inf", g["count"][gen])],
                         g["sum"][gen])
        out.families.append(h)
        out.gauge("verispec_gc_pause_max_seconds", "The longest garbage-collector pause since serving began.",
                  [({}, g["max"])])
        out.gauge("verispec_gc_frozen_objects", "Objects frozen out of garbage collection at start-up.",
                  [({}, g["frozen"])])


class _Families:
    """Metric families as they are built, each labelled with the model's name first and
    then the labels of its samples (sorted; a sample without one of them reads "")."""

    def __init__(self, model_name: str):
        self.model = {"model_name": model_name}
        self.families: list = []

    def counter(self, name: str, help_: str, samples: list[tuple[dict, float]]) -> None:
        self._add(CounterMetricFamily, name, help_, samples)

    def gauge(self, name: str, help_: str, samples: list[tuple[dict, float]]) -> None:
        self._add(GaugeMetricFamily, name, help_, samples)

    def _add(self, cls, name: str, help_: str, samples: list[tuple[dict, float]]) -> None:
        m = self.model
        keys = sorted({k for labels, _ in samples for k in labels} | set(m), key=lambda k: (k != "model_name", k))
        f = cls(name, help_, labels=keys)
        for labels, value in samples:
            f.add_metric([str({**m, **labels}.get(k, "")) for k in keys], value)
        self.families.append(f)

class _Collector:
    """prometheus_client's custom-collector protocol over a Metrics object."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        return iter(self.metrics.families())
