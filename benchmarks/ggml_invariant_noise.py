"""The ggml backend's numerics with and without its batch-invariant mode (models/noise.py),
each mode in a process of its own (ggml fixes its tiled-kernel switch once per process):

- batching noise: a fresh single-row one-pass decode against one-token passes past 256
  cached positions and against a row decoded beside a row that leaves (logit / top-2 gap);
- ragged batch after two rounds of rejected drafts and rollback (rollback_difference);
- churn: rows starting, taking verify-like ragged passes, rolling back and leaving
  (churn_difference), every logit of every pass against a fresh decode.

    python benchmarks/ggml_invariant_noise.py --target smollm2-135m --threads 2

--modes invariant-repacked is an experiment, not a mode verispec offers: the batch-invariant
cache and switches with llama.cpp's repacked weights left on, to measure what repacking alone
adds to the noise (benchmarks/RESULTS.md, "ggml backend"). Turning repacking off is the one
switch of the batch-invariant mode that costs real speed on an AVX-512 CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def child(args) -> None:
    import torch

    from verispec.models import load_model
    from verispec.models.noise import batching_noise, churn_difference, rollback_difference
    torch.set_num_threads(args.threads)
    if args.child == "invariant-repacked":
        from verispec.models.ggml.lib import bindings
        ll = bindings()
        load = ll.llama_model_load_from_file

        def load_repacked(path, params):  # GgmlModel(batch_invariant=True) sets this False
            params.use_extra_bufts = True
            return load(path, params)
        ll.llama_model_load_from_file = load_repacked
    m = load_model(args.target, backend="ggml", batch_invariant=args.child != "default", progress=False).model
    seeds = tuple(range(args.seeds))
    t = time.perf_counter()
    res = {"mode": args.child, "backend": m.backend, "noise": batching_noise(m, seeds=seeds),
           "rollback": max(rollback_difference(m, seed=s) for s in seeds),
           "churn": max(churn_difference(m, steps=args.churn_steps, seed=s) for s in seeds)}
    res["seconds"] = round(time.perf_counter() - t, 1)
    print(json.dumps(res), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--churn-steps", type=int, default=20)
    ap.add_argument("--modes", default="default,invariant")
    ap.add_argument("--child", choices=["default", "invariant", "invariant-repacked"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    print(f"{args.target}, {args.threads} threads, seeds 0-{args.seeds - 1}, churn {args.churn_steps} steps")
    print("| mode | batching noise (logit / top-2 gap) | ragged after rollbacks | churn | seconds |")
    print("|---|---|---|---|---|")
    for mode in args.modes.split(","):
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--target", args.target,
                              "--threads", str(args.threads), "--seeds", str(args.seeds),
                              "--churn-steps", str(args.churn_steps)], check=True, capture_output=True,
                             text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {mode} | {r['noise']['logit']:.3g} / {r['noise']['margin']:.3g} | {r['rollback']:.3g} | "
              f"{r['churn']:.3g} | {r['seconds']} |", flush=True)


if __name__ == "__main__":
    main()
