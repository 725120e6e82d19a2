"""The speedup floor of other servers' speculation: llama.cpp's llama-server and vLLM's CPU
build, each beside a plain server of the same model, searched by `verispec audit
--endpoint ... --only speedup-floor` (audit/floor.py) and confirmed side by side.

    python benchmarks/floor_peers.py llama-ngram  [--budget quick|full] [--seed 0]
    python benchmarks/floor_peers.py llama-draft  ...   # draft-simple, the Qwen 0.5B draft
    python benchmarks/floor_peers.py vllm-ngram   ...   # SmolLM2-135M, fp32, ngram k=4

llama.cpp: Qwen2.5-Coder 1.5B Q4_K_M (the preset's GGUF as shipped), 2 threads per server,
`--spec-type ngram-simple` (n 3, m 4) or `draft-simple` with the 0.5B Q4_K_M draft
(`--spec-draft-n-max 4`); llama.cpp's own defaults otherwise. vLLM: SmolLM2-135M-Instruct
from the preset's converted folder, `ngram` with k = 4 and lookup 2..4 as its docs configure
it. Both servers are up during the search (vLLM has no per-request switch): requests go one
at a time, the speculative one and the plain one alternating, so an idle vLLM worker's
spinning taxes both sides alike. The report (report.json/md/html) goes to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src"), str(ROOT / "benchmarks")]

from endpoint_llama_cpp import gguf  # noqa: E402
from tests.llama_server import NGRAM as LLAMA_NGRAM, LlamaServer  # noqa: E402
from verispec.audit.context import select_prompts  # noqa: E402
from verispec.audit.endpoint.runner import EndpointAuditConfig, run_endpoint_audit  # noqa: E402
from verispec.audit.floor import FloorBudget  # noqa: E402
from verispec.audit.report import write_reports  # noqa: E402
from verispec.audit.suite import load_suite  # noqa: E402


def servers(kind: str, threads: int):
    """(plain server, speculative server) context managers for one peer configuration."""
    if kind.startswith("llama"):
        target = gguf("qwen2.5-coder-1.5b")
        spec = LLAMA_NGRAM if kind == "llama-ngram" else (
            "--spec-type", "draft-simple", "-md", str(gguf("qwen2.5-coder-0.5b")), "--spec-draft-n-max", "4",
            "-td", str(threads))
        return (LlamaServer(target, threads=threads, ctx_per_slot=2048, slots=1),
                LlamaServer(target, spec=spec, threads=threads, ctx_per_slot=2048, slots=1))
    from tests.vllm_server import NGRAM, VllmServer
    from verispec.models.presets import converted_dir, get_preset
    folder = converted_dir(get_preset("smollm2-135m"))
    return VllmServer(folder, name="smollm2"), VllmServer(folder, spec=NGRAM, name="smollm2")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=("llama-ngram", "llama-draft", "vllm-ngram"))
    ap.add_argument("--budget", choices=("quick", "full"), default="quick")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-speedup", type=float, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--settle", type=float, default=None,
                    help="seconds of pause before each timed request (default: 2 for vLLM, whose worker spins "
                         "on after a request and slows the other server's next one; 0 for llama.cpp)")
    ap.add_argument("--pairs", type=int, default=None,
                    help="side-by-side pairs per confirmed prompt (default: the budget's)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through the `with`: servers stopped
    out = Path(args.out or f"/tmp/floor-{args.kind}")
    command = "python benchmarks/floor_peers.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    suite = load_suite("default")
    prompts = select_prompts(suite, 2 if args.budget == "quick" else None, args.seed)
    budget = FloorBudget.quick() if args.budget == "quick" else FloorBudget.full()
    if args.pairs:
        budget = replace(budget, repeats=args.pairs)
    t0 = time.monotonic()
    plain, spec = servers(args.kind, args.threads)
    with plain, spec:
        report = run_endpoint_audit(EndpointAuditConfig(spec.url, reference_url=plain.url, only=("speedup-floor",),
                                                        sampled_tokens=0, seed=args.seed,
                                                        min_speedup=args.min_speedup, quick=args.budget == "quick", suite=suite, floor_budget=budget, floor_settle_s=args.settle if args.settle is not None else
                                    (2.0 if args.kind.startswith("vllm") else 0.0)), prompts)
        report["record"]["launch"] = {"plain": plain.cmd, "speculative": spec.cmd}
    report["record"]["command"] = command
    report["record"]["machine_load"] = {"after": list(os.getloadavg()), "cpus": os.cpu_count(),
                                        "wall_s_with_server_start": time.monotonic() - t0}
    paths = write_reports(report, out)
    floor = next(c for c in report["checks"] if c["name"] == "speedup-floor")
    print(f"{args.kind}: {floor['summary']}")
    print(json.dumps({k: floor["figures"].get(k) for k in ("floor", "floor_ci_low", "floor_ci_high", "floor_prompt",
                                                          "floor_acceptance", "floor_tokens_per_pass")}))
    print(f"reports: {paths['json']}")


if __name__ == "__main__":
    main()
