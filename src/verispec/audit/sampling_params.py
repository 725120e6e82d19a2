"""Sampling parameters from outside: does the endpoint sample from the distribution its
sampling settings define, at every position, drafted or not?

The temperature-1 check (endpoint/sampled.py) sends every filter off, so a server that skips
a setting where it verifies drafts passes it. Real ones did: vllm-project/vllm#10198
(temperature, top-p and penalties skipped on the target probs at verified positions),
vllm-project/vllm#42744 (min_p and logit_bias applied to the bonus token only: vLLM 0.32.0's
rejection sampler still applies neither to the verified positions, v1/sample/
rejection_sampler.py apply_logits_processors), vllm-project/vllm#18902 (penalties ignored
under speculation), and temperature applied twice at verified positions.

How. Answers are sampled under several settings (SETTINGS, then one of logit_bias), each
sent explicitly with every other sampler setting off (sampled.SAMPLER_OFF), with the top 20
logprobs and token ids, on the prompts where a drafter drafts (sampled.drafting_mix). For
each emitted token the distribution the server should have drawn it from is computed from
the RAW target log-probabilities listed at that position (`processed_distribution`), and
the emitted token's randomised PIT under it is taken (`pit_processed`). Each setting is
tested apart (KS, stats.test_uniform), and again over the positions where prompt lookup has
a candidate (the drafted positions; whether a position has one is fixed by the context before
the draw, so these PITs are as uniform as the rest), Bonferroni over every test run, at
sampled.ALPHA. A token emitted outside the setting's support (probability 0) fails its
setting outright.

Why the processed distribution is exact from 20 raw logprobs: every setting has top_k below
the number of draw-independent listed entries (sampled.logprob_convention(...).buckets: 19
for vLLM chat, 20 for vLLM completions and verispec), so its support lies among them where
the k-th processed logit clears, by MARGIN, both the next listed one and the most an unlisted
token can reach (the lowest bucket's raw logprob plus any positive bias on an unlisted token;
penalties only lower a logit). Logprobs differ from logits by a per-position constant, which
cancels under temperature, top-k, top-p, min-p (a ratio to the top token), additive biases
and frequency/presence penalties. repetition_penalty divides a positive logit and multiplies
a negative one: it is not shift-invariant, so it cannot be computed from logprobs and is
always sent as 1 (off). Positions whose support or a top-p / min-p boundary lies within MARGIN are left
out (a choice made from the context alone, before the draw).

Which logprobs are raw, per server kind (the check is not applicable to the others):
- vLLM: `logprobs_mode` defaults to "raw_logprobs" (vllm/config/model.py); the sampler takes
  them before any processing ("Use the original logits (before any penalties or temperature
  scaling) for the top-k logprobs", v1/sample/sampler.py) and the rejection sampler from
  raw_target_logits. Its order (sampler.py's docstring): logit_bias, penalties (repetition,
  frequency, presence: OpenAI's, over output-token counts, model_executor/layers/utils.py),
  temperature, min_p (argmax-invariant processors), top_k then top_p (topk_topp_sampler.py).
  A server started with --logprobs-mode processed_* lists processed logprobs: its lists then
  hold -inf (written -9999.0) past the support and the positions are unscorable
  (inconclusive), never a pass.
- verispec: the target's own logprobs at temperature 1 before top-k/top-p/min-p
  (server/protocol.py, _check_logprobs); order temperature, top_k, top_p, min_p
  (sampling.logits_to_probs). It refuses penalties and logit_bias (HTTP 400): those settings
  are reported as refused, not failed.
- llama.cpp (0.3.36's tools/server): raw logits unless post_sampling_probs, but no logprobs
  at all for a speculative verification step's tokens (populate_token_probs is only called on
  the one-token path), which are the tokens this check is about; its penalties count a window
  of the last penalty_last_n tokens, and its temperature comes last in the chain.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field, replace

from ..drafters.lookup import lookup_continuation
from .checks import CheckResult
from .endpoint.client import audit_endpoint
from .endpoint.sampled import (
    ALPHA,
    LOOKUP_MAX_NGRAM,
    LOOKUP_MIN_NGRAM,
    MISSING_LOGPROBS_TOLERANCE,
    SAMPLER_OFF,
    drafting_mix,
    logprob_convention,
    sampled_run,
)

MARGIN = 1e-3  # logit (nats) and mass distance within which a boundary is ambiguous: the position is left out
# tokens asked for per setting: --sampled-tokens shared by the settings (and the logit_bias one), at least this
MIN_TOKENS_PER_SETTING = 300
MIN_SCORED = 150  # fewer scored tokens in a setting: inconclusive
DRAFTED_MIN = 50  # fewer positions with a prompt-lookup candidate: that setting's drafted test is not run
# vLLM's OpenAI shapes write -inf as -9999.0 (a processed logprobs mode masks tokens so): no logprob at all
LOGPROB_FLOOR = -9999.0
# where min_p comes among the filters, per server kind whose logprobs are raw: vLLM applies it
# right after temperature, before top_k and top_p; verispec after them (both after temperature)
ORDER = {"vllm": "min_p-first", "verispec": "min_p-last"}


@dataclass(frozen=True)
class Setting:
    """One sampling setting as sent (penalties >= 0: an unlisted token's logit can only fall)."""

    label: str
    temperature: float
    top_k: int
    top_p: float = 1.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)

    def sent(self, kind: str) -> dict:
        """What a request sends beside temperature: every setting of the kind off, then this one's."""
        out = {**SAMPLER_OFF[kind], "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p,
               "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty}
        if self.logit_bias:
            out["logit_bias"] = {str(t): b for t, b in self.logit_bias}
        return out


# penalties and biases move tokens across the k-th logit: a smaller k leaves fewer positions undetermined
SHIFTED_TOP_K = 8
SETTINGS = (
    Setting("T=0.6 top_k=10", 0.6, 10),
    Setting("T=1.4 top_k=15", 1.4, 15),
    Setting("T=0.8 top_k=12 top_p=0.8", 0.8, 12, top_p=0.8),
    Setting("top_k=15 min_p=0.1", 1.0, 15, min_p=0.1),
    Setting(f"top_k={SHIFTED_TOP_K} frequency 1.0 presence 0.5", 1.0, SHIFTED_TOP_K, frequency_penalty=1.0,
            presence_penalty=0.5),
)
BIAS_UP, BIAS_DOWN = 2.0, -3.0


def bias_setting(emitted: Counter, listed: Counter) -> Setting | None:
    """logit_bias chosen from the earlier settings' answers: BIAS_DOWN on the two tokens
    emitted most (the bias then moves tokens that are drawn), BIAS_UP on the two others
    listed most often among the draw-independent entries (a positive bias on a token left
    unlisted at a position lifts the bound on unlisted tokens there, and that position may
    be undetermined); None when fewer than four token ids are known."""
    down = [t for t, _ in emitted.most_common(2)]
    up = [t for t, _ in listed.most_common() if t not in down][:2]
    if len(down) + len(up) < 4:
        return None
    bias = tuple((t, BIAS_UP) for t in up) + tuple((t, BIAS_DOWN) for t in down)
    return Setting(f"top_k={SHIFTED_TOP_K} logit_bias {{{', '.join(f'{t}: {b:+g}' for t, b in bias)}}}", 1.0,
                   SHIFTED_TOP_K, logit_bias=bias)


def listed_ids(answers: list, buckets: int) -> Counter:
    """How often each token id was among the `buckets` most probable listed entries."""
    out: Counter = Counter()
    for r in answers:
        for top in (r.top or []) if r.ok else []:
            ranked = sorted((kv for kv in top if kv[1] is not None and math.isfinite(kv[1])), key=lambda kv: -kv[1])
            out.update(k for k, _ in ranked[:buckets] if isinstance(k, int))
    return out


@dataclass(frozen=True)
class Support:
    """The processed distribution at one position: the tokens that can be drawn, by
    descending probability, and their probabilities (summing to 1)."""

    keys: list
    probs: list[float]


def adjusted_logits(entries: list[tuple], s: Setting, counts: dict) -> list[tuple]:
    """[(key, z)]: each listed raw logprob plus its bias, less the frequency penalty times its
    count in the output so far and the presence penalty where it occurred (OpenAI's
    definition, vLLM's apply_penalties); descending z, ties in the listed order."""
    bias = dict(s.logit_bias)
    z = [(k, lp + bias.get(k, 0.0) - s.frequency_penalty * counts.get(k, 0)
          - s.presence_penalty * (counts.get(k, 0) > 0)) for k, lp in entries]
    return sorted(z, key=lambda kz: -kz[1])


def processed_distribution(top: list[tuple], buckets: int, s: Setting, counts: dict,
                           order: str = "min_p-first") -> Support | str:
    """The distribution setting s samples from at one position, from the raw [(key, logprob)]
    listed there (the `buckets` most probable are draw-independent) and the output tokens'
    counts so far; a string says why it is not determined by the list."""
    entries = sorted(((k, lp) for k, lp in top if lp is not None and math.isfinite(lp) and lp > LOGPROB_FLOOR),
                     key=lambda kv: -kv[1])[:buckets]
    if len(entries) <= s.top_k:
        return "fewer listed entries than top_k + 1"
    listed = {k for k, _ in entries}
    unlisted_up = max((b for t, b in s.logit_bias if t not in listed and b > 0), default=0.0)
    bound = entries[-1][1] + unlisted_up  # the most an unlisted token's adjusted logit can be
    z = adjusted_logits(entries, s, counts)
    if z[s.top_k - 1][1] - max(z[s.top_k][1], bound) <= MARGIN:
        return "top-k boundary within the margin (or an unlisted token may enter)"
    kept = [(k, v / s.temperature) for k, v in z[:s.top_k]]
    steps = (_min_p, _top_p) if order == "min_p-first" else (_top_p, _min_p)
    for step in steps:
        kept = step(kept, s)
        if isinstance(kept, str):
            return kept
    m = kept[0][1]
    w = [math.exp(y - m) for _, y in kept]
    total = sum(w)
    return Support([k for k, _ in kept], [x / total for x in w])


def _min_p(kept: list[tuple], s: Setting) -> list[tuple] | str:
    """Keep the tokens whose probability is at least min_p times the top one's (a ratio:
    the normalisation cancels)."""
    if s.min_p <= 0.0:
        return kept
    floor = math.log(s.min_p)
    gaps = [y - kept[0][1] for _, y in kept]
    if any(abs(g - floor) <= MARGIN for g in gaps):
        return "min-p boundary within the margin"
    return [ky for ky, g in zip(kept, gaps) if g >= floor]


def _top_p(kept: list[tuple], s: Setting) -> list[tuple] | str:
    """Keep each token whose mass before it (descending, renormalised over `kept`) is below
    top_p: vLLM masks where the ascending cumulative mass is <= 1 - top_p, verispec where
    the mass before a token reaches top_p; the same set."""
    if s.top_p >= 1.0:
        return kept
    m = kept[0][1]
    w = [math.exp(y - m) for _, y in kept]
    total, before, out = sum(w), 0.0, []
    for ky, x in zip(kept, w):
        if abs(before - s.top_p) <= MARGIN:
            return "top-p boundary within the margin"
        if before < s.top_p:
            out.append(ky)
        before += x / total
    return out


def pit_processed(support: Support, chosen, rng: random.Random) -> float | None:
    """u = F(x-) + U p(x) over the support in descending probability; None when the emitted
    token is outside the support (probability 0 under the setting)."""
    before = 0.0
    for k, p in zip(support.keys, support.probs):
        if k == chosen:
            return min(1.0, before + rng.random() * p)
        before += p
    return None


@dataclass
class _Scores:
    """One setting's answers, scored token by token."""

    us: list[float] = field(default_factory=list)
    drafted_us: list[float] = field(default_factory=list)  # where prompt lookup has a candidate
    out_of_support: list[dict] = field(default_factory=list)  # (answer, position, token)
    left_out: Counter = field(default_factory=Counter)  # positions not determined, by why
    emitted: int = 0
    without: int = 0  # emitted tokens without logprobs
    errors: list[str] = field(default_factory=list)
    answers: int = 0
    prompt_context: bool = False  # the lookup context held the prompt's ids (else the answer alone)


def score_answers(answers: list, s: Setting, buckets: int, order: str, rng: random.Random) -> _Scores:
    """Every answer's tokens, in order, against setting s."""
    sc = _Scores()
    for r in answers:
        sc.answers += 1
        if not r.ok:
            sc.errors.append(r.error or "failed")
            continue
        got = len(r.tokens or [])
        n = r.completion_tokens if r.completion_tokens is not None else got
        sc.emitted += max(n, got)
        sc.without += max(0, n - got)
        _score_answer(sc, r, s, buckets, order, rng)
    return sc


def _score_answer(sc: _Scores, r, s: Setting, buckets: int, order: str, rng: random.Random) -> None:
    """One answer: per token, its key (id where the list is keyed by ids, else text), the
    processed distribution from its list and the counts so far, its PIT, and whether prompt
    lookup had a candidate there."""
    ids = r.token_ids or []
    by_id = len(ids) == len(r.tokens or []) and all(isinstance(t, int) for t in ids)
    context = list(r.prompt_ids or []) if by_id else None
    sc.prompt_context = sc.prompt_context or bool(r.prompt_ids)
    counts: Counter = Counter()
    for j, (text, top) in enumerate(zip(r.tokens or [], r.top or [])):
        key = ids[j] if by_id and all(isinstance(k, int) for k, _ in top) else text
        drafted = bool(lookup_continuation(context, 1, LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM)) if context else False
        if s.logit_bias and not isinstance(key, int):
            sc.left_out["no token ids (logit_bias needs them)"] += 1
        else:
            support = processed_distribution(top, buckets, s, counts, order)
            if isinstance(support, str):
                sc.left_out[support] += 1
            else:
                u = pit_processed(support, key, rng)
                if u is None:
                    sc.out_of_support.append({"answer": r.id, "position": j, "token": key})
                else:
                    sc.us.append(u)
                    if drafted:
                        sc.drafted_us.append(u)
        counts[key] += 1
        if context is not None:
            context.append(ids[j])


# -- the runs and the verdict --------------------------------------------------------------

def _not_applicable(kind: str) -> CheckResult:
    why = ("llama-server sends no logprobs for the tokens of a speculative verification step (0.3.36's "
           "tools/server calls populate_token_probs only on the one-token path), the tokens this check is about"
           if kind == "llama.cpp" else
           f"whether a {kind} server's logprobs are raw (before its sampling settings) is not known here")
    return CheckResult(True, f"not applicable: {why}", {"applicable": False, "server_kind": kind, "why": why},
                       informational=True)


def _run_setting(a, s: Setting, prompts: list, tokens: int) -> list:
    """At least `tokens` tokens sampled under s (sampled.sampled_run's rounds, with s sent in
    place of its temperature-1 settings; it asks for the top 20 logprobs and, per kind,
    token ids): the answers."""
    sent = s.sent(a.info.kind)

    def run(cfg, batch):
        return audit_endpoint(replace(cfg, temperature=s.temperature, sampler=sent), batch)
    got = sampled_run(a.cfg, a.info.kind, prompts, tokens, max(a.concurrency), run=run)
    return [r for lv in got.levels for r in lv.results]


def _refused(sc: _Scores) -> str | None:
    """The server's refusal of the setting (every answer an HTTP 400), None otherwise."""
    if sc.answers and len(sc.errors) == sc.answers and all(e.startswith("HTTP 400") for e in sc.errors):
        return sc.errors[0][:300]
    return None


def _setting_row(s: Setting, sc: _Scores, kind: str) -> dict:
    """One setting's figures before its tests: what was sent and what was scored."""
    return {"label": s.label, "sent": {"temperature": s.temperature, **s.sent(kind)}, "answers": sc.answers,
            "failed_answers": len(sc.errors), "emitted_tokens": sc.emitted, "tokens_without_logprobs": sc.without,
            "scored": len(sc.us), "drafted_positions": len(sc.drafted_us),
            "left_out": dict(sc.left_out), "out_of_support": len(sc.out_of_support),
            "out_of_support_examples": sc.out_of_support[:5], "refused": _refused(sc),
            "lookup_context": "prompt + answer ids" if sc.prompt_context else "the answer's ids alone"}


def _tests(sc: _Scores) -> list[tuple[str, object]]:
    """The KS tests one setting runs: every scored token, and the drafted positions where
    there are enough of them."""
    from .stats import test_uniform
    out = [("pit", test_uniform(sc.us))] if sc.us else []
    if len(sc.drafted_us) >= DRAFTED_MIN:
        out.append(("pit-drafted", test_uniform(sc.drafted_us)))
    return out


def _judge(row: dict, sc: _Scores, tests: list, a_each: float) -> None:
    """The setting's verdict into row: refused (not failed), inconclusive, or each test at
    a_each and no token outside the support."""
    reasons = []
    if row["refused"]:
        row.update(passed=None, reason=f"refused by the server: {row['refused']}")
        return
    if sc.errors:
        reasons.append(f"{len(sc.errors)} request(s) failed (first: {sc.errors[0][:200]})")
    if sc.out_of_support:
        reasons.append(f"{len(sc.out_of_support)} token(s) emitted outside the setting's support (probability 0 "
                       "under it): the setting was not applied there")
    for name, t in tests:
        row[name] = {"n": t.n, "ks_statistic": t.ks_statistic, "p_value": t.p_value, "alpha": a_each,
                     "passed": t.passed(a_each), "histogram": t.histogram}
        if not t.passed(a_each):
            where = " at positions where prompt lookup has a candidate" if name == "pit-drafted" else ""
            reasons.append(f"KS p = {t.p_value:.3g} < {a_each:.2g}{where}: the tokens do not follow the setting")
    if len(sc.us) < MIN_SCORED:
        reasons.append(f"inconclusive: only {len(sc.us)} scored tokens (< {MIN_SCORED})")
    if sc.without > MISSING_LOGPROBS_TOLERANCE * max(sc.emitted, 1):
        reasons.append(f"inconclusive: {sc.without} of {sc.emitted} tokens came without logprobs")
    row.update(passed=not reasons, reason="; ".join(reasons) or None)


def endpoint_sampling_params_check(a) -> CheckResult | None:
    """Each setting sampled, scored against the distribution it defines, and tested."""
    if not a.sampled_tokens:
        return None
    kind = a.info.kind
    if kind not in ORDER:
        return _not_applicable(kind)
    buckets = logprob_convention(kind, a.cfg.chat).buckets
    prompts = drafting_mix(a.prompts)
    if a.seed:
        random.Random(a.seed).shuffle(prompts)
    per = max(MIN_TOKENS_PER_SETTING, math.ceil(a.sampled_tokens / (len(SETTINGS) + 1)))
    rng = random.Random(a.seed)
    emitted, listed = Counter(), Counter()
    rows, scored = [], []
    for s in (*SETTINGS, None):
        s = s or bias_setting(emitted, listed)
        if s is None:
            rows.append({"label": "logit_bias", "passed": None, "reason": "not run: no token ids to bias"})
            continue
        answers = _run_setting(a, s, prompts, per)
        emitted.update(t for r in answers if r.ok for t in (r.token_ids or []) if isinstance(t, int))
        listed.update(listed_ids(answers, buckets))
        sc = score_answers(answers, s, buckets, ORDER[kind], rng)
        rows.append(_setting_row(s, sc, kind))
        scored.append((rows[-1], sc, _tests(sc)))
    return _verdict(rows, scored, kind, buckets, per)


def _verdict(rows: list[dict], scored: list, kind: str, buckets: int, per: int) -> CheckResult:
    """Bonferroni over every KS test run, each setting judged, the result."""
    n_tests = sum(len(t) for row, _, t in scored if not row["refused"])
    a_each = ALPHA / max(n_tests, 1)
    for row, sc, tests in scored:
        _judge(row, sc, tests, a_each)
    tested = [r for r in rows if r.get("passed") is not None]
    failed = [r for r in tested if not r["passed"]]
    passed = bool(tested) and not failed
    figures = {"alpha": ALPHA, "correction": f"Bonferroni over {n_tests} KS tests", "alpha_per_test": a_each,
               "server_kind": kind, "order": ORDER[kind], "buckets": buckets, "margin": MARGIN,
               "tokens_per_setting": per, "min_scored": MIN_SCORED, "drafted_min": DRAFTED_MIN,
               "scored_with": "the endpoint's own raw top-20 logprobs, processed here under each setting",
               "settings": rows}
    if not tested:
        summary = "inconclusive: no setting could be tested (" + "; ".join(
            f"{r['label']}: {r['reason']}" for r in rows) + ")"
    else:
        summary = (f"{len(tested) - len(failed)} of {len(tested)} sampling settings followed by the emitted tokens "
                   f"(KS per setting and at drafted positions, Bonferroni over {n_tests} at {ALPHA:g})"
                   + "".join(f"; {r['label']}: {r['reason']}" for r in failed)
                   + "".join(f"; {r['label']} " + ("refused by the server" if r.get("refused") else r["reason"])
                             for r in rows if r.get("passed") is None))
    return CheckResult(passed, summary, figures, {"settings": [r["label"] for r in rows]})
