"""Re-test as a gate: `verispec audit --endpoint URL --compare-to OLD/report.json`.

The deployment checklist says: re-test on every draft-model, target-model or batching
change. This compares a new endpoint audit with an earlier one:

* triggers: which re-test triggers of the record changed (served model and its files,
  server software and version, drafter, k, rule, concurrency levels, slots, prompt
  format, workload);
* figures: per slice (at concurrency 1) and per load level, acceptance and speedup in
  both runs, each with a 95% interval, and the change with its interval. Acceptance per
  prompt is accepted / drafted from the answers' own speculative fields, where the server
  gives them, else from the endpoint's /metrics difference over the request (read at
  concurrency 1: client.run_paired), and each prompt is one observation;
* gate: it fails when equivalence got worse (the old audit passed it and the new one
  does not, or a level's divergence count rose by a one-sided Fisher exact test at
  ALPHA) or when a speedup fell beyond its noise (a one-sided Welch t test of the log
  speedups, ALPHA over all levels and slices compared, Bonferroni).

How the speedup's noise is counted. A speedup is the endpoint's tokens/s over the
reference's on the same prompt at the same level, and the audit times the two side by
side (client.run_paired): each wave of c prompts goes to the endpoint and then to the
reference (the order alternating), so a machine that slows for a while (other jobs on
shared cores) slows both halves of a ratio alike and the drift cancels in it. Timed as
two runs, the endpoint's at every level and then the reference's (as the audit did
before), a load change between them moved every prompt's ratio at once, and a test that
took the prompts as independent read that shared shift as a fall far beyond its noise
(benchmarks/RESULTS.md, "Auditing other servers": false alarms in unchanged re-audits on the loaded
2-core machine, none once paired). What drift is left is shared within a wave
(its requests ran together, and its reference half ran after it), so the observations
are the waves, not the prompts: each wave's mean log speedup is one value (at concurrency
1, one prompt a wave). Runs are summarised by the geometric mean over waves (the mean of
log ratios, a t interval), and Welch's test compares the two runs' waves. At concurrency
c with n prompts that leaves n / c observations a run: a high level's gate can only see a
large fall, which is what the data can show. What pairing cannot cancel, a machine whose
load differs between the two audits and slows a verify pass and a plain step unequally,
is a real change of the speedup under those conditions, and the gate reports it as one.
An older report without waves is read one prompt a wave.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from scipy import stats as sps

from ..checks import CheckResult
from ..stats import fisher_greater

ALPHA = 0.01
LEVEL = 0.95


class CompareError(ValueError):
    """The old report cannot be compared (missing, not an endpoint audit, unreadable)."""


def load_report(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    try:
        report = json.loads(p.read_text())
    except FileNotFoundError:
        raise CompareError(f"--compare-to: {p} does not exist") from None
    except (OSError, ValueError) as e:
        raise CompareError(f"--compare-to: {p} is not a readable report.json ({e})") from None
    if not isinstance(report, dict) or "endpoint_runs" not in report or "record" not in report:
        raise CompareError(f"--compare-to: {p} is not the report of an endpoint audit (no endpoint_runs)")
    return report


def _mean_ci(xs: list[float]) -> tuple[float | None, float | None, float | None]:
    """(mean, low, high) of a t interval; (mean, None, None) for fewer than two values."""
    if not xs:
        return None, None, None
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None, None
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    h = sps.t.ppf(0.5 + LEVEL / 2, len(xs) - 1) * sd / math.sqrt(len(xs))
    return m, m - h, m + h


def _diff_ci(a: list[float], b: list[float]) -> tuple[float | None, float | None, float | None, float | None]:
    """(mean(b) - mean(a), low, high, one-sided p that b's mean is below a's): Welch's t."""
    if len(a) < 2 or len(b) < 2:
        ma, mb = _mean_ci(a)[0], _mean_ci(b)[0]
        return (mb - ma if ma is not None and mb is not None else None), None, None, None
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    va = sum((x - ma) ** 2 for x in a) / (len(a) - 1) / len(a)
    vb = sum((x - mb) ** 2 for x in b) / (len(b) - 1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return mb - ma, mb - ma, mb - ma, (0.0 if mb < ma else 1.0)
    df = (va + vb) ** 2 / ((va ** 2 / (len(a) - 1)) + (vb ** 2 / (len(b) - 1)))
    h = sps.t.ppf(0.5 + LEVEL / 2, df) * se
    return mb - ma, mb - ma - h, mb - ma + h, float(sps.t.cdf((mb - ma) / se, df))


def _tps(r: dict) -> float | None:
    if r.get("error") or not r.get("latency_s") or not r.get("completion_tokens"):
        return None
    return r["completion_tokens"] / r["latency_s"]


def per_prompt(report: dict) -> dict[int, list[dict]]:
    """Per level: [{"id", "slice", "wave", "log_speedup", "acceptance"}] from a report's raw
    runs; "wave": the index of the wave the prompt was timed in (its own index when the
    report has no waves)."""
    runs = report["endpoint_runs"]
    ref = runs.get("reference") if report["record"]["endpoint"].get("reference") else None  # None: no plain run
    ref_levels = {lv["concurrency"]: {r["id"]: r for r in lv["results"]} for lv in (ref or {}).get("levels", [])}
    out: dict[int, list[dict]] = {}
    for lv in runs["endpoint"]["levels"]:
        rows = []
        refs = ref_levels.get(lv["concurrency"], {})
        wave_of = {i: w for w, idx in enumerate(lv.get("waves") or []) for i in idx}
        for i, r in enumerate(lv["results"]):
            s, p = _tps(r), _tps(refs.get(r["id"], {}))
            info = r.get("server_info") or r.get("counter_spec") or {}  # the response's own, else its /metrics
            acc = info["accepted"] / info["drafted"] if info.get("drafted") else None
            rows.append({"id": r["id"], "slice": r["slice"], "acceptance": acc, "wave": wave_of.get(i, f"p{i}"),
                         "log_speedup": math.log(s / p) if s and p else None})
        out[lv["concurrency"]] = rows
    return out


def _units(rows: list[dict], key: str) -> list[float]:
    """The observations of `key`: per prompt for acceptance; for the log speedup, the mean
    of each wave's prompts (a wave's ratios share its timing, see the module docstring)."""
    if key != "log_speedup":
        return [r[key] for r in rows if r[key] is not None]
    waves: dict = {}
    for r in rows:
        if r[key] is not None:
            waves.setdefault(r.get("wave", r["id"]), []).append(r[key])
    return [sum(v) / len(v) for v in waves.values()]


def _summary(rows: list[dict], key: str) -> dict:
    xs = _units(rows, key)
    m, lo, hi = _mean_ci(xs)
    if key == "log_speedup":
        return {"n": len(xs), "value": math.exp(m) if m is not None else None,
                "low": math.exp(lo) if lo is not None else None, "high": math.exp(hi) if hi is not None else None}
    return {"n": len(xs), "value": m, "low": lo, "high": hi}


def _moved(old: list[dict], new: list[dict], key: str) -> dict:
    a, b = _units(old, key), _units(new, key)
    d, lo, hi, p_drop = _diff_ci(a, b)
    return {"old": _summary(old, key), "new": _summary(new, key), "change": d, "low": lo, "high": hi,
            "p_drop": p_drop, "scale": "log ratio" if key == "log_speedup" else "difference"}


def _result(report: dict, check: str) -> dict | None:
    """A report's result of the named check (None: it has none)."""
    return next((c for c in report["checks"] if c["name"] == check), None)


def _equivalence_levels(report: dict, check: str) -> dict[int, dict]:
    eq = _result(report, check)
    if eq is None:
        return {}
    return {r["batch"]: r for r in eq["details"]["per_batch"]}


def compare_reports(old: dict, new: dict, equivalence: str, alpha: float = ALPHA) -> dict:
    """The comparison of two endpoint audits: triggers, figures per slice and level, the gate.
    equivalence: the name of the check whose per-level divergences the gate compares."""
    ot = {t.get("key", t["trigger"]): t for t in old["record"]["retest_triggers"]}
    nt = {t.get("key", t["trigger"]): t for t in new["record"]["retest_triggers"]}
    triggers = [{"key": k, "trigger": (nt.get(k) or ot.get(k))["trigger"],
                 "old": ot[k]["audited"] if k in ot else "(not recorded)",
                 "new": nt[k]["audited"] if k in nt else "(not recorded)"}
                for k in list(dict.fromkeys([*ot, *nt]))
                if (ot.get(k) or {}).get("audited") != (nt.get(k) or {}).get("audited")]
    po, pn = per_prompt(old), per_prompt(new)
    levels = []
    for c in sorted(set(po) & set(pn)):
        levels.append({"batch": c, "speedup": _moved(po[c], pn[c], "log_speedup"),
                       "acceptance": _moved(po[c], pn[c], "acceptance")})
    slices = []
    c1 = min(set(po) & set(pn), default=None)
    if c1 is not None:
        for name in dict.fromkeys(r["slice"] for r in pn[c1]):
            o = [r for r in po[c1] if r["slice"] == name]
            n = [r for r in pn[c1] if r["slice"] == name]
            if o and n:
                slices.append({"slice": name, "batch": c1, "speedup": _moved(o, n, "log_speedup"),
                               "acceptance": _moved(o, n, "acceptance")})
    failures = []
    rows = levels + slices
    for row in rows:  # one-sided Welch tests, Bonferroni over the rows: alpha in all
        s = row["speedup"]
        if s["p_drop"] is not None and s["p_drop"] < alpha / len(rows):
            where = f"slice {row['slice']}" if "slice" in row else f"c={row['batch']}"
            failures.append(f"{where}: speedup fell {s['old']['value']:.2f}x -> {s['new']['value']:.2f}x "
                            f"(log speedup {s['change']:+.3f}, {LEVEL:.0%} interval {s['low']:+.3f}..{s['high']:+.3f}; "
                            f"one-sided p = {s['p_drop']:.2g} < {alpha / len(rows):.2g})")
    eo, en = _equivalence_levels(old, equivalence), _equivalence_levels(new, equivalence)
    old_eq = (_result(old, equivalence) or {}).get("passed")
    new_eq = (_result(new, equivalence) or {}).get("passed")
    if old_eq and new_eq is False:
        failures.append("equivalence passed before and fails now")
    eq_levels = []
    for c in sorted(set(eo) & set(en)):
        do = eo[c]["prompts"] - eo[c]["identical"]
        dn = en[c]["prompts"] - en[c]["identical"]
        p = fisher_greater(dn, en[c]["prompts"], do, eo[c]["prompts"])
        eq_levels.append({"batch": c, "old_divergences": do, "new_divergences": dn, "old_prompts": eo[c]["prompts"],
                          "new_prompts": en[c]["prompts"], "fisher_p": p})
        if p < alpha:
            failures.append(f"c={c}: divergences rose {do}/{eo[c]['prompts']} -> {dn}/{en[c]['prompts']} "
                            f"(Fisher p = {p:.2g} < {alpha:g})")
    return {"old_started_at": old["record"].get("started_at"), "new_started_at": new["record"].get("started_at"),
            "old_verdict": old.get("verdict"), "triggers_changed": triggers, "levels": levels, "slices": slices,
            "equivalence": eq_levels, "failures": failures, "passed": not failures, "alpha": alpha,
            "interval": LEVEL}


def _fmt(s: dict, speed: bool) -> str:
    if s["value"] is None:
        return "-"
    f = (lambda x: f"{x:.2f}x") if speed else (lambda x: f"{x:.1%}")
    return f(s["value"]) + (f" [{f(s['low'])}, {f(s['high'])}]" if s["low"] is not None else "") + f" n={s['n']}"


def _fmt_change(m: dict) -> str:
    if m["change"] is None:
        return "-"
    return f"{m['change']:+.3f}" + (f" [{m['low']:+.3f}, {m['high']:+.3f}]" if m["low"] is not None else "")


def gate_check(a, equivalence: str) -> CheckResult | None:
    """--compare-to: the re-test gate, on the endpoint audit's report as the checks before it
    left it (endpoint.state.EndpointAudit); not applicable without an earlier report."""
    if a.previous is None:
        return None
    return comparison_check(compare_reports(a.previous, a.report(0.0), equivalence))


def comparison_check(cmp: dict) -> CheckResult:
    """The comparison as a check of the new report (fails the audit when the gate fails)."""
    changed = ", ".join(t["key"] for t in cmp["triggers_changed"]) or "none"
    summary = (f"against the audit of {cmp['old_started_at']}: triggers changed: {changed}; "
               + ("; ".join(cmp["failures"]) if cmp["failures"] else "no equivalence or speedup regression"))
    rows = []
    for r in cmp["levels"] + cmp["slices"]:
        rows.append([r.get("slice", "all"), r["batch"], _fmt(r["speedup"]["old"], True),
                     _fmt(r["speedup"]["new"], True), _fmt_change(r["speedup"]),
                     _fmt(r["acceptance"]["old"], False), _fmt(r["acceptance"]["new"], False),
                     _fmt_change(r["acceptance"])])
    tables = [("Compared with the earlier audit: re-test triggers that changed", ["trigger", "before", "now"],
               [[t["trigger"], t["old"], t["new"]] for t in cmp["triggers_changed"]] or [["(none)", "-", "-"]]),
              (f"Compared with the earlier audit: speedup and acceptance ({cmp['interval']:.0%} intervals over "
               "prompts; speedup change on the log scale)",
               ["slice", "batch", "speedup before", "speedup now", "change (log)", "acceptance before",
                "acceptance now", "change"], rows),
              ("Compared with the earlier audit: divergences per level",
               ["batch", "before", "now", "Fisher p (rose)"],
               [[e["batch"], f"{e['old_divergences']}/{e['old_prompts']}", f"{e['new_divergences']}/{e['new_prompts']}",
                 f"{e['fisher_p']:.3g}"] for e in cmp["equivalence"]])]
    details = {"levels": cmp["levels"], "slices": cmp["slices"], "tables": tables}
    return CheckResult(cmp["passed"], summary, {k: v for k, v in cmp.items() if k not in details}, details)
