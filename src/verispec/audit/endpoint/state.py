"""The endpoint audit's state as its checks read it (`EndpointAudit`: the servers, the
settings, the greedy runs and their comparisons, the sampled run, the results), the error
that ends an endpoint audit, and the helpers that make its greedy runs. Each check's
endpoint half sits beside its offline half (audit/equivalence.py, distribution.py,
corruption.py, speed.py, load.py, record.py, lossy_rule.py); audit/registry.py registers
them and runner.py runs them in registry order."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from ..checks import CheckResult
from .client import EndpointConfig, EndpointRun, PromptResult, audit_endpoint, audit_paired
from .kinds import ServerInfo
from .null import Comparison, compare

# a speculative server's sampled phase must verify this many draft tokens to have power
MIN_VERIFIED_DRAFTS = 200


class EndpointError(RuntimeError):
    """The endpoint could not be audited at all (unreachable, no model, refused every request)."""


def _run(cfg: EndpointConfig, prompts: list, what: str) -> EndpointRun:
    try:
        return audit_endpoint(cfg, prompts)
    except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as e:
        raise EndpointError(f"{what} at {cfg.base}: {type(e).__name__}: {e}") from None


def _run_paired(cfg: EndpointConfig, ref_cfg: EndpointConfig, prompts: list,
                reference_first: bool = False) -> tuple[EndpointRun, EndpointRun]:
    try:
        return audit_paired(cfg, ref_cfg, prompts, reference_first)
    except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as e:
        raise EndpointError(f"the endpoint and its reference at {cfg.base} / {ref_cfg.base}: "
                            f"{type(e).__name__}: {e}") from None


@dataclass
class EndpointAudit:
    """The endpoint audit's state as its checks read it: the servers, the settings, the
    greedy runs (base, endpoint, null) and their comparisons, the sampled run, the results."""

    info: ServerInfo
    ref_info: ServerInfo | None
    cfg: EndpointConfig
    ref_cfg: EndpointConfig | None
    reference_kind: str
    prompts: list
    chat: bool
    max_tokens: int
    concurrency: tuple[int, ...]
    suite_spec: str
    suite_size: int | None
    started: str
    alpha: float
    sampled_tokens: int
    score_with: str
    min_verified_drafts: int
    seed: int
    # timings per prompt of the endpoint and its reference side by side at concurrency 1, for
    # the slices' speedup intervals: the paired run's level 1 and speed_repeats - 1 more
    speed_repeats: int = 1
    # the speedup-floor check (audit/floor.py): its gate (None: informational), its budget
    # (None: the quick one) and the whole suite it starts from (None: the audited prompts)
    min_speedup: float | None = None
    floor_budget: Any = None
    suite: list | None = None
    floor_settle_s: float = 0.0  # the floor's pause before each timed request (floor.EndpointSubject)
    floor_run: EndpointRun | None = None  # what the floor's search talked to (no levels): the record's
    run: EndpointRun | None = None  # the endpoint at every level
    base: EndpointRun | None = None  # the reference at concurrency 1
    null_run: EndpointRun | None = None
    reference: EndpointRun | None = None  # the null run when there is a separate reference
    null_runs: list[EndpointRun] = field(default_factory=list)
    base_results: list[PromptResult] = field(default_factory=list)
    tests: list[Comparison] = field(default_factory=list)
    nulls: dict[int, Comparison] = field(default_factory=dict)
    srun: EndpointRun | None = None  # the temperature-1 phase
    quick: bool = True  # the quick audit's budgets (--quick), else the full ones
    # the acceptance check's further temperature-1 rounds (audit/acceptance.py), for the counters check too
    acceptance_runs: list[EndpointRun] = field(default_factory=list)
    drafter_replay: Any = None  # the prompt-lookup drafter whose replay the server's counters confirm, if any
    # the further paired runs at concurrency 1 (endpoint run, reference run), each of one level
    speed_runs: list[tuple[EndpointRun, EndpointRun]] = field(default_factory=list)
    record: dict | None = None
    # the sampler settings the distribution check sent, for the record (None: it did not run)
    sampling_sent: dict | None = None
    previous: dict | None = None  # an earlier audit's report: the re-test gate's baseline
    only: tuple[str, ...] = ()
    greedy: bool = True  # whether the greedy runs are made (only for the checks that read them)
    greedy_error: str | None = None  # why the greedy runs failed
    results: list[CheckResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def greedy_runs(self, null_repeats: int) -> None:
        """The base (reference at concurrency 1), then the endpoint and the reference at every
        level side by side, then the reference alone for further null repeats."""
        base_cfg = replace(self.ref_cfg or self.cfg, concurrency=(1,))
        self.base = _run(base_cfg, self.prompts, "the base run (reference at concurrency 1)")
        if self.ref_cfg:  # the endpoint and the first null timed side by side: the speedups' pairs
            self.run, first_null = _run_paired(self.cfg, self.ref_cfg, self.prompts)
            self.null_runs = [first_null] + [_run(self.ref_cfg, self.prompts, "the null run")
                                             for _ in range(null_repeats - 1)]
            if self.concurrency[0] == 1:  # the slices' level: more pairs, each wave's order flipped in turn
                one = replace(self.cfg, concurrency=(1,))
                self.speed_runs = [_run_paired(one, self.ref_cfg, self.prompts, reference_first=rep % 2 == 1)
                                   for rep in range(1, self.speed_repeats)]
        else:
            self.run = _run(self.cfg, self.prompts, "the endpoint")
            self.null_runs = [_run(base_cfg, self.prompts, "the null run") for _ in range(null_repeats)]
        self.null_run = self.null_runs[0]
        self.reference = self.null_run if self.ref_cfg else None
        self.base_results = self.base.levels[0].results
        self.tests = [compare(self.base_results, lv.results, lv.concurrency) for lv in self.run.levels]
        for nr in self.null_runs:  # repeats pool per level: more null divergences give the margins a scale
            for lv in nr.levels:
                self.nulls.setdefault(lv.concurrency, Comparison(lv.concurrency)).rows += compare(
                    self.base_results, lv.results, lv.concurrency).rows

    def sampled(self) -> EndpointRun:
        """The temperature-1 phase (sampled.py), made once for every check that reads it: the
        suite's prompts and the drafting prompts in turn (shuffled by the seed), at least
        sampled_tokens tokens at the highest load level, scored as score_with says."""
        if self.srun is not None:
            return self.srun
        import random

        from . import rescore
        from .sampled import drafting_mix, sampled_run
        why_not = rescore.supported(self.info.kind, self.ref_info.kind if self.ref_info else None)
        sprompts = drafting_mix(self.prompts)
        if self.seed:
            random.Random(self.seed).shuffle(sprompts)
        try:
            if self.score_with != "endpoint" and not why_not:
                self.srun = rescore.rescored_sampled_run(self.cfg, self.ref_cfg, sprompts, self.sampled_tokens,
                                                         max(self.concurrency), scorer=self.score_with,
                                                         kind=self.info.kind)
            else:
                self.srun = sampled_run(self.cfg, self.info.kind, sprompts, self.sampled_tokens, max(self.concurrency))
        except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as e:
            raise EndpointError(f"the sampled run at {self.cfg.base}: {type(e).__name__}: {e}") from None
        return self.srun

    def report(self, elapsed_s: float) -> dict:
        """The report so far, in the offline audit's format (the re-test gate compares it with
        the earlier one before the gate's own result joins it)."""
        failed = [c.name for c in self.results if not c.passed]
        levels = self.run.levels[-1].results if self.run else []
        samples = [{"slice": p.slice, "prompt": p.prompt, "reference": r.text or "", "speculative": g.text or ""}
                   for p, r, g in list(zip(self.prompts, self.base_results, levels))[:6]]
        runs = ({"endpoint": self.run.to_dict(), "base": self.base.to_dict(), "reference": self.null_run.to_dict()}
                if self.greedy and self.run is not None
                else {"sampled": self.srun.to_dict() if self.srun is not None else None})
        return {"verdict": "fail" if failed else "pass", "failed_checks": failed, "elapsed_s": round(elapsed_s, 1),
                "checks": [c.to_dict() for c in self.results], "record": self.record, "samples": samples,
                "only": list(self.only), "checks_not_run": list(self.skipped), "endpoint_runs": runs}
