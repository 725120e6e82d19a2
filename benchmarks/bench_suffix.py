"""Suffix decoding against llama.cpp's own n-gram speculation, side by side in one run, on
the same GGUF file, the same threads and the same prompts: the repetitive suite (code
edits, RAG, multi-turn, agentic, JSON) and, with --suite default, the default suite.

Every server is up for the whole run (llama-server with `--poll 0` and an idle `verispec
serve` take no core), and each prompt (or, at --batch B, each group of B prompts sent at
once) goes to every server in turn, the order rotating from prompt to prompt, with a
pause before each request so that one server's spinning threads do not tax the next. Each
prompt is sent once to each server: a second pass would find it in suffix decoding's
global cache (and in llama.cpp's ngram-cache), which is the repetition the suite's slices
are meant to hold between different requests, not the same one.

Greedy streamed chat requests of --max-tokens. Two speeds per server, per slice and pooled,
each as a speedup over llama-server plain's: end to end (completion tokens over wall time;
at --batch B, each group's wall counted once) and decode (tokens after the first over the
time after the first token: the prompts are long and their prefill, which no drafter
shortens, is half the wall time at batch 1).

    python benchmarks/bench_suffix.py --per-slice 2 --max-tokens 96 --batch 1
    python benchmarks/bench_suffix.py --configs llama-plain,verispec-suffix --batch 4
    python benchmarks/bench_suffix.py --replot run.json --plot run.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src"), str(ROOT / "benchmarks")]

from endpoint_llama_cpp import gguf  # noqa: E402
from tests.llama_server import LlamaServer  # noqa: E402
from tests.verispec_server import VerispecServer  # noqa: E402
from verispec.audit.suite import load_suite, slices  # noqa: E402

# llama.cpp's n-gram drafters at their documented defaults, and ngram-map-k at the lookup
# lengths its docs suggest for short repeats
LLAMA = {
    "llama-plain": (),
    "llama-ngram-simple": ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                           "--spec-ngram-simple-size-m", "8"),
    "llama-ngram-map-k": ("--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "4",
                          "--spec-ngram-map-k-size-m", "16"),
    "llama-ngram-mod": ("--spec-type", "ngram-mod"),
    "llama-ngram-cache": ("--spec-type", "ngram-cache"),
}
VERISPEC = {
    "verispec-plain": ("--draft", "none"),
    "verispec-lookup": ("--draft", "lookup"),
    "verispec-suffix": ("--draft", "suffix"),
    # what the drafts are worth where the policy does not decide: 4 drafts whenever found
    "verispec-suffix-k4": ("--draft", "suffix", "--policy", "fixed", "--k", "4"),
    # draft trees of up to 4 branches, priced node by node by the adaptive policy
    "verispec-suffix-tree": ("--draft", "suffix:width=4"),
}


def server(name: str, args):
    if name in LLAMA:
        return LlamaServer(gguf(args.target), spec=LLAMA[name], threads=args.threads, slots=args.batch,
                           ctx_per_slot=args.ctx)
    return VerispecServer(args.target, "--backend", "ggml", "--threads", str(args.threads), "--max-batch",
                          str(args.batch), "--max-len", str(args.ctx), *VERISPEC[name])


def model_id(url: str) -> str:
    """the model name the server serves (verispec refuses any other; llama-server takes any)"""
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def ask(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy chat request: its wall time, the time to its first token (the
    prefill, which no drafter speeds up), its tokens and, where the server says, its drafts."""
    t0 = time.perf_counter()
    first, tokens, usage, timings, extra = None, 0, None, {}, {}
    with client.stream("POST", url + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    tokens += 1
                    if first is None:
                        first = time.perf_counter() - t0
            usage = ev.get("usage") or usage
            timings = ev.get("timings") or timings
            extra = ev.get("verispec") or extra
    dt = time.perf_counter() - t0
    n = usage["completion_tokens"] if usage else tokens
    return {"s": dt, "ttft_s": first if first is not None else dt, "tokens": n,
            "drafted": timings.get("draft_n", extra.get("drafted")),
            "accepted": timings.get("draft_n_accepted", extra.get("accepted"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--suite", default="repetitive")
    ap.add_argument("--per-slice", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096, help="context per slot / row")
    ap.add_argument("--pause", type=float, default=0.5, help="seconds before each request")
    ap.add_argument("--configs", default=",".join([*LLAMA, "verispec-plain", "verispec-lookup", "verispec-suffix",
                                                       "verispec-suffix-k4", "verispec-suffix-tree"]))
    ap.add_argument("--out", default=None, help="JSON of every request (default: print only)")
    ap.add_argument("--plot", default=None, help="PNG of the per-slice speedups (end to end and decode)")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="redraw the tables and --plot from a run's --out JSON, running nothing")
    args = ap.parse_args()
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        for key, value in saved["args"].items():
            if key not in ("plot", "replot", "out"):
                setattr(args, key, value)
        report(saved["requests"], list(saved["requests"]), args)
        return
    names = args.configs.split(",")
    unknown = [n for n in names if n not in LLAMA and n not in VERISPEC]
    if unknown or "llama-plain" not in names:
        ap.error(f"unknown configs {unknown}" if unknown else "llama-plain is the baseline: include it")
    prompts = [p for ps in slices(load_suite(args.suite)).values() for p in ps[:args.per_slice]]
    groups = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    rows = {n: [] for n in names}
    with contextlib.ExitStack() as stack:
        urls = {}
        for n in names:
            print(f"starting {n} ...", file=sys.stderr, flush=True)
            s = stack.enter_context(server(n, args))
            url = s if isinstance(s, str) else s.url
            urls[n] = (url, model_id(url))
        client = stack.enter_context(httpx.Client(timeout=600))
        pool = stack.enter_context(ThreadPoolExecutor(args.batch))
        for gi, group in enumerate(groups):
            order = names[gi % len(names):] + names[:gi % len(names)]
            for n in order:
                time.sleep(args.pause)
                t0 = time.perf_counter()
                res = list(pool.map(lambda p, u=urls[n]: ask(client, *u, p.prompt, args.max_tokens), group))
                wall = time.perf_counter() - t0
                for p, r in zip(group, res):
                    rows[n].append({"id": p.id, "slice": p.slice, **r, "group_s": wall})
            print(f"  {gi + 1}/{len(groups)} " + "  ".join(
                f"{n} {sum(r['tokens'] for r in rows[n][-len(group):]) / rows[n][-1]['group_s']:.1f} t/s"
                for n in names), file=sys.stderr, flush=True)
    report(rows, names, args)


def _speed(rs: list[dict]) -> float:
    """tokens per second of wall time, each group's wall counted once"""
    groups = {}
    for r in rs:
        groups.setdefault(r["group_s"], 0)
        groups[r["group_s"]] += r["tokens"]
    return sum(groups.values()) / sum(groups)


def _decode_speed(rs: list[dict]) -> float:
    """tokens after the first per second after the first token (prefill left out)"""
    return sum(r["tokens"] - 1 for r in rs) / sum(r["s"] - r["ttft_s"] for r in rs)


def report(rows: dict, names: list[str], args) -> None:
    slice_names = list(dict.fromkeys(r["slice"] for r in rows["llama-plain"]))
    table = {}
    for label, speed in (("end to end", _speed), ("decode (after the first token)", _decode_speed)):
        print(f"\n{args.target}, {args.threads} threads, batch {args.batch}, {args.max_tokens} tokens, "
              f"suite {args.suite} ({args.per_slice} a slice); {label} speedup over llama-server plain")
        print("config".ljust(22) + "".join(s[:11].rjust(12) for s in [*slice_names, "pooled"]) + "   accepted/drafted")
        base = {s: speed([r for r in rows["llama-plain"] if r["slice"] == s]) for s in slice_names}
        base["pooled"] = speed(rows["llama-plain"])
        for n in names:
            sp = {s: speed([r for r in rows[n] if r["slice"] == s]) / base[s] for s in slice_names}
            sp["pooled"] = speed(rows[n]) / base["pooled"]
            drafted = sum(r["drafted"] or 0 for r in rows[n])
            acc = sum(r["accepted"] or 0 for r in rows[n])
            table.setdefault(n, {"drafted": drafted, "accepted": acc, "tokens": sum(r["tokens"] for r in rows[n])})
            table[n]["end_to_end" if speed is _speed else "decode"] = sp
            print(n.ljust(22) + "".join(f"{sp[s]:11.2f}x" for s in [*slice_names, "pooled"])
                  + (f"   {acc}/{drafted}" if drafted else "   -"))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "summary": table, "requests": rows}, indent=1))
        print(f"wrote {args.out}")
    if args.plot:
        plot(table, [*slice_names, "pooled"], args)
        print(f"wrote {args.plot}")


def plot(table: dict, cols: list[str], args) -> None:
    """Two panels (end to end, decode): one group of bars per slice, one bar per config, the
    speedup over llama-server plain; a line at 1.0x."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in table if n != "llama-plain"]
    fig, axes = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    width = 0.8 / len(names)
    cmap = plt.get_cmap("tab10")
    for ax, key, title in ((axes[0], "end_to_end", "end to end"), (axes[1], "decode", "decode (after the first token)")):
        for i, n in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(cols))]
            ax.bar(xs, [table[n][key][c] for c in cols], width, label=n, color=cmap(i % 10),
                   hatch="//" if n.startswith("verispec") else None, edgecolor="white", linewidth=0.3)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel("speedup over llama-server plain")
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_xticks(range(len(cols)), cols)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, ncol=5, fontsize=8, loc="lower center")
    fig.suptitle(f"{args.target}, {args.threads} threads, batch {args.batch}, {args.max_tokens} tokens, "
                 f"suite {args.suite} ({args.per_slice} a slice)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
