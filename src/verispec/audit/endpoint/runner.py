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
* with an earlier report, the re-test gate (compare.py), a check of its own that runs last.

Wiring into `verispec audit` (cli/audit.py): ``add_endpoint_arguments(a)`` in
add_audit_parser, and at the top of cmd_audit
``if args.endpoint: from .endpoint.runner import cmd_endpoint_audit; return cmd_endpoint_audit(args)``.
"""

from __future__ import annotations

import datetime
import sys
import time
from dataclasses import dataclass, replace

from ..checks import ENDPOINT, checks_for, run_checks, selectable
from .state import MIN_VERIFIED_DRAFTS, EndpointAudit, EndpointError
from .client import EndpointConfig
from .compare import CompareError, load_report
from .kinds import ServerInfo, probe
from .null import ALPHA as NULL_ALPHA
from .rescore import supported as rescoring_supported
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
    """The endpoint mode's options of `verispec audit` (cli/audit.py adds those common to both
    modes: --suite, --out, --quick, --seed, --only, --fail-fast, --speed-repeats, ...)."""
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


def _speed_repeats(args) -> int:
    """--speed-repeats, else the default of the audit's size: 2 with --quick, 3 without."""
    return args.speed_repeats if args.speed_repeats is not None else 2 if args.quick else 3


@dataclass(frozen=True)
class EndpointAuditConfig:
    """What an endpoint audit runs against and how, built once at the edge (the command
    line: from_args; tests and benchmarks: directly).

    url / reference_url: the endpoint and its non-speculative reference (None: a verispec
    endpoint with speculation off, else the endpoint itself at concurrency 1); null_repeats:
    how many times the null (reference vs itself) runs, pooled; sampled_tokens > 0: the
    distribution check at temperature 1 over at least that many tokens (sampled.py), scored
    as score_with says: "auto" by the endpoint's own logprobs and, for tokens sent without
    any, by the reference (rescore.py: a llama.cpp endpoint and reference), "endpoint" its
    own only, "reference" every token by the reference; min_verified_drafts: a speculative
    server's sampled phase verifies at least this many drafts or that check is inconclusive;
    only: the checks to run (checks.selectable("endpoint"); empty: all); seed: the sampled
    phase's prompt order and the tie-breaks (no seed is sent: the server's draws stay
    unseeded, as a deployment's are); speed_repeats: how many times each prompt is timed
    against the reference at concurrency 1, for the slices' intervals; min_speedup: the
    speedup floor's gate (None: informational), quick: its quick budget else the full one
    (floor_budget: another), suite: the prompts its search starts from (None: the audited
    ones), floor_settle_s: its pause before each timed request (vLLM's CPU worker keeps the
    cores busy for a while after an answer); previous: an earlier endpoint audit's report,
    the re-test gate's baseline; fail_fast: skip the remaining checks after a failure."""

    url: str
    reference_url: str | None = None
    model: str | None = None
    api_key: str | None = None
    chat: bool = True
    max_tokens: int = 64
    concurrency: tuple[int, ...] = (1, 8)
    suite_spec: str = "default"
    suite_size: int | None = None
    alpha: float = NULL_ALPHA
    null_repeats: int = 1
    sampled_tokens: int = 0
    score_with: str = "auto"
    only: tuple[str, ...] = ()
    min_verified_drafts: int = MIN_VERIFIED_DRAFTS
    seed: int = 0
    speed_repeats: int = 3
    min_speedup: float | None = None
    quick: bool = True
    suite: list | None = None
    floor_budget: FloorBudget | None = None
    floor_settle_s: float = 0.0
    previous: dict | None = None
    fail_fast: bool = False

    def __post_init__(self):
        if self.null_repeats < 1:
            raise ValueError(f"null_repeats must be >= 1, got {self.null_repeats}")
        if self.speed_repeats < 1:
            raise ValueError(f"speed_repeats must be >= 1, got {self.speed_repeats}")

    @classmethod
    def from_args(cls, args, suite: list, previous: dict | None) -> "EndpointAuditConfig":
        return cls(args.endpoint, reference_url=args.reference_endpoint, model=args.endpoint_model,
                   api_key=args.endpoint_api_key, chat=not args.endpoint_raw, max_tokens=args.endpoint_max_tokens,
                   concurrency=args.concurrency, suite_spec=args.suite, suite_size=len(suite),
                   null_repeats=args.null_repeats, sampled_tokens=args.sampled_tokens, score_with=args.score_with,
                   only=tuple(args.only or ()), min_verified_drafts=args.min_verified_drafts, seed=args.seed,
                   speed_repeats=_speed_repeats(args), min_speedup=args.min_speedup, quick=args.quick,
                   suite=suite, floor_settle_s=args.floor_settle, previous=previous, fail_fast=args.fail_fast)


def cmd_endpoint_audit(args, progress=None) -> int:
    from ..context import select_prompts
    from ..report import write_reports
    from ..suite import load_suite

    suite = load_suite(args.suite)
    prompts = select_prompts(suite, 2 if args.quick else None, args.seed)
    try:
        previous = load_report(args.compare_to) if args.compare_to else None
        report = run_endpoint_audit(EndpointAuditConfig.from_args(args, suite, previous), prompts, progress=progress)
    except CompareError as e:
        print(f"verispec audit --endpoint: {e}", file=sys.stderr)
        return 2
    except EndpointError as e:
        print(f"verispec audit --endpoint: cannot audit: {e}", file=sys.stderr)
        return 2
    paths = write_reports(report, args.out)
    print(f"verdict: {report['verdict'].upper()}"
          + (f" (failed: {', '.join(report['failed_checks'])})" if report["failed_checks"] else "")
          + f" in {report['elapsed_s']:.0f} s", file=sys.stderr)
    for c in report["checks"]:
        print(f"  {c['name']:<20} {c['status'] if c['status'] != 'fail' else 'FAIL':<5} {c['summary']}",
              file=sys.stderr)
    print(f"reports: {paths['json']}, {paths['md']}, {paths['html']}", file=sys.stderr)
    return 0 if report["verdict"] == "pass" else 1


def run_endpoint_audit(config: EndpointAuditConfig, prompts: list, *, progress=None) -> dict:
    """Audit the endpoint over the prompts: the report as a dict in the offline audit's
    format (audit.report.write_reports renders it).

    Runs, in order: the base (reference at concurrency 1), then the endpoint and the
    reference at every level side by side (client.run_paired: alternating waves, so each
    prompt's speedup is a ratio of two answers timed moments apart; the reference's half
    is the null and the plain speed), then the reference alone for further null repeats;
    without a reference, the endpoint itself is base and null (at concurrency 1 only). The
    greedy runs are made only when a check that reads them runs. Then every check of the
    registry (checks.run_checks, the offline audit's loop), the re-test gate last."""
    checks = _chosen_checks(config)
    greedy = any(ENDPOINT in c.greedy for c in checks)  # the base, endpoint and null runs: only for checks that read them
    t0 = time.perf_counter()
    a = _audit_state(config, prompts, greedy)
    if greedy:
        try:
            a.greedy_runs(config.null_repeats)
        except EndpointError:
            raise
        except Exception as e:  # noqa: BLE001 - the checks that read the runs report it; the others still run
            a.greedy_error = f"{type(e).__name__}: {e}"
    run_checks(ENDPOINT, a, only=config.only, fail_fast=config.fail_fast, progress=progress)
    return a.report(time.perf_counter() - t0)


def _chosen_checks(config: EndpointAuditConfig) -> list:
    """The checks --only asks for (and those that always run), after the checks that no
    request can be made for are refused."""
    names = selectable(ENDPOINT)
    unknown = set(config.only) - set(names)
    if unknown:
        raise EndpointError(f"--only {','.join(sorted(unknown))}: not a check of the endpoint audit "
                            f"(from outside: {', '.join(names)})")
    wanted = set(config.only or names)
    checks = [c for c in checks_for(ENDPOINT) if c.always or c.name in wanted]
    if not any(c.greedy for c in checks) and not _sampled_tokens(config) and \
            not any(c.runner(ENDPOINT) is not None and not c.always and not c.samples for c in checks):
        raise EndpointError("--only distribution with --sampled-tokens 0: nothing to run")
    return checks


def _sampled_tokens(config: EndpointAuditConfig) -> int:
    """The distribution check's sample size: 0 where --only leaves out the checks that sample."""
    sampling = {c.name for c in checks_for(ENDPOINT) if c.samples}
    return config.sampled_tokens if not config.only or sampling & set(config.only) else 0


def _audit_state(config: EndpointAuditConfig, prompts: list, greedy: bool) -> EndpointAudit:
    """The servers probed, the reference chosen, and the state every check reads."""
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info = probe(EndpointConfig(config.url).base, config.api_key)
    cfg = EndpointConfig(config.url, model=config.model, api_key=config.api_key, chat=config.chat,
                         max_tokens=config.max_tokens, concurrency=config.concurrency, logprobs=True)
    ref_cfg, ref_info, reference_kind = _reference(config, cfg, info)
    sampled_tokens = _sampled_tokens(config)
    why_not = rescoring_supported(info.kind, ref_info.kind if ref_info else None)
    if sampled_tokens and config.score_with == "reference" and why_not:
        raise EndpointError(f"--score-with reference: {why_not}")
    return EndpointAudit(info=info, ref_info=ref_info, cfg=cfg, ref_cfg=ref_cfg, reference_kind=reference_kind,
                         prompts=prompts, chat=config.chat, max_tokens=config.max_tokens,
                         concurrency=config.concurrency, suite_spec=config.suite_spec, suite_size=config.suite_size,
                         started=started, alpha=config.alpha, sampled_tokens=sampled_tokens,
                         score_with=config.score_with, min_verified_drafts=config.min_verified_drafts,
                         seed=config.seed, speed_repeats=config.speed_repeats, min_speedup=config.min_speedup,
                         floor_budget=config.floor_budget or (FloorBudget.quick() if config.quick
                                                              else FloorBudget.full()),
                         suite=config.suite, floor_settle_s=config.floor_settle_s, previous=config.previous,
                         only=config.only, greedy=greedy, quick=config.quick)


def _reference(config: EndpointAuditConfig, cfg: EndpointConfig,
               info: ServerInfo) -> tuple[EndpointConfig | None, ServerInfo | None, str]:
    """The non-speculative reference: (its client settings, what it reports of itself, how
    the report names it)."""
    if config.reference_url:
        ref_cfg = replace(cfg, url=config.reference_url, extra_body=None)
        ref_info = probe(ref_cfg.base, config.api_key)
        return ref_cfg, ref_info, f"reference endpoint {ref_cfg.base} ({ref_info.kind})"
    if info.kind == "verispec":
        return (replace(cfg, extra_body={"verispec": {"speculate": False}}), None,
                "the same verispec server with speculation off")
    return None, None, ("none: the endpoint's own answers at concurrency 1 (load invariance only; "
                        "speculation cannot be separated from batching numerics)")
