"""The server's functions stay short enough to read in one screen: none over 60 lines
(a route, a phase of a request, a group of metric families each a function of its own)."""

from __future__ import annotations

from pathlib import Path

from tests.structure import long_functions

SERVER = Path(__file__).resolve().parents[2] / "src" / "verispec" / "server"
LIMIT = 60


def test_server_functions_are_short():
    paths = sorted(SERVER.glob("*.py"))
    assert paths
    longest = long_functions(paths, 0)[:5]
    print(f"longest functions in src/verispec/server (limit {LIMIT} lines):")
    for lines, path, name in longest:
        print(f"  {lines:4d}  {Path(path).name}:{name}")
    too_long = long_functions(paths, LIMIT)
    assert not too_long, "functions over %d lines: %s" % (
        LIMIT, ", ".join(f"{Path(p).name}:{n} ({k})" for k, p, n in too_long))


def test_long_functions_counts_nested_and_methods(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def a():\n    def b():\n        pass\n    return b\n\n\n"
                   "class C:\n    @staticmethod\n    def m():\n        x = 1\n        return x\n")
    assert long_functions([src], 0) == [(4, str(src), "a"), (3, str(src), "C.m"), (2, str(src), "a.b")]
    assert long_functions([src], 3) == [(4, str(src), "a")]
