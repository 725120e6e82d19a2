"""The endpoint audit's checks: what each check does from outside, given the audit's state
(`EndpointAudit`: the servers, the greedy runs and their comparisons, the sampled run).
audit/registry.py registers them; runner.py runs them in registry order."""

from __future__ import annotations

import os
import platform
import random
import re
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from ..checks import CheckResult
from ..speed import RANKED, interval_figures, verdict_counts
from ..stats import predicted_speedup, speedup_interval
from .client import EndpointConfig, EndpointRun, LevelRun, PromptResult, audit_endpoint, audit_paired
from .counters import SpecCounters
from . import rescore
from .kinds import ServerInfo
from .tokens import ReferenceTokens
from .null import Comparison, compare, verdict
from .sampled import DRAFTING_PROMPTS, distribution_figures, drafting_mix, sampled_run, sampler_settings

WORD = re.compile(r"\w+|[^\w\s]|\s+")

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


# -- the checks from outside (audit/registry.py registers them) ------------------------------
def lossy_rule_check(a: EndpointAudit) -> CheckResult | None:
    """Only a verispec server says which rule it verifies with; others: not applicable."""
    if a.info.kind != "verispec" or "rule" not in a.info.speculative:
        return None
    lossy = bool(a.info.speculative.get("lossy"))
    rule = a.info.speculative["rule"]
    return _check(not lossy, f"server rule {rule!r} is " + ("LOSSY" if lossy else "exact"),
                  {"rule": rule, "lossy": lossy})


def equivalence_check(a: EndpointAudit) -> CheckResult:
    return _equivalence(a.tests, a.nulls, a.base, a.reference_kind, a.ref_cfg is not None, a.alpha)


def distribution_check(a: EndpointAudit) -> CheckResult | None:
    if not a.sampled_tokens:
        return None
    why_not = rescore.supported(a.info.kind, a.ref_info.kind if a.ref_info else None)
    if a.score_with == "reference" and why_not:
        raise EndpointError(f"--score-with reference: {why_not}")
    sprompts = drafting_mix(a.prompts)
    if a.seed:
        random.Random(a.seed).shuffle(sprompts)
    try:
        if a.score_with != "endpoint" and not why_not:
            a.srun = rescore.rescored_sampled_run(a.cfg, a.ref_cfg, sprompts, a.sampled_tokens, max(a.concurrency),
                                                  scorer=a.score_with, kind=a.info.kind)
        else:
            a.srun = sampled_run(a.cfg, a.info.kind, sprompts, a.sampled_tokens, max(a.concurrency))
    except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as e:
        raise EndpointError(f"the sampled run at {a.cfg.base}: {type(e).__name__}: {e}") from None
    result = _distribution(a.srun, a.sampled_tokens, a.info, a.min_verified_drafts,
                           None if a.score_with == "endpoint" or not why_not else why_not, a.seed)
    a.sampling_sent = {"sent": result.figures["sampler_sent"], "top_logprobs": result.figures["top_logprobs"]}
    return result


def corruption_check(a: EndpointAudit) -> CheckResult:
    toks = ReferenceTokens(a.ref_cfg or a.cfg, a.ref_info.kind if a.ref_info else a.info.kind)
    try:
        return _corruption(a.run, a.base_results, a.null_runs, _Signer(toks, a.prompts, a.chat))
    finally:
        toks.close()


def slices_check(a: EndpointAudit) -> CheckResult:
    return _slices(a.run, a.reference, a.speed_runs)


def load_check(a: EndpointAudit) -> CheckResult:
    return _load(a.run, a.reference)


def record_check(a: EndpointAudit) -> CheckResult:
    record = _record(a.run or a.srun or a.floor_run, a.reference, a.info, a.ref_info, a.reference_kind, a.prompts, a.chat,
                     a.max_tokens, a.concurrency, a.suite_spec, a.suite_size, a.started)
    record["suite"]["audit_seed"] = a.seed  # the prompts chosen, the sampled phase's order, the tie-breaks
    record["suite"]["prompt_ids"] = [p.id for p in a.prompts]
    if a.sampling_sent is not None:
        record["sampling"]["distribution_check"] = {**a.sampling_sent, "seed": "none sent", "audit_seed": a.seed}
    a.record = record
    audited = a.run or a.srun or a.floor_run
    info = a.info
    return _check(True, f"endpoint {audited.url} ({info.kind} {info.version or 'version unknown'}), "
                                  f"model {audited.model}; {len(record['retest_triggers'])} re-test triggers",
                  {"kind": info.kind, "version": info.version, "model": audited.model}, informational=True)


def _check(passed, summary, figures=None, details=None, informational=False) -> CheckResult:
    return CheckResult(passed, summary, figures or {}, details, informational)


def _equivalence(tests: list[Comparison], nulls: dict[int, Comparison], base: EndpointRun, reference_kind: str,
                 separable: bool, alpha: float) -> CheckResult:
    v = verdict(tests, nulls, alpha)
    margins_known = base.logprobs
    per_batch, rows = [], []
    for t, lv in zip(tests, v["per_level"]):
        counts = {"identical": sum(r["exact"] for r in t.rows),
                  "near-tie": sum(r.get("verdict") == "near-tie" for r in t.rows)}
        counts["divergence"] = len(t.rows) - counts["identical"] - counts["near-tie"]
        n = len(t.rows)
        per_batch.append({"batch": t.concurrency, "rows_decoded_together": min(t.concurrency, n), "prompts": n,
                          "exact_match_rate": counts["identical"] / n if n else 0.0, **counts,
                          "null_exact_match_rate": 1 - lv["null_rate"] if lv["null_rate"] is not None else None,
                          **{k: lv[k] for k in ("null_divergences", "null_compared", "null_source", "fisher_p",
                                                "alpha", "beyond_null", "margin_p", "errors", "reasons")},
                          "passed": lv["passed"]})
        rows += [{"batch": t.concurrency, **r} for r in t.rows]
    null_rows = [{"batch": c, **r} for c, cmp in nulls.items() for r in cmp.rows]
    failures = v["failures"]
    summary = ("exact match (text) " + ", ".join(
        f"c{r['batch']} {r['exact_match_rate']:.0%} (null {r['null_exact_match_rate']:.0%})"
        if r["null_exact_match_rate"] is not None else f"c{r['batch']} {r['exact_match_rate']:.0%}"
        for r in per_batch)
        + (f"; null max margin {v['null_max_margin']:.3g}" if v["null_max_margin"] is not None
           else "; the null never diverged" if margins_known else "; no logprobs: margins unknown")
        + ("" if separable else "; NO reference: speculation not separable from batching")
        + ("" if not failures else "; " + "; ".join(failures)))
    figures = {"exact_match_by_batch": {str(r["batch"]): r["exact_match_rate"] for r in per_batch},
               "null_exact_match_by_batch": {str(s["concurrency"]): 1 - s["divergence_rate"]
                                             for s in v["null"] if s["divergence_rate"] is not None},
               "min_exact_match": min(r["exact_match_rate"] for r in per_batch),
               "divergences": sum(r["divergence"] for r in per_batch),
               "near_ties": sum(r["near-tie"] for r in per_batch),
               "null_divergences": sum(s["divergences"] for s in v["null"]),
               "null_max_margin": v["null_max_margin"], "null_margins": v["null_margins"],
               "test": f"per level: one-sided Fisher exact test on divergence counts, and an exact exceedance "
                       f"test of margins beyond the null's largest (alpha {alpha:g} over {2 * len(tests)} tests)",
               "alpha": alpha,
               "exact_match_threshold": min((r["null_exact_match_rate"] for r in per_batch
                                             if r["null_exact_match_rate"] is not None), default=1.0),
               "prompts": len(base.levels[0].results), "reference": reference_kind, "separable": separable,
               "compared_on": "text (batch = concurrent clients)", "reference_logprobs": margins_known}
    if not separable:
        figures["not_separable"] = ("no non-speculative reference: a divergence under load may be speculation "
                                    "or the server's batching numerics; only load invariance was tested")
    tables = [("Equivalence: null baseline (reference vs itself) beside the endpoint",
               ["batch", "endpoint divergences", "null divergences", "null source", "Fisher p",
                "beyond null's max margin", "exceedance p", "alpha", "failed requests", "passed"],
               [[r["batch"], f"{r['divergence']+r['near-tie']}/{r['prompts']}",
                 f"{r['null_divergences']}/{r['null_compared']}", r["null_source"], f"{r['fisher_p']:.3g}",
                 r["beyond_null"], f"{r['margin_p']:.3g}", f"{r['alpha']:.3g}", r["errors"], r["passed"]]
                for r in per_batch]),
              ("Equivalence: null divergences (top-2 margin of the base at the first divergence)",
               ["batch", "prompt", "slice", "first divergence", "top-2 margin"],
               [[r["batch"], r["id"], r["slice"], r["first_divergence"],
                 "-" if r["margin"] is None else f"{r['margin']:.3g}"]
                for r in null_rows if not r["exact"] and r["error"] is None][:40])]
    return _check(not failures, summary, figures,
                  {"per_batch": per_batch, "prompts": rows, "null_prompts": null_rows, "null": v["null"],
                   "tables": tables})


def _phase_counters(srun: EndpointRun) -> SpecCounters | None:
    """The endpoint's speculative counters summed over the sampled phase's rounds."""
    total = None
    for lv in srun.levels:
        if lv.spec is not None and not lv.spec.from_gauges:
            total = lv.spec if total is None else total.plus(lv.spec)
    return total


def _speculates(info: ServerInfo, counters: SpecCounters | None) -> bool | None:
    """Whether the endpoint drafts, as it says itself (None: it does not say)."""
    if info.kind == "verispec":
        return bool(info.speculative.get("drafter"))
    if info.kind == "llama.cpp" and info.speculative.get("slots") is not None:
        return bool(info.speculative.get("slots_speculative"))
    if counters is not None:  # vLLM publishes spec_decode counters only with a speculative config
        return True
    return None


def _distribution(srun: EndpointRun, budget: int, info: ServerInfo, min_drafts: int,
                  no_reference: str | None = None, seed: int = 0) -> CheckResult:
    """no_reference: why the tokens sent without logprobs could not be scored by the reference.
    A speculative endpoint whose sampled phase verified fewer than min_drafts draft tokens
    (its counters' difference over the phase) has not shown its verifier exact: inconclusive."""
    f = distribution_figures(srun, seed=seed, min_tokens=min(200, budget))
    if no_reference and f["tokens_without_logprobs"]:
        f["reason"] = "; ".join(x for x in (f["reason"], f"not scored by a reference: {no_reference}") if x)
    counters = _phase_counters(srun)
    speculates = _speculates(info, counters)
    drafts = int(counters.draft_tokens) if counters is not None and counters.draft_tokens is not None else None
    f.update(verified_drafts=drafts if drafts is not None else "not published by the server",
             min_verified_drafts=min_drafts if speculates else "-", speculative_server=speculates,
             phase_counters=counters.to_dict() if counters else None)
    if counters is not None and counters.draft_tokens:
        f.update(acceptance_rate=counters.acceptance_rate, mean_accepted_length=counters.mean_acceptance_length)
    if speculates and (drafts is None or drafts < min_drafts):
        why = (f"inconclusive: the sampled phase verified {drafts} draft tokens (< {min_drafts}): the verifier "
               "was hardly exercised" if drafts is not None else
               "inconclusive: the server publishes no draft counters, so how many drafts the sampled phase "
               "verified is unknown")
        f["reason"] = "; ".join(x for x in (f["reason"], why) if x)
        f["passed"] = False
    conv = f["convention"]["endpoint"]
    if f["p_value"] is None:
        summary = f["reason"]
    else:
        summary = (f"randomised PIT over the top {conv['buckets']} + tail ({conv['name']}), {f['n']} tokens at T=1 "
                   f"(every other sampler setting sent as off): KS p = {f['p_value']:.3g}, D = {f['ks_statistic']:.3f}"
                   + (f"; {drafts} drafts verified in the phase"
                      + (f", acceptance {f['acceptance_rate']:.1%}" if f.get("acceptance_rate") is not None else "")
                      if drafts is not None else "")
                   + (f"; {f['reason']}" if f["reason"] else "") + f"; scored with {f['scored_with']}")
    f["sampler_sent"] = {"temperature": 1.0, **sampler_settings(info.kind)}
    f["prompts"] = (f"the suite's prompts and {len(DRAFTING_PROMPTS)} copy-heavy prompts in turn (answers that "
                    "copy their prompt, so that the drafter proposes)")
    return _check(f["passed"], summary, f, {"answers": f["answers"]})


def _pseudo_tokens(text: str) -> list[int]:
    """Words, punctuation and whitespace runs as ids: the stand-in where the reference cannot tokenize."""
    ids: dict[str, int] = {}
    return [ids.setdefault(w, len(ids)) for w in WORD.findall(text)]


# the repeated-4-gram and perplexity signatures judge outputs of at least this many tokens
MIN_SIGNATURE_TOKENS = 16


class _Signer:
    """Signatures of outputs on the reference's tokens, perplexity by the reference's score;
    each text tokenized and scored once."""

    def __init__(self, toks: ReferenceTokens, prompts: list, chat: bool):
        self.toks, self.chat = toks, chat
        self.prompt = {p.id: p.prompt for p in prompts}
        self.words = False  # fell back to words somewhere
        self._sigs: dict[tuple, object] = {}

    def __call__(self, pid: str, r: PromptResult, score: bool):
        from ..corruption import signatures
        key = (pid, r.text or "", r.finish_reason == "stop", score)
        if key not in self._sigs:
            text = r.text or ""
            ids = self.toks.tokenize(text) if text else []
            if ids is None:
                self.words = True
                ids = _pseudo_tokens(text)
            ppl = (self.toks.perplexity(self.prompt[pid.split("#")[0]], self.chat, ids)
                   if score and not self.words and len(ids) >= MIN_SIGNATURE_TOKENS else None)
            self._sigs[key] = signatures(ids, text, r.finish_reason == "stop", ppl)
        return self._sigs[key]


def _corruption(run: EndpointRun, refs: list[PromptResult], null_runs: list[EndpointRun], signer: _Signer) -> CheckResult:
    """Corruption signatures of every endpoint output that differs from the base, judged
    against the deployment's own null: the reference's outputs that differ from the same base.

    An endpoint output is flagged for a signature it shows and its base output lacks (loop,
    repeated 4-grams and perplexity on outputs of >= MIN_SIGNATURE_TOKENS reference tokens),
    unless the null explains it: the reference itself produced the same text for that prompt
    (at any level, in any null run), or a null output showed the same kind of signature at
    least as strongly. The check fails on any flag the null does not explain."""
    from ..corruption import signature_flags
    null_texts: dict[str, set] = {}
    null_worst: dict[str, float] = {}  # signature kind -> the null's strongest
    null_flagged = []
    for nr in null_runs:
        for level in nr.levels:
            for ref, got in zip(refs, level.results):
                if not ref.ok or not got.ok:
                    continue
                null_texts.setdefault(got.id, set()).add(got.text)
                if got.text == ref.text:
                    continue
                flags = signature_flags(signer(got.id, got, True), signer(ref.id, ref, True), MIN_SIGNATURE_TOKENS)
                for f in flags:
                    null_worst[f.kind] = max(null_worst.get(f.kind, 0.0), f.severity)
                if flags:
                    null_flagged.append({"batch": level.concurrency, "id": got.id, "signatures": [f.message for f in flags],
                                         "text": (got.text or "")[-200:], "reference": (ref.text or "")[-200:]})
    flagged, explained, per_batch = [], [], []
    for level in run.levels:
        n = 0
        for ref, got in zip(refs, level.results):
            if not ref.ok or not got.ok or got.text == ref.text:
                continue
            flags = signature_flags(signer(got.id, got, True), signer(ref.id, ref, True), MIN_SIGNATURE_TOKENS)
            if not flags:
                continue
            row = {"batch": level.concurrency, "id": got.id, "slice": got.slice,
                   "signatures": [f.message for f in flags], "text": (got.text or "")[-200:],
                   "reference": (ref.text or "")[-200:]}
            if got.text in null_texts.get(got.id, ()):
                explained.append({**row, "why": "the reference produced the same text in the null run"})
            elif all(f.severity <= null_worst.get(f.kind, -1.0) for f in flags):
                explained.append({**row, "why": "the null showed the same signatures at least as strongly"})
            else:
                n += 1
                flagged.append(row)
        per_batch.append({"batch": level.concurrency, "outputs": len(level.results), "flagged": n})
    total = sum(r["outputs"] for r in per_batch)
    unit = _pseudo_unit(signer)
    summary = (f"no corruption signature beyond the null in {total} endpoint outputs"
               + (f" ({len(explained)} explained by the null)" if explained else "")
               if not flagged else
               f"{len(flagged)} of {total} endpoint outputs show signatures their reference lacks and the null "
               f"does not explain") + f"; tokens: {unit}"
    figures = {"outputs_checked": total, "flagged": len(flagged), "explained_by_null": len(explained),
               "null_flagged": len(null_flagged), "null_worst": null_worst, "tokens": unit,
               "min_signature_tokens": MIN_SIGNATURE_TOKENS,
               "test": "a signature the base output lacks, beyond what the null (the reference diverging from "
                       "itself) shows: the same text, or the same kind of signature at least as strong, explains "
                       "it; any unexplained flag fails",
               "perplexity": "the reference's score of the reference's tokens"}
    tables = [("Corruption: flagged outputs beside their reference", ["batch", "prompt", "signatures", "output",
                                                                      "reference (base)"],
               [[r["batch"], r["id"], "; ".join(r["signatures"]), r["text"], r["reference"]] for r in flagged[:20]])]
    return _check(not flagged, summary, figures,
                  {"per_batch": per_batch, "flagged": flagged[:50], "explained": explained[:50],
                   "null_flagged": null_flagged[:50], "tables": tables if flagged else []})


def _pseudo_unit(signer: _Signer) -> str:
    return "words, where the reference could not tokenize" if signer.words else signer.toks.unit


def _tps(results: list[PromptResult]) -> float | None:
    toks = sum(r.completion_tokens or 0 for r in results if r.ok)
    secs = sum(r.latency_s or 0.0 for r in results if r.ok)
    return toks / secs if secs else None


def _s_per_token(r: PromptResult) -> float | None:
    """Seconds per completion token of one answer, end to end (None: failed or empty)."""
    if not r.ok or not r.completion_tokens or not r.latency_s:
        return None
    return r.latency_s / r.completion_tokens


def _request_spec(r: PromptResult) -> tuple[dict, str] | None:
    """One answer's speculative figures and where they come from: its response's own
    fields, else the endpoint's /metrics difference over it alone (client.run_paired)."""
    if r.server_info:
        return r.server_info, "responses"
    if r.counter_spec:
        return r.counter_spec, "/metrics counters per request"
    return None


def _response_sums(results: list[PromptResult]) -> dict | None:
    """Per-request speculative figures summed over answers (None when no answer had any)."""
    infos = [x for r in results if r.ok and (x := _request_spec(r)) is not None]
    if not infos:
        return None

    def total(key):
        vals = [i.get(key) for i, _ in infos]
        return sum(vals) if vals and all(v is not None for v in vals) else None
    return {"source": infos[0][0].get("source"), "via": infos[0][1], "responses": len(infos),
            "drafted": total("drafted"), "accepted": total("accepted"), "verify_steps": total("verify_steps"),
            "target_passes": total("target_passes")}


def _slice_row(name: str, spec: list[PromptResult], plain: list[PromptResult] | None,
               counters: SpecCounters | None = None, pairs: list[tuple] | None = None) -> dict:
    """One slice's figures from each answer's own speculative figures (_request_spec); the
    pooled row takes the level's /metrics counters where the server has them (and says
    which). pairs: (plain, speculative) seconds per token of each prompt in each repeat,
    timed side by side: the speedup and its interval. What acceptance predicts is tokens per
    target pass, an upper bound: the server's step costs are not known from outside."""
    sums = _response_sums(spec)
    toks = sum(r.completion_tokens or 0 for r in spec if r.ok)
    rate = mal = None
    source = None
    if sums:
        if sums["drafted"]:
            rate = sums["accepted"] / sums["drafted"]
        if sums["target_passes"]:
            mal = toks / sums["target_passes"]
        elif sums["verify_steps"]:
            mal = 1 + sums["accepted"] / sums["verify_steps"]
        elif sums["accepted"] is not None and toks > sums["accepted"]:
            # llama.cpp counts no passes: each (the prefill's included) emits its accepted
            # drafts and one token of its own
            mal = toks / (toks - sums["accepted"])
        source = f"{sums['via']} ({sums['source']})"
    per_pos: list = []
    gauges = None
    if counters is not None and not counters.from_gauges:
        rate = counters.acceptance_rate if counters.draft_tokens else rate
        mal = _tokens_per_pass(counters) or mal
        per_pos = [a for a in counters.acceptance_per_position if a is not None]
        source = f"/metrics counters ({counters.source})"
    elif counters is not None:
        gauges = {"accept_length_gauge": counters.accept_length_gauge, "accept_rate_gauge": counters.accept_rate_gauge,
                  "samples": counters.gauge_samples,
                  "note": "SGLang gauges: last-batch values sampled during the run, not this level's figures"}
    s_tps, p_tps = _tps(spec), (_tps(plain) if plain else None)
    sp = speedup_interval([p for p, _ in pairs], [s for _, s in pairs]) if pairs else None
    return {"slice": name, "prompts": len(spec), "tokens": toks, "mean_accepted_length": mal, "acceptance_rate": rate,
            "acceptance_per_position": per_pos, "plain_tokens_per_s": p_tps, "figures_from": source,
            "response_sums": sums, "gauges": gauges, "speculative_tokens_per_s": s_tps,
            **interval_figures(sp, predicted_speedup(mal))}


def _tokens_per_pass(spec: SpecCounters) -> float | None:
    """Tokens per target pass where the server counts passes (verispec), else
    1 + accepted / verification steps (vLLM, llama.cpp; bonus token included)."""
    return spec.tokens_per_target_pass or spec.mean_acceptance_length


def _counters_agree(sums: dict | None, counters: SpecCounters | None) -> bool | None:
    """Do the answers' own fields add up to the /metrics counters' differences?"""
    if not sums or counters is None or counters.from_gauges or sums["drafted"] is None:
        return None
    return (sums["drafted"] == counters.draft_tokens and sums["accepted"] == counters.accepted_tokens)


def _slices(run: EndpointRun, reference: EndpointRun | None,
            speed_runs: list[tuple[EndpointRun, EndpointRun]] = ()) -> CheckResult:
    """Per slice at the first level; speedups from every prompt's pairs: the paired run's
    and each of speed_runs' (further paired runs at concurrency 1)."""
    level = run.levels[0]
    plain = reference.levels[0].results if reference else None
    repeats = ([(level.results, plain)] if plain else []) + [(e.levels[0].results, r.levels[0].results)
                                                             for e, r in speed_runs]

    def pairs(idx):
        return [(_s_per_token(ref[i]), _s_per_token(got[i])) for got, ref in repeats for i in idx]
    names = list(dict.fromkeys(r.slice for r in level.results))
    rows = []
    for name in names:
        idx = [i for i, r in enumerate(level.results) if r.slice == name]
        rows.append(_slice_row(name, [level.results[i] for i in idx], [plain[i] for i in idx] if plain else None,
                               pairs=pairs(idx)))
    pooled = _slice_row("pooled", level.results, plain, level.spec, pairs(range(len(level.results))))
    agree = _counters_agree(pooled["response_sums"], level.spec)
    measured = [r for r in rows if r["speedup"] is not None]
    if measured:  # best and worst among the slices whose speedup says something
        ranked, key = [r for r in measured if r["verdict"] in RANKED], (lambda r: r["speedup"])
    else:  # no reference: by acceptance alone
        ranked, key = rows, (lambda r: r["mean_accepted_length"] or 0)
    best, worst = (max(ranked, key=key)["slice"], min(ranked, key=key)["slice"]) if ranked else (None, None)
    summary = (f"concurrency {level.concurrency}"
               + (f", {pooled['pairs']} pairs ({len(level.results)} prompts x {len(repeats)} repeats)"
                  if repeats else "")
               + ": pooled speedup "
               + (pooled["speedup_text"] if pooled["speedup"] else "n/a (no separate reference)")
               + (f", {pooled['mean_accepted_length']:.2f} tokens/target pass" if pooled["mean_accepted_length"]
                  else "")
               + (f", acceptance {pooled['acceptance_rate']:.1%}" if pooled["acceptance_rate"] is not None else "")
               + (f" (from {pooled['figures_from']})" if pooled["figures_from"] else
                  ", acceptance unknown: the server publishes no speculative counters")
               + ("" if agree is None else "; responses agree with /metrics" if agree
                  else "; responses DISAGREE with /metrics"))
    counts = verdict_counts(rows)
    if counts:
        summary += f"; of {len(rows)} slices {counts}"
    figures = {"pooled_speedup": pooled["speedup"], "pooled_speedup_ci": pooled["speedup_ci"],
               "pooled_verdict": pooled["verdict"], "pooled_predicted": pooled["predicted"],
               "pooled_pairs": pooled["pairs"], "speed_repeats": len(repeats),
               "pooled_mean_accepted_length": pooled["mean_accepted_length"],
               "pooled_acceptance_rate": pooled["acceptance_rate"],
               "pooled_acceptance_per_position": pooled["acceptance_per_position"],
               "figures_from": pooled["figures_from"], "responses_agree_with_counters": agree,
               "best_slice": best, "worst_slice": worst, "gauges": pooled["gauges"],
               "noise_slices": [r["slice"] for r in rows if r["verdict"] == "noise"],
               "unresolved_slices": [r["slice"] for r in rows if r["verdict"] == "unresolved"],
               "timing": "end to end per request; each prompt to the endpoint and to the reference back to back "
                         "(client.run_paired), once per repeat, the order flipped repeat by repeat; a pair is "
                         "one prompt in one repeat",
               "interval": "95% t interval of the mean log ratio over the pairs",
               "predicted_from": "tokens per target pass: an upper bound (the server's step costs are not known)",
               "server_counters": level.spec.to_dict() if level.spec else None}
    return _check(True, summary, figures, {"slices": rows, "pooled": pooled}, informational=True)


def _wave_pairs(lv: LevelRun, ref: LevelRun | None) -> list[tuple[float, float]]:
    """(plain, speculative) seconds per token of each wave both sides answered in full: the
    wave's wall time over its completion tokens."""
    if ref is None or not lv.waves or not lv.wave_walls or ref.waves != lv.waves or not ref.wave_walls:
        return []
    out = []
    for idx, wall, ref_wall in zip(lv.waves, lv.wave_walls, ref.wave_walls):
        got, base = [lv.results[i] for i in idx], [ref.results[i] for i in idx]
        if all(r.ok and r.completion_tokens for r in got + base):
            out.append((ref_wall / sum(r.completion_tokens for r in base),
                        wall / sum(r.completion_tokens for r in got)))
    return out


def _load(run: EndpointRun, reference: EndpointRun | None) -> CheckResult:
    ref_by_c = {lv.concurrency: lv for lv in reference.levels} if reference else {}
    points = []
    for lv in run.levels:
        ok = [r for r in lv.results if r.ok]
        ref = ref_by_c.get(lv.concurrency)
        s_tps = lv.completion_tokens / lv.wall_s if lv.wall_s else None
        p_tps = ref.completion_tokens / ref.wall_s if ref and ref.wall_s else None

        def ms_per_token(results):
            v = [1000 * r.latency_s / r.completion_tokens for r in results if r.ok and r.completion_tokens]
            return sum(v) / len(v) if v else None
        mal = _tokens_per_pass(lv.spec) if lv.spec and not lv.spec.from_gauges else None
        pairs = _wave_pairs(lv, ref)
        sp = speedup_interval([p for p, _ in pairs], [s for _, s in pairs]) if pairs else None
        points.append({"batch": lv.concurrency,
                       "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok) / len(ok) if ok else 0,
                       "plain_tokens_per_s": p_tps, "speculative_tokens_per_s": s_tps,
                       "plain_ms_per_token": ms_per_token(ref.results) if ref else None,
                       "speculative_ms_per_token": ms_per_token(lv.results),
                       "mean_accepted_length": mal, **interval_figures(sp, predicted_speedup(mal)),
                       "server_counters": lv.spec.to_dict() if lv.spec else None})
    below = [p["batch"] for p in points if p["speedup"] is not None and p["speedup"] < 1]
    summary = ("throughput per load level: " + ", ".join(
        f"c{p['batch']} {p['speculative_tokens_per_s'] or 0:.1f} tok/s"
        + (f" ({p['speedup_text']})" if p["speedup"] else "") for p in points)
        + (f"; slower than the reference from concurrency {below[0]}" if below else ""))
    counts = verdict_counts(points)
    if counts:
        summary += f"; of {len(points)} levels {counts}"
    return _check(True, summary,
                  {"crossover_concurrency": below[0] if below else None,
                   "verdicts": {"short": {str(p["batch"]): p["verdict"] for p in points}},
                   "pairs": "one per wave: its wall time per completion token, endpoint and reference",
                   "interval": "95% t interval of the mean log ratio over the waves",
                   "predicted_from": "tokens per target pass: an upper bound (the server's step costs are not known)"},
                  {"points": {"short": points}}, informational=True)


def _drafter_record(info: ServerInfo) -> dict:
    """The drafter, k, policy and rule as the server reports them; "not published" where it does not."""
    sp = info.speculative
    if info.kind == "verispec":
        d = sp.get("drafter")
        return {"spec": d, "name": d or "none (speculation off)", "k": sp.get("k", "not published"),
                "policy": sp.get("policy", "not published"), "rule": sp.get("rule", "not published"),
                "model_files": None}
    if info.kind == "llama.cpp":
        n, on = sp.get("slots"), sp.get("slots_speculative")
        drafting = ("unknown (no /slots)" if n is None else f"speculative in {on} of {n} slots" if on
                    else "no speculation (no slot drafts)")
        return {"spec": sp.get("speculative.types"), "name": f"llama.cpp: {drafting}",
                "k": "not published by llama-server", "policy": "llama.cpp's own (--spec-* flags)",
                "rule": "not published (llama.cpp verifies with its own sampler)", "model_files": None}
    if info.kind == "sglang":
        algo = sp.get("speculative_algorithm")
        return {"spec": algo, "name": f"SGLang {algo}" if algo else "none", "model_files": None,
                "k": sp.get("speculative_num_draft_tokens", "not published"),
                "policy": f"steps {sp.get('speculative_num_steps')}, topk {sp.get('speculative_eagle_topk')}",
                "rule": "not published"}
    return {"spec": None, "name": "not published by the server", "k": "not published", "policy": "not published",
            "rule": "not published", "model_files": None}


def _record(run, reference, info: ServerInfo, ref_info: ServerInfo | None, reference_kind, prompts, chat,
            max_tokens, concurrency, suite_spec, suite_size, started) -> dict:
    import hashlib
    import json

    from ..record import PACKAGES, _version
    digest = hashlib.sha256(json.dumps([[p.id, p.slice, p.prompt] for p in prompts]).encode()).hexdigest()
    drafter = _drafter_record(info)
    sampling = {"temperature": 0.0, "seed": "none sent (greedy)", "sent": "temperature 0 (greedy)"}
    rec = {
        "started_at": started,
        "target": {"spec": run.model, "name": run.model, "files": None},
        "drafter": drafter,
        "rule": drafter["rule"],
        "engine": {"endpoint": run.url, "server": info.kind, "version": info.version, "reference": reference_kind,
                   "batch_sizes": list(concurrency), "max_tokens": max_tokens},
        "endpoint": {"url": run.url, "kind": info.kind, "model": run.model, "logprobs": run.logprobs,
                     "reference": reference.url if reference else None, "reference_kind": reference_kind},
        "server": info.to_dict(),
        "reference_server": ref_info.to_dict() if ref_info else None,
        "seed": sampling["seed"],
        "temperature": 0.0,
        "sampling": sampling,
        "suite": {"spec": suite_spec, "prompts_audited": len(prompts), "prompts_in_suite": suite_size or len(prompts),
                  "sha256_of_audited_prompts": digest},
        "prompt_format": "chat (the server's template)" if chat else "raw text",
        "sizes": {"name": "endpoint", "max_new_tokens": max_tokens},
        "packages": {name: _version(name) for name in PACKAGES} | {"python": sys.version.split()[0]},
        "machine": {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
                    "role": "client (the server's machine is not visible)"},
    }
    rec["retest_triggers"] = [{"trigger": t, "key": key, "audited": v} for key, t, v in (
        ("model", "served model", run.model),
        ("model_files", "model files (server-reported path / id)",
         info.settings.get("model_path") or info.settings.get("model_id") or info.settings.get("model")),
        ("server", "server software and version", f"{info.kind} {info.version or '(version not published)'}"),
        ("drafter", "drafter (server-reported)", drafter["name"]),
        ("k", "draft length k", drafter["k"]),
        ("rule", "verification rule", drafter["rule"]),
        ("batch_levels", "concurrency levels audited", list(concurrency)),
        ("slots", "server batch slots", info.settings.get("total_slots") or info.settings.get("max_running_requests")),
        ("prompt_format", "prompt format / chat template", rec["prompt_format"]),
        ("suite", "workload mix (suite slices)", digest[:16]))]
    return rec
