"""The README's headline figures are RESULTS' figures.

Each row of the README's headline table links to the rows of benchmarks/RESULTS.md's summary
table it reports (a link to benchmarks/RESULTS.md#anchor, the anchor of the summary row's
topic). Every figure of the row (ratios, intervals, seconds, p-values, "N of M" counts,
percentages) must occur in those summary rows, so a figure edited on one side only fails here.
The quick audit's time, the speedup floor on the defaults and the fault count must each read
one value wherever the README states them.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
RESULTS = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")

LINK = re.compile(r"\[([^\[\]]*)\]\(([^()\s]*)\)")
FIGURE = re.compile(
    r"""(?<![\w.])(?:
        \[\d+(?:\.\d+)?,\ \d+(?:\.\d+)?\]              # an interval: [1.11, 1.27]
      | \d+(?:\.\d+)?x(?:-\d+(?:\.\d+)?x)?(?!\w)       # a ratio or a range: 1.19x, 0.96x-0.99x
      | \d[\d,]*(?:\.\d+)?\ s(?!\w)                    # seconds: 229 s, 1,145 s
      | p\ =\ \d+(?:\.\d+)?(?:e-?\d+)?                 # a p-value: p = 0.75
      | \d[\d,]*\ of\ \d[\d,]*(?![\d,]*\d)             # a count: 5 of 5, 26 of 26
      | \d+(?:\.\d+)?%                                 # a percentage
    )""",
    re.X,
)


def plain(text: str) -> str:
    """Markdown emphasis, code marks and link targets dropped, link texts kept."""
    return LINK.sub(r"\1", text).replace("**", "").replace("`", "")


def table_after(doc: str, heading: str) -> list[list[str]]:
    """The rows (cells, header and rule skipped) of the first table under `heading`."""
    lines = doc[doc.index(heading):].splitlines()[1:]
    rows = []
    for line in lines:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = re.sub(r"[^\w\- ]", "", plain(heading).strip().lower())
    return s.replace(" ", "-")


HEADLINE = table_after(README, "## Headline figures")
SUMMARY = {LINK.search(row[0]).group(2).lstrip("#"): plain(row[1])
           for row in table_after(RESULTS, "## Summary")}
RESULTS_ANCHORS = {slug(h) for h in re.findall(r"^#{2,6} (.+)$", RESULTS, re.M)}


def anchors(row: list[str]) -> list[str]:
    return [url.split("#", 1)[1] for _, url in LINK.findall(" ".join(row))
            if url.startswith("benchmarks/RESULTS.md#")]


def occurs(figure: str, text: str) -> bool:
    return re.search(r"(?<![\w.])" + re.escape(figure) + r"(?![\w]|,\d)", text) is not None


def test_tables_parsed():
    assert len(HEADLINE) >= 8 and len(SUMMARY) >= 8


def test_summary_rows_link_to_results_sections():
    missing = [a for a in SUMMARY if a not in RESULTS_ANCHORS]
    assert not missing, f"RESULTS summary links to no heading: {missing}"


@pytest.mark.parametrize("row", HEADLINE, ids=lambda r: plain(r[0])[:40])
def test_headline_row_figures_are_in_its_results_summary_rows(row):
    keys = anchors(row)
    assert keys, f"README headline row links to no RESULTS summary row: {row[0]}"
    unknown = [k for k in keys if k not in SUMMARY]
    assert not unknown, f"README row {plain(row[0])!r} links to {unknown}, not a RESULTS summary row"
    source = " ".join(SUMMARY[k] for k in keys)
    figures = FIGURE.findall(plain(row[1]))
    assert figures, f"no figure found in README row {plain(row[0])!r}"
    missing = [f for f in figures if not occurs(f, source)]
    assert not missing, (f"README row {plain(row[0])!r}: {missing} not in the RESULTS summary "
                         f"row(s) {keys}")


def test_figure_pattern_and_pairing_catch_a_one_sided_edit():
    row = next(r for r in HEADLINE if "audit on the defaults" in r[0])
    keys = anchors(row)
    source = " ".join(SUMMARY[k] for k in keys)
    edited = plain(row[1]).replace("229 s", "199 s").replace("1.01x", "0.96x")
    assert {"199 s", "0.96x"} <= set(FIGURE.findall(edited))
    assert not occurs("199 s", source)
    assert occurs("229 s", source)
    assert not occurs("1.1x", "11.1x") and not occurs("5 of 5", "15 of 50")


# --- one value for one thing ---------------------------------------------------------------

DURATION = re.compile(r"(\d[\d,]*(?:\.\d+)?)\s*(s|seconds|min|minutes)(?!\w)")


def quick_audit_durations() -> list[tuple[float, str]]:
    """(value, unit) of every time the README gives the quick audit on the defaults."""
    found = []
    defaults = [r for r in HEADLINE if "audit on the defaults" in r[0]]
    assert len(defaults) == 1, "README headline table: one row for the audit on the defaults"
    m = DURATION.search(plain(defaults[0][1]))
    assert m, "the audit-on-the-defaults row gives no time"
    found.append(m.groups())
    text = plain(README)
    for m in re.finditer(r"quick audit\b", text, re.I):
        clause = re.split(r"(?<=[a-z)])\.\s|;|\||,\s|\n\n", text[m.end():], maxsplit=1)[0]
        found.extend(DURATION.findall(clause))
    return [(float(v.replace(",", "")), u) for v, u in found]


def test_quick_audit_time_is_one_figure():
    durations = quick_audit_durations()
    seconds = {v for v, u in durations if u in ("s", "seconds")}
    assert len(seconds) == 1, f"the README gives the quick audit {sorted(seconds)} s"
    (s,) = seconds
    for v, u in durations:
        if u.startswith("min"):
            decimals = len(str(v).split(".")[1].rstrip("0")) if v != int(v) else 0
            assert round(s / 60, decimals) == v, (
                f"README: the quick audit takes {v:g} minutes, and elsewhere {s:g} s")
    heads = {float(h.replace(",", "")) for h in re.findall(r"^### Quick audit: ([\d,]+) s", RESULTS, re.M)}
    assert heads == {s}, f"RESULTS' quick-audit heading says {heads} s, the README {s:g} s"


def test_speedup_floor_on_the_defaults_is_one_figure_per_budget():
    text = plain(README)
    assert not re.search(r"speedup floor:?\s+\d", text), (
        "README: a speedup floor figure without its budget (quick or full)")
    for budget in ("quick", "full"):
        values = set(re.findall(rf"speedup floor at the {budget} budget\W+(\d+(?:\.\d+)?x)", text))
        assert len(values) <= 1, f"README: the floor at the {budget} budget reads {values}"
    quick = set(re.findall(r"speedup floor at the quick budget\W+(\d+(?:\.\d+)?x)", text))
    assert quick, "README: the audit on the defaults gives no speedup floor at the quick budget"
    (value,) = quick
    results = set(re.findall(r"speedup floor at the quick budget\W+(\d+(?:\.\d+)?x)", plain(RESULTS)))
    assert results == {value}, f"RESULTS' summary gives the quick-budget floor as {results}"
    report = (ROOT / "docs" / "sample-report.md").read_text(encoding="utf-8")
    sample = re.search(r"\| Speedup floor \| (\d+(?:\.\d+)?x)", report)
    assert sample and sample.group(1) == value, (
        "README's quick-budget floor is not the one in docs/sample-report.md")


def test_fault_count_is_the_catalogue():
    from verispec.audit.faults import FAULTS

    counts = [(int(a), int(b)) for a, b in
              re.findall(r"(\d+) of (\d+) faults", plain(README) + plain(RESULTS))]
    assert counts, "no 'N of N faults' in README or RESULTS"
    assert set(counts) == {(len(FAULTS), len(FAULTS))}, (
        f"README/RESULTS fault counts {sorted(set(counts))}; the catalogue holds {len(FAULTS)}: "
        "measure the new faults, then state the count")
    audit_doc = (ROOT / "docs" / "audit.md").read_text(encoding="utf-8")
    stated = {int(n) for n in re.findall(r"`audit/faults/` has (\d+) faults", audit_doc)}
    assert stated == {len(FAULTS)}, f"docs/audit.md says the catalogue has {stated} faults"


def test_ci_runs_the_readmes_test_command():
    commands = re.findall(r"^bash scripts/install\.sh.*$", README, re.M)
    main_cmd = next(c for c in commands if "verispec audit" in c)
    test_cmd = next(c for c in commands if "pytest" in c)
    assert "--test" not in main_cmd and "--test" in test_cmd
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert test_cmd in ci.splitlines(), ".ci/run does not run the README's test command"
