"""The adaptive policy's tunables, in one frozen dataclass built at the edge (CLI, server,
audit, benchmarks) and passed down through make_policy(). The defaults are the values the
policy's benchmarks ran with (RESULTS.md); see policy/adaptive.py for how each is used."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class AdaptiveConfig:
    # -- acceptance records -------------------------------------------------------------
    prior: float = 0.6  # acceptance assumed of a drafter at a position nobody has tried
    decay: float = 0.1  # a row's record is forgotten by this share per step it drafts
    global_keep: float = 0.98  # the drafter's record over every row: kept per row-step drafted
    global_strength: float = 5.0  # trials' worth of weight of the prior in the drafter's figures
    optimism: float = 0.5  # standard errors added to the drafter's figures where they are thin
    row_strength: float = 3.0  # expected acceptances' worth of weight of the drafter in a row's level
    # -- planning ----------------------------------------------------------------------
    min_gain: float = 0.05  # a choice must beat plain decoding's modelled rate by this share
    replan_every: int = 16  # steps a settled plan is reused at most (the cost model drifts)
    # -- probes of rows left out ---------------------------------------------------------
    min_probe: int = 8  # idle steps before a row left out is probed again (at least)
    max_probe: int = 128  # the probe interval doubles per failed probe up to this
    probe_budget: float = 0.005  # share of a step's time one probe interval may spend probing
    # -- measured step times (observe_costs) -----------------------------------------------
    scale_weight: float = 0.1  # weight of each step in the measured / modelled time ratios
    max_swing: float = 4.0  # one step's ratio is clamped to [1 / max_swing, max_swing]
    pass_keep: float = 0.8  # measured pass times per shape: kept per measurement
    rate_keep: float = 0.9  # realised tokens per second per batch size: kept per step
    # -- the drafter's confidence (halt()) ---------------------------------------------------
    conf_keep: float = 0.995  # calibration records: kept per draft observed
    conf_strength: float = 10.0  # drafts' worth of weight of the fitted curve in a bin's figure
    # -- the cost model's disk cache (policy/costs.py) ------------------------------------------
    drift_tolerance: float = 0.25  # measured / cached time ratio beyond 1 +- this: rewrite the entry
    drift_min_steps: int = 16  # steps' worth of measurements of a ratio before it may trigger
    drift_keep: float = 0.98  # the drift ratios' sums: kept per step (about 50 steps' memory)

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"AdaptiveConfig.{f.name} must be a number >= 0, got {v!r}")
        for name in ("decay", "global_keep", "pass_keep", "rate_keep", "conf_keep", "drift_keep", "prior"):
            if getattr(self, name) > 1:
                raise ValueError(f"AdaptiveConfig.{name} must lie in [0, 1]")
        if self.min_probe < 1 or self.max_probe < self.min_probe or self.replan_every < 1:
            raise ValueError("need 1 <= min_probe <= max_probe and replan_every >= 1")
        if self.max_swing < 1 or self.probe_budget <= 0:
            raise ValueError("need max_swing >= 1 and probe_budget > 0")
        if self.drift_keep < 1 and self.drift_min_steps >= 1 / (1 - self.drift_keep):
            # the forgotten step count tends to 1 / (1 - drift_keep): it must reach min_steps
            raise ValueError("drift_min_steps must be below 1 / (1 - drift_keep)")
