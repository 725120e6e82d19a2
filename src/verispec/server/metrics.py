"""Server metrics in the Prometheus text format (no client library needed).

Counters and the step histogram are written by the engine thread and the HTTP
middleware and read by /metrics; one lock guards them all. Speculative-decoding
counters follow vLLM's names with a ``verispec_`` prefix, so a dashboard or the
endpoint audit reads verispec, vLLM and SGLang the same way.
"""

from __future__ import annotations

import threading
from collections import defaultdict

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _labels(**kv) -> str:
    if not kv:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in kv.items())
    return "{" + inner + "}"


def _num(x) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


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

    def gauges(self, queue_depth: int, running: int, rows_in_use: int) -> None:
        with self.lock:
            self.queue_depth, self.running, self.rows_in_use = queue_depth, running, rows_in_use

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
        m = {"model_name": self.model_name}
        out: list[str] = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                out.append(f"{name}{_labels(**labels)} {_num(value)}")

        with self.lock:
            metric("verispec_info", "gauge", "Server configuration (constant 1).",
                   [({**m, **self.info}, 1)])
            metric("verispec_requests_total", "counter", "HTTP responses by endpoint and status code.",
                   [({**m, "endpoint": e, "status": str(s)}, n) for (e, s), n in sorted(self.http.items())])
            metric("verispec_request_finish_total", "counter",
                   "Generation requests that left the engine, by finish reason.",
                   [({**m, "reason": r}, n) for r, n in sorted(self.finished.items())])
            metric("verispec_prompt_tokens_total", "counter", "Prompt tokens of requests that left the engine.",
                   [(m, self.prompt_tokens)])
            metric("verispec_generation_tokens_total", "counter", "Generated tokens.",
                   [(m, self.generation_tokens)])
            metric("verispec_target_passes_total", "counter",
                   "Target forward passes per row (one per step per running row).",
                   [(m, self.target_passes)])
            metric("verispec_spec_decode_num_drafts_total", "counter",
                   "Row-steps that verified at least one draft token.", [(m, self.num_drafts)])
            metric("verispec_spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.",
                   [(m, self.draft_tokens)])
            metric("verispec_spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
                   [(m, self.accepted_tokens)])
            metric("verispec_spec_decode_num_accepted_tokens_per_pos_total", "counter",
                   "Accepted draft tokens by draft position (0 = first draft).",
                   [({**m, "position": str(i)}, n) for i, n in enumerate(self.accepted_per_pos)])
            metric("verispec_spec_decode_num_draft_tokens_per_pos_total", "counter",
                   "Proposed draft tokens by draft position.",
                   [({**m, "position": str(i)}, n) for i, n in enumerate(self.drafted_per_pos)])
            rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
            metric("verispec_spec_decode_acceptance_rate", "gauge",
                   "Accepted / proposed draft tokens since start (0 when nothing was drafted).", [(m, rate)])
            mal = self.generation_tokens / self.target_passes if self.target_passes else 0.0
            metric("verispec_spec_decode_mean_accepted_length", "gauge",
                   "Generated tokens per target pass since start (1.0 = plain decoding).", [(m, mal)])
            metric("verispec_spec_decode_acceptance_per_position", "gauge",
                   "Acceptance rate by draft position (requests that left the engine).",
                   [({**m, "position": str(i)}, a / d if d else 0.0)
                    for i, (a, d) in enumerate(zip(self.accepted_per_pos, self.drafted_per_pos))])
            metric("verispec_num_requests_waiting", "gauge", "Requests queued for a free row (queue depth).",
                   [(m, self.queue_depth)])
            metric("verispec_num_requests_running", "gauge", "Requests holding a row of the running batch.",
                   [(m, self.running)])
            metric("verispec_cache_rows_in_use", "gauge", "KV-cache rows held (active rows).",
                   [(m, self.rows_in_use)])
            name = "verispec_step_duration_seconds"
            out.append(f"# HELP {name} Wall time of one engine step (all running rows).")
            out.append(f"# TYPE {name} histogram")
            for le, n in zip(STEP_BUCKETS, self.step_buckets):
                out.append(f"{name}_bucket{_labels(**m, le=repr(le))} {n}")
            out.append(f"{name}_bucket{_labels(**m, le='+Inf')} {self.steps}")
            out.append(f"{name}_sum{_labels(**m)} {self.step_sum!r}")
            out.append(f"{name}_count{_labels(**m)} {self.steps}")
            metric("verispec_step_rows_total", "counter", "Running rows summed over engine steps.",
                   [(m, self.step_rows_sum)])
        return "\n".join(out) + "\n"
