"""The verify pass: one forward over k = 1, 2, 4, 8, 16 new tokens on a cached context of
~100 tokens, native runtime vs Hugging Face (DynamicCache), costs relative to k = 1.

    python benchmarks/bench_verify.py --model qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import common  # noqa: F401  (puts src/ on the path)
from verispec.models import load_model
from verispec.models.fastlinear import backend_name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()
    loaded = load_model(args.model, progress=False)
    model = loaded.model
    V = model.config.vocab_size
    ctx = torch.randint(0, V, (1, args.context))
    cache = model.new_cache(1, args.context + 32)
    row = cache.alloc()
    model.forward(ctx, cache, row)
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM, DynamicCache
        hf = AutoModelForCausalLM.from_pretrained(str(loaded.files.path), dtype=torch.float32).eval()
    ks = [1, 2, 4, 8, 16]
    res = {k: {"native": [], "hf": []} for k in ks}
    for _ in range(args.repeats):
        for k in ks:  # interleaved
            x = torch.randint(0, V, (1, k))
            t = time.perf_counter()
            model.forward(x, cache, row)
            res[k]["native"].append(time.perf_counter() - t)
            cache.truncate(row, [args.context])
            if hf is not None:
                with torch.no_grad():
                    pkv = DynamicCache(config=hf.config)
                    hf(ctx, past_key_values=pkv, use_cache=True)
                    t = time.perf_counter()
                    hf(x, past_key_values=pkv, use_cache=True)
                    res[k]["hf"].append(time.perf_counter() - t)
    print(f"model {args.model}, context {args.context}, backend {backend_name()}, "
          f"threads {torch.get_num_threads()}, median of {args.repeats}")
    print(f"{'k':>3} {'native ms':>10} {'x k=1':>6} {'HF ms':>9} {'x k=1':>6}")
    n1 = statistics.median(res[1]["native"])
    h1 = statistics.median(res[1]["hf"]) if hf is not None else None
    for k in ks:
        n = statistics.median(res[k]["native"])
        line = f"{k:>3} {n * 1e3:>10.1f} {n / n1:>5.2f}x"
        if hf is not None:
            h = statistics.median(res[k]["hf"])
            line += f" {h * 1e3:>9.1f} {h / h1:>5.2f}x"
        print(line)


if __name__ == "__main__":
    main()
