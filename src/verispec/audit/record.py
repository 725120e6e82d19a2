"""What was audited, exactly, and what would invalidate the verdict (re-test triggers)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
import sys

import torch

from .checks import CheckResult
from .context import AuditContext

PACKAGES = ("verispec", "torch", "transformers", "tokenizers", "safetensors", "numpy", "scipy")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        if dist == "verispec":
            from .. import __version__
            return __version__
        return None


def _files(files) -> dict | None:
    if files is None:
        return None
    return {"name": files.name, "source": files.source, "path": str(files.path),
            "sha256": files.sha256, "files": files.files}


def _suite_digest(ctx: AuditContext) -> str:
    blob = json.dumps([dataclasses.asdict(p) for p in ctx.prompts], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def build_record(ctx: AuditContext, target_files, draft_files, started: str) -> dict:
    cfg = ctx.config
    probe = ctx.drafter_factory(1, 8)
    drafter = {"spec": cfg.draft, "name": probe.name, "k": cfg.k,
               "policy": f"FixedK({cfg.k})" if cfg.policy == "fixed" else f"adaptive (k <= {cfg.k})", "model_files": _files(draft_files)}
    greedy_len = max(map(len, ctx.prompt_ids)) + cfg.sizes.max_new_tokens
    rec = {
        "started_at": started,
        "target": {"spec": cfg.target, **(_files(target_files) or {"files": None}),
                   "config": dataclasses.asdict(ctx.model.config)},
        "drafter": drafter,
        "rule": cfg.rule,
        "engine": {"rule": cfg.rule, "batch_invariant": cfg.batch_invariant,
                   "backend": ctx.model.runtime, "kernels": ctx.model.backend,
                   "batch_sizes": list(cfg.greedy_batch_sizes),
                   "max_len_greedy": greedy_len,
                   # the adaptive policy's cost model: one, timed at the largest batch size
                   "cost_model": ({"max_batch": ctx.costs["max_batch"], "source": ctx.costs["source"]}
                                  if ctx.costs else None),
                   "dtype": "float32" if ctx.model.runtime == "native" else "GGUF as shipped"},
        "seed": cfg.seed,
        "temperature": cfg.temperature,
        "temperatures": list(cfg.temperatures),
        "sampling_settings": [s.to_dict() for s in cfg.settings],
        "suite": {"spec": cfg.suite, "prompts_audited": len(ctx.prompts), "prompts_in_suite": len(ctx.suite),
                  "sha256_of_audited_prompts": _suite_digest(ctx)},
        "prompt_format": "chat template" if ctx.chat else "raw text",
        "stop_token_ids": list(ctx.stops),
        "sizes": dataclasses.asdict(cfg.sizes),
        "inject_fault": cfg.inject_fault,
        "packages": {name: _version(name) for name in PACKAGES} | {"python": sys.version.split()[0]},
        "machine": {"platform": platform.platform(), "machine": platform.machine(),
                    "processor": platform.processor() or None, "cpu_count": os.cpu_count(),
                    "torch_threads": torch.get_num_threads()},
    }
    rec["retest_triggers"] = retest_triggers(rec)
    return rec


def retest_triggers(rec: dict) -> list[dict]:
    """A change of any of these invalidates the verdict: re-run the audit."""
    t = rec["target"]
    d = rec["drafter"]
    items = [
        ("target model weights (file hashes)", t.get("sha256") or (t.get("files") and "per-file sha256")),
        ("drafter (kind, depth, draft model weights)", d["name"] + (
            f" @ {d['model_files']['sha256']}" if d.get("model_files") and d["model_files"].get("sha256") else "")),
        ("draft length k / policy", d["policy"]),
        ("verification rule", rec["rule"]),
        ("engine version (verispec)", rec["packages"]["verispec"]),
        ("torch version (kernels, reduction order)", rec["packages"]["torch"]),
        ("model backend and its kernels", f"{rec['engine']['backend']}: {rec['engine']['kernels']}"),
        ("transformers / tokenizers version (tokenization)",
         f"{rec['packages']['transformers']} / {rec['packages']['tokenizers']}"),
        ("numpy / scipy version (statistics)", f"{rec['packages']['numpy']} / {rec['packages']['scipy']}"),
        ("batch sizes in production beyond those audited", rec["engine"]["batch_sizes"]),
        ("sampling settings in production beyond those audited (temperature, top-k, top-p, min-p)",
         "; ".join(f"{s['label']}: T={s['temperature']:g}, top-k {s['top_k']}, top-p {s['top_p']:g}, "
                   f"min-p {s['min_p']:g}" for s in rec["sampling_settings"])),
        ("context length beyond the audited maximum", rec["engine"]["max_len_greedy"]),
        ("prompt format / chat template", rec["prompt_format"]),
        ("machine (CPU, thread count: kernels differ)",
         f"{rec['machine']['machine']}, {rec['machine']['cpu_count']} cpus, "
         f"{rec['machine']['torch_threads']} threads"),
        ("workload mix (suite slices)", rec["suite"]["sha256_of_audited_prompts"][:16]),
        ("seed (reproducing this exact run)", rec["seed"]),
    ]
    return [{"trigger": what, "audited": value} for what, value in items]


def record_check(rec: dict) -> CheckResult:
    hashed = rec["target"].get("files") or {}
    summary = (f"target {rec['target'].get('name') or rec['target']['spec']}: {len(hashed)} files hashed; "
               f"{len(rec['retest_triggers'])} re-test triggers")
    figures = {"target_sha256": rec["target"].get("sha256"), "files_hashed": len(hashed),
               "retest_triggers": len(rec["retest_triggers"])}
    return CheckResult(True, summary, figures, informational=True)
