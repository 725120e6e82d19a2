"""`verispec generate`: plain or speculative decoding of prompts from the command line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .common import (THREADS_HELP, UsageError, _nonneg_int, _positive_int, _threads, add_backend_argument,
                     add_speculation_arguments, build_engine, set_threads)


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


def cmd_generate(args) -> int:
    from tqdm import tqdm

    from ..engine import GenerationParams, Request
    from ..engine.core import ContextLengthError
    from ..models import load_model
    from ..policy import resolve_k
    from ..sampling import SamplingParams

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
    engine = build_engine(target, tok, args, max_batch=args.batch_size, max_len=max_len)
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


def add_generate_parser(sub) -> None:
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
    add_speculation_arguments(g)
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    g.add_argument("--threads", type=_threads, default="auto", help=THREADS_HELP)
    add_backend_argument(g)
    g.add_argument("--batch-invariant", action="store_true",
                   help="bitwise batch-invariant numerics: output independent of batch and speculation")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    g.set_defaults(func=cmd_generate)
