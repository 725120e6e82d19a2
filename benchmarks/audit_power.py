"""The audit's power against a relaxed acceptance rule min(1, c p/q), per drafter and audit
size: the smallest c that the distribution check detects in >= 95% of seeds.

    python3 benchmarks/audit_power.py                                   # lookup + layerskip:20, quick + full
    python3 benchmarks/audit_power.py --drafts lookup --sizes quick --validate 1.25:10
    python3 benchmarks/audit_power.py --json power.json --plot benchmarks/audit_power.png
    python3 benchmarks/audit_power.py --from-report full=verispec-audit/report.json   # simulate only

Two measurements, both of `verispec audit`'s own distribution check (run with --only
distribution, in process, on SmolLM2-135M):

1. **Simulated** (every c of the grid): one audit of the correct engine records every
   verified draft's exact acceptance probability a = min(1, p/q). Under the relaxed rule a
   draft is kept with probability min(1, c a) where a < 1. Replaying the calibration z-test
   on those drafts with outcomes drawn under each c, at the check's own per-test alpha
   (Bonferroni), gives the tests' power: the deployed drafter's calibration test and the
   calibration probe's (audit/probe.py), detected when either rejects. It is a lower bound on the check's: the PIT,
   recovered and bonus tests, which also move under relaxation, are not counted; the
   trajectory's own change under the fault is not modelled.
2. **Real** (--validate C:S): S audits with the fault `relaxed-acceptance:C` injected, seeds
   1..S; the share whose distribution check failed. This is the measurement; the simulation
   says where to look.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import scipy.stats as sps

from verispec.audit.context import AuditConfig, AuditSizes
from verispec.audit.runner import run_audit

GRID = (1.02, 1.05, 1.075, 1.1, 1.15, 1.2, 1.25, 1.35, 1.5, 2.0)
REPLICATES = 4000


def _captured_run(cfg: AuditConfig, loaded) -> tuple[dict, np.ndarray, np.ndarray]:
    """Run the distribution check; -> (its figures, the exact a of every verified draft of
    the deployed drafter, and of the calibration probe's)."""
    res = run_audit(cfg, target=loaded)
    check = next(c for c in res.checks if c.name == "distribution")
    d = check.details or {}
    return ({"passed": check.passed, "summary": check.summary, **check.figures},
            np.asarray(d.get("calibration_a", []), dtype=np.float64),
            np.asarray(d.get("probe_a", []), dtype=np.float64))


def simulated_power(tests: list[np.ndarray], c: float, alpha: float, rng: np.random.Generator,
                    replicates: int = REPLICATES) -> float:
    """P(at least one of the calibration z-tests rejects at alpha) when every draft is kept
    w.p. min(1, c a): one test per array of exact acceptance probabilities (the deployed
    drafter's, the probe's)."""
    tests = [a for a in tests if a.size and float(np.sqrt((a * (1 - a)).sum())) > 1e-6]
    if not tests:
        return 0.0
    detected = 0
    for start in range(0, replicates, 500):  # chunks of 500 replicates bound the memory
        n = min(500, replicates - start)
        hit = np.zeros(n, dtype=bool)
        for a in tests:
            relaxed = np.where(a < 1.0, np.minimum(1.0, c * a), 1.0)
            kept = rng.random((n, a.size)) < relaxed  # [n, drafts]
            z = (kept.sum(1) - a.sum()) / float(np.sqrt((a * (1 - a)).sum()))
            hit |= 2 * sps.norm.sf(np.abs(z)) <= alpha
        detected += int(hit.sum())
    return detected / replicates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafts", default="lookup,layerskip:20")
    ap.add_argument("--sizes", default="quick,full")
    ap.add_argument("--validate", default="quick=1.25:5,full=1.1:2",
                    help="SIZE=C:S,...: S real audits per drafter with relaxed-acceptance:C ('' for none)")
    ap.add_argument("--from-report", default="",
                    help="SIZE=PATH,...: simulate from these audits' report.json (their drafter and size) "
                         "instead of running the correct engine for that size")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="power curves (PNG)")
    args = ap.parse_args()
    from tqdm import tqdm

    validate = {}
    for item in filter(None, args.validate.split(",")):
        size, spec = item.split("=")
        c, s = spec.split(":")
        validate[size] = (float(c), int(s))
    rng = np.random.default_rng(0)
    rows = []
    for item in filter(None, args.from_report.split(",")):
        size, path = item.split("=", 1)
        rep = json.loads(Path(path).read_text())
        check = next(c for c in rep["checks"] if c["name"] == "distribution")
        a = np.asarray(check["details"]["calibration_a"], dtype=np.float64)
        pa = np.asarray(check["details"].get("probe_a", []), dtype=np.float64)
        curve = {c: simulated_power([a, pa], c, check["figures"]["alpha_each"], rng) for c in GRID}
        rows.append({"draft": rep["record"]["drafter"]["name"], "size": size, "correct_passed": check["passed"],
                     "verified_drafts": int(a.size), "probe_drafts": int(pa.size), "mean_a": float(a.mean()),
                     "share_a_below_1": float((a < 1).mean()), "alpha_each": check["figures"]["alpha_each"],
                     "seconds": None, "power": curve, "smallest_c_95": next((c for c in GRID if curve[c] >= 0.95), None),
                     "source": path})
    jobs = [(d, s) for d in args.drafts.split(",") for s in args.sizes.split(",") if s]
    if jobs:
        import torch

        from verispec.cli import pick_threads
        from verispec.models import load_model
        loaded = load_model(args.target, progress=False)
        # as `verispec audit` does: on a shared machine all-cores torch can be several times
        # slower than one thread (a correct-engine run took over 45 minutes at 2 threads)
        threads, speeds = pick_threads(loaded.model)
        torch.set_num_threads(threads)
        tqdm.write(f"torch threads: {threads} ({speeds})")
    for draft, size in tqdm(jobs, desc="power", unit="cell"):
        sizes = AuditSizes.quick() if size == "quick" else AuditSizes.full()
        cfg = AuditConfig(target=args.target, draft=draft, sizes=sizes, only=("distribution",),
                          batch_sizes=(1, 4, 16) if size == "quick" else (1, 4, 16, 32))
        t0 = time.perf_counter()
        fig, a, pa = _captured_run(cfg, loaded)
        secs = time.perf_counter() - t0
        alpha = fig["alpha_each"]
        curve = {c: simulated_power([a, pa], c, alpha, rng) for c in GRID}
        smallest = next((c for c in GRID if curve[c] >= 0.95), None)
        row = {"draft": draft, "size": size, "correct_passed": fig["passed"], "verified_drafts": int(a.size),
               "probe_drafts": int(pa.size),
               "mean_a": float(a.mean()) if a.size else None, "share_a_below_1": float((a < 1).mean()) if a.size else None,
               "alpha_each": alpha, "seconds": round(secs, 1), "power": curve, "smallest_c_95": smallest}
        if size in validate:
            c, n = validate[size]
            hits = []
            for seed in range(1, n + 1):
                f, _, _ = _captured_run(dataclasses.replace(cfg, seed=seed, inject_fault=f"relaxed-acceptance:{c}"), loaded)
                hits.append(not f["passed"])
                tqdm.write(f"  {draft} {size} relaxed c={c} seed {seed}: {'DETECTED' if hits[-1] else 'missed'}"
                           f" ({f['summary'][:90]})")
            row["validated"] = {"c": c, "seeds": n, "detected": int(sum(hits))}
        rows.append(row)
        tqdm.write(f"{draft} {size}: {a.size} verified drafts, correct engine "
                   f"{'passes' if fig['passed'] else 'FAILS'}; smallest c at 95%: {smallest} ({secs:.0f} s)")
    print("\n| drafter | audit | verified drafts (drafter + probe) | correct engine | " + " | ".join(f"c={c:g}" for c in GRID)
          + " | smallest c >= 95% | real audits with the fault |")
    print("|---|---|---|---|" + "---|" * len(GRID) + "---|---|")
    for r in rows:
        v = r.get("validated")
        print(f"| {r['draft']} | {r['size']} | {r['verified_drafts']} + {r.get('probe_drafts', 0)} | {'pass' if r['correct_passed'] else 'FAIL'} | "
              + " | ".join(f"{r['power'][c]:.0%}" for c in GRID)
              + f" | {r['smallest_c_95'] or '> 2'} | "
              + (f"c={v['c']:g}: {v['detected']}/{v['seeds']} detected" if v else "-") + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in rows:
            ax.plot(GRID, [r["power"][c] for c in GRID], marker="o", label=f"{r['draft']}, {r['size']}")
        ax.axhline(0.95, color="grey", ls="--", lw=1)
        ax.set_xticks([1.0, 1.1, 1.25, 1.5, 1.75, 2.0])
        ax.set_xlabel("relaxation c in min(1, c p/q)")
        ax.set_ylabel("P(calibration test detects)")
        ax.set_title(f"Audit power against relaxed acceptance ({args.target})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
