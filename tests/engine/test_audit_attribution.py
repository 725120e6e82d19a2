"""Attribution: every test of the distribution check names the code paths its samples came
from (the deployed drafter, the calibration probe), the same test on each path's samples
alone says where a deviation lies, and the check states the power of each path's drafts.
A fault in code prompt lookup never runs (the verify pass's handling of a q) fails a lookup
audit through the probe alone, and the report says the deployment does not run that path."""

import json

import pytest

from tests.audit_tiny import one_thread, tiny_audit, tiny_models
from verispec.audit.report import write_reports

Q_FAULTS = ["verify-q-floored", "verify-q-one-draft-late"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def models():
    return tiny_models()


def _distribution(result):
    return next(c for c in result.checks if c.name == "distribution")


def test_every_test_names_its_samples_and_the_power_of_each_path(models, tmp_path):
    d = _distribution(tiny_audit(models, drafter="lookup"))
    assert d.passed, d.summary
    paths = d.figures["code_paths"]
    assert "verispec.drafters.lookup" in paths["deployed"]["name"]
    assert "does not run" in paths["probe"]["name"]  # lookup never takes the draft-model path
    tests = {t["test"]: t for t in d.figures["tests"]}
    assert set(tests["calibration"]["samples_from"]) == {"deployed"}
    assert set(tests["probe-calibration"]["samples_from"]) == {"probe"}
    # each family runs apart on each path; the per-setting PIT pools both, split in the figures
    assert set(tests["pit"]["samples_from"]) == {"deployed"} and set(tests["probe-pit"]["samples_from"]) == {"probe"}
    assert set(tests["pit [plain]"]["samples_from"]) == {"deployed", "probe"}
    assert sum(tests["pit [plain]"]["samples_from"].values()) == tests["pit [plain]"]["n"]
    power = d.figures["power_vs_relaxed"]
    assert set(power) == {"deployed", "probe", "both"}
    assert all(0 <= v <= 1 for src in power.values() for v in src.values())
    assert power["both"]["2.0"] >= max(power["deployed"]["2.0"], power["probe"]["2.0"]) - 1e-9
    assert "deployed drafter alone" in d.summary and "probe alone" in d.summary


@pytest.mark.parametrize("fault", Q_FAULTS)
def test_a_q_path_fault_is_blamed_on_the_path_that_runs_it(models, tmp_path, fault):
    with_q = _distribution(tiny_audit(models, drafter="layerskip", fault=fault))
    assert not with_q.passed
    failed = [t for t in with_q.figures["tests"] if not t["passed"]]
    assert any(t["by_source"].get("deployed", {}).get("fails_alone") for t in failed), with_q.summary
    assert "the deployed drafter" in with_q.summary

    lookup = tiny_audit(models, drafter="lookup", fault=fault)
    d = _distribution(lookup)
    assert not d.passed
    failed = [t for t in d.figures["tests"] if not t["passed"]]
    # the deployed drafter's own samples pass every failed test alone: only the probe's fail
    assert all(not t["by_source"].get("deployed", {}).get("fails_alone") for t in failed), d.summary
    assert any(t["by_source"].get("probe", {}).get("fails_alone") for t in failed)
    assert "the calibration probe (draft-model path, which this deployment does not run)" in d.summary
    paths = write_reports(lookup.to_dict(), tmp_path)
    md = paths["md"].read_text()
    assert "FAILS ALONE" in md and "code paths that produced the samples" in md
    assert json.loads(paths["json"].read_text())["checks"]
