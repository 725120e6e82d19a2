"""Token ids -> text for the HTTP side: incremental detokenization and stop strings.

Both run on the event loop, outside the engine step: the engine only knows token ids
and stop *token* ids; stop *strings* cut the text here and then cancel the row.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a decoder shows for an incomplete UTF-8 sequence


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas whose concatenation is the text.

    A byte-level tokenizer can split one character over several tokens; a delta is held
    back while the decoded text ends in U+FFFD (an incomplete character) and sent once
    the character completes, or at flush() as whatever the decoder then shows.
    Decoding restarts from ``prefix`` (the last emitted boundary), so each call decodes a
    few tokens, not the whole output.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to text already emitted
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        if len(self.ids) == self.read:
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if text.endswith(REPLACEMENT) or len(text) < len(before) or not text.startswith(before):
            return ""  # wait for the rest of the character
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        """The text of ids not yet emitted, incomplete characters included (end of output)."""
        if len(self.ids) == self.read:
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):] if text.startswith(before) else text


class StopStrings:
    """Cuts text at the first occurrence of any stop string (OpenAI `stop`).

    feed() returns the text that is safe to send now: a tail that could still grow
    into a stop string is held back, so streamed text never has to be taken back.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""  # everything decoded so far (cut at the stop once found)
        self.sent = 0  # characters of text already returned

    def _held(self) -> int:
        """Length of the longest tail of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def feed(self, delta: str, final: bool = False) -> tuple[str, bool]:
        """Add decoded text; returns (text to send now, whether a stop string was hit)."""
        if not self.stops:
            self.text += delta
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, False
        # a match must end inside the new text, so it starts at most len(stop)-1 before it
        start = max(0, len(self.text) - max(map(len, self.stops)) + 1)
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i != -1]
        if hits:
            self.text = self.text[:min(hits)]
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, True
        safe = len(self.text) if final else max(self.sent, len(self.text) - self._held())
        out, self.sent = self.text[self.sent:safe], safe
        return out, False
