"""Report files: report.json (machine-readable), report.md, and a self-contained
report.html with four plots embedded as base64 PNG. The Markdown and HTML are rendered
from the JSON document alone, so `render_all(json.load(...))` reproduces them."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

PLOTS = ("equivalence", "pit", "slices", "load")
PLOT_TITLES = {"equivalence": "Exact match vs the plain reference, per batch size",
               "pit": "Randomised PIT histogram (uniform under an exact sampler)",
               "slices": "Acceptance per slice: tokens per target pass (speedup on the bars)",
               "load": "Speedup of speculative over plain decoding vs load"}


def write_reports(report: dict, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "md": out / "report.md", "html": out / "report.html"}
    paths["json"].write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    paths["md"].write_text(render_markdown(report), encoding="utf-8")
    paths["html"].write_text(render_html(report), encoding="utf-8")
    return paths


# -- shared helpers -----------------------------------------------------------------------
def _check(report: dict, name: str) -> dict | None:
    """The named check, if it ran to completion (a check that raised or did not run has no
    figures to show; the checks table carries its summary)."""
    c = next((c for c in report["checks"] if c["name"] == name), None)
    return c if c and c["figures"] and "error" not in c["figures"] else None


def _f(x, fmt: str = ".2f", none: str = "-") -> str:
    if x is None:
        return none
    if isinstance(x, float):
        return format(x, fmt)
    return str(x)


def drafts_verified(check: dict) -> int | None:
    """How many draft tokens (or drafted positions) a check verified: a check that verified
    none proved nothing about the speculative paths. None where the check drafts nothing."""
    f, d = check.get("figures") or {}, check.get("details") or {}
    name = check["name"]
    if name in ("equivalence", "seeded"):
        return f.get("drafts_verified")
    if name == "distribution":
        return f.get("verified_drafts")
    if name == "stopping":
        per = d.get("per_config")
        return sum(r.get("drafted", 0) for r in per) if per else None
    if name == "drafter-consistency":
        return f.get("positions_compared")
    return None


def _temps(f: dict) -> str:
    """The audited temperatures of a check's figures: "1, 0.5"."""
    return ", ".join(f"{t:g}" for t in (f.get("temperatures") or [f["temperature"]]))


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def headline(report: dict) -> list[tuple[str, str]]:
    """(label, value) pairs: the figures a reader needs first."""
    rec = report["record"]
    out = [("Verdict", report["verdict"].upper() + (f" (failed: {', '.join(report['failed_checks'])})"
                                                    if report["failed_checks"] else "")),
           ("Target", f"{rec['target'].get('name') or rec['target']['spec']}"),
           ("Drafter", f"{rec['drafter']['name']}, k={rec['drafter']['k']}"),
           ("Verification rule", rec["rule"]),
           ("Mode", f"{rec['sizes']['name']}, {rec['suite']['prompts_audited']} prompts, "
                    f"{rec['prompt_format']}, {report['elapsed_s']:.0f} s")]
    if rec.get("checks_not_run"):
        out.append(("Not run (--fail-fast or --only)", ", ".join(rec["checks_not_run"])))
    eq = _check(report, "equivalence")
    if eq:
        out.append(("Exact match (greedy)", ", ".join(f"b{b} {_pct(v)}" for b, v in
                                                      eq["figures"]["exact_match_by_batch"].items())
                    + f"; {eq['figures']['divergences']} clear divergences, {eq['figures']['near_ties']} near-ties"))
    d = _check(report, "distribution")
    if d:
        f = d["figures"]
        out.append(("Distribution (PIT KS)", f"p = {_f(f['p_value'], '.3g')}, D = {_f(f['ks_statistic'], '.4f')}, "
                                             f"n = {f['n']} tokens at T={_temps(f)}"))
    sd = _check(report, "seeded")
    if sd and sd["figures"].get("applicable"):
        f = sd["figures"]
        out.append(("Same seed, same bytes", f"{f['prompts']} seeded prompts at T={_temps(f)}: "
                                             f"{f['divergences']} divergences, {f['near_ties']} near-ties, "
                                             f"{f['drafts_verified']} drafts verified"))
    s = _check(report, "slices")
    if s:
        f = s["figures"]
        out.append(("Speedup at batch 1 (pooled)", f"{_f(f['pooled_speedup'])}x, "
                                                   f"{_f(f['pooled_mean_accepted_length'])} tokens/target pass; "
                                                   f"best {f['best_slice']}, worst {f['worst_slice']}"))
    ld = _check(report, "load")
    if ld:
        out.append(("Load crossover", ld["summary"]))
    return out


# -- plots --------------------------------------------------------------------------------
def plot_pngs(report: dict) -> dict[str, bytes]:
    """name -> PNG bytes for the four plots (matplotlib, Agg backend, no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}

    def save(fig, name):
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=90)
        plt.close(fig)
        out[name] = buf.getvalue()

    eq = _check(report, "equivalence")
    fig, ax = plt.subplots(figsize=(6, 3.4))
    if eq:
        rows = eq["details"]["per_batch"]
        xs = [f"{r['batch']}\n{r['policy']}" if "policy" in r else str(r["batch"]) for r in rows]
        ys = [r["exact_match_rate"] for r in rows]
        colors = ["#2e7d32" if r["passed"] else "#c62828" for r in rows]
        ax.bar(xs, ys, color=colors)
        fig_eq = eq["figures"]
        if fig_eq.get("exact_match_threshold") is not None:
            ax.axhline(fig_eq["exact_match_threshold"], color="k", ls="--", lw=1, label="threshold")
        elif fig_eq.get("null_run"):  # a noisy backend: tested against its own null run, no fixed bar
            null = fig_eq["null_run"]
            ax.axhline(1 - null["differ"] / null["prompts"], color="k", ls="--", lw=1,
                       label=f"null run: plain b={null['batch']} vs b=1")
        for x, r in zip(xs, rows):
            ax.text(x, max(r["exact_match_rate"] / 2, 0.05), f"{r['identical']}/{r['prompts']} identical\n"
                    f"{r['near-tie']} near-tie\n{r['divergence']} divergence", ha="center", va="center",
                    fontsize=8, color="white" if r["exact_match_rate"] > 0.2 else "black")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("batch size")
    ax.set_ylabel("exact match rate")
    save(fig, "equivalence")

    d = _check(report, "distribution")
    tests = {t["test"]: t for t in (d["figures"].get("tests") or [])} if d else {}
    if tests:  # one panel per test family: three PIT histograms and the calibration curve
        fig, axes = plt.subplots(2, 2, figsize=(7.5, 5.2))
        # the engine's families (recovered, bonus), or from outside the drafted positions' own PIT
        panels = ("pit", "pit-drafted", "recovered") if "pit-drafted" in tests else ("pit", "recovered", "bonus")
        for ax, name in zip(axes.flat[:3], panels):
            t = tests.get(name)
            if t is None or not t.get("histogram"):
                ax.text(0.5, 0.5, f"{name}: not tested", ha="center", va="center", fontsize=9)
                ax.set_axis_off()
                continue
            hist = t["histogram"]
            width = 1 / len(hist)
            ax.bar([i * width for i in range(len(hist))], hist, width=width, align="edge",
                   color="#1565c0" if t["passed"] else "#c62828", edgecolor="white")
            expect, sd = t["n"] / len(hist), (t["n"] * width * (1 - width)) ** 0.5
            ax.axhline(expect, color="k", lw=1)
            ax.axhspan(expect - 2 * sd, expect + 2 * sd, color="k", alpha=0.08)
            ax.set_title(f"{name}: KS p = {t['p_value']:.3g}, n = {t['n']}", fontsize=8)
            ax.set_xlabel("u (CDF over descending p)", fontsize=8)
            ax.tick_params(labelsize=7)
        ax = axes.flat[3]  # the calibration family: the deployed drafter's drafts and the probe's
        cal = [(name, tests[name]) for name in ("calibration", "probe-calibration")
               if name in tests and tests[name].get("bins")]
        if cal:
            ax.plot([0, 1], [0, 1], color="k", lw=1)
            titles = []
            for (name, t), marker, ok in zip(cal, ("o", "s"), ("#1565c0", "#ef6c00")):
                bins = t["bins"]
                ax.scatter([b["mean_a"] for b in bins], [b["kept_rate"] for b in bins], marker=marker,
                           s=[8 + 40 * b["n"] / max(x["n"] for x in bins) for b in bins],
                           color=ok if t["passed"] else "#c62828",
                           label=f"{'drafter' if name == 'calibration' else 'probe'}: n = {t['n']}")
                titles.append(f"{'drafter' if name == 'calibration' else 'probe'} z = {t['statistic']:+.2f}")
            ax.set_title("calibration: " + ", ".join(titles), fontsize=8)
            ax.legend(fontsize=7, loc="upper left")
            ax.set_xlabel("exact acceptance min(1, p/q)", fontsize=8)
            ax.set_ylabel("kept", fontsize=8)
            ax.set_xlim(0, 1.02)
            ax.set_ylim(0, 1.02)
            ax.tick_params(labelsize=7)
        else:
            ax.text(0.5, 0.5, "calibration: no verified drafts", ha="center", va="center", fontsize=9)
            ax.set_axis_off()
        fig.tight_layout()
    else:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        if d and d["figures"].get("histogram"):  # an inconclusive check has no histogram
            f = d["figures"]
            hist = f["histogram"]
            width = 1 / len(hist)
            ax.bar([i * width for i in range(len(hist))], hist, width=width, align="edge",
                   color="#1565c0" if d["passed"] else "#c62828", edgecolor="white")
            expect = f["n"] / len(hist)
            sd = (f["n"] * width * (1 - width)) ** 0.5
            ax.axhline(expect, color="k", lw=1)
            ax.axhspan(expect - 2 * sd, expect + 2 * sd, color="k", alpha=0.08)
            ax.set_title(f"KS p = {f['p_value']:.3g}, n = {f['n']}", fontsize=9)
        ax.set_xlabel("u = F(x-) + U p(x)")
        ax.set_ylabel("tokens")
    save(fig, "pit")

    s = _check(report, "slices")
    fig, ax = plt.subplots(figsize=(6, 3.4))
    if s:
        rows = s["details"]["slices"]
        names = [r["slice"] for r in rows]
        mal = [r["mean_accepted_length"] or 0 for r in rows]
        ax.bar(names, mal, color="#6a1b9a")
        for n, m, r in zip(names, mal, rows):
            ax.text(n, m + 0.02, f"{_f(r['speedup'])}x", ha="center", fontsize=8)
        ax.axhline(1.0, color="k", ls="--", lw=1)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    ax.set_ylabel("tokens per target pass")
    save(fig, "slices")

    ld = _check(report, "load")
    fig, ax = plt.subplots(figsize=(6, 3.4))
    if ld:
        for name, style in (("short", "o-"), ("long", "s--")):
            pts = ld["details"]["points"].get(name) or []
            if pts:
                ctx_tokens = round(sum(p["prompt_tokens"] for p in pts) / len(pts))
                ax.plot([p["batch"] for p in pts], [p["speedup"] for p in pts], style,
                        label=f"{name} context (~{ctx_tokens} tokens)")
        ax.axhline(1.0, color="k", lw=1)
        ax.set_xscale("log", base=2)
        batches = sorted({p["batch"] for pts in ld["details"]["points"].values() for p in pts})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.legend(fontsize=8)
    ax.set_xlabel("batch size (rows decoded together)")
    ax.set_ylabel("speedup (spec / plain)")
    save(fig, "load")
    return out


# -- Markdown -----------------------------------------------------------------------------
def _md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _sections(report: dict) -> list[tuple[str, list[str], list[list]]]:
    """(title, header, rows) tables per check, shared by Markdown and HTML."""
    out = []
    eq = _check(report, "equivalence")
    if eq:
        out.append(("Equivalence per batch size", ["batch", "policy", "rows together", "prompts", "exact match",
                                                   "identical", "near-tie", "divergence", "drafts verified",
                                                   "passed"],
                    [[r["batch"], r.get("policy", "-"), r["rows_decoded_together"], r["prompts"],
                      _pct(r["exact_match_rate"]), r["identical"], r["near-tie"], r["divergence"],
                      r.get("drafted", "-"), r["passed"]]
                     for r in eq["details"]["per_batch"]]))
        diff = [r for r in eq["details"]["prompts"] if r["verdict"] != "identical"]
        if diff:
            out.append(("Equivalence: prompts that differ", ["batch", "prompt", "slice", "first divergence",
                                                             "top-2 margin", "verdict"],
                        [[r["batch"], r["id"], r["slice"], r["first_divergence"], _f(r["margin"], ".3g"),
                          r["verdict"]] for r in diff[:40]]))
    d = _check(report, "distribution")
    if d:
        f = d["figures"]
        out.append(("Distribution (randomised PIT, KS test)", ["temperature", "tokens", "KS D", "p-value",
                                                               "alpha", "acceptance", "tokens/pass", "passed"],
                    [[_temps(f), f["n"], _f(f["ks_statistic"], ".4f"), _f(f["p_value"], ".3g"), f["alpha"],
                      _pct(f["acceptance_rate"]), _f(f["mean_accepted_length"]), d["passed"]]]))
        if f.get("tests"):
            pr = f.get("probe")
            probe_txt = (f"; calibration probe: {pr['verified_drafts']} drafts of the target drafting for itself "
                         f"from its own nucleus {'/'.join(f'{m:g}' for m in pr['masses'])}, k={pr['k']}, "
                         f"acceptance {_pct(pr['acceptance_rate'])}") if pr else ""
            out.append((f"Distribution: one test per mechanism ({f['correction']}, alpha {f['alpha']:g} in all; "
                        f"{f['verified_drafts']} verified drafts, at least {f['min_verified_drafts']} needed"
                        f"{probe_txt})",
                        ["test", "kind", "n", "statistic", "p-value", "alpha", "passed"],
                        [[t["test"], t["kind"], t["n"], _f(t["statistic"], ".3g"), _f(t["p_value"], ".3g"),
                          _f(t["alpha"], ".2g"), t["passed"]] for t in f["tests"]]))
    sd = _check(report, "seeded")
    if sd and sd["figures"].get("applicable"):
        out.append(("Seeded speculative vs seeded plain output", ["batch", "policy", "prompts", "identical",
                                                                  "near-tie", "divergence", "drafts verified",
                                                                  "passed"],
                    [[r["batch"], r["policy"], r["prompts"], r["identical"], r["near-tie"], r["divergence"],
                      r["drafted"], r["passed"]] for r in sd["details"]["per_config"]]))
    c = _check(report, "drafter-consistency")
    if c and c["figures"].get("applicable"):
        out.append(("Drafter consistency", ["batch", "policy", "positions compared", "near-ties", "mismatches"],
                    [[r["batch"], r.get("policy", "-"), r["positions_compared"], r["near_ties"], r["mismatches"]]
                     for r in c["details"]["per_batch"]]))
        if c["details"]["mismatches"]:
            out.append(("Drafter consistency: first mismatches", ["batch", "prompt", "step", "position",
                                                                  "drafted", "expected"],
                        [[m["batch"], m["id"], m["step"], m["position"], m["drafted"], m.get("expected", "-")]
                         for m in c["details"]["mismatches"][:20]]))
    k = _check(report, "corruption")
    if k:
        out.append(("Corruption signatures", ["batch", "outputs", "flagged"],
                    [[r["batch"], r["outputs"], r["flagged"]] for r in k["details"]["per_batch"]]))
        if k["details"]["flagged"]:
            out.append(("Corruption: flagged outputs", ["batch", "prompt", "signatures", "end of output"],
                        [[r["batch"], r["id"], "; ".join(r["signatures"]), r["text"][-80:]]
                         for r in k["details"]["flagged"][:20]]))
    s = _check(report, "slices")
    if s:
        rows = s["details"]["slices"] + [s["details"]["pooled"]]
        out.append(("Acceptance and speed per slice (batch 1)",
                    ["slice", "prompts", "tokens", "tokens/pass", "acceptance", "acceptance per position",
                     "plain tok/s", "spec tok/s", "speedup"],
                    [[r["slice"], r["prompts"], r["tokens"], _f(r["mean_accepted_length"]), _pct(r["acceptance_rate"]),
                      " ".join(_pct(a) for a in r["acceptance_per_position"]), _f(r["plain_tokens_per_s"], ".1f"),
                      _f(r["speculative_tokens_per_s"], ".1f"), _f(r["speedup"]) + "x"] for r in rows]))
    ld = _check(report, "load")
    if ld:
        rows = []
        for name, pts in ld["details"]["points"].items():
            for p in pts:
                rows.append([name, p["prompt_tokens"], p["batch"], _f(p["plain_tokens_per_s"], ".1f"),
                             _f(p["speculative_tokens_per_s"], ".1f"), _f(p["plain_ms_per_token"], ".0f"),
                             _f(p["speculative_ms_per_token"], ".0f"), _f(p["mean_accepted_length"]),
                             _f(p["speedup"]) + "x"])
        out.append(("Load sweep", ["context", "prompt tokens", "batch", "plain tok/s", "spec tok/s",
                                   "plain ms/token", "spec ms/token", "tokens/pass", "speedup"], rows))
    for c in report["checks"]:  # tables a check brings along (the endpoint audit's null baseline, ...)
        out += [tuple(t) for t in ((c.get("details") or {}).get("tables") or [])]
    rec = report["record"]
    out.append(("Re-test triggers (a change of any re-opens the verdict)", ["trigger", "audited value"],
                [[t["trigger"], t["audited"]] for t in rec["retest_triggers"]]))
    files = (rec["target"].get("files") or {})
    if files:
        out.append(("Target model files", ["file", "sha256"], [[f, h] for f, h in files.items()]))
    return out


def render_markdown(report: dict) -> str:
    parts = [f"# verispec audit: {report['verdict'].upper()}\n"]
    parts.append(_md_table(["", ""], headline(report)))
    parts.append("## Checks\n")
    parts.append(_md_table(["check", "result", "time", "drafts verified", "summary"],
                           [[c["name"], "info" if c["informational"] else ("pass" if c["passed"] else "**FAIL**"),
                             f"{c['elapsed_s']:.1f} s", _f(drafts_verified(c), "d"), c["summary"]]
                            for c in report["checks"]]))
    for title, header, rows in _sections(report):
        parts.append(f"## {title}\n")
        parts.append(_md_table(header, rows))
    rec = report["record"]
    parts.append("## Record\n")
    parts.append(_md_table(["", ""], [["packages", ", ".join(f"{k} {v}" for k, v in rec["packages"].items())],
                                      ["machine", ", ".join(f"{k}: {v}" for k, v in rec["machine"].items())],
                                      ["seed", rec["seed"]], ["started", rec["started_at"]]]))
    return "\n".join(parts)


# -- HTML ---------------------------------------------------------------------------------
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1200px;
color:#222;padding:0 16px}
h1{margin:0 0 8px}.verdict{display:inline-block;padding:6px 18px;border-radius:6px;color:#fff;font-weight:700}
.pass{background:#2e7d32}.fail{background:#c62828}.info{background:#546e7a}
table{border-collapse:collapse;margin:8px 0 20px;font-size:13px}td,th{border:1px solid #ccc;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f3f3f3}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:16px}.plot{border:1px solid #ddd;padding:8px}
.plot img{width:100%}.plot h3{font-size:14px;margin:0 0 6px}code{font-size:12px}
table.headline{font-size:15px}table.headline td:first-child{font-weight:600}
"""


def _html_table(header: list[str] | None, rows: list[list], cls: str = "") -> str:
    head = ""
    if header:
        head = "<thead><tr>" + "".join(f"<th>{html.escape(str(x))}</th>" for x in header) + "</tr></thead>"
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table class='{cls}'>{head}<tbody>{body}</tbody></table>"


def render_html(report: dict) -> str:
    pngs = plot_pngs(report)
    v = report["verdict"]
    out = ["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
           f"<title>verispec audit: {v}</title><style>{_CSS}</style></head><body>",
           f"<h1>verispec audit <span class='verdict {v}'>{v.upper()}</span></h1>"]
    out.append(_html_table(None, headline(report), cls="headline"))
    out.append("<h2>Checks</h2>")
    rows = []
    for c in report["checks"]:
        res = "info" if c["informational"] else ("pass" if c["passed"] else "fail")
        rows.append(f"<tr><td>{html.escape(c['name'])}</td><td><span class='verdict {res}'>{res.upper()}</span>"
                    f"</td><td>{c['elapsed_s']:.1f} s</td><td>{_f(drafts_verified(c), 'd')}</td>"
                    f"<td>{html.escape(c['summary'])}</td></tr>")
    out.append("<table><thead><tr><th>check</th><th>result</th><th>time</th><th>drafts verified</th>"
               "<th>summary</th></tr></thead>"
               f"<tbody>{''.join(rows)}</tbody></table>")
    out.append("<h2>Plots</h2><div class='grid'>")
    for name in PLOTS:
        b64 = base64.b64encode(pngs[name]).decode("ascii")
        out.append(f"<div class='plot'><h3>{html.escape(PLOT_TITLES[name])}</h3>"
                   f"<img id='plot-{name}' alt='{html.escape(PLOT_TITLES[name])}' "
                   f"src='data:image/png;base64,{b64}'></div>")
    out.append("</div>")
    for title, header, rows in _sections(report):
        out.append(f"<h2>{html.escape(title)}</h2>")
        out.append(_html_table(header, rows))
    if report.get("samples"):
        out.append("<h2>Sample outputs (greedy)</h2>")
        out.append(_html_table(["slice", "prompt", "reference", "speculative"],
                               [[s["slice"], s["prompt"][:160], s["reference"][:300],
                                 next(v for k, v in s.items() if k.startswith("speculative"))[:300]]
                                for s in report["samples"]]))
    rec = report["record"]
    out.append("<h2>Record</h2>")
    out.append(_html_table(["", ""], [["packages", ", ".join(f"{k} {v}" for k, v in rec["packages"].items())],
                                      ["machine", ", ".join(f"{k}: {v}" for k, v in rec["machine"].items())],
                                      ["engine", json.dumps(rec["engine"])], ["seed", rec["seed"]],
                                      ["started", rec["started_at"]]]))
    out.append("</body></html>")
    return "\n".join(out)
