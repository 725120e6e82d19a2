"""Test-only fault injection: the bugs that break batched speculative decoding in the
wild, each switched on by name inside a `with inject(name):` block, so the audit can
prove it catches them. Nothing here runs unless a test or `verispec audit
--inject-fault` asks for it."""

from __future__ import annotations

import contextlib
import inspect

import torch

FAULTS = {
    "rollback-off-by-one": "KV rollback keeps one token too few after each step",
    "positions-not-realigned": "positions of every row continue from the batch's longest row",
    "residual-not-normalised": "recovered tokens drawn from the unnormalised residual by inverse CDF",
    "draft-no-catchup": "the drafter's state misses the last committed token: the draft cache skips it "
                        "after a bonus token, prompt lookup matches on a table one token stale, "
                        "layer-skip drafts from the previous pending token",
    "row-leak": "a row's pending token leaks into its neighbour's verify input every 5th step",
    "relaxed-acceptance": "drafts accepted with probability min(1, c p/q) instead of min(1, p/q) "
                          "(c = 2; `relaxed-acceptance:C` sets c)",
    "recovered-from-p": "the token after a rejected draft is drawn from p instead of the residual",
    "bonus-previous-position": "the bonus token is drawn from p at the last draft's position",
    "keyed-noise-misaligned": "a verify pass over drafts reads the keyed noise one position late",
    "stop-only-at-run-end": "a stop token is honoured only as the last token of a step's emitted run",
    "verify-untempered": "a verify pass over drafts scores them with the raw softmax: the request's "
                         "temperature, top-k, top-p and min-p apply to one-token steps only",
    "length-off-by-one": "drafts are capped at the tokens left instead of one fewer, and the length "
                         "limit is checked at the end of a step's emitted run: max_tokens overshoots by one",
    "draft-q-untempered": "a drafter with q reports its raw softmax as q while it draws the drafts "
                          "under the request's sampling settings (prompt lookup: q is read as 1/2, not 1)",
}

# the audit check that is meant to catch each fault (others may fail too)
EXPECTED_CHECK = {
    "rollback-off-by-one": "equivalence",
    "positions-not-realigned": "equivalence",
    "residual-not-normalised": "distribution",  # only visible when sampling (temperature > 0)
    "draft-no-catchup": "drafter-consistency",  # output stays exact; only the proposals go stale
    "row-leak": "equivalence",
    "relaxed-acceptance": "distribution",
    "recovered-from-p": "distribution",
    "bonus-previous-position": "distribution",
    "keyed-noise-misaligned": "seeded",  # same seed, same bytes: only the seeded check sees it
    "stop-only-at-run-end": "stopping",
    "verify-untempered": "distribution",  # only at temperatures other than 1 or with top-k/top-p
    "length-off-by-one": "stopping",
    "draft-q-untempered": "distribution",
}


def argument(s: str) -> str:
    """argparse type of the hidden, test-only --inject-fault options (audit and serve)."""
    import argparse
    try:
        parse(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def parse(name: str) -> tuple[str, float | None]:
    """'relaxed-acceptance:1.25' -> ('relaxed-acceptance', 1.25); a fault without a
    parameter -> (name, None). Raises ValueError naming the valid faults."""
    base, _, arg = name.partition(":")
    if base not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; faults: {', '.join(FAULTS)}")
    if not arg:
        return base, None
    if base != "relaxed-acceptance":
        raise ValueError(f"fault {base!r} takes no parameter (only relaxed-acceptance:C does)")
    try:
        c = float(arg)
    except ValueError:
        raise ValueError(f"relaxed-acceptance:C needs a number C > 1, got {arg!r}") from None
    if not c > 1 or c != c or c == float("inf"):
        raise ValueError(f"relaxed-acceptance:C needs a finite C > 1, got {arg!r}")
    return base, c


def _faulty_rejection(fault: str, scale: float = 2.0):
    """Rejection sampling with one of three mistakes of the kind the audit must catch end to
    end (benchmarks/mutation_suite.py); the exact rule is verify/rules.py:rejection."""
    from ..verify import rules

    c = scale if fault == "relaxed-acceptance" else 1.0

    def rule(target_probs, draft_probs, draft_tokens, num_drafts, generator):
        valid = rules._check_inputs(target_probs, draft_probs, draft_tokens, num_drafts)  # [B,K]
        B, K1, V = target_probs.shape
        K, rows = K1 - 1, torch.arange(B)
        tok = torch.where(valid, draft_tokens, 0).long()
        p_x = target_probs[:, :K].gather(-1, tok[..., None]).squeeze(-1).double()
        q_x = torch.ones_like(p_x) if draft_probs is None else \
            draft_probs.gather(-1, tok[..., None]).squeeze(-1).double()
        u = torch.ones(B, K, dtype=torch.float64)
        u[valid] = torch.rand(int(valid.sum()), dtype=torch.float64, generator=generator)
        n_acc = (valid & (u * q_x < c * p_x)).long().cumprod(1).sum(1)  # [B]
        pos = n_acc.clone()
        if fault == "bonus-previous-position":
            pos = torch.where(n_acc == num_drafts, (n_acc - 1).clamp(min=0), n_acc)
        nxt = target_probs[rows, pos]  # [B,V]
        if K > 0 and fault != "recovered-from-p":
            j = n_acc.clamp(max=K - 1)
            q_j = torch.nn.functional.one_hot(tok[rows, j], V).to(nxt.dtype) if draft_probs is None \
                else draft_probs[rows, j].to(nxt.dtype)
            res = (nxt - q_j).clamp_min(0)
            use = (n_acc < num_drafts) & (res.sum(-1) > rules.RESIDUAL_EPS)
            nxt = torch.where(use[:, None], res, nxt)
        return rules._emit(draft_tokens, n_acc, rules.sample_from_probs(nxt, generator))
    return rule


@contextlib.contextmanager
def inject(name: str):
    name, arg = parse(name)
    from ..drafters import draft_model, layerskip, lookup
    from ..models import llama
    from ..verify import rules
    from . import core

    patches: list[tuple[object, str, object]] = []

    def patch(obj, attr, value):
        patches.append((obj, attr, inspect.getattr_static(obj, attr)))  # keeps staticmethod
        setattr(obj, attr, value)

    if name == "rollback-off-by-one":
        patch(core.Engine, "_committed_length", lambda self, r: len(r.tokens) - 2)
    elif name == "positions-not-realigned":
        patch(llama, "_positions", lambda start, T: start.max() + torch.arange(T)[None].expand(len(start), T))
    elif name == "residual-not-normalised":
        def inverse_cdf(probs, generator):  # assumes sum(probs) == 1: wrong for a raw residual
            u = torch.rand(probs.shape[0], 1, generator=generator, dtype=probs.dtype)
            return torch.searchsorted(probs.cumsum(-1), u).squeeze(-1).clamp(max=probs.shape[-1] - 1)
        patch(rules, "sample_from_probs", inverse_cdf)
    elif name == "draft-no-catchup":
        patch(draft_model.DraftModelDrafter, "_unseen",
              staticmethod(lambda seq, cached: seq[max(cached, len(seq) - 1):]))
        for cls in (lookup.PromptLookupDrafter, layerskip.LayerSkipDrafter):
            def stale(self, rows, tokens, k, *a, _propose=cls.propose, **kw):  # one token behind
                return _propose(self, rows, [t[:-1] if len(t) > 1 else t for t in tokens], k, *a, **kw)
            patch(cls, "propose", stale)
    elif name == "row-leak":
        original = core.Engine._pending_tokens

        def leaky(self, reqs):
            x = original(self, reqs)
            if len(reqs) > 1 and self.times.steps % 5 == 4:
                x[0] = x[1].clone()
            return x
        patch(core.Engine, "_pending_tokens", leaky)
    elif name == "keyed-noise-misaligned":
        keyed = core.keyed_gumbel

        def late(seed, positions, V):  # only passes with drafts (more than one position)
            positions = list(positions)
            return keyed(seed, [p + 1 for p in positions] if len(positions) > 1 else positions, V)
        patch(core, "keyed_gumbel", late)
    elif name == "stop-only-at-run-end":
        def append(self, r, emitted):  # accepted drafts after a stop token are kept
            for i, tok in enumerate(emitted):
                r.output_ids.append(tok)
                if i == len(emitted) - 1 and not r.params.ignore_eos and tok in r.params.stop_token_ids:
                    return "stop"
                if len(r.output_ids) >= r.params.max_new_tokens:
                    return "length"
            return None
        patch(core.Engine, "_append", append)
    elif name in ("relaxed-acceptance", "recovered-from-p", "bonus-previous-position"):
        patch(rules, "RULES", {**rules.RULES, "rejection": _faulty_rejection(name, arg or 2.0)})
    elif name == "verify-untempered":
        processed = core.logits_to_probs

        def raw_when_verifying(logits, params):  # [1,K+1,V] with K > 0: the verify pass
            if logits.dim() == 3 and logits.shape[1] > 1 and not params.greedy:
                return logits.float().softmax(-1)
            return processed(logits, params)
        patch(core, "logits_to_probs", raw_when_verifying)
    elif name == "length-off-by-one":
        patch(core.Engine, "_draft_budget", lambda self, r: r.params.max_new_tokens - len(r.output_ids))

        def append(self, r, emitted):  # the length limit only at the end of the run
            for tok in emitted:
                r.output_ids.append(tok)
                if not r.params.ignore_eos and tok in r.params.stop_token_ids:
                    return "stop"
            return "length" if len(r.output_ids) >= r.params.max_new_tokens else None
        patch(core.Engine, "_append", append)
    elif name == "draft-q-untempered":
        for mod in (layerskip, draft_model):
            def raw_q(logits, active, i, tokens, sampling, generators, out, probs, *a,
                      _draw=mod.draft_from_logits, **kw):
                conf = _draw(logits, active, i, tokens, sampling, generators, out, probs, *a, **kw)
                if probs is not None:  # drawn under the sampling settings, reported raw
                    for j, b in enumerate(active):
                        if not sampling[b].greedy:
                            probs[b, i, :logits.shape[-1]] = logits[j].float().softmax(-1)
                return conf
            patch(mod, "draft_from_logits", raw_q)
        accept = core.Engine._accept

        def q_is_p(self, b, r, p, q, drafts, num, n0, K):  # no q (prompt lookup): read as p
            if q is None and K > 0 and self.rule_for(r) == "rejection":
                q = torch.zeros(len(drafts), K, p.shape[-1])
                q[b] = p[0, :K]
            return accept(self, b, r, p, q, drafts, num, n0, K)
        patch(core.Engine, "_accept", q_is_p)
    try:
        yield
    finally:
        for obj, attr, old in reversed(patches):
            setattr(obj, attr, old)
