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
import sys
import time
from dataclasses import replace

from ..checks import ENDPOINT, checks_for, selectable
from .checks import MIN_VERIFIED_DRAFTS, EndpointAudit, EndpointError
from .client import EndpointConfig
from .compare import CompareError, comparison_check, compare_reports, load_report
from .kinds import probe
from .null import ALPHA as NULL_ALPHA
from ..floor import FloorBudget


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


def _seconds(s: str) -> float:
    import argparse
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {s!r}") from None
    if not 0 <= v <= 60:
        raise argparse.ArgumentTypeError(f"must be between 0 and 60 seconds, got {v:g}")
    return v


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
    a.add_argument("--floor-settle", type=_seconds, default=0.0, metavar="SECONDS",
                   help="speedup floor: pause this long before each timed request (vLLM's CPU worker spins on "
                        "after an answer and slows whichever request follows; 2 s suffices there; default 0)")
    a.add_argument("--null-repeats", type=_int_at_least(1), default=1,
                   help="run the null (reference vs itself) this many times, pooled (default 1)")
    a.add_argument("--speed-repeats", type=_int_at_least(1), default=None, metavar="N",
                   help="time each prompt N times plain and speculative side by side, for the slices' speedup "
                        "intervals: from an endpoint against its reference at concurrency 1 (default 3; with "
                        "--quick 2), offline at batch 1 (default 4; with --quick 3)")


def _speed_repeats(args) -> int:
    """--speed-repeats, else the default of the audit's size: 2 with --quick, 3 without."""
    n = getattr(args, "speed_repeats", None)
    return n if n is not None else 2 if getattr(args, "quick", False) else 3


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
                                    seed=seed, speed_repeats=_speed_repeats(args),
                                    min_speedup=getattr(args, "min_speedup", None),
                                    quick=bool(getattr(args, "quick", False)), suite=suite,
                                    floor_settle_s=args.floor_settle)
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


def run_endpoint_audit(url: str, prompts: list, *, reference_url: str | None = None, model: str | None = None,
                       api_key: str | None = None, chat: bool = True, max_tokens: int = 64,
                       concurrency: tuple[int, ...] = (1, 8), suite_spec: str = "default",
                       suite_size: int | None = None, alpha: float = NULL_ALPHA, null_repeats: int = 1,
                       sampled_tokens: int = 0, previous: dict | None = None, score_with: str = "auto",
                       only: tuple[str, ...] = (), min_verified_drafts: int = MIN_VERIFIED_DRAFTS,
                       seed: int = 0, speed_repeats: int = 3, min_speedup: float | None = None,
                       quick: bool = True, suite: list | None = None, floor_budget: FloorBudget | None = None,
                       floor_settle_s: float = 0.0) -> dict:
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
    compared with this one as a gate (compare.py). only: the checks to run (checks.selectable("endpoint");
    empty: all); the greedy runs are made only for the checks that read them.
    min_verified_drafts: a speculative server's sampled phase verifies at least this many
    draft tokens (its counters' difference over the phase) or the check is inconclusive.
    seed: the sampled phase's prompt order and the distribution check's tie-breaks (the
    prompts themselves are chosen by the caller: context.select_prompts); no seed is sent to
    the server, whose own draws stay unseeded as a deployment's are. speed_repeats: how many
    times each prompt is timed against the reference at concurrency 1 (the paired run's
    level 1 and further paired runs), for the slices' speedup intervals. min_speedup: the
    speedup-floor check's gate (None: informational); quick: its quick budget, else the full
    one (floor_budget: another); suite: the prompts its search starts from (None: `prompts`);
    floor_settle_s: its pause before each timed request, for servers that keep the cores busy
    for a while after a request (vLLM's CPU worker)."""
    if null_repeats < 1:
        raise ValueError(f"null_repeats must be >= 1, got {null_repeats}")
    if speed_repeats < 1:
        raise ValueError(f"speed_repeats must be >= 1, got {speed_repeats}")
    names = selectable(ENDPOINT)
    unknown = set(only) - set(names)
    if unknown:
        raise EndpointError(f"--only {','.join(sorted(unknown))}: not a check of the endpoint audit "
                            f"(from outside: {', '.join(names)})")
    wanted = set(only or names)
    checks = [c for c in checks_for(ENDPOINT) if c.always or c.name in wanted]
    greedy = any(ENDPOINT in c.greedy for c in checks)  # the base, endpoint and null runs: only for checks that read them
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
    if not greedy and not sampled_tokens and not (wanted - {"distribution"}):
        raise EndpointError("--only distribution with --sampled-tokens 0: nothing to run")
    a = EndpointAudit(info=info, ref_info=ref_info, cfg=cfg, ref_cfg=ref_cfg, reference_kind=reference_kind,
                      prompts=prompts, chat=chat, max_tokens=max_tokens, concurrency=concurrency,
                      suite_spec=suite_spec, suite_size=suite_size, started=started, alpha=alpha,
                      sampled_tokens=sampled_tokens, score_with=score_with,
                      min_verified_drafts=min_verified_drafts, seed=seed, speed_repeats=speed_repeats,
                      min_speedup=min_speedup,
                      floor_budget=floor_budget or (FloorBudget.quick() if quick else FloorBudget.full()),
                      suite=suite, floor_settle_s=floor_settle_s)
    if greedy:
        a.greedy_runs(null_repeats)
    for check in checks:
        result = check.endpoint(a)
        if result is not None:
            a.results.append(result)
    failed = [c.name for c in a.results if not c.passed]
    samples = [{"slice": p.slice, "prompt": p.prompt, "reference": r.text or "", "speculative": g.text or ""}
               for p, r, g in list(zip(prompts, a.base_results, a.run.levels[-1].results if a.run else []))[:6]]
    report = {"verdict": "fail" if failed else "pass", "failed_checks": failed,
              "elapsed_s": round(time.perf_counter() - t0, 1), "checks": [c.to_dict() for c in a.results],
              "record": a.record, "samples": samples, "only": list(only),
              "endpoint_runs": {"endpoint": a.run.to_dict(), "base": a.base.to_dict(),
                                "reference": a.null_run.to_dict()}
              if greedy else {"sampled": a.srun.to_dict() if sampled_tokens else None}}
    if previous is not None:  # --compare-to: the gate against an earlier audit
        report["checks"].append(comparison_check(compare_reports(previous, report)).to_dict())
        report["failed_checks"] = [c["name"] for c in report["checks"] if not c["passed"]]
        report["verdict"] = "fail" if report["failed_checks"] else "pass"
    return report


