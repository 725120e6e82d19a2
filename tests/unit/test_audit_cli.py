"""`verispec audit` argument handling: config built at the edge, usage errors exit 2."""

import argparse

import pytest

from verispec.cli.audit import config_from_args
from verispec.audit.context import DEFAULT_SETTINGS, AuditSizes
from verispec.cli import build_parser, main


def _args(*argv):
    return build_parser().parse_args(["audit", *argv])


def test_defaults():
    cfg = config_from_args(_args())
    assert cfg.target == "smollm2-135m" and cfg.draft == "lookup" and cfg.k == 8
    assert cfg.rule == "rejection" and cfg.suite == "default" and cfg.temperature == 1.0
    assert cfg.batch_sizes == (1, 4, 16, 32) and cfg.sizes == AuditSizes.full()
    assert cfg.inject_fault is None and cfg.settings == DEFAULT_SETTINGS and cfg.temperatures == (1.0, 0.7)
    assert not cfg.fail_fast and cfg.only == ()


def test_temperatures_fail_fast_only_and_fault_parameters():
    cfg = config_from_args(_args("--temperature", "1,0.7,0.3", "--fail-fast", "--only", "distribution,seeded",
                                 "--inject-fault", "relaxed-acceptance:1.25"))
    assert cfg.temperatures == (1.0, 0.7, 0.3) and [cfg.temperature_of(i) for i in range(4)] == [1.0, 0.7, 0.3, 1.0]
    assert cfg.fail_fast and cfg.only == ("distribution", "seeded")
    assert cfg.inject_fault == "relaxed-acceptance:1.25"


def test_quick_and_options():
    cfg = config_from_args(_args("--quick", "--batch-sizes", "2,8", "--k", "3", "--seed", "7",
                                 "--temperature", "0.7", "--verify", "typical-lossy",
                                 "--inject-fault", "row-leak", "--draft", "layerskip:20"))
    assert cfg.sizes == AuditSizes.quick() and cfg.batch_sizes == (2, 8)
    assert cfg.greedy_batch_sizes == (1, 2, 8)  # batch 1 always: the slices compare it with plain
    assert (cfg.k, cfg.seed, cfg.temperature, cfg.rule) == (3, 7, 0.7, "typical-lossy")
    assert cfg.inject_fault == "row-leak" and cfg.draft == "layerskip:20"
    assert config_from_args(_args("--quick")).batch_sizes == (1, 4, 16)
    # --k defaults to a cap of 8 for the adaptive policy, 4 drafts every step for fixed
    assert config_from_args(_args("--policy", "fixed")).k == 4
    assert config_from_args(_args("--policy", "fixed", "--k", "6")).k == 6


def test_inject_fault_is_hidden_from_help():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert "--inject-fault" not in sub.choices["audit"].format_help()
    assert "--quick" in sub.choices["audit"].format_help()


@pytest.mark.parametrize("argv", [
    ["--batch-sizes", "0,4"], ["--batch-sizes", "a"], ["--k", "0"], ["--temperature", "0"],
    ["--inject-fault", "nope"], ["--inject-fault", "relaxed-acceptance:0.5"], ["--inject-fault", "row-leak:2"],
    ["--temperature", "1,-1"], ["--temperature", "1,x"], ["--temperature", "1,0.001"], ["--only", "nope"],
    ["--verify", "nope"], ["--prompt-format", "xml"], ["--threads", "0"],
])
def test_usage_errors_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        main(["audit", *argv])
    assert e.value.code == 2


def test_missing_suite_file_exits_2(tmp_path, capsys):
    assert main(["audit", "--suite", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path)]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_malformed_suite_file_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["audit", "--suite", str(bad), "--out", str(tmp_path)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_model_free_drafter_specs_build_without_loading_a_model():
    """Every model-free drafter the CLI names builds for the audit (a fresh drafter per
    engine: suffix decoding's global cache is its engine's alone); a bad option fails at
    once with the option's name, before any model work."""
    from verispec.audit.runner import drafter_factory_from_spec
    from verispec.drafters.lookup import PromptLookupDrafter
    from verispec.drafters.suffix import SuffixDrafter

    for spec, cls in [("lookup", PromptLookupDrafter), ("lookup:2", PromptLookupDrafter),
                      ("suffix", SuffixDrafter), ("suffix:width=4,cache=0", SuffixDrafter)]:
        factory, files = drafter_factory_from_spec(spec, None, None)
        a, b = factory(4, 64), factory(4, 64)
        assert isinstance(a, cls) and a is not b and files is None
    assert drafter_factory_from_spec("suffix:width=4", None, None)[0](1, 8).tree_width == 4
    with pytest.raises(ValueError, match="width"):
        drafter_factory_from_spec("suffix:width=99", None, None)
    with pytest.raises(ValueError, match="needs a drafter"):
        drafter_factory_from_spec("none", None, None)


@pytest.mark.parametrize("argv, option, mode", [
    (["--endpoint", "http://127.0.0.1:9", "--target", "X"], "--target", "engine"),
    (["--endpoint", "http://127.0.0.1:9", "--target", "smollm2-135m"], "--target", "engine"),  # its default, given
    (["--endpoint", "http://127.0.0.1:9", "--temperature", "0.5"], "--temperature", "engine"),
    (["--endpoint", "http://127.0.0.1:9", "--batch-invariant"], "--batch-invariant", "engine"),
    (["--concurrency", "4"], "--concurrency", "endpoint"),
    (["--reference-endpoint", "http://127.0.0.1:9"], "--reference-endpoint", "endpoint"),
    (["--sampled-tokens", "100"], "--sampled-tokens", "endpoint"),
])
def test_an_option_of_the_other_mode_exits_2_naming_it(argv, option, mode, capsys):
    assert main(["audit", *argv]) == 2
    err = capsys.readouterr().err
    assert option in err and f"option of the {mode} mode" in err


def test_help_groups_the_options_by_mode(capsys):
    with pytest.raises(SystemExit):
        main(["audit", "--help"])
    out = capsys.readouterr().out
    common, engine, endpoint = (out.index(h) for h in ("\ncommon to both modes:", "\nengine mode (", "\nendpoint mode ("))
    assert common < engine < endpoint
    assert engine < out.index("\n  --target") < endpoint < out.index("\n  --concurrency")
    assert common < out.index("\n  --only") < engine
