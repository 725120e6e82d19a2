"""Cost of the batch-invariant mode: tokens/s of plain and speculative decoding on
SmolLM2-135M, default numerics vs batch-invariant numerics, side by side in one run.

Every configuration runs once per repeat, default and invariant back to back (their
order alternating between repeats), so both see the same machine state; the table
reports medians over repeats. Generation has a fixed length (EOS ignored), so both
modes produce the same number of tokens. It also checks what the mode promises: the
invariant outputs are identical across batch sizes and with speculation.

    python benchmarks/bench_batch_invariant.py --repeats 3 --max-new 24
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import suite_prompts

from verispec.drafters import make_drafter
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.models import load_model
from verispec.models.llama import LlamaModel
from verispec.policy import FixedK


def run(target, drafter_spec, k, ids, batch, max_new):
    drafter = make_drafter(drafter_spec, target, None, max_rows=batch, max_len=4096)
    eng = Engine(target, drafter, FixedK(k if drafter is not None else 0),
                 EngineConfig(max_batch=batch, max_len=max(map(len, ids)) + max_new, rule="greedy"))
    reqs = [Request(x, GenerationParams(max_new_tokens=max_new, ignore_eos=True)) for x in ids]
    t = time.perf_counter()
    eng.run(reqs)
    dt = time.perf_counter() - t
    return sum(len(r.output_ids) for r in reqs) / dt, [r.output_ids for r in reqs], reqs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default="lookup:3", help="lookup[:N] or layerskip:N")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model, progress=False)
    tok = loaded.tokenizer
    models = {"default": loaded.model,
              "invariant": LlamaModel.from_dir(loaded.files.path, batch_invariant=True)}
    batches = [int(b) for b in args.batches.split(",")]
    prompts = suite_prompts(max(1, -(-max(batches) // 8)))  # one or more per slice
    ids_all = []
    for p in prompts:
        x = tok.apply_chat_template([{"role": "user", "content": p.prompt}], add_generation_prompt=True,
                                    tokenize=True)
        ids_all.append(list(x["input_ids"] if hasattr(x, "keys") else x))
    decodings = {"plain": None, args.drafter: args.drafter}
    # batch 1 runs fewer prompts (the same first ones) to keep the run short
    n_prompts = {b: max(b, 4) for b in batches}
    tps: dict[tuple, list[float]] = {}
    outs: dict[tuple, list] = {}
    acc: dict[tuple, float] = {}
    print(f"{args.model}, greedy, {args.max_new} new tokens per prompt, {torch.get_num_threads()} threads, "
          f"drafter {args.drafter} k={args.k}; {args.repeats} repeats, interleaved", flush=True)
    for rep in range(args.repeats):
        for b in batches:
            ids = ids_all[:n_prompts[b]]
            for dname, dspec in decodings.items():
                order = ["default", "invariant"] if rep % 2 == 0 else ["invariant", "default"]
                for mode in order:
                    r, o, reqs = run(models[mode], dspec, args.k, ids, b, args.max_new)
                    key = (b, dname, mode)
                    tps.setdefault(key, []).append(r)
                    outs[key] = o
                    drafted = sum(q.stats.drafted for q in reqs)
                    if drafted:
                        acc[key] = sum(q.stats.accepted for q in reqs) / drafted
                    print(f"  repeat {rep + 1}: batch {b} {dname:<12} {mode:<9} {r:6.2f} tok/s", flush=True)

    print("\n| batch | decoding | default tok/s | invariant tok/s | invariant / default | overhead |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for b in batches:
        for dname in decodings:
            d = statistics.median(tps[(b, dname, "default")])
            i = statistics.median(tps[(b, dname, "invariant")])
            ratios.append(i / d)
            a = f" (acceptance {acc[(b, dname, 'invariant')]:.0%})" if (b, dname, "invariant") in acc else ""
            print(f"| {b} | {dname}{a} | {d:.2f} | {i:.2f} | {i / d:.2f}x | {d / i - 1:+.0%} |")
    print(f"geometric mean invariant / default throughput: {statistics.geometric_mean(ratios):.2f}x")
    # what the mode buys: the same tokens whatever the batch and the decoding
    for mode in ("default", "invariant"):
        n = min(n_prompts.values())
        ref = outs[(batches[0], "plain", mode)][:n]
        same = all(outs[(b, d, mode)][:n] == ref for b in batches for d in decodings)
        print(f"{mode}: outputs identical across batch sizes and decodings (first {n} prompts): {same}")


if __name__ == "__main__":
    main()
