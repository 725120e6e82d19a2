"""Adaptive speculation vs fixed k vs plain decoding, per audit slice and batch size,
measured side by side (every configuration on the same prompts, interleaved per cell).

    python benchmarks/bench_adaptive.py --target smollm2-135m --draft lookup --batches 1,4,16
    python benchmarks/bench_adaptive.py --target smollm2-135m --draft layerskip:20
    python benchmarks/bench_adaptive.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --batches 1,4

Prints a table of speedup over plain decoding; --plot writes a PNG.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict

import torch
from common import suite_prompts
from tqdm import tqdm

from verispec.drafters import make_drafter
from verispec.engine import Engine, EngineConfig, GenerationParams, PromptCache, Request
from verispec.models import load_model
from verispec.policy import FixedK
from verispec.policy.adaptive import AdaptivePolicy, measure_costs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="lookup")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--fixed", default="2,4,8")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--slices", default=None, help="comma list (default: all 8)")
    ap.add_argument("--load", default="2",
                    help="requests per batch slot: freed rows are refilled, as in a server (1 = one closed "
                         "batch); one number, or one per batch size (a batch-1 cell of one request is a "
                         "handful of steps, and as noisy)")
    ap.add_argument("--max-requests", type=int, default=None,
                    help="cap on requests per cell (batch x load), to keep large batches affordable")
    ap.add_argument("--rounds", default="3",
                    help="repeat every configuration, interleaved; median of the per-round ratios "
                         "(one number, or one per batch size: small batches are short and noisy)")
    ap.add_argument("--aa", action="store_true",
                    help="also run plain decoding a second time as a configuration: the noise floor")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    loaded = load_model(args.target, progress=False)
    target, tok = loaded.model, loaded.tokenizer
    batches = [int(b) for b in args.batches.split(",")]
    fixed = [int(k) for k in args.fixed.split(",")]

    def per_batch(flag: str, text: str) -> dict[int, int]:
        # one positive number for every batch size, or one per batch size
        xs = [int(x) for x in text.split(",")]
        if len(xs) not in (1, len(batches)) or min(xs) < 1:
            ap.error(f"{flag} takes one positive number or one per batch size")
        return dict(zip(batches, xs * len(batches) if len(xs) == 1 else xs))
    rounds, loads = per_batch("--rounds", args.rounds), per_batch("--load", args.load)
    kmax = max(fixed)
    prompts = suite_prompts(12, args.slices.split(",") if args.slices else None)
    by_slice = defaultdict(list)
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p.prompt}], add_generation_prompt=True,
                                      tokenize=True)
        by_slice[p.slice].append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    max_len = max(len(x) for v in by_slice.values() for x in v) + args.max_new
    drafter = make_drafter(args.draft, target, tok, max_rows=max(batches), max_len=max_len + kmax + 2,
                           progress=False)
    # every configuration of a cell prefills the same prompts: prefill each once, and
    # restore the snapshot after (prefill is excluded from the figures anyway)
    prompt_cache = PromptCache(max_tokens=1 << 20)
    if hasattr(drafter, "prompt_cache"):
        drafter.prompt_cache = PromptCache(max_tokens=1 << 20)
    costs = {b: measure_costs(target, drafter, b, kmax) for b in batches}
    # one policy per batch size for the whole run, as a server keeps one: what it learns
    # about the drafter and its measured step times carries from request to request
    adaptive = {b: AdaptivePolicy(costs[b], max_k=kmax) for b in batches}
    warm = next(iter(by_slice.values()))[:1]  # page the weights in and build kernels before timing
    for d, pol in ((None, FixedK(0)), (drafter, FixedK(kmax))):
        Engine(target, d, pol, EngineConfig(max_batch=1, max_len=max_len)).run(
            [Request(x, GenerationParams(max_new_tokens=4, ignore_eos=True)) for x in warm])
    # --aa: plain decoding a second time, as if it were a configuration under test; its
    # ratio to plain is the noise floor of this harness on this machine, cell by cell
    configs = ["plain"] + (["plain again"] if args.aa else []) + [f"k={k}" for k in fixed] + ["adaptive"]
    fixed_cfgs = [f"k={k}" for k in fixed]
    tps = defaultdict(dict)  # (slice, batch) -> config -> tok/s
    chosen = defaultdict(list)
    cells = [(s, b) for b in batches for s in by_slice]
    for sl, b in tqdm(cells, desc="cells"):
        n_req = min(b * loads[b], args.max_requests or b * loads[b])
        ids = (by_slice[sl] * ((n_req + len(by_slice[sl]) - 1) // len(by_slice[sl])))[:n_req]
        runs = defaultdict(list)
        for rnd in range(rounds[b]):
            # rotate the order each round: no configuration always runs first or last
            for cfg in configs[rnd % len(configs):] + configs[:rnd % len(configs)]:
                if cfg in ("plain", "plain again"):
                    d, pol = None, FixedK(0)
                elif cfg == "adaptive":
                    d, pol = drafter, adaptive[b]
                else:
                    d, pol = drafter, FixedK(int(cfg[2:]))
                eng = Engine(target, d, pol, EngineConfig(max_batch=b, max_len=max_len),
                             prompt_cache=prompt_cache)
                reqs = [Request(x, GenerationParams(max_new_tokens=args.max_new, ignore_eos=True)) for x in ids]
                t = time.perf_counter()
                eng.run(reqs)
                # decode throughput: prefill (target and drafter) is the same work in every
                # configuration, so it is left out rather than allowed to dilute the ratios
                dt = time.perf_counter() - t - eng.times.prefill_s
                runs[cfg].append(sum(len(r.output_ids) for r in reqs) / dt)
                if cfg == "adaptive":
                    ks = [k for r in reqs for k in r.stats.k_chosen]
                    chosen[(sl, b)] = sum(ks) / len(ks)
        # a ratio is taken within a round (configurations side by side), then the median
        # over rounds: a slow spell of the machine moves a round's ratios far less than
        # its throughputs
        tps[(sl, b)] = {"plain": statistics.median(runs["plain"])}
        tps[(sl, b)].update({c: tps[(sl, b)]["plain"] * statistics.median(
            [x / p for x, p in zip(runs[c], runs["plain"])]) for c in configs[1:]})
        d = tps[(sl, b)]
        tqdm.write(f"batch {b:>2} {sl:<14} plain {d['plain']:.2f} tok/s; " + ", ".join(
            f"{c} {d[c] / d['plain']:.2f}x" for c in configs[1:]), file=sys.stdout)
    print(f"\n{args.target} with {args.draft}, greedy, {args.max_new} new tokens, chat template; "
          f"decode throughput (prefill excluded), {args.load} requests per batch slot"
          f"{f' (batch {args.batches})' if ',' in args.load else ''}"
          f"{f' (at most {args.max_requests} per cell)' if args.max_requests else ''}; median over {args.rounds} "
          f"interleaved rounds of the ratio to plain decoding in the same round; "
          f"speedup over plain decoding (adaptive: mean k chosen)")
    print("| batch | slice | plain tok/s | " + " | ".join(configs[1:]) + " | adaptive / best fixed |")
    print("|---" * (len(configs) + 3) + "|")
    worst_plain, worst_best = 9e9, 9e9
    for (sl, b), d in tps.items():
        best = max(d[c] for c in fixed_cfgs)
        worst_plain = min(worst_plain, d["adaptive"] / d["plain"])
        worst_best = min(worst_best, d["adaptive"] / best)
        print(f"| {b} | {sl} | {d['plain']:.1f} | " + " | ".join(
            f"{d[c] / d['plain']:.2f}x" + (f" (k~{chosen[(sl, b)]:.1f})" if c == "adaptive" else "")
            for c in configs[1:]) + f" | {d['adaptive'] / best:.2f} |")
    print(f"\nworst cell: adaptive / plain = {worst_plain:.2f}x, adaptive / best fixed k = {worst_best:.2f}x")
    if args.aa:
        aa = [d["plain again"] / d["plain"] for d in tps.values()]
        print(f"plain again / plain (noise floor): {min(aa):.2f}x to {max(aa):.2f}x over {len(aa)} cells")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{s}|{b}": d for (s, b), d in tps.items()}, f, indent=1)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), sharey=True)
        axes = [axes] if len(batches) == 1 else axes
        sl_names = list(by_slice)
        for ax, b in zip(axes, batches):
            w = 0.8 / (len(configs) - 1)
            for i, c in enumerate(configs[1:]):
                ax.bar([j + i * w for j in range(len(sl_names))],
                       [tps[(s, b)][c] / tps[(s, b)]["plain"] for s in sl_names], w, label=c)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xticks([j + 0.4 - w / 2 for j in range(len(sl_names))], sl_names, rotation=45, ha="right")
            ax.set_title(f"batch {b}")
        axes[0].set_ylabel("speedup over plain decoding")
        axes[-1].legend()
        fig.suptitle(f"{args.target} / {args.draft}")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
