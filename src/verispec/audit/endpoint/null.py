"""Equivalence calibrated to the deployment's own numerics: a null baseline.

A quantized or bf16 server is not bit-stable under batching: the same plain server asked
the same greedy prompt alone and among 7 others can answer differently, at top-2 margins
of ~0.05. A fixed tie margin cannot tell that from a bug, so the verdict compares the
speculative endpoint with what the reference does to itself:

* base: the reference at concurrency 1;
* null, per load level c: the reference run again at c, compared with the base;
* test, per load level c: the endpoint at c, compared with the same base.

Per level, a divergence is counted per prompt (first differing character of the text),
with the base's top-2 logprob margin at the token holding it (when the base returned
logprobs; log-probability differences equal logit differences). Speculation fails
equivalence at level c when either of two exact tests rejects at alpha / (2 x levels):

1. counts: one-sided Fisher's exact test that the endpoint diverges more often than the
   null (scipy.stats.fisher_exact on [[d, n - d], [d0, n0 - d0]]);
2. margins: j of the endpoint's n1 divergences sit at margins beyond the largest margin
   at which the null (all levels pooled, n0 divergences) diverged. Under the null
   hypothesis (the same numerics) the n0 + n1 margins are exchangeable, so the chance
   that the j largest all belong to the endpoint is C(n1, j) / C(n0 + n1, j): the
   p-value. With no null divergence this test has no evidence and cannot reject; the
   divergences are then reported as "unexplained by the null" and only the count test
   decides (more null runs, --null-repeats, give the margins a scale).

A divergence at a margin within the null's range is a near-tie (the backend's own numerics,
as the offline audit names it). Prompts whose request failed are not compared, and any failed request
makes the level inconclusive (a failure: what was not compared was not shown equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from math import comb

from ..stats import fisher_greater

from .client import PromptResult, first_divergence

ALPHA = 0.01  # family-wise, over the load levels (Bonferroni)


def margin_at(ref: PromptResult, char: int, other: PromptResult | None = None) -> float | None:
    """The reference's top-2 logprob margin at the choice where `other` left it.

    Where both answers list every token they emitted (their token texts join to their
    texts), that choice is the first token that differs, which can lie before the first
    differing character: "met" + "re" against "meter" first differ in characters inside
    "re", where the reference was sure of itself, but the choice was "met" against "meter".
    Otherwise, the token holding the first differing character `char`."""
    if not ref.tokens or not ref.top2_margins:
        return None
    a, b = _complete_tokens(ref), _complete_tokens(other) if other is not None else None
    if a is not None and b is not None and a[0] == b[0]:  # both ids, or both texts
        a, b = a[1], b[1]
        n = min(len(a), len(b))
        i = next((j for j in range(n) if a[j] != b[j]), n)
        return ref.top2_margins[i] if i < len(ref.top2_margins) else None
    end = 0
    for tok, margin in zip(ref.tokens, ref.top2_margins):
        end += len(tok)
        if end > char:
            return margin
    return None


def _complete_tokens(r: PromptResult) -> tuple[str, list] | None:
    """Every token the answer emitted: ("ids", ids) where the server gave all of them, else
    ("texts", texts) where they join to the answer's text; None when its list has gaps."""
    ids = r.token_ids
    if ids and all(t is not None for t in ids) and r.completion_tokens in (None, len(ids)):
        return "ids", list(ids)
    if r.tokens and "".join(r.tokens) == (r.text or ""):
        return "texts", list(r.tokens)
    return None


@dataclass
class Comparison:
    """One run compared with the base, prompt by prompt."""

    concurrency: int
    rows: list[dict] = field(default_factory=list)  # id, slice, exact, first_divergence, margin, error

    @property
    def compared(self) -> list[dict]:
        return [r for r in self.rows if r["error"] is None]

    @property
    def errors(self) -> int:
        return sum(r["error"] is not None for r in self.rows)

    @property
    def divergences(self) -> list[dict]:
        return [r for r in self.compared if not r["exact"]]

    @property
    def margins(self) -> list[float]:
        return [r["margin"] for r in self.divergences if r["margin"] is not None]

    def summary(self) -> dict:
        n = len(self.compared)
        return {"concurrency": self.concurrency, "prompts": len(self.rows), "compared": n, "errors": self.errors,
                "divergences": len(self.divergences),
                "divergence_rate": len(self.divergences) / n if n else None, "margins": sorted(self.margins),
                "unknown_margins": sum(r["margin"] is None for r in self.divergences)}


def compare(base: list[PromptResult], got: list[PromptResult], concurrency: int) -> Comparison:
    """Prompt by prompt (same order), `got` against `base`."""
    if len(base) != len(got):
        raise ValueError(f"runs of different length: {len(base)} base answers, {len(got)} compared")
    out = Comparison(concurrency)
    for b, g in zip(base, got):
        if b.id != g.id:
            raise ValueError(f"prompt order differs: {b.id!r} vs {g.id!r}")
        err = None if (b.ok and g.ok) else (f"base: {b.error}" if not b.ok else g.error)
        at = first_divergence(b.text, g.text) if err is None else None
        out.rows.append({"id": g.id, "slice": g.slice, "exact": err is None and at is None,
                         "first_divergence": at, "margin": margin_at(b, at, g) if at is not None else None,
                         "error": err})
    return out


def exceedance_p(j: int, n_test: int, n_null: int) -> float:
    """P(the j largest of n_test + n_null exchangeable margins all belong to the test run)."""
    if j == 0 or n_null == 0:
        return 1.0
    return comb(n_test, j) / comb(n_test + n_null, j)


def verdict(tests: list[Comparison], nulls: dict[int, Comparison], alpha: float = ALPHA) -> dict:
    """The equivalence verdict of the test comparisons against the null ones.

    nulls: per concurrency level; a level with no null of its own is compared with the
    null pooled over all levels (said so in its row)."""
    null_margins = [m for c in nulls.values() for m in c.margins]
    null_max = max(null_margins) if null_margins else None
    pooled_d = sum(len(c.divergences) for c in nulls.values())
    pooled_n = sum(len(c.compared) for c in nulls.values())
    per_level, failures = [], []
    a = alpha / max(1, 2 * len(tests))
    for t in tests:
        own = nulls.get(t.concurrency)
        d0, n0 = (len(own.divergences), len(own.compared)) if own else (pooled_d, pooled_n)
        d1, n1 = len(t.divergences), len(t.compared)
        p = fisher_greater(d1, n1, d0, n0)
        beyond = [r for r in t.divergences if r["margin"] is not None and (null_max is None or r["margin"] > null_max)]
        p_margin = exceedance_p(len(beyond), len(t.margins), len(null_margins))
        for r in t.divergences:
            r["verdict"] = ("beyond the null" if r in beyond else "near-tie" if r["margin"] is not None
                            else "margin unknown")
        for r in t.rows:
            r.setdefault("verdict", "identical" if r["exact"] else ("not compared" if r["error"] else "?"))
        reasons = []
        if t.errors:
            reasons.append(f"{t.errors} request(s) failed: inconclusive")
        if n1 and p < a:
            reasons.append(f"divergence rate {d1}/{n1} vs null {d0}/{n0} (Fisher p = {p:.2g} < {a:.2g})")
        if p_margin < a:
            reasons.append(f"{len(beyond)} of {len(t.margins)} divergences beyond the null's largest margin "
                           f"({null_max:.3g}; exceedance p = {p_margin:.2g} < {a:.2g})")
        row = {"batch": t.concurrency, "prompts": len(t.rows), "compared": n1, "errors": t.errors,
               "divergences": d1, "divergence_rate": d1 / n1 if n1 else None,
               "null_divergences": d0, "null_compared": n0, "null_rate": d0 / n0 if n0 else None,
               "null_source": "same level" if own else "pooled over levels", "fisher_p": p, "alpha": a,
               "margins": sorted(t.margins), "beyond_null": len(beyond), "margin_p": p_margin,
               "passed": not reasons,
               "reasons": reasons}
        per_level.append(row)
        failures += [f"c={t.concurrency}: {x}" for x in reasons]
    return {"per_level": per_level, "failures": failures, "null_max_margin": null_max,
            "null_margins": sorted(null_margins), "alpha": alpha,
            "null": [c.summary() for c in nulls.values()]}
