"""The built-in checks, in report order: how each runs in the offline audit (engine mode,
runner.EngineAudit) and from outside (endpoint mode, endpoint.state.EndpointAudit), and how
the report shows its result. checks.py says what a check is; report.py renders whatever
is registered here.

lossy-rule, equivalence, distribution, acceptance-calibration, counter-fidelity,
sampling-params, logprob-fidelity, seeded, stopping, drafter-consistency, corruption, slices,
load, record: acceptance-calibration, counter-fidelity, sampling-params and logprob-fidelity
read what only a server shows from outside (its counters, its logprobs, its sampling
parameters), so they run from outside only; drafter-consistency needs the engine's own
drafter, so it runs offline only.
"""

from __future__ import annotations

from . import (acceptance, churn, consistency, corruption, counter_fidelity, distribution, equivalence, floor, load,
               logprob_fidelity, lossy_rule, plots, record, sampling_params, seeded, speed, stopping)
from .checks import ENDPOINT, ENGINE, Check, CheckResult, Section, register
from .endpoint import compare
from .fmt import f as _f, pct as _pct, temps as _temps


# -- row churn of the runs under audit (audit/churn.py) ----------------------------------------
def _with_churn(result: CheckResult, runs: list[dict]) -> CheckResult:
    """An offline check's result with the row churn of the runs it compared: per run in
    details["churn"], and in the summary and figures the runs that reached no row reuse or
    no gap (a fault in row bookkeeping could not have shown there)."""
    missing = churn.shortfalls(runs)
    result.details = {**(result.details or {}), "churn": runs}
    result.figures["churn_not_reached"] = missing
    if missing:
        result.summary += "; row churn not reached at " + "; ".join(missing)
    return result


def _churn_section(title: str, c: CheckResult) -> list[Section]:
    runs = (c.details or {}).get("churn")
    if not runs:  # endpoint mode: the server's rows are its own
        return []
    return [(title, ["batch", "policy", "requests", "steps", "rows reused", "of them after sitting free",
                     "gapped steps", "mixed-length steps", "not reached"],
             [[r["batch"], r.get("policy") or "-", r["requests"], r["steps"], r["reused_rows"],
               r["reused_after_idle"], r["gapped_steps"], r["mixed_length_steps"], churn.note(r) or "-"]
              for r in runs])]


def _equivalence_engine(a) -> CheckResult:
    runs = a.runs()
    return _with_churn(equivalence.equivalence_check(a.ctx, runs), runs.churn)


def _seeded_engine(a) -> CheckResult:
    result = seeded.seeded_check(a.ctx)
    per = (result.details or {}).get("per_config")
    return _with_churn(result, [r["churn"] for r in per]) if per else result


# -- equivalence -----------------------------------------------------------------------------
def _equivalence_headline(c: CheckResult) -> list[tuple[str, str]]:
    return [("Exact match (greedy)", ", ".join(f"b{b} {_pct(v)}" for b, v in c.figures["exact_match_by_batch"].items())
             + f"; {c.figures['divergences']} clear divergences, {c.figures['near_ties']} near-ties")]


def _equivalence_sections(c: CheckResult) -> list[Section]:
    out = [("Equivalence per batch size", ["batch", "policy", "rows together", "prompts", "exact match",
                                           "identical", "near-tie", "divergence", "drafts verified", "passed"],
            [[r["batch"], r.get("policy", "-"), r["rows_decoded_together"], r["prompts"],
              _pct(r["exact_match_rate"]), r["identical"], r["near-tie"], r["divergence"],
              r.get("drafted", "-"), r["passed"]] for r in c.details["per_batch"]])]
    out += _churn_section("Row churn of the greedy speculative runs (batch 1: one prompt at a time)", c)
    diff = [r for r in c.details["prompts"] if r["verdict"] != "identical"]
    if diff:
        out.append(("Equivalence: prompts that differ", ["batch", "prompt", "slice", "first divergence",
                                                         "top-2 margin", "verdict"],
                    [[r["batch"], r["id"], r["slice"], r["first_divergence"], _f(r["margin"], ".3g"),
                      r["verdict"]] for r in diff[:40]]))
    return out


# -- distribution ----------------------------------------------------------------------------
def _settings_txt(f: dict) -> str:
    """The audited sampling settings by label ("plain, filtered"), or the temperatures of a
    report written before settings had labels."""
    return ", ".join(s["label"] for s in f["settings"]) if f.get("settings") else f"T={_temps(f)}"


def _distribution_headline(c: CheckResult) -> list[tuple[str, str]]:
    f = c.figures
    return [("Distribution (PIT KS)", f"p = {_f(f['p_value'], '.3g')}, D = {_f(f['ks_statistic'], '.4f')}, "
                                      f"n = {f['n']} tokens, settings {_settings_txt(f)}")]


def _distribution_sections(c: CheckResult) -> list[Section]:
    f = c.figures
    out = [("Distribution (randomised PIT, KS test)", ["settings", "tokens", "KS D", "p-value", "alpha",
                                                       "acceptance", "tokens/pass", "passed"],
            [[_settings_txt(f), f["n"], _f(f["ks_statistic"], ".4f"), _f(f["p_value"], ".3g"), f["alpha"],
              _pct(f["acceptance_rate"]), _f(f["mean_accepted_length"]), c.passed]])]
    if f.get("settings"):
        # what each setting sampled and verified: a setting with a thin share carries little
        # power of its own, which the note says
        out.append(("Distribution: sampling settings (requests take them in turn; the probe's tokens "
                    "and drafts counted apart)",
                    ["setting", "values", "requests", "tokens", "verified drafts", "acceptance", "probe tokens",
                     "probe drafts", "outside support", "own tests failed", "note"],
                    [[s["label"], s["values"], s["requests"], s["tokens"], s["verified_drafts"],
                      _pct(s["acceptance_rate"]), s["probe_tokens"], s["probe_drafts"], s["outside_support"],
                      ", ".join(s["failed"]) or "-",
                      "thin: its own tests carry little power" if s["thin"] else "-"] for s in f["settings"]]))
    if f.get("tests"):
        pr = f.get("probe")
        probe_txt = (f"; calibration probe: {pr['verified_drafts']} drafts of the target drafting for itself "
                     f"from its own nucleus {'/'.join(f'{m:g}' for m in pr['masses'])}, k={pr['k']}, "
                     f"acceptance {_pct(pr['acceptance_rate'])}") if pr else ""
        out.append((f"Distribution: one test per mechanism ({f['correction']}, alpha {f['alpha']:g} in all; "
                    f"{f['verified_drafts']} verified drafts, at least {f['min_verified_drafts']} needed{probe_txt})",
                    ["test", "kind", "n", "statistic", "p-value", "alpha", "passed", "samples from (n; p alone)"],
                    [[t["test"], t["kind"], t["n"], _f(t["statistic"], ".3g"), _f(t["p_value"], ".3g"),
                      _f(t["alpha"], ".2g"), t["passed"], _sources_txt(t)] for t in f["tests"]]))
    if f.get("code_paths"):
        out.append(("Distribution: the code paths that produced the samples",
                    ["source", "code path", "power vs relaxed c = " + ", ".join(f.get("power_vs_relaxed", {})
                                                                            .get("deployed", {}))],
                    [[p["name"], p["path"], ", ".join(f"{v:.0%}" for v in f.get("power_vs_relaxed", {})
                                                      .get(src, {}).values()) or "-"]
                     for src, p in f["code_paths"].items()]))
    return out


def _sources_txt(t: dict) -> str:
    """A test's samples by source, with the p of the same test on each source alone (a
    source whose samples fail alone is marked)."""
    parts = []
    for src, b in t.get("by_source", {}).items():
        mark = " FAILS ALONE" if b["fails_alone"] and not t["passed"] else ""
        parts.append(f"{'deployed drafter' if src == 'deployed' else 'probe'} {b['n']}; {_f(b['p_value'], '.2g')}{mark}")
    return " / ".join(parts) or "-"


# -- seeded ----------------------------------------------------------------------------------
def _seeded_headline(c: CheckResult) -> list[tuple[str, str]]:
    f = c.figures
    if not f.get("applicable"):
        return []
    return [("Same seed, same bytes", f"{f['prompts']} seeded prompts, settings {_settings_txt(f)}: {f['divergences']} "
                                      f"divergences, {f['near_ties']} near-ties, {f['drafts_verified']} drafts verified")]


def _seeded_sections(c: CheckResult) -> list[Section]:
    if not c.figures.get("applicable"):
        return []
    return [("Seeded speculative vs seeded plain output", ["batch", "policy", "prompts", "identical", "near-tie",
                                                           "divergence", "drafts verified", "passed"],
             [[r["batch"], r["policy"], r["prompts"], r["identical"], r["near-tie"], r["divergence"],
               r["drafted"], r["passed"]] for r in c.details["per_config"]])] + \
        _churn_section("Row churn of the seeded speculative runs", c)


# -- stopping --------------------------------------------------------------------------------
def _stopping_drafts(c: CheckResult) -> int | None:
    per = (c.details or {}).get("per_config")
    return sum(r.get("drafted", 0) for r in per) if per else None


# -- drafter consistency ---------------------------------------------------------------------
def _consistency_sections(c: CheckResult) -> list[Section]:
    if not c.figures.get("applicable"):
        return []
    out = [("Drafter consistency", ["batch", "policy", "positions compared", "near-ties", "mismatches"],
            [[r["batch"], r.get("policy", "-"), r["positions_compared"], r["near_ties"], r["mismatches"]]
             for r in c.details["per_batch"]])]
    if c.details["mismatches"]:
        out.append(("Drafter consistency: first mismatches", ["batch", "prompt", "step", "position", "drafted",
                                                              "expected"],
                    [[m["batch"], m["id"], m["step"], m["position"], m["drafted"], m.get("expected", "-")]
                     for m in c.details["mismatches"][:20]]))
    return out


# -- corruption ------------------------------------------------------------------------------
def _corruption_sections(c: CheckResult) -> list[Section]:
    out = [("Corruption signatures", ["batch", "outputs", "flagged"],
            [[r["batch"], r["outputs"], r["flagged"]] for r in c.details["per_batch"]])]
    if c.details["flagged"]:
        out.append(("Corruption: flagged outputs", ["batch", "prompt", "signatures", "end of output"],
                    [[r["batch"], r["id"], "; ".join(r["signatures"]), r["text"][-80:]]
                     for r in c.details["flagged"][:20]]))
    return out


# -- slices ----------------------------------------------------------------------------------
def _verdict_txt(v: str | None) -> str:
    """A speedup's verdict as the tables write it (stats.judge_speedup)."""
    return {"unresolved": "not resolved at this budget", None: "-"}.get(v, v)


def _slices_headline(c: CheckResult) -> list[tuple[str, str]]:
    f = c.figures
    rows = c.details["slices"]
    pooled = c.details["pooled"]
    odd = [f"{len(f[k])} {w}" for k, w in (("noise_slices", "noise"), ("unresolved_slices", "not resolved"))
           if f.get(k)]
    return [("Speedup at batch 1 (pooled)", f"{pooled['speedup_text']}, {_f(f['pooled_mean_accepted_length'])} "
                                            f"tokens/target pass; "
                                            + speed.ranking_text(rows, f["best_slice"], f["worst_slice"], speedups=False)
             + (f"; of {len(rows)} slices " + ", ".join(odd) if odd else ""))]


def _slices_sections(c: CheckResult) -> list[Section]:
    rows = c.details["slices"] + [c.details["pooled"]]
    return [(f"Acceptance and speed per slice (batch 1; 95% intervals over {c.figures.get('speed_repeats', 1)} "
             f"timings per prompt; predicted from {c.figures.get('predicted_from', '-')})",
             ["slice", "prompts", "tokens", "tokens/pass", "acceptance", "acceptance per position",
              "plain tok/s", "spec tok/s", "speedup [95% CI]", "predicted", "verdict"],
             [[r["slice"], r["prompts"], r["tokens"], _f(r["mean_accepted_length"]), _pct(r["acceptance_rate"]),
               " ".join(_pct(a) for a in r["acceptance_per_position"]), _f(r["plain_tokens_per_s"], ".1f"),
               _f(r["speculative_tokens_per_s"], ".1f"), r["speedup_text"],
               _f(r["predicted"]) + "x" if r["predicted"] is not None else "acceptance unknown",
               _verdict_txt(r["verdict"])] for r in rows])]


# -- acceptance calibration and counter fidelity (from outside) ------------------------------
def _acceptance_headline(c: CheckResult) -> list[tuple[str, str]]:
    f = c.figures
    if not f.get("applicable"):
        return []
    c95 = f.get("smallest_c_95")
    return [("Acceptance vs p (replayed drafts)",
             f"{f['accepted']} of {f['positions']} accepted, {_f(f['expected_accepted'], '.1f')} expected, "
             f"z = {_f(f['z'], '.2f')}; catches c >= {c95:g} with 95% power" if c95 else
             f"{f['accepted']} of {f['positions']} accepted, {_f(f['expected_accepted'], '.1f')} expected, "
             f"z = {_f(f['z'], '.2f')}; under 95% power at every c tried")]


def _acceptance_sections(c: CheckResult) -> list[Section]:
    f = c.figures
    if not f.get("applicable"):
        return []
    grid = f["power_vs_relaxed"]
    return [(f"Acceptance calibration: {f['drafter']} replayed; weight {f['weight']}; power of the test "
             f"against a relaxed rule min(1, c p/q) at the positions it saw (alpha {f['alpha']:g})",
             ["positions", "not listed", "accepted", "expected", "z", "p-value", "rounds added", "tokens added"]
             + [f"c={k}" for k in grid],
             [[f["positions"], f["unlisted_positions"], f["accepted"], _f(f["expected_accepted"], ".1f"),
               _f(f["z"], ".2f"), _f(f["p_value"], ".3g"), f["rounds_added"], f["tokens_added"]]
              + [_pct(v) for v in grid.values()]])]


def _counters_sections(c: CheckResult) -> list[Section]:
    rows = (c.details or {}).get("rounds") or []
    if not rows:
        return []
    return [("Counter fidelity: the server's counters per round against its answers (replay: drafts, draft "
             "tokens, accepted shown + at most cut)",
             ["round", "answers", "drafts", "draft tokens", "accepted", "replay", "findings"],
             [[r["round"], r["answers"], _f(r["counters"].get("drafts"), ".0f"),
               _f(r["counters"].get("draft_tokens"), ".0f"), _f(r["counters"].get("accepted_tokens"), ".0f"),
               (f"{r['replay']['drafts']} / {r['replay']['draft_tokens']} / {r['replay']['accepted_shown']} "
                f"+ <= {r['replay']['accepted_cut_at_most']}") if r["replay"] else "-",
               "; ".join(r["failures"]) or "-"] for r in rows])]


# -- sampling parameters under speculation ----------------------------------------------------
def _sampling_params_sections(c: CheckResult) -> list[Section]:
    """One row per setting: what was scored, the tests, the verdict."""
    def p(t):
        return f"{t['p_value']:.3g}" if t else "-"
    rows = [[s["label"], s.get("emitted_tokens", "-"), s.get("scored", "-"), s.get("drafted_positions", "-"),
             s.get("out_of_support", "-"), p(s.get("pit")), p(s.get("pit-drafted")),
             {True: "pass", False: "FAIL", None: "not tested"}[s.get("passed")], s.get("reason") or ""]
            for s in c.figures.get("settings", [])]
    if not rows:
        return []
    return [("Sampling settings: each emitted token against the distribution its setting defines from the raw "
             "logprobs", ["setting", "tokens", "scored", "drafted", "outside support", "KS p", "KS p (drafted)",
                          "verdict", "why"], rows)]


# -- logprob fidelity --------------------------------------------------------------------------
def _logprobs_headline(c: CheckResult) -> list[tuple[str, str]]:
    f = c.figures
    if not f.get("applicable") or "tokens" not in f:
        return []
    t = f["tokens"]
    return [("Logprob fidelity", f"{t['all']['over']} of {t['all']['compared']} emitted tokens beyond "
                                 f"{_f(f['tolerance'], '.3g')} of the reference ({_pct(t['all']['share'])}; drafted "
                                 f"positions {_pct(t['drafted']['share'])}); {f['tokens_without_logprobs']} of "
                                 f"{f['emitted_tokens']} tokens without logprobs")]


def _logprobs_sections(c: CheckResult) -> list[Section]:
    f = c.figures
    if not f.get("applicable") or "tokens" not in f:
        return []
    rows = [[what, part, s[part]["compared"], s[part]["over"], _pct(s[part]["share"])]
            for what, s in (("emitted tokens", f["tokens"]), ("listed alternatives", f["alternatives"]))
            for part in ("all", "drafted", "not_drafted")]
    nq = f["null_quantiles"]
    out = [(f"Logprob fidelity vs {f['reference']} (tolerance {_f(f['tolerance'], '.3g')}: {f['tolerance_rule']}; "
            f"null: {f['null']}, p50 {_f(nq['p50'], '.3g')}, p99 {_f(nq['p99'], '.3g')}, max {_f(nq['max'], '.3g')})",
            ["logprobs", "positions", "compared", "over tolerance", "share"], rows)]
    worst = (c.details or {}).get("largest_differences") or []
    if worst:
        out.append(("Logprob fidelity: largest differences", ["answer", "position", "token", "endpoint", "reference",
                                                              "drafted", "alternative"],
                    [[w["answer"], w["position"], repr(w["token"]) if w["token"] else w["token_id"],
                      _f(w["endpoint_logprob"], ".4g"), _f(w["reference_logprob"], ".4g"), w["drafted"],
                      w["alternative"]] for w in worst]))
    return out


# -- load ------------------------------------------------------------------------------------
def _load_sections(c: CheckResult) -> list[Section]:
    rows = []
    for name, pts in c.details["points"].items():
        for p in pts:
            rows.append([name, p["prompt_tokens"], p["batch"], _f(p["plain_tokens_per_s"], ".1f"),
                         _f(p["speculative_tokens_per_s"], ".1f"), _f(p["plain_ms_per_token"], ".0f"),
                         _f(p["speculative_ms_per_token"], ".0f"), _f(p["mean_accepted_length"]),
                         p["speedup_text"], _f(p["predicted"]) + "x" if p["predicted"] is not None else "-",
                         _verdict_txt(p["verdict"])])
    return [(f"Load sweep (speedup: {c.figures.get('pairs', 'paired timings')}; predicted from "
             f"{c.figures.get('predicted_from', '-')})",
             ["context", "prompt tokens", "batch", "plain tok/s", "spec tok/s", "plain ms/token",
              "spec ms/token", "tokens/pass", "speedup [95% CI]", "predicted", "verdict"], rows)]


LOSSY_RULE = register(Check("lossy-rule", engine=lambda a: lossy_rule.lossy_rule_check(a.ctx.config),
                            endpoint=lossy_rule.endpoint_lossy_rule_check, always=True))
EQUIVALENCE = register(Check("equivalence", engine=_equivalence_engine,
                             endpoint=equivalence.endpoint_equivalence_check, greedy=(ENGINE, ENDPOINT), headline=_equivalence_headline,
                             sections=_equivalence_sections, drafts_verified=lambda c: c.figures.get("drafts_verified"),
                             plot=("equivalence", "Exact match vs the plain reference, per batch size", plots.equivalence)))
DISTRIBUTION = register(Check("distribution", engine=lambda a: distribution.distribution_check(a.ctx),
                              endpoint=distribution.endpoint_distribution_check, samples=True, headline=_distribution_headline,
                              sections=_distribution_sections, drafts_verified=lambda c: c.figures.get("verified_drafts"),
                              plot=("pit", "Randomised PIT histogram (uniform under an exact sampler)", plots.pit)))
ACCEPTANCE = register(Check("acceptance-calibration", endpoint=acceptance.endpoint_acceptance_check, samples=True,
                            headline=_acceptance_headline, sections=_acceptance_sections,
                            drafts_verified=lambda c: c.figures.get("positions")))
COUNTERS = register(Check("counter-fidelity", endpoint=counter_fidelity.endpoint_counters_check, samples=True,
                          sections=_counters_sections))
SAMPLING_PARAMS = register(Check("sampling-params", endpoint=sampling_params.endpoint_sampling_params_check,
                                 samples=True, sections=_sampling_params_sections))
LOGPROBS = register(Check("logprob-fidelity", endpoint=logprob_fidelity.endpoint_logprobs_check, samples=True,
                          headline=_logprobs_headline, sections=_logprobs_sections))
SEEDED = register(Check("seeded", engine=_seeded_engine, endpoint=seeded.endpoint_seeded_check, headline=_seeded_headline,
                        sections=_seeded_sections, drafts_verified=lambda c: c.figures.get("drafts_verified")))
STOPPING = register(Check("stopping", engine=lambda a: stopping.stopping_check(a.ctx, a.runs()),
                          endpoint=stopping.endpoint_stopping_check, greedy=(ENGINE,),
                          drafts_verified=_stopping_drafts))
DRAFTER_CONSISTENCY = register(Check("drafter-consistency", engine=lambda a: consistency.drafter_consistency_check(a.ctx, a.runs()),
                                     greedy=(ENGINE,), sections=_consistency_sections,
                                     drafts_verified=lambda c: c.figures.get("positions_compared")))
CORRUPTION = register(Check("corruption", engine=lambda a: corruption.corruption_check(a.ctx, a.runs()),
                            endpoint=corruption.endpoint_corruption_check, greedy=(ENGINE, ENDPOINT), sections=_corruption_sections))
SLICES = register(Check("slices", engine=lambda a: speed.slices_check(a.ctx, a.runs()), endpoint=speed.endpoint_slices_check,
                        greedy=(ENGINE, ENDPOINT), headline=_slices_headline, sections=_slices_sections,
                        plot=("slices", "Per slice: tokens per target pass (bars), the speedup with its 95% interval "
                               "(grey: noise or not resolved) and what acceptance predicts", plots.slices)))
LOAD = register(Check("load", engine=lambda a: load.load_check(a.ctx), endpoint=load.endpoint_load_check, greedy=(ENDPOINT,),
                      headline=lambda c: [("Load crossover", c.summary)], sections=_load_sections,
                      plot=("load", "Speedup of speculative over plain decoding vs load, with 95% intervals", plots.load)))
RECORD = register(Check("record", engine=lambda a: record.record_check(a.record()), endpoint=record.endpoint_record_check,
                        always=True, closes=True))
SPEEDUP_FLOOR = register(Check("speedup-floor", engine=lambda a: floor.engine_floor_check(a.ctx, a.ctx.config.min_speedup),
                               endpoint=lambda a: floor.endpoint_floor_check(a, a.min_speedup), headline=floor.headline,
                               sections=floor.sections,
                               plot=("floor", "Speedup per prompt: the suite, the search's edits, and the worst confirmed",
                                     floor.plot)), before=LOAD)
GATE = register(Check("compare", endpoint=lambda a: compare.gate_check(a, EQUIVALENCE.name), always=True,
                      closes=True))
