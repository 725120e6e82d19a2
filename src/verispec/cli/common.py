"""What the commands share: the user-facing error, argument types, the --threads choice,
the options that configure speculation (--draft, --k, --policy, --verify) and --backend,
each defined once, and the engine assembled from them."""

from __future__ import annotations

import argparse
import sys
import time


class UsageError(Exception):
    """A clear, user-facing error: printed without a traceback, exit status 2."""


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _nonneg_int(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _threads(s: str) -> int | str:
    return s if s == "auto" else _positive_int(s)


THREADS_HELP = ("CPU threads (torch's, which the ggml backend follows), or auto (default): 1 or all cores, "
                "whichever decodes faster now, timed on the loaded model")


def pick_threads(model, steps: int = 6) -> tuple[int, dict]:
    """The faster torch thread count for decoding right now, 1 or all cores, timed on a few
    batch-1 decode steps (alternating, best of two each). On a shared machine, OpenMP threads
    waiting at barriers for a descheduled sibling can make all-cores several times slower
    than one thread (ggml, Qwen 1.5B, 2 cores under load: 940 ms a token at 2 threads, 19 ms
    at 1); on an idle machine all cores win. -> (threads, tokens/s per candidate)."""
    import os

    import torch

    candidates = sorted({1, os.cpu_count() or 1})
    cache = model.new_cache(1, 16 + 4 * steps)
    row = cache.alloc()
    model.forward(torch.zeros(1, 16, dtype=torch.long), cache, row, last_only=True)
    best: dict[int, float] = {}
    for n in candidates * 2:
        torch.set_num_threads(n)
        t0 = time.perf_counter()
        for _ in range(steps):
            model.forward(torch.zeros(1, 1, dtype=torch.long), cache, row, last_only=True)
        best[n] = max(best.get(n, 0.0), steps / (time.perf_counter() - t0))
    threads = max(best, key=best.get)
    torch.set_num_threads(threads)
    return threads, best


def set_threads(choice: int | str, model=None, *, quiet: bool = False) -> None:
    """Apply --threads: a count now (model None: before loading), or "auto" once the model is
    loaded (pick_threads; said on stderr unless quiet). "auto" with no model does nothing yet."""
    import torch

    if choice != "auto":
        torch.set_num_threads(choice)
    elif model is not None:
        threads, speeds = pick_threads(model)
        if not quiet:
            print(f"threads: {threads} (decode tok/s by thread count: "
                  + ", ".join(f"{n}: {v:.1f}" for n, v in speeds.items()) + ")", file=sys.stderr)


def add_backend_argument(parser) -> None:
    from ..models import BACKENDS
    parser.add_argument("--backend", default="auto", choices=["auto", *BACKENDS],
                        help="native: the fp32 runtime on converted weights (the reference); ggml: "
                             "llama.cpp on the GGUF file as shipped (pip install 'verispec[gguf]'); "
                             "auto (default): ggml for a .gguf path when installed, else native. "
                             "A draft model runs on the target's backend")



def add_speculation_arguments(parser, *, draft_default: str | None = None, draft_help: str | None = None,
                              min_k: int = 0, policy_help: str | None = None,
                              verify_help: str = "verification rule; typical-lossy is lossy") -> None:
    """--draft, --k, --policy and --verify, as every command takes them. min_k: the least k
    the command accepts (the audit needs drafts: 1)."""
    from ..verify import RULES
    parser.add_argument("--draft", default=draft_default,
                        help=draft_help or "none | lookup[:N] | suffix[:options] | layerskip:N | a draft model (preset, path, hub id)")
    parser.add_argument("--k", type=_positive_int if min_k >= 1 else _nonneg_int, default=None,
                        help="draft tokens per step (the most, with the adaptive policy); "
                             "default 8 with --policy adaptive, 4 with fixed")
    parser.add_argument("--policy", default="adaptive", choices=["adaptive", "fixed"],
                        help=policy_help or "adaptive: per row and step, measured costs and acceptance (never "
                                            "slower); fixed: always k")
    parser.add_argument("--verify", default="rejection", choices=list(RULES), help=verify_help)


def build_engine(target, tokenizer, args, *, max_batch: int, max_len: int, wrap=None, fault=None):
    """The engine the parsed --draft, --k, --policy and --verify describe, on a loaded target
    (args.k resolved already: policy.resolve_k); wrap(policy) -> the policy the engine runs
    (the server's per-request wrapper); fault: test only, an audit.faults.Fault built into
    the engine (`serve --inject-fault`)."""
    from ..drafters import make_drafter
    from ..engine import Engine, EngineConfig
    from ..policy import make_policy
    from ..policy.costs import CostCache

    drafter = make_drafter(args.draft, target, tokenizer, max_rows=max_batch,
                           max_len=max_len + args.k + 2)
    # the adaptive policy's cost model: measured on a machine's first run, then read from
    # $VERISPEC_CACHE/costs (and rewritten there when decoding measures it drifting)
    policy = make_policy(args.policy, target, drafter, max_batch, args.k,
                         cost_cache=CostCache.default())
    if wrap is not None:
        policy = wrap(policy)
    build = Engine if fault is None else fault.engine
    return build(target, drafter, policy, EngineConfig(max_batch=max_batch, max_len=max_len, rule=args.verify))
