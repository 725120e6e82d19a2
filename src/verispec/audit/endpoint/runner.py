"""`verispec audit --endpoint URL`: the audit's checks against any OpenAI-compatible server,
written as the same report files (report.json, report.md, report.html) as the offline audit.

What can be checked from outside, with the client in client.py:
* equivalence at temperature 0 against the deployment's own null run (null.py): the
  reference (--reference-endpoint, or a verispec server with ``"verispec": {"speculate":
  false}``) at concurrency 1 is the base; the reference again at every level is the null,
  the endpoint at every level the test, both compared with the base on text, with the
  base's top-2 logprob margin at the first divergence. No reference: the endpoint is its
  own base and null (load invariance only, and the report says what is not separable);
* the sampled distribution at temperature 1 from the answers' top-n logprobs (sampled.py);
* corruption signatures of the text against the base's (words stand in for tokens;
  perplexity from the returned logprobs when there are any);
* per-slice speed and acceptance (each answer's speculative fields, the level's /metrics
  counters for the pooled figures: counters.py) and throughput per load level, the
  endpoint and the reference timed side by side (client.run_paired);
* the server's kind, version and settings as it reports them (kinds.py), in the record;
* with an earlier report, the re-test gate (compare.py).

Wiring into `verispec audit` (cli/audit.py): ``add_endpoint_arguments(a)`` in
add_audit_parser, and at the top of cmd_audit
``if args.endpoint: from .endpoint.runner import cmd_endpoint_audit; return cmd_endpoint_audit(args)``.
"""

from __future__ import annotations

import datetime
import os
import platform
import random
import re
import sys
import time
from dataclasses import replace

import httpx

from .client import EndpointConfig, EndpointRun, PromptResult, audit_endpoint, audit_paired
from .compare import CompareError, comparison_check, compare_reports, load_report
from .counters import SpecCounters
from . import rescore
from .kinds import ServerInfo, probe
from .tokens import ReferenceTokens
from .null import ALPHA as NULL_ALPHA
from .null import Comparison, compare, verdict
from .sampled import DRAFTING_PROMPTS, distribution_figures, drafting_mix, sampled_run, sampler_settings

WORD = re.compile(r"\w+|[^\w\s]|\s+")

# the checks the endpoint audit runs (lossy-rule and record come with any of them), and those
# that read the greedy runs (base, endpoint and null): without them those runs are not made
ENDPOINT_CHECKS = ("equivalence", "distribution", "corruption", "slices", "load")
GREEDY_CHECKS = {"equivalence", "corruption", "slices", "load"}
# a speculative server's sampled phase must verify this many draft tokens to have power
MIN_VERIFIED_DRAFTS = 200


def _concurrency(s: str) -> tuple[int, ...]:
    import argparse
    try:
        levels = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got {s!r}")
    return levels


def _int_at_least(low: int):
    def parse(s: str) -> int:
        import argparse
        try:
            n = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        return n
    return parse


def add_endpoint_arguments(a) -> None:
    """The endpoint options of `verispec audit` (with --suite, --out, --quick of the audit)."""
    a.add_argument("--endpoint", default=None,
                   help="audit this OpenAI-compatible server (base URL) instead of a local engine")
    a.add_argument("--reference-endpoint", default=None,
                   help="non-speculative reference server (default: the endpoint itself with speculation "
                        "off when it is verispec serve)")
    a.add_argument("--model", dest="endpoint_model", default=None, help="model id (default: /v1/models' first)")
    a.add_argument("--api-key", dest="endpoint_api_key", default=None, help="bearer token for the endpoint(s)")
    a.add_argument("--concurrency", type=_concurrency, default=(1, 8),
                   help="load levels: concurrent clients, comma-separated (default 1,8)")
    a.add_argument("--max-tokens", dest="endpoint_max_tokens", type=int, default=64,
                   help="max_tokens per request (default 64)")
    a.add_argument("--raw", dest="endpoint_raw", action="store_true",
                   help="send raw prompts to /v1/completions instead of chat messages")
    a.add_argument("--sampled-tokens", type=_int_at_least(0), default=2048,
                   help="tokens sampled at temperature 1 for the distribution check (0: skip; default 2048)")
    a.add_argument("--score-with", choices=("auto", "endpoint", "reference"), default="auto",
                   help="who scores the temperature-1 tokens: auto (the endpoint's own logprobs, and the "
                        "reference's for tokens sent without any: llama.cpp endpoint and reference), endpoint "
                        "(its own only), reference (every token by the reference)")
    a.add_argument("--compare-to", default=None, metavar="OLD/report.json",
                   help="compare with an earlier endpoint audit: changed re-test triggers, moved acceptance and "
                        "speedup; exit 1 when equivalence got worse or a speedup fell beyond its noise")
    a.add_argument("--null-repeats", type=_int_at_least(1), default=1,
                   help="run the null (reference vs itself) this many times, pooled (default 1)")


def cmd_endpoint_audit(args) -> int:
    from ..context import select_prompts
    from ..report import write_reports
    from ..suite import load_suite

    suite = load_suite(args.suite)
    seed = getattr(args, "seed", 0)
    prompts = select_prompts(suite, 2 if getattr(args, "quick", False) else None, seed)
    try:
        previous = load_report(args.compare_to) if args.compare_to else None
    except CompareError as e:
        print(f"verispec audit --endpoint: {e}", file=sys.stderr)
        return 2
    try:
        report = run_endpoint_audit(args.endpoint, prompts, reference_url=args.reference_endpoint,
                                    model=args.endpoint_model, api_key=args.endpoint_api_key,
                                    chat=not args.endpoint_raw, max_tokens=args.endpoint_max_tokens,
                                    concurrency=args.concurrency, suite_spec=args.suite, suite_size=len(suite),
                                    null_repeats=args.null_repeats, sampled_tokens=args.sampled_tokens,
                                    previous=previous, score_with=args.score_with, only=tuple(getattr(args, "only", None) or ()),
                                    min_verified_drafts=getattr(args, "min_verified_drafts", MIN_VERIFIED_DRAFTS),
                                    seed=seed)
    except EndpointError as e:
        print(f"verispec audit --endpoint: cannot audit: {e}", file=sys.stderr)
        return 2
    paths = write_reports(report, args.out)
    print(f"verdict: {report['verdict'].upper()}"
          + (f" (failed: {', '.join(report['failed_checks'])})" if report["failed_checks"] else "")
          + f" in {report['elapsed_s']:.0f} s", file=sys.stderr)
    for c in report["checks"]:
        print(f"  {c['name']:<20} {'info' if c['informational'] else ('pass' if c['passed'] else 'FAIL'):<5} "
              f"{c['summary']}", file=sys.stderr)
    print(f"reports: {paths['json']}, {paths['md']}, {paths['html']}", file=sys.stderr)
    return 0 if report["verdict"] == "pass" else 1


class EndpointError(RuntimeError):
    """The endpoint could not be audited at all (unreachable, no model, refused every request)."""


def _run(cfg: EndpointConfig, prompts: list, what: str) -> EndpointRun:
    try:
        return audit_endpoint(cfg, prompts)
    except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as e:
        raise EndpointError(f"{what} at {cfg.base}: {type(e).__name__}: {e}") from None


def _run_paired(cfg: EndpointConfig, ref_cfg: EndpointConfig, prompts: list) -> tuple[EndpointRun, EndpointRun]:
    try:
        return audit_paired(cfg, ref_cfg, prompts)
    except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as e:
        raise EndpointError(f"the endpoint and its reference at {cfg.base} / {ref_cfg.base}: "
                            f"{type(e).__name__}: {e}") from None


def run_endpoint_audit(url: str, prompts: list, *, reference_url: str | None = None, model: str | None = None,
                       api_key: str | None = None, chat: bool = True, max_tokens: int = 64,
                       concurrency: tuple[int, ...] = (1, 8), suite_spec: str = "default",
                       suite_size: int | None = None, alpha: float = NULL_ALPHA, null_repeats: int = 1,
                       sampled_tokens: int = 0, previous: dict | None = None, score_with: str = "auto",
                       only: tuple[str, ...] = (), min_verified_drafts: int = MIN_VERIFIED_DRAFTS,
                       seed: int = 0) -> dict:
    """Run the endpoint, its reference and the reference's null runs over the prompts; the
    report as a dict in the offline audit's format (audit.report.write_reports renders it).

    Runs, in order: the base (reference at concurrency 1), then the endpoint and the
    reference at every level side by side (client.run_paired: alternating waves, so each
    prompt's speedup is a ratio of two answers timed moments apart; the reference's half
    is the null and the plain speed), then the reference alone for further null repeats.
    Without a reference, the endpoint itself is base and null (at concurrency 1 only).
    null_repeats: how many times the null runs (pooled). sampled_tokens > 0: the distribution check at
    temperature 1 over at least that many tokens (sampled.py), scored as score_with says:
    "auto" by the endpoint's own logprobs and, for the tokens it sends none for, by the
    reference (rescore.py: a llama.cpp endpoint and reference; else the endpoint's own
    only), "endpoint" its own only, "reference" every token by the reference (an
    EndpointError where that cannot run). previous: an earlier endpoint audit's report,
    compared with this one as a gate (compare.py). only: the checks to run (ENDPOINT_CHECKS;
    empty: all); the greedy runs are made only for the checks that read them.
    min_verified_drafts: a speculative server's sampled phase verifies at least this many
    draft tokens (its counters' difference over the phase) or the check is inconclusive.
    seed: the sampled phase's prompt order and the distribution check's tie-breaks (the
    prompts themselves are chosen by the caller: context.select_prompts); no seed is sent to
    the server, whose own draws stay unseeded as a deployment's are."""
    if null_repeats < 1:
        raise ValueError(f"null_repeats must be >= 1, got {null_repeats}")
    unknown = set(only) - set(ENDPOINT_CHECKS)
    if unknown:
        raise EndpointError(f"--only {','.join(sorted(unknown))}: not a check of the endpoint audit "
                            f"(from outside: {', '.join(ENDPOINT_CHECKS)})")
    wanted = set(only or ENDPOINT_CHECKS)
    greedy = bool(wanted & GREEDY_CHECKS)
    sampled_tokens = sampled_tokens if "distribution" in wanted else 0
    t0 = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info = probe(EndpointConfig(url).base, api_key)
    cfg = EndpointConfig(url, model=model, api_key=api_key, chat=chat, max_tokens=max_tokens,
                         concurrency=concurrency, logprobs=True)
    ref_info = None
    if reference_url:
        ref_cfg = replace(cfg, url=reference_url, extra_body=None)
        ref_info = probe(ref_cfg.base, api_key)
        reference_kind = f"reference endpoint {ref_cfg.base} ({ref_info.kind})"
    elif info.kind == "verispec":
        ref_cfg = replace(cfg, extra_body={"verispec": {"speculate": False}})
        reference_kind = "the same verispec server with speculation off"
    else:
        ref_cfg = None
        reference_kind = ("none: the endpoint's own answers at concurrency 1 (load invariance only; "
                          "speculation cannot be separated from batching numerics)")
    if not greedy and not sampled_tokens:
        raise EndpointError("--only distribution with --sampled-tokens 0: nothing to run")
    base_cfg = replace(ref_cfg or cfg, concurrency=(1,))
    run = base = null_run = reference = srun = None
    null_runs: list[EndpointRun] = []
    tests, base_results = [], []
    nulls: dict[int, Comparison] = {}
    if greedy:
        base = _run(base_cfg, prompts, "the base run (reference at concurrency 1)")
        if ref_cfg:  # the endpoint and the first null timed side by side: the speedups' pairs
            run, first_null = _run_paired(cfg, ref_cfg, prompts)
            null_runs = [first_null] + [_run(ref_cfg, prompts, "the null run") for _ in range(null_repeats - 1)]
        else:
            run = _run(cfg, prompts, "the endpoint")
            null_runs = [_run(base_cfg, prompts, "the null run") for _ in range(null_repeats)]
        null_run = null_runs[0]
        reference = null_run if ref_cfg else None
        base_results = base.levels[0].results
        tests = [compare(base_results, lv.results, lv.concurrency) for lv in run.levels]
        nulls = {}
        for nr in null_runs:  # repeats pool per level: more null divergences give the margins a scale
            for lv in nr.levels:
                nulls.setdefault(lv.concurrency, Comparison(lv.concurrency)).rows += compare(
                    base_results, lv.results, lv.concurrency).rows

    checks = []
    if info.kind == "verispec" and "rule" in info.speculative:
        lossy = bool(info.speculative.get("lossy"))
        rule = info.speculative["rule"]
        checks.append(_check("lossy-rule", not lossy, f"server rule {rule!r} is " + ("LOSSY" if lossy else "exact"),
                             {"rule": rule, "lossy": lossy}))
    if "equivalence" in wanted:
        checks.append(_equivalence(tests, nulls, base, reference_kind, ref_cfg is not None, alpha))
    if sampled_tokens:
        why_not = rescore.supported(info.kind, ref_info.kind if ref_info else None)
        if score_with == "reference" and why_not:
            raise EndpointError(f"--score-with reference: {why_not}")
        sprompts = drafting_mix(prompts)
        if seed:
            random.Random(seed).shuffle(sprompts)
        try:
            if score_with != "endpoint" and not why_not:
                srun = rescore.rescored_sampled_run(cfg, ref_cfg, sprompts, sampled_tokens, max(concurrency),
                                                    scorer=score_with, kind=info.kind)
            else:
                srun = sampled_run(cfg, info.kind, sprompts, sampled_tokens, max(concurrency))
        except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as e:
            raise EndpointError(f"the sampled run at {cfg.base}: {type(e).__name__}: {e}") from None
        checks.append(_distribution(srun, sampled_tokens, info, min_verified_drafts,
                                    None if score_with == "endpoint" or not why_not else why_not, seed))
    if "corruption" in wanted:
        toks = ReferenceTokens(ref_cfg or cfg, ref_info.kind if ref_info else info.kind)
        try:
            checks.append(_corruption(run, base_results, null_runs, _Signer(toks, prompts, chat)))
        finally:
            toks.close()
    if "slices" in wanted:
        checks.append(_slices(run, reference))
    if "load" in wanted:
        checks.append(_load(run, reference))
    record = _record(run or srun, reference, info, ref_info, reference_kind, prompts, chat, max_tokens, concurrency,
                     suite_spec, suite_size, started)
    record["suite"]["audit_seed"] = seed  # the prompts chosen, the sampled phase's order, the tie-breaks
    record["suite"]["prompt_ids"] = [p.id for p in prompts]
    dist = next((c for c in checks if c["name"] == "distribution"), None)
    if dist is not None:
        record["sampling"]["distribution_check"] = {"sent": dist["figures"]["sampler_sent"], "seed": "none sent",
                                                    "audit_seed": seed,
                                                    "top_logprobs": dist["figures"]["top_logprobs"]}
    audited = run or srun
    checks.append(_check("record", True, f"endpoint {audited.url} ({info.kind} {info.version or 'version unknown'}), "
                                         f"model {audited.model}; {len(record['retest_triggers'])} re-test triggers",
                         {"kind": info.kind, "version": info.version, "model": audited.model}, informational=True))
    failed = [c["name"] for c in checks if not c["passed"]]
    samples = [{"slice": p.slice, "prompt": p.prompt, "reference": r.text or "", "speculative": g.text or ""}
               for p, r, g in list(zip(prompts, base_results, run.levels[-1].results if run else []))[:6]]
    report = {"verdict": "fail" if failed else "pass", "failed_checks": failed,
              "elapsed_s": round(time.perf_counter() - t0, 1), "checks": checks, "record": record,
              "samples": samples, "only": list(only),
              "endpoint_runs": {"endpoint": run.to_dict(), "base": base.to_dict(), "reference": null_run.to_dict()}
              if greedy else {"sampled": srun.to_dict() if sampled_tokens else None}}
    if previous is not None:  # --compare-to: the gate against an earlier audit
        report["checks"].append(comparison_check(compare_reports(previous, report)))
        report["failed_checks"] = [c["name"] for c in report["checks"] if not c["passed"]]
        report["verdict"] = "fail" if report["failed_checks"] else "pass"
    return report


def _check(name, passed, summary, figures=None, details=None, informational=False) -> dict:
    return {"name": name, "passed": passed, "informational": informational, "summary": summary,
            "elapsed_s": 0.0, "figures": figures or {}, "details": details}


def _equivalence(tests: list[Comparison], nulls: dict[int, Comparison], base: EndpointRun, reference_kind: str,
                 separable: bool, alpha: float) -> dict:
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
    return _check("equivalence", not failures, summary, figures,
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
                  no_reference: str | None = None, seed: int = 0) -> dict:
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
    return _check("distribution", f["passed"], summary, f, {"answers": f["answers"]})


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


def _corruption(run: EndpointRun, refs: list[PromptResult], null_runs: list[EndpointRun], signer: _Signer) -> dict:
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
    return _check("corruption", not flagged, summary, figures,
                  {"per_batch": per_batch, "flagged": flagged[:50], "explained": explained[:50],
                   "null_flagged": null_flagged[:50], "tables": tables if flagged else []})


def _pseudo_unit(signer: _Signer) -> str:
    return "words, where the reference could not tokenize" if signer.words else signer.toks.unit


def _tps(results: list[PromptResult]) -> float | None:
    toks = sum(r.completion_tokens or 0 for r in results if r.ok)
    secs = sum(r.latency_s or 0.0 for r in results if r.ok)
    return toks / secs if secs else None


def _response_sums(results: list[PromptResult]) -> dict | None:
    """Per-response speculative fields summed over answers (None when no answer had any)."""
    infos = [r.server_info for r in results if r.ok and r.server_info]
    if not infos:
        return None

    def total(key):
        vals = [i.get(key) for i in infos]
        return sum(vals) if vals and all(v is not None for v in vals) else None
    return {"source": infos[0].get("source"), "responses": len(infos), "drafted": total("drafted"),
            "accepted": total("accepted"), "verify_steps": total("verify_steps"),
            "target_passes": total("target_passes")}


def _slice_row(name: str, spec: list[PromptResult], plain: list[PromptResult] | None,
               counters: SpecCounters | None = None) -> dict:
    """One slice's figures from the answers' own speculative fields; the pooled row takes
    the level's /metrics counters where the server has them (and says which)."""
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
        source = f"responses ({sums['source']})"
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
    return {"slice": name, "prompts": len(spec), "tokens": toks, "mean_accepted_length": mal, "acceptance_rate": rate,
            "acceptance_per_position": per_pos, "plain_tokens_per_s": p_tps, "figures_from": source,
            "response_sums": sums, "gauges": gauges,
            "speculative_tokens_per_s": s_tps, "speedup": s_tps / p_tps if s_tps and p_tps else None}


def _tokens_per_pass(spec: SpecCounters) -> float | None:
    """Tokens per target pass where the server counts passes (verispec), else
    1 + accepted / verification steps (vLLM, llama.cpp; bonus token included)."""
    return spec.tokens_per_target_pass or spec.mean_acceptance_length


def _counters_agree(sums: dict | None, counters: SpecCounters | None) -> bool | None:
    """Do the answers' own fields add up to the /metrics counters' differences?"""
    if not sums or counters is None or counters.from_gauges or sums["drafted"] is None:
        return None
    return (sums["drafted"] == counters.draft_tokens and sums["accepted"] == counters.accepted_tokens)


def _slices(run: EndpointRun, reference: EndpointRun | None) -> dict:
    level = run.levels[0]
    plain = reference.levels[0].results if reference else None
    names = list(dict.fromkeys(r.slice for r in level.results))
    rows = []
    for name in names:
        idx = [i for i, r in enumerate(level.results) if r.slice == name]
        rows.append(_slice_row(name, [level.results[i] for i in idx], [plain[i] for i in idx] if plain else None))
    pooled = _slice_row("pooled", level.results, plain, level.spec)
    agree = _counters_agree(pooled["response_sums"], level.spec)
    ranked = [r for r in rows if r["speedup"] is not None] or rows
    key = (lambda r: r["speedup"]) if any(r["speedup"] is not None for r in rows) else (
        lambda r: r["mean_accepted_length"] or 0)
    best, worst = (max(ranked, key=key)["slice"], min(ranked, key=key)["slice"]) if ranked else (None, None)
    summary = (f"concurrency {level.concurrency}: pooled speedup "
               + (f"{pooled['speedup']:.2f}x" if pooled["speedup"] else "n/a (no separate reference)")
               + (f", {pooled['mean_accepted_length']:.2f} tokens/target pass" if pooled["mean_accepted_length"]
                  else "")
               + (f", acceptance {pooled['acceptance_rate']:.1%}" if pooled["acceptance_rate"] is not None else "")
               + (f" (from {pooled['figures_from']})" if pooled["figures_from"] else
                  ", acceptance unknown: the server publishes no speculative counters")
               + ("" if agree is None else "; responses agree with /metrics" if agree
                  else "; responses DISAGREE with /metrics"))
    figures = {"pooled_speedup": pooled["speedup"], "pooled_mean_accepted_length": pooled["mean_accepted_length"],
               "pooled_acceptance_rate": pooled["acceptance_rate"],
               "pooled_acceptance_per_position": pooled["acceptance_per_position"],
               "figures_from": pooled["figures_from"], "responses_agree_with_counters": agree,
               "best_slice": best, "worst_slice": worst, "gauges": pooled["gauges"],
               "server_counters": level.spec.to_dict() if level.spec else None}
    return _check("slices", True, summary, figures, {"slices": rows, "pooled": pooled}, informational=True)


def _load(run: EndpointRun, reference: EndpointRun | None) -> dict:
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
        points.append({"batch": lv.concurrency,
                       "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok) / len(ok) if ok else 0,
                       "plain_tokens_per_s": p_tps, "speculative_tokens_per_s": s_tps,
                       "plain_ms_per_token": ms_per_token(ref.results) if ref else None,
                       "speculative_ms_per_token": ms_per_token(lv.results),
                       "mean_accepted_length": (_tokens_per_pass(lv.spec) if lv.spec and not lv.spec.from_gauges
                                                else None),
                       "speedup": s_tps / p_tps if s_tps and p_tps else None,
                       "server_counters": lv.spec.to_dict() if lv.spec else None})
    below = [p["batch"] for p in points if p["speedup"] is not None and p["speedup"] < 1]
    summary = ("throughput per load level: " + ", ".join(
        f"c{p['batch']} {p['speculative_tokens_per_s'] or 0:.1f} tok/s"
        + (f" ({p['speedup']:.2f}x)" if p["speedup"] else "") for p in points)
        + (f"; slower than the reference from concurrency {below[0]}" if below else ""))
    return _check("load", True, summary, {"crossover_concurrency": below[0] if below else None},
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
