"""The endpoint audit run again and again on one deployment: its verdict must hold in every
run, not once. Starts a plain server (the reference) and, unless `--draft none`, the same
server speculating; runs `verispec audit --endpoint` `--runs` times with seeds 1..N (each
seed audits other prompts of each slice: context.select_prompts) and writes, per run, the
verdict, the checks that failed and the figures that decide them, to --out/repeats.json and
repeats.md. With `--draft none` the plain server is both the endpoint and its reference
(a correct server audited against itself: every run must pass).

    python benchmarks/audit_repeats.py --server llama.cpp --target qwen2.5-coder-1.5b \
        --draft qwen2.5-coder-0.5b --runs 5 --out /tmp/repeats-llama-draft
    python benchmarks/audit_repeats.py --server llama.cpp --target qwen2.5-coder-1.5b --draft none
    python benchmarks/audit_repeats.py --server vllm --target smollm2-135m --draft none
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks.endpoint_llama_cpp import gguf  # noqa: E402
from verispec.audit.context import select_prompts  # noqa: E402
from verispec.audit.endpoint.runner import EndpointAuditConfig, run_endpoint_audit  # noqa: E402
from verispec.audit.report import write_reports  # noqa: E402
from verispec.audit.suite import load_suite  # noqa: E402


def _servers(args):
    """(reference, endpoint) context managers; the endpoint is None with --draft none."""
    if args.server == "llama.cpp":
        from tests.llama_server import NGRAM, LlamaServer
        target = gguf(args.target)
        plain = LlamaServer(target, threads=args.threads, ctx_per_slot=1024)
        if args.draft == "none":
            return plain, None
        spec = NGRAM if args.draft == "ngram" else (
            "--spec-type", "draft-simple", "-md", str(gguf(args.draft)), "--spec-draft-n-max", str(args.n_max),
            "-td", str(args.threads))
        return plain, LlamaServer(target, spec=spec, threads=args.threads, ctx_per_slot=1024)
    from tests.vllm_server import NGRAM, VllmServer
    from verispec.models.presets import converted_dir, get_preset
    folder = converted_dir(get_preset(args.target))
    plain = VllmServer(folder, name=args.target, cpus="0" if args.draft != "none" else "0-1")
    if args.draft == "none":
        return plain, None
    spec = dict(NGRAM) if args.draft == "ngram" else {
        "method": "draft_model", "model": str(converted_dir(get_preset(args.draft))),
        "num_speculative_tokens": args.n_max}
    if args.rejection_sample_method:
        spec["rejection_sample_method"] = args.rejection_sample_method
    return plain, VllmServer(folder, spec=spec, name=args.target, cpus="1", fix_expand=args.fix_expand)


def summarise(report: dict, seed: int, wall_s: float) -> dict:
    checks = {c["name"]: c for c in report["checks"]}
    row = {"seed": seed, "verdict": report["verdict"], "failed": report["failed_checks"],
           "elapsed_s": report["elapsed_s"], "wall_s": round(wall_s, 1),
           "prompts": report["record"]["suite"].get("prompt_ids")}
    if "equivalence" in checks:
        row["equivalence"] = {str(r["batch"]): f"{r['identical']}/{r['prompts']} (null "
                              f"{r['null_compared'] - r['null_divergences']}/{r['null_compared']})"
                              for r in checks["equivalence"]["details"]["per_batch"]}
    if "distribution" in checks:
        f = checks["distribution"]["figures"]
        lookup = f.get("lookup") or {}
        row["distribution"] = {"passed": checks["distribution"]["passed"], "n": f.get("n"),
                               "ks_p": f.get("p_value"), "drafted_token_z": lookup.get("z"),
                               "verified_drafts": f.get("verified_drafts"), "reason": f.get("reason")}
    if "corruption" in checks:
        c = checks["corruption"]
        row["corruption"] = {"passed": c["passed"], "flagged": c["figures"].get("flagged"),
                             "explained_by_null": c["figures"].get("explained_by_null"),
                             "checked": c["figures"].get("outputs_checked"),
                             "flags": [(f["id"], f["signatures"]) for f in c["details"]["flagged"]]}
    return row


def markdown(rows: list[dict], command: str, launch: dict) -> str:
    passed = sum(r["verdict"] == "pass" for r in rows)
    out = [f"# {passed} of {len(rows)} audits passed", "", f"`{command}`", "",
           "Launch: " + "; ".join(f"{k}: `{' '.join(map(str, v))}`" for k, v in launch.items()), "",
           "| seed | verdict | failed | equivalence (identical, null) | KS p | drafted-token z | scored tokens "
           "| corruption flagged / explained by the null | s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d, c = r.get("distribution") or {}, r.get("corruption") or {}
        out.append(f"| {r['seed']} | {r['verdict'].upper()} | {', '.join(r['failed']) or '-'} | "
                   + "; ".join(f"c{k}: {v}" for k, v in (r.get("equivalence") or {}).items())
                   + f" | {_g(d.get('ks_p'))} | {_g(d.get('drafted_token_z'), '.2f')} | {d.get('n', '-')} | "
                   f"{c.get('flagged', '-')} / {c.get('explained_by_null', '-')} | {r['wall_s']:.0f} |")
    return "\n".join(out) + "\n"


def _g(v, fmt=".3g") -> str:
    return "-" if v is None else format(v, fmt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=("llama.cpp", "vllm"), default="llama.cpp")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="a preset, 'ngram', or 'none' (plain vs itself)")
    ap.add_argument("--n-max", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--fix-expand", action="store_true", help="vLLM: the fix of vllm-project/vllm#55005")
    ap.add_argument("--rejection-sample-method", default=None, help="vLLM: standard, block, synthetic")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--per-slice", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--sampled-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp: threads per server")
    ap.add_argument("--out", type=Path, default=Path("/tmp/verispec-repeats"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through the `with`: servers stop
    command = "python benchmarks/audit_repeats.py " + " ".join(sys.argv[1:])
    suite = load_suite("default")
    levels = tuple(int(x) for x in args.concurrency.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    plain, speculative = _servers(args)
    rows = []
    with contextlib.ExitStack() as stack:
        ref = stack.enter_context(plain)
        endpoint = stack.enter_context(speculative) if speculative else ref
        launch = {"reference": ref.cmd, **({"endpoint": endpoint.cmd} if speculative else {})}
        for seed in range(1, args.runs + 1):
            t0 = time.monotonic()
            report = run_endpoint_audit(EndpointAuditConfig(endpoint.url, reference_url=ref.url,
                                                            max_tokens=args.max_tokens, concurrency=levels,
                                                            sampled_tokens=args.sampled_tokens, seed=seed), select_prompts(suite, args.per_slice, seed))
            report["record"]["command"] = command
            write_reports(report, args.out / f"seed{seed}")
            rows.append(summarise(report, seed, time.monotonic() - t0))
            print(f"seed {seed}: {report['verdict'].upper()} {report['failed_checks'] or ''} in "
                  f"{rows[-1]['wall_s']:.0f} s (load {os.getloadavg()[0]:.2f})", flush=True)
            (args.out / "repeats.json").write_text(json.dumps({"command": command, "launch": launch, "runs": rows},
                                                              indent=1))
            (args.out / "repeats.md").write_text(markdown(rows, command, launch))
    print(markdown(rows, command, launch))


if __name__ == "__main__":
    main()
