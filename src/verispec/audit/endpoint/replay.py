"""A server's prompt-lookup drafts, replayed from outside.

A prompt-lookup drafter (vLLM's ``ngram``) proposes from the context alone, so its drafts
at every step are a function of the prompt and the tokens emitted so far: given an answer's
token ids, the audit can recompute each step's drafts and read off, position by position,
which were accepted. With a one-hot draft (q = 1 at d), the exact rule accepts a drafted
token d with probability p(d) and, on a rejection, draws from the residual, which excludes
d. So an answer's tokens decide its steps: a step that drafted d_1..d_n accepted the longest
prefix of the drafts that the answer repeats, then emitted one more token (recovered after a
rejection, bonus after a full acceptance), and the next step drafts from the context then.

The replay is checked against the server's own speculative counters (drafts, draft tokens,
accepted tokens over the same requests): equal counts mean the replay is the server's
drafter; unequal ones mean it is not (another configuration, another drafter), and nothing is
inferred from it (audit/counter_fidelity.py says which).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class NgramDrafter:
    """vLLM's ``ngram`` proposer (vllm/v1/spec_decode/ngram_proposer.py in 0.32.0): the
    longest suffix of the context of length min_n..max_n (capped at max_n) that occurs
    earlier, at its earliest occurrence, and up to k tokens that followed it (fewer where the
    context ends sooner; none within k of max_model_len)."""

    k: int = 4
    min_n: int = 2
    max_n: int = 4
    max_model_len: int = 4096

    @property
    def label(self) -> str:
        return f"vLLM ngram k={self.k} prompt_lookup_min={self.min_n} prompt_lookup_max={self.max_n}"

    def propose(self, ctx: list[int]) -> list[int]:
        total = len(ctx)
        k = min(self.k, self.max_model_len - total)
        if total < self.min_n or k <= 0:
            return []
        best_len, best_start = 0, -1
        # the occurrence starting at s matches the suffix over the longest L (<= max_n) with
        # ctx[s:s+L] == ctx[total-L:] and s + L <= total - 1 (it ends before the last token, as
        # the proposer's proper-border search requires); the earliest s of the longest L wins
        for s in range(total - 2, -1, -1):
            length = next((n for n in range(min(self.max_n, total - 1 - s), 0, -1)
                           if ctx[s:s + n] == ctx[total - n:]), 0)
            if length and length >= best_len:
                best_len, best_start = length, s
        if best_len < self.min_n:
            return []
        start = best_start + best_len
        return list(ctx[start:start + min(k, total - start)])


@dataclass
class Step:
    """One verification step as the answer shows it: the drafts, how many the answer
    accepted, whether the position after them is visible (a rejection or a bonus token), and
    the answer's index of the first drafted position."""

    at: int
    drafts: list[int]
    accepted: int
    complete: bool  # False: the answer ends inside the step (length, stop or EOS)


@dataclass
class Replay:
    """An answer's steps, and the counters they imply."""

    steps: list[Step] = field(default_factory=list)
    plain_steps: int = 0  # steps that drafted nothing (one token each; the prefill's first token included)

    @property
    def drafts(self) -> int:
        return len(self.steps)

    @property
    def draft_tokens(self) -> int:
        return sum(len(s.drafts) for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    def outcomes(self) -> list[tuple[int, int, bool]]:
        """(answer index, drafted token, accepted) for every drafted position the answer
        shows: the accepted ones, and the first rejected one of each step that was not cut."""
        out = []
        for s in self.steps:
            out += [(s.at + j, s.drafts[j], True) for j in range(s.accepted)]
            if s.complete and s.accepted < len(s.drafts):
                out.append((s.at + s.accepted, s.drafts[s.accepted], False))
        return out


def replay(drafter: NgramDrafter, prompt: list[int], answer: list[int]) -> Replay:
    """The steps of one answer (its token ids) under the drafter, from the prompt's ids. The
    first token comes from the prefill (nothing drafted); every later step drafts from the
    context so far and emits its accepted drafts plus one token."""
    out = Replay()
    if not answer:
        return out
    ctx = list(prompt) + [answer[0]]
    out.plain_steps = 1
    i = 1
    while i < len(answer):
        d = drafter.propose(ctx)
        if not d:
            out.plain_steps += 1
            ctx.append(answer[i])
            i += 1
            continue
        j = 0
        while j < len(d) and i + j < len(answer) and answer[i + j] == d[j]:
            j += 1
        out.steps.append(Step(i, d, j, complete=i + j < len(answer)))
        n = min(j + 1, len(answer) - i)
        ctx += answer[i:i + n]
        i += n
    return out
