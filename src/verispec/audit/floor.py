"""The speedup floor: the lowest speedup of the deployment's speculation over its plain
reference that a bounded, seeded search of prompts can find and confirm.

Speedup and losslessness are separate properties, and only losslessness is a theorem:
crafted inputs can collapse speculation's speedup while output quality stays the same
(Mistletoe, arXiv 2605.14005). The slices report the average per task; this check looks
for the worst case.

The search (`search`), the same in both modes:

1. Start from the suite's prompts (`FloorBudget.seeds` of them, slices in turn).
2. Evaluate each prompt once: greedy, plain and speculative timed side by side (one pair),
   and the drafter's acceptance on it (the guide).
3. Repeat until `FloorBudget.candidates` new prompts are evaluated: take a parent among
   the `population` worst prompts so far (the worse of two drawn at random), edit it with
   one of the mutations that defeat drafters (audit/mutate.py), evaluate the child.
   "Worst" is by the guide: drafts thrown away per emitted token (drafted - accepted,
   over tokens), then the lower acceptance. Where no acceptance can be read, the single
   timed pair's speedup is the guide.
4. Rank everything evaluated. Confirm the worst `confirm` prompts whose output quality is
   intact (the reference's perplexity of the output within `quality_factor` times the
   90th percentile of the suite prompts'), and the one with the lowest single-pair
   speedup: `repeats` side-by-side pairs each, order alternating, and a Student-t interval
   on the log ratio (stats.speedup_interval).

`floor` is the lowest confirmed speedup, `floor_ci_high` the upper end of its interval.
The check is informational unless `--min-speedup X`: then it fails when a confirmed
prompt runs below X with its whole interval below X.

Where acceptance comes from:
* engine: the engine's record of each request (drafted, accepted, target passes), from a
  run at a fixed k (the forced k of the other checks) when the deployed policy is
  adaptive, so the guide is the drafter's and does not depend on timing;
* endpoint: each response's speculative fields (llama.cpp ``timings.draft_n{,_accepted}``,
  verispec's), else the difference of the server's /metrics counters around the request
  (requests go one at a time: vLLM), else none (the guide is then the timed speedup).

The same seed and budget evaluate the same prompts where the guide is acceptance read from
a deterministic greedy run; a guide from timing is not reproducible, and the figures say so.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
import math
import random
import time
from dataclasses import asdict, dataclass, field, replace

from . import mutate as mutations
from .checks import CheckResult
from .stats import Speedup, speedup_interval


@dataclass(frozen=True)
class FloorBudget:
    """What the search may spend: prompts evaluated (seeds + candidates, one timed pair
    each, plus a guide run where the policy is adaptive), tokens per request, and the
    confirmation's pairs."""

    seeds: int  # suite prompts the search starts from
    candidates: int  # edited prompts evaluated
    max_new_tokens: int  # per request, greedy; EOS ends a request as it would in use
    population: int  # parents are drawn from the this-many worst prompts so far
    confirm: int  # worst prompts re-timed side by side (plus the lowest single pair)
    repeats: int  # side-by-side pairs per confirmed prompt
    max_prompt_tokens: int = 1024  # longer edits are discarded (engine mode)
    quality_factor: float = 1.5  # output perplexity bound: this times the suite's 90th percentile

    def __post_init__(self):
        if min(self.seeds, self.max_new_tokens, self.population, self.confirm) < 1 or self.candidates < 0:
            raise ValueError("floor budget: seeds, max_new_tokens, population and confirm must be >= 1, "
                             "candidates >= 0")
        if self.repeats < 2:
            raise ValueError(f"floor budget: repeats must be >= 2 (an interval needs two pairs), got {self.repeats}")
        if self.quality_factor < 1:
            raise ValueError(f"floor budget: quality_factor must be >= 1, got {self.quality_factor}")

    # SmolLM2-135M with lookup and the adaptive policy on 2 cores, ~30 tokens/s at batch 1:
    # quick ~1,900 tokens (~65 s), full ~10,000 (~6 min)
    @classmethod
    def quick(cls) -> "FloorBudget":
        return cls(seeds=6, candidates=10, max_new_tokens=24, population=4, confirm=2, repeats=4)

    @classmethod
    def full(cls) -> "FloorBudget":
        return cls(seeds=18, candidates=40, max_new_tokens=40, population=8, confirm=4, repeats=8)


@dataclass
class Trial:
    """One side-by-side timing of a prompt: plain and speculative, moments apart."""

    plain_s: float
    spec_s: float
    plain_tokens: int
    spec_tokens: int
    spec_first: bool

    @property
    def plain_spt(self) -> float:
        return self.plain_s / max(1, self.plain_tokens)

    @property
    def spec_spt(self) -> float:
        return self.spec_s / max(1, self.spec_tokens)


@dataclass
class Candidate:
    id: str
    text: str
    origin: str  # the suite prompt it descends from
    edits: list[str]  # the mutations applied, in order
    parent: str | None = None
    slice: str = "crafted"
    # the guide, from the acceptance run (None where the deployment says nothing)
    tokens: int = 0
    drafted: int | None = None
    accepted: int | None = None
    passes: int | None = None
    trials: list[Trial] = field(default_factory=list)  # the search's pair, then the confirmation's
    ppl: float | None = None  # the reference's perplexity of the (plain, greedy) output
    quality: str = "not measured"  # "intact" | "degraded" | "not measured"
    confirmed: Speedup | None = None
    output: str = ""  # the plain output's start, for the reader
    error: str | None = None

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def waste(self) -> float | None:
        """Drafts thrown away per emitted token: what speculation paid for and did not get."""
        if self.drafted is None or self.accepted is None or not self.tokens:
            return None
        return (self.drafted - self.accepted) / self.tokens

    @property
    def tokens_per_pass(self) -> float | None:
        if self.passes:
            return self.tokens / self.passes
        if self.accepted is not None and self.tokens > self.accepted:  # each pass: accepted + 1
            return self.tokens / (self.tokens - self.accepted)
        return None

    @property
    def single_speedup(self) -> float | None:
        t = self.trials[0] if self.trials else None
        return t.plain_spt / t.spec_spt if t and t.spec_spt > 0 else None

    def badness(self) -> tuple:
        """Sort key, worst first: the guide (waste, then low acceptance), else the timed pair."""
        if self.error is not None:
            return (2, 0.0, 0.0)
        if self.waste is not None:
            return (0, -self.waste, self.acceptance if self.acceptance is not None else 1.0)
        s = self.single_speedup
        return (1, s if s is not None else math.inf, 0.0)

    def to_dict(self) -> dict:
        return {"id": self.id, "slice": self.slice, "origin": self.origin, "parent": self.parent,
                "edits": self.edits, "text": self.text, "tokens": self.tokens, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance": self.acceptance, "waste_per_token": self.waste,
                "tokens_per_pass": self.tokens_per_pass, "single_pair_speedup": self.single_speedup,
                "perplexity": self.ppl, "quality": self.quality,
                "confirmed": self.confirmed.to_dict() if self.confirmed else None,
                "pairs": [asdict(t) for t in self.trials], "output": self.output[:300], "error": self.error}


class Subject(ABC):
    """What the search measures: a deployment and its plain reference (engine or endpoint).
    acceptance_source: where the guide's acceptance comes from, in words; reproducible:
    whether the guide is a deterministic greedy record (the same seed finds the same prompts)."""

    acceptance_source = "none"
    reproducible = False

    @abstractmethod
    def evaluate(self, c: Candidate, spec_first: bool) -> None:
        """One timed pair (appended to c.trials), the guide (c.tokens, drafted, accepted,
        passes) and c.output; sets c.error on a prompt the deployment refuses."""

    @abstractmethod
    def pair(self, c: Candidate, spec_first: bool) -> Trial:
        """One timed pair, plain and speculative, in the order spec_first says."""

    @abstractmethod
    def perplexity(self, c: Candidate) -> float | None:
        """The reference's perplexity of c.output (None where it cannot be scored)."""

    def close(self) -> None:
        pass


def search(subject: Subject, seeds: list, budget: FloorBudget, seed: int, progress) -> tuple[list[Candidate], float | None]:
    """The seeded search (module docstring, steps 1-3): every candidate evaluated, in order,
    and the perplexity bound of intact output. seeds: SuitePrompt-like objects (.id, .slice,
    .prompt), taken slice by slice in turn. A candidate whose output is degraded is never a
    parent: the search must not win by making the model emit garbage."""
    by_slice: dict[str, list] = {}
    for p in seeds:
        by_slice.setdefault(p.slice, []).append(p)
    order = [g[i] for i in range(max(map(len, by_slice.values()), default=0)) for g in by_slice.values()
             if i < len(g)][:budget.seeds]
    rng = random.Random(f"{seed}/speedup-floor")
    donors = [p.prompt for p in order]
    done: list[Candidate] = []
    seen: set[str] = set()
    n_eval = 0
    bound = None

    def run(c: Candidate) -> None:
        nonlocal n_eval
        subject.evaluate(c, spec_first=n_eval % 2 == 0)
        n_eval += 1
        done.append(c)
        seen.add(c.text)
        if c.error is None:
            c.ppl = subject.perplexity(c)
            c.quality = ("not measured" if c.ppl is None or (c.edits and bound is None)
                         else "intact" if not c.edits or c.ppl <= bound else "degraded")

    with progress.stage("speedup floor: suite prompts", len(order)) as bar:
        for p in order:
            run(Candidate(p.id, p.prompt, origin=p.id, edits=[], slice=p.slice))
            bar.advance()
    ppls = sorted(c.ppl for c in done if c.ppl is not None)
    if ppls:
        bound = budget.quality_factor * ppls[min(len(ppls) - 1, int(0.9 * len(ppls)))]
    made = tries = 0
    with progress.stage("speedup floor: edited prompts", budget.candidates) as bar:
        while made < budget.candidates and tries < 8 * budget.candidates:
            tries += 1
            pool = sorted((c for c in done if c.error is None and c.quality != "degraded"),
                          key=Candidate.badness)[:budget.population]
            if not pool:
                break
            a, b = rng.choice(pool), rng.choice(pool)
            parent = min((a, b), key=Candidate.badness)
            text, edit = mutations.mutate(parent.text, rng, donors)
            if text in seen:
                continue
            made += 1
            run(Candidate(f"crafted-{made:02d}", text, origin=parent.origin, edits=parent.edits + [edit],
                          parent=parent.id))
            bar.advance()
    return done, bound


def confirm(subject: Subject, done: list[Candidate], budget: FloorBudget, progress) -> list[Candidate]:
    """Step 4: the worst prompts with intact output, and the lowest single pair, re-timed."""
    ranked = [c for c in sorted(done, key=Candidate.badness) if c.error is None and c.quality != "degraded"]
    chosen = ranked[:budget.confirm]
    timed = [c for c in ranked if c.single_speedup is not None and c not in chosen]
    if timed:  # the lowest single pair: a slowdown the guide does not see
        chosen.append(min(timed, key=lambda c: c.single_speedup))
    with progress.stage("speedup floor: confirming side by side", len(chosen) * budget.repeats) as bar:
        for c in chosen:
            pairs = []
            for r in range(budget.repeats):
                pairs.append(subject.pair(c, spec_first=r % 2 == 0))
                bar.advance()
            c.trials += pairs
            c.confirmed = speedup_interval([t.plain_spt for t in pairs], [t.spec_spt for t in pairs])
    return chosen


def floor_result(subject: Subject, budget: FloorBudget, seed: int, progress, min_speedup: float | None,
                 describe: dict) -> CheckResult:
    """Search, confirm and report: the speedup-floor check's result in either mode."""
    t0 = time.perf_counter()
    done, bound = search(subject, describe.pop("seeds"), budget, seed, progress)
    chosen = confirm(subject, done, budget, progress)
    subject.close()
    ok = [c for c in chosen if c.confirmed is not None]
    worst = min(ok, key=lambda c: c.confirmed.estimate) if ok else None
    below = [c.id for c in ok if min_speedup is not None and c.confirmed.high < min_speedup]
    lost = []
    for c in ok:
        if c.confirmed.estimate < 1:
            pairs = c.trials[-budget.repeats:]
            plain = sum(t.plain_spt for t in pairs) / len(pairs)
            spec = sum(t.spec_spt for t in pairs) / len(pairs)
            lost.append({"id": c.id, "ms_per_token_lost": 1000 * (spec - plain),
                         "time_lost_fraction": 1 / c.confirmed.estimate - 1})
    suite_s = [c.single_speedup for c in done if not c.edits and c.single_speedup is not None]
    crafted_s = [c.single_speedup for c in done if c.edits and c.single_speedup is not None]
    tokens = sum(sum(t.plain_tokens + t.spec_tokens for t in c.trials) + c.tokens for c in done)
    med = (lambda xs: sorted(xs)[len(xs) // 2] if xs else None)
    figures = {
        "floor": worst.confirmed.estimate if worst else None,
        "floor_ci_high": worst.confirmed.high if worst else None,
        "floor_ci_low": worst.confirmed.low if worst else None,
        "floor_prompt": worst.id if worst else None,
        "floor_edits": worst.edits if worst else None,
        "floor_acceptance": worst.acceptance if worst else None,
        "floor_tokens_per_pass": worst.tokens_per_pass if worst else None,
        "min_speedup": min_speedup, "below_min_speedup": below,
        "time_lost": lost,
        "suite_median_single_pair": med(suite_s), "crafted_median_single_pair": med(crafted_s),
        "budget": {**asdict(budget), "prompts_evaluated": len(done), "tokens_generated": tokens},
        "search": {"seed": seed, "mutations": list(mutations.MUTATIONS), "guide": subject.acceptance_source,
                   "reproducible": subject.reproducible,
                   "selection": f"parent: the worse of two drawn from the {budget.population} worst so far; "
                                "worst = most drafts thrown away per token, then lowest acceptance"},
        "quality": {"perplexity_bound": bound, "rule": f"{budget.quality_factor:g} x the suite prompts' "
                                                       "90th-percentile output perplexity (the reference's)",
                    "degraded": [c.id for c in done if c.quality == "degraded"]},
        **describe,
    }
    if worst:
        summary = (f"floor {worst.confirmed.estimate:.2f}x [{worst.confirmed.low:.2f}, {worst.confirmed.high:.2f}] "
                   f"on {worst.id}" + (f" ({'+'.join(worst.edits)})" if worst.edits else "")
                   + (f", {worst.tokens_per_pass:.2f} tokens/pass" if worst.tokens_per_pass else "")
                   + (f", acceptance {worst.acceptance:.0%}" if worst.acceptance is not None else "")
                   + f"; {len(done)} prompts searched x {budget.max_new_tokens} tokens, {len(ok)} confirmed "
                     f"x {budget.repeats} pairs")
    else:
        summary = "no prompt could be confirmed (every request failed or no output was intact)"
    if min_speedup is not None:
        summary += (f"; {len(below)} below {min_speedup:g}x with the whole interval: FAIL" if below
                    else f"; none confirmed below {min_speedup:g}x")
    passed = not below and (worst is not None or min_speedup is None)
    details = {"candidates": [c.to_dict() for c in done],
               "confirmed": [c.id for c in chosen],
               "elapsed_s": time.perf_counter() - t0}
    return CheckResult(passed, summary, figures, details, informational=min_speedup is None)


# -- the engine: white box ----------------------------------------------------------------------
class EngineSubject(Subject):
    """The engine under audit at batch 1 (deployed drafter and policy) against plain decoding
    of the same model, one request each way per pair."""

    def __init__(self, ctx, budget: FloorBudget):
        from ..engine import GenerationParams
        from ..policy import FixedK
        self.ctx, self.budget = ctx, budget
        max_len = budget.max_prompt_tokens + budget.max_new_tokens
        self.plain = ctx.engine(1, max_len, speculative=False, rule="rejection")
        self.spec = ctx.engine(1, max_len)
        adaptive = ctx.config.policy != "fixed"
        # the guide at a fixed k: the drafter's own acceptance, the same whatever the timing
        self.guide = ctx.engine(1, max_len, policy=FixedK(ctx.config.forced_k)) if adaptive else None
        k = ctx.config.forced_k if adaptive else ctx.config.k
        self.acceptance_source = (f"the engine's record of each request at a fixed k={k}"
                                  + (" (the deployed policy is adaptive: its own drafting is timed, not "
                                     "the guide)" if adaptive else ""))
        self.reproducible = True
        self.params = GenerationParams(max_new_tokens=budget.max_new_tokens, stop_token_ids=ctx.stops)
        self._ids: dict[str, tuple[list[int], list[int]]] = {}  # id -> (prompt ids, plain output ids)
        from ..engine import Request
        self._Request = Request
        warm = GenerationParams(max_new_tokens=4)
        for e in (self.plain, self.spec, self.guide):
            if e is not None:
                e.run([Request(ctx.prompt_ids[0][:8], warm)])

    def _run(self, engine, ids):
        return engine.run([self._Request(list(ids), self.params)])[0]

    def pair(self, c: Candidate, spec_first: bool) -> Trial:
        ids = self._ids[c.id][0]
        out = {}
        for side in ((True, False) if spec_first else (False, True)):
            out[side] = self._run(self.spec if side else self.plain, ids)
        p, s = out[False], out[True]
        self._ids[c.id] = (ids, list(p.output_ids))
        return Trial(p.stats.time_s, s.stats.time_s, len(p.output_ids), len(s.output_ids), spec_first)

    def evaluate(self, c: Candidate, spec_first: bool) -> None:
        ids = self.ctx.encode(c.text)
        if len(ids) > self.budget.max_prompt_tokens:
            c.error = f"prompt of {len(ids)} tokens > {self.budget.max_prompt_tokens}"
            return
        self._ids[c.id] = (ids, [])
        c.trials.append(self.pair(c, spec_first))
        g = self._run(self.guide, ids) if self.guide is not None else None
        rec = g if g is not None else None
        if rec is None:  # a fixed-k deployment: its own timed run is the guide; run it again untimed
            rec = self._run(self.spec, ids)
        c.tokens, c.drafted, c.accepted, c.passes = (len(rec.output_ids), rec.stats.drafted, rec.stats.accepted,
                                                     rec.stats.target_passes)
        c.output = self.ctx.decode(self._ids[c.id][1])

    def perplexity(self, c: Candidate) -> float | None:
        import torch
        from .equivalence import teacher_forced_logits
        ids, out = self._ids.get(c.id, ([], []))
        if not out:
            return None
        logits = teacher_forced_logits(self.ctx.model, ids + out, first=len(ids) - 1)[: len(out)]
        lp = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(out)[:, None])
        return float(torch.exp(-lp.mean()))


def engine_floor_check(ctx, min_speedup: float | None = None, budget: FloorBudget | None = None) -> CheckResult:
    budget = budget or ctx.config.sizes.floor or FloorBudget.quick()
    subject = EngineSubject(ctx, budget)
    describe = {"seeds": list(ctx.suite), "mode": "engine", "drafter": ctx.config.draft,
                "policy": ctx.config.policy, "k": ctx.config.k, "batch": 1,
                "timing": "end to end per request (prefill included), plain and speculative in alternating order"}
    return floor_result(subject, budget, ctx.config.seed, ctx.progress, min_speedup, describe)


# -- an endpoint: black box -----------------------------------------------------------------------
class EndpointSubject(Subject):
    """An OpenAI-compatible server and its plain reference, requests one at a time."""

    def __init__(self, cfg, ref_cfg, budget: FloorBudget, settle_s: float = 0.0):
        from .endpoint.client import EndpointClient
        self.loop = asyncio.new_event_loop()
        one = dict(concurrency=(1,), max_tokens=budget.max_new_tokens, temperature=0.0)
        self.sides = {True: EndpointClient(replace(cfg, logprobs=False, **one)),
                      False: EndpointClient(replace(ref_cfg, logprobs=False, **one))}
        # perplexity: the reference asked again, untimed, with logprobs (the timed requests
        # ask for none, so that neither side pays for them)
        self.scorer = EndpointClient(replace(ref_cfg, logprobs=True, top_logprobs=1, **one))
        # /metrics through a client of its own: a GET on the connection a timed POST then
        # takes delays that POST by ~40 ms (delayed ACK), which would tax one side only
        self.scraper = EndpointClient(replace(cfg, **one))
        self.models = {s: self.loop.run_until_complete(c.model()) for s, c in self.sides.items()}
        self.score_model = self.models[False]
        self.acceptance_source = "not yet known"
        self._texts: dict[str, str] = {}
        # a pause before each timed request: a server that keeps spinning after its answer
        # (vLLM's CPU worker) would otherwise slow whichever request follows it, an order
        # effect that alternation turns into noise instead of removing
        self.settle_s = settle_s
        self._counted = True  # scrape /metrics around each request until a response carries its own figures

    def _complete(self, side: bool, c: Candidate):
        time.sleep(self.settle_s)
        return self.loop.run_until_complete(self.sides[side].complete(self.models[side], c.id, c.slice, c.text))

    def _metered(self, c: Candidate):
        """The endpoint's answer and its speculative record: the response's fields, else the
        counters' difference around it (nothing else runs meanwhile), else None."""
        from .endpoint.client import _counters, _settled_counters
        client, scraper = self.sides[True], self.scraper

        async def go():
            await asyncio.sleep(self.settle_s)
            before = _counters(await scraper.metrics()) if self._counted else None
            r = await client.complete(self.models[True], c.id, c.slice, c.text)
            info = r.server_info
            if info is not None and info.get("drafted") is not None:
                self._counted = False  # the responses say it: no scrape around the next ones
            elif before is not None and r.ok:
                after = await _settled_counters(scraper, before, r.completion_tokens)
                if after is not None and not after.from_gauges:
                    d = after.delta(before)
                    info = {"source": f"/metrics counters ({d.source})", "drafted": d.draft_tokens,
                            "accepted": d.accepted_tokens, "verify_steps": d.drafts, "target_passes": d.target_passes}
            return r, info
        return self.loop.run_until_complete(go())

    def pair(self, c: Candidate, spec_first: bool, keep: dict | None = None) -> Trial:
        got = {}
        for side in ((True, False) if spec_first else (False, True)):
            if side and keep is not None:
                got[side], keep["info"] = self._metered(c)
            else:
                got[side] = self._complete(side, c)
        s, p = got[True], got[False]
        for r in (s, p):
            if not r.ok:
                raise RuntimeError(f"{c.id}: {r.error}")
        self._texts[c.id] = p.text or ""
        return Trial(p.latency_s, s.latency_s, p.completion_tokens or 0, s.completion_tokens or 0, spec_first)

    def evaluate(self, c: Candidate, spec_first: bool) -> None:
        keep: dict = {}
        try:
            c.trials.append(self.pair(c, spec_first, keep))
        except RuntimeError as e:
            c.error = str(e)
            return
        info = keep.get("info")
        c.tokens = c.trials[-1].spec_tokens
        c.output = self._texts.get(c.id, "")
        if info is not None and info.get("drafted") is not None:
            c.drafted, c.accepted = int(info["drafted"]), int(info.get("accepted") or 0)
            c.passes = info.get("target_passes")
            if c.passes is None and info.get("verify_steps"):
                # vLLM counts verification steps of drafting rows; each emits accepted + 1,
                # and tokens decoded without drafts are one pass each
                steps = int(info["verify_steps"])
                c.passes = steps + max(0, c.tokens - (steps + c.accepted))
            self.acceptance_source = f"per request: {info.get('source')}"
            self.reproducible = True
        elif self.acceptance_source == "not yet known":
            self.acceptance_source = "none (the server publishes no speculative fields or counters): time per token"

    def perplexity(self, c: Candidate) -> float | None:
        r = self.loop.run_until_complete(self.scorer.complete(self.score_model, c.id, c.slice, c.text))
        lps = [x for x in (r.token_logprobs or []) if x is not None]
        return math.exp(-sum(lps) / len(lps)) if r.ok and lps else None

    def close(self) -> None:
        for c in (*self.sides.values(), self.scorer, self.scraper):
            self.loop.run_until_complete(c.aclose())
        self.loop.close()


def endpoint_floor_check(a, min_speedup: float | None = None, budget: FloorBudget | None = None) -> CheckResult | None:
    """From outside: needs a plain reference (a separate server, or verispec's own switch)."""
    from .endpoint.client import EndpointClient, EndpointRun
    if a.ref_cfg is None:
        async def model_id():
            client = EndpointClient(a.cfg)
            try:
                return await client.model()
            finally:
                await client.aclose()
        a.floor_run = a.floor_run or EndpointRun(a.cfg.base, asyncio.run(model_id()), a.info.kind, False, [])
        return CheckResult(True, "not run: no plain reference to time against "
                           "(--reference-endpoint)", {"floor": None}, informational=True)
    budget = budget or a.floor_budget or FloorBudget.quick()
    subject = EndpointSubject(a.cfg, a.ref_cfg, budget, a.floor_settle_s)
    a.floor_run = EndpointRun(a.cfg.base, subject.models[True], a.info.kind, False, [])
    describe = {"seeds": list(a.suite or a.prompts), "mode": "endpoint",
                "endpoint": a.cfg.base, "reference": a.reference_kind, "batch": 1,
                "timing": "end to end per streamed request, endpoint and reference in alternating order"
                          + (f", {a.floor_settle_s:g} s pause before each" if a.floor_settle_s else "")}
    return floor_result(subject, budget, a.seed, _StageLines(), min_speedup, describe)


class _StageLines:
    """The endpoint audit's progress: a line on stderr as each stage of the search starts
    (a search of a slow server runs for minutes)."""

    def stage(self, description: str, total: int):
        import sys
        from .progress import NullProgress
        print(f"  {description}: {total} ...", file=sys.stderr, flush=True)
        return NullProgress().stage(description, total)


# -- how the report shows it --------------------------------------------------------------------
def _x(v, spec=".2f", suffix="") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def headline(c: CheckResult) -> list[tuple[str, str]]:
    f = c.figures
    if f.get("floor") is None:
        return [("Speedup floor", c.summary)]
    b = f["budget"]
    return [("Speedup floor", f"{f['floor']:.2f}x [{f['floor_ci_low']:.2f}, {f['floor_ci_high']:.2f}] on "
                              f"{f['floor_prompt']}; searched {b['prompts_evaluated']} prompts x "
                              f"{b['max_new_tokens']} tokens (seed {f['search']['seed']})"
                              + (f"; gate {f['min_speedup']:g}x: {'FAIL' if f['below_min_speedup'] else 'pass'}"
                                 if f.get("min_speedup") is not None else ""))]


def sections(c: CheckResult) -> list:
    f, cands = c.figures, {d["id"]: d for d in c.details["candidates"]}
    lost = {x["id"]: x for x in f.get("time_lost") or []}
    rows = []
    for cid in c.details["confirmed"]:
        d = cands[cid]
        conf = d["confirmed"]
        rows.append([cid, "+".join(d["edits"]) or "(suite)", _x(d["acceptance"], ".0%"), _x(d["tokens_per_pass"]),
                     _x(d["waste_per_token"]),
                     f"{conf['speedup']:.2f}x [{conf['ci_low']:.2f}, {conf['ci_high']:.2f}]" if conf else "-",
                     _x(lost.get(cid, {}).get("ms_per_token_lost"), ".1f", " ms/token") if cid in lost else "-",
                     _x(d["perplexity"]), d["quality"]])
    out = [("Speedup floor: the worst prompts found, re-timed side by side "
            f"({f['budget']['repeats']} pairs each, alternating order, 95% interval)",
            ["prompt", "edits", "acceptance", "tokens/pass", "drafts wasted/token", "speedup [95% CI]",
             "time lost vs plain", "output perplexity", "quality"], rows)]
    b, s, q = f["budget"], f["search"], f["quality"]
    out.append(("Speedup floor: the search",
                ["setting", "value"],
                [["budget", f"{b['seeds']} suite prompts + {b['candidates']} edited, {b['max_new_tokens']} tokens "
                            f"each ({b['prompts_evaluated']} evaluated, {b['tokens_generated']} tokens generated)"],
                 ["seed", s["seed"]], ["edits", ", ".join(s["mutations"])], ["guide", s["guide"]],
                 ["selection", s["selection"]], ["reproducible", "yes: the same seed and budget evaluate the same "
                                                 "prompts" if s["reproducible"] else "no: the guide is a timing"],
                 ["quality", f"{q['rule']}: bound {_x(q['perplexity_bound'])}; degraded: "
                             f"{', '.join(q['degraded']) or 'none'}"],
                 ["single-pair speedup, median", f"suite {_x(f['suite_median_single_pair'])}x, "
                                                 f"edited {_x(f['crafted_median_single_pair'])}x"]]))
    worst = sorted((d for d in c.details["candidates"] if d["edits"] and d["waste_per_token"] is not None),
                   key=lambda d: -d["waste_per_token"])[:3]
    if worst:
        out.append(("Speedup floor: the worst edited prompts' text",
                    ["prompt", "text (start)", "output (start)"],
                    [[d["id"], d["text"][-240:], d["output"][:160]] for d in worst]))
    return out


def plot(plt, res: CheckResult | None):
    """Per-prompt speedup (one timed pair each) of the suite and the edited prompts, and the
    confirmed prompts with their intervals."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    if res is not None and res.details:
        cands = res.details["candidates"]
        rng = random.Random(0)
        for x, group, color in ((0, [d for d in cands if not d["edits"]], "#1565c0"),
                                (1, [d for d in cands if d["edits"]], "#ef6c00")):
            ys = [d["single_pair_speedup"] for d in group if d["single_pair_speedup"]]
            ax.scatter([x + rng.uniform(-0.15, 0.15) for _ in ys], ys, s=14, color=color, alpha=0.7)
        conf = [d for d in cands if d["confirmed"]]
        for i, d in enumerate(conf):
            c = d["confirmed"]
            x = 2 + (i - (len(conf) - 1) / 2) * 0.12
            ax.errorbar([x], [c["speedup"]], yerr=[[c["speedup"] - c["ci_low"]], [c["ci_high"] - c["speedup"]]],
                        fmt="o", color="#c62828", capsize=3)
            ax.annotate(d["id"], (x, c["ci_high"]), fontsize=6, ha="center", va="bottom")
        ax.axhline(1.0, color="k", lw=1)
        if res.figures.get("min_speedup") is not None:
            ax.axhline(res.figures["min_speedup"], color="#c62828", lw=1, ls="--", label="--min-speedup")
            ax.legend(fontsize=8)
    ax.set_xticks([0, 1, 2], ["suite prompts\n(one pair each)", "edited prompts\n(one pair each)",
                              "confirmed\n(95% interval)"])
    ax.set_ylabel("speedup over plain")
    return fig
