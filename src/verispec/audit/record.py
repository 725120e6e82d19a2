"""What was audited, exactly, and what would invalidate the verdict (re-test triggers):
`record_check` offline, `endpoint_record_check` from outside (what the server says of itself)."""

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
from .endpoint.state import EndpointAudit
from .endpoint.kinds import ServerInfo

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


# -- from outside (endpoint mode: the state in endpoint/state.py) ------------------------------
def endpoint_record_check(a: EndpointAudit) -> CheckResult:
    record = _endpoint_record(a.run or a.srun or a.floor_run, a.reference, a.info, a.ref_info, a.reference_kind,
                              a.prompts, a.chat, a.max_tokens, a.concurrency, a.suite_spec, a.suite_size, a.started)
    record["suite"]["audit_seed"] = a.seed  # the prompts chosen, the sampled phase's order, the tie-breaks
    record["suite"]["prompt_ids"] = [p.id for p in a.prompts]
    if a.sampling_sent is not None:
        record["sampling"]["distribution_check"] = {**a.sampling_sent, "seed": "none sent", "audit_seed": a.seed}
    a.record = record
    audited = a.run or a.srun or a.floor_run
    info = a.info
    return CheckResult(True, f"endpoint {audited.url} ({info.kind} {info.version or 'version unknown'}), "
                                       f"model {audited.model}; {len(record['retest_triggers'])} re-test triggers",
                       {"kind": info.kind, "version": info.version, "model": audited.model}, informational=True)


def _drafter_record(info: ServerInfo) -> dict:
    """The drafter, k, policy and rule as the server reports them; "not published" where it does not."""
    sp = info.speculative
    if info.kind == "verispec":
        d = sp.get("drafter")
        return {"spec": d, "name": d or "none (speculation off)", "k": sp.get("k", "not published"),
                "policy": sp.get("policy", "not published"), "rule": sp.get("rule", "not published"),
                "model_files": None}
    if info.kind == "llama.cpp":
        n, on = sp.get("slots"), sp.get("slots_speculative")
        drafting = ("unknown (no /slots)" if n is None else f"speculative in {on} of {n} slots" if on
                    else "no speculation (no slot drafts)")
        return {"spec": sp.get("speculative.types"), "name": f"llama.cpp: {drafting}",
                "k": "not published by llama-server", "policy": "llama.cpp's own (--spec-* flags)",
                "rule": "not published (llama.cpp verifies with its own sampler)", "model_files": None}
    if info.kind == "sglang":
        algo = sp.get("speculative_algorithm")
        return {"spec": algo, "name": f"SGLang {algo}" if algo else "none", "model_files": None,
                "k": sp.get("speculative_num_draft_tokens", "not published"),
                "policy": f"steps {sp.get('speculative_num_steps')}, topk {sp.get('speculative_eagle_topk')}",
                "rule": "not published"}
    return {"spec": None, "name": "not published by the server", "k": "not published", "policy": "not published",
            "rule": "not published", "model_files": None}


def _endpoint_record(run, reference, info: ServerInfo, ref_info: ServerInfo | None, reference_kind, prompts, chat,
                     max_tokens, concurrency, suite_spec, suite_size, started) -> dict:
    digest = hashlib.sha256(json.dumps([[p.id, p.slice, p.prompt] for p in prompts]).encode()).hexdigest()
    drafter = _drafter_record(info)
    sampling = {"temperature": 0.0, "seed": "none sent (greedy)", "sent": "temperature 0 (greedy)"}
    rec = {
        "started_at": started,
        "target": {"spec": run.model, "name": run.model, "files": None},
        "drafter": drafter,
        "rule": drafter["rule"],
        "engine": {"endpoint": run.url, "server": info.kind, "version": info.version, "reference": reference_kind,
                   "batch_sizes": list(concurrency), "max_tokens": max_tokens},
        "endpoint": {"url": run.url, "kind": info.kind, "model": run.model, "logprobs": run.logprobs,
                     "reference": reference.url if reference else None, "reference_kind": reference_kind},
        "server": info.to_dict(),
        "reference_server": ref_info.to_dict() if ref_info else None,
        "seed": sampling["seed"],
        "temperature": 0.0,
        "sampling": sampling,
        "suite": {"spec": suite_spec, "prompts_audited": len(prompts), "prompts_in_suite": suite_size or len(prompts),
                  "sha256_of_audited_prompts": digest},
        "prompt_format": "chat (the server's template)" if chat else "raw text",
        "sizes": {"name": "endpoint", "max_new_tokens": max_tokens},
        "packages": {name: _version(name) for name in PACKAGES} | {"python": sys.version.split()[0]},
        "machine": {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
                    "role": "client (the server's machine is not visible)"},
    }
    rec["retest_triggers"] = [{"trigger": t, "key": key, "audited": v} for key, t, v in (
        ("model", "served model", run.model),
        ("model_files", "model files (server-reported path / id)",
         info.settings.get("model_path") or info.settings.get("model_id") or info.settings.get("model")),
        ("server", "server software and version", f"{info.kind} {info.version or '(version not published)'}"),
        ("drafter", "drafter (server-reported)", drafter["name"]),
        ("k", "draft length k", drafter["k"]),
        ("rule", "verification rule", drafter["rule"]),
        ("batch_levels", "concurrency levels audited", list(concurrency)),
        ("slots", "server batch slots", info.settings.get("total_slots") or info.settings.get("max_running_requests")),
        ("prompt_format", "prompt format / chat template", rec["prompt_format"]),
        ("suite", "workload mix (suite slices)", digest[:16]))]
    return rec
