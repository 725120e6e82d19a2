"""`run_audit`: the deployment checklist as one function.

    result = run_audit(AuditConfig(...))                       # loads target and drafter
    result = run_audit(cfg, target=loaded, drafter_factory=f,   # tests: tiny injected models
                       prompts=[SuitePrompt(...), ...])

Checks, in report order: lossy rule (no statistics needed); equivalence, after the greedy
runs (plain reference at batch 1 interleaved prompt by prompt with speculative batch 1,
then speculative at every other batch size, and with drafting forced, under row churn:
audit/churn.py; each prompt at its own length in every run); distribution;
seeded (seeded speculative output equals seeded plain output); stopping (stops and
length limits inside drafted runs end where plain decoding ends); drafter consistency,
corruption and slices, which read the greedy runs too; load; record. A check whose code
raises (a crash in the engine under audit) fails with the error in its details. With
`config.inject_fault` the speculative engine (the system under audit) runs inside the
fault; references and teacher-forced passes never do, except for a fault in the backend
itself (audit/faults/null.py), which every engine on the model runs.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field, replace
from typing import Any

from ..engine import Engine, GenerationParams, Request
from ..policy import FixedK
from . import churn, record
from .checks import ENGINE, CheckResult, run_checks, verdict
from .context import AuditConfig, AuditContext, DrafterFactory, GreedyRuns, encode, select_prompts
from .progress import NullProgress
from .suite import SuitePrompt, load_suite


@dataclass
class AuditResult:
    verdict: str  # "pass" | "fail"
    checks: list[CheckResult]
    record: dict
    elapsed_s: float
    samples: list[dict] = field(default_factory=list)  # a few outputs, for the reader

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.passed]

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "failed_checks": self.failed,
                "elapsed_s": round(self.elapsed_s, 1), "checks": [c.to_dict() for c in self.checks],
                "record": self.record, "samples": self.samples}


def drafter_factory_from_spec(spec: str, target_model, tokenizer) -> tuple[DrafterFactory, Any]:
    """A factory for the drafter named by a CLI spec, and the draft model's files (or None).
    A draft model is loaded once; each engine gets a fresh drafter (its own cache) on it."""
    from ..drafters import loads_no_model, make_drafter
    if spec == "none":
        raise ValueError("the audit needs a drafter: --draft lookup | suffix[:options] | layerskip:N | a draft model")
    if loads_no_model(spec):
        make_drafter(spec, target_model, tokenizer, max_rows=1, max_len=2)  # validate the spec now
        return (lambda rows, max_len: make_drafter(spec, target_model, tokenizer, max_rows=rows,
                                                   max_len=max_len)), None
    from ..drafters.draft_model import DraftModelDrafter, check_same_tokenizer
    from ..models import load_model
    loaded = load_model(spec, progress=False, backend=target_model.runtime)  # the target's backend
    check_same_tokenizer(loaded.tokenizer, tokenizer)
    V = target_model.config.vocab_size
    return (lambda rows, max_len: DraftModelDrafter(loaded.model, V, max_rows=rows, max_len=max_len,
                                                    name=spec)), loaded.files


def run_audit(config: AuditConfig, *, target=None, drafter_factory: DrafterFactory | None = None,
              draft_files=None, prompts: list[SuitePrompt] | None = None, progress=None) -> AuditResult:
    """Run every check. target: a LoadedModel-like object (model, tokenizer, files); None loads
    config.target. drafter_factory(max_rows, max_len) -> drafter; None builds config.draft
    (draft_files: the draft model's files, recorded). prompts: the suite; None loads config.suite."""
    t_start = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    progress = progress or NullProgress()
    if target is None:
        from ..models import load_model
        target = load_model(config.target, progress=False, batch_invariant=config.batch_invariant)
    model, tokenizer = target.model, target.tokenizer
    build_audited = Engine
    if config.inject_fault:
        from .faults import build as build_fault
        fault = build_fault(config.inject_fault)  # ValueError naming the faults

        def build_audited(*args, **kwargs):  # a fresh fault per engine: its hooks keep per-engine state
            return build_fault(config.inject_fault).engine(*args, **kwargs)

        if fault.backend is not None:  # a fault in the backend: every engine of the audit runs on it
            model = fault.backend(model)
    if drafter_factory is None:
        drafter_factory, draft_files = drafter_factory_from_spec(config.draft, model, tokenizer)
    suite = prompts if prompts is not None else load_suite(config.suite)
    chosen = select_prompts(suite, config.sizes.prompts_per_slice)
    chat = (config.prompt_format == "chat"
            or (config.prompt_format == "auto" and bool(getattr(tokenizer, "chat_template", None))))
    eos = getattr(tokenizer, "eos_token_id", None)
    stops = tuple(dict.fromkeys(tuple(model.config.eos_token_ids) + ((eos,) if eos is not None else ())))
    ctx = AuditContext(config=config, model=model, tokenizer=tokenizer, drafter_factory=drafter_factory,
                       suite=suite, prompts=chosen, prompt_ids=[encode(tokenizer, p.prompt, chat) for p in chosen],
                       chat=chat, stops=stops, progress=progress, build_audited=build_audited)

    audit = EngineAudit(ctx, target.files, draft_files, started)
    run_checks(ENGINE, audit, only=tuple(config.only or ()), fail_fast=config.fail_fast, progress=progress)
    rec = audit.record()
    elapsed = time.perf_counter() - t_start
    rec["elapsed_s"] = round(elapsed, 1)
    return AuditResult(verdict=verdict(audit.results), checks=audit.results, record=rec, elapsed_s=elapsed,
                       samples=_samples(ctx, audit.greedy) if audit.greedy else [])


@dataclass
class EngineAudit:
    """The offline audit's state as its checks read it: the context, the greedy runs (made on
    first use and shared by the checks that read them), the results so far."""

    ctx: AuditContext
    target_files: Any
    draft_files: Any
    started: str
    results: list[CheckResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    greedy: ChurnedRuns | None = None
    greedy_error: str | None = None
    _record: dict | None = None

    def runs(self) -> ChurnedRuns:
        if self.greedy is None:
            try:
                self.greedy = greedy_runs(self.ctx)
            except Exception as e:  # noqa: BLE001 - checks.attempt turns it into a failed check
                self.greedy_error = f"{type(e).__name__}: {e}"
                raise
        return self.greedy

    def record(self) -> dict:
        """The record (built once, when the record check runs: it lists the checks not run)."""
        if self._record is None:
            self._record = record.build_record(self.ctx, self.target_files, self.draft_files, self.started)
            self._record["checks_not_run"] = list(self.skipped)
        return self._record


# -- greedy runs and equivalence -------------------------------------------------------------
@dataclass
class ChurnedRuns(GreedyRuns):
    """The greedy runs and the row churn each speculative run reached (audit/churn.py): one
    dict per run (batch, policy, requests, steps, rows reused, rows reused after sitting
    free, gapped and mixed-length steps), in batch order, the forced run last."""

    churn: list[dict] = field(default_factory=list)


def greedy_runs(ctx: AuditContext) -> ChurnedRuns:
    """Every greedy run, each prompt at its own length (churn.mixed_lengths: the reference
    and every speculative run take the same). Batch 1 alternates plain and speculative
    prompt by prompt (the slices time them); every larger batch size, and the forced run,
    decode under churn (churn.run_churned: staggered arrivals, rows freed and taken again)."""
    t0 = time.perf_counter()
    base = ctx.greedy_params()
    lengths = churn.mixed_lengths(len(ctx.prompt_ids), base.max_new_tokens)
    params = [replace(base, max_new_tokens=m) for m in lengths]
    max_len = max(map(len, ctx.prompt_ids)) + base.max_new_tokens
    n = len(ctx.prompt_ids)
    plain = ctx.engine(1, max_len, speculative=False, rule="rejection")
    spec1 = ctx.engine(1, max_len)
    # warm both engines up (first-call kernel setup) so neither pays it inside a timing
    warm = GenerationParams(max_new_tokens=4)
    plain.run([Request(ctx.prompt_ids[0][:8], warm)])
    spec1.run([Request(ctx.prompt_ids[0][:8], warm)])
    reference, spec = [], {1: []}
    policy = ctx.config.policy
    before = churn.counted(spec1)
    with ctx.progress.stage("greedy: plain vs speculative, b=1", 2 * n) as bar:
        # interleaved prompt by prompt: both see the same machine load (slices compare them)
        for ids, p in zip(ctx.prompt_ids, params):
            reference.append(plain.run([Request(ids, p)])[0])
            bar.advance()
            spec[1].append(spec1.run([Request(ids, p)])[0])
            bar.advance()
    churned = [{**churn.since(spec1, before, policy=policy), "requests": n, "arrival_span": None}]
    for b in ctx.config.greedy_batch_sizes:
        if b == 1:
            continue
        reqs = [Request(ids, p) for ids, p in zip(ctx.prompt_ids, params)]
        with ctx.progress.stage(f"greedy: speculative, b={b}", n) as bar:
            churned.append(churn.run_churned(ctx.engine(min(b, n), max_len), reqs, f"{ctx.config.seed}/greedy/{b}",
                                             on_finish=lambda r: bar.advance(), policy=policy))
        spec[b] = reqs
    forced = None
    if ctx.config.policy != "fixed":  # the deployed policy may draft little: force drafting too
        b = max(ctx.config.greedy_batch_sizes)
        reqs = [Request(ids, p) for ids, p in zip(ctx.prompt_ids, params)]
        k = ctx.config.forced_k
        with ctx.progress.stage(f"greedy: speculative, fixed k={k}, b={b}", n) as bar:
            churned.append(churn.run_churned(ctx.engine(min(b, n), max_len, policy=FixedK(k)), reqs,
                                             f"{ctx.config.seed}/greedy-forced/{b}",
                                             on_finish=lambda r: bar.advance(), policy=f"fixed k={k}"))
        forced = (b, reqs)
    return ChurnedRuns(reference, spec, time.perf_counter() - t0, forced, churned)


def _samples(ctx: AuditContext, runs: GreedyRuns) -> list[dict]:
    """One output per slice (reference and largest-batch speculative), for the reader."""
    out, seen = [], set()
    b_max = max(runs.speculative)
    for i, p in enumerate(ctx.prompts):
        if p.slice in seen:
            continue
        seen.add(p.slice)
        out.append({"id": p.id, "slice": p.slice, "prompt": p.prompt[:300],
                    "reference": ctx.decode(runs.reference[i].output_ids),
                    f"speculative_b{b_max}": ctx.decode(runs.speculative[b_max][i].output_ids)})
    return out
