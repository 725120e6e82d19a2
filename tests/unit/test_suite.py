"""The audit prompt suite: the packaged default suite and the JSONL loader."""

from __future__ import annotations

import json

import pytest

from verispec.audit.suite import SuitePrompt, load_suite, slices

EXPECTED_SLICES = ["code", "math", "chat", "summarisation", "translation", "json", "html", "string-copying",
                   "adversarial"]


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_default_suite_has_all_slices():
    suite = load_suite()
    assert suite == load_suite("default")
    groups = slices(suite)
    assert list(groups) == EXPECTED_SLICES
    for name, prompts in groups.items():
        assert len(prompts) >= 10, name
        assert all(p.slice == name for p in prompts)
    ids = [p.id for p in suite]
    assert len(ids) == len(set(ids))
    assert all(isinstance(p, SuitePrompt) and p.prompt.strip() for p in suite)
    assert len({p.prompt for p in suite}) == len(suite)


def test_default_file_is_specbench_compatible():
    from importlib import resources

    text = resources.files("verispec.data").joinpath("suite_default.jsonl").read_text(encoding="utf-8")
    for line in text.splitlines():
        rec = json.loads(line)
        assert rec["turns"] == [rec["prompt"]]
        assert rec["id"].startswith(rec["slice"] + "-")


def test_summarisation_prompts_carry_their_text():
    for p in slices(load_suite())["summarisation"]:
        assert p.prompt.startswith("Summarise the following text in 3 sentences:")
        assert len(p.prompt.split()) >= 120


def test_specbench_format(tmp_path):
    path = _write(tmp_path / "question.jsonl", [
        json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a travel blog post.", "Rewrite it."]}),
        json.dumps({"question_id": 82, "category": "math", "turns": ["What is 2+2?"]}),
        "",
        json.dumps({"question_id": 83, "category": "writing", "turns": ["Draft an email."]}),
    ])
    suite = load_suite(str(path))
    assert suite == [
        SuitePrompt("81", "writing", "Write a travel blog post."),
        SuitePrompt("82", "math", "What is 2+2?"),
        SuitePrompt("83", "writing", "Draft an email."),
    ]
    groups = slices(suite)
    assert list(groups) == ["writing", "math"]
    assert [p.id for p in groups["writing"]] == ["81", "83"]


def test_our_format_with_defaults(tmp_path):
    path = _write(tmp_path / "mine.jsonl", [
        json.dumps({"id": "a", "slice": "code", "prompt": "def f():"}),
        json.dumps({"prompt": "Hello there"}),
        json.dumps({"slice": "chat", "prompt": "How are you?"}),
    ])
    assert load_suite(path) == [
        SuitePrompt("a", "code", "def f():"),
        SuitePrompt("default-2", "default", "Hello there"),
        SuitePrompt("chat-3", "chat", "How are you?"),
    ]


@pytest.mark.parametrize(
    "bad, what",
    [
        ("{not json", "invalid JSON"),
        (json.dumps({"slice": "code"}), "no prompt text"),
        (json.dumps({"prompt": "   "}), "no prompt text"),
        (json.dumps({"question_id": 1, "turns": []}), "no prompt text"),
        (json.dumps(["a list"]), "expected a JSON object"),
        (json.dumps({"id": "x", "prompt": "again"}), "duplicate id"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad, what):
    path = _write(tmp_path / "bad.jsonl", [json.dumps({"id": "x", "prompt": "fine"}), "", bad])
    with pytest.raises(ValueError) as e:
        load_suite(str(path))
    assert f"{path}:3" in str(e.value)
    assert what in str(e.value)


def test_empty_file(tmp_path):
    path = _write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match="empty"):
        load_suite(str(path))


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError) as e:
        load_suite(str(path))
    assert str(path) in str(e.value)


def test_select_prompts_default_seed_takes_each_slices_first_and_other_seeds_sample_reproducibly():
    from verispec.audit.context import select_prompts

    suite = load_suite("default")
    first = select_prompts(suite, 2)
    assert [p.id for p in first] == [p.id for g in slices(suite).values() for p in g[:2]]
    a, b = select_prompts(suite, 2, seed=3), select_prompts(suite, 2, seed=3)
    assert [p.id for p in a] == [p.id for p in b]  # reproducible
    assert {p.slice for p in a} == {p.slice for p in suite}  # every slice keeps its share
    assert len(a) == len(first)
    others = [[p.id for p in select_prompts(suite, 2, seed=s)] for s in range(1, 6)]
    assert any(o != [p.id for p in first] for o in others)  # the seed chooses other prompts
    assert select_prompts(suite, None, seed=3) == list(suite)


def test_the_adversarial_slice_says_how_each_prompt_was_made():
    """Made by the speedup-floor search (benchmarks/adversarial_slice.py) against each
    built-in drafter: every line names its drafter, search seed, budget and edits."""
    from importlib import resources

    text = resources.files("verispec.data").joinpath("suite_default.jsonl").read_text(encoding="utf-8")
    made = [json.loads(line)["made_by"] for line in text.splitlines() if json.loads(line)["slice"] == "adversarial"]
    assert len(made) >= 10
    assert all(m["search"] == "speedup-floor" and m["edits"] and m["budget"] and m["seed"] is not None for m in made)
    drafters = {m["drafter"].split(":")[0] for m in made}
    assert {"lookup", "layerskip"} <= drafters and drafters - {"lookup", "layerskip"}  # and a draft model


REPETITIVE_SLICES = ["code-edit", "rag", "multi-turn", "agentic", "json"]


def _repetitive_records():
    from importlib import resources

    text = resources.files("verispec.data").joinpath("suite_repetitive.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()]


def test_repetitive_suite_has_its_slices():
    suite = load_suite("repetitive")
    groups = slices(suite)
    assert list(groups) == REPETITIVE_SLICES
    assert all(len(prompts) == 8 for prompts in groups.values())
    assert len({p.id for p in suite}) == len(suite)
    assert all(len(p.prompt) < 2000 for p in suite)
    records = _repetitive_records()
    assert [r["id"] for r in records] == [p.id for p in suite]
    assert all(isinstance(r["made_from"], str) and r["made_from"].strip() for r in records)


def test_repetitive_code_edits_carry_the_code_they_ask_about():
    for p in slices(load_suite("repetitive"))["code-edit"]:
        block = p.prompt.split("```python\n", 1)[1].split("\n```", 1)[0]
        assert len(block.splitlines()) >= 5, p.id
        assert block.lstrip().startswith("def "), p.id


def test_repetitive_agentic_prompts_share_text_across_requests():
    """Suffix decoding's cache across requests pays only where tool results recur."""
    prompts = [p.prompt for p in slices(load_suite("repetitive"))["agentic"]]
    assert all(p.rstrip().endswith("Next action:") for p in prompts)
    results = [line for p in prompts for line in p.splitlines() if line.startswith("Result: ") and len(line) >= 200]
    assert any(sum(r in p for p in prompts) >= 3 for r in results)  # a long tool result in 3+ prompts


def test_repetitive_suite_regenerates_byte_for_byte(tmp_path):
    import importlib.util
    import platform
    import sys
    from pathlib import Path

    made = {r["made_from"] for r in _repetitive_records()}
    here = f"{platform.python_implementation()} {platform.python_version()}"
    if sys.version_info[:2] != (3, 11) or not any(here in m for m in made):
        pytest.skip(f"the packaged suite quotes another Python's standard library than {here}'s")
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "repetitive_suite.py"
    spec = importlib.util.spec_from_file_location("repetitive_suite", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "suite_repetitive.jsonl"
    module.write(out)
    from importlib import resources

    packaged = resources.files("verispec.data").joinpath("suite_repetitive.jsonl").read_bytes()
    assert out.read_bytes() == packaged, "regenerate with: python benchmarks/repetitive_suite.py"
