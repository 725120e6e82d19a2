"""The sampled checks' settings: plain T = 1 and a common filtered setting by default, the
deployment's own with --temperature/--top-k/--top-p/--min-p (replacing the defaults),
clear errors for values the engine refuses, and per-setting figures in a tiny audit."""

import argparse
import math

import pytest

from tests.audit_tiny import one_thread, tiny_audit, tiny_models
from verispec.audit.context import DEFAULT_SETTINGS, AuditConfig, SamplingSetting, settings_for
from verispec.audit.distribution import ALPHA
from verispec.audit.report import render_markdown
from verispec.cli import build_parser, main
from verispec.cli.audit import config_from_args


def _config(*argv) -> AuditConfig:
    return config_from_args(build_parser().parse_args(["audit", *argv]))


def test_defaults_are_plain_and_a_common_filtered_setting():
    plain, filtered = DEFAULT_SETTINGS
    assert (plain.label, plain.temperature, plain.filtered) == ("plain", 1.0, False)
    assert filtered.label == "filtered" and filtered.temperature < 1
    assert filtered.top_k > 0 and filtered.top_p < 1 and filtered.min_p > 0  # every filter the engine has
    cfg = AuditConfig()
    assert cfg.settings == DEFAULT_SETTINGS and cfg.temperatures == (1.0, filtered.temperature)


def test_requests_take_the_settings_in_turn():
    cfg = AuditConfig()
    assert [cfg.setting_of(i).label for i in range(5)] == ["plain", "filtered", "plain", "filtered", "plain"]
    sp = cfg.sampling_of(3, seed=11)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.seed) == (0.7, 50, 0.9, 0.1, 11)
    assert cfg.sampling_of(3, seed=11, coupled=False).keyed is False and sp.keyed  # a seed keys the noise
    assert [cfg.temperature_of(i) for i in range(3)] == [1.0, 0.7, 1.0] and cfg.temperature == 1.0
    # one filter for every request (a reader that has no request index): the first setting's
    assert (cfg.top_k, cfg.top_p, cfg.min_p) == (0, 1.0, 0.0)


def test_a_setting_describes_itself_and_is_named_by_its_values_without_a_label():
    s = SamplingSetting(0.8, top_k=40, top_p=0.95, min_p=0.05)
    assert s.label == s.describe() == "T=0.8, top-k 40, top-p 0.95, min-p 0.05"
    assert SamplingSetting(1.0).describe() == "T=1, no filter"
    assert SamplingSetting(0.5, min_p=0.1, label="mine").to_dict() == {
        "label": "mine", "temperature": 0.5, "top_k": 0, "top_p": 1.0, "min_p": 0.1}


@pytest.mark.parametrize("kwargs, named", [
    ({"temperature": 0.0}, "temperature > 0"), ({"temperature": -1.0}, "temperature"),
    ({"temperature": math.nan}, "temperature"), ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
    ({"temperature": 1.0, "top_p": 0.0}, "top_p"), ({"temperature": 1.0, "min_p": -0.1}, "min_p"),
    ({"temperature": 1.0, "top_k": -3}, "top_k"), ({"temperature": 1.0, "top_k": 2.5}, "top_k"),
])
def test_a_bad_value_is_a_value_error_naming_it(kwargs, named):
    with pytest.raises(ValueError, match=named):
        SamplingSetting(**kwargs)


def test_the_config_refuses_no_settings_and_repeated_labels():
    with pytest.raises(ValueError, match="at least one"):
        AuditConfig(settings=())
    with pytest.raises(ValueError, match="distinct labels"):
        AuditConfig(settings=(SamplingSetting(1.0, label="a"), SamplingSetting(0.5, label="a")))
    with pytest.raises(ValueError, match="SamplingSetting"):
        AuditConfig(settings=(1.0, 0.5))


def test_no_flags_audit_the_defaults():
    assert _config().settings == DEFAULT_SETTINGS
    assert _config("--quick", "--seed", "3").settings == DEFAULT_SETTINGS


@pytest.mark.parametrize("argv, expected", [
    (["--top-p", "0.9"], settings_for((1.0,), top_p=0.9)),
    (["--temperature", "1,0.7,0.3"], settings_for((1.0, 0.7, 0.3))),
    (["--top-k", "0"], (SamplingSetting(1.0),)),  # a filter given as off: still the deployment's own
    (["--temperature", "0.8", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.05"],
     (SamplingSetting(0.8, 40, 0.95, 0.05),)),
    (["--temperature", "1,0.7", "--min-p", "0.1"], (SamplingSetting(1.0, min_p=0.1), SamplingSetting(0.7, min_p=0.1))),
])
def test_the_deployments_flags_replace_the_defaults(argv, expected):
    cfg = _config(*argv)
    assert cfg.settings == expected
    assert not set(cfg.settings) & set(DEFAULT_SETTINGS)


def test_help_says_what_happens_to_the_defaults():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["audit"].format_help().split())
    for s in DEFAULT_SETTINGS:
        assert s.describe() in text
    assert "instead" in text


@pytest.mark.parametrize("argv, named", [
    (["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"), (["--min-p", "2"], "min_p must be in [0, 1], got 2"),
    (["--top-k", "-1"], "top_k must be an integer >= 0"), (["--top-p", "0"], "top_p must be in (0, 1], got 0"),
])
def test_bad_flags_exit_2_with_a_message_and_no_traceback(argv, named, capsys, tmp_path):
    assert main(["audit", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


@pytest.fixture(scope="module")
def models():
    with one_thread():
        yield tiny_models()


def _distribution(models, **kw) -> dict:
    with one_thread():
        result = tiny_audit(models, only=("distribution",), **kw).to_dict()
    return next(c for c in result["checks"] if c["name"] == "distribution")


def test_a_tiny_audit_reports_each_settings_share_and_tests(models):
    check = _distribution(models)
    f = check["figures"]
    share = f["settings"]
    assert [s["label"] for s in share] == ["plain", "filtered"] and check["passed"]
    # the shares add up to the whole: requests, tokens, verified drafts, probe drafts
    assert sum(s["requests"] for s in share) == f["requests"]
    assert sum(s["verified_drafts"] for s in share) == f["verified_drafts"]
    assert sum(s["probe_drafts"] for s in share) == f["probe"]["verified_drafts"]
    assert sum(s["tokens"] for s in share) == f["n"]  # the deployed drafter's PIT
    probe_pit = next(t for t in f["tests"] if t["test"] == "probe-pit")
    assert sum(s["probe_tokens"] for s in share) == probe_pit["n"]  # the probe's, tested apart
    assert all(s["verified_drafts"] > 200 and s["tokens"] > 1000 and not s["thin"] for s in share)
    assert f["thin_settings"] == [] and all(s["outside_support"] == 0 and s["failed"] == [] for s in share)
    names = [t["test"] for t in f["tests"]]
    for label in ("plain", "filtered"):
        assert {f"pit [{label}]", f"calibration [{label}]", f"probe-calibration [{label}]"} <= set(names)
    # every test with data in one Bonferroni family; the count of impossible tokens outside it
    m = sum(not t.get("impossible") for t in f["tests"])
    assert m == 26 and f["alpha_each"] == pytest.approx(ALPHA / m)
    support = next(t for t in f["tests"] if t["test"] == "outside-support")
    assert support["passed"] and support["statistic"] == 0 and support["n"] == f["n"] + probe_pit["n"]
    assert "plain (T=1, no filter): 1500 tokens" in check["summary"]


def test_the_report_has_a_settings_table(models):
    with one_thread():
        report = tiny_audit(models, only=("distribution",)).to_dict()
    md = render_markdown(report)
    assert "Distribution: sampling settings" in md
    for s in DEFAULT_SETTINGS:
        assert f"| {s.label} | {s.describe()} |" in md
    assert "settings plain, filtered" in md  # the headline


def test_a_thin_share_is_said_and_one_setting_runs_no_split(models):
    f = _distribution(models, min_verified_drafts=10 ** 6)["figures"]
    assert f["thin_settings"] == ["plain", "filtered"] and all(s["thin"] for s in f["settings"])
    one = _distribution(models, settings=(SamplingSetting(0.7, top_p=0.9),))["figures"]
    assert [s["label"] for s in one["settings"]] == ["T=0.7, top-p 0.9"] and one["thin_settings"] == []
    assert not [t for t in one["tests"] if "[" in t["test"]]  # the pooled tests are that setting's
