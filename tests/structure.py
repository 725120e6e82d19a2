"""Structural checks read from the source (no import of what they check)."""

from __future__ import annotations

import ast
from pathlib import Path


def long_functions(paths, limit: int) -> list[tuple[int, str, str]]:
    """Every function or method in the files `paths` longer than `limit` lines, longest
    first, as (lines, path, dotted name). Lines run from the `def` to the end of the body
    (decorators excluded, nested functions counted in their parent and on their own)."""
    found = []
    for path in paths:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=str(path))
        for lines, name in _function_lengths(tree.body, ""):
            if lines > limit:
                found.append((lines, str(path), name))
    return sorted(found, key=lambda f: (-f[0], f[1], f[2]))


def _function_lengths(body: list, prefix: str):
    """(lines, dotted name) of each function defined in `body`, at any depth."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.end_lineno - node.lineno + 1, prefix + node.name
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _function_lengths(node.body, prefix + node.name + ".")
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):  # defs under if/try/with
                yield from _function_lengths(getattr(node, field, []), prefix)
