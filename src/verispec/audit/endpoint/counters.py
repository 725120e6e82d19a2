"""Speculative-decoding counters in other servers' Prometheus /metrics pages, and the
per-response speculative fields of their answers.

Pages are parsed by prometheus_client's parser (text format 0.0.4). Counters read:

* llama.cpp (``llama-server --metrics``): ``llamacpp:spec_decode_num_drafts_total``
  (verification steps), ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total``,
  ``..._num_accepted_tokens_per_pos_total{position}`` (steps that accepted position i),
  ``llamacpp:tokens_predicted_total``; added when a request finishes (a slot's stats
  flushed at release), so a scrape after a level has finished counts all of it;
* vLLM: ``vllm:spec_decode_num_drafts_total`` and the same three, ``vllm:generation_tokens_total``;
* verispec: ``verispec_spec_decode_*`` (vLLM's names) plus target passes per row;
* SGLang: only gauges, ``sglang:spec_accept_length`` / ``sglang:spec_accept_rate``: the
  last batch's (or a short window's) values, sampled during a run and reported as
  gauges, never as the level's figures.

`delta` turns two scrapes into the figures of what happened between them.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families


class MetricsParseError(ValueError):
    """A /metrics page that is not valid Prometheus text."""


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition -> [(sample name, labels, value)] (counters keep their
    _total suffix). Raises MetricsParseError on a page the parser rejects."""
    try:
        return [(s.name, dict(s.labels), float(s.value))
                for fam in text_string_to_metric_families(text) for s in fam.samples]
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise MetricsParseError(f"unparseable /metrics page: {e}") from None


def _total(samples, name: str) -> float | None:
    vals = [v for n, _, v in samples if n == name]
    return sum(vals) if vals else None


def _mean(samples, name: str) -> float | None:
    vals = [v for n, _, v in samples if n == name]
    return sum(vals) / len(vals) if vals else None


def _per_position(samples, name: str) -> list[float]:
    by_pos: dict[int, float] = {}
    for n, labels, v in samples:
        if n == name and labels.get("position", "").isdigit():
            by_pos[int(labels["position"])] = by_pos.get(int(labels["position"]), 0.0) + v
    return [by_pos.get(i, 0.0) for i in range(max(by_pos) + 1)] if by_pos else []


@dataclass
class SpecCounters:
    """Speculative-decoding figures a server exposes (counters as they stand; see `delta`).

    mean_acceptance_length follows vLLM: 1 + accepted / drafts (tokens per verification of
    a row, bonus token included); SGLang reports it directly as a gauge."""

    source: str  # "llama.cpp" | "vllm" | "sglang" | "verispec"
    drafts: float | None = None  # row-steps that verified drafts
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    accepted_per_position: list[float] = field(default_factory=list)
    drafted_per_position: list[float] = field(default_factory=list)
    generation_tokens: float | None = None
    target_passes: float | None = None  # verispec only: passes per row, speculative or not
    accept_length_gauge: float | None = None  # SGLang's gauge: last batch / short window, not a level figure
    accept_rate_gauge: float | None = None
    gauge_samples: list[dict] = field(default_factory=list)  # SGLang: the gauges as sampled during a level

    @property
    def from_gauges(self) -> bool:
        """True when the figures are gauges (SGLang), not differences of counters."""
        return self.drafts is None and self.draft_tokens is None and (
            self.accept_length_gauge is not None or self.accept_rate_gauge is not None)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens over the counted interval (None for gauges)."""
        if self.draft_tokens:
            return self.accepted_tokens / self.draft_tokens
        return None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / verification steps (bonus token included), from counters only."""
        if self.drafts:
            return 1.0 + self.accepted_tokens / self.drafts
        return None

    @property
    def tokens_per_target_pass(self) -> float | None:
        """Generated tokens per target pass (verispec's own figure; 1.0 = plain decoding)."""
        if self.target_passes:
            return self.generation_tokens / self.target_passes
        return None

    @property
    def acceptance_per_position(self) -> list[float | None]:
        if self.drafted_per_position:
            return [a / d if d else None for a, d in zip(self.accepted_per_position, self.drafted_per_position)]
        if self.drafts:  # vLLM, llama.cpp: steps that accepted position i / verification steps
            return [a / self.drafts for a in self.accepted_per_position]
        return []

    def delta(self, before: "SpecCounters | None") -> "SpecCounters":
        """Counters as differences since `before` (gauges keep their current value)."""
        if before is None or before.source != self.source:
            return self

        def d(a, b):
            return None if a is None else a - (b or 0.0)

        def dl(a, b):
            return [x - (b[i] if i < len(b) else 0.0) for i, x in enumerate(a)]
        return SpecCounters(self.source, d(self.drafts, before.drafts), d(self.draft_tokens, before.draft_tokens),
                            d(self.accepted_tokens, before.accepted_tokens),
                            dl(self.accepted_per_position, before.accepted_per_position),
                            dl(self.drafted_per_position, before.drafted_per_position),
                            d(self.generation_tokens, before.generation_tokens),
                            d(self.target_passes, before.target_passes),
                            self.accept_length_gauge, self.accept_rate_gauge, list(self.gauge_samples))

    def plus(self, other: "SpecCounters") -> "SpecCounters":
        """Two intervals' differences added (the waves of one level); gauges: the later's."""
        if other.source != self.source:
            raise ValueError(f"cannot add {other.source} counters to {self.source} ones")

        def a(x, y):
            return None if x is None and y is None else (x or 0.0) + (y or 0.0)

        def al(x, y):
            return [(x[i] if i < len(x) else 0.0) + (y[i] if i < len(y) else 0.0) for i in range(max(len(x), len(y)))]
        return SpecCounters(self.source, a(self.drafts, other.drafts), a(self.draft_tokens, other.draft_tokens),
                            a(self.accepted_tokens, other.accepted_tokens),
                            al(self.accepted_per_position, other.accepted_per_position),
                            al(self.drafted_per_position, other.drafted_per_position),
                            a(self.generation_tokens, other.generation_tokens),
                            a(self.target_passes, other.target_passes),
                            other.accept_length_gauge, other.accept_rate_gauge,
                            self.gauge_samples + other.gauge_samples)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(acceptance_rate=self.acceptance_rate, mean_acceptance_length=self.mean_acceptance_length,
                   tokens_per_target_pass=self.tokens_per_target_pass,
                   acceptance_per_position=self.acceptance_per_position, from_gauges=self.from_gauges)
        return out


# (source, prefix, generated-tokens counter, target-passes counter or None)
VLLM_NAMED = (("verispec", "verispec_", "verispec_generation_tokens_total", "verispec_target_passes_total"),
              ("llama.cpp", "llamacpp:", "llamacpp:tokens_predicted_total", None),
              ("vllm", "vllm:", "vllm:generation_tokens_total", None))


def spec_counters(text: str) -> SpecCounters | None:
    """The speculative-decoding counters in a /metrics page, or None when it has none."""
    s = parse_prometheus(text)
    names = {n for n, _, _ in s}
    for source, prefix, generated, passes in VLLM_NAMED:  # vLLM's counter names under a prefix each
        if f"{prefix}spec_decode_num_draft_tokens_total" in names:
            return SpecCounters(
                source, _total(s, f"{prefix}spec_decode_num_drafts_total"),
                _total(s, f"{prefix}spec_decode_num_draft_tokens_total"),
                _total(s, f"{prefix}spec_decode_num_accepted_tokens_total"),
                _per_position(s, f"{prefix}spec_decode_num_accepted_tokens_per_pos_total"),
                _per_position(s, f"{prefix}spec_decode_num_draft_tokens_per_pos_total"),
                _total(s, generated), _total(s, passes) if passes else None)
    if names & {"sglang:spec_accept_length", "sglang:spec_accept_rate"}:
        return SpecCounters("sglang", generation_tokens=_total(s, "sglang:generation_tokens_total"),
                            accept_length_gauge=_mean(s, "sglang:spec_accept_length"),
                            accept_rate_gauge=_mean(s, "sglang:spec_accept_rate"))
    return None


def server_kind(text: str) -> str:
    """The server software a /metrics page names by its prefixes ("unknown" if none)."""
    for prefix, kind in (("verispec_", "verispec"), ("vllm:", "vllm"), ("sglang:", "sglang"),
                         ("llamacpp:", "llama.cpp"), ("tgi_", "tgi")):
        if re.search(rf"^{re.escape(prefix)}", text, re.M):
            return kind
    return "unknown"




def response_spec(obj: dict) -> dict | None:
    """The speculative fields of one response (or its final stream chunk), normalised:
    {"source", "drafted", "accepted", "verify_steps", "target_passes"} with None where the
    server does not say. Read: llama.cpp's ``timings.draft_n`` / ``timings.draft_n_accepted``
    (present only when the request drafted), vLLM's ``metrics.speculative_decoding``
    (``--per-request-spec-decode-metrics``), verispec's ``verispec`` object."""
    if not isinstance(obj, dict):
        return None
    v = obj.get("verispec")
    if isinstance(v, dict) and ("drafted" in v or "target_passes" in v):
        return {"source": "verispec", "drafted": v.get("drafted"), "accepted": v.get("accepted"),
                "verify_steps": None, "target_passes": v.get("target_passes")}
    m = obj.get("metrics")
    sd = m.get("speculative_decoding") if isinstance(m, dict) else None
    if isinstance(sd, dict):
        return {"source": "vllm", "drafted": sd.get("num_draft_tokens"), "accepted": sd.get("num_accepted_draft_tokens"),
                "verify_steps": sd.get("num_spec_steps"), "target_passes": None}
    t = obj.get("timings")
    if isinstance(t, dict) and "predicted_n" in t:
        return {"source": "llama.cpp", "drafted": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0),
                "verify_steps": None, "target_passes": None}
    return None
