"""`verispec audit`: the argument parsing and the edge where AuditConfig is built.

Exit status: 0 when every check passes, 1 when any fails, 2 for usage errors."""

from __future__ import annotations

import argparse
import sys
import time

from .common import UsageError, _threads, add_backend_argument, add_speculation_arguments, set_threads

DEFAULT_BATCH_SIZES = {"full": (1, 4, 16, 32), "quick": (1, 4, 16)}


def _batch_sizes(s: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {s!r}")
    return sizes


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def _temperatures(s: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"temperatures must be numbers, got {s!r}") from None
    from ..sampling import MIN_TEMPERATURE
    if not vals or not all(MIN_TEMPERATURE <= v < float("inf") for v in vals):
        raise argparse.ArgumentTypeError(f"temperatures must be finite and at least {MIN_TEMPERATURE:g} "
                                         f"(the distribution check samples), got {s!r}")
    return tuple(dict.fromkeys(vals))


def _checks(s: str) -> tuple[str, ...]:
    from ..audit.checks import ENGINE, selectable
    CHECKS = selectable(ENGINE)  # the endpoint audit's are among them
    names = tuple(x.strip() for x in s.split(",") if x.strip())
    bad = [n for n in names if n not in CHECKS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown checks {bad or s!r}; checks: {', '.join(CHECKS)}")
    return names


class _Options:
    """An argument group that remembers the options added to it, so that the mode check can
    name each one given in the mode it does not apply to."""

    def __init__(self, group):
        self.group, self.actions = group, []

    def add_argument(self, *flags, **kw):
        action = self.group.add_argument(*flags, **kw)
        self.actions.append(action)
        return action


def add_audit_parser(sub) -> None:
    from ..audit.checks import ENGINE, selectable
    from ..audit.endpoint.runner import add_endpoint_arguments

    a = sub.add_parser("audit", help="audit speculative decoding: equivalence, distribution, "
                                     "corruption, slices, load; exit 1 on failure",
                       description="Run the deployment checklist and write report.json, report.md and "
                                   "report.html. Exit status 1 when any check fails. Two modes: a local "
                                   "model and drafter (engine mode, the default), or any OpenAI-compatible "
                                   "server from outside (--endpoint URL); an option of one mode given in "
                                   "the other is an error.")
    common = a.add_argument_group("common to both modes")
    engine = _Options(a.add_argument_group("engine mode (a local model and drafter; no --endpoint)"))
    endpoint = _Options(a.add_argument_group("endpoint mode (--endpoint URL: a server from outside)"))
    _add_common(common, selectable(ENGINE))
    _add_engine(engine)
    add_endpoint_arguments(endpoint)
    a.set_defaults(func=cmd_audit, argv=None, mode_options={"engine": engine.actions, "endpoint": endpoint.actions})


def _add_common(a, checks: tuple[str, ...]) -> None:
    from ..audit.endpoint.runner import _int_at_least
    a.add_argument("--suite", default="default", help='"default", "repetitive" (code edits, RAG, multi-turn, '
                   'agentic, JSON: answers that repeat text) or a JSONL file (Spec-Bench format accepted)')
    a.add_argument("--out", default="verispec-audit", help="report directory (default ./verispec-audit)")
    a.add_argument("--quick", action="store_true",
                   help="2 prompts per slice, fewer samples: about 4 minutes on 2 cores")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--min-verified-drafts", type=int, default=200,
                   help="the distribution check is inconclusive, and fails, with fewer verified draft "
                        "tokens (default 200; 0 accepts a check that exercised no speculation)")
    a.add_argument("--no-progress", action="store_true", help="no progress bar: one line per finished check")
    a.add_argument("--fail-fast", action="store_true",
                   help="stop after the first failed check (the verdict is then FAIL; the report lists "
                        "the checks not run)")
    a.add_argument("--only", type=_checks, default=(),
                   help="comma-separated checks to run (and lossy-rule, record): " + ", ".join(checks)
                        + "; the verdict then covers only those")
    a.add_argument("--min-speedup", type=_positive_float, default=None, metavar="X",
                   help="make the speedup floor a gate: fail when a prompt the search finds runs below X "
                        "times plain speed with its whole confidence interval below X (default: the floor is "
                        "reported, not gated)")
    a.add_argument("--speed-repeats", type=_int_at_least(1), default=None, metavar="N",
                   help="time each prompt N times plain and speculative side by side, for the slices' speedup "
                        "intervals: from an endpoint against its reference at concurrency 1 (default 3; with "
                        "--quick 2), offline at batch 1 (default 4; with --quick 3)")


def _add_engine(a) -> None:
    a.add_argument("--target", default="smollm2-135m", help="preset, HF directory, GGUF file or hub id")
    add_speculation_arguments(a, draft_default="lookup", min_k=1,
                              draft_help="lookup[:N] | suffix[:options] | layerskip:N | a draft model (preset, path, hub id); "
                                         "default lookup",
                              policy_help="adaptive (default): k per row and step from measured costs and "
                                          "acceptance; fixed: always k",
                              verify_help="verification rule; typical-lossy is lossy and fails the audit")
    a.add_argument("--batch-invariant", action="store_true",
                   help="run the target in batch-invariant mode: greedy output must then match "
                        "plain decoding bitwise at every batch size")
    a.add_argument("--batch-sizes", type=_batch_sizes, default=None,
                   help="comma-separated (default 1,4,16,32; with --quick 1,4,16)")
    from ..audit.context import DEFAULT_SETTINGS
    defaults = "; ".join(f"{s.label}: {s.describe()}" for s in DEFAULT_SETTINGS)
    a.add_argument("--temperature", type=_temperatures, default=None,
                   help="comma-separated temperatures of the deployment. Without --temperature, --top-k, "
                        f"--top-p and --min-p the sampled checks (distribution, seeded) audit {defaults}; "
                        "with any of them they audit the deployment's settings instead: each temperature "
                        "(default 1) under the filters given (the others off). Requests take the settings "
                        "in turn")
    a.add_argument("--top-k", type=int, default=None, help="the deployment's top-k (0 = off; see --temperature)")
    a.add_argument("--top-p", type=float, default=None, help="the deployment's top-p (1 = off; see --temperature)")
    a.add_argument("--min-p", type=float, default=None, help="the deployment's min-p (0 = off; see --temperature)")
    a.add_argument("--prompt-format", choices=("auto", "chat", "raw"), default="auto",
                   help="auto (default): the chat template when the tokenizer has one, else raw text")
    a.add_argument("--threads", type=_threads, default="auto",
                   help="torch CPU threads, or auto (default): 1 or all cores, whichever decodes faster now")
    a.add_argument("--measure-costs", action="store_true",
                   help="time the adaptive policy's cost model afresh instead of reading the machine's "
                        "cost cache (what generate and serve read; the audit writes it when it measures)")
    add_backend_argument(a)
    from ..audit.faults import argument as fault_argument
    a.add_argument("--inject-fault", type=fault_argument, default=None, help=argparse.SUPPRESS)


def check_mode(args, argv: list[str] | None = None) -> None:
    """A UsageError naming the first option given in the mode it does not apply to. An
    option counts as given when its value is not its default or, where the command line is
    known (argv), when one of its flags is on it."""
    mode, other = ("endpoint", "engine") if args.endpoint else ("engine", "endpoint")
    words = {w.split("=", 1)[0] for w in argv or () if w.startswith("--")}
    for action in args.mode_options[other]:
        if action.dest == "endpoint" or action.default == argparse.SUPPRESS:
            continue
        if getattr(args, action.dest) != action.default or words & set(action.option_strings):
            where = "an endpoint audit (--endpoint URL)" if mode == "endpoint" else "an engine audit (no --endpoint)"
            raise UsageError(f"{action.option_strings[0]} is an option of the {other} mode and does not apply to "
                             f"{where}; see verispec audit --help")


def _settings(args):
    """The deployment's sampling settings when any of their flags is given, else the defaults."""
    from ..audit.context import DEFAULT_SETTINGS, settings_for
    given = {name: v for name in ("top_k", "top_p", "min_p") if (v := getattr(args, name)) is not None}
    if args.temperature is None and not given:
        return DEFAULT_SETTINGS
    return settings_for(args.temperature or (1.0,), **given)  # ValueError naming a bad value


def config_from_args(args):
    import dataclasses

    from ..audit.context import AuditConfig, AuditSizes
    from ..policy import resolve_k
    mode = "quick" if args.quick else "full"
    sizes = AuditSizes.quick() if args.quick else AuditSizes.full()
    if args.speed_repeats is not None:
        sizes = dataclasses.replace(sizes, speed_repeats=args.speed_repeats)
    return AuditConfig(target=args.target, draft=args.draft, k=resolve_k(args.policy, args.k), policy=args.policy,
                       batch_invariant=args.batch_invariant, rule=args.verify, suite=args.suite,
                       batch_sizes=args.batch_sizes or DEFAULT_BATCH_SIZES[mode],
                       sizes=sizes,
                       seed=args.seed, settings=_settings(args), min_verified_drafts=args.min_verified_drafts,
                       prompt_format=args.prompt_format, inject_fault=args.inject_fault,
                       fail_fast=args.fail_fast, only=args.only, cost_cache=not args.measure_costs,
                       min_speedup=args.min_speedup)


def cmd_audit(args) -> int:
    from ..audit.progress import PlainProgress, RichProgress
    check_mode(args, args.argv)
    if args.endpoint:  # audit any OpenAI-compatible server instead of an in-process engine
        from ..audit.endpoint.runner import cmd_endpoint_audit
        progress = PlainProgress() if args.no_progress else RichProgress()
        try:
            return cmd_endpoint_audit(args, progress)
        finally:
            progress.close()
    from ..audit.report import write_reports
    from ..audit.runner import drafter_factory_from_spec, run_audit
    from ..audit.suite import load_suite
    from ..models import load_model

    try:
        config = config_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if config.rule == "typical-lossy":
        print("WARNING: --verify typical-lossy is LOSSY: the audit will fail it", file=sys.stderr)
    if config.inject_fault:
        print(f"TEST ONLY: injecting fault {config.inject_fault!r}", file=sys.stderr)
    t0 = time.perf_counter()
    # resolve everything a user can get wrong before the long run starts
    try:
        suite = load_suite(config.suite)
    except ValueError as e:
        raise UsageError(str(e)) from None
    set_threads(args.threads)  # a count: before loading; auto: timed on the loaded model
    target = load_model(config.target, progress=not args.no_progress, batch_invariant=config.batch_invariant,
                        backend=args.backend)
    try:
        factory, draft_files = drafter_factory_from_spec(config.draft, target.model, target.tokenizer)
    except ValueError as e:
        raise UsageError(f"--draft {config.draft}: {e}") from None
    set_threads(args.threads, target.model)
    progress = PlainProgress() if args.no_progress else RichProgress()
    try:
        result = run_audit(config, target=target, drafter_factory=factory, draft_files=draft_files,
                           prompts=suite, progress=progress)
    finally:
        progress.close()
    paths = write_reports(result.to_dict(), args.out)
    elapsed = time.perf_counter() - t0
    print(f"verdict: {result.verdict.upper()}"
          + (f" (failed: {', '.join(result.failed)})" if result.failed else "")
          + f" in {elapsed:.0f} s", file=sys.stderr)
    print(f"reports: {paths['json']}, {paths['md']}, {paths['html']}", file=sys.stderr)
    return 0 if result.verdict == "pass" else 1
