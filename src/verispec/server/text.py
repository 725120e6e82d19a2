"""Token ids -> text for the HTTP side: incremental detokenization and stop strings.

Both run on the event loop, outside the engine step: the engine only knows token ids
and stop *token* ids; stop *strings* cut the text here and then cancel the row.
"""

from __future__ import annotations

import os

REPLACEMENT = "\ufffd"  # what a decoder shows for an incomplete UTF-8 sequence
# a UTF-8 character spans at most 4 byte tokens: past this many tokens held back, the text
# is sent as the decoder shows it (invalid bytes stay U+FFFD), so holding stays bounded
MAX_HELD_TOKENS = 8


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas whose concatenation is the text.

    A byte-level tokenizer can split one character over several tokens; a delta is held
    back while the decoded text ends in U+FFFD (an incomplete character) and sent once
    the character completes, or at flush() as whatever the decoder then shows. A delta
    is also held while decoding the new tokens changes text already sent (a tokenizer
    that cleans up spaces around punctuation). Decoding restarts from ``prefix`` (the
    last emitted boundary), so each call decodes a few tokens, not the whole output;
    after MAX_HELD_TOKENS tokens held back (bytes that never form a character) the
    held text is sent as it decodes, so a call never decodes more than that many.
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
            if len(self.ids) - self.read > MAX_HELD_TOKENS:
                return self.flush()
            return ""  # wait for the rest of the character
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        """The text of ids not yet emitted, incomplete characters included (end of output,
        or too many tokens held). Text already sent is never repeated: where decoding the
        new ids changed it, the delta starts after the part that still agrees."""
        if len(self.ids) == self.read:
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        if text.startswith(before):
            return text[len(before):]
        return text[len(os.path.commonprefix([before, text])):]


def _failure(s: str) -> list[int]:
    """KMP failure function: f[i] = length of the longest proper prefix of s[:i+1] that is
    also a suffix of it."""
    f = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


class StopStrings:
    """Cuts text at the first stop string to complete (OpenAI `stop`).

    feed() returns the text that is safe to send now: a tail that could still grow into
    a stop string is held back, so streamed text never has to be taken back. "First"
    means the occurrence that ends first (the one a token-by-token generator meets
    first; among those ending at the same character, the longest), so the answer does
    not depend on how the text was split into deltas.

    Cost: one Knuth-Morris-Pratt automaton per stop string, advanced one character at a
    time: amortised O(number of stops) per character however long the output and the
    stop strings; the held tail is at most the longest stop string minus one.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)  # per stop: longest suffix of the text that is its prefix
        self._sent: list[str] = []  # text already returned by feed(), in pieces
        self._held = ""  # decoded text not yet returned: a tail that may start a stop string
        self._text: str | None = ""  # cache of text
        self.hit = False

    @property
    def text(self) -> str:
        """Everything decoded so far (cut at the stop once found)."""
        if self._text is None:
            self._text = "".join(self._sent) + self._held
        return self._text

    def _send(self, out: str) -> str:
        if out:
            self._sent.append(out)
        self._text = None
        return out

    def _advance(self, delta: str) -> int:
        """Feed delta to the automata; returns the length of delta consumed up to and
        including the end of the first stop string completed, and sets self.hit (then
        self._stop_len is that stop's length); len(delta) when none completes."""
        stops, fails, state = self.stops, self._fail, self._state
        for i, ch in enumerate(delta):
            best = 0
            for j, s in enumerate(stops):
                k = state[j]
                while k and s[k] != ch:
                    k = fails[j][k - 1]
                if s[k] == ch:
                    k += 1
                if k == len(s):
                    best = max(best, k)
                    k = fails[j][k - 1]
                state[j] = k
            if best:
                self.hit, self._stop_len = True, best
                return i + 1
        return len(delta)

    def feed(self, delta: str, final: bool = False) -> tuple[str, bool]:
        """Add decoded text; returns (text to send now, whether a stop string was hit)."""
        if self.hit:
            return "", True  # nothing after the stop
        if not self.stops:
            return self._send(delta), False
        n = self._advance(delta)
        pending = self._held + delta[:n]
        if self.hit:  # the stop starts within pending (what came before it held no prefix of it)
            self._held = ""
            return self._send(pending[:len(pending) - self._stop_len]), True
        if final:  # the end: everything goes out, and no later text can complete a stop
            self._state = [0] * len(self.stops)
        keep = max(self._state)
        self._held = pending[len(pending) - keep:] if keep else ""
        return self._send(pending[:len(pending) - keep]), False
