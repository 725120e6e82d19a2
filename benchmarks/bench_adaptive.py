"""Adaptive speculation vs fixed k vs plain decoding, per audit slice and batch size,
measured side by side: every configuration on the same prompts, and by default decoding
at the same time, one engine step of each in turn (--interleave step).

    python benchmarks/bench_adaptive.py --target smollm2-135m --draft lookup --batches 1,4,16
    python benchmarks/bench_adaptive.py --target smollm2-135m --draft layerskip:20
    python benchmarks/bench_adaptive.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --batches 1,4
    python benchmarks/bench_adaptive.py --backend ggml --target qwen2.5-coder-1.5b --draft lookup

Prints a table of speedup over plain decoding; --plot writes a PNG.

Two throughputs per run. Full batch: tokens emitted over seconds spent in the steps that
decode b rows, the throughput of a server holding b requests (a server under load keeps
its batch full). Closed batch: every token of the cell's requests over the whole run,
drain included. With --ignore-eos lengths every plain row of a wave ends on the same
step, while speculative rows accept different numbers of tokens and end apart, so the
last requests decode on in a thinning batch, at a worse cost per token; that drain
is a cost of speculation on a closed workload, and its share shrinks as --load grows.
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


def _twin(drafter, target, max_rows: int, max_len: int):
    """A drafter like `drafter` with per-row state of its own, sharing any weights."""
    from verispec.drafters.draft_model import DraftModelDrafter
    from verispec.drafters.layerskip import LayerSkipDrafter
    from verispec.drafters.lookup import PromptLookupDrafter
    if isinstance(drafter, DraftModelDrafter):
        twin = DraftModelDrafter(drafter.model, drafter.target_vocab, max_rows=max_rows, max_len=max_len,
                                 name=drafter.name)
        twin.prompt_cache = drafter.prompt_cache
        return twin
    if isinstance(drafter, LayerSkipDrafter):
        return LayerSkipDrafter(target, drafter.num_layers)
    if isinstance(drafter, PromptLookupDrafter):
        return PromptLookupDrafter(max_ngram=drafter.max_ngram)
    raise TypeError(f"no twin for {type(drafter).__name__}")


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
    ap.add_argument("--interleave", choices=("step", "run"), default="step",
                    help="step: the configurations of a round decode side by side, one engine step "
                         "each in turn, each timed on its own steps (a slow spell of the machine hits "
                         "all alike); run: one configuration's whole run after another")
    ap.add_argument("--aa", action="store_true",
                    help="also run plain decoding a second time as a configuration: the noise floor")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--backend", default="auto", choices=("auto", "native", "ggml"),
                    help="the target's (and a draft model's) backend; ggml: the GGUF as shipped")
    ap.add_argument("--threads", type=int, default=None, help="torch (and ggml) threads")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.target, progress=False, backend=args.backend)
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
    # configurations decoding side by side each need a drafter of their own (a drafter
    # keeps per-row state); a draft model's weights and prefill snapshots are shared
    drafters = {f"k={k}": _twin(drafter, target, max(batches), max_len + kmax + 2) for k in fixed}
    drafters["adaptive"] = drafter
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
    tps = defaultdict(dict)  # (slice, batch) -> config -> tok/s in full-batch steps
    closed = defaultdict(dict)  # (slice, batch) -> config -> tok/s over the whole run
    chosen = defaultdict(list)
    cells = [(s, b) for b in batches for s in by_slice]
    for sl, b in tqdm(cells, desc="cells"):
        n_req = min(b * loads[b], args.max_requests or b * loads[b])
        ids = (by_slice[sl] * ((n_req + len(by_slice[sl]) - 1) // len(by_slice[sl])))[:n_req]
        runs, runs_closed = defaultdict(list), defaultdict(list)
        for rnd in range(rounds[b]):
            # rotate the order each round: no configuration always runs first or last
            order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
            engines = {}
            for cfg in order:
                if cfg in ("plain", "plain again"):
                    d, pol = None, FixedK(0)
                elif cfg == "adaptive":
                    d, pol = drafters[cfg], adaptive[b]
                else:
                    d, pol = drafters[cfg], FixedK(int(cfg[2:]))
                engines[cfg] = Engine(target, d, pol, EngineConfig(max_batch=b, max_len=max_len),
                                      prompt_cache=prompt_cache)
            reqs = {cfg: [Request(x, GenerationParams(max_new_tokens=args.max_new, ignore_eos=True))
                          for x in ids] for cfg in order}
            secs = dict.fromkeys(order, 0.0)
            if args.interleave == "step":
                # one step of each configuration in turn: a slow spell of the shared
                # machine lands on every configuration alike, not on whichever ran then
                for cfg in order:
                    for r in reqs[cfg]:
                        engines[cfg].add(r)
                live = list(order)
                while live:
                    for cfg in list(live):
                        t = time.perf_counter()
                        engines[cfg].step()
                        secs[cfg] += time.perf_counter() - t
                        if not engines[cfg].has_work:
                            live.remove(cfg)
            else:  # one configuration after another
                for cfg in order:
                    t = time.perf_counter()
                    engines[cfg].run(reqs[cfg])
                    secs[cfg] = time.perf_counter() - t
            for cfg in order:
                eng = engines[cfg]
                # decode throughput: prefill (target and drafter) is the same work in every
                # configuration, so it is left out rather than allowed to dilute the ratios
                dt = secs[cfg] - eng.times.prefill_s
                runs_closed[cfg].append(sum(len(r.output_ids) for r in reqs[cfg]) / dt)
                full = [(n, s) for bb, _, n, s in eng.times.per_step if bb == b]
                runs[cfg].append(sum(n for n, _ in full) / sum(s for _, s in full))
                if cfg == "adaptive":
                    ks = [k for r in reqs[cfg] for k in r.stats.k_chosen]
                    chosen[(sl, b)] = sum(ks) / len(ks)
        # a ratio is taken within a round (configurations side by side), then the median
        # over rounds: a slow spell of the machine moves a round's ratios far less than
        # its throughputs
        for out, rs in ((tps, runs), (closed, runs_closed)):
            out[(sl, b)] = {"plain": statistics.median(rs["plain"])}
            out[(sl, b)].update({c: out[(sl, b)]["plain"] * statistics.median(
                [x / p for x, p in zip(rs[c], rs["plain"])]) for c in configs[1:]})
        d, dc = tps[(sl, b)], closed[(sl, b)]
        tqdm.write(f"batch {b:>2} {sl:<14} plain {d['plain']:.2f} tok/s; " + ", ".join(
            f"{c} {d[c] / d['plain']:.2f}x ({dc[c] / dc['plain']:.2f}x)" for c in configs[1:])
            + "  [full batch (closed batch)]", file=sys.stdout)
    print(f"\n{args.target} ({target.backend}) with {args.draft}, greedy, {args.max_new} new tokens, chat template; "
          f"decode throughput (prefill excluded), {args.load} requests per batch slot"
          f"{f' (batch {args.batches})' if ',' in args.load else ''}"
          f"{f' (at most {args.max_requests} per cell)' if args.max_requests else ''}; median over {args.rounds} "
          f"rounds (configurations interleaved per {args.interleave}) of the ratio to plain decoding in the same round; "
          f"speedup over plain decoding (adaptive: mean k chosen); full-batch throughput, with the "
          f"closed-batch figure (drain included) in brackets")
    print("| batch | slice | plain tok/s | " + " | ".join(configs[1:]) + " | adaptive / best fixed |")
    print("|---" * (len(configs) + 3) + "|")
    for (sl, b), d in tps.items():
        dc = closed[(sl, b)]
        best, best_c = max(d[c] for c in fixed_cfgs), max(dc[c] for c in fixed_cfgs)
        print(f"| {b} | {sl} | {d['plain']:.1f} | " + " | ".join(
            f"{d[c] / d['plain']:.2f}x ({dc[c] / dc['plain']:.2f}x)"
            + (f" k~{chosen[(sl, b)]:.1f}" if c == "adaptive" else "")
            for c in configs[1:]) + f" | {d['adaptive'] / best:.2f} ({dc['adaptive'] / best_c:.2f}) |")
    for label, t in (("full batch", tps), ("closed batch", closed)):
        vs_plain = [d["adaptive"] / d["plain"] for d in t.values()]
        vs_best = [d["adaptive"] / max(d[c] for c in fixed_cfgs) for d in t.values()]
        print(f"\n{label}: worst cell adaptive / plain = {min(vs_plain):.2f}x "
              f"({sum(x >= 0.95 for x in vs_plain)}/{len(vs_plain)} cells >= 0.95x), "
              f"adaptive / best fixed k = {min(vs_best):.2f}x ({sum(x >= 0.9 for x in vs_best)}/{len(vs_best)} >= 0.9x)")
        if args.aa:
            aa = [d["plain again"] / d["plain"] for d in t.values()]
            print(f"  plain again / plain (noise floor): {min(aa):.2f}x to {max(aa):.2f}x over {len(aa)} cells")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"full_batch": {f"{s}|{b}": d for (s, b), d in tps.items()},
                       "closed_batch": {f"{s}|{b}": d for (s, b), d in closed.items()},
                       "mean_k": {f"{s}|{b}": k for (s, b), k in chosen.items()}}, f, indent=1)
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
                xs = [j + i * w for j in range(len(sl_names))]
                ax.bar(xs, [tps[(s, b)][c] / tps[(s, b)]["plain"] for s in sl_names], w, label=c)
                if c == "adaptive":  # the closed-batch figure, drain included
                    ax.scatter(xs, [closed[(s, b)][c] / closed[(s, b)]["plain"] for s in sl_names],
                               marker="_", s=120, color="k", zorder=3,
                               label="adaptive, closed batch" if b == batches[-1] else None)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.axhline(0.95, color="k", lw=0.6, ls=":")
            ax.set_xticks([j + 0.4 - w / 2 for j in range(len(sl_names))], sl_names, rotation=45, ha="right")
            ax.set_title(f"batch {b}")
        axes[0].set_ylabel("speedup over plain decoding")
        axes[-1].legend()
        fig.suptitle(f"{args.target} / {args.draft}: full-batch throughput over plain decoding")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
