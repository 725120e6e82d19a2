"""Speculation on the ggml backend against llama.cpp's own plain decoding, per task slice and
batch size, side by side in one run on the same GGUF files, token ids and threads.

Per cell (slice, batch b), the slice's --prompts prompts (chat template) run as waves of b
concurrent greedy requests of --max-new tokens (EOS ignored, as llama-bench does), under each
configuration:

- plain: verispec on ggml, no drafter;
- adaptive[D]: verispec on ggml, the adaptive policy (k <= --k) with drafter D, for every D in
  --drafts (prompt lookup, a draft model on ggml, ...);
- llama.cpp: `llama-server -np b` (built from the pinned sdist by scripts/build_llama_cpp.sh)
  serving the same token ids, no draft, no prompt cache.

The configurations of a round run one after another (never at once: 2 cores), the order
rotated each round; a ratio is taken within a round and the median over --rounds kept, so a
slow spell of the shared machine moves both sides of a ratio. Against plain verispec (the same
backend, the same prefill) the ratio is of decode throughput, prefill left out (the engine's
prefill time; a draft model's prefill counts as prefill). Against llama.cpp it is end to end,
each wave's tokens over its wall time: llama-server's own decode figure (the requests'
predicted_ms) is not comparable beyond batch 1, since its continuous batching decodes the first
requests of a wave while it still evaluates the prompts of the others (measured: its decode
throughput read 21 tok/s at batch 16 on the summarisation slice, end to end 0.84x of verispec's
plain), so both figures are printed and the verdict reads the end-to-end one.

Where a drafter cannot pay, the measured costs say why: for each drafter and batch size the
script prints the target pass over 1 and k + 1 tokens per row and the drafter's cost per
draft token, and the acceptance a row needs for one draft per step to break even,
a* = (c(b, 2) + d(b)) / c(b, 1) - 1, next to the acceptance measured per slice.

    python benchmarks/ggml_slices.py --target qwen2.5-coder-1.5b --drafts lookup,qwen2.5-coder-0.5b \\
        --threads 2 --batches 1,4,16 --json /tmp/slices.json --plot /tmp/slices.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from verispec.omp import spin_for_ggml

spin_for_ggml()  # before torch loads libgomp: llama.cpp's threads spin between decodes (omp.py)

import torch  # noqa: E402
from bench_ggml import Server, tools
from common import suite_prompts
from tqdm import tqdm

from verispec.drafters import make_drafter
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.models import load_model
from verispec.policy import FixedK
from verispec.policy.adaptive import AdaptivePolicy, measure_costs

LLAMA = "llama.cpp"


def run_verispec(target, drafter, policy, waves, max_new, b, max_len):
    """-> (tokens, decode seconds, wall seconds, drafted, accepted) over the waves."""
    n = decode = wall = drafted = accepted = 0
    for wave in waves:
        eng = Engine(target, drafter, policy, EngineConfig(max_batch=b, max_len=max_len))
        reqs = [Request(list(x), GenerationParams(max_new_tokens=max_new, ignore_eos=True)) for x in wave]
        t = time.perf_counter()
        eng.run(reqs)
        dt = time.perf_counter() - t
        n += sum(len(r.output_ids) for r in reqs)
        decode += dt - eng.times.prefill_s  # the target's and the drafter's prefill
        wall += dt
        drafted += sum(r.stats.drafted for r in reqs)
        accepted += sum(r.stats.accepted for r in reqs)
    return n, decode, wall, drafted, accepted


def run_server(srv: Server, waves, max_new):
    """llama-server, each wave's requests at once -> (tokens, decode seconds, wall seconds)."""
    n = decode = wall = 0
    with ThreadPoolExecutor(max(len(w) for w in waves)) as pool:
        for wave in waves:
            def one(ids):
                r = srv.http.post("/completion", json={
                    "prompt": list(ids), "n_predict": max_new, "ignore_eos": True, "temperature": 0,
                    "top_k": 1, "cache_prompt": False, "samplers": ["top_k"]})
                r.raise_for_status()
                return r.json()
            t = time.perf_counter()
            res = list(pool.map(one, wave))
            wall += time.perf_counter() - t
            n += sum(r["timings"]["predicted_n"] for r in res)
            # the wave's decode phase: from the first token of the slowest request to its last
            decode += max(r["timings"]["predicted_ms"] for r in res) / 1000
    return n, decode, wall, 0, 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b", help="a preset or a .gguf file")
    ap.add_argument("--drafts", default="lookup,qwen2.5-coder-0.5b", help="comma list of drafters")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per slice")
    ap.add_argument("--slices", default=None, help="comma list (default: all 8)")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--k", type=int, default=8, help="the adaptive policy's cap")
    ap.add_argument("--rounds", default="2", help="one number, or one per batch size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="print the summary and draw --plot again from an earlier run's --json; runs nothing")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            doc = json.load(f)
        rows = doc["rows"]
        batches = sorted({r["batch"] for r in rows})
        dnames = list(rows[0]["drafters"])
        breakeven = {(k.rsplit("|", 1)[0], int(k.rsplit("|", 1)[1])): v for k, v in doc["breakeven"].items()}
        summarise(rows, batches, dnames, breakeven)
        if args.plot:
            plot(rows, batches, dnames, list(dict.fromkeys(r["slice"] for r in rows)),
                 argparse.Namespace(**doc["args"]))
        return
    torch.set_num_threads(args.threads)  # the ggml backend follows torch's thread count
    batches = [int(b) for b in args.batches.split(",")]
    rs = [int(x) for x in args.rounds.split(",")]
    rounds = dict(zip(batches, rs * len(batches) if len(rs) == 1 else rs))
    bin_dir = tools()
    loaded = load_model(args.target, backend="ggml", progress=False)
    target, tok, gguf = loaded.model, loaded.tokenizer, loaded.files.path
    print(f"{args.target}: {gguf.name} (sha256 {loaded.files.sha256[:16]}...), {args.threads} threads", flush=True)
    by_slice = defaultdict(list)
    for p in suite_prompts(args.prompts, args.slices.split(",") if args.slices else None):
        ids = tok.apply_chat_template([{"role": "user", "content": p.prompt}], add_generation_prompt=True,
                                      tokenize=True)
        by_slice[p.slice].append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    max_len = max(len(x) for v in by_slice.values() for x in v) + args.max_new + args.k + 2
    drafters = {}
    for spec in args.drafts.split(","):
        drafters[spec] = make_drafter(spec, target, tok, max_rows=max(batches), max_len=max_len, progress=False)
    configs = ["plain", *(f"adaptive[{d}]" for d in drafters), LLAMA]

    # the measured costs the policy plans with, and what they say a draft must achieve
    costs = {(d, b): measure_costs(target, drafters[d], b, args.k) for d in drafters for b in batches}
    print("\nmeasured costs (ms): target pass over b rows x T tokens; drafter per draft token; "
          "a* = acceptance one draft per step needs to break even")
    print("| drafter | batch | c(b,1) | c(b,2) | c(b,5) | c(b,9) | draft/token | a* (k=1) |")
    print("|---|---|---|---|---|---|---|---|")
    breakeven = {}
    for (d, b), cm in costs.items():
        c1, c2 = float(cm.target(b, 1)), float(cm.target(b, 2))
        dr = 0.0 if cm.draft_free else float(cm.draft(b))
        breakeven[(d, b)] = (c2 + dr) / c1 - 1
        print(f"| {d} | {b} | {1e3 * c1:.1f} | {1e3 * c2:.1f} | {1e3 * float(cm.target(b, 5)):.1f} | "
              f"{1e3 * float(cm.target(b, 9)):.1f} | {1e3 * dr:.1f} | {breakeven[(d, b)]:.2f} |", flush=True)

    # warm-up: page the weights in, build kernels
    warm = [next(iter(by_slice.values()))[0]]
    for d in [None, *drafters.values()]:
        run_verispec(target, d, FixedK(0 if d is None else 2), [warm], 4, 1, max_len)

    dec = defaultdict(lambda: defaultdict(list))  # (slice, b) -> config -> [decode tok/s per round]
    e2e = defaultdict(lambda: defaultdict(list))
    acc = defaultdict(lambda: [0, 0])  # (slice, b, drafter) -> [drafted, accepted]
    mean_k = defaultdict(list)
    for b in batches:
        srv = Server(bin_dir, gguf, args.threads, b, b * max_len + 64)
        try:
            run_server(srv, [[warm[0]] * b], 4)
            # one policy per (drafter, batch) for the whole run, as a server keeps one
            policies = {d: AdaptivePolicy(costs[(d, b)], max_k=args.k) for d in drafters}
            cells = [(s, r) for r in range(rounds[b]) for s in by_slice]
            for sl, rnd in tqdm(cells, desc=f"batch {b}"):
                ids = by_slice[sl]
                # waves of b requests; a wave wider than the slice repeats its prompts
                n_req = max(len(ids), b) if b > 1 else len(ids)
                allreq = (ids * ((n_req + len(ids) - 1) // len(ids)))[:n_req]
                waves = [allreq[i:i + b] for i in range(0, len(allreq), b)]
                order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
                for cfg in order:
                    if cfg == LLAMA:
                        n, ds, ws, _, _ = run_server(srv, waves, args.max_new)
                    elif cfg == "plain":
                        n, ds, ws, _, _ = run_verispec(target, None, FixedK(0), waves, args.max_new, b, max_len)
                    else:
                        d = cfg[len("adaptive["):-1]
                        n, ds, ws, nd, na = run_verispec(target, drafters[d], policies[d], waves, args.max_new,
                                                         b, max_len)
                        acc[(sl, b, d)][0] += nd
                        acc[(sl, b, d)][1] += na
                        mean_k[(sl, b, d)].append(nd / max(1, n))
                    dec[(sl, b)][cfg].append(n / ds)
                    e2e[(sl, b)][cfg].append(n / ws)
        finally:
            srv.close()

    def ratio(t, key, num, den):
        return statistics.median(x / y for x, y in zip(t[key][num], t[key][den]))

    print(f"\n{args.target} on ggml, {args.threads} threads, greedy, {args.max_new} new tokens (EOS ignored), "
          f"chat template, {args.prompts} prompts per slice in waves of b; decode throughput (prefill excluded), "
          f"end to end in brackets; median over rounds of the ratio within a round")
    dnames = list(drafters)
    print("| batch | slice | plain tok/s | llama.cpp tok/s | plain / llama.cpp, decode (end to end) | "
          + " | ".join(f"adaptive[{d}] / plain (acceptance, drafts per token)" for d in dnames)
          + " | best / llama.cpp, end to end |")
    print("|---" * (5 + len(dnames) + 1) + "|")
    rows = []
    for (sl, b) in sorted(dec, key=lambda x: (x[1], list(by_slice).index(x[0]))):
        p = statistics.median(dec[(sl, b)]["plain"])
        lc = statistics.median(dec[(sl, b)][LLAMA])
        per_d = {}
        for d in dnames:
            c = f"adaptive[{d}]"
            nd, na = acc[(sl, b, d)]
            per_d[d] = {"vs_plain": ratio(dec, (sl, b), c, "plain"), "vs_plain_e2e": ratio(e2e, (sl, b), c, "plain"),
                        "vs_llama": ratio(dec, (sl, b), c, LLAMA), "vs_llama_e2e": ratio(e2e, (sl, b), c, LLAMA),
                        "acceptance": na / nd if nd else None, "drafted": nd,
                        "drafts_per_token": statistics.mean(mean_k[(sl, b, d)])}
        best = max(dnames, key=lambda d: per_d[d]["vs_llama_e2e"])
        row = {"slice": sl, "batch": b, "plain_tok_s": p, "llama_tok_s": lc,
               "plain_vs_llama": ratio(dec, (sl, b), "plain", LLAMA),
               "plain_vs_llama_e2e": ratio(e2e, (sl, b), "plain", LLAMA), "drafters": per_d, "best": best}
        rows.append(row)
        print(f"| {b} | {sl} | {p:.1f} | {lc:.1f} | {row['plain_vs_llama']:.2f}x ({row['plain_vs_llama_e2e']:.2f}x) | "
              + " | ".join(
                  f"{per_d[d]['vs_plain']:.2f}x ({per_d[d]['vs_plain_e2e']:.2f}x), "
                  + (f"{100 * per_d[d]['acceptance']:.0f}%" if per_d[d]["acceptance"] is not None else "no drafts")
                  + f", {per_d[d]['drafts_per_token']:.2f}" for d in dnames)
              + f" | {per_d[best]['vs_llama_e2e']:.2f}x ({best}) |")
    summarise(rows, batches, dnames, breakeven)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows,
                       "breakeven": {f"{d}|{b}": v for (d, b), v in breakeven.items()},
                       "costs": {f"{d}|{b}": cm.to_dict() for (d, b), cm in costs.items()},
                       "decode_tok_s": {f"{s}|{b}": dict(v) for (s, b), v in dec.items()},
                       "e2e_tok_s": {f"{s}|{b}": dict(v) for (s, b), v in e2e.items()}}, f, indent=1)
    if args.plot:
        plot(rows, batches, dnames, list(by_slice), args)


def summarise(rows, batches, dnames, breakeven):
    print()
    for b in batches:
        rb = [r for r in rows if r["batch"] == b]
        cells = [r["drafters"][d]["vs_plain"] for r in rb for d in dnames]
        best = [r["drafters"][r["best"]]["vs_llama_e2e"] for r in rb]
        # pooled: equal tokens per slice, each slice with its best drafter, seconds summed
        # (llama.cpp's throughput per slice only weights the slices)
        pooled = (sum(1 / r["llama_tok_s"] for r in rb)
                  / sum(1 / (r["llama_tok_s"] * r["drafters"][r["best"]]["vs_llama_e2e"]) for r in rb))
        print(f"batch {b}: cells adaptive / plain {min(cells):.2f}x..{max(cells):.2f}x "
              f"({sum(x >= 0.95 for x in cells)}/{len(cells)} >= 0.95x); best drafter per slice / llama.cpp plain, "
              f"end to end {min(best):.2f}x..{max(best):.2f}x, pooled (equal tokens per slice) {pooled:.2f}x, "
              f"{sum(x >= 1.0 for x in best)}/{len(best)} slices >= 1.0x")
        for d in dnames:
            acc_b = [r["drafters"][d]["acceptance"] for r in rb if r["drafters"][d]["acceptance"] is not None]
            print(f"  {d}: break-even acceptance at k = 1 from measured costs a* = {breakeven[(d, b)]:.2f}; "
                  f"measured acceptance per slice {', '.join(f'{a:.2f}' for a in acc_b) or 'no drafts'}")


def plot(rows, batches, dnames, slices, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4.2), sharey=True)
    axes = [axes] if len(batches) == 1 else axes
    series = ["plain", *dnames]
    w = 0.8 / len(series)
    for ax, b in zip(axes, batches):
        rb = {r["slice"]: r for r in rows if r["batch"] == b}
        for i, s in enumerate(series):
            ys = [rb[sl]["plain_vs_llama_e2e"] if s == "plain" else rb[sl]["drafters"][s]["vs_llama_e2e"]
                  for sl in slices]
            ax.bar([j + i * w for j in range(len(slices))], ys, w,
                   label="verispec plain" if s == "plain" else f"verispec adaptive, {s}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.1, color="k", lw=0.6, ls=":")
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(slices))], slices, rotation=45, ha="right")
        ax.set_title(f"batch {b}")
    axes[0].set_ylabel("end-to-end throughput / llama.cpp plain")
    axes[-1].legend(fontsize=8)
    fig.suptitle(f"{args.target} on ggml vs llama-server -np b (no draft), {args.threads} threads")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
