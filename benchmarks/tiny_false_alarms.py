"""The correct engine's false alarms on the tiny models (tests/audit_tiny.py): a whole audit
per seed and drafter, every check, and the verdict. A correct engine fails an audit only
through the distribution check's family-wise alpha (1e-3) and the null Fisher tests (0.01
over configurations, noisy backends only), so 20 seeds x 3 drafters should all pass.

    python3 benchmarks/tiny_false_alarms.py --seeds 20 --json /tmp/tiny_fa.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.audit_tiny import one_thread, tiny_audit, tiny_models  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--drafters", default="draft-model,lookup,layerskip")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows, t0 = [], time.perf_counter()
    with one_thread():
        models = tiny_models()
        for drafter in args.drafters.split(","):
            for seed in range(args.seeds):
                r = tiny_audit(models, seed=seed, drafter=drafter)
                dist = next(c for c in r.checks if c.name == "distribution")
                rows.append({"drafter": drafter, "seed": seed, "verdict": r.verdict, "failed": r.failed,
                             "distribution_min_p": min(t["p_value"] for t in dist.figures["tests"]),
                             "alpha_each": dist.figures["alpha_each"]})
                print(f"{drafter:12s} seed {seed:2d}: {r.verdict.upper()} {r.failed or ''} "
                      f"(smallest distribution p {rows[-1]['distribution_min_p']:.3g})", flush=True)
    passed = sum(r["verdict"] == "pass" for r in rows)
    print(f"{passed} of {len(rows)} audits pass ({time.perf_counter() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
