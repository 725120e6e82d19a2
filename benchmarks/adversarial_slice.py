"""Make the default suite's "adversarial" slice from speedup-floor searches.

Each report given is an audit's report.json whose speedup-floor check searched for prompts
that defeat one drafter (`verispec audit --only speedup-floor --draft D ...`). From each,
the edited prompts that threw away the most drafts per token with their output quality
intact are taken (--per-report of them, each from another suite prompt), and the slice is rewritten in the
suite file with where each prompt came from (`made_by`: drafter, target, backend, search
seed and budget, the edits, and the acceptance the search measured).

    python benchmarks/adversarial_slice.py /tmp/floor-lookup/report.json \\
        /tmp/floor-layerskip/report.json /tmp/floor-draft/report.json \\
        --per-report 4 --write src/verispec/data/suite_default.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SLICE = "adversarial"


def picks(report: dict, n: int) -> list[dict]:
    floor = next((c for c in report["checks"] if c["name"] == "speedup-floor"), None)
    if floor is None or not floor.get("details"):
        raise SystemExit("a report without a completed speedup-floor check")
    rec = report.get("record") or {}
    target = (rec.get("target") or {}).get("spec") or rec.get("target")
    drafter = floor["figures"].get("drafter")
    out, seen, origins = [], set(), set()
    cands = [d for d in floor["details"]["candidates"]
             if d["edits"] and d["quality"] == "intact" and d["waste_per_token"] is not None]
    for d in sorted(cands, key=lambda d: (-d["waste_per_token"], d["acceptance"] or 0)):
        if d["text"] in seen or d["origin"] in origins:  # one per suite prompt: a slice of variety
            continue
        seen.add(d["text"])
        origins.add(d["origin"])
        out.append({"prompt": d["text"], "made_by": {
            "search": "speedup-floor", "drafter": drafter, "target": target,
            "backend": (rec.get("engine") or {}).get("backend"),
            "seed": floor["figures"]["search"]["seed"], "budget": {k: floor["figures"]["budget"][k] for k in
                                                                   ("seeds", "candidates", "max_new_tokens")},
            "edits": d["edits"], "from": d["origin"], "acceptance": d["acceptance"],
            "drafts_wasted_per_token": round(d["waste_per_token"], 3)}})
        if len(out) == n:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--per-report", type=int, default=4)
    ap.add_argument("--write", type=Path, help="the suite file whose adversarial slice is replaced")
    args = ap.parse_args()
    chosen = [p for r in args.reports for p in picks(json.loads(r.read_text()), args.per_report)]
    lines = []
    for i, p in enumerate(chosen, 1):
        lines.append(json.dumps({"id": f"{SLICE}-{i:02d}", "slice": SLICE, "prompt": p["prompt"],
                                 "turns": [p["prompt"]], "made_by": p["made_by"]}, ensure_ascii=False))
    if args.write:
        kept = [ln for ln in args.write.read_text(encoding="utf-8").splitlines()
                if ln.strip() and json.loads(ln).get("slice") != SLICE]
        args.write.write_text("\n".join(kept + lines) + "\n", encoding="utf-8")
        print(f"{args.write}: {len(lines)} {SLICE} prompts from {len(args.reports)} searches")
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
