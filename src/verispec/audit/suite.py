"""The audit's prompt suite: the built-in default suite, or a JSONL file of prompts.

Two line formats are accepted (they may even be mixed in one file):

* ours: ``{"prompt": "...", "slice": "code", "id": "code-01"}`` - ``slice`` and ``id``
  are optional;
* Spec-Bench's ``question.jsonl``: ``{"question_id": 81, "category": "writing",
  "turns": ["...", ...]}`` - the slice is the category and the prompt the first turn.

A missing slice becomes ``"default"``; a missing id becomes ``"<slice>-<line number>"``.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass
from importlib import resources
from typing import Iterable

DEFAULT_SLICE = "default"
_DEFAULT_RESOURCE = "suite_default.jsonl"


@dataclass(frozen=True)
class SuitePrompt:
    id: str
    slice: str
    prompt: str


def load_suite(spec: str | os.PathLike[str] = "default") -> list[SuitePrompt]:
    """Load a prompt suite: ``"default"`` (the packaged suite) or a path to a JSONL file.

    Raises FileNotFoundError (naming the path) when the file is missing, and ValueError
    naming ``file:line`` for a malformed line, a line without prompt text, a repeated id,
    or a file holding no prompts.
    """
    if isinstance(spec, str) and spec == "default":
        text = resources.files("verispec.data").joinpath(_DEFAULT_RESOURCE).read_text(encoding="utf-8")
        return _parse(text, f"<verispec.data/{_DEFAULT_RESOURCE}>")
    path = os.fspath(spec)
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, f"prompt suite file not found: {path}", path)
    with open(path, encoding="utf-8-sig") as f:
        text = f.read()
    return _parse(text, path)


def slices(prompts: Iterable[SuitePrompt]) -> dict[str, list[SuitePrompt]]:
    """Group prompts by slice; slices in order of first appearance, prompts in input order."""
    out: dict[str, list[SuitePrompt]] = {}
    for p in prompts:
        out.setdefault(p.slice, []).append(p)
    return out


def _parse(text: str, where: str) -> list[SuitePrompt]:
    prompts: list[SuitePrompt] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        loc = f"{where}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{loc}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{loc}: expected a JSON object, got {type(rec).__name__}")
        prompt = _prompt_text(rec, loc)
        slice_ = rec.get("slice", rec.get("category"))
        if slice_ is None or (isinstance(slice_, str) and not slice_.strip()):
            slice_ = DEFAULT_SLICE
        elif not isinstance(slice_, str):
            raise ValueError(f"{loc}: 'slice'/'category' must be a string, got {slice_!r}")
        id_ = rec.get("id", rec.get("question_id"))
        id_ = f"{slice_}-{lineno}" if id_ is None or id_ == "" else str(id_)
        if id_ in seen:
            raise ValueError(f"{loc}: duplicate id {id_!r} (first used on line {seen[id_]})")
        seen[id_] = lineno
        prompts.append(SuitePrompt(id=id_, slice=slice_, prompt=prompt))
    if not prompts:
        raise ValueError(f"{where}: the prompt suite file holds no prompts (empty file)")
    return prompts


def _prompt_text(rec: dict, loc: str) -> str:
    prompt = rec.get("prompt")
    if prompt is None:
        turns = rec.get("turns")
        if isinstance(turns, list) and turns:
            prompt = turns[0]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(
            f"{loc}: no prompt text (need a non-empty 'prompt' string or a 'turns' list "
            f"whose first item is a non-empty string)"
        )
    return prompt
