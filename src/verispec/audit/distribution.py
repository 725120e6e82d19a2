"""The distribution check: sample with the speculative engine at temperature > 0, then
teacher-force the target on every output and test the randomised PIT for uniformity
(see stats.py). Requests run to a fixed length (EOS ignored) so the sample size is known
in advance; the test stays valid, as p is recomputed for exactly the emitted prefix."""

from __future__ import annotations

import math
import time

import torch

from ..engine import Request
from ..sampling import logits_to_probs
from .checks import CheckResult
from .context import AuditContext
from .equivalence import teacher_forced_logits
from .stats import randomized_pit, test_uniform

ALPHA = 1e-3


def distribution_check(ctx: AuditContext) -> CheckResult:
    cfg, sizes = ctx.config, ctx.config.sizes
    max_new = sizes.distribution_max_new
    n_req = math.ceil(sizes.distribution_tokens / max_new)
    # prompt i % n with its own seed: repeated prompts still give independent samples
    prompt_of = [ctx.prompt_ids[i % len(ctx.prompt_ids)] for i in range(n_req)]
    reqs = [Request(ids, ctx.sampled_params(cfg.seed * 1_000_003 + i, max_new))
            for i, ids in enumerate(prompt_of)]
    batch = min(max(cfg.batch_sizes), n_req)
    engine = ctx.engine(batch, max(map(len, prompt_of)) + max_new)
    t0 = time.perf_counter()
    with ctx.progress.stage(f"distribution: sampling, T={cfg.temperature:g}, b={batch}", n_req) as bar, \
            ctx.fault():
        engine.run(reqs, on_finish=lambda r: bar.advance())
    sample_s = time.perf_counter() - t0
    # teacher-force the target (outside any fault) for its exact p at every emitted position
    g = torch.Generator().manual_seed(cfg.seed)
    us = []
    with ctx.progress.stage("distribution: teacher forcing", n_req) as bar:
        for r in reqs:
            P = len(r.prompt_ids)
            logits = teacher_forced_logits(ctx.model, r.tokens[:-1], first=P - 1)  # [n_out,V]
            p = logits_to_probs(logits, r.params.sampling)  # [n_out,V]
            us.append(randomized_pit(p, torch.tensor(r.output_ids), g))
            bar.advance()
    test = test_uniform(torch.cat(us).numpy())  # sync: every u at once, for scipy
    drafted = sum(r.stats.drafted for r in reqs)
    accepted = sum(r.stats.accepted for r in reqs)
    tokens = sum(len(r.output_ids) for r in reqs)
    passed = test.passed(ALPHA)
    summary = (f"KS p = {test.p_value:.3g} over {test.n} sampled tokens at T={cfg.temperature:g} "
               + ("(uniform PIT: exact)" if passed else f"< {ALPHA:g}: the sampler is biased"))
    figures = {"temperature": cfg.temperature, "rule": cfg.rule, "alpha": ALPHA, **test.to_dict(),
               "requests": n_req, "batch": batch, "max_new_tokens": max_new, "eos_ignored": True,
               "acceptance_rate": accepted / drafted if drafted else None,
               "mean_accepted_length": tokens / sum(r.stats.target_passes for r in reqs),
               "sampling_tokens_per_s": tokens / sample_s if sample_s else None}
    return CheckResult("distribution", passed, summary, figures)
