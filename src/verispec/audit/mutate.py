"""Prompt edits that defeat drafters, for the speedup-floor search (audit/floor.py).

Each edit takes a prompt and a seeded random.Random and returns a new prompt; the same
prompt, seed and edit give the same text. They aim at what a drafter relies on:

* ``identifiers``: words of the prompt replaced by fresh random identifiers, so that no
  drafter has seen the tokens the answer must repeat (a draft model's prior, a suffix
  cache's history);
* ``script``: the answer asked for in a rare language or script (Georgian, Amharic,
  Tibetan, ...), where a small draft model and a shallow layer-skip disagree with the
  target most;
* ``shuffle``: the prompt's list items or sentences in a new order, and the answer asked
  for in another order again, so that what the answer copies comes out of order;
* ``paraphrase``: quoting forbidden, so that lookup finds no run to copy;
* ``trap``: a phrase set up in the prompt with one continuation and asked for again with
  others (``The next value is 4821.`` then eight more values), so that prompt lookup and
  any n-gram or suffix drafter match the phrase and propose the old continuation, which
  the target rejects each time: the drafts are paid for and thrown away;
* ``splice``: another prompt's task added, which lets the search combine what works.

The search keeps the edits that lower acceptance (floor.py); `MUTATIONS` names them all.
"""

from __future__ import annotations

import random
import re
from typing import Callable

# scripts and languages a model of the sizes we audit writes poorly and a draft disagrees on
_SCRIPTS = ("Georgian (Mkhedruli script)", "Amharic (Ge'ez script)", "Tibetan", "Khmer", "Sinhala",
            "Armenian", "the Cherokee syllabary", "Inuktitut syllabics", "Tamil", "Mongolian (Cyrillic)",
            "Yoruba with full tone marks", "Old Norse in runes")
_NO_QUOTE = ("Do not quote or copy any phrase from the text above; put everything in your own words.",
             "Never reuse a word sequence from this message: paraphrase every sentence with synonyms.",
             "Restate each point in different words than the question uses, without copying phrases.")
_ORDER = ("Present the items in a new random order, never in the order given.",
          "Answer the parts in reverse order, and reword each one.",
          "List everything in an order of your own choosing, not the order above.")
_TRAPS = ("The next value is {v}.", "Code {i}: {v}", "The key for room {i} is {v}.", "Result of step {i} = {v}",
          "Order {i} ships on day {v}.", "Token {i} maps to {v}.")
_WORD = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{3,}\b")
_STOP = {"with", "that", "this", "from", "into", "what", "when", "then", "than", "them", "they", "each",
         "your", "have", "will", "does", "there", "their", "which", "about", "would", "should", "could",
         "write", "return", "every", "other", "these", "those", "only", "also", "some", "make", "more"}


def fresh_identifier(rng: random.Random) -> str:
    """A random identifier no tokenizer has a token for: consonant runs, digits, an underscore."""
    cons, vows = "bcdfghjklmnpqrstvwxzBCDFGHJKLMNPQRSTVWXZ", "aeiouy"
    parts = [rng.choice(cons) + rng.choice(vows) + rng.choice(cons) + rng.choice(cons) for _ in range(rng.randint(1, 2))]
    return "_".join(parts) + str(rng.randint(10, 999))


def identifiers(text: str, rng: random.Random, donors: list[str]) -> str:
    words = sorted({w for w in _WORD.findall(text) if w.lower() not in _STOP})
    if not words:
        names = ", ".join(fresh_identifier(rng) for _ in range(4))
        return f"{text}\n\nName every variable, item and person with new identifiers such as {names}."
    for w in rng.sample(words, min(len(words), rng.randint(2, 4))):
        text = re.sub(rf"\b{re.escape(w)}\b", fresh_identifier(rng), text)
    return text


def script(text: str, rng: random.Random, donors: list[str]) -> str:
    return f"{text}\n\nWrite your whole answer in {rng.choice(_SCRIPTS)}."


def shuffle(text: str, rng: random.Random, donors: list[str]) -> str:
    lines = text.split("\n")
    items = [i for i, ln in enumerate(lines) if ln.strip()]
    if len(items) >= 3:  # one item per line: the lines move, blank lines stay
        moved = [lines[i] for i in items]
        rng.shuffle(moved)
        for i, ln in zip(items, moved):
            lines[i] = ln
        text = "\n".join(lines)
    else:
        parts = re.split(r"(?<=[.!?])\s+|,\s+", text)
        if len(parts) >= 3:
            rng.shuffle(parts)
            text = " ".join(parts)
    return f"{text}\n\n{rng.choice(_ORDER)}"


def paraphrase(text: str, rng: random.Random, donors: list[str]) -> str:
    return f"{text}\n\n{rng.choice(_NO_QUOTE)}"


def trap(text: str, rng: random.Random, donors: list[str]) -> str:
    form = rng.choice(_TRAPS)
    n = rng.randint(6, 10)
    seen = form.format(i=1, v=rng.randint(1000, 9999))
    asked = form.format(i="N", v="<a new random 4-digit number>")
    return (f"{text}\n\nFirst, copy this line exactly: {seen}\nThen write {n} more lines of the form "
            f"\"{asked}\", counting N up from 2, each with a different number.")


def splice(text: str, rng: random.Random, donors: list[str]) -> str:
    others = [d for d in donors if d != text]
    if not others:
        return paraphrase(text, rng, donors)
    other = rng.choice(others)
    return f"{text}\n\nThen, separately: {other[:600]}"


MUTATIONS: dict[str, Callable[[str, random.Random, list[str]], str]] = {
    "identifiers": identifiers, "script": script, "shuffle": shuffle, "paraphrase": paraphrase,
    "trap": trap, "splice": splice}


def mutate(text: str, rng: random.Random, donors: list[str], names: tuple[str, ...] | None = None) -> tuple[str, str]:
    """One edit chosen by rng among `names` (default: all): (new prompt, the edit's name)."""
    pool = list(names or MUTATIONS)
    for name in pool:
        if name not in MUTATIONS:
            raise ValueError(f"unknown mutation {name!r}; known: {', '.join(MUTATIONS)}")
    name = rng.choice(pool)
    return MUTATIONS[name](text, rng, donors), name
