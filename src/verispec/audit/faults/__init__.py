"""Test-only fault injection: the bugs that break batched speculative decoding in the wild,
each built by name as explicit hooks for one engine (`build(name).engine(...)`), so the
audit can prove it catches them.

A fault reaches only the objects of the engine it builds: the step's seams
(engine/hooks.py: StepHooks), its drafter's (drafters/base.py: DrafterHooks) and, for a
native model, a view of it (same weights) that places a pass's tokens at other RoPE
positions (models/llama.py: LlamaModel.with_positions). Every other engine in the process,
and the model the view shares its weights with, stay correct; no module or class is
changed. Nothing here runs unless a test, the audit's engines under audit
(`verispec audit --inject-fault`) or `verispec serve --inject-fault` ask for it.

This module holds the catalogue and the faults of the engine's step and drafters' draws;
each further class of fault lives in its own module of this package and enters the
catalogue through `register` (imported at the end, so the catalogue is whole on import).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from ...drafters.base import DrafterHooks
from ...engine import Engine, EngineConfig
from ...engine.hooks import StepHooks
from ...models import with_positions
from ...sampling import keyed_gumbel, logits_to_probs
from ...verify import rules
from .catalogue import EXPECTED_CHECK, FAULTS, expect, register  # noqa: F401 - the catalogue, re-exported
from .catalogue import PARTS as _PARTS
from ..registry import DISTRIBUTION, DRAFTER_CONSISTENCY, EQUIVALENCE, SEEDED, STOPPING

DRAWN_TOP_K = 28  # draft-drawn-top-k: the tokens of q its drafts are drawn from

FAULTS.update({
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
    "draft-drawn-top-p": "a drafter with q draws its drafts from the 0.8 nucleus of q (renormalised) "
                         "while it reports q itself: a filter applied on one side only",
    "draft-drawn-sharper": "a drafter with q draws its drafts from q squared (renormalised: half the "
                           "temperature) while it reports q",
    "draft-drawn-top-k": f"a drafter with q draws its drafts from the top {DRAWN_TOP_K} tokens of q "
                         "(renormalised) while it reports q unfiltered: q's tail is never drawn",
    "draft-temperature-twice": "a drafter with q divides its logits by the temperature twice for its draws "
                               "(drawn at T squared) while it reports q at T: exact at T = 1 only",
})

# the audit check that is meant to catch each fault (others may fail too)
for _fault, _check in {
    "rollback-off-by-one": EQUIVALENCE,
    "positions-not-realigned": EQUIVALENCE,
    "residual-not-normalised": DISTRIBUTION,  # only visible when sampling (temperature > 0)
    "draft-no-catchup": DRAFTER_CONSISTENCY,  # output stays exact; only the proposals go stale
    "row-leak": EQUIVALENCE,
    "relaxed-acceptance": DISTRIBUTION,
    "recovered-from-p": DISTRIBUTION,
    "bonus-previous-position": DISTRIBUTION,
    "keyed-noise-misaligned": SEEDED,  # same seed, same bytes: only the seeded check sees it
    "stop-only-at-run-end": STOPPING,
    "verify-untempered": DISTRIBUTION,  # only at temperatures other than 1 or with top-k/top-p
    "length-off-by-one": STOPPING,
    "draft-q-untempered": DISTRIBUTION,
    # drafters that draw from one distribution and report another: the drafts' own PIT
    # under the reported q (prompt lookup draws nothing: nothing to break)
    "draft-drawn-top-p": DISTRIBUTION,
    "draft-drawn-sharper": DISTRIBUTION,
    # these two move the drafts' PIT mostly in q's tails (an empty far tail), or under one
    # sampling setting only (T < 1): the drafts' two-sided tail test and per-setting tests
    "draft-drawn-top-k": DISTRIBUTION,
    "draft-temperature-twice": DISTRIBUTION,
}.items():
    expect(_fault, _check)


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


@dataclass(frozen=True)
class Fault:
    """One fault as the hooks it gives the objects it breaks (None: that part is correct)."""

    name: str
    step: StepHooks | None = None  # the engine's step
    drafter: DrafterHooks | None = None  # the engine's drafter
    # start [B], T -> the RoPE positions [B,T] of a pass, for the native models the engine runs
    positions: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    # model -> a view of it with the fault in its forward: a bug in the backend itself, which
    # every engine on that model runs, plain references included (the audit builds its whole
    # run on the view: run_audit); None: the backend is correct
    backend: Callable[[object], object] | None = None

    def engine(self, target, drafter=None, policy=None, config: EngineConfig = EngineConfig(),
               **kw) -> Engine:
        """Engine(target, drafter, policy, config, **kw) with this fault in it. The drafter,
        which must be this engine's own, takes the fault's drafter hooks; the target and
        the model a drafter drafts with are replaced by views with the fault's positions
        (the models passed in are not changed)."""
        if self.backend is not None and target.backend_fault != self.name:
            target = self.backend(target)  # a server's one engine; the audit passes the view in
        if self.positions is not None:
            target = self._model(target)
        if drafter is not None:
            self._drafter(drafter)
        return Engine(target, drafter, policy, config, hooks=self.step, **kw)

    def _drafter(self, drafter) -> None:
        if self.drafter is not None:
            drafter.hooks = self.drafter
        if self.positions is not None:
            drafter.map_models(self._model)

    def _model(self, model):
        return with_positions(model, self.positions)


def build(name: str) -> Fault:
    """The fault `name` (as parse() reads it, parameter included) as hooks."""
    base, arg = parse(name)
    return Fault(name, **_PARTS[base](arg))


def _faulty_rejection(fault: str, scale: float = 2.0):
    """Rejection sampling with one of three mistakes of the kind the audit must catch end to
    end (benchmarks/mutation_suite.py); the exact rule is verify/rules.py:rejection."""
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


def _inverse_cdf(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Assumes sum(probs) == 1: wrong for a raw residual (residual-not-normalised)."""
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=probs.dtype)
    return torch.searchsorted(probs.cumsum(-1), u).squeeze(-1).clamp(max=probs.shape[-1] - 1)


class _Rules(StepHooks):
    """Verification with the rules of some names replaced."""

    def __init__(self, replaced: dict):
        self.replaced = replaced

    def verify(self, rule, p, q, drafts, num, generator):
        fn = self.replaced.get(rule)
        if fn is None:
            return super().verify(rule, p, q, drafts, num, generator)
        return fn(p, q, drafts, num, generator)


class _RollbackOffByOne(StepHooks):
    def committed_length(self, r):
        return len(r.tokens) - 2


class _RowLeak(StepHooks):
    def pending_tokens(self, reqs, step):
        x = super().pending_tokens(reqs, step)
        if len(reqs) > 1 and step % 5 == 4:
            x[0] = x[1].clone()
        return x


class _KeyedNoiseLate(StepHooks):
    @staticmethod
    def keyed_noise(seed, positions, V):  # only a pass with drafts (more than one position)
        positions = list(positions)
        return keyed_gumbel(seed, [p + 1 for p in positions] if len(positions) > 1 else positions, V)


class _StopOnlyAtRunEnd(StepHooks):
    def append(self, r, emitted):  # accepted drafts after a stop token are kept
        for i, tok in enumerate(emitted):
            r.output_ids.append(tok)
            if i == len(emitted) - 1 and not r.params.ignore_eos and tok in r.params.stop_token_ids:
                return "stop"
            if len(r.output_ids) >= r.params.max_new_tokens:
                return "length"
        return None


class _VerifyUntempered(StepHooks):
    @staticmethod
    def verify_probs(logits, params):  # [1,K+1,V] with K > 0: a verify pass over drafts
        if logits.dim() == 3 and logits.shape[1] > 1 and not params.greedy:
            return logits.float().softmax(-1)
        return logits_to_probs(logits, params)


class _LengthOffByOne(StepHooks):
    def draft_budget(self, r):
        return r.params.max_new_tokens - len(r.output_ids)

    def append(self, r, emitted):  # the length limit only at the end of the run
        for tok in emitted:
            r.output_ids.append(tok)
            if not r.params.ignore_eos and tok in r.params.stop_token_ids:
                return "stop"
        return "length" if len(r.output_ids) >= r.params.max_new_tokens else None


class _NoQReadAsP(StepHooks):
    def verify(self, rule, p, q, drafts, num, generator):  # no q (prompt lookup): read as p
        K = drafts.shape[1]
        if rule == "rejection" and q is None and K > 0:
            q = torch.zeros(len(drafts), K, p.shape[-1])
            q[:] = p[:, :K]
        return super().verify(rule, p, q, drafts, num, generator)


class _StaleDrafter(DrafterHooks):
    def sequences(self, tokens):  # one token behind
        return [t[:-1] if len(t) > 1 else t for t in tokens]

    def unseen(self, seq, cached):  # the pending token only: no catch-up after a bonus token
        return seq[max(cached, len(seq) - 1):]


class _DrawnNucleus(DrafterHooks):
    def drawn_q(self, q):  # the 0.8 nucleus of q, renormalised; q itself is what the verifier reads
        order = q.argsort(descending=True)
        before = q[order].cumsum(0) - q[order]  # mass ranked before each token
        keep = torch.zeros_like(q)
        top = order[before < 0.8]
        keep[top] = q[top]
        return keep / keep.sum()


class _DrawnSharper(DrafterHooks):
    def drawn_q(self, q):  # q squared, renormalised: drawn at half the temperature of the q reported
        q2 = q.double() ** 2
        return (q2 / q2.sum()).to(q.dtype)


class _DrawnTopK(DrafterHooks):
    def drawn_q(self, q):  # the top DRAWN_TOP_K of q, renormalised; q itself is what the verifier reads
        if int((q > 0).sum()) <= DRAWN_TOP_K:
            return q
        keep = torch.zeros_like(q)
        top = q.topk(DRAWN_TOP_K).indices
        keep[top] = q[top]
        return keep / keep.sum()


class _TemperatureTwice(DrafterHooks):
    """Draws from q^(1/T) on q's support, that is softmax(logits / T / T) under the same
    filters, while q at T is reported. The hooks see q and the logits, not the setting: T is
    read off them (on q's support, log q is logits / T plus a constant), and a q that is not
    such a tempered softmax on three or more tokens (the calibration probe's nucleus, whose
    boundary token breaks the proportion) is drawn as it is. The draw follows the report of
    the same q (draft_from_logits: reported_q, then drawn_q); a q nobody records is drawn
    as it is too."""

    def __init__(self):
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # (q reported, q drawn)

    def reported_q(self, q, logits):
        self.last = (q, self._squared_temperature(q, logits))
        return q

    def drawn_q(self, q):
        return self.last[1] if self.last is not None and self.last[0] is q else q

    @staticmethod
    def _squared_temperature(q, logits):
        on = q > 0
        lq, lg = q[on].double().log(), logits[: q.shape[-1]][on].double()
        if lq.numel() < 3 or float(lq.max() - lq.min()) < 1e-6:
            return q
        T = float((lg.max() - lg.min()) / (lq.max() - lq.min()))
        if float(((lq - lq.max()) - (lg - lg.max()) / T).abs().max()) > 1e-3:  # not softmax(logits / T)
            return q
        drawn = torch.zeros_like(q, dtype=torch.float64)
        drawn[on] = ((lq - lq.max()) / T).exp()  # q^(1/T), scaled for range
        return (drawn / drawn.sum()).to(q.dtype)


class _RawQ(DrafterHooks):
    def reported_q(self, q, logits):  # drawn under the sampling settings, reported raw
        return logits.float().softmax(-1)


def _realigned_to_longest(start: torch.Tensor, T: int) -> torch.Tensor:
    return start.max() + torch.arange(T)[None].expand(len(start), T)


_SAMPLE_BY_INVERSE_CDF = {"rejection": partial(rules.rejection, sample=_inverse_cdf),
                          "typical-lossy": partial(rules.typical_lossy, sample=_inverse_cdf)}

# fault -> (its parameter -> Fault's fields)
_PARTS.update({
    "rollback-off-by-one": lambda c: {"step": _RollbackOffByOne()},
    "positions-not-realigned": lambda c: {"positions": _realigned_to_longest},
    "residual-not-normalised": lambda c: {"step": _Rules(_SAMPLE_BY_INVERSE_CDF)},
    "draft-no-catchup": lambda c: {"drafter": _StaleDrafter()},
    "row-leak": lambda c: {"step": _RowLeak()},
    "relaxed-acceptance": lambda c: {"step": _Rules({"rejection": _faulty_rejection("relaxed-acceptance", c or 2.0)})},
    "recovered-from-p": lambda c: {"step": _Rules({"rejection": _faulty_rejection("recovered-from-p")})},
    "bonus-previous-position": lambda c: {"step": _Rules({"rejection": _faulty_rejection("bonus-previous-position")})},
    "keyed-noise-misaligned": lambda c: {"step": _KeyedNoiseLate()},
    "stop-only-at-run-end": lambda c: {"step": _StopOnlyAtRunEnd()},
    "verify-untempered": lambda c: {"step": _VerifyUntempered()},
    "length-off-by-one": lambda c: {"step": _LengthOffByOne()},
    # layer-skip and a draft model report the raw q; prompt lookup's missing q is read as p
    "draft-q-untempered": lambda c: {"drafter": _RawQ(), "step": _NoQReadAsP()},
    "draft-drawn-top-p": lambda c: {"drafter": _DrawnNucleus()},
    "draft-drawn-sharper": lambda c: {"drafter": _DrawnSharper()},
    "draft-drawn-top-k": lambda c: {"drafter": _DrawnTopK()},
    "draft-temperature-twice": lambda c: {"drafter": _TemperatureTwice()},
})


from . import null  # noqa: E402,F401 - registers its faults
from . import filters  # noqa: E402,F401 - registers its faults
from . import churn  # noqa: E402,F401 - registers its faults
from . import attribution  # noqa: E402,F401 - registers its faults
from . import trees  # noqa: E402,F401 - registers its faults
