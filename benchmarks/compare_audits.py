"""Two audit reports, figure by figure: which checks' figures and details differ, timings
aside. For a change that must not change the audit (a refactor): run the same audit before
and after with the same seed and `--policy fixed` (the adaptive policy's k follows measured
step times, so its draft counts differ between two runs of one commit), then

    python benchmarks/compare_audits.py before/report.json after/report.json
"""

from __future__ import annotations

import argparse
import json

# keys whose values are times or follow from them
TIMING = ("seconds", "elapsed", "_s", "tok_s", "tokens_per_s", "speedup", "ms_per", "time", "crossover", "started")


def diff(x, y, path: str, out: list) -> None:
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(set(x) | set(y)):
            if not any(t in k for t in TIMING):
                diff(x.get(k), y.get(k), f"{path}.{k}", out)
    elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y)):
            diff(u, v, f"{path}[{i}]", out)
    elif x != y:
        out.append((path, x, y))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--show", type=int, default=3, help="differing leaves to print per check")
    args = ap.parse_args()
    a, b = (json.load(open(p, encoding="utf-8")) for p in (args.old, args.new))
    print(f"verdict: {a['verdict']} -> {b['verdict']}")
    changed = 0
    for ca, cb in zip(a["checks"], b["checks"]):
        out: list = []
        diff(ca.get("figures"), cb.get("figures"), "figures", out)
        diff(ca.get("details"), cb.get("details"), "details", out)
        changed += bool(out) or ca["name"] != cb["name"] or ca["passed"] != cb["passed"]
        print(f"{ca['name']:<20} passed {ca['passed']} -> {cb['passed']}, differing figures: {len(out)}")
        for path, x, y in out[:args.show]:
            print(f"    {path}: {str(x)[:70]} -> {str(y)[:70]}")
    return 1 if changed or len(a["checks"]) != len(b["checks"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
