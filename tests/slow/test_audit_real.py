"""The real `verispec audit --quick` on the default configuration (SmolLM2-135M, prompt
lookup): it passes and writes the three report files. Slow: about 3 minutes on 2 cores."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SRC = Path(__file__).resolve().parents[2] / "src"


def _audit(out: Path, *args) -> subprocess.CompletedProcess:
    """`verispec audit --quick` with these arguments, its reports in out."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "verispec.cli", "audit", "--quick", "--no-progress",
                           "--out", str(out), *args], capture_output=True, text=True, env=env, timeout=1200)


def test_quick_audit_passes_on_defaults(tmp_path):
    out = tmp_path / "audit"
    proc = _audit(out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in ("report.json", "report.md", "report.html"):
        assert (out / name).is_file(), name
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "pass" and report["failed_checks"] == []
    names = [c["name"] for c in report["checks"]]
    assert names == ["lossy-rule", "equivalence", "distribution", "seeded", "stopping", "drafter-consistency",
                     "corruption", "slices", "speedup-floor", "load", "record"]
    dist = next(c for c in report["checks"] if c["name"] == "distribution")
    assert dist["figures"]["n"] >= 2000
    # no vacuous pass: the checks say how many drafts they verified, and enough were
    assert dist["figures"]["verified_drafts"] >= dist["figures"]["min_verified_drafts"] > 0
    seeded = next(c for c in report["checks"] if c["name"] == "seeded")
    assert seeded["figures"]["drafts_verified"] > 0 and seeded["figures"]["divergences"] == 0
    assert report["record"]["target"]["sha256"]  # the audited weights are identified
    assert (out / "report.html").read_text().count("data:image/png;base64,") == 5


# The tree faults that a tiny random target hides (its attention barely moves when a key is
# misplaced or extra) fail the equivalence check on SmolLM2, whose attention is a real
# model's: each about 90 s with equivalence alone.
@pytest.mark.parametrize("fault", ["tree-sibling-leak", "tree-position-off-by-one"])
def test_tree_faults_fail_the_audit_on_smollm2(tmp_path, fault):
    proc = _audit(tmp_path, "--draft", "suffix:width=4", "--only", "equivalence", "--inject-fault", fault)
    assert proc.returncode in (0, 1), proc.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    eq = next(c for c in report["checks"] if c["name"] == "equivalence")
    assert eq["figures"]["tree_steps"] >= 20, eq["figures"]  # trees were verified, so the fault ran
    assert report["verdict"] == "fail" and report["failed_checks"] == ["equivalence"], eq["summary"]
