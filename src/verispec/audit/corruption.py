"""Corruption signatures: what a broken ragged batch turns output into.

Misaligned positions or KV lengths make a model loop, stutter one character, drift into
text the model itself finds improbable, or stop early. Models also repeat legitimately,
so a speculative output is judged against the reference output for the same prompt: a
signature counts only when the speculative output shows it and the reference does not.

The signature functions are pure (token ids, text, numbers in; numbers out);
`continuation_perplexity` runs the target once, and `corruption_check` applies them to the
audit's greedy runs; `endpoint_corruption_check` applies them from outside, on the
reference's tokens, against the deployment's own null.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

import torch

from .checks import CheckResult
from .endpoint.state import EndpointAudit
from .endpoint.client import EndpointRun, PromptResult
from .endpoint.tokens import ReferenceTokens
from .equivalence import prefix_cache, teacher_forced_logits

LOOP_MIN_REPEATS = 4  # a unit repeated at least this many times back to back ...
LOOP_MIN_SPAN = 16  # ... covering at least this many tokens, at the end of the output
LOOP_MAX_PERIOD = 32
NGRAM = 4
REPETITIVE_FRACTION = 0.5  # share of 4-grams seen earlier in the same output
REPETITIVE_MARGIN = 0.25  # ... and this much above the reference's share
CHAR_RUN = 20  # one character this many times in a row
PPL_RATIO = 2.0  # continuation perplexity this many times the reference's
EARLY_STOP_RATIO = 0.5  # stopped with fewer than this share of the reference's tokens
EARLY_STOP_MIN_REF = 8  # ... when the reference ran at least this long


def tail_loop(tokens: list[int], max_period: int = LOOP_MAX_PERIOD, min_repeats: int = LOOP_MIN_REPEATS,
              min_span: int = LOOP_MIN_SPAN) -> tuple[int, int] | None:
    """(period, repeats) of the shortest unit that ends the output repeated back to back at
    least min_repeats times over at least min_span tokens; None when the tail is no loop."""
    n = len(tokens)
    for p in range(1, min(max_period, n // min_repeats) + 1):
        span = p  # tokens at the end that are periodic with period p
        while span < n and tokens[n - 1 - span] == tokens[n - 1 - span + p]:
            span += 1
        repeats = span // p
        if repeats >= min_repeats and repeats * p >= min_span:
            return p, repeats
    return None


def repeated_ngram_fraction(tokens: list[int], n: int = NGRAM) -> float:
    """Share of the output's n-grams that already occurred earlier in it (0 for short outputs)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    seen, repeated = set(), 0
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated / len(grams)


def longest_char_run(text: str) -> tuple[int, str]:
    """Length and character of the longest run of one character in text."""
    best, best_c, run = 0, "", 0
    for i, c in enumerate(text):
        run = run + 1 if i and text[i - 1] == c else 1
        if run > best:
            best, best_c = run, c
    return best, best_c


def continuation_perplexity(model, prompt: list[int], output: list[int], prefixes=None) -> float | None:
    """exp(mean negative log-likelihood) of output given prompt under model (temperature 1).
    prefixes: prompt prefills to reuse (equivalence.prefix_cache)."""
    if not output:
        return None
    seq = prompt + output
    logits = teacher_forced_logits(model, seq[:-1], first=len(prompt) - 1, prefixes=prefixes)  # [len(output),V]
    logp = torch.log_softmax(logits.double(), dim=-1)
    nll = -logp.gather(-1, torch.tensor(output)[:, None]).mean()
    return math.exp(float(nll))  # sync: one scalar per output


@dataclass(frozen=True)
class Signatures:
    tokens: int
    stopped: bool  # ended on a stop token
    loop: tuple[int, int] | None  # (period, repeats) at the end
    repeated_fraction: float
    char_run: int
    char_run_char: str
    perplexity: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def signatures(output: list[int], text: str, stopped: bool, perplexity: float | None) -> Signatures:
    run, c = longest_char_run(text)
    return Signatures(tokens=len(output), stopped=stopped, loop=tail_loop(output),
                      repeated_fraction=round(repeated_ngram_fraction(output), 4),
                      char_run=run, char_run_char=c, perplexity=perplexity)


@dataclass(frozen=True)
class Flag:
    """One corruption signature an output shows and its reference does not."""

    kind: str  # "loop" | "repeated" | "char_run" | "perplexity" | "early_stop"
    severity: float  # how far past its threshold, in the signature's own unit (comparable within a kind)
    message: str


def signature_flags(got: Signatures, ref: Signatures, min_tokens: int = 0) -> list[Flag]:
    """The corruption signatures got shows and the reference ref does not (empty: clean).
    min_tokens: the repeated-4-gram and perplexity signatures need an output at least this
    long (a short answer's share of repeats and mean log-likelihood are too noisy to judge)."""
    flags = []
    long_enough = got.tokens >= min_tokens
    if got.loop and not ref.loop:
        flags.append(Flag("loop", got.loop[0] * got.loop[1],
                          f"repetition loop: a {got.loop[0]}-token unit x{got.loop[1]} at the end"))
    if (long_enough and got.repeated_fraction >= REPETITIVE_FRACTION
            and got.repeated_fraction > ref.repeated_fraction + REPETITIVE_MARGIN):
        flags.append(Flag("repeated", got.repeated_fraction - ref.repeated_fraction,
                          f"repeated {NGRAM}-grams: {got.repeated_fraction:.0%} of the output "
                          f"(reference {ref.repeated_fraction:.0%})"))
    if got.char_run >= CHAR_RUN and ref.char_run < CHAR_RUN:
        flags.append(Flag("char_run", got.char_run, f"character run: {got.char_run_char!r} x{got.char_run}"))
    if (long_enough and got.perplexity is not None and ref.perplexity is not None
            and got.perplexity > PPL_RATIO * ref.perplexity):
        flags.append(Flag("perplexity", got.perplexity / ref.perplexity,
                          f"perplexity {got.perplexity:.2f} > {PPL_RATIO:g}x the reference's {ref.perplexity:.2f}"))
    if (got.stopped and ref.tokens >= EARLY_STOP_MIN_REF
            and got.tokens < EARLY_STOP_RATIO * ref.tokens):
        flags.append(Flag("early_stop", ref.tokens / max(1, got.tokens),
                          f"early stop: {got.tokens} tokens where the reference has {ref.tokens}"))
    return flags


def new_signatures(got: Signatures, ref: Signatures) -> list[str]:
    """The corruption signatures got shows and the reference ref does not (empty: clean)."""
    return [f.message for f in signature_flags(got, ref)]


def corruption_check(ctx, runs) -> CheckResult:
    """Signatures of every greedy speculative output against its reference's
    (ctx: AuditContext, runs: GreedyRuns)."""
    ppl: dict[tuple[int, tuple[int, ...]], float | None] = {}
    prefixes = prefix_cache()  # each prompt prefilled once for its reference and its outputs

    def sig(i: int, req) -> Signatures:
        key = (i, tuple(req.output_ids))
        if key not in ppl:
            ppl[key] = continuation_perplexity(ctx.model, ctx.prompt_ids[i], req.output_ids, prefixes)
        return signatures(req.output_ids, ctx.decode(req.output_ids), req.finish_reason == "stop", ppl[key])

    total = len(runs.reference) + sum(len(v) for v in runs.speculative.values())
    flagged, per_batch = [], []
    with ctx.progress.stage("corruption signatures", total) as bar:
        refs = []
        for i, r in enumerate(runs.reference):
            refs.append(sig(i, r))
            bar.advance()
        for b, reqs in sorted(runs.speculative.items()):
            n_flagged = 0
            for i, r in enumerate(reqs):
                bar.advance()
                if r.output_ids == runs.reference[i].output_ids:
                    continue  # identical output: identical signatures
                flags = new_signatures(sig(i, r), refs[i])
                if flags:
                    n_flagged += 1
                    flagged.append({"batch": b, "id": ctx.prompts[i].id, "slice": ctx.prompts[i].slice,
                                    "signatures": flags, "text": ctx.decode(r.output_ids)[-200:]})
            per_batch.append({"batch": b, "outputs": len(reqs), "flagged": n_flagged})
    ref_ppl = [s.perplexity for s in refs if s.perplexity is not None]
    reference_own = {"loops": sum(s.loop is not None for s in refs),
                     "char_runs": sum(s.char_run >= CHAR_RUN for s in refs),
                     "repetitive": sum(s.repeated_fraction >= REPETITIVE_FRACTION for s in refs),
                     "median_perplexity": sorted(ref_ppl)[len(ref_ppl) // 2] if ref_ppl else None}
    passed = not flagged
    n_out = sum(r["outputs"] for r in per_batch)
    summary = (f"no new corruption signature in {n_out} speculative outputs" if passed
               else f"{len(flagged)} of {n_out} speculative outputs show signatures their reference lacks")
    figures = {"outputs_checked": n_out, "flagged": len(flagged), "reference_own_signatures": reference_own,
               "thresholds": {"loop": f"unit <= {LOOP_MAX_PERIOD} tokens x >= {LOOP_MIN_REPEATS}, "
                                      f">= {LOOP_MIN_SPAN} tokens at the end",
                              "repeated_4gram_fraction": REPETITIVE_FRACTION, "char_run": CHAR_RUN,
                              "perplexity_ratio": PPL_RATIO, "early_stop_ratio": EARLY_STOP_RATIO}}
    return CheckResult(passed, summary, figures,
                       {"per_batch": per_batch, "flagged": flagged[:50]})


# -- from outside (endpoint mode: the state in endpoint/state.py) ------------------------------
def endpoint_corruption_check(a: EndpointAudit) -> CheckResult:
    toks = ReferenceTokens(a.ref_cfg or a.cfg, a.ref_info.kind if a.ref_info else a.info.kind)
    try:
        return _endpoint_corruption(a.run, a.base_results, a.null_runs, _Signer(toks, a.prompts, a.chat))
    finally:
        toks.close()


WORD = re.compile(r"\w+|[^\w\s]|\s+")


def _pseudo_tokens(text: str) -> list[int]:
    """Words, punctuation and whitespace runs as ids: the stand-in where the reference cannot tokenize."""
    ids: dict[str, int] = {}
    return [ids.setdefault(w, len(ids)) for w in WORD.findall(text)]


# the repeated-4-gram and perplexity signatures judge outputs of at least this many tokens
MIN_SIGNATURE_TOKENS = 16


class _Signer:
    """Signatures of outputs on the reference's tokens, perplexity by the reference's score;
    each text tokenized and scored once."""

    def __init__(self, toks: ReferenceTokens, prompts: list, chat: bool):
        self.toks, self.chat = toks, chat
        self.prompt = {p.id: p.prompt for p in prompts}
        self.words = False  # fell back to words somewhere
        self._sigs: dict[tuple, object] = {}

    def __call__(self, pid: str, r: PromptResult, score: bool):
        key = (pid, r.text or "", r.finish_reason == "stop", score)
        if key not in self._sigs:
            text = r.text or ""
            ids = self.toks.tokenize(text) if text else []
            if ids is None:
                self.words = True
                ids = _pseudo_tokens(text)
            ppl = (self.toks.perplexity(self.prompt[pid.split("#")[0]], self.chat, ids)
                   if score and not self.words and len(ids) >= MIN_SIGNATURE_TOKENS else None)
            self._sigs[key] = signatures(ids, text, r.finish_reason == "stop", ppl)
        return self._sigs[key]


def _endpoint_corruption(run: EndpointRun, refs: list[PromptResult], null_runs: list[EndpointRun],
                         signer: _Signer) -> CheckResult:
    """Corruption signatures of every endpoint output that differs from the base, judged
    against the deployment's own null: the reference's outputs that differ from the same base.

    An endpoint output is flagged for a signature it shows and its base output lacks (loop,
    repeated 4-grams and perplexity on outputs of >= MIN_SIGNATURE_TOKENS reference tokens),
    unless the null explains it: the reference itself produced the same text for that prompt
    (at any level, in any null run), or a null output showed the same kind of signature at
    least as strongly. The check fails on any flag the null does not explain."""
    null_texts, null_worst, null_flagged = _null_signatures(refs, null_runs, signer)
    flagged, explained, per_batch = _judge_outputs(run, refs, signer, null_texts, null_worst)
    total = sum(r["outputs"] for r in per_batch)
    unit = _pseudo_unit(signer)
    summary = (f"no corruption signature beyond the null in {total} endpoint outputs"
               + (f" ({len(explained)} explained by the null)" if explained else "")
               if not flagged else
               f"{len(flagged)} of {total} endpoint outputs show signatures their reference lacks and the null "
               f"does not explain") + f"; tokens: {unit}"
    figures = {"outputs_checked": total, "flagged": len(flagged), "explained_by_null": len(explained),
               "null_flagged": len(null_flagged), "null_worst": null_worst, "tokens": unit,
               "min_signature_tokens": MIN_SIGNATURE_TOKENS,
               "test": "a signature the base output lacks, beyond what the null (the reference diverging from "
                       "itself) shows: the same text, or the same kind of signature at least as strong, explains "
                       "it; any unexplained flag fails",
               "perplexity": "the reference's score of the reference's tokens"}
    tables = [("Corruption: flagged outputs beside their reference", ["batch", "prompt", "signatures", "output",
                                                                      "reference (base)"],
               [[r["batch"], r["id"], "; ".join(r["signatures"]), r["text"], r["reference"]] for r in flagged[:20]])]
    return CheckResult(not flagged, summary, figures,
                       {"per_batch": per_batch, "flagged": flagged[:50], "explained": explained[:50],
                        "null_flagged": null_flagged[:50], "tables": tables if flagged else []})


def _null_signatures(refs: list[PromptResult], null_runs: list[EndpointRun], signer: _Signer):
    """The null's texts per prompt, its strongest signature per kind, and its flagged outputs:
    the reference's outputs that differ from the same base, which explain the endpoint's."""
    null_texts: dict[str, set] = {}
    null_worst: dict[str, float] = {}  # signature kind -> the null's strongest
    null_flagged = []
    for nr in null_runs:
        for level in nr.levels:
            for ref, got in zip(refs, level.results):
                if not ref.ok or not got.ok:
                    continue
                null_texts.setdefault(got.id, set()).add(got.text)
                if got.text == ref.text:
                    continue
                flags = signature_flags(signer(got.id, got, True), signer(ref.id, ref, True), MIN_SIGNATURE_TOKENS)
                for f in flags:
                    null_worst[f.kind] = max(null_worst.get(f.kind, 0.0), f.severity)
                if flags:
                    null_flagged.append({"batch": level.concurrency, "id": got.id, "signatures": [f.message for f in flags],
                                         "text": (got.text or "")[-200:], "reference": (ref.text or "")[-200:]})
    return null_texts, null_worst, null_flagged


def _judge_outputs(run: EndpointRun, refs: list[PromptResult], signer: _Signer, null_texts: dict,
                   null_worst: dict):
    """The endpoint's outputs that differ from the base: flagged, or explained by the null (and
    why), and the flagged count per level."""
    flagged, explained, per_batch = [], [], []
    for level in run.levels:
        n = 0
        for ref, got in zip(refs, level.results):
            if not ref.ok or not got.ok or got.text == ref.text:
                continue
            flags = signature_flags(signer(got.id, got, True), signer(ref.id, ref, True), MIN_SIGNATURE_TOKENS)
            if not flags:
                continue
            row = {"batch": level.concurrency, "id": got.id, "slice": got.slice,
                   "signatures": [f.message for f in flags], "text": (got.text or "")[-200:],
                   "reference": (ref.text or "")[-200:]}
            if got.text in null_texts.get(got.id, ()):
                explained.append({**row, "why": "the reference produced the same text in the null run"})
            elif all(f.severity <= null_worst.get(f.kind, -1.0) for f in flags):
                explained.append({**row, "why": "the null showed the same signatures at least as strongly"})
            else:
                n += 1
                flagged.append(row)
        per_batch.append({"batch": level.concurrency, "outputs": len(level.results), "flagged": n})
    return flagged, explained, per_batch


def _pseudo_unit(signer: _Signer) -> str:
    return "words, where the reference could not tokenize" if signer.words else signer.toks.unit
