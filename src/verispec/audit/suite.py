"""The audit's prompt suite: a packaged suite by name, or a JSONL file of prompts.

The packaged suites are ``"default"`` (task slices from code to translation, plus an
adversarial slice) and ``"repetitive"`` (code edits, RAG, multi-turn, agentic and JSON
transforms: answers that repeat text from the prompt, the kind suffix decoding drafts from;
made by ``benchmarks/repetitive_suite.py``).

Two line formats are accepted (they may even be mixed in one file):

* ours: ``{"prompt": "...", "slice": "code", "id": "code-01"}`` - ``slice`` and ``id``
  are optional, and other keys (such as where a prompt came from) are ignored;
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
PACKAGED = {"default": "suite_default.jsonl", "repetitive": "suite_repetitive.jsonl"}


@dataclass(frozen=True)
class SuitePrompt:
    id: str
    slice: str
    prompt: str


def load_suite(spec: str | os.PathLike[str] = "default") -> list[SuitePrompt]:
    """Load a prompt suite: a packaged one by name (a key of ``PACKAGED``: ``"default"``,
    ``"repetitive"``) or a path to a JSONL file.

    A name wins over a file of that name in the working directory; give such a file as
    ``./default``. Raises FileNotFoundError (naming the path) when the file is missing, and
    ValueError naming ``file:line`` for a malformed line, a line without prompt text, a
    repeated id, or a file holding no prompts.
    """
    if isinstance(spec, str) and spec in PACKAGED:
        resource = PACKAGED[spec]
        text = resources.files("verispec.data").joinpath(resource).read_text(encoding="utf-8")
        return _parse(text, f"<verispec.data/{resource}>")
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
