"""Plain (non-speculative) decoding: native runtime vs Hugging Face generate, same model,
same prompts, batch 1 and batch 8, measured side by side (interleaved) in one run.

    python benchmarks/bench_plain.py --model smollm2-135m --max-new 32
    python benchmarks/bench_plain.py --model qwen2.5-coder-1.5b --max-new 16 --prompts 2
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import Timer, hf_generate, suite_prompts

from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.models import load_model
from verispec.models.fastlinear import backend_name


def native_generate(model, ids_list, max_new, batch):
    eng = Engine(model, config=EngineConfig(max_batch=batch, max_len=max(map(len, ids_list)) + max_new))
    reqs = [Request(ids, GenerationParams(max_new_tokens=max_new, ignore_eos=True)) for ids in ids_list]
    eng.run(reqs)
    return sum(len(r.output_ids) for r in reqs), eng.times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=1, help="prompts per slice (8 slices)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM
    loaded = load_model(args.model, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(loaded.files.path), dtype=torch.float32).eval()
    tok = loaded.tokenizer
    prompts = suite_prompts(args.prompts)
    ids = [tok(p.prompt)["input_ids"] for p in prompts]
    print(f"model {args.model}, {len(ids)} prompts ({min(map(len, ids))}-{max(map(len, ids))} tokens), "
          f"{args.max_new} new tokens each, linear backend {backend_name()}, threads {torch.get_num_threads()}")
    print(f"{'batch':>5} {'HF tok/s':>9} {'native tok/s':>12} {'ratio':>6}")
    for batch in map(int, args.batches.split(",")):
        hf_r, nat_r = [], []
        for _ in range(args.repeats):  # interleaved: both see the same machine state
            with Timer() as t:
                n = hf_generate(hf, tok, ids, args.max_new, batch)
            hf_r.append(n / t.s)
            with Timer() as t:
                n, _ = native_generate(loaded.model, ids, args.max_new, batch)
            nat_r.append(n / t.s)
        h, nt = statistics.median(hf_r), statistics.median(nat_r)
        print(f"{batch:>5} {h:>9.2f} {nt:>12.2f} {nt / h:>5.2f}x")


if __name__ == "__main__":
    main()
