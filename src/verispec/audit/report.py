"""Report files: report.json (machine-readable), report.md, and a self-contained
report.html with four plots embedded as base64 PNG. The Markdown and HTML are rendered
from the JSON document alone, so `render_all(json.load(...))` reproduces them."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from .checks import REGISTRY, Check, CheckResult, find, status_of
from .fmt import f as _f



def write_reports(report: dict, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "md": out / "report.md", "html": out / "report.html"}
    paths["json"].write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    paths["md"].write_text(render_markdown(report), encoding="utf-8")
    paths["html"].write_text(render_html(report), encoding="utf-8")
    return paths


# -- shared helpers -----------------------------------------------------------------------
def drafts_verified(check: dict) -> int | None:
    """How many draft tokens (or drafted positions) a check verified: a check that verified
    none proved nothing about the speculative paths. None where the check drafts nothing."""
    c = find(check["name"])
    return c.drafts_verified(CheckResult.from_dict(check)) if c and c.drafts_verified else None


def _completed(report: dict) -> list[tuple[Check, CheckResult]]:
    """Each registered check that ran to completion, with its result, in report order."""
    out = []
    for d in report["checks"]:
        c, r = find(d["name"]), CheckResult.from_dict(d)
        if c is not None and r.completed:
            out.append((c, r))
    return out


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
    for c, r in _completed(report):
        if c.headline:
            out += c.headline(r)
    return out


# -- plots --------------------------------------------------------------------------------
def plot_names() -> list[str]:
    """The plots of the registered checks, in report order."""
    return [c.plot[0] for c in REGISTRY if c.plot is not None]


def plot_pngs(report: dict) -> dict[str, bytes]:
    """name -> PNG bytes for every registered check's plot (matplotlib, Agg backend, no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = {c.name: r for c, r in _completed(report)}
    out = {}
    for check in REGISTRY:
        if check.plot is None:
            continue
        name, _, draw = check.plot
        fig = draw(plt, done.get(check.name))
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=90)
        plt.close(fig)
        out[name] = buf.getvalue()
    return out


# -- Markdown -----------------------------------------------------------------------------
def _md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _sections(report: dict) -> list[tuple[str, list[str], list[list]]]:
    """(title, header, rows) tables per check, shared by Markdown and HTML."""
    out = []
    for c, r in _completed(report):
        if c.sections:
            out += c.sections(r)
    for c in report["checks"]:  # tables a check brings along (the endpoint audit's null baseline, ...)
        out += [tuple(t) for t in ((c.get("details") or {}).get("tables") or [])]
    out += coverage_sections(report)
    rec = report["record"]
    out.append(("Re-test triggers (a change of any re-opens the verdict)", ["trigger", "audited value"],
                [[t["trigger"], t["audited"]] for t in rec["retest_triggers"]]))
    files = (rec["target"].get("files") or {})
    if files:
        out.append(("Target model files", ["file", "sha256"], [[f, h] for f, h in files.items()]))
    return out


def _coverage(report: dict, check: Check) -> str:
    """What this audit did with a check the bug catalogue names: tested (its status), not
    applicable to this server (and why), or not run."""
    d = next((c for c in report["checks"] if c["name"] == check.name), None)
    if d is None:
        return "not run"
    if (d.get("figures") or {}).get("applicable") is False:
        return "not covered: " + (d.get("summary") or "not applicable")
    return {"fail": "FAIL", "error": "ERROR", "info": "informational"}.get(status_of(d), "tested: pass")


def coverage_sections(report: dict) -> list[tuple[str, list[str], list[list]]]:
    """Which classes of the servers' known bugs (audit/known_bugs.py) this audit covered and
    which it could not, so a PASS claims no more than was tested; and for each failed check,
    what its evidence looks like and the known bugs with that signature."""
    from . import known_bugs
    checks = []
    for b in known_bugs.CATALOGUE:
        if b.check not in checks:
            checks.append(b.check)
    rows, failed = [], []
    for check in checks:
        bugs = known_bugs.by_check(check)
        state = _coverage(report, check)
        rows.append([check.name, state, ", ".join(sorted({b.bug_class for b in bugs})), len(bugs)])
        if state in ("FAIL", "ERROR"):
            for sig in dict.fromkeys(b.signature for b in bugs):
                failed.append([check.name, sig, ", ".join(b.cite for b in bugs if b.signature == sig)])
    out = [("Known bug classes: what this audit covered (audit/known_bugs.py: real bugs of vLLM, llama.cpp, "
            "SGLang, TGI, TensorRT-LLM and transformers)", ["check", "in this audit", "bug classes", "known bugs"],
            rows)]
    if failed:
        out.append(("What the failures look like, and the known bugs with that signature",
                    ["failed check", "signature", "known bugs"], failed))
    return out


def render_markdown(report: dict) -> str:
    parts = [f"# verispec audit: {report['verdict'].upper()}\n"]
    parts.append(_md_table(["", ""], headline(report)))
    parts.append("## Checks\n")
    parts.append(_md_table(["check", "result", "time", "drafts verified", "summary"],
                           [[c["name"], {"fail": "**FAIL**", "error": "**ERROR**"}.get(status_of(c), status_of(c)),
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
.pass{background:#2e7d32}.fail{background:#c62828}.error{background:#6a1b9a}.info{background:#546e7a}
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
        res = status_of(c)
        rows.append(f"<tr><td>{html.escape(c['name'])}</td><td><span class='verdict {res}'>{res.upper()}</span>"
                    f"</td><td>{c['elapsed_s']:.1f} s</td><td>{_f(drafts_verified(c), 'd')}</td>"
                    f"<td>{html.escape(c['summary'])}</td></tr>")
    out.append("<table><thead><tr><th>check</th><th>result</th><th>time</th><th>drafts verified</th>"
               "<th>summary</th></tr></thead>"
               f"<tbody>{''.join(rows)}</tbody></table>")
    out.append("<h2>Plots</h2><div class='grid'>")
    for name, title, _ in (c.plot for c in REGISTRY if c.plot is not None):
        b64 = base64.b64encode(pngs[name]).decode("ascii")
        out.append(f"<div class='plot'><h3>{html.escape(title)}</h3>"
                   f"<img id='plot-{name}' alt='{html.escape(title)}' "
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
