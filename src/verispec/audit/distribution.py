"""The distribution check: sample with the speculative engine at temperature > 0 (under the
audited top-k / top-p / min-p), teacher-force the target on every output for its exact p
at every emitted position, and test what each mechanism of the rule promises (stats.py):

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

* **probe-calibration**: the calibration test on the drafts of the calibration probe
  (audit/probe.py): extra requests where the target drafts for itself from a nucleus of its
  own p, so that nearly every draft is kept with a known probability a = mass, where a
  relaxed threshold moves it most. The deployed drafter's drafts are mostly kept with
  a near 0 or 1, which carry little evidence; the probe's tokens also join the PIT families.

Half the requests run under the deployed policy, half with drafting forced (a fixed k),
so a policy that drafts little cannot make the check vacuous. The tests are combined by
Bonferroni: each runs at ALPHA / m for the m tests with data, so a correct engine fails
this check in at most ALPHA of audits. A check that verified fewer draft tokens than
`min_verified_drafts` is *inconclusive*, which fails it: it proved nothing about the
speculative paths. Requests run to a fixed length (EOS ignored) so the sample size is
known in advance; the tests stay valid, as p is recomputed for exactly the emitted prefix.
"""

from __future__ import annotations

import math
import time

import torch

from ..engine import EngineConfig, Request
from ..policy import FixedK
from ..sampling import logits_to_probs
from .checks import CheckResult
from .consistency import oracle_for
from .context import AuditContext
from .equivalence import prefix_cache, teacher_forced_logits
from .probe import nucleus_q, probe_drafter
from .stats import calibration_test, randomized_pit, tail_test, test_uniform

ALPHA = 1e-3  # family-wise: false alarms of the correct engine in at most 1 audit in 1,000
TAIL = 0.01  # the PIT tail tests: share of u above 1 - TAIL
MIN_TOKENS_PER_PIT = 20  # a PIT family with fewer tokens is not run (and not counted in m)


def _sample(ctx: AuditContext, reqs: list[Request], batch: int, max_len: int, policy, label: str) -> float:
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
    for step, ((n0, drafts, acc, _), qd) in enumerate(zip(r.stats.trace, r.stats.draft_q)):
        if not drafts or qd is None:
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


def _probe_requests(ctx: AuditContext, first_seed: int, max_new: int) -> list[tuple[float, list[Request]]]:
    """The calibration probe's requests (audit/probe.py), grouped by nucleus mass: each mass
    sees every audited temperature. None under a keyed rule (coupled), which reads no q."""
    cfg, sizes = ctx.config, ctx.config.sizes
    if sizes.probe_tokens <= 0 or cfg.rule == "coupled":
        return []
    n = math.ceil(sizes.probe_tokens / max_new)
    nt, masses = len(cfg.temperatures), sizes.probe_masses
    groups: dict[float, list[Request]] = {m: [] for m in masses}
    for i in range(n):
        ids = ctx.prompt_ids[(i * 7 + 3) % len(ctx.prompt_ids)]  # not the sampled run's order
        groups[masses[(i // nt) % len(masses)]].append(
            Request(ids, ctx.sampled_params(first_seed + i, max_new, cfg.temperature_of(i))))
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


def distribution_check(ctx: AuditContext) -> CheckResult:
    cfg, sizes = ctx.config, ctx.config.sizes
    max_new = sizes.distribution_max_new
    n_req = math.ceil(sizes.distribution_tokens / max_new)
    # prompt i % n with its own seed: repeated prompts still give independent samples
    prompt_of = [ctx.prompt_ids[i % len(ctx.prompt_ids)] for i in range(n_req)]
    # the audited temperatures in turn, so each half (deployed policy, forced k) has them all
    reqs = [Request(ids, ctx.sampled_params(cfg.seed * 1_000_003 + i, max_new, cfg.temperature_of(i)))
            for i, ids in enumerate(prompt_of)]
    batch = min(max(cfg.batch_sizes), n_req)
    max_len = max(map(len, ctx.prompt_ids)) + max_new
    forced = cfg.policy != "fixed"  # the deployed policy may draft little: force drafting too
    halves = [(reqs[: n_req // 2], "deployed policy", None),
              (reqs[n_req // 2:], f"fixed k={cfg.forced_k}", FixedK(cfg.forced_k))] if forced \
        else [(reqs, f"fixed k={cfg.k}", None)]
    sample_s = 0.0
    temps = ", ".join(f"{t:g}" for t in cfg.temperatures)
    for part, label, policy in halves:
        if part:
            sample_s += _sample(ctx, part, min(batch, len(part)), max_len, policy,
                                f"T={temps}, {label}, b={min(batch, len(part))}")
    probe = _probe_requests(ctx, cfg.seed * 1_000_003 + n_req, sizes.probe_max_new)
    probe_len = max(map(len, ctx.prompt_ids)) + sizes.probe_max_new
    probe_s = sum(_run_probe(ctx, m, rs, min(batch, len(rs)), probe_len) for m, rs in probe)
    # teacher-force the target (outside any fault) for its exact p at every emitted position
    g = torch.Generator().manual_seed(cfg.seed)
    oracle = oracle_for(ctx.drafter_factory(1, 8), ctx.model)  # the drafter's q, recomputed
    us, us_rec, us_bonus, calib, probe_calib, impossible = [], [], [], [], [], 0
    us_drafts: list[float] = []
    todo = [(r, None) for r in reqs] + [(r, m) for m, rs in probe for r in rs]
    # each prompt is prefilled once for all its outputs (the same batch-1 numbers)
    target_prefixes, draft_prefixes = prefix_cache(), prefix_cache()
    with ctx.progress.stage("distribution: teacher forcing", len(todo)) as bar:
        for r, mass in todo:
            P = len(r.prompt_ids)
            logits = teacher_forced_logits(ctx.model, r.tokens[:-1], first=P - 1,
                                           prefixes=target_prefixes)  # [n_out,V]
            p = logits_to_probs(logits, r.params.sampling)  # [n_out,V]
            out = torch.tensor(r.output_ids)
            us.append(randomized_pit(p, out, g))
            q = draft_q(oracle, r, p.shape[-1], draft_prefixes) if mass is None else nucleus_q(p, mass)
            c, rec, bonus, imp = _mechanisms(r, p, q)
            (calib if mass is None else probe_calib).extend(c)
            if mass is None:  # the deployed drafter's own draws (the probe's are the probe's)
                us_drafts.extend(_draft_pits(r, g))
            impossible += imp
            if rec:
                idx = torch.tensor([j for j, _ in rec])
                us_rec.append(randomized_pit(torch.stack([res for _, res in rec]), out[idx], g))  # [n_rec]
            if bonus:
                us_bonus.append(randomized_pit(p[bonus], out[bonus], g))
            bar.advance()
    families = {"pit": torch.cat(us)}
    for name, parts in (("recovered", us_rec), ("bonus", us_bonus)):
        u = torch.cat(parts) if parts else torch.empty(0)
        if u.numel() >= MIN_TOKENS_PER_PIT:
            families[name] = u
    if len(us_drafts) >= MIN_TOKENS_PER_PIT:
        families["drafts"] = torch.tensor(us_drafts, dtype=torch.float64)
    results = {name: test_uniform(u.numpy()) for name, u in families.items()}  # sync: for scipy
    tails = {name: tail_test(u.numpy(), TAIL) for name, u in families.items()}
    calib_res = calibration_test([a for a, _ in calib], [k for _, k in calib]) if calib else None
    probe_res = calibration_test([a for a, _ in probe_calib], [k for _, k in probe_calib]) if probe_calib else None
    m = len(results) + len(tails) + (calib_res is not None) + (probe_res is not None)
    alpha_each = ALPHA / m
    tests = [{"test": name, "kind": "KS, PIT of each draft under the q the verifier read (descending q)"
              if name == "drafts" else "KS, PIT over descending p", "statistic": t.ks_statistic, "n": t.n,
              "p_value": t.p_value, "alpha": alpha_each, "passed": t.passed(alpha_each), "histogram": t.histogram}
             for name, t in results.items()]
    tests += [{"test": f"{name}-tail", "kind": f"binomial, share of PIT above {1 - TAIL:g} (exactly {TAIL:g})",
               "statistic": t.count / t.n, "n": t.n, "p_value": t.p_value, "alpha": alpha_each,
               "passed": t.passed(alpha_each), "count": t.count} for name, t in tails.items()]
    if calib_res is not None:
        tests.append({"test": "calibration", "kind": "z, kept vs min(1, p/q)", "statistic": calib_res.z,
                      "n": calib_res.n, "p_value": calib_res.p_value, "alpha": alpha_each,
                      "passed": calib_res.passed(alpha_each), "kept": calib_res.kept,
                      "expected": calib_res.expected, "bins": _calibration_bins(calib)})
    if probe_res is not None:
        tests.append({"test": "probe-calibration",
                      "kind": f"z, kept vs min(1, p/q), q = target nucleus {'/'.join(f'{x:g}' for x, _ in probe)}",
                      "statistic": probe_res.z, "n": probe_res.n, "p_value": probe_res.p_value,
                      "alpha": alpha_each, "passed": probe_res.passed(alpha_each), "kept": probe_res.kept,
                      "expected": probe_res.expected, "bins": _calibration_bins(probe_calib)})
    if impossible:  # probability 0 under the null: no correction needed, no false alarm
        tests.append({"test": "recovered-is-draft", "kind": "count, recovered token == rejected draft (q one-hot)",
                      "statistic": float(impossible), "n": len(us_rec) and sum(len(u) for u in us_rec),
                      "p_value": 0.0, "alpha": alpha_each, "passed": False})
    verified = calib_res.n if calib_res is not None else 0
    probe_reqs = [r for _, rs in probe for r in rs]
    probe_fig = None
    if probe_reqs:
        pd_ = sum(r.stats.drafted for r in probe_reqs)
        probe_fig = {"masses": [m for m, _ in probe], "k": PROBE_K, "requests": len(probe_reqs),
                     "tokens": sum(len(r.output_ids) for r in probe_reqs), "verified_drafts": len(probe_calib),
                     "acceptance_rate": sum(r.stats.accepted for r in probe_reqs) / pd_ if pd_ else None,
                     "seconds": probe_s}
    drafted = sum(r.stats.drafted for r in reqs)
    accepted = sum(r.stats.accepted for r in reqs)
    tokens = sum(len(r.output_ids) for r in reqs)
    failed = [t["test"] for t in tests if not t["passed"]]
    inconclusive = not failed and verified < cfg.min_verified_drafts
    passed = not failed and not inconclusive
    pit = results["pit"]
    if failed:
        summary = (f"{', '.join(failed)} failed at alpha {alpha_each:.2g} each (Bonferroni over {m}): "
                   "the sampler is biased")
    elif inconclusive:
        summary = (f"INCONCLUSIVE: only {verified} verified draft tokens (< {cfg.min_verified_drafts} "
                   "needed); the speculative paths were hardly exercised")
    else:
        summary = (f"{m} tests pass at family-wise alpha {ALPHA:g}: PIT KS p = {pit.p_value:.3g} over "
                   f"{pit.n} tokens, {verified} verified drafts calibrated"
                   + (f" (z = {calib_res.z:+.2f})" if calib_res is not None else "")
                   + (f", {probe_res.n} probe drafts (z = {probe_res.z:+.2f})" if probe_res is not None else "")
                   + f", T={temps}")
    figures = {"temperature": cfg.temperature, "temperatures": list(cfg.temperatures), "top_k": cfg.top_k, "top_p": cfg.top_p, "min_p": cfg.min_p,
               "rule": cfg.rule, "alpha": ALPHA, "alpha_each": alpha_each, "correction": "Bonferroni",
               **pit.to_dict(), "tests": tests, "verified_drafts": verified,
               "min_verified_drafts": cfg.min_verified_drafts, "inconclusive": inconclusive,
               "drafting_forced": forced, "requests": n_req, "batch": batch, "max_new_tokens": max_new,
               "eos_ignored": True, "drafted": drafted, "probe": probe_fig,
               "acceptance_rate": accepted / drafted if drafted else None,
               "mean_accepted_length": tokens / sum(r.stats.target_passes for r in reqs),
               "sampling_tokens_per_s": tokens / sample_s if sample_s else None}
    # every verified draft's exact acceptance probability: what benchmarks/audit_power.py
    # replays to measure this check's power against relaxed acceptance rules
    details = {"calibration_a": [round(a, 6) for a, _ in calib],
               "probe_a": [round(a, 6) for a, _ in probe_calib]}
    return CheckResult("distribution", passed, summary, figures, details)
