"""Make the packaged "repetitive" prompt suite: workloads whose answers repeat text.

Suffix decoding drafts by copying continuations it has already seen: in the prompt, in the
output so far and in earlier requests. It pays on answers that repeat text, and the default
suite has few of those, so this suite holds five slices of them, 8 prompts each, phrased as
a user would ask a chat model:

* ``code-edit``: a standard-library function and a request for it back with one change (a
  consistent rename, type hints, a docstring, or the fix of a bug put into it on purpose,
  described by its symptom);
* ``rag``: a passage (a module's or a function's docstring) and a question to answer by
  quoting the passage verbatim;
* ``multi-turn``: a chat history whose earlier assistant turns hold code or lists, ending
  with a request to give an earlier answer again with a small change;
* ``agentic``: an agent loop over three tools with JSON calls and JSON results, ending with
  "Next action:"; the tool results recur across the prompts (the same listing, search
  result or test report in several of them), as they do across the requests of one agent;
* ``json``: a JSON document and a transform (rename a key, sort records, change the shape,
  add a field) that asks for the whole document back.

All text ships offline: the sources and docstrings of Python's standard library (read from
the module source with ``inspect.getsource`` and ``ast``, so that functions the C
accelerators replace at import still come out as their Python definitions), data the
standard library holds (``calendar``, ``string``, ``unicodedata``, ``colorsys``), listings
of three standard-library packages, and the default suite's own prompts. The test runner
results in the agentic slice are made up. Every line's ``made_from`` names its sources and
the Python that read them; sources differ across Python versions, so regenerate with the
Python recorded there (CPython 3.11) to get the packaged file back byte for byte:

    python benchmarks/repetitive_suite.py
"""

from __future__ import annotations

import argparse
import ast
import calendar
import colorsys
import importlib
import importlib.util
import inspect
import json
import os
import platform
import random
import re
import string
import sys
import sysconfig
import unicodedata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from verispec.audit.suite import load_suite  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "src" / "verispec" / "data" / "suite_repetitive.jsonl"
SLICES = ["code-edit", "rag", "multi-turn", "agentic", "json"]
PER_SLICE = 8
MAX_CHARS = 2000
PYTHON = f"{platform.python_implementation()} {platform.python_version()}"
STDLIB = f"({PYTHON} stdlib)"
WRITTEN = "conversation written for this suite"


def source(qualname: str) -> str:
    """The source of a module-level function or class (``"module.name"``, ``"module.Class.name"``).

    Read from the module's own source, because ``inspect.getsource(bisect.bisect_right)``
    fails: the name is bound to the C accelerator's builtin after import.
    """
    mod, _, rest = qualname.partition(".")
    while True:  # the longest importable prefix is the module: "json.encoder.py_encode_basestring_ascii"
        head, _, tail = rest.partition(".")
        if tail and importlib.util.find_spec(f"{mod}.{head}") is not None:
            mod, rest = f"{mod}.{head}", tail
        else:
            break
    text = inspect.getsource(importlib.import_module(mod))
    body, node = ast.parse(text).body, None
    for part in rest.split("."):
        node = next(n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
        body = node.body
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return "\n".join(text.splitlines()[start - 1:node.end_lineno])


def summary(module: str) -> str:
    """The first sentence of a module's docstring.

    A sentence, not a line: a first line such as json's breaks off mid-sentence.
    """
    doc = inspect.cleandoc(importlib.import_module(module).__doc__ or "").strip()
    para = " ".join(doc.split("\n\n")[0].split())
    return re.split(r"(?<=\.) (?=[A-Z])", para)[0]


def fenced(code: str, lang: str = "python") -> str:
    return f"```{lang}\n{code}\n```"


def dump(obj, style: str = "table", indent: int = 0) -> str:
    """Pretty JSON with a two-space indent, in one of three styles.

    "table" keeps short records and lists of scalars on one line (a record per line reads as
    a table), "records" keeps only lists of scalars on one line, and "tall" puts every value
    on its own line. The style keeps each document at 20-60 lines.
    """
    flat = json.dumps(obj, ensure_ascii=False)
    scalars = isinstance(obj, list) and all(not isinstance(v, (dict, list)) for v in obj)
    if (not isinstance(obj, (dict, list)) or (scalars and style != "tall")
            or (style == "table" and indent > 0 and len(flat) <= 100)):
        return flat
    pad, inner = " " * indent, " " * (indent + 2)
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {dump(v, style, indent + 2)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    return "[\n" + ",\n".join(f"{inner}{dump(v, style, indent + 2)}" for v in obj) + f"\n{pad}]"


def bugged(src: str, old: str, new: str) -> str:
    assert src.count(old) == 1, (old, src)
    return src.replace(old, new)


# --- code-edit -------------------------------------------------------------------------------

INTROS = [
    "Here is `{name}` from Python's `{module}` module:",
    "This is the source of `{module}.{name}` from the standard library:",
    "I copied `{name}` out of the standard library's `{module}` module:",
]
WHOLE = [
    "Give me back the whole function and nothing else.",
    "Reply with the complete function, unchanged apart from that.",
    "Return the full function in one code block.",
]

# (function, what to change): the bugs are the two functions below
CODE_EDITS = [
    ("bisect.bisect_right", "Rename the parameters `lo` and `hi` to `low` and `high` everywhere in the "
     "function, including the docstring and the error message."),
    ("string.capwords", "Rename the function to `capitalize_words` and its parameter `s` to `text`, "
     "and update the docstring to match."),
    ("colorsys.rgb_to_hsv", "Add type hints: the three inputs are floats and it returns a tuple of three "
     "floats. Don't change anything else."),
    ("fnmatch.filter", "Add type hints to it (`names` is any iterable of strings, `pat` a string) and "
     "keep the body as it is."),
    ("heapq._siftdown", "It has no docstring. Add one that explains what `startpos` and `pos` are and "
     "which invariant the function restores."),
    ("colorsys.rgb_to_hls", "Add a docstring saying what the inputs and outputs are and their ranges."),
]


def _median_bug():
    src = bugged(source("statistics.median"), "return (data[i - 1] + data[i]) / 2",
                 "return (data[i] + data[i + 1]) / 2")
    ns = {"StatisticsError": ValueError}
    exec(src, ns)
    assert ns["median"]([1, 3, 5, 7]) == 6.0 and ns["median"]([1, 3, 5]) == 3
    symptom = ("`median([1, 3, 5])` gives 3 as it should, but `median([1, 3, 5, 7])` gives 6.0 instead of "
               "4.0 and `median([1, 2])` raises IndexError.")
    return "statistics.median", src, symptom


def _cmp_to_key_bug():
    src = bugged(source("functools.cmp_to_key"), "return mycmp(self.obj, other.obj) > 0",
                 "return mycmp(self.obj, other.obj) < 0")
    ns: dict = {}
    exec(src, ns)
    by_length = ns["cmp_to_key"](lambda a, b: len(a) - len(b))
    words = ["fig", "banana", "kiwi"]
    assert sorted(words, key=by_length) == ["fig", "kiwi", "banana"] and max(words, key=by_length) == "fig"
    symptom = ("`sorted(words, key=cmp_to_key(by_length))` orders the words correctly, but "
               "`max(words, key=cmp_to_key(by_length))` returns the shortest word, `'fig'` for "
               "`['fig', 'banana', 'kiwi']`, where `by_length(a, b)` returns `len(a) - len(b)`.")
    return "functools.cmp_to_key", src, symptom


def code_edit(rng: random.Random) -> list[tuple[str, str]]:
    out = []
    for qualname, ask in CODE_EDITS:
        module, _, name = qualname.rpartition(".")
        intro = rng.choice(INTROS).format(module=module, name=name)
        prompt = f"{intro}\n\n{fenced(source(qualname))}\n\n{ask} {rng.choice(WHOLE)}"
        out.append((prompt, f"{qualname} {STDLIB}"))
    for qualname, src, symptom in (_median_bug(), _cmp_to_key_bug()):
        module, _, name = qualname.rpartition(".")
        prompt = (f"This is my copy of `{name}`, taken from Python's `{module}` module, and I broke something "
                  f"while editing it: {symptom}\n\n{fenced(src)}\n\nFind the bug and fix it. "
                  f"{rng.choice(WHOLE)}")
        out.append((prompt, f"{qualname} {STDLIB}, with a bug put in"))
    order = list(range(len(out)))
    rng.shuffle(order)  # the edit kinds interleave, as they would arrive
    return [out[i] for i in order]


# --- rag -------------------------------------------------------------------------------------

RAG = [
    ("heapq", "module", "How does heapq's API differ from textbook heap algorithms, and what does `heap[0]` hold?"),
    ("sched", "module", "How are events specified, and does a lower priority number mean a higher or a lower "
     "priority?"),
    ("tempfile", "module", "Which interface is subject to race conditions, and what is `tempdir` for?"),
    ("struct", "module", "Which format character selects big-endian byte order, and which format characters "
     "are only available in native format?"),
    ("colorsys", "module", "What range do the inputs and outputs have, and which colour systems are supported?"),
    ("difflib", "module", "Which function gives a delta in unified diff format, and which class makes an HTML "
     "side-by-side comparison?"),
    ("functools.lru_cache", "function", "What does `typed=True` change, and how do I see or clear the cache "
     "statistics?"),
    ("difflib.get_close_matches", "function", "What do `n` and `cutoff` mean, and in what order are the matches "
     "returned?"),
]
RAG_ASK = [
    "Answer quoting the relevant sentences verbatim.",
    "Answer by quoting the relevant sentences of the passage word for word.",
    "Quote the sentences that answer it verbatim, then add one line of your own.",
]


def rag(rng: random.Random) -> list[tuple[str, str]]:
    out = []
    for name, kind, question in RAG:
        obj = importlib.import_module(name) if kind == "module" else getattr(
            importlib.import_module(name.rpartition(".")[0]), name.rpartition(".")[2])
        passage = inspect.cleandoc(obj.__doc__).strip()
        where = f"the docstring of Python's `{name}` module" if kind == "module" else f"the docstring of `{name}`"
        prompt = (f"Read this passage, {where}, and answer the question below. {rng.choice(RAG_ASK)}\n\n"
                  f"\"\"\"\n{passage}\n\"\"\"\n\nQuestion: {question}")
        out.append((prompt, f"{name} {kind} docstring {STDLIB}"))
    return out


# --- multi-turn ------------------------------------------------------------------------------

def chat(turns: list[tuple[str, str]]) -> str:
    return "\n\n".join(f"{who}: {text}" for who, text in turns)


def _text_modules() -> str:
    names = ["textwrap", "string", "shlex", "re", "difflib", "fnmatch", "csv", "unicodedata"]
    return "\n".join(f"- `{m}`: {summary(m).removeprefix('Module difflib -- ')}" for m in names)


def _months(year: int) -> str:
    return "\n".join(f"- {calendar.month_name[m]}: {calendar.monthrange(year, m)[1]} days" for m in range(1, 13))


def numbered(prompts) -> str:
    return "\n".join(f"{i}. {p.prompt.strip()}" for i, p in enumerate(prompts, 1))


def multi_turn(rng: random.Random, default) -> list[tuple[str, str]]:
    code = {q: fenced(source(q)) for q in ["string.capwords", "textwrap.indent", "shlex.quote", "shlex.join",
                                           "statistics.median_low", "statistics.median_high"]}
    # requests in a sentence, not bare code to complete: they read as items of a list
    short_code = [p for p in default if p.slice == "code" and len(p.prompt) < 260 and "\n" not in p.prompt.strip()]
    code_picks = sorted(rng.sample(short_code, 4), key=lambda p: p.id)
    json_picks = sorted(rng.sample([p for p in default if p.slice == "json" and len(p.prompt) < 260
                                    and "\n" not in p.prompt.strip()], 4),
                        key=lambda p: p.id)
    python_ones = [str(i) for i, p in enumerate(code_picks, 1) if "Python" in p.prompt]
    assert python_ones, "the follow-up question needs a Python prompt among the picks"
    harder = json_picks[1].prompt.strip() + " Also add a nested \"source\" object with \"name\" and \"url\" fields."
    convs = [
        ([("User", "How does `string.capwords` work? Show me its source."),
          ("Assistant", f"Here is the implementation from CPython's `string` module:\n\n{code['string.capwords']}\n\n"
                        "It splits the string into words, capitalises each with `str.capitalize` and joins them "
                        "again."),
          ("User", "Why does `capwords(\"hello   world\")` give `'Hello World'` with a single space?"),
          ("Assistant", "With `sep=None`, `s.split()` splits on runs of whitespace and drops empty strings, and "
                        "the words are joined with one space. Pass `sep=' '` to keep the spacing."),
          ("User", "Show me the function from your first answer again, with the parameter `sep` renamed to "
                   "`separator` everywhere, the docstring included.")],
         f"string.capwords {STDLIB}; {WRITTEN}"),
        ([("User", "Can you show me how `textwrap.indent` is written?"),
          ("Assistant", f"Sure, this is it:\n\n{code['textwrap.indent']}"),
          ("User", "Does it indent blank lines?"),
          ("Assistant", "No. Without a `predicate` it adds the prefix only to lines where `line.strip()` is "
                        "non-empty. Pass `predicate=lambda line: True` to indent every line."),
          ("User", "Please repeat the function, but with type hints (`predicate` is an optional callable that "
                   "takes a string and returns a bool).")],
         f"textwrap.indent {STDLIB}; {WRITTEN}"),
        ([("User", "What does `shlex.quote` do internally?"),
          ("Assistant", f"Here is its source:\n\n{code['shlex.quote']}\n\nStrings with only safe characters come "
                        "back as they are; anything else is wrapped in single quotes."),
          ("User", "And `shlex.join`?"),
          ("Assistant", f"{code['shlex.join']}\n\nIt quotes every argument with `quote` and joins them with spaces."),
          ("User", "Give me both functions again in one code block, with a comment above each `return` saying "
                   "what it returns.")],
         f"shlex.quote, shlex.join {STDLIB}; {WRITTEN}"),
        ([("User", "Show me `statistics.median_low`."),
          ("Assistant", code["statistics.median_low"]),
          ("User", "How is `median_high` different?"),
          ("Assistant", f"It returns the larger of the two middle values:\n\n{code['statistics.median_high']}"),
          ("User", "Go back to `median_low` from your first answer and give it to me again, raising ValueError "
                   "instead of StatisticsError. Keep everything else the same.")],
         f"statistics.median_low, statistics.median_high {STDLIB}; {WRITTEN}"),
        ([("User", "Which standard-library modules help with text processing? One line each."),
          ("Assistant", f"These are the main ones, with the first sentence of each module's docstring:\n\n"
                        f"{_text_modules()}"),
          ("User", "Which of them would you use to compare two files?"),
          ("Assistant", "`difflib`: `unified_diff(a, b)` and `context_diff(a, b)` return the delta between two "
                        "lists of lines, and `HtmlDiff` renders a side-by-side comparison."),
          ("User", "Repeat your first list, sorted alphabetically by module name and numbered.")],
         f"module docstrings {STDLIB}; {WRITTEN}"),
        ([("User", "List the months of 2024 with the number of days in each."),
          ("Assistant", _months(2024)),
          ("User", "How many days is that in total?"),
          ("Assistant", "366: 2024 is a leap year, so February has 29 days."),
          ("User", "Give me the same list for 2023, in the same format.")],
         f"calendar.month_name, calendar.monthrange {STDLIB}; {WRITTEN}"),
        ([("User", "I need a few prompts to test a code model with. Can you suggest some?"),
          ("Assistant", f"Here are four:\n\n{numbered(code_picks)}"),
          ("User", "Which of them are about Python?"),
          ("Assistant", f"Numbers {', '.join(python_ones)}." if len(python_ones) > 1 else f"Number {python_ones[0]}."),
          ("User", "Repeat the whole list, adding \"(Python)\" at the end of each Python prompt.")],
         f"default suite prompts {', '.join(p.id for p in code_picks)} (verispec); {WRITTEN}"),
        ([("User", "Give me some test prompts that ask for JSON output."),
          ("Assistant", f"Here are four:\n\n{numbered(json_picks)}"),
          ("User", "Can you make the second one harder?"),
          ("Assistant", harder),
          ("User", "Put that harder version into your first list in place of the second prompt and give me the "
                   "full list again.")],
         f"default suite prompts {', '.join(p.id for p in json_picks)} (verispec); {WRITTEN}"),
    ]
    return [(chat(turns), made) for turns, made in convs]


# --- agentic ---------------------------------------------------------------------------------

AGENT_SYSTEM = "\n".join([
    "System: You are a coding agent working in a checkout of CPython's Lib/ directory. Call one tool per step, "
    'written as one line of JSON: {"tool": NAME, "arguments": {...}}. Its result follows as JSON. Tools:',
    "- search_modules(query: str): standard-library modules whose name or summary contains the query.",
    "- list_dir(path: str): the files in a directory under Lib/, with their sizes in bytes.",
    "- run_tests(target: str): runs a test package under Lib/test/ and returns its summary.",
    'Finish with {"tool": "finish", "arguments": {"answer": TEXT}}.',
])

SEARCHABLE = ["base64", "bisect", "calendar", "csv", "difflib", "fnmatch", "glob", "heapq", "html.parser",
              "json", "json.decoder", "json.encoder", "json.scanner", "json.tool", "re", "shlex", "shutil",
              "sqlite3", "statistics", "string", "tempfile", "textwrap", "urllib.error", "urllib.parse",
              "urllib.request", "urllib.response", "zlib"]

# made up, and the same report each time the same target runs: an agent sees that too
TEST_RUNS = {
    "test_json": {"target": "test_json", "ran": 184, "failures": 1, "errors": 0, "skipped": 2, "failed": [
        "test_float.TestPyFloat.test_allow_nan: AssertionError: 'NaN' != 'nan'"]},
    "test_urlparse": {"target": "test_urlparse", "ran": 101, "failures": 0, "errors": 0, "skipped": 0, "failed": []},
    "test_shlex": {"target": "test_shlex", "ran": 30, "failures": 0, "errors": 0, "skipped": 0, "failed": []},
    "test_textwrap": {"target": "test_textwrap", "ran": 88, "failures": 1, "errors": 0, "skipped": 0, "failed": [
        "IndentTestCase.test_indent_empty_lines: AssertionError: '  \\n' != '\\n'"]},
    "test_sqlite3": {"target": "test_sqlite3", "ran": 478, "failures": 0, "errors": 0, "skipped": 6, "failed": []},
}

AGENT_TASKS = [
    ("A user says `json.loads` accepts `NaN` where their service expects an error. Find where the decoder is "
     "implemented and check whether the json tests pass.",
     [("search_modules", "json"), ("list_dir", "Lib/json"), ("run_tests", "test_json")]),
    ("Find the module that splits a command line the way a POSIX shell does, and check that its tests pass.",
     [("search_modules", "shell"), ("run_tests", "test_shlex")]),
    ("A user reports that `urllib.parse.urljoin` drops the last path segment of the base URL. Find the module "
     "and run its tests.",
     [("search_modules", "url"), ("list_dir", "Lib/urllib"), ("run_tests", "test_urlparse")]),
    ("Find the file that implements the json encoder and report whether the json tests pass.",
     [("list_dir", "Lib/json"), ("search_modules", "json"), ("run_tests", "test_json")]),
    ("The CI job for the json package failed. Find which file holds the code under the failing test.",
     [("run_tests", "test_json"), ("list_dir", "Lib/json"), ("search_modules", "json")]),
    ("Find a standard-library module that wraps text to a given width and check its tests.",
     [("search_modules", "text"), ("run_tests", "test_textwrap")]),
    ("Check that the sqlite3 package ships its dump helper and that its tests pass.",
     [("list_dir", "Lib/sqlite3"), ("search_modules", "sqlite"), ("run_tests", "test_sqlite3")]),
    ("Find the standard-library modules for fetching URLs and list the files of the package they live in.",
     [("search_modules", "url"), ("list_dir", "Lib/urllib"), ("run_tests", "test_urlparse")]),
]


def tool_result(tool: str, arg: str) -> dict:
    if tool == "search_modules":
        hits = [{"module": m, "summary": summary(m)} for m in SEARCHABLE
                if arg.lower() in m.lower() or arg.lower() in summary(m).lower()]
        return {"query": arg, "results": hits[:5]}
    if tool == "list_dir":
        root = Path(sysconfig.get_paths()["stdlib"]) / arg.removeprefix("Lib/")
        files = [f for f in sorted(os.listdir(root)) if f.endswith(".py")]
        return {"path": arg, "entries": [{"name": f, "size": os.path.getsize(root / f)} for f in files]}
    return TEST_RUNS[arg]


ARG_NAME = {"search_modules": "query", "list_dir": "path", "run_tests": "target"}


def agentic() -> list[tuple[str, str]]:
    out = []
    for task, steps in AGENT_TASKS:
        lines = [AGENT_SYSTEM, f"User: {task}"]
        for i, (tool, arg) in enumerate(steps, 1):
            call = json.dumps({"tool": tool, "arguments": {ARG_NAME[tool]: arg}})
            lines.append(f"Step {i}\nCall: {call}\nResult: {json.dumps(tool_result(tool, arg))}")
        lines.append("Next action:")
        out.append(("\n\n".join(lines), "agent transcript written for this suite; search_modules over module "
                    f"docstrings and list_dir of Lib/ {STDLIB}; run_tests results made up"))
    return out


# --- json ------------------------------------------------------------------------------------

JSON_ASK = [
    "Return the full JSON document, nothing else.",
    "Give me back the whole document as JSON, with no commentary.",
    "Reply with the complete JSON only.",
]


def json_docs(rng: random.Random, default) -> list[tuple[str, str]]:
    docs = []  # (document, style, request, made_from)
    weekdays = {"calendar": "Gregorian", "first_weekday": calendar.day_name[calendar.firstweekday()],
                "days": [{"index": i, "name": calendar.day_name[i], "abbr": calendar.day_abbr[i],
                          "weekend": i >= 5} for i in range(7)]}
    docs.append((weekdays, "records", "Rename the key \"abbr\" to \"short_name\" in every record.",
                 f"calendar.day_name, calendar.day_abbr {STDLIB}"))
    years = {"years": [{"year": y, "months": [
        {"month": calendar.month_name[m], "days": calendar.monthrange(y, m)[1],
         "starts_on": calendar.day_name[calendar.monthrange(y, m)[0]]} for m in range(1, 13)]} for y in (2023, 2024)]}
    docs.append((years, "table", "Within each year, sort the months by number of days, fewest first, keeping "
                 "calendar order among months with the same number of days.", f"calendar.monthrange {STDLIB}"))
    consts = [{"name": name, "value": getattr(string, name)} for name in
              ["whitespace", "ascii_lowercase", "ascii_uppercase", "ascii_letters", "digits", "hexdigits",
               "octdigits", "punctuation"]]
    docs.append(({"module": "string", "constants": consts}, "records",
                 "Convert \"constants\" from a list of records into one object that maps each name to its "
                 "value, in the same order.", f"string constants {STDLIB}"))
    chars = ["é", "ß", "Ω", "€", "½", "—", "ñ", "ü", "∞"]
    records = [{"char": c, "codepoint": f"U+{ord(c):04X}", "name": unicodedata.name(c),
                "category": unicodedata.category(c)} for c in chars]
    docs.append(({"unidata_version": unicodedata.unidata_version, "characters": records}, "records",
                 "Add a field \"is_letter\" to every character record: true when its category starts with "
                 "\"L\", false otherwise.", f"unicodedata {STDLIB}"))
    picks = sorted(rng.sample([p for p in default if len(p.prompt) < 400], 8), key=lambda p: p.id)
    docs.append(({"suite": "default", "prompts": [{"id": p.id, "slice": p.slice, "chars": len(p.prompt),
                                                   "words": len(p.prompt.split())} for p in picks]}, "records",
                 "Sort the prompts by \"chars\", longest first.",
                 f"default suite prompts {', '.join(p.id for p in picks)} (verispec)"))
    groups: dict[str, list[str]] = {}
    for p in default:
        groups.setdefault(p.slice, []).append(p.id)
    chosen = sorted(rng.sample(sorted(groups), 5))
    docs.append(({"suite": "default", "slices": {s: groups[s][:4] for s in chosen}}, "tall",
                 "Convert \"slices\" into a flat list \"prompts\" of records {\"id\": ..., \"slice\": ...}, "
                 "in the same order.", f"default suite ids of slices {', '.join(chosen)} (verispec)"))
    colours = {"red": (1.0, 0.0, 0.0), "orange": (1.0, 0.5, 0.0), "gold": (1.0, 0.84, 0.0), "teal": (0.0, 0.5, 0.5),
               "navy": (0.0, 0.0, 0.5), "violet": (0.93, 0.51, 0.93), "grey": (0.5, 0.5, 0.5), "olive": (0.5, 0.5, 0.0)}
    docs.append(({"space": "RGB and HSV, components in [0, 1]", "colours": [
        {"name": n, "rgb": list(rgb), "hsv": [round(v, 4) for v in colorsys.rgb_to_hsv(*rgb)]}
        for n, rgb in colours.items()]}, "records",
        "Add a field \"hex\" to every colour: the #rrggbb string of its \"rgb\" (each component times 255, "
        "rounded).", f"colorsys.rgb_to_hsv {STDLIB}"))
    packages = {"json": ["json.decoder", "json.encoder", "json.scanner", "json.tool"],
                "email": ["email.header", "email.message", "email.parser", "email.utils"],
                "importlib": ["importlib.abc", "importlib.machinery", "importlib.util"]}
    docs.append(({"packages": [{"name": pkg, "summary": summary(pkg), "modules": [
        {"name": m, "summary": summary(m)} for m in mods]} for pkg, mods in packages.items()]}, "table",
        "Rename the key \"summary\" to \"description\" everywhere, in the packages and in their modules.",
        f"module docstrings of json, email and importlib {STDLIB}"))
    out = []
    for doc, style, ask, made in docs:
        text = dump(doc, style)
        assert 20 <= len(text.splitlines()) <= 60, (made, len(text.splitlines()))
        out.append((f"{fenced(text, 'json')}\n\n{ask} {rng.choice(JSON_ASK)}", made))
    return out


# --- the file --------------------------------------------------------------------------------

def build() -> list[dict]:
    """The suite's records, in file order; each slice's maker returns (prompt, made_from) pairs."""
    rng = random.Random(0)
    default = load_suite("default")
    made = {"code-edit": code_edit(rng), "rag": rag(rng), "multi-turn": multi_turn(rng, default),
            "agentic": agentic(), "json": json_docs(rng, default)}
    records = []
    for slice_ in SLICES:
        assert len(made[slice_]) == PER_SLICE, slice_
        for i, (prompt, made_from) in enumerate(made[slice_], 1):
            assert len(prompt) < MAX_CHARS, (slice_, i, len(prompt))
            records.append({"id": f"{slice_}-{i:02d}", "slice": slice_, "prompt": prompt, "made_from": made_from})
    return records


def write(path: Path) -> list[dict]:
    records = build()
    Path(path).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return records


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT, help="where to write the JSONL (default: the packaged file)")
    args = ap.parse_args(argv)
    records = write(args.out)
    for slice_ in SLICES:
        sizes = [len(r["prompt"]) for r in records if r["slice"] == slice_]
        print(f"{slice_:<11} {len(sizes)} prompts, mean {sum(sizes) / len(sizes):.0f} characters "
              f"(min {min(sizes)}, max {max(sizes)})")
    print(f"wrote {args.out} with {PYTHON}")


if __name__ == "__main__":
    main()
