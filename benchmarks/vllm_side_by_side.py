"""verispec serve beside vLLM's CPU build on the same model, prompts and cores: greedy
throughput, plain and speculative (prompt lookup, k = 4), at concurrency 1 and 8.

Both serve SmolLM2-135M-Instruct in fp32 from the preset's converted folder, on both cores
(vLLM: VLLM_CPU_OMP_THREADS_BIND=0-1; verispec: --threads 2, fixed k = 4, the lookup
drafter; vLLM: `ngram`, k = 4, prompt_lookup 2..4), chat template, 64 new tokens, the quick
suite's 16 prompts. One server runs at a time (an idle vLLM worker keeps a core busy, which
would tax whichever server is measured beside it), in the order A B C D D C B A so that a
slow drift of the machine cancels in the ratios; each figure is the mean of its two blocks.
Greedy is vLLM's speculative path without the temperature > 0 bug of
vllm-project/vllm#55005 (no temperature is expanded then), so the servers run as released.

    python benchmarks/vllm_side_by_side.py [--json benchmarks/vllm_side_by_side.json]

`--suite repetitive --draft suffix --policy adaptive` sets verispec's suffix decoding, as it
is deployed, against vLLM's `ngram` on the suite whose answers repeat their prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from tests.vllm_server import NGRAM, VllmServer  # noqa: E402
from verispec.audit.context import select_prompts  # noqa: E402
from verispec.audit.endpoint.client import EndpointConfig, audit_endpoint  # noqa: E402
from verispec.audit.suite import load_suite  # noqa: E402
from verispec.models.presets import converted_dir, get_preset  # noqa: E402

LEVELS = (1, 8)


class VerispecServer:
    """`verispec serve` on the preset, as a user starts it."""

    def __init__(self, draft: str | None, threads: int = 2, policy: str = "fixed"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "verispec.cli", "serve", "--target", "smollm2-135m", "--port",
                    str(self.port), "--threads", str(threads), "--max-batch", "8", "--log-level", "warning",
                    "--served-model-name", "smollm2"]
        if draft:
            self.cmd += ["--draft", draft, "--policy", policy] + (["--k", "4"] if policy == "fixed" else [])

    def __enter__(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"verispec serve exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit("verispec serve did not start")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(60)


def measure(url: str, prompts: list, levels=LEVELS, max_tokens: int = 64) -> dict:
    run = audit_endpoint(EndpointConfig(url, max_tokens=max_tokens, concurrency=levels), prompts)
    out = {}
    for lv in run.levels:
        assert not any(not r.ok for r in lv.results), [r.error for r in lv.results if not r.ok]
        out[lv.concurrency] = {"tokens": lv.completion_tokens, "wall_s": lv.wall_s,
                               "tok_s": lv.completion_tokens / lv.wall_s,
                               "acceptance": lv.spec.acceptance_rate if lv.spec else None,
                               "tokens_per_pass": (lv.spec.tokens_per_target_pass or lv.spec.mean_acceptance_length)
                               if lv.spec else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "vllm_side_by_side.json"))
    ap.add_argument("--suite", default="default", help="default | repetitive | a JSONL file")
    ap.add_argument("--per-slice", type=int, default=2)
    ap.add_argument("--draft", default="lookup", help="verispec's drafter (vLLM runs ngram, k = 4)")
    ap.add_argument("--policy", default="fixed", choices=["fixed", "adaptive"],
                    help="verispec's policy: fixed k = 4 (as vLLM's) or adaptive (as deployed)")
    ap.add_argument("--levels", default="1,8", help="concurrency levels, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    levels = tuple(int(x) for x in args.levels.split(","))
    model = converted_dir(get_preset("smollm2-135m"))
    prompts = select_prompts(load_suite(args.suite), args.per_slice)
    spec_name = f"verispec {args.draft}" + (" k=4" if args.policy == "fixed" else " adaptive")
    configs = {"vLLM plain": lambda: VllmServer(model, name="smollm2"),
               "verispec plain": lambda: VerispecServer(None),
               "vLLM ngram k=4": lambda: VllmServer(model, name="smollm2", spec=NGRAM),
               spec_name: lambda: VerispecServer(args.draft, policy=args.policy)}
    order = list(configs) + list(configs)[::-1]
    blocks: dict[str, list[dict]] = {k: [] for k in configs}
    for name in order:
        with configs[name]() as s:
            audit_endpoint(EndpointConfig(s.url, max_tokens=8, concurrency=(1,)), prompts[:2])  # warm-up
            got = measure(s.url, prompts, levels, args.max_tokens)
        blocks[name].append(got)
        print(name, {c: f"{v['tok_s']:.1f} tok/s" for c, v in got.items()}, flush=True)
    table = {}
    for name, bs in blocks.items():
        table[name] = {c: {"tok_s": sum(b[c]["tok_s"] for b in bs) / len(bs),
                           "acceptance": bs[0][c]["acceptance"], "tokens_per_pass": bs[0][c]["tokens_per_pass"]}
                       for c in levels}
    print(f"\n{args.suite} suite, {len(prompts)} prompts, {args.max_tokens} tokens")
    print(f"{'server':<28} " + " ".join(f"{'c' + str(c) + ' tok/s':>12}" for c in levels))
    for name, row in table.items():
        print(f"{name:<28} " + " ".join(f"{row[c]['tok_s']:>12.1f}" for c in levels))
    for c in levels:
        print(f"c{c}: verispec/vLLM plain {table['verispec plain'][c]['tok_s'] / table['vLLM plain'][c]['tok_s']:.2f}x, "
              f"speculative {table[spec_name][c]['tok_s'] / table['vLLM ngram k=4'][c]['tok_s']:.2f}x; "
              f"vLLM ngram/plain {table['vLLM ngram k=4'][c]['tok_s'] / table['vLLM plain'][c]['tok_s']:.2f}x, "
              f"{spec_name}/plain "
              f"{table[spec_name][c]['tok_s'] / table['verispec plain'][c]['tok_s']:.2f}x")
    Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "suite": args.suite,
                                           "draft": args.draft, "policy": args.policy, "max_tokens": args.max_tokens,
                                           "levels": levels, "table": table, "blocks": blocks, "order": order},
                                          indent=1, default=str))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
