"""The audit's mutation suite: run `verispec audit --quick` once per fault of
audit/faults/ (and per drafter), plus the correct engine on several seeds, and check
that every fault fails the audit (naming a check) and the correct engine passes.

    python3 benchmarks/mutation_suite.py                        # default drafter (lookup)
    python3 benchmarks/mutation_suite.py --drafts lookup,layerskip:20 --seeds 3
    python3 benchmarks/mutation_suite.py --faults row-leak,recovered-from-p --json out.json

Each audit is a subprocess of the real CLI (what a user runs), one at a time (2 cores).
Fault audits run with --fail-fast (the verdict is FAIL at the first failed check; the
checks after it are not run) unless --all-checks; the lossy rule runs every check, so
that the table shows whether the statistics fail it too, not only its name.
With --only-expected each fault audit runs only the check that must catch it (`--only`;
typical-lossy: the distribution check, so the statistics alone must fail it): the same
check on the same runs as in a whole audit, whose verdict is FAIL whenever one check
fails, in a fraction of the time. Exit status 1 if a fault passes or the correct engine
fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from verispec.audit.faults import EXPECTED_CHECK, FAULTS, parse



def audit(draft: str, fault: str | None, seed: int, extra: list[str], fail_fast: bool = True,
          only: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "verispec.cli", "audit", "--quick", "--draft", draft, "--seed", str(seed),
               "--out", out, "--no-progress", *extra]
        if fault is not None and fault != "typical-lossy":
            cmd += ["--inject-fault", fault]
        if fault == "typical-lossy":
            cmd += ["--verify", "typical-lossy"]
        if only:
            cmd += ["--only", only]
        if fault not in (None, "typical-lossy") and fail_fast:  # the lossy rule: every check, to see the statistics
            cmd += ["--fail-fast"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        secs = time.perf_counter() - t0
        path = Path(out) / "report.json"
        if not path.exists():
            return {"draft": draft, "fault": fault, "seed": seed, "verdict": "error", "failed": [],
                    "seconds": secs, "stderr": proc.stderr[-2000:]}
        rep = json.loads(path.read_text())
    return {"draft": draft, "fault": fault, "seed": seed, "verdict": rep["verdict"], "failed": rep["failed_checks"],
            "seconds": round(secs, 1)}


def _proposes_trees(draft: str) -> bool:
    """Whether the drafter spec proposes draft trees (suffix decoding with width > 1): only
    there does a tree fault's code run."""
    if draft != "suffix" and not draft.startswith("suffix:"):
        return False
    from verispec.drafters.suffix import SuffixSettings
    return SuffixSettings.parse(draft.partition(":")[2]).width > 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafts", default="lookup", help="comma-separated drafter specs")
    ap.add_argument("--faults", default=",".join(list(FAULTS) + ["typical-lossy"]),
                    help="comma-separated fault names (typical-lossy: the lossy rule)")
    ap.add_argument("--seeds", type=int, default=1, help="correct-engine audits per drafter (seeds 0..N-1)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--all-checks", action="store_true", help="fault audits run every check (no --fail-fast)")
    ap.add_argument("--first-seed", type=int, default=0, help="correct-engine seeds start here")
    ap.add_argument("--seed-only", default=None,
                    help="correct-engine audits after the first seed run only these checks (the seed "
                         "enters only the sampled checks: distribution,seeded; the rest repeat seed 0's)")
    ap.add_argument("--only-expected", action="store_true",
                    help="fault audits run only the check that must catch the fault (typical-lossy: distribution)")
    ap.add_argument("extra", nargs="*", help="more `verispec audit` arguments, after --")
    args = ap.parse_args()
    faults = [f for f in args.faults.split(",") if f]
    for f in faults:
        if f != "typical-lossy":
            try:
                parse(f)
            except ValueError as e:
                ap.error(str(e))
    from tqdm import tqdm
    jobs = [(d, None, s) for d in args.drafts.split(",")
            for s in range(args.first_seed, args.first_seed + args.seeds)]
    pairs = [(d, f) for d in args.drafts.split(",") for f in faults]
    skipped = {(d, f) for d, f in pairs if f.startswith("tree-") and not _proposes_trees(d)}
    jobs += [(d, f, 0) for d, f in pairs if (d, f) not in skipped]
    if skipped:
        print(f"not run: {len(skipped)} tree fault(s) with a drafter that proposes chains "
              "(the fault's code never runs; use --drafts suffix:width=4)")
    rows = []
    for d, f, s in tqdm(jobs, desc="audits", unit="audit"):
        only = args.seed_only if f is None and s != args.first_seed else None
        if f is not None and args.only_expected:
            only = "distribution" if f == "typical-lossy" else EXPECTED_CHECK[parse(f)[0]]
        rows.append(audit(d, f, s, args.extra, fail_fast=not args.all_checks, only=only))
        rows[-1]["only"] = only
        r = rows[-1]
        tqdm.write(f"{d:14s} {str(f or 'none (correct)'):26s} seed {s}: {r['verdict'].upper():5s} "
                   f"{','.join(r['failed']) or '-'} ({r['seconds']:.0f} s)")
        if args.json:  # after every audit: a long suite's partial results survive
            Path(args.json).write_text(json.dumps(rows, indent=1))
    bad = []
    print("\n| drafter | fault | expected check | checks run | verdict | failed checks | expected check failed | s |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        want = "none" if r["fault"] is None else (
            ("distribution" if r.get("only") else "lossy-rule") if r["fault"] == "typical-lossy"
            else EXPECTED_CHECK.get(parse(r["fault"])[0], "?"))
        ok = r["verdict"] == "pass" if r["fault"] is None else (
            r["verdict"] == "fail" and (not r.get("only") or want in r["failed"]))
        if not ok:
            bad.append(r)
        hit = "-" if r["fault"] is None else ("yes" if want in r["failed"] else "no")
        print(f"| {r['draft']} | {r['fault'] or 'none (correct)'} | {want} | {r.get('only') or 'all'} | {r['verdict']} | "
              f"{', '.join(r['failed']) or '-'} | {hit} | {r['seconds']:.0f} |")
    print(f"\n{len(rows) - len(bad)} of {len(rows)} audits gave the right verdict")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
