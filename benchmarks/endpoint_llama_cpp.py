"""Audit llama.cpp's own server with `verispec audit --endpoint`: a llama-server with a
draft model (speculative) against the same model served plain (the reference and its
null run), both built from the pinned sdist (scripts/build_llama_cpp.sh) and run with
Prometheus metrics, no busy polling and 8 slots. Writes report.json / report.md /
report.html (and a PNG screenshot of the HTML when chromium is installed) to --out, and
prints the headline figures beside llama.cpp's own counters.

    python benchmarks/endpoint_llama_cpp.py --target qwen2.5-coder-1.5b \
        --draft qwen2.5-coder-0.5b --out docs/endpoint-llama-cpp
    python benchmarks/endpoint_llama_cpp.py --target smollm2-135m --draft ngram --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from tests.llama_server import NGRAM, LlamaServer  # noqa: E402
from verispec.audit.endpoint.runner import run_endpoint_audit  # noqa: E402
from verispec.audit.report import write_reports  # noqa: E402
from verispec.audit.suite import load_suite  # noqa: E402


def gguf(name: str) -> Path:
    """A preset's GGUF file as shipped (parts joined once into the cache, SHA-256 checked)."""
    from verispec.models.presets import assemble_parts, cache_dir, get_preset, locate_parts, reinstall_hint
    p = Path(name)
    if p.suffix == ".gguf" and p.is_file():
        return p
    preset = get_preset(name)
    parts = locate_parts(preset)
    if len(parts) == 1:
        return parts[0]
    dest = cache_dir() / "gguf" / preset.gguf_name
    if not dest.is_file():
        tmp = dest.with_suffix(".part")
        assemble_parts(parts, tmp, expected_sha256=preset.sha256, reinstall_hint=reinstall_hint(preset))
        tmp.replace(dest)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="a preset / GGUF, or 'ngram' (ngram-simple)")
    ap.add_argument("--n-max", type=int, default=4, help="--spec-draft-n-max (draft model)")
    ap.add_argument("--per-slice", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--sampled-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/endpoint-llama-cpp")
    args = ap.parse_args()
    target = gguf(args.target)
    spec = NGRAM if args.draft == "ngram" else (
        "--spec-type", "draft-simple", "-md", str(gguf(args.draft)), "--spec-draft-n-max", str(args.n_max),
        "-td", str(args.threads))
    by: dict[str, list] = {}
    for p in load_suite("default"):
        by.setdefault(p.slice, []).append(p)
    prompts = [p for ps in by.values() for p in ps[:args.per_slice]]
    levels = tuple(int(x) for x in args.concurrency.split(","))
    with LlamaServer(target, threads=args.threads, ctx_per_slot=1024) as plain, \
            LlamaServer(target, spec=spec, threads=args.threads, ctx_per_slot=1024) as speculative:
        report = run_endpoint_audit(speculative.url, prompts, reference_url=plain.url, max_tokens=args.max_tokens,
                                    concurrency=levels, sampled_tokens=args.sampled_tokens)
        cmd = {"plain": plain.cmd, "speculative": speculative.cmd}
    report["record"]["launch"] = cmd  # what was served, as run
    out = Path(args.out)
    paths = write_reports(report, out)
    chrome = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chrome:
        subprocess.run([chrome, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--screenshot={out / 'report.png'}", "--window-size=1250,2600",
                        paths["html"].resolve().as_uri()], capture_output=True, timeout=120)
    print(f"verdict {report['verdict'].upper()} in {report['elapsed_s']:.0f} s; failed: {report['failed_checks']}")
    for c in report["checks"]:
        print(f"  {c['name']:<12} {'info' if c['informational'] else ('pass' if c['passed'] else 'FAIL'):<5} "
              f"{c['summary']}")
    load = next(c for c in report["checks"] if c["name"] == "load")
    for p in load["details"]["points"]["short"]:
        sc = p["server_counters"] or {}
        print(f"  c{p['batch']}: {p['speculative_tokens_per_s'] or 0:.1f} tok/s vs plain "
              f"{p['plain_tokens_per_s'] or 0:.1f} ({(p['speedup'] or 0):.2f}x); llama.cpp counters: "
              f"{sc.get('draft_tokens')} drafted, {sc.get('accepted_tokens')} accepted in {sc.get('drafts')} "
              f"verification steps, per position {json.dumps([round(a, 3) for a in sc.get('acceptance_per_position') or []])}")
    print(f"reports: {paths['json']}, {paths['html']}")


if __name__ == "__main__":
    main()
