"""Speculative decoding on the Qwen2.5-Coder 1.5B target / 0.5B draft pair, greedy,
batch 1: speedup over plain decoding per prompt category, against Hugging Face
`generate(assistant_model=...)` and `generate(prompt_lookup_num_tokens=...)` on the
same prompts, with the ideal speedup that the measured acceptance and costs allow.
Every configuration runs on each prompt before the next prompt (interleaved), so all
see the same machine state. Then a ragged batch-8 run reports bookkeeping time.

    python benchmarks/bench_spec.py --prompts 1 --max-new 48
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
from common import suite_prompts

from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.lookup import PromptLookupDrafter
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.models import load_model
from verispec.policy import FixedK


def run_native(target, drafter, k, ids, max_new, batch=1, trace=False):
    eng = Engine(target, drafter, FixedK(k if drafter else 0),
                 EngineConfig(max_batch=batch, max_len=max(map(len, ids)) + max_new, trace=trace))
    reqs = [Request(x, GenerationParams(max_new_tokens=max_new, ignore_eos=True)) for x in ids]
    t = time.perf_counter()
    eng.run(reqs)
    dt = time.perf_counter() - t
    return reqs, dt, eng


def run_hf(hf, ids, max_new, **kw):
    x = torch.tensor([ids])
    t = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                          min_new_tokens=max_new, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist(), time.perf_counter() - t


def step_costs(target, draft, ctx_len: int, ks, repeats=7):
    """Measured seconds: target forward over n tokens at a cached context, draft 1 token.
    One warm-up round, then the sizes are timed round-robin (so a burst of load on the
    shared machine hits every size alike) and the median per size is kept."""
    V = target.config.vocab_size
    ctx = torch.randint(0, V, (1, ctx_len))
    tc, dc = target.new_cache(1, ctx_len + 20), draft.new_cache(1, ctx_len + 20)
    tr, dr = tc.alloc(), dc.alloc()
    target.forward(ctx, tc, tr)
    draft.forward(ctx, dc, dr)
    sizes = list(range(1, max(ks) + 2))
    ts = defaultdict(list)
    ds = []
    for rep in range(repeats + 1):
        for n in sizes:
            t = time.perf_counter()
            target.forward(torch.randint(0, V, (1, n)), tc, tr, last_only=False)
            if rep:
                ts[n].append(time.perf_counter() - t)
            tc.truncate(tr, [ctx_len])
        t = time.perf_counter()
        draft.forward(torch.randint(0, V, (1, 1)), dc, dr, last_only=True)
        if rep:
            ds.append(time.perf_counter() - t)
        dc.truncate(dr, [ctx_len])
    return {n: statistics.median(v) for n, v in ts.items()}, statistics.median(ds)


def ideal_speedup(reqs, cost, t_draft, t_lookup=0.0):
    """Tokens per step over the cost of a step, relative to one plain step, from the
    measured acceptance (per step) and measured forward costs: no bookkeeping counted."""
    steps = sum(r.stats.target_passes for r in reqs)
    tokens = sum(r.stats.generated_tokens for r in reqs)
    drafted = sum(r.stats.drafted for r in reqs)
    t_steps = sum(cost[len(drafts) + 1] for r in reqs for _, drafts, _, _ in r.stats.trace) \
        + drafted * t_draft + steps * t_lookup
    return tokens * cost[1] / t_steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", type=int, default=1, help="per category")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--k-lookup", type=int, default=8)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", default=None, help="write raw results here")
    args = ap.parse_args()

    tl, dl = load_model(args.target, progress=False), load_model(args.draft, progress=False)
    target, draft, tok = tl.model, dl.model, tl.tokenizer
    hf = hf_d = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(str(tl.files.path), dtype=torch.float32).eval()
        hf_d = AutoModelForCausalLM.from_pretrained(str(dl.files.path), dtype=torch.float32).eval()
    prompts = suite_prompts(args.prompts)
    V = target.config.vocab_size
    cfgs = {
        "plain": lambda: (None, 0),
        "draft": lambda: (DraftModelDrafter(draft, V, max_rows=1, max_len=4096), args.k),
        "lookup": lambda: (PromptLookupDrafter(3), args.k_lookup),
    }
    res = defaultdict(lambda: defaultdict(list))  # slice -> config -> [(tokens, seconds)]
    ideal = defaultdict(lambda: defaultdict(list))
    cost, t_draft = step_costs(target, draft, 150, [args.k, args.k_lookup])
    print(f"costs at context 150: target 1 token {cost[1] * 1e3:.0f} ms, "
          + ", ".join(f"{n} tokens {c / cost[1]:.2f}x" for n, c in cost.items() if n > 1)
          + f"; draft token {t_draft * 1e3:.0f} ms ({t_draft / cost[1]:.2f} of a target pass)", flush=True)
    mismatches = 0
    for i, p in enumerate(prompts):
        ids = tok.apply_chat_template([{"role": "user", "content": p.prompt}], add_generation_prompt=True,
                                      tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        outs = {}
        for name, make in cfgs.items():
            drafter, k = make()
            reqs, dt, _ = run_native(target, drafter, k, [ids], args.max_new, trace=True)  # ideal_speedup reads it
            outs[name] = reqs[0].output_ids
            res[p.slice][name].append((len(reqs[0].output_ids), dt))
            if name != "plain":
                ideal[p.slice][name].append(ideal_speedup(reqs, cost, t_draft if name == "draft" else 0.0))
                res[p.slice][name + "_stats"].append(reqs[0].stats.to_dict())
        if hf is not None:
            for name, kw in {"hf-plain": {}, "hf-assisted": {"assistant_model": hf_d},
                             "hf-lookup": {"prompt_lookup_num_tokens": 10}}.items():
                out, dt = run_hf(hf, ids, args.max_new, **kw)
                res[p.slice][name].append((len(out), dt))
                outs[name] = out
        mismatches += sum(o != outs["plain"] for n, o in outs.items() if not n.startswith("hf"))
        print(f"[{i + 1}/{len(prompts)}] {p.slice:<14} " + "  ".join(
            f"{n} {res[p.slice][n][-1][0] / res[p.slice][n][-1][1]:.2f}" for n in res[p.slice]
            if not n.endswith("_stats")) + " tok/s", flush=True)

    def tps(rows):
        return sum(t for t, _ in rows) / sum(s for _, s in rows)

    names = ["plain", "draft", "lookup"] + (["hf-plain", "hf-assisted", "hf-lookup"] if hf else [])
    print(f"\nGreedy, batch 1, {args.max_new} new tokens, chat template; draft k={args.k}, lookup k={args.k_lookup}")
    print("| slice | plain tok/s | draft-model speedup (ideal) | lookup speedup (ideal) | acc. len draft / lookup |"
          + (" HF plain | HF assisted | HF lookup | ours(draft)/HF assisted |" if hf else ""))
    pooled = defaultdict(list)
    for sl, d in res.items():
        for n in names:
            pooled[n] += d[n]
        base = tps(d["plain"])
        acc = [statistics.mean(s["mean_accepted_length"] for s in d[n + "_stats"]) for n in ("draft", "lookup")]
        line = (f"| {sl} | {base:.2f} | {tps(d['draft']) / base:.2f}x ({statistics.mean(ideal[sl]['draft']):.2f}x) | "
                f"{tps(d['lookup']) / base:.2f}x ({statistics.mean(ideal[sl]['lookup']):.2f}x) | "
                f"{acc[0]:.2f} / {acc[1]:.2f} |")
        if hf:
            line += (f" {tps(d['hf-plain']):.2f} | {tps(d['hf-assisted']):.2f} | {tps(d['hf-lookup']):.2f} | "
                     f"{tps(d['draft']) / tps(d['hf-assisted']):.2f}x |")
        print(line)
    base = tps(pooled["plain"])
    print("pooled tok/s: " + ", ".join(f"{n} {tps(pooled[n]):.2f}" for n in names))
    line = f"pooled speedup: draft {tps(pooled['draft']) / base:.2f}x, lookup {tps(pooled['lookup']) / base:.2f}x"
    if hf:
        line += (f"; ours(draft) / HF assisted {tps(pooled['draft']) / tps(pooled['hf-assisted']):.2f}x"
                 f", ours(lookup) / HF lookup {tps(pooled['lookup']) / tps(pooled['hf-lookup']):.2f}x")
    print(line)
    meas = [tps(d["draft"]) / tps(d["plain"]) for d in res.values()]
    print(f"draft-model: measured / ideal speedup, mean over slices: "
          f"{statistics.mean(m / i for m, i in zip(meas, [statistics.mean(d['draft']) for d in ideal.values()])):.2f}")
    print(f"outputs differing from native plain decoding (ours): {mismatches}")

    # ragged batch 8: where does step time go?
    ids8 = []
    for p in prompts[:8]:
        x = tok.apply_chat_template([{"role": "user", "content": p.prompt}], add_generation_prompt=True, tokenize=True)
        ids8.append(list(x["input_ids"] if hasattr(x, "keys") else x))
    reqs, dt, eng = run_native(target, DraftModelDrafter(draft, V, max_rows=8, max_len=4096), args.k, ids8,
                               args.max_new, batch=8)
    t = eng.times.to_dict()
    print(f"\nbatch 8, draft model k={args.k}: {sum(len(r.output_ids) for r in reqs) / dt:.2f} tok/s; "
          f"step time: draft {t['draft_s']:.1f} s, verify forward {t['verify_forward_s']:.1f} s, "
          f"bookkeeping {t['bookkeeping_s']:.2f} s = {t['bookkeeping_fraction']:.1%} of step time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: dict(v) for k, v in res.items()}, f)


if __name__ == "__main__":
    main()
