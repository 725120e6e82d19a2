"""Request lifecycle: what a caller asks for, and the structured stats it gets back."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ..sampling import SamplingParams

_ids = itertools.count()


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # with True, stop_token_ids are not applied (fixed-length runs)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class RequestStats:
    """Per-request speculation record, read by the CLI, the audit and the metrics endpoint."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_passes: int = 0  # verification (or plain decoding) forward passes
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    k_chosen: list[int] = field(default_factory=list)  # drafts per step, as the policy chose
    # per step: (sequence length before the step, drafted tokens, accepted count, drafts the
    # engine asked for); lets the audit recompute what a correct drafter would have proposed.
    # Filled only by an engine with EngineConfig(trace=True), as the draft_q below.
    trace: list[tuple[int, list[int], int, int]] = field(default_factory=list)
    # per step, aligned with trace: the drafter's q(d) of each draft token as the engine
    # verified it (1.0 where q is one-hot: prompt lookup) for rows verified by rejection or
    # typical-lossy; None for greedy and coupled rows. The audit recomputes q itself and reads
    # only which steps were verified by a rule that draws with a generator.
    draft_q: list[list[float] | None] = field(default_factory=list)
    # per step, aligned with draft_q: for each draft token d, the mass q puts on the tokens
    # ranked before d (descending q, ties by id), so that above + U q(d) is d's randomised
    # PIT under the q the verifier read; None where no q was reported (one-hot, greedy,
    # coupled). The audit tests that the drafts are samples of that q.
    draft_q_above: list[list[float] | None] = field(default_factory=list)
    # per step, aligned with trace: a draft tree's nodes as (tokens, parents) (verify/tree.py),
    # None for a linear draft. A tree step's trace entry holds the branch its verdict ran
    # along: the accepted path, then the first child's line below where the walk stopped.
    trace_trees: list[tuple[list[int], list[int]] | None] = field(default_factory=list)
    # per step, aligned with trace: the drafts the policy asked the drafter for, before any
    # trim (a drafter's proposal can depend on it: suffix decoding scores by its length)
    trace_asked: list[int] = field(default_factory=list)
    time_s: float = 0.0  # wall time from admission to finish

    def record_step(self, k: int, accepted: int, levels: int | None = None) -> None:
        """k drafts verified, `accepted` of them accepted; levels: a draft tree's depth (its
        positions; k counts its nodes), None for a linear draft (k positions)."""
        self.target_passes += 1
        self.drafted += k
        self.accepted += accepted
        self.k_chosen.append(k)
        n = k if levels is None else levels
        for lst in (self.drafted_per_position, self.accepted_per_position):
            if len(lst) < n:
                lst.extend([0] * (n - len(lst)))
        for i in range(n):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per target pass (1.0 = plain decoding)."""
        return self.generated_tokens / self.target_passes if self.target_passes else None

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "target_passes": self.target_passes,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_per_position": [a / d if d else None for a, d in
                                        zip(self.accepted_per_position, self.drafted_per_position)],
            "time_s": self.time_s,
            "tokens_per_s": self.generated_tokens / self.time_s if self.time_s else None,
        }


@dataclass
class Request:
    prompt_ids: list[int]
    params: GenerationParams = GenerationParams()
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None  # with finish_reason "error": what failed, for the caller
    stats: RequestStats = field(default_factory=RequestStats)
    # whose text a drafter that learns across requests may draft from for this request: a
    # hash of the client's API key (drafters/suffix_tree.scope_of); None: the key-less scope
    scope: str | None = None
    # engine-owned state
    row: int | None = None
    generator: torch.Generator | None = None
    rule: str | None = None  # the verification rule, resolved once at admission (Engine.add)

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("empty prompt: at least one token is required")
        self.stats.prompt_tokens = len(self.prompt_ids)

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens so far."""
        return self.prompt_ids + self.output_ids
