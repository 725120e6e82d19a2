"""The suffix cache's cost to the process that holds it, at two source trees side by
side: the garbage collector's pauses while the cache fills to its bound and evicts, a full
collection with the cache full against the same process before it, objects the collector
tracks, resident memory, and the time to add a sequence and to propose a chain and a tree.

Both trees run the same token streams (the packaged suites' prompts, tokenized with the
default model's tokenizer, each added twice with a varied tail as a request's prompt and
output would be), each in a subprocess of its own, alternated over rounds (A B B A ...)
so both see the same machine load.

    git worktree add /tmp/old <commit>
    python benchmarks/bench_suffix_trie.py --old /tmp/old --new . --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import gc, json, random, resource, statistics, sys, time
from verispec.drafters.suffix_tree import SuffixCache
streams = json.load(open(sys.argv[1]))
max_nodes, depth = int(sys.argv[2]), int(sys.argv[3])

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20

pauses, starts = [], {}
def on_gc(phase, info):
    if phase == "start":
        starts[0] = time.perf_counter()
    else:
        pauses.append((info["generation"], time.perf_counter() - starts[0]))

def full_collect_ms(n=5):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); gc.collect(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3

gc.collect()
base_objects, base_rss, base_gc = len(gc.get_objects()), rss_mb(), full_collect_ms()
cache = SuffixCache(max_depth=depth, max_nodes=max_nodes)
rng = random.Random(0)
adds = []
gc.callbacks.append(on_gc)
t0 = time.perf_counter()
for rep in range(3):  # enough text to reach the bound and evict
    for toks in streams:
        cut = rng.randrange(len(toks) // 2, len(toks))
        seq = toks + toks[cut:] + [rng.randrange(49152) for _ in range(4)]
        t = time.perf_counter(); cache.add(None, seq); adds.append(time.perf_counter() - t)
fill_s = time.perf_counter() - t0
gc.callbacks.remove(on_gc)
full_gc = full_collect_ms()
objects = len(gc.get_objects()) - base_objects
contexts = [toks[: rng.randrange(8, len(toks))][-(depth - 1):]
            for toks in rng.sample([s for s in streams if len(s) > 16], 40)]
t = time.perf_counter()
for _ in range(5):
    for c in contexts:
        cache.propose(None, c, 16, max_spec_factor=1.0, max_spec_offset=0.0, min_token_prob=0.1)
chain_us = (time.perf_counter() - t) / (5 * len(contexts)) * 1e6
t = time.perf_counter()
for _ in range(5):
    for c in contexts:
        cache.propose_tree(None, c, 16, 4, max_spec_factor=1.0, max_spec_offset=0.0, min_token_prob=0.1)
tree_us = (time.perf_counter() - t) / (5 * len(contexts)) * 1e6
st = cache.stats()
print(json.dumps({
    "nodes": st["nodes"], "evictions": st["evictions"], "adds": len(adds), "fill_s": fill_s,
    "gc_pauses": len(pauses), "gc_max_pause_ms": max((p for _, p in pauses), default=0) * 1e3,
    "gc_total_s": sum(p for _, p in pauses), "full_gc_ms": full_gc, "full_gc_base_ms": base_gc,
    "tracked_objects": objects, "rss_mb": rss_mb() - base_rss,
    "add_median_ms": statistics.median(adds) * 1e3, "add_max_ms": max(adds) * 1e3,
    "chain_us": chain_us, "tree_us": tree_us}))
"""


def token_streams() -> list[list[int]]:
    """The packaged suites' prompts in the default model's tokens."""
    from tokenizers import Tokenizer
    from verispec.audit.suite import load_suite
    from verispec.models.loading import resolve_model

    files = resolve_model("smollm2-135m", progress=False)
    tok = Tokenizer.from_file(str(Path(files.path) / "tokenizer.json"))
    prompts = [p.prompt for name in ("default", "repetitive") for p in load_suite(name)]
    return [tok.encode(p).ids for p in prompts]


def measure(src: Path, streams_file: Path, max_nodes: int, depth: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(streams_file), str(max_nodes), str(depth)],
                         env={"PYTHONPATH": str(src / "src"), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{src}: the measuring subprocess failed:\n{out.stderr}")
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="a source tree (a git worktree)")
    ap.add_argument("--new", type=Path, default=Path("."))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-nodes", type=int, default=200_000, help="the cache's bound (the server's default)")
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--json", type=Path, help="write every round's figures here")
    args = ap.parse_args()

    import tempfile
    streams = token_streams()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(streams, f)
    print(f"{len(streams)} prompts, {sum(map(len, streams))} tokens; cache bound {args.max_nodes} nodes, "
          f"depth {args.depth}", file=sys.stderr)
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            runs[name].append(measure(getattr(args, name).resolve(), Path(f.name), args.max_nodes, args.depth))
            print(f"round {r + 1} {name}: {json.dumps(runs[name][-1])}", file=sys.stderr)
    keys = ["nodes", "gc_pauses", "gc_max_pause_ms", "gc_total_s", "full_gc_ms", "full_gc_base_ms",
            "tracked_objects", "rss_mb", "fill_s", "add_median_ms", "add_max_ms", "chain_us", "tree_us"]
    print(f"{'':18} {'old':>12} {'new':>12} {'new/old':>8}")
    for k in keys:
        o = statistics.median(x[k] for x in runs["old"])
        n = statistics.median(x[k] for x in runs["new"])
        print(f"{k:18} {o:12.3f} {n:12.3f} {n / o if o else float('nan'):8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
