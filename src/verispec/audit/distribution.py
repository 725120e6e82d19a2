"""The distribution check: sample with the speculative engine under the audited sampling
settings (AuditConfig.settings: a temperature > 0 and top-k / top-p / min-p each; requests
take them in turn), teacher-force the target on every output for its exact p under the
request's own setting at every emitted position, and test what each mechanism of the rule
promises (stats.py):

* **pit**: every emitted token, randomised PIT over descending p, KS test;
* **calibration**: at every verified draft d, the emitted token is d with probability
  exactly min(1, p(d)/q(d)), z-test. q is the audit's own, never the engine's record: one-hot
  at the draft for prompt lookup, and for a drafter with a model (layer-skip, a draft model)
  that model teacher-forced on the output under the same sampling settings, so a q that is
  not the distribution the drafts were drawn from moves the test;
* **recovered**: tokens emitted in place of a rejected draft follow the residual
  normalise(max(0, p - q)) (for prompt lookup: p without d; a recovered token equal to the
  rejected draft is then impossible, and counted);
* **bonus**: tokens after a step whose every draft was kept follow p at their position;
* **pit-tail**, **recovered-tail**, **bonus-tail**: the share of each family's PIT values
  above 0.99 is exactly 1% under the null (one-sided binomial test): a token that should
  (almost) never be emitted, as a recovered token drawn outside the residual, lands there;
* **drafts**, **drafts-tail**: every draft's PIT under the q the drafter reported (KS), and
  its share below t and above 1 - t for t in DRAFT_TAIL_CUTS, each exactly t (two-sided
  binomial tests, Bonferroni over the six): a drafter that draws from a filtered q and
  reports it unfiltered leaves q's far tail empty, a deficit that a test of an excess passes;

* **probe-calibration**: the calibration test on the drafts of the calibration probe
  (audit/probe.py): extra requests where the target drafts for itself from a nucleus of its
  own p, so that nearly every draft is kept with a known probability a = mass, where a
  relaxed threshold moves it most. The deployed drafter's drafts are mostly kept with
  a near 0 or 1, which carry little evidence; the probe's tokens also join the PIT families.

* **outside-support**: the count of emitted tokens that p gives probability 0 under their
  setting's filters even with their logit raised by the backend's tie margin: impossible
  for an exact engine, so any one fails (a verify pass that filters in another place or
  order than plain decoding does emits them: audit/faults/filters.py).

With more than one setting, PER_SETTING's tests also run on each setting's own requests,
and the report says what each setting sampled and verified. Half the requests run under
the deployed policy, half with drafting forced (a fixed k), so a policy that drafts little
cannot make the check vacuous. The tests are combined by Bonferroni: each runs at
ALPHA / m for the m tests with data (the counts of impossible events aside), so a correct
engine fails this check in at most ALPHA of audits. A check that verified fewer draft
tokens than `min_verified_drafts` is *inconclusive*, which fails it: it proved nothing
about the speculative paths. Requests run to a fixed length (EOS ignored) so the sample size is
known in advance; the tests stay valid, as p is recomputed for exactly the emitted prefix.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..engine import EngineConfig, Request
from ..policy import FixedK
from ..sampling import logits_to_probs
from .checks import CheckResult
from .endpoint import rescore
from .endpoint.state import EndpointAudit, EndpointError
from .endpoint.client import EndpointRun
from .endpoint.counters import SpecCounters
from .endpoint.kinds import ServerInfo
from .endpoint.sampled import DRAFTING_PROMPTS, distribution_figures, sampler_settings
from .consistency import oracle_for
from .context import AuditContext
from .equivalence import prefix_cache, teacher_forced_logits, tie_margin_for, tree_steps
from .probe import nucleus_q, probe_drafter
from .stats import calibration_test, randomized_pit, relaxed_power, tail_test, test_uniform, two_tail_test

ALPHA = 1e-3  # family-wise: false alarms of the correct engine in at most 1 audit in 1,000
TAIL = 0.01  # the PIT tail tests: share of u above 1 - TAIL
# the drafts' tail test: the share below t and above 1 - t for each t, both ways (a deficit
# too); 0.2 reaches a filtered-out tail of q thicker than 5%
DRAFT_TAIL_CUTS = (0.01, 0.05, 0.2)
MIN_TOKENS_PER_PIT = 20  # a PIT family with fewer tokens is not run (and not counted in m)


def _run_sampled(ctx: AuditContext, reqs: list[Request], batch: int, max_len: int, policy, label: str) -> float:
    engine = ctx.engine(batch, max_len, policy=policy)
    t0 = time.perf_counter()
    with ctx.progress.stage(f"distribution: sampling, {label}", len(reqs)) as bar:
        engine.run(reqs, on_finish=lambda r: bar.advance())
    return time.perf_counter() - t0


def draft_q(oracle, r: Request, V: int, prefixes=None) -> torch.Tensor | None:
    """The drafter's q [n_out, V] at every output position of r, teacher-forced under r's
    sampling settings (row j: the distribution the draft at output index j was drawn from);
    None for prompt lookup (q one-hot at its draft). prefixes: the drafter's prompt prefills
    (equivalence.prefix_cache)."""
    if oracle is None or oracle.kind != "model":
        return None
    P = len(r.prompt_ids)
    logits = teacher_forced_logits(oracle.model, r.tokens[:-1], first=P - 1, num_layers=oracle.num_layers,
                                   prefixes=prefixes)
    return logits_to_probs(logits[:, :V], r.params.sampling)  # [n_out,V]


def _mechanisms(r: Request, p: torch.Tensor, q: torch.Tensor | None = None):
    """From one request's per-step record, its teacher-forced p [n_out,V] and the drafter's
    q [n_out,V] (None: one-hot at each draft): verified drafts as (a, kept), recovered
    tokens as (output index, residual [V]), bonus output indices, and the count of recovered
    tokens equal to a rejected one-hot draft (impossible under the exact rule)."""
    P = len(r.prompt_ids)
    calib, recovered, bonus, impossible = [], [], [], 0
    trees = r.stats.trace_trees or [None] * len(r.stats.trace)
    for step, ((n0, drafts, acc, _), qd, tree) in enumerate(zip(r.stats.trace, r.stats.draft_q, trees)):
        if not drafts or qd is None:
            continue
        if tree is not None:  # a draft tree, verified by the walk (verify/tree.py)
            calib += _tree_calibration(r, p, n0 - P, tree, drafts[:acc])
            continue
        for i in range(min(acc + 1, len(drafts))):  # the drafts the rule looked at
            j = n0 + i - P  # output index of the token emitted at draft i's position
            if j >= p.shape[0]:
                break
            qdi = 1.0 if q is None else float(q[j, drafts[i]])
            pdi = float(p[j, drafts[i]])
            a = 1.0 if qdi <= 0 < pdi else min(1.0, pdi / max(qdi, 1e-300))
            # kept = the emitted token there is the draft (not the engine's own count of
            # accepted drafts): a recovered token that may equal d, as one drawn from p
            # instead of the residual, shows up here
            calib.append((a, int(r.output_ids[j] == drafts[i])))
            if i == acc:
                if q is not None:
                    res = (p[j] - q[j].to(p.dtype)).clamp_min(0)
                else:  # one-hot q: the residual is p without the draft
                    res = p[j].clone()
                    res[drafts[i]] = 0.0
                    # the residual never gives the rejected draft back (the zero-residual
                    # guard aside, taken with probability <= RESIDUAL_EPS)
                    impossible += int(r.output_ids[j] == drafts[i] and float(res.sum()) > 1e-6)
                if float(res.sum()) > 1e-6:  # the engine's zero-residual guard samples from p there
                    recovered.append((j, res / res.sum()))
        j = n0 + len(drafts) - P
        if acc == len(drafts) and j < p.shape[0]:
            bonus.append(j)
    return calib, recovered, bonus, impossible


def _tree_calibration(r: Request, p: torch.Tensor, j0: int, tree, accepted: list[int]) -> list[tuple[float, int]]:
    """A draft tree step's verified drafts as (a, kept): every child of a node the walk
    reached (the root, then each accepted node) was tried, and the walk emits it with
    probability exactly p(child) there (one draw from p per node, children distinct), so
    a = p(child) and kept = whether the token emitted at that depth is the child."""
    toks, parents = tree
    out, node = [], -1  # -1: the root
    for depth in range(len(accepted) + 1):
        j = j0 + depth  # output index of the token drawn at this depth
        if j >= p.shape[0] or j >= len(r.output_ids):
            break
        kids = [i for i, par in enumerate(parents) if par == node]
        out += [(float(p[j, toks[i]]), int(r.output_ids[j] == toks[i])) for i in kids]
        if depth == len(accepted):
            break
        node = next((i for i in kids if toks[i] == accepted[depth]), None)
        if node is None:  # the trace disagrees with its tree: count nothing more of this step
            break
    return out


def _draft_pits(r: Request, g: torch.Generator) -> list[float]:
    """The randomised PIT of every token the drafter drew for r (verified or not) under the q
    it reported and the verifier read: above + U q(d), above being the mass of q ranked
    before d (engine trace, EngineConfig(trace=True)). Uniform when each draft is a sample of
    that q, whatever the target does; a drafter that draws from one distribution (another
    temperature, a filter) and reports another is not. Empty without a reported q."""
    out: list[float] = []
    for (_, drafts, _, _), qd, above in zip(r.stats.trace, r.stats.draft_q, r.stats.draft_q_above):
        if not drafts or qd is None or above is None:
            continue
        u = torch.rand(len(drafts), generator=g, dtype=torch.float64).tolist()
        out += [min(1.0, a + ui * q) for a, q, ui in zip(above, qd, u)]
    return out


def _calibration_bins(calib: list[tuple[float, int]], n_bins: int = 10) -> list[dict]:
    """Verified drafts binned by their exact acceptance a: mean a against the share kept
    (on the diagonal under the null), for the report's calibration plot."""
    out = []
    for lo in range(n_bins):
        sel = [(a, k) for a, k in calib if lo / n_bins <= a < (lo + 1) / n_bins or (lo == n_bins - 1 and a == 1.0)]
        if sel:
            out.append({"lo": lo / n_bins, "n": len(sel), "mean_a": sum(a for a, _ in sel) / len(sel),
                        "kept_rate": sum(k for _, k in sel) / len(sel)})
    return out


PROBE_K = 2  # drafts per probe step: verified drafts per forward pass peak at k = 2-3


def _probe_requests(ctx: AuditContext, first_seed: int, max_new: int) -> list[tuple[float, list[tuple[int, Request]]]]:
    """The calibration probe's requests (audit/probe.py), grouped by nucleus mass, each with
    the index of its sampling setting: each mass sees every audited setting. None under a
    keyed rule (coupled), which reads no q."""
    cfg, sizes = ctx.config, ctx.config.sizes
    if sizes.probe_tokens <= 0 or cfg.rule == "coupled":
        return []
    n = math.ceil(sizes.probe_tokens / max_new)
    ns, masses = len(cfg.settings), sizes.probe_masses
    groups: dict[float, list[tuple[int, Request]]] = {m: [] for m in masses}
    for i in range(n):
        ids = ctx.prompt_ids[(i * 7 + 3) % len(ctx.prompt_ids)]  # not the sampled run's order
        groups[masses[(i // ns) % len(masses)]].append(
            (i % ns, Request(ids, ctx.sampled_params(cfg.setting_of(i), first_seed + i, max_new))))
    return [(m, rs) for m, rs in groups.items() if rs]


def _run_probe(ctx: AuditContext, mass: float, reqs: list[Request], batch: int, max_len: int) -> float:
    V = ctx.model.config.vocab_size
    drafter = probe_drafter(ctx.model, V, max_rows=batch, max_len=max_len + PROBE_K + 2, mass=mass)
    engine = ctx.audited_engine(drafter, FixedK(PROBE_K),
                                EngineConfig(max_batch=batch, max_len=max_len, rule=ctx.config.rule, trace=True))
    t0 = time.perf_counter()
    with ctx.progress.stage(f"distribution: probe, nucleus {mass:g}, k={PROBE_K}, b={batch}", len(reqs)) as bar:
        engine.run(reqs, on_finish=lambda r: bar.advance())
    return time.perf_counter() - t0


class _Evidence:
    """What the tests read, gathered over a set of requests (one setting's, or all of them)."""

    def __init__(self):
        # PIT values per family: every emitted token, recovered tokens (against the
        # residual), bonus tokens, and the deployed drafter's draws (under its reported q)
        self.u: dict[str, list[torch.Tensor]] = {name: [] for name in FAMILIES}
        self.calib: list[tuple[float, int]] = []  # the deployed drafter's verified drafts (a, kept)
        self.probe_calib: list[tuple[float, int]] = []
        self.impossible = 0  # recovered tokens equal to a rejected one-hot draft
        self.outside = 0  # emitted tokens outside p's support at a clear margin (_outside_support)
        self.tokens = 0  # emitted tokens examined

    def add(self, other: "_Evidence") -> None:
        for name in FAMILIES:
            self.u[name] += other.u[name]
        self.calib += other.calib
        self.probe_calib += other.probe_calib
        self.impossible += other.impossible
        self.outside += other.outside
        self.tokens += other.tokens

    def family(self, name: str) -> torch.Tensor:
        parts = self.u[name]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float64)


FAMILIES = ("pit", "recovered", "bonus", "drafts")
# With more than one setting audited, these tests run again on each setting's own requests:
# a fault confined to one setting (a filter, a temperature) moves only its tokens, which
# the pooled tests dilute with the others'. The PIT's KS test sees a distribution moved
# either way (mass added or taken away), the calibration tests a verify distribution that
# is not p. Each adds to m: on the Qwen quick audit's drafts (docs/audit-ggml-qwen) the
# first six take the power against relaxed-acceptance:1.2 from 59% to 58% (1.25: 100%
# still), where every family per setting (m = 22) took it to 35%. The drafts' own tests
# run per setting as well: a drafter that divides by the temperature twice is exact at
# T = 1, and layer-skip's drafts at T = 1 diluted it to p = 0.004 over 3,434 drafts pooled,
# a pass. A token outside the filtered support needs no split: it is counted
# (outside-support), with no false alarm to spend.
PER_SETTING = ("pit", "calibration", "probe-calibration", "drafts", "drafts-tail")


def _outside_support(logits: torch.Tensor, p: torch.Tensor, out: torch.Tensor, params, margin: float) -> int:
    """How many emitted tokens out [n] p [n,V] gives probability 0 even with their logit
    (logits [n,V], the teacher-forced ones p comes from) raised by `margin`, the backend's tie
    margin: tokens outside the support the request's filters leave, at a margin no numerics
    explain. An exact engine never emits one."""
    zero = (p.gather(-1, out[:, None]).squeeze(-1) == 0).nonzero().flatten().tolist()  # sync: seldom any
    n = 0
    for j in zero:
        row = logits[j].float().clone()
        row[out[j]] += margin
        n += int(float(logits_to_probs(row[None], params)[0, out[j]]) == 0.0)
    return n


def _evidence(r: Request, logits: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, probe: bool,
              g: torch.Generator, margin: float) -> _Evidence:
    """One request's evidence from its teacher-forced logits and p [n_out,V] and the
    drafter's q [n_out,V] (None: one-hot at each draft); probe: a calibration probe request."""
    ev = _Evidence()
    out = torch.tensor(r.output_ids)
    ev.tokens = len(out)
    ev.outside = _outside_support(logits, p, out, r.params.sampling, margin)
    ev.u["pit"].append(randomized_pit(p, out, g))
    c, rec, bonus, ev.impossible = _mechanisms(r, p, q)
    (ev.probe_calib if probe else ev.calib).extend(c)
    if not probe:  # the deployed drafter's own draws (the probe's are the probe's)
        ev.u["drafts"].append(torch.tensor(_draft_pits(r, g), dtype=torch.float64))
    if rec:
        idx = torch.tensor([j for j, _ in rec])
        ev.u["recovered"].append(randomized_pit(torch.stack([res for _, res in rec]), out[idx], g))  # [n_rec]
    if bonus:
        ev.u["bonus"].append(randomized_pit(p[bonus], out[bonus], g))
    return ev


def _tests(ev: _Evidence, setting: str | None, probe_masses: str) -> list[dict]:
    """The tests over one body of evidence (setting None: every request; else that
    setting's label, and only the tests of PER_SETTING), each without its alpha yet."""
    def run(name: str) -> bool:
        return setting is None or name in PER_SETTING

    tests = []
    for name in FAMILIES:
        u = ev.family(name)
        if u.numel() < MIN_TOKENS_PER_PIT:  # too few to test (and not counted in m)
            continue
        if run(name):
            t = test_uniform(u.numpy())  # sync: for scipy
            tests.append({"test": name, "kind": "KS, PIT of each draft under the q the verifier read (descending q)"
                          if name == "drafts" else "KS, PIT over descending p", "statistic": t.ks_statistic,
                          "n": t.n, "p_value": t.p_value, "histogram": t.histogram})
        if run(f"{name}-tail"):
            tests.append(_tail_test(name, u.numpy()))  # sync: for scipy
    for name, calib, kind in (("calibration", ev.calib, "z, kept vs min(1, p/q)"),
                              ("probe-calibration", ev.probe_calib,
                               f"z, kept vs min(1, p/q), q = target nucleus {probe_masses}")):
        if calib and run(name):
            c = calibration_test([a for a, _ in calib], [k for _, k in calib])
            tests.append({"test": name, "kind": kind, "statistic": c.z, "n": c.n, "p_value": c.p_value,
                          "kept": c.kept, "expected": c.expected, "bins": _calibration_bins(calib)})
    for t in tests:
        t["setting"] = setting or "all"
        if setting is not None:
            t["test"] = f"{t['test']} [{setting}]"
    return tests


def _tail_test(name: str, u) -> dict:
    """A family's tail test on its PIT values u: the drafts' both ways at each of
    DRAFT_TAIL_CUTS (their q may lose its tail: a deficit), the others' an excess above
    1 - TAIL (a token that should almost never be emitted)."""
    if name == "drafts":
        t = two_tail_test(u, DRAFT_TAIL_CUTS)
        cuts = "/".join(f"{c:g}" for c in DRAFT_TAIL_CUTS)
        return {"test": f"{name}-tail", "statistic": t.above[1] / t.n, "n": t.n, "p_value": t.p_value,
                "kind": f"binomial two-sided, shares of PIT below t and above 1 - t for t = {cuts} "
                        f"(exactly t; Bonferroni over {2 * len(DRAFT_TAIL_CUTS)}); statistic: the share above "
                        f"{1 - DRAFT_TAIL_CUTS[1]:g}",
                "below": list(t.below), "above": list(t.above), "worst": t.worst}
    t = tail_test(u, TAIL)
    return {"test": f"{name}-tail", "kind": f"binomial, share of PIT above {1 - TAIL:g} (exactly {TAIL:g})",
            "statistic": t.count / t.n, "n": t.n, "p_value": t.p_value, "count": t.count}


SOURCES = ("deployed", "probe")
RELAXED_C = (1.25, 2.0)  # the relaxed thresholds min(1, c p/q) the check states its power against


def code_paths(ctx: AuditContext, oracle) -> dict[str, dict[str, str]]:
    """Which code produced each source's samples: {source: {"name": short, "path": long}}."""
    drafter = ctx.drafter_factory(1, 8)
    module = type(drafter).__module__
    kind = "prompt lookup, no q" if oracle is None or oracle.kind != "model" else "drafts from a model's q"
    probe_name = "the calibration probe (draft-model path"
    probe_name += ", which this deployment does not run)" if drafter.draft_model is None else ")"
    return {"deployed": {"name": f"the deployed drafter {ctx.config.draft!r} ({module})",
                         "path": f"{module} ({kind}), then the engine's verify pass (rule {ctx.config.rule})"},
            "probe": {"name": probe_name,
                      "path": "audit/probe.py: the target drafting for itself from a nucleus of its own p, through "
                              "verispec.drafters.draft_model and the same verify pass"}}


def attribute(tests: list[dict], by_source: dict, settings, masses: str, alpha: float, paths: dict) -> None:
    """Give every test the code paths its samples came from (`samples_from`: source -> n)
    and, for each source, the same test on that source's samples alone (`by_source`: n, p;
    informational, at the family's alpha): where a failed test's deviation lies."""
    alone: dict[str, dict[str, dict]] = {}
    for src, (ev, per) in by_source.items():
        found = _tests(ev, None, masses)
        if src == "probe":  # as the check names the probe's own families
            found = [{**t, "test": t["test"] if t["test"].startswith("probe-") else f"probe-{t['test']}"}
                     for t in found]
        if len(settings) > 1:
            found += [t for st, e in zip(settings, per) for t in _tests(e, st.label, masses)]
        alone[src] = {t["test"]: t for t in found}
        counts = {"outside-support": ev.outside, "recovered-is-draft": ev.impossible}
        for name, n in counts.items():
            alone[src][name] = {"n": ev.tokens, "statistic": float(n), "p_value": 0.0 if n else 1.0}
    for t in tests:
        t["samples_from"] = {src: alone[src][t["test"]]["n"] for src in SOURCES if t["test"] in alone[src]
                             and alone[src][t["test"]]["n"]}
        t["by_source"] = {src: {"n": a["n"], "p_value": a["p_value"], "statistic": a["statistic"],
                                "fails_alone": a["p_value"] <= alpha if not t.get("impossible") else bool(a["statistic"])}
                          for src in SOURCES if (a := alone[src].get(t["test"])) is not None and a["n"]}


def blame(tests: list[dict], paths: dict) -> str:
    """The failed tests grouped by the code path whose samples fail them alone (or, where
    no source fails alone, by the pooled samples only), for the summary."""
    groups: dict[str, list[str]] = {}
    for t in tests:
        if t["passed"]:
            continue
        alone = [src for src, b in t.get("by_source", {}).items() if b["fails_alone"]]
        key = " and ".join(paths[src]["name"] for src in alone) if alone else \
            "no single code path alone (the samples pooled)"
        groups.setdefault(key, []).append(t["test"])
    return "failing in samples from " + "; ".join(f"{k}: {', '.join(v)}" for k, v in groups.items())


def _power_txt(power: dict) -> str:
    """The calibration tests' power against a relaxed threshold, by source."""
    def pc(src):
        return "/".join(f"{power[src][str(c)]:.0%}" for c in RELAXED_C)
    return (f"power against relaxed c = {'/'.join(f'{c:g}' for c in RELAXED_C)}: deployed drafter alone "
            f"{pc('deployed')}, probe alone {pc('probe')}, together {pc('both')}")


@dataclass(frozen=True)
class _Sampled:
    """The sampled requests, run (the audited settings in turn), and the calibration probe's."""

    reqs: list[Request]
    max_new: int
    batch: int
    forced: bool  # half the requests ran with drafting forced (the deployed policy is not fixed)
    seconds: float  # sampling the requests (the probe aside)
    probe: list[tuple[float, list[tuple[int, Request]]]]  # (nucleus mass, [(setting index, request)])
    probe_s: float


@dataclass(frozen=True)
class _Gathered:
    """The evidence the teacher-forced p (and the recomputed q) give: pooled, per setting,
    and by the code path that produced it (source -> (pooled, per setting))."""

    pooled: _Evidence
    per: list[_Evidence]
    by_source: dict[str, tuple[_Evidence, list[_Evidence]]]
    margin: float  # the backend's tie margin: the outside-support count's allowance
    oracle: object  # the drafter's q, recomputed (consistency.oracle_for)


@dataclass(frozen=True)
class _Verdict:
    """The tests with their alpha and attribution, the calibration tests' power, and what
    they conclude."""

    tests: list[dict]
    m: int  # tests with data (Bonferroni's count; the impossible events' counts aside)
    alpha_each: float
    paths: dict[str, dict[str, str]]
    power: dict[str, dict[str, float]]
    verified: int  # the deployed drafter's verified drafts
    failed: list[str]
    inconclusive: bool

    @property
    def passed(self) -> bool:
        return not self.failed and not self.inconclusive


def distribution_check(ctx: AuditContext) -> CheckResult:
    """Sample, teacher-force the target for p, run the tests (module docstring), attribute
    them to their code paths, state their power and each setting's share, and sum up."""
    cfg = ctx.config
    sampled = _sample(ctx)
    ev = _teacher_force(ctx, sampled)
    verdict = _verdict(ctx, sampled, ev)
    share = _shares(cfg, sampled, ev.per, verdict.tests)
    pit = test_uniform(ev.by_source["deployed"][0].family("pit").numpy())  # the headline: the deployed drafter's
    trees = tree_steps(sampled.reqs)  # draft-tree steps: their tokens are in the PIT (the walk draws from p)
    summary = _summary(cfg, verdict, share, pit, trees)
    figures = _figures(cfg, sampled, ev, verdict, share, pit, trees)
    # every verified draft's exact acceptance probability: what benchmarks/audit_power.py
    # replays to measure this check's power against relaxed acceptance rules
    details = {"calibration_a": [round(a, 6) for a, _ in ev.pooled.calib],
               "probe_a": [round(a, 6) for a, _ in ev.pooled.probe_calib]}
    return CheckResult(verdict.passed, summary, figures, details)


def _sample(ctx: AuditContext) -> _Sampled:
    """The sampled requests, run to a fixed length (half under the deployed policy and half
    with drafting forced where that policy is not a fixed k), then the calibration probe's."""
    cfg, sizes = ctx.config, ctx.config.sizes
    max_new = sizes.distribution_max_new
    n_req = math.ceil(sizes.distribution_tokens / max_new)
    # prompt i % n with its own seed: repeated prompts still give independent samples
    prompt_of = [ctx.prompt_ids[i % len(ctx.prompt_ids)] for i in range(n_req)]
    # the audited settings in turn, so each half (deployed policy, forced k) has them all
    reqs = [Request(ids, ctx.sampled_params(cfg.setting_of(i), cfg.seed * 1_000_003 + i, max_new))
            for i, ids in enumerate(prompt_of)]
    batch = min(max(cfg.batch_sizes), n_req)
    max_len = max(map(len, ctx.prompt_ids)) + max_new
    forced = cfg.policy != "fixed"  # the deployed policy may draft little: force drafting too
    halves = [(reqs[: n_req // 2], "deployed policy", None),
              (reqs[n_req // 2:], f"fixed k={cfg.forced_k}", FixedK(cfg.forced_k))] if forced \
        else [(reqs, f"fixed k={cfg.k}", None)]
    sample_s = 0.0
    labels = ", ".join(s.label for s in cfg.settings)
    for part, label, policy in halves:
        if part:
            sample_s += _run_sampled(ctx, part, min(batch, len(part)), max_len, policy,
                                     f"{labels}, {label}, b={min(batch, len(part))}")
    probe = _probe_requests(ctx, cfg.seed * 1_000_003 + n_req, sizes.probe_max_new)
    probe_len = max(map(len, ctx.prompt_ids)) + sizes.probe_max_new
    probe_s = sum(_run_probe(ctx, m, [r for _, r in rs], min(batch, len(rs)), probe_len) for m, rs in probe)
    return _Sampled(reqs, max_new, batch, forced, sample_s, probe, probe_s)


def _teacher_force(ctx: AuditContext, sampled: _Sampled) -> _Gathered:
    """Every output's evidence: the target teacher-forced (outside any fault) for its exact p
    at every emitted position, under each request's own sampling settings, and the drafter's
    q recomputed (the probe's q is its nucleus of p)."""
    cfg = ctx.config
    settings, ns = cfg.settings, len(cfg.settings)
    g = torch.Generator().manual_seed(cfg.seed)
    oracle = oracle_for(ctx.drafter_factory(1, 8), ctx.model)  # the drafter's q, recomputed
    pooled, per = _Evidence(), [_Evidence() for _ in settings]
    # the same evidence by the code path that produced it: the deployed drafter's requests,
    # and the calibration probe's (attribution: which path a failed test's deviation is in)
    by_source = {src: (_Evidence(), [_Evidence() for _ in settings]) for src in SOURCES}
    margin = tie_margin_for(ctx.model)["value"]  # numerics may move a token across a filter's edge by this
    todo = [(i % ns, r, None) for i, r in enumerate(sampled.reqs)] + \
        [(s, r, m) for m, rs in sampled.probe for s, r in rs]
    # each prompt is prefilled once for all its outputs (the same batch-1 numbers)
    target_prefixes, draft_prefixes = prefix_cache(), prefix_cache()
    with ctx.progress.stage("distribution: teacher forcing", len(todo)) as bar:
        for s, r, mass in todo:
            P = len(r.prompt_ids)
            logits = teacher_forced_logits(ctx.model, r.tokens[:-1], first=P - 1,
                                           prefixes=target_prefixes)  # [n_out,V]
            p = logits_to_probs(logits, r.params.sampling)  # [n_out,V]
            q = draft_q(oracle, r, p.shape[-1], draft_prefixes) if mass is None else nucleus_q(p, mass)
            ev = _evidence(r, logits, p, q, mass is not None, g, margin)
            pooled.add(ev)
            per[s].add(ev)
            src_all, src_per = by_source["probe" if mass is not None else "deployed"]
            src_all.add(ev)
            src_per[s].add(ev)
            bar.advance()
    return _Gathered(pooled, per, by_source, margin, oracle)


def _verdict(ctx: AuditContext, sampled: _Sampled, ev: _Gathered) -> _Verdict:
    """The tests at their Bonferroni alpha, each attributed to the code paths its samples came
    from, the calibration tests' power, and whether they fail or prove too little."""
    cfg = ctx.config
    masses = "/".join(f"{m:g}" for m, _ in sampled.probe)
    tests = _all_tests(ev, cfg.settings, masses)
    m, alpha_each = _bonferroni(tests)
    paths = code_paths(ctx, ev.oracle)
    attribute(tests, ev.by_source, cfg.settings, masses, alpha_each, paths)
    verified = len(ev.pooled.calib)
    failed = [t["test"] + (f" ({t['statistic']:g} of {t['n']} tokens)" if t.get("impossible") else "")
              for t in tests if not t["passed"]]
    inconclusive = not failed and verified < cfg.min_verified_drafts
    return _Verdict(tests, m, alpha_each, paths, _power(ev.pooled, alpha_each), verified, failed, inconclusive)


def _all_tests(ev: _Gathered, settings, masses: str) -> list[dict]:
    """Every test, each without its alpha yet: the families on each code path's samples, per
    setting on both pooled, and the counts of impossible events."""
    pooled, per = ev.pooled, ev.per
    # the families run apart on each code path's samples: the probe's few hundred tokens,
    # pooled with the deployed drafter's thousands, would be diluted (a fault the probe alone
    # exercises moved its own PIT to p ~ 1e-7 while the pooled one passed), and a failed
    # test then names one path. The per-setting tests pool both, with the split reported.
    tests = _tests(ev.by_source["deployed"][0], None, masses)
    tests += [{**t, "test": t["test"] if t["test"].startswith("probe-") else f"probe-{t['test']}"}
              for t in _tests(ev.by_source["probe"][0], None, masses)]
    if len(settings) > 1:
        tests += [t for st, e in zip(settings, per) for t in _tests(e, st.label, masses)]
    # counts of events of probability 0 under the null: no correction needed, no false alarm
    # (not counted in m); the first is run whenever it found one, the second always
    if pooled.impossible:
        tests.append({"test": "recovered-is-draft", "kind": "count, recovered token == rejected draft (q one-hot)",
                      "statistic": float(pooled.impossible), "n": int(pooled.family("recovered").numel()),
                      "setting": "all", "impossible": True})
    tests.append({"test": "outside-support", "kind": "count, emitted token outside the support of p under its "
                  f"setting's filters (beyond the tie margin {ev.margin:.3g})", "statistic": float(pooled.outside),
                  "n": pooled.tokens, "setting": "all", "impossible": True,
                  "per_setting": {st.label: e.outside for st, e in zip(settings, per)}})
    return tests


def _bonferroni(tests: list[dict]) -> tuple[int, float]:
    """-> (m, alpha each): every test with data runs at ALPHA / m and gets its verdict; a count
    of impossible events fails on any one."""
    m = sum(not t.get("impossible") for t in tests)
    alpha_each = ALPHA / m
    for t in tests:
        t["alpha"] = alpha_each
        if t.get("impossible"):
            t["p_value"] = 0.0 if t["statistic"] else 1.0
            t["passed"] = not t["statistic"]
        else:
            t["passed"] = t["p_value"] > alpha_each
    return m, alpha_each


def _power(pooled: _Evidence, alpha_each: float) -> dict[str, dict[str, float]]:
    """The calibration tests' power against each relaxed threshold, by source of drafts."""
    return {src: {str(c): relaxed_power(a, c, alpha_each) for c in RELAXED_C}
            for src, a in (("deployed", [a for a, _ in pooled.calib]), ("probe", [a for a, _ in pooled.probe_calib]),
                           ("both", [a for a, _ in pooled.calib + pooled.probe_calib]))}


def _shares(cfg, sampled: _Sampled, per: list[_Evidence], tests: list[dict]) -> list[dict]:
    """Each setting's share: what it sampled and verified, and whether that carries power."""
    ns, share = len(cfg.settings), []
    for i, (st, ev) in enumerate(zip(cfg.settings, per)):
        rs = sampled.reqs[i::ns]
        drafted_s = sum(r.stats.drafted for r in rs)
        own = {t["test"].split(" [")[0]: t for t in tests if t["setting"] == st.label}
        share.append({**st.to_dict(), "values": st.describe(), "requests": len(rs),
                      "tokens": sum(len(r.output_ids) for r in rs), "verified_drafts": len(ev.calib),
                      "probe_drafts": len(ev.probe_calib),
                      "probe_tokens": sum(len(r.output_ids) for _, rs_ in sampled.probe for s, r in rs_ if s == i),
                      "acceptance_rate": sum(r.stats.accepted for r in rs) / drafted_s if drafted_s else None,
                      "recovered": int(ev.family("recovered").numel()), "bonus": int(ev.family("bonus").numel()),
                      "outside_support": ev.outside,
                      "thin": ns > 1 and len(ev.calib) < cfg.min_verified_drafts / ns,
                      "tests": len(own), "failed": [n for n, t in own.items() if not t["passed"]]})
    return share


def _summary(cfg, v: _Verdict, share: list[dict], pit, trees: dict) -> str:
    """The line a person reads first: what failed and on which code path, or too few drafts,
    or what passed, on how much, per setting and with what power."""
    if v.failed:
        return (f"{', '.join(v.failed)} failed at alpha {v.alpha_each:.2g} each (Bonferroni over {v.m}): "
                "the sampler is biased; " + blame(v.tests, v.paths))
    if v.inconclusive:
        return (f"INCONCLUSIVE: only {v.verified} verified draft tokens (< {cfg.min_verified_drafts} "
                "needed); the speculative paths were hardly exercised")
    ns = len(cfg.settings)
    calib = next((t for t in v.tests if t["test"] == "calibration"), None)
    probe_t = next((t for t in v.tests if t["test"] == "probe-calibration"), None)
    thin = [sh for sh in share if sh["thin"]]
    thin_txt = ("; thin: " + ", ".join(f"{sh['label']} ({sh['verified_drafts']} verified drafts, under "
                                       f"{cfg.min_verified_drafts / ns:g}): its own tests carry little power"
                                       for sh in thin)) if thin else ""
    summary = (f"{v.m} tests pass at family-wise alpha {ALPHA:g}: PIT KS p = {pit.p_value:.3g} over "
               f"{pit.n} tokens, {v.verified} verified drafts calibrated"
               + (f" (z = {calib['statistic']:+.2f})" if calib is not None else "")
               + (f", {probe_t['n']} probe drafts (z = {probe_t['statistic']:+.2f})" if probe_t is not None else "")
               + "; settings " + "; ".join(
                   sh["label"] + ("" if sh["label"] == sh["values"] else f" ({sh['values']})")
                   + f": {sh['tokens']} tokens, {sh['verified_drafts']} verified drafts" for sh in share)
               + thin_txt + "; " + _power_txt(v.power))
    if trees["tree_steps"]:
        summary += (f"; {trees['tree_tokens']} of the tokens from {trees['tree_steps']} draft-tree steps "
                    f"({trees['tree_later_sibling']} taken off a later sibling)")
    return summary


def _figures(cfg, sampled: _Sampled, ev: _Gathered, v: _Verdict, share: list[dict], pit, trees: dict) -> dict:
    """The check's headline numbers, in the report's order."""
    reqs = sampled.reqs
    drafted = sum(r.stats.drafted for r in reqs)
    accepted = sum(r.stats.accepted for r in reqs)
    tokens = sum(len(r.output_ids) for r in reqs)
    return {"temperature": cfg.temperature, "temperatures": list(cfg.temperatures), "settings": share,
            **trees,
            "rule": cfg.rule, "alpha": ALPHA, "alpha_each": v.alpha_each, "correction": "Bonferroni",
            **pit.to_dict(), "tests": v.tests, "verified_drafts": v.verified,
            "min_verified_drafts": cfg.min_verified_drafts, "inconclusive": v.inconclusive,
            "thin_settings": [sh["label"] for sh in share if sh["thin"]], "code_paths": v.paths,
            "power_vs_relaxed": v.power,
            "drafting_forced": sampled.forced, "requests": len(reqs), "batch": sampled.batch,
            "max_new_tokens": sampled.max_new, "eos_ignored": True, "drafted": drafted,
            "probe": _probe_figures(sampled, ev.pooled),
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": tokens / sum(r.stats.target_passes for r in reqs),
            "sampling_tokens_per_s": tokens / sampled.seconds if sampled.seconds else None}


def _probe_figures(sampled: _Sampled, pooled: _Evidence) -> dict | None:
    """What the calibration probe ran and verified (None: no probe)."""
    probe_reqs = [r for _, rs in sampled.probe for _, r in rs]
    if not probe_reqs:
        return None
    pd_ = sum(r.stats.drafted for r in probe_reqs)
    return {"masses": [m for m, _ in sampled.probe], "k": PROBE_K, "requests": len(probe_reqs),
            "tokens": sum(len(r.output_ids) for r in probe_reqs), "verified_drafts": len(pooled.probe_calib),
            "acceptance_rate": sum(r.stats.accepted for r in probe_reqs) / pd_ if pd_ else None,
            "seconds": sampled.probe_s}


# -- from outside (endpoint mode: the state in endpoint/state.py) ------------------------------
def endpoint_distribution_check(a: EndpointAudit) -> CheckResult | None:
    if not a.sampled_tokens:
        return None
    why_not = rescore.supported(a.info.kind, a.ref_info.kind if a.ref_info else None)
    if a.score_with == "reference" and why_not:
        raise EndpointError(f"--score-with reference: {why_not}")
    a.sampled()
    result = _endpoint_distribution(a.srun, a.sampled_tokens, a.info, a.min_verified_drafts,
                                    None if a.score_with == "endpoint" or not why_not else why_not, a.seed)
    a.sampling_sent = {"sent": result.figures["sampler_sent"], "top_logprobs": result.figures["top_logprobs"]}
    return result


def _phase_counters(srun: EndpointRun) -> SpecCounters | None:
    """The endpoint's speculative counters summed over the sampled phase's rounds."""
    total = None
    for lv in srun.levels:
        if lv.spec is not None and not lv.spec.from_gauges:
            total = lv.spec if total is None else total.plus(lv.spec)
    return total


def _speculates(info: ServerInfo, counters: SpecCounters | None) -> bool | None:
    """Whether the endpoint drafts, as it says itself (None: it does not say)."""
    if info.kind == "verispec":
        return bool(info.speculative.get("drafter"))
    if info.kind == "llama.cpp" and info.speculative.get("slots") is not None:
        return bool(info.speculative.get("slots_speculative"))
    if counters is not None:  # vLLM publishes spec_decode counters only with a speculative config
        return True
    return None


def _endpoint_distribution(srun: EndpointRun, budget: int, info: ServerInfo, min_drafts: int,
                           no_reference: str | None = None, seed: int = 0) -> CheckResult:
    """no_reference: why the tokens sent without logprobs could not be scored by the reference.
    A speculative endpoint whose sampled phase verified fewer than min_drafts draft tokens
    (its counters' difference over the phase) has not shown its verifier exact: inconclusive."""
    f = distribution_figures(srun, seed=seed, min_tokens=min(200, budget))
    if no_reference and f["tokens_without_logprobs"]:
        f["reason"] = "; ".join(x for x in (f["reason"], f"not scored by a reference: {no_reference}") if x)
    counters = _phase_counters(srun)
    speculates = _speculates(info, counters)
    drafts = int(counters.draft_tokens) if counters is not None and counters.draft_tokens is not None else None
    f.update(verified_drafts=drafts if drafts is not None else "not published by the server",
             min_verified_drafts=min_drafts if speculates else "-", speculative_server=speculates,
             phase_counters=counters.to_dict() if counters else None)
    if counters is not None and counters.draft_tokens:
        f.update(acceptance_rate=counters.acceptance_rate, mean_accepted_length=counters.mean_acceptance_length)
    if speculates and (drafts is None or drafts < min_drafts):
        why = (f"inconclusive: the sampled phase verified {drafts} draft tokens (< {min_drafts}): the verifier "
               "was hardly exercised" if drafts is not None else
               "inconclusive: the server publishes no draft counters, so how many drafts the sampled phase "
               "verified is unknown")
        f["reason"] = "; ".join(x for x in (f["reason"], why) if x)
        f["passed"] = False
    conv = f["convention"]["endpoint"]
    if f["p_value"] is None:
        summary = f["reason"]
    else:
        summary = (f"randomised PIT over the top {conv['buckets']} + tail ({conv['name']}), {f['n']} tokens at T=1 "
                   f"(every other sampler setting sent as off): KS p = {f['p_value']:.3g}, D = {f['ks_statistic']:.3f}"
                   + (f"; {drafts} drafts verified in the phase"
                      + (f", acceptance {f['acceptance_rate']:.1%}" if f.get("acceptance_rate") is not None else "")
                      if drafts is not None else "")
                   + (f"; {f['reason']}" if f["reason"] else "") + f"; scored with {f['scored_with']}")
    f["sampler_sent"] = {"temperature": 1.0, **sampler_settings(info.kind)}
    f["prompts"] = (f"the suite's prompts and {len(DRAFTING_PROMPTS)} copy-heavy prompts in turn (answers that "
                    "copy their prompt, so that the drafter proposes)")
    return CheckResult(f["passed"], summary, f, {"answers": f["answers"]})
