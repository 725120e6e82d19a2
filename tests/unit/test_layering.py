"""The package's imports flow downward, with no circles: from the bottom, models, sampling
and verify; drafters; policy; engine; audit and server; cli. Read from the source (every
import statement, at module level or inside a function; imports for type checking only do
not run and do not count)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "verispec"
LAYER = {"models": 0, "sampling": 0, "verify": 0, "omp": 0, "paths": 0, "data": 0, "drafters": 1, "policy": 2,
         "engine": 3, "audit": 4, "server": 4, "cli": 5}


def _modules(src: Path = SRC) -> dict[str, Path]:
    out = {}
    for path in src.rglob("*.py"):
        parts = ("verispec",) + path.relative_to(src).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):  # `if TYPE_CHECKING:` bodies never run
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                out.add(f"{mod}.{alias.name}" if f"{mod}.{alias.name}" in modules else mod)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in modules and m != name}


def _graph(src: Path = SRC) -> dict[str, set[str]]:
    modules = _modules(src)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> int:
    parts = module.split(".")
    return 0 if len(parts) == 1 else LAYER[parts[1]]


def test_every_top_level_part_has_a_layer():
    assert {m.split(".")[1] for m in _modules() if "." in m} <= set(LAYER)


def test_no_import_goes_up_a_layer():
    up = [f"{a} -> {b}" for a, outs in _graph().items() for b in outs if _layer(b) > _layer(a)]
    assert not up, up


SPECULATION = ("verify", "drafters", "policy", "engine")


def _speculative_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a module under models/ of verify, drafters, policy or engine: models/ is
    on the bottom layer with verify/, so the layer test alone lets models -> verify through."""
    return [f"{a} -> {b}" for a, outs in graph.items() if a.split(".")[1:2] == ["models"]
            for b in outs if b.split(".")[1:2] and b.split(".")[1] in SPECULATION]


def test_models_know_nothing_of_speculation():
    bad = _speculative_imports(_graph())
    assert not bad, bad


def test_no_import_circles():
    graph, seen, on_path, cycles = _graph(), set(), [], []

    def visit(node):
        on_path.append(node)
        for nxt in sorted(graph[node]):
            if nxt in on_path:
                cycles.append(on_path[on_path.index(nxt):] + [nxt])
            elif nxt not in seen:
                visit(nxt)
        on_path.pop()
        seen.add(node)

    for node in sorted(graph):
        if node not in seen:
            visit(node)
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path):
    """The tests above can fail: a fake package with a circle, an upward import and an
    import of verify from models."""
    pkg = tmp_path / "verispec"
    (pkg / "models").mkdir(parents=True)
    (pkg / "engine").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("from ..engine import core\n")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "core.py").write_text("from ..models import x\n")
    (pkg / "models" / "x.py").write_text("from . import y\n")
    (pkg / "models" / "y.py").write_text("def f():\n    from . import x\n")
    (pkg / "verify").mkdir()
    (pkg / "verify" / "__init__.py").write_text("")
    (pkg / "verify" / "tree.py").write_text("MAX_BRANCHES = 8\n")
    (pkg / "models" / "z.py").write_text("def f():\n    from ..verify.tree import MAX_BRANCHES\n")
    graph = _graph(pkg)
    assert "verispec.engine.core" in graph["verispec.models"]  # models -> engine: up
    assert sorted(_speculative_imports(graph)) == ["verispec.models -> verispec.engine.core",
                                                   "verispec.models.z -> verispec.verify.tree"]
    assert "verispec.models.y" in graph["verispec.models.x"] and "verispec.models.x" in graph["verispec.models.y"]
