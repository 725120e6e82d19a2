"""Few-row fp32 linear: torch F.linear vs verispec PackedLinear, side by side.

    PYTHONPATH=src python benchmarks/bench_linear.py [--shapes 8960x1536,...] [--ns 1,2,4,8,16]
        [--repeats 15] [--hot] [--threads T] [--no-fallback] [--csv out.csv]

For every shape (out x in) and row count N the variants are timed interleaved
(torch, packed, [fallback], then rotated order, ...) so machine noise hits
them alike; each cell is the median (and for packed also the min) over repeats x
weight copies.  By default every variant cycles through copies of the weight
(>= ~128 MB, at most 32 copies) so that it mostly comes from DRAM, not the
32 MB L3, as in a real decode step; --hot reuses one copy.  On a shared
machine the median absorbs scheduler stalls (a 2-thread call waits whenever
the other core is busy with someone else's process); the min shows the cost
when both cores were ours.

Columns: torch = F.linear(x, W, b) (MKL); packed = PackedLinear (the backend
reported at the top); ratio = packed(N) / packed(N=1) (median, and min/min);
GB/s = weight bytes / packed median time; fallback = the torch-only backend PackedLinear uses when the
kernel is unavailable (VERISPEC_LINEAR=torch); diff = max |packed - torch|.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from verispec.models import fastlinear as fl  # noqa: E402

DEFAULT_SHAPES = "8960x1536,1536x8960,1536x1536,256x1536,151936x1536,49152x576"


def _parse_shapes(s: str) -> list[tuple[int, int]]:
    out = []
    for part in s.split(","):
        o, i = part.lower().split("x")
        out.append((int(o), int(i)))
    return out


def _make_fallback(w, b):
    old = os.environ.get(fl.ENV_BACKEND)
    os.environ[fl.ENV_BACKEND] = "torch"
    try:
        return fl.PackedLinear(w, b)
    finally:
        if old is None:
            del os.environ[fl.ENV_BACKEND]
        else:
            os.environ[fl.ENV_BACKEND] = old


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of OUTxIN")
    ap.add_argument("--ns", default="1,2,4,8,16", help="comma list of row counts")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--hot", action="store_true", help="reuse one weight copy (cache-hot)")
    ap.add_argument("--min-bytes", type=float, default=128e6, help="cold mode: bytes of weight copies per variant")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--no-fallback", action="store_true", help="skip the torch-fallback column")
    ap.add_argument("--bias", action="store_true", help="use a bias")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    backend = fl.backend_name()
    t_first = time.perf_counter() - t0
    info = fl.native_info()
    comp = info["compile_seconds"]
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, backend={backend}"
          f" (threading={info['threading'] or '-'}), "
          + (f"compiled in {comp:.2f}s" if comp is not None else f"loaded from cache in {t_first:.2f}s")
          + ("" if info["available"] else f", native error: {info['error']}"))
    print(f"mode={'hot' if args.hot else 'cold (weights cycled from DRAM)'}, repeats={args.repeats}, "
          f"median ms per call\n")

    ns = [int(v) for v in args.ns.split(",")]
    show_fb = not args.no_fallback
    hdr = (f"{'shape':>13} {'N':>3} | {'torch':>8} {'packed':>8} {'(min)':>7} {'speedup':>7} "
           f"{'ratio':>6} {'(min)':>6} {'GB/s':>6}")
    if show_fb:
        hdr += f" | {'fallback':>8} {'fb ratio':>8}"
    hdr += f" | {'max diff':>8}"
    print(hdr)
    print("-" * len(hdr))
    rows = []
    g = torch.Generator().manual_seed(0)
    for out, inn in _parse_shapes(args.shapes):
        wbytes = out * inn * 4
        ncopy = 1 if args.hot else max(1, min(32, int(args.min_bytes // wbytes) + (wbytes < args.min_bytes)))
        ws = [torch.randn(out, inn, generator=g) * inn**-0.5 for _ in range(ncopy)]
        bs = [torch.randn(out, generator=g) if args.bias else None for _ in range(ncopy)]
        packed = [fl.PackedLinear(w, b) for w, b in zip(ws, bs)]
        fb = [_make_fallback(w, b) for w, b in zip(ws, bs)] if show_fb else []
        variants = {"torch": [lambda x, w=w, b=b: F.linear(x, w, b) for w, b in zip(ws, bs)],
                    "packed": packed}
        if show_fb:
            variants["fallback"] = fb
        base = {}
        for n in ns:
            x = torch.randn(n, inn, generator=g)
            times = {k: [] for k in variants}
            with torch.inference_mode():
                for fns in variants.values():  # warm up
                    fns[0](x)
                names = list(variants)
                for r in range(args.repeats):
                    order = names[r % len(names):] + names[: r % len(names)]  # rotate: no fixed "first after X"
                    for c in range(ncopy):
                        for k in order:
                            fn = variants[k][c]
                            s = time.perf_counter()
                            fn(x)
                            times[k].append(time.perf_counter() - s)
                diff = float((packed[0](x) - F.linear(x, ws[0], bs[0])).abs().max())
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            pmin = min(times["packed"]) * 1e3
            if n == ns[0]:
                base = dict(med)
                base_min = pmin
            ratio = med["packed"] / base["packed"]
            gbs = wbytes / (med["packed"] * 1e-3) / 1e9
            line = (f"{out:>6}x{inn:<6} {n:>3} | {med['torch']:8.3f} {med['packed']:8.3f} {pmin:7.3f} "
                    f"{med['torch'] / med['packed']:6.2f}x {ratio:6.2f} {pmin / base_min:6.2f} {gbs:6.1f}")
            if show_fb:
                line += f" | {med['fallback']:8.3f} {med['fallback'] / base['fallback']:8.2f}"
            line += f" | {diff:8.1e}"
            print(line, flush=True)
            rows.append(dict(out=out, inn=inn, n=n, torch_ms=med["torch"], packed_ms=med["packed"],
                             packed_min_ms=pmin, ratio=ratio, gbs=gbs, fallback_ms=med.get("fallback"), max_diff=diff))
        del ws, bs, packed, fb, variants
        print()
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
