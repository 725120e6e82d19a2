"""Acceptance of the coupled rule against the rejection rule, same pair, same prompts.

Sampling at temperature T, one prompt per audit slice, all rows decoded as one batch
(acceptance is a per-row quantity; batching only saves wall time here). For each
drafter and temperature the two rules run back to back on the same prompts, fixed k.

    python benchmarks/bench_coupled.py                       # Qwen2.5-Coder 1.5B / 0.5B
    python benchmarks/bench_coupled.py --target smollm2-135m --drafters lookup,layerskip:20

Rejection sampling accepts draft token d with probability min(1, p(d)/q(d)), which
realises the maximal coupling: P(accept) = sum_x min(p, q) = 1 - TV(p, q), the most any
rule can accept. The coupled rule accepts when the target's Gumbel-max sample under
the shared keyed noise equals the draft's (which used the same noise): at most
1 - TV and at least (1 - TV) / (1 + TV), the price of byte-reproducibility. For prompt
lookup (q one-hot) both rules accept with probability p(d). The two rules emit
different (equally distributed) sequences, so their acceptances are measured on
different contexts: differences of a few hundredths are sampling noise.
"""

from __future__ import annotations

import argparse
import time

from common import suite_prompts
from tqdm import tqdm

from verispec.drafters import make_drafter
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.models import load_model
from verispec.policy import FixedK
from verispec.sampling import SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafters", default="qwen2.5-coder-0.5b,lookup")
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=1, help="per slice")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    tl = load_model(args.target, progress=False)
    target, tok = tl.model, tl.tokenizer
    prompts = suite_prompts(args.prompts)
    ids = []
    for p in prompts:
        x = tok.apply_chat_template([{"role": "user", "content": p.prompt}], add_generation_prompt=True,
                                    tokenize=True)
        ids.append(list(x["input_ids"] if hasattr(x, "keys") else x))
    max_len = max(map(len, ids)) + args.max_new
    temps = [float(t) for t in args.temperatures.split(",")]
    rows = []
    runs = [(d, t, rule) for d in args.drafters.split(",") for t in temps for rule in ("rejection", "coupled")]
    drafters = {}
    for spec, temp, rule in tqdm(runs, desc="runs"):
        if spec not in drafters:
            drafters[spec] = make_drafter(spec, target, tok, max_rows=len(ids), max_len=max_len + args.k + 2,
                                          progress=False)
        eng = Engine(target, drafters[spec], FixedK(args.k),
                     EngineConfig(max_batch=len(ids), max_len=max_len, rule=rule))
        # coupled=False under rejection: a seeded generator, not keyed noise (the default for seeds)
        sp = SamplingParams(temperature=temp, seed=args.seed, coupled=rule == "coupled")
        reqs = [Request(x, GenerationParams(max_new_tokens=args.max_new, sampling=sp, ignore_eos=True))
                for x in ids]
        t = time.perf_counter()
        eng.run(reqs)
        dt = time.perf_counter() - t
        drafted = sum(r.stats.drafted for r in reqs)
        accepted = sum(r.stats.accepted for r in reqs)
        passes = sum(r.stats.target_passes for r in reqs)
        tokens = sum(r.stats.generated_tokens for r in reqs)
        per_pos = [sum(r.stats.accepted_per_position[i] for r in reqs if i < len(r.stats.accepted_per_position))
                   / max(1, sum(r.stats.drafted_per_position[i] for r in reqs
                                if i < len(r.stats.drafted_per_position))) for i in range(args.k)]
        rows.append((spec, temp, rule, accepted / drafted, tokens / passes, per_pos, tokens / dt))
    print(f"\n{args.target}, k={args.k}, {len(ids)} prompts (one per slice) as one batch, "
          f"{args.max_new} new tokens, seed {args.seed}")
    print("| drafter | T | rule | acceptance per draft token | tokens per target pass | "
          "acceptance at positions 1..k | tok/s |")
    print("|---|---|---|---|---|---|---|")
    for spec, temp, rule, acc, tpp, per_pos, tps in rows:
        print(f"| {spec} | {temp} | {rule} | {acc:.3f} | {tpp:.2f} | "
              + " ".join(f"{a:.2f}" for a in per_pos) + f" | {tps:.2f} |")
    print("\ncoupled / rejection, tokens per target pass:")
    for i in range(0, len(rows), 2):
        a, b = rows[i], rows[i + 1]
        print(f"  {a[0]} T={a[1]}: {b[4] / a[4]:.2f}x (acceptance {b[3]:.3f} vs {a[3]:.3f})")


if __name__ == "__main__":
    main()
