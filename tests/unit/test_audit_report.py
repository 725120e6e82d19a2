"""Report files from a tiny audit: report.json (verdict, checks with name/passed/figures),
report.md, and a self-contained report.html with the four plots as embedded PNGs."""

import base64
import json
import re

import pytest

from tests.audit_tiny import one_thread, tiny_audit, tiny_models
from verispec.audit.report import plot_names, render_html, render_markdown, write_reports

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report():
    with one_thread():
        return tiny_audit(tiny_models()).to_dict()


def test_json_document(report, tmp_path):
    paths = write_reports(report, tmp_path)
    assert {p.name for p in paths.values()} == {"report.json", "report.md", "report.html"}
    doc = json.loads(paths["json"].read_text())
    assert doc["verdict"] in ("pass", "fail") and doc["failed_checks"] == []
    for c in doc["checks"]:
        assert {"name", "passed", "figures", "details", "summary", "elapsed_s"} <= set(c)
        assert isinstance(c["passed"], bool)
    rec = doc["record"]
    for key in ("target", "drafter", "rule", "engine", "seed", "packages", "machine", "retest_triggers"):
        assert key in rec
    assert {"torch", "transformers", "numpy", "verispec"} <= set(rec["packages"])
    assert all(t["trigger"] for t in rec["retest_triggers"])


def test_markdown_has_headline_and_a_table_per_check(report):
    md = render_markdown(report)
    assert md.startswith("# verispec audit: PASS")
    for title in ("Equivalence per batch size", "Distribution", "Drafter consistency", "Corruption signatures",
                  "Acceptance and speed per slice", "Load sweep", "Re-test triggers"):
        assert f"## {title}" in md, title


def test_html_is_self_contained_with_every_plot(report):
    page = render_html(report)
    imgs = re.findall(r"<img id='plot-(\w+)'[^>]*src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert [name for name, _ in imgs] == plot_names()
    for _, b64 in imgs:
        png = base64.b64decode(b64)
        assert png.startswith(PNG_MAGIC) and len(png) > 5000
    assert "http://" not in page and "https://" not in page  # nothing fetched from elsewhere


def test_failed_report_names_the_failing_check(report):
    failed = json.loads(json.dumps(report))
    failed["checks"][1]["passed"] = False
    failed["verdict"], failed["failed_checks"] = "fail", [failed["checks"][1]["name"]]
    assert "FAIL" in render_markdown(failed).splitlines()[0]
    assert "verdict fail" in render_html(failed)


def test_a_check_that_raised_still_renders(report, tmp_path):
    """A crash in the engine under audit fails its check; the report still renders."""
    broken = json.loads(json.dumps(report))
    dist = next(c for c in broken["checks"] if c["name"] == "distribution")
    dist.update(passed=False, summary="raised IndexError: index 107 is out of bounds",
                figures={"error": "IndexError: index 107 is out of bounds"}, details={"traceback": "..."})
    broken["verdict"], broken["failed_checks"] = "fail", ["distribution"]
    paths = write_reports(broken, tmp_path)
    assert "IndexError" in paths["md"].read_text()
    assert paths["html"].read_text().count("data:image/png;base64,") == 5  # an empty PIT panel


def test_each_check_says_how_many_drafts_it_verified(report):
    from verispec.audit.report import drafts_verified
    counts = {c["name"]: drafts_verified(c) for c in report["checks"]}
    for name in ("equivalence", "distribution", "seeded", "stopping", "drafter-consistency"):
        assert counts[name] and counts[name] > 0, (name, counts)
    md = render_markdown(report)
    assert "| check | result | time | drafts verified | summary |" in md
    dist = next(c for c in report["checks"] if c["name"] == "distribution")
    assert f"| {counts['distribution']} |" in md and counts["distribution"] == len(dist["details"]["calibration_a"])
    assert "<th>drafts verified</th>" in render_html(report)


def test_a_noisy_backends_null_run_report_renders(report, tmp_path):
    """On a backend whose numerics move with batching (ggml), equivalence is tested against the
    backend's own null run and has no fixed exact-match bar (threshold None): the HTML report
    crashed in its equivalence plot after an 18-minute audit of the Qwen pair on ggml."""
    noisy = json.loads(json.dumps(report))
    eq = next(c for c in noisy["checks"] if c["name"] == "equivalence")
    eq["figures"].update(exact_match_threshold=None, near_tie_allowance=None,
                         null_run={"batch": 16, "prompts": 16, "differ": 2, "margins": [0.01, 0.14],
                                   "beyond_noise": 0, "tie_margin": 1.06, "alpha": 0.01})
    paths = write_reports(noisy, tmp_path)
    page = paths["html"].read_text()
    assert page.count("data:image/png;base64,") == len(plot_names())
