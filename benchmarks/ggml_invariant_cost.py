"""The speed cost of the ggml backend's batch-invariant mode, side by side with the default
mode in one run, on the same GGUF file and thread count: plain greedy decoding at batch 1
(decode tok/s, as bench_ggml.py measures it) and the aggregate decode throughput at batch 8,
with `llama-bench -p 0 -n N` (llama.cpp's own batch-1 decode) in every round.

Each mode runs in a process of its own: ggml reads its tiled-kernel switch once per process
(models/ggml/lib.switch_off_tiled_matmul), so a default-mode model sharing a process with a
batch-invariant one would not run llama.cpp's defaults. Rounds alternate the modes and
llama-bench, so a slow spell of the machine lands on all three.

    python benchmarks/ggml_invariant_cost.py --target qwen2.5-coder-1.5b --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def child(args) -> None:
    """One mode's measurement, printed as one JSON line."""
    import torch
    from bench_ggml import engine_plain
    from common import suite_prompts

    from verispec.models import load_model
    torch.set_num_threads(args.threads)
    loaded = load_model(args.target, backend="ggml", batch_invariant=args.child == "invariant", progress=False)
    model, tok = loaded.model, loaded.tokenizer
    bos = [tok.bos_token_id if tok.bos_token_id is not None else tok("\n")["input_ids"][0]]
    prompts = [ids[:24] for ids in (tok(p.prompt)["input_ids"] for p in suite_prompts(1))]
    prompts = (prompts * args.batch)[:args.batch]
    engine_plain(model, [bos], 4, 1)  # warm-up
    engine_plain(model, prompts, 4, args.batch)
    b1 = engine_plain(model, [bos], args.max_new, 1)[0]
    b8 = engine_plain(model, prompts, args.max_new, args.batch)
    long = [t for ids in (tok(p.prompt)["input_ids"] for p in suite_prompts(4)) for t in ids]
    long = (long * (1 + args.long_context // max(1, len(long))))[:args.long_context]
    b1_long = engine_plain(model, [long], args.max_new, 1)[0]  # decoding past 256 cached positions
    print(json.dumps({"mode": args.child, "backend": model.backend, "b1": b1, "b8_decode": b8[0],
                      "b8_e2e": b8[1], "b1_long": b1_long, "gguf": str(loaded.files.path)}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--long-context", type=int, default=300, help="prompt of the third (batch-1) measurement")
    ap.add_argument("--child", choices=["default", "invariant"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from bench_ggml import llama_bench, tools
    bin_dir = tools()
    got = {"default": [], "invariant": []}
    lb = []
    for rnd in range(args.rounds):
        for mode in (("default", "invariant") if rnd % 2 == 0 else ("invariant", "default")):
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--target", args.target,
                                  "--threads", str(args.threads), "--max-new", str(args.max_new),
                                  "--batch", str(args.batch), "--long-context", str(args.long_context)], check=True, capture_output=True, text=True).stdout
            got[mode].append(json.loads(out.strip().splitlines()[-1]))
        gguf = Path(got["default"][-1]["gguf"])
        lb.append(llama_bench(bin_dir, gguf, args.threads, ["-p", "0", "-n", str(args.max_new), "-r", "2"]))
        print(f"round {rnd}: " + ", ".join(f"{m} {got[m][-1]['b1']:.1f} / {got[m][-1]['b8_decode']:.1f} / "
                                            f"{got[m][-1]['b1_long']:.1f}" for m in got)
              + f", llama-bench {lb[-1]:.1f} tok/s", flush=True)
    keys = ("b1", "b8_decode", "b8_e2e", "b1_long")
    med = {m: {k: statistics.median(r[k] for r in v) for k in keys} for m, v in got.items()}
    lbm = statistics.median(lb)
    print(f"{args.target}, {args.threads} threads, {args.rounds} rounds (medians):")
    print(f"| mode | batch 1 decode tok/s | x llama-bench ({lbm:.1f}) | batch {args.batch} decode tok/s | "
          f"batch {args.batch} end to end tok/s | batch 1 after {args.long_context} tokens |")
    print("|---|---|---|---|---|---|")
    for m in ("default", "invariant"):
        print(f"| {m} | {med[m]['b1']:.1f} | {med[m]['b1'] / lbm:.3f} | {med[m]['b8_decode']:.1f} | "
              f"{med[m]['b8_e2e']:.1f} | {med[m]['b1_long']:.1f} |")
    print(f"invariant / default: batch 1 {med['invariant']['b1'] / med['default']['b1']:.3f}, batch {args.batch} "
          f"{med['invariant']['b8_decode'] / med['default']['b8_decode']:.3f}, batch 1 after {args.long_context} "
          f"{med['invariant']['b1_long'] / med['default']['b1_long']:.3f}")


if __name__ == "__main__":
    main()
