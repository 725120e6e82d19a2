"""The report's plots, one per check that has one (registry.py attaches them): each draws
a completed result, or empty axes where its check did not complete. matplotlib is passed
in by the report (Agg backend)."""

from __future__ import annotations

from .checks import CheckResult


def equivalence(plt, res: CheckResult | None):
    """Exact match per batch size, with the threshold or the null run's level."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    if res is not None:
        rows = res.details["per_batch"]
        xs = [f"{r['batch']}\n{r['policy']}" if "policy" in r else str(r["batch"]) for r in rows]
        ys = [r["exact_match_rate"] for r in rows]
        colors = ["#2e7d32" if r["passed"] else "#c62828" for r in rows]
        ax.bar(xs, ys, color=colors)
        fig_eq = res.figures
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
    return fig


def _pit_panel(ax, name: str, t: dict | None) -> None:
    """One PIT family's histogram against its uniform expectation (+-2 sd)."""
    if t is None or not t.get("histogram"):
        ax.text(0.5, 0.5, f"{name}: not tested", ha="center", va="center", fontsize=9)
        ax.set_axis_off()
        return
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


def _calibration_panel(ax, tests: dict) -> None:
    """The calibration family: kept rate against exact acceptance (min(1, p/q)), the deployed
    drafter's drafts and the probe's."""
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


def pit(plt, res: CheckResult | None):
    """The PIT histograms, one panel per test family, and the calibration curve."""
    tests = {t["test"]: t for t in (res.figures.get("tests") or [])} if res is not None else {}
    if tests:  # one panel per test family: three PIT histograms and the calibration curve
        fig, axes = plt.subplots(2, 2, figsize=(7.5, 5.2))
        # the engine's families (recovered, bonus), or from outside the drafted positions' own PIT
        panels = ("pit", "pit-drafted", "recovered") if "pit-drafted" in tests else ("pit", "recovered", "bonus")
        for ax, name in zip(axes.flat[:3], panels):
            _pit_panel(ax, name, tests.get(name))
        _calibration_panel(axes.flat[3], tests)  # the deployed drafter's drafts and the probe's
        fig.tight_layout()
    else:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        if res is not None and res.figures.get("histogram"):  # an inconclusive check has no histogram
            f = res.figures
            hist = f["histogram"]
            width = 1 / len(hist)
            ax.bar([i * width for i in range(len(hist))], hist, width=width, align="edge",
                   color="#1565c0" if res.passed else "#c62828", edgecolor="white")
            expect = f["n"] / len(hist)
            sd = (f["n"] * width * (1 - width)) ** 0.5
            ax.axhline(expect, color="k", lw=1)
            ax.axhspan(expect - 2 * sd, expect + 2 * sd, color="k", alpha=0.08)
            ax.set_title(f"KS p = {f['p_value']:.3g}, n = {f['n']}", fontsize=9)
        ax.set_xlabel("u = F(x-) + U p(x)")
        ax.set_ylabel("tokens")
    return fig


def _yerr(rows: list[dict]) -> list[list[float]]:
    """Asymmetric error bars of the rows' speedup intervals (none for a row without one)."""
    lo = [r["speedup"] - r["speedup_ci"][0] if r.get("speedup_ci") else 0.0 for r in rows]
    hi = [r["speedup_ci"][1] - r["speedup"] if r.get("speedup_ci") else 0.0 for r in rows]
    return [lo, hi]


def slices(plt, res: CheckResult | None):
    """Tokens per target pass per slice (bars) and, on the same scale, the speedup with its
    interval (grey where noise or not resolved) and what acceptance predicts: a speedup
    above its bar is not speculation's doing."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    if res is not None:
        rows = res.details["slices"]
        names = [r["slice"] for r in rows]
        ax.bar(names, [r["mean_accepted_length"] or 0 for r in rows], color="#ce93d8", label="tokens per target pass")
        timed = [(i, r) for i, r in enumerate(rows) if r.get("speedup") is not None]
        for j, (i, r) in enumerate(timed):
            ax.errorbar([i], [r["speedup"]], yerr=_yerr([r]), fmt="o", capsize=3, ms=4,
                        color="#9e9e9e" if r.get("verdict") in ("noise", "unresolved") else "#4a148c",
                        label="speedup, 95% interval" if j == 0 else None)
        pred = [(i, r["predicted"]) for i, r in enumerate(rows) if r.get("predicted") is not None]
        if pred:
            ax.plot([i for i, _ in pred], [p for _, p in pred], "x", color="#e65100", label="predicted speedup")
        ax.axhline(1.0, color="k", ls="--", lw=1)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        ax.legend(fontsize=7)
    ax.set_ylabel("tokens per target pass; speedup")
    fig.tight_layout()
    return fig


def load(plt, res: CheckResult | None):
    """Speedup against batch size, short and long context, with its interval."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    if res is not None:
        for name, style in (("short", "o-"), ("long", "s--")):
            pts = [p for p in res.details["points"].get(name) or [] if p.get("speedup") is not None]
            if pts:
                ctx_tokens = round(sum(p["prompt_tokens"] for p in pts) / len(pts))
                ax.errorbar([p["batch"] for p in pts], [p["speedup"] for p in pts], yerr=_yerr(pts), fmt=style,
                            capsize=3, label=f"{name} context (~{ctx_tokens} tokens)")
        ax.axhline(1.0, color="k", lw=1)
        ax.set_xscale("log", base=2)
        batches = sorted({p["batch"] for pts in res.details["points"].values() for p in pts})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.legend(fontsize=8)
    ax.set_xlabel("batch size (rows decoded together)")
    ax.set_ylabel("speedup (spec / plain), 95% interval")
    fig.tight_layout()
    return fig
