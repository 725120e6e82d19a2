"""The audit reads as its registry: a check's name is spelled once, on its Check
(audit/registry.py), and every other module takes it from there or has it stamped on its
results by the loop that runs the checks; no function of the audit or the server is longer
than a screen; protocols are stated, not probed. Read from the source, as test_layering.py
reads imports."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.structure import long_functions
from verispec.audit.checks import REGISTRY
import verispec.audit.registry  # noqa: F401 - registers the built-in checks

SRC = Path(__file__).resolve().parents[2] / "src" / "verispec"
LIMIT = 60


def _key_positions(tree: ast.AST) -> set[int]:
    """ids of the string constants used as keys of JSON data (d["x"], {"x": ...},
    d.get("x")): a report's "record" or a result's "slices" rows name data, not a check."""
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            keys.add(id(node.slice))
        elif isinstance(node, ast.Dict):
            keys.update(id(k) for k in node.keys if k is not None)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("get", "pop", "setdefault") and node.args:
            keys.add(id(node.args[0]))
        elif isinstance(node, ast.Compare):  # "x" in d / "x" not in d
            if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
                keys.add(id(node.left))
    return keys


def check_name_literals(src: Path = SRC) -> list[str]:
    """Every string literal in src/ equal to a registered check's name, outside the module
    that defines the checks, and not a key of JSON data."""
    names = {c.name for c in REGISTRY}
    found = []
    for path in sorted(src.rglob("*.py")):
        if path == src / "audit" / "registry.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        keys = _key_positions(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in keys:
                found.append(f"{path.relative_to(src)}:{node.lineno}: {node.value!r}")
    return found


def test_a_check_name_is_spelled_only_where_its_check_is_defined():
    assert check_name_literals() == []


def test_the_name_scan_sees_a_literal(tmp_path):
    (tmp_path / "m.py").write_text('r = run("equivalence")\nrow = d["equivalence"]\n')
    assert check_name_literals(tmp_path) == ["m.py:1: 'equivalence'"]


def test_no_function_of_the_audit_or_the_server_is_longer_than_60_lines():
    paths = sorted((SRC / "audit").rglob("*.py")) + sorted((SRC / "server").rglob("*.py"))
    longest = long_functions(paths, 0)[:5]
    print("longest functions:", [(n, str(Path(p).relative_to(SRC)), f) for n, p, f in longest])
    too_long = [(n, str(Path(p).relative_to(SRC)), f) for n, p, f in long_functions(paths, LIMIT)]
    assert too_long == [], too_long


# what each probed object is, by the name it has, and the package that owns it
OWNERS = {"model": "models", "target": "models", "cache": "models", "drafter": "drafters", "policy": "policy"}


def probes(src: Path = SRC) -> list[str]:
    """getattr / hasattr / isinstance applied to a model, drafter, cache or policy (by its
    variable's or attribute's name) outside the package that owns it."""
    found = []
    for path in sorted(src.rglob("*.py")):
        package = path.relative_to(src).parts[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr", "isinstance") and node.args):
                continue
            subject = node.args[0]
            name = subject.id if isinstance(subject, ast.Name) else \
                subject.attr if isinstance(subject, ast.Attribute) else ""
            owner = next((pkg for word, pkg in OWNERS.items() if name.lstrip("_").endswith(word)), None)
            if owner is not None and owner != package:
                found.append(f"{path.relative_to(src)}:{node.lineno}: {node.func.id}({name}, ...)")
    return found


def test_protocols_are_stated_not_probed():
    assert probes() == []


def test_the_probe_scan_sees_a_probe(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "m.py").write_text('ok = getattr(target, "supports_trees", False)\n'
                                              'n = getattr(tokenizer, "eos_token_id", None)\n')
    assert probes(tmp_path) == ["engine/m.py:1: getattr(target, ...)"]
