"""Power of the endpoint audit's distribution check (temperature 1, randomised PIT over
each answer's top-20 logprobs plus one tail bucket; audit/endpoint/sampled.py): how many
sampled tokens it needs to fail `verispec serve --verify typical-lossy`, and how often it
fails the exact rule (its false alarms), at the check's alpha of 1e-3.

Each cell runs the check `--repeats` times against a live server (in this process, on
the tests' tiny models: a 97-token character vocabulary, a draft model that agrees on
about 2/3 of drafts, k = 3) and prints the fraction of runs that failed and the median
p-value.

    python benchmarks/endpoint_power.py [--tokens 128,256,512,1024,2048] [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from tests.server.helpers import LiveServer, make_state  # noqa: E402
from verispec.audit.endpoint.sampled import ALPHA, distribution_figures, sampled_run  # noqa: E402
from verispec.audit.endpoint.client import EndpointConfig  # noqa: E402
from verispec.audit.suite import SuitePrompt  # noqa: E402

PROMPTS = [SuitePrompt(f"s{i}", "tiny", t) for i, t in enumerate(
    ["abc abc abc", "hello there", "the quick brown fox", "one, two, three", "lorem ipsum dolor", "xyzzy plugh",
     "to be or not to be", "1 2 3 4 5 6"])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="128,256,512,1024,2048")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rules", default="typical-lossy,rejection")
    args = ap.parse_args()
    sizes = [int(x) for x in args.tokens.split(",")]
    print(f"alpha {ALPHA:g}; {args.repeats} runs per cell; tiny models, draft model k = 3, 32 tokens per answer")
    print(f"{'rule':<14} {'tokens':>6} {'scored':>7} {'failed':>7} {'median p':>10} {'s/run':>6}")
    for rule in args.rules.split(","):
        with LiveServer(make_state(drafter="draft", k=3, rule=rule, max_batch=8)) as s:
            cfg = EndpointConfig(s.url, chat=False, max_tokens=32)
            for n in sizes:
                ps, fails, scored = [], 0, []
                t0 = time.perf_counter()
                for rep in range(args.repeats):
                    run = sampled_run(cfg, "verispec", PROMPTS, n, 8)
                    f = distribution_figures(run, seed=rep, min_tokens=1)
                    ps.append(f["p_value"])
                    scored.append(f["n"])
                    fails += not f["passed"]
                dt = (time.perf_counter() - t0) / args.repeats
                print(f"{rule:<14} {n:>6} {statistics.median(scored):>7.0f} {fails:>3}/{args.repeats:<3} "
                      f"{statistics.median(ps):>10.2g} {dt:>6.1f}", flush=True)


if __name__ == "__main__":
    main()
