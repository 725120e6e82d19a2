"""The engine's speed at two commits, side by side: plain and speculative decoding of the
same prompts, each commit's sources in a subprocess of its own, the commits alternated
(A B B A ...) so both see the same machine load. Prints tokens/s per commit and the ratio
new / old with its spread over rounds.

    git worktree add /tmp/old <commit>
    python benchmarks/bench_commits.py --old /tmp/old --new . --rounds 4

A refactor that keeps speed prints ratios near 1 (the rounds' spread says how near is noise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# what one subprocess runs: load the model, warm up, then time each configuration once
CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.models import load_model
from verispec.policy import FixedK
from verispec.drafters.lookup import PromptLookupDrafter
from verispec.audit.suite import load_suite
cfg = json.loads(sys.argv[2])
loaded = load_model(cfg["model"], progress=False)
tok, model = loaded.tokenizer, loaded.model
prompts = [p.prompt for p in load_suite("default")][::12][:cfg["prompts"]]
ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in prompts]
ids = [list(x["input_ids"] if hasattr(x, "keys") else x) for x in ids]
out = {}
def run(name, batch, speculative):
    drafter = PromptLookupDrafter(3) if speculative else None
    eng = Engine(model, drafter, FixedK(cfg["k"] if speculative else 0),
                 EngineConfig(max_batch=batch, max_len=max(map(len, ids)) + cfg["max_new"]))
    reqs = [Request(x, GenerationParams(max_new_tokens=cfg["max_new"], ignore_eos=True)) for x in ids]
    t = time.perf_counter()
    eng.run(reqs)
    out[name] = sum(len(r.output_ids) for r in reqs) / (time.perf_counter() - t)
for b in cfg["batches"]:
    run(f"warm b{b}", b, True)
    run(f"plain b{b}", b, False)
    run(f"lookup k={cfg['k']} b{b}", b, True)
print(json.dumps({k: v for k, v in out.items() if not k.startswith("warm")}))
"""


def measure(src: Path, threads: int, cfg: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src / "src")}
    r = subprocess.run([sys.executable, "-c", CHILD, str(threads), json.dumps(cfg)], env=env,
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{src}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True, help="checkout of the older commit")
    ap.add_argument("--new", type=Path, default=Path("."), help="checkout of the newer commit (default: .)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cfg = {"model": args.model, "prompts": args.prompts, "max_new": args.max_new, "k": args.k,
           "batches": [int(b) for b in args.batches.split(",")]}
    got = {"old": [], "new": []}
    for i in range(args.rounds):
        order = ("old", "new") if i % 2 == 0 else ("new", "old")  # ABBA
        for which in order:
            got[which].append(measure(getattr(args, which).resolve(), args.threads, cfg))
            print(f"round {i + 1}/{args.rounds} {which}: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in got[which][-1].items()), file=sys.stderr, flush=True)
    rows = []
    for name in got["old"][0]:
        old = [r[name] for r in got["old"]]
        new = [r[name] for r in got["new"]]
        ratios = [n / o for n, o in zip(new, old)]
        rows.append({"config": name, "old_tok_s": statistics.median(old), "new_tok_s": statistics.median(new),
                     "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)})
    print(f"{'config':<20} {'old tok/s':>10} {'new tok/s':>10} {'new/old':>8}  (min-max over {args.rounds} rounds)")
    for r in rows:
        print(f"{r['config']:<20} {r['old_tok_s']:>10.1f} {r['new_tok_s']:>10.1f} {r['ratio_median']:>8.3f}  "
              f"({r['ratio_min']:.3f}-{r['ratio_max']:.3f})")
    if args.json:
        args.json.write_text(json.dumps({"config": cfg, "threads": args.threads, "rows": rows, "raw": got}, indent=2))


if __name__ == "__main__":
    main()
