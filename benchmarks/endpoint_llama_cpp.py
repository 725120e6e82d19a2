"""Audit llama.cpp's own server with `verispec audit --endpoint`: a llama-server with a
draft model (speculative) against the same model served plain (the reference and its
null run), both built from the pinned sdist (scripts/build_llama_cpp.sh) and run with
Prometheus metrics, no busy polling and 8 slots. Writes report.json / report.md /
report.html, a PNG screenshot of the HTML (when chromium is installed) and README.md (the
headline figures, and the speed per concurrency level beside llama.cpp's own counters) to
--out, and prints the same. `--from-report OUT/report.json` renders those files again from
a finished run without serving anything.

    python benchmarks/endpoint_llama_cpp.py --target qwen2.5-coder-1.5b \
        --draft qwen2.5-coder-0.5b --out docs/endpoint-llama-cpp
    python benchmarks/endpoint_llama_cpp.py --target smollm2-135m --draft ngram --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from tests.llama_server import NGRAM, LlamaServer  # noqa: E402
from verispec.audit.endpoint.runner import EndpointAuditConfig, run_endpoint_audit  # noqa: E402
from verispec.audit.report import write_reports  # noqa: E402
from verispec.audit.suite import load_suite  # noqa: E402


def gguf(name: str) -> Path:
    """A preset's GGUF file as shipped (parts joined once into the cache, SHA-256 checked)."""
    from verispec.models.presets import assemble_parts, cache_dir, get_preset, locate_parts, reinstall_hint
    p = Path(name)
    if p.suffix == ".gguf" and p.is_file():
        return p
    preset = get_preset(name)
    parts = locate_parts(preset)
    if len(parts) == 1:
        return parts[0]
    dest = cache_dir() / "gguf" / preset.gguf_name
    if not dest.is_file():
        tmp = dest.with_suffix(".part")
        assemble_parts(parts, tmp, expected_sha256=preset.sha256, reinstall_hint=reinstall_hint(preset))
        tmp.replace(dest)
    return dest


def _check(report: dict, name: str) -> dict | None:
    return next((c for c in report["checks"] if c["name"] == name), None)


def _x(v, fmt=".2f", none="-") -> str:
    return none if v is None else format(v, fmt)


def level_rows(report: dict) -> list[dict]:
    """Per concurrency level: the speeds the audit measured and llama.cpp's own counters
    (differences of its /metrics counters over that level's requests)."""
    rows = []
    for p in _check(report, "load")["details"]["points"]["short"]:
        sc = p["server_counters"] or {}
        rows.append({"c": p["batch"], "spec_tps": p["speculative_tokens_per_s"], "plain_tps": p["plain_tokens_per_s"],
                     "speedup": p["speedup"], "spec_ms": p["speculative_ms_per_token"],
                     "plain_ms": p["plain_ms_per_token"], "drafts": sc.get("drafts"),
                     "draft_tokens": sc.get("draft_tokens"), "accepted": sc.get("accepted_tokens"),
                     "generated": sc.get("generation_tokens"), "rate": sc.get("acceptance_rate"),
                     "per_step": sc.get("mean_acceptance_length"),
                     "per_pos": [round(a, 3) for a in sc.get("acceptance_per_position") or [] if a is not None]})
    return rows


def summary_markdown(report: dict, png: str | None, command: str) -> str:
    """README.md of the report folder: headline figures, then speed beside the counters."""
    rec, eq, sl = report["record"], _check(report, "equivalence"), _check(report, "slices")
    dist = _check(report, "distribution")
    srv, launch = rec["server"], rec.get("launch") or {}
    machine = rec.get("machine_load") or {}
    rows = level_rows(report)
    kind = srv["kind"]
    names = {"llama.cpp": ("llama.cpp's server", "llama-server's `llamacpp:spec_decode_*` and `tokens_predicted_total`"),
             "vllm": ("vLLM", "vLLM's `vllm:spec_decode_*` and `generation_tokens_total`")}
    title, counters = names.get(kind, (kind, "the server's speculative counters"))
    out = [f"# {title} audited by `verispec audit --endpoint`: {report['verdict'].upper()}", "",
           f"Written by `{command}` (started {rec['started_at']}, {report['elapsed_s']:.0f} s"
           + (f"; 1-minute load average {machine['before'][0]:.2f} before, {machine['after'][0]:.2f} after, "
              f"on {machine['cpus']} CPUs" if machine else "") + "). Files: [report.md](report.md), "
           "[report.html](report.html), [report.json](report.json).", ""]
    if png:
        out += [f"![the HTML report]({png})", ""]
    pb = {r["batch"]: r for r in eq["details"]["per_batch"]}
    first = sl["figures"]
    head = [("Verdict", f"{report['verdict'].upper()}" + (f" (failed: {', '.join(report['failed_checks'])})"
                                                          if report["failed_checks"] else "")),
            ("Server", f"{srv['kind']} {srv.get('version') or 'version unknown'}; model {rec['target']['name']}"),
            ("Drafter", rec["drafter"]["name"]),
            ("Equivalence (greedy, text; null = plain vs plain)", "; ".join(
                f"c{c}: {r['identical']}/{r['prompts']} identical (null {r['null_compared'] - r['null_divergences']}"
                f"/{r['null_compared']}), Fisher p {r['fisher_p']:.3g}, {'pass' if r['passed'] else 'FAIL'}"
                for c, r in pb.items())),
            ("Null run's largest margin at a divergence", _x(eq["figures"]["null_max_margin"], ".3g",
                                                              "the null never diverged"))]
    if dist:
        f = dist["figures"]
        cover = (f" of {f['emitted_tokens']} emitted ({f['tokens_without_logprobs']} came without logprobs)"
                 if f.get("emitted_tokens") is not None else "")
        head.append(("Distribution at T = 1 (top-20 + tail PIT)",
                     f"{'pass' if dist['passed'] else 'FAIL'}: KS p = {_x(f.get('p_value'), '.3g')} over {f['n']} "
                     f"scored tokens{cover}, scored with {f.get('scored_with')}"
                     + (f"; {f['reason']}" if f.get("reason") else "")))
    head += [(f"Acceptance at c{rows[0]['c']} ({kind} counters)",
              f"{_x(first['pooled_acceptance_rate'], '.1%')}, {_x(first['pooled_mean_accepted_length'])} tokens "
              f"per verification step, per position {first['pooled_acceptance_per_position'] and [round(a, 3) for a in first['pooled_acceptance_per_position']]}"),
             ("Answers' own speculative fields sum to the counters", str(first["responses_agree_with_counters"])),
             ("Speed (speculative / plain, tokens per second of wall time)", "; ".join(
                 f"c{r['c']}: {_x(r['spec_tps'], '.1f')} / {_x(r['plain_tps'], '.1f')} = {_x(r['speedup'])}x"
                 for r in rows))]
    out += ["## Headline figures", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in head] + [""]
    out += [f"## Speed per concurrency level beside {title}'s own counters", "",
            "Speed: completion tokens over the level's wall time; ms/token: each answer's latency over its tokens, "
            f"averaged. Counters: differences of {counters} over the level.", "",
            "| concurrency | speculative tok/s | plain tok/s | speedup | ms/token spec / plain | tokens predicted "
            "| verification steps | draft tokens | accepted | acceptance | tokens per step | accepted per position |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['c']} | {_x(r['spec_tps'], '.1f')} | {_x(r['plain_tps'], '.1f')} | {_x(r['speedup'])}x | "
                   f"{_x(r['spec_ms'], '.0f')} / {_x(r['plain_ms'], '.0f')} | {_x(r['generated'], '.0f')} | "
                   f"{_x(r['drafts'], '.0f')} | {_x(r['draft_tokens'], '.0f')} | {_x(r['accepted'], '.0f')} | "
                   f"{_x(r['rate'], '.1%')} | {_x(r['per_step'])} | {r['per_pos']} |")
    out += ["", "## Checks", "", "| check | result | summary |", "|---|---|---|"]
    for c in report["checks"]:
        res = "info" if c["informational"] else ("pass" if c["passed"] else "FAIL")
        out.append(f"| {c['name']} | {res} | {c['summary'].replace('|', '/')} |")
    if launch:
        out += ["", "## As served", ""] + [f"* {k}: `{' '.join(shlex.quote(a) for a in v)}`"
                                           for k, v in launch.items()]
    return "\n".join(out) + "\n"


def render(report: dict, out: Path, command: str) -> dict[str, Path]:
    """report.json/md/html, the screenshot and README.md into `out`; prints the figures."""
    paths = write_reports(report, out)
    chrome = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    png = None
    if chrome:
        shot = out / "report.png"
        subprocess.run([chrome, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--screenshot={shot}", "--window-size=1250,2600",
                        paths["html"].resolve().as_uri()], capture_output=True, timeout=120)
        png = shot.name if shot.is_file() else None
    paths["readme"] = out / "README.md"
    paths["readme"].write_text(summary_markdown(report, png, command), encoding="utf-8")
    print(f"verdict {report['verdict'].upper()} in {report['elapsed_s']:.0f} s; failed: {report['failed_checks']}")
    for c in report["checks"]:
        print(f"  {c['name']:<12} {'info' if c['informational'] else ('pass' if c['passed'] else 'FAIL'):<5} "
              f"{c['summary']}")
    for r in level_rows(report):
        print(f"  c{r['c']}: {_x(r['spec_tps'], '.1f')} tok/s vs plain {_x(r['plain_tps'], '.1f')} "
              f"({_x(r['speedup'])}x); server counters: {_x(r['draft_tokens'], '.0f')} drafted, "
              f"{_x(r['accepted'], '.0f')} accepted in {_x(r['drafts'], '.0f')} verification steps, "
              f"per position {json.dumps(r['per_pos'])}")
    print(f"reports: {', '.join(str(p) for p in paths.values())}" + (f", {out / png}" if png else ""))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="a preset / GGUF, or 'ngram' (ngram-simple)")
    ap.add_argument("--n-max", type=int, default=4, help="--spec-draft-n-max (draft model)")
    ap.add_argument("--per-slice", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--sampled-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/endpoint-llama-cpp")
    ap.add_argument("--from-report", type=Path, help="render an earlier run's report.json again; serve nothing")
    args = ap.parse_args()
    # `timeout` sends SIGTERM: leave through the `with` blocks so both servers are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out)
    if args.from_report:
        report = json.loads(args.from_report.read_text())
        render(report, out, report["record"].get("command") or "benchmarks/endpoint_llama_cpp.py")
        return
    command = "python benchmarks/endpoint_llama_cpp.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    target = gguf(args.target)
    spec = NGRAM if args.draft == "ngram" else (
        "--spec-type", "draft-simple", "-md", str(gguf(args.draft)), "--spec-draft-n-max", str(args.n_max),
        "-td", str(args.threads))
    by: dict[str, list] = {}
    for p in load_suite("default"):
        by.setdefault(p.slice, []).append(p)
    prompts = [p for ps in by.values() for p in ps[:args.per_slice]]
    levels = tuple(int(x) for x in args.concurrency.split(","))
    load_before = os.getloadavg()
    t0 = time.monotonic()
    with LlamaServer(target, threads=args.threads, ctx_per_slot=1024) as plain, \
            LlamaServer(target, spec=spec, threads=args.threads, ctx_per_slot=1024) as speculative:
        report = run_endpoint_audit(EndpointAuditConfig(speculative.url, reference_url=plain.url,
                                                        max_tokens=args.max_tokens, concurrency=levels,
                                                        sampled_tokens=args.sampled_tokens), prompts)
        cmd = {"plain": plain.cmd, "speculative": speculative.cmd}
    report["record"]["launch"] = cmd  # what was served, as run
    report["record"]["command"] = command
    # the machine is shared: what else ran beside the audit shows in the load average
    report["record"]["machine_load"] = {"before": list(load_before), "after": list(os.getloadavg()),
                                        "cpus": os.cpu_count(), "wall_s_with_server_start": time.monotonic() - t0}
    render(report, out, command)


if __name__ == "__main__":
    main()
