"""verispec's ggml backend against llama.cpp itself, side by side in one run, on the same GGUF
file and the same thread count (llama.cpp's tools built from the same pinned sdist by
scripts/build_llama_cpp.sh):

1. plain decoding at batch 1: the engine (greedy, fixed length) against `llama-bench -p 0 -n N`;
2. aggregate decode throughput at batch 8: the engine against `llama-server -np 8` serving 8
   concurrent greedy requests of the same token ids (no draft);
3. the cost of a verify pass over k + 1 tokens, k = 1, 2, 4, 8, at a cached context,
   against `llama-bench -p k+1 -n 0 -d <context>`;
4. the backend's batching noise (models/noise.py) on the target.

Rounds alternate verispec and llama.cpp, so a slow spell of the machine lands on both.
At batch 8 it also says where verispec's decode time goes: inside llama_decode (llama.cpp's
graph over the 8 tokens), the rest of the model's forward (the feed, copying logits out),
and the engine's step (greedy acceptance, bookkeeping). --batch-invariant measures the
backend's batch-invariant mode (models/ggml/ordered.py) against the same llama.cpp defaults;
it needs a process of its own (ggml fixes its tiled-kernel switch at the first decode).

    python benchmarks/bench_ggml.py --target qwen2.5-coder-1.5b --threads 2
    python benchmarks/bench_ggml.py --target qwen2.5-coder-1.5b --threads 2 --batch-invariant --parts b1,b8
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from verispec.omp import spin_for_ggml

spin_for_ggml()  # before torch loads libgomp: llama.cpp's threads spin between decodes (omp.py)

import torch  # noqa: E402
from common import suite_prompts

from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.models import load_model
from verispec.models.ggml.lib import LLAMA_CPP_PYTHON_VERSION
from verispec.models.ggml.kvcache import GgmlCache
from verispec.models.presets import cache_dir
from verispec.policy import FixedK


def tools() -> Path:
    bin_dir = cache_dir() / "llama.cpp" / LLAMA_CPP_PYTHON_VERSION / "bin"
    if not (bin_dir / "llama-bench").exists():
        sys.exit(f"no llama.cpp tools in {bin_dir}: run bash scripts/build_llama_cpp.sh")
    return bin_dir


def llama_bench(bin_dir, gguf, threads, args) -> float:
    """tokens/s of one llama-bench test (its average over its repetitions)."""
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-o", "json",
                          *args], check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def engine_plain(model, prompts, max_new, batch, breakdown=None):
    """-> (decode tok/s: prefill excluded, end-to-end tok/s). breakdown (a dict): filled with
    the decode phase's seconds, split as in the module docstring."""
    eng = Engine(model, None, FixedK(0), EngineConfig(max_batch=batch, max_len=max(map(len, prompts)) + max_new + 1))
    reqs = [Request(p, GenerationParams(max_new_tokens=max_new, ignore_eos=True)) for p in prompts]
    timer = DecodeTimer(model, max_tokens=batch) if breakdown is not None else None
    t = time.perf_counter()
    try:
        eng.run(reqs)
    finally:
        if timer is not None:
            timer.close()
    wall = time.perf_counter() - t
    n = sum(len(r.output_ids) for r in reqs)
    if breakdown is not None:
        decode = wall - eng.times.prefill_s
        breakdown.update(tokens=n, steps=eng.times.steps, decode_s=decode, llama_decode_s=timer.seconds,
                         forward_rest_s=eng.times.verify_forward_s - timer.seconds,
                         engine_s=decode - eng.times.verify_forward_s)
    return n / (wall - eng.times.prefill_s), n / wall


class DecodeTimer:
    """Seconds spent inside llama_decode on passes of at most max_tokens tokens (the decode
    steps; prefills feed more), by wrapping the binding the backend calls."""

    def __init__(self, model, max_tokens):
        self.ll, self.seconds, self.max_tokens = model._ll, 0.0, max_tokens
        self.inner = self.ll.llama_decode

        def timed(ctx, batch):
            t = time.perf_counter()
            try:
                return self.inner(ctx, batch)
            finally:
                if batch.n_tokens <= self.max_tokens:
                    self.seconds += time.perf_counter() - t
        self.ll.llama_decode = timed

    def close(self):
        self.ll.llama_decode = self.inner


def verify_costs(model, ks, context, repeats):
    """Median seconds of a batch-1 pass over T tokens at a cached context, T = 1 and k + 1."""
    V = model.config.vocab_size
    cache = model.new_cache(1, context + max(ks) + 2)
    row = cache.alloc()
    model.forward(torch.randint(0, V, (1, context)), cache, row, last_only=True)
    sizes = [1] + [k + 1 for k in ks]
    ts = {T: [] for T in sizes}
    for rep in range(repeats + 1):
        for T in sizes:
            t = time.perf_counter()
            model.forward(torch.randint(0, V, (1, T)), cache, row)
            if rep:
                ts[T].append(time.perf_counter() - t)
            cache.truncate(row, [context])
    return {T: statistics.median(v) for T, v in ts.items()}


class Server:
    def __init__(self, bin_dir, gguf, threads, slots, ctx):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(gguf), "-t", str(threads),
                                      "-tb", str(threads), "-np", str(slots), "-c", str(ctx), "--port", str(self.port),
                                      "--host", "127.0.0.1", "--no-webui"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import httpx
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600)
        for _ in range(600):
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("llama-server did not come up")

    def run(self, prompts, max_new):
        """8 concurrent greedy completions -> (aggregate decode tok/s, end-to-end tok/s)."""
        res = [None] * len(prompts)

        def one(i):
            r = self.http.post("/completion", json={
                "prompt": prompts[i], "n_predict": max_new, "ignore_eos": True, "temperature": 0,
                "top_k": 1, "cache_prompt": False, "samplers": ["top_k"]})
            r.raise_for_status()
            res[i] = r.json()
        t = time.perf_counter()
        th = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for x in th:
            x.start()
        for x in th:
            x.join()
        wall = time.perf_counter() - t
        n = sum(r["timings"]["predicted_n"] for r in res)
        decode_s = max(r["timings"]["predicted_ms"] for r in res) / 1000
        return n / decode_s, n / wall

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=150, help="cached context of the verify-pass timing")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--batch-invariant", action="store_true", help="the backend's batch-invariant mode")
    ap.add_argument("--parts", default="b1,b8,verify,noise", help="which of b1,b8,verify,noise to run")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    torch.set_num_threads(args.threads)  # the ggml backend follows torch's thread count
    bin_dir = tools()
    loaded = load_model(args.target, backend="ggml", progress=False, batch_invariant=args.batch_invariant)
    model, tok, gguf = loaded.model, loaded.tokenizer, loaded.files.path
    print(f"{args.target}: {gguf} ({gguf.stat().st_size / 2**30:.2f} GiB, sha256 {loaded.files.sha256[:16]}...), "
          f"{args.threads} threads, llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}, backend {model.backend}", flush=True)
    ks = [int(k) for k in args.ks.split(",")]

    # 1. plain decoding, batch 1: one token of prompt, as llama-bench's generation test
    bos = [tok.bos_token_id if tok.bos_token_id is not None else tok("\n")["input_ids"][0]]
    if "b1" in parts:
        plain_b1(args, model, bin_dir, gguf, bos)
    if "b8" in parts:
        plain_b8(args, model, tok, bin_dir, gguf)
    if "verify" in parts:
        verify_part(args, model, bin_dir, gguf, ks)
    if "noise" in parts:
        from verispec.models.noise import batching_noise
        n = batching_noise(model)
        print(f"batching noise (models/noise.py): largest logit difference {n['logit']:.3g}, "
              f"largest change of the top-2 gap {n['margin']:.3g}")


def plain_b1(args, model, bin_dir, gguf, bos):
    engine_plain(model, [bos], 4, 1)  # warm-up
    llama_bench(bin_dir, gguf, args.threads, ["-p", "0", "-n", "4", "-r", "1"])
    ours, theirs = [], []
    for _ in range(args.rounds):
        ours.append(engine_plain(model, [bos], args.max_new, 1)[0])
        theirs.append(llama_bench(bin_dir, gguf, args.threads, ["-p", "0", "-n", str(args.max_new), "-r", "2"]))
    print(f"batch 1 plain: verispec {statistics.median(ours):.1f} tok/s, llama-bench {statistics.median(theirs):.1f} "
          f"tok/s, ratio {statistics.median([a / b for a, b in zip(ours, theirs)]):.3f} (rounds: "
          + ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(ours, theirs)) + ")", flush=True)


def plain_b8(args, model, tok, bin_dir, gguf):
    """2. aggregate throughput at batch 8 against llama-server -np 8, the same token ids."""
    prompts = [ids[:24] for ids in (tok(p.prompt)["input_ids"] for p in suite_prompts(1))][:args.batch]
    prompts = (prompts * args.batch)[:args.batch]
    srv = Server(bin_dir, gguf, args.threads, args.batch, args.batch * (24 + args.max_new + 16))
    layouts = {"the backend's cache": model.new_cache}
    if not getattr(model, "batch_invariant", False):
        layouts["a KV stream per row (llama-server's layout)"] = StreamPerRowCache.for_model(model)
    raw = {name: [] for name in layouts}
    try:
        srv.run(prompts, 4)  # warm-up
        engine_plain(model, prompts, 4, args.batch)
        o8, t8, bd = [], [], []
        for _ in range(args.rounds):
            bd.append({})
            o8.append(engine_plain(model, prompts, args.max_new, args.batch, breakdown=bd[-1]))
            t8.append(srv.run(prompts, args.max_new))
            for name, new_cache in layouts.items():
                raw[name].append(raw_decode(model, new_cache, prompts, args.max_new))
    finally:
        srv.close()
    print(f"batch {args.batch} plain, decode (prefill excluded): verispec {statistics.median(x[0] for x in o8):.1f} "
          f"tok/s, llama-server -np {args.batch} {statistics.median(x[0] for x in t8):.1f} tok/s, ratio "
          f"{statistics.median([a[0] / b[0] for a, b in zip(o8, t8)]):.3f}; end to end (prefill of "
          f"{sum(map(len, prompts))} prompt tokens included): {statistics.median(x[1] for x in o8):.1f} vs "
          f"{statistics.median(x[1] for x in t8):.1f} tok/s (rounds: "
          + ", ".join(f"{a[0]:.1f}/{b[0]:.1f}" for a, b in zip(o8, t8)) + ")", flush=True)
    # where verispec's decode time goes, per step (ms), against llama-server's time per step
    # (its decode time over the tokens each request emitted)
    srv_ms = [1000 * args.batch / b[0] for b in t8]  # each request emits max_new tokens
    print(f"batch {args.batch}, ms per decode step (median of rounds): verispec "
          f"{statistics.median(1000 * b['decode_s'] / b['steps'] for b in bd):.1f} = llama_decode "
          f"{statistics.median(1000 * b['llama_decode_s'] / b['steps'] for b in bd):.1f} + rest of the forward "
          f"{statistics.median(1000 * b['forward_rest_s'] / b['steps'] for b in bd):.1f} + engine step "
          f"{statistics.median(1000 * b['engine_s'] / b['steps'] for b in bd):.1f}; llama-server "
          f"{statistics.median(srv_ms):.1f} (its decode time / tokens per request)", flush=True)
    for name, v in raw.items():
        print(f"batch {args.batch}, forward() alone in a loop, no engine, {name}: "
              f"{statistics.median(x[0] for x in v):.1f} tok/s, ms per step {statistics.median(x[1] for x in v):.1f}"
              f" (llama_decode {statistics.median(x[2] for x in v):.1f})", flush=True)


class StreamPerRowCache(GgmlCache):
    """The default cache with llama.cpp's KV cache split into one stream per sequence
    (kv_unified = false, what llama-server -np N runs): for timing plain batched decoding
    only (llama.cpp cuts a ragged batch into several graphs in this layout)."""

    def _context_params(self, p, max_rows, max_len):
        super()._context_params(p, max_rows, max_len)
        p.kv_unified = False

    @classmethod
    def for_model(cls, model):
        return lambda max_rows, max_len: cls(model, max_rows, max_len)


def raw_decode(model, new_cache, prompts, max_new):
    """Plain decoding of the prompts as one batch, model.forward in a loop (no engine, no
    sampling: every row is fed the same token) -> (tok/s, ms per step, ms in llama_decode)."""
    B = len(prompts)
    cache = new_cache(B, max(map(len, prompts)) + max_new + 1)
    rows = cache.alloc(B)
    x = torch.zeros(B, max(map(len, prompts)), dtype=torch.long)
    for b, p in enumerate(prompts):
        x[b, :len(p)] = torch.tensor(p)
    model.forward(x, cache, rows, [len(p) for p in prompts], last_only=True)
    step = torch.full((B, 1), int(prompts[0][-1]), dtype=torch.long)
    timer = DecodeTimer(model, max_tokens=B)
    t = time.perf_counter()
    try:
        for _ in range(max_new):
            model.forward(step, cache, rows)
    finally:
        timer.close()
    wall = time.perf_counter() - t
    cache.close()
    return B * max_new / wall, 1000 * wall / max_new, 1000 * timer.seconds / max_new


def verify_part(args, model, bin_dir, gguf, ks):
    """3. verify-pass cost, batch 1, at a cached context."""
    vc = verify_costs(model, ks, args.context, 7)
    lb = {T: llama_bench(bin_dir, gguf, args.threads, ["-p", str(T), "-n", "0", "-d", str(args.context), "-r", "3"])
          for T in [1] + [k + 1 for k in ks]}
    print(f"verify pass at context {args.context}, batch 1 (ms; x one-token pass):")
    print("| k | tokens | verispec ggml | llama-bench -p T -d ctx |")
    print("|---|---|---|---|")
    for T in [1] + [k + 1 for k in ks]:
        ms_l = 1000 * T / lb[T]
        print(f"| {T - 1} | {T} | {1000 * vc[T]:.1f} ({vc[T] / vc[1]:.2f}x) | {ms_l:.1f} "
              f"({ms_l / (1000 / lb[1]):.2f}x) |", flush=True)


if __name__ == "__main__":
    main()
