"""`verispec audit --endpoint URL`: the audit's checks against any OpenAI-compatible server,
written as the same report files (report.json, report.md, report.html) as the offline audit.

What can be checked from outside, with the client in client.py:
* equivalence at temperature 0: every load level (concurrent clients) of the endpoint
  against a non-speculative reference: --reference-endpoint, or, for a verispec server,
  the same server with ``"verispec": {"speculate": false}``; failing both, the endpoint's
  own concurrency-1 answers (then only load invariance is tested, and the report says so).
  The comparison is on text; a divergence is a near-tie only when the reference returned
  logprobs and its top-2 margin there is below the audit's tie margin (log-probability
  differences equal logit differences), otherwise it counts as a divergence;
* corruption signatures of the text against the reference's (words stand in for tokens;
  perplexity from the returned logprobs when there are any);
* per-slice speed and acceptance (per-request stats where the server returns them, the
  /metrics counters of vLLM, SGLang or verispec otherwise) and throughput per load level.

Wiring into `verispec audit` (audit/cli.py): ``add_endpoint_arguments(a)`` in
add_audit_parser, and at the top of cmd_audit
``if args.endpoint: from .endpoint.runner import cmd_endpoint_audit; return cmd_endpoint_audit(args)``.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import re
import sys
import time

import httpx

from .client import EndpointConfig, EndpointRun, PromptResult, audit_endpoint, first_divergence, server_kind

WORD = re.compile(r"\w+|[^\w\s]|\s+")


def _concurrency(s: str) -> tuple[int, ...]:
    import argparse
    try:
        levels = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got {s!r}")
    return levels


def add_endpoint_arguments(a) -> None:
    """The endpoint options of `verispec audit` (with --suite, --out, --quick of the audit)."""
    a.add_argument("--endpoint", default=None,
                   help="audit this OpenAI-compatible server (base URL) instead of a local engine")
    a.add_argument("--reference-endpoint", default=None,
                   help="non-speculative reference server (default: the endpoint itself with speculation "
                        "off when it is verispec serve)")
    a.add_argument("--model", dest="endpoint_model", default=None, help="model id (default: /v1/models' first)")
    a.add_argument("--api-key", dest="endpoint_api_key", default=None, help="bearer token for the endpoint(s)")
    a.add_argument("--concurrency", type=_concurrency, default=(1, 8),
                   help="load levels: concurrent clients, comma-separated (default 1,8)")
    a.add_argument("--max-tokens", dest="endpoint_max_tokens", type=int, default=64,
                   help="max_tokens per request (default 64)")
    a.add_argument("--raw", dest="endpoint_raw", action="store_true",
                   help="send raw prompts to /v1/completions instead of chat messages")


def cmd_endpoint_audit(args) -> int:
    from ..context import select_prompts
    from ..report import write_reports
    from ..suite import load_suite

    suite = load_suite(args.suite)
    prompts = select_prompts(suite, 2 if getattr(args, "quick", False) else None)
    report = run_endpoint_audit(args.endpoint, prompts, reference_url=args.reference_endpoint,
                                model=args.endpoint_model, api_key=args.endpoint_api_key,
                                chat=not args.endpoint_raw, max_tokens=args.endpoint_max_tokens,
                                concurrency=args.concurrency, suite_spec=args.suite, suite_size=len(suite))
    paths = write_reports(report, args.out)
    print(f"verdict: {report['verdict'].upper()}"
          + (f" (failed: {', '.join(report['failed_checks'])})" if report["failed_checks"] else "")
          + f" in {report['elapsed_s']:.0f} s", file=sys.stderr)
    for c in report["checks"]:
        print(f"  {c['name']:<20} {'info' if c['informational'] else ('pass' if c['passed'] else 'FAIL'):<5} "
              f"{c['summary']}", file=sys.stderr)
    print(f"reports: {paths['json']}, {paths['md']}, {paths['html']}", file=sys.stderr)
    return 0 if report["verdict"] == "pass" else 1


def _server_info(url: str, api_key: str | None) -> tuple[str, dict]:
    """(kind, the "verispec" object of /v1/models if any)."""
    base = EndpointConfig(url).base
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    kind, info = "unknown", {}
    try:
        m = httpx.get(base + "/metrics", headers=headers, timeout=30)
        if m.status_code == 200:
            kind = server_kind(m.text)
        models = httpx.get(base + "/v1/models", headers=headers, timeout=30).json()["data"]
        info = models[0].get("verispec") or {}
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        pass
    return kind, info


def run_endpoint_audit(url: str, prompts: list, *, reference_url: str | None = None, model: str | None = None,
                       api_key: str | None = None, chat: bool = True, max_tokens: int = 64,
                       concurrency: tuple[int, ...] = (1, 8), suite_spec: str = "default",
                       suite_size: int | None = None) -> dict:
    """Run the endpoint (and its reference) over the prompts; the report as a dict in the
    offline audit's format (audit.report.write_reports renders it)."""
    t0 = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    kind, info = _server_info(url, api_key)
    cfg = EndpointConfig(url, model=model, api_key=api_key, chat=chat, max_tokens=max_tokens,
                         concurrency=concurrency, logprobs=True)
    if reference_url:
        ref_cfg = EndpointConfig(reference_url, model=model, api_key=api_key, chat=chat, max_tokens=max_tokens,
                                 concurrency=concurrency, logprobs=True)
        reference_kind = f"reference endpoint {EndpointConfig(reference_url).base}"
    elif kind == "verispec":
        ref_cfg = EndpointConfig(url, model=model, api_key=api_key, chat=chat, max_tokens=max_tokens,
                                 concurrency=concurrency, logprobs=True,
                                 extra_body={"verispec": {"speculate": False}})
        reference_kind = "the same verispec server with speculation off"
    else:
        ref_cfg = None
        reference_kind = "none: the endpoint's own answers at the lowest concurrency (load invariance only)"
    reference = audit_endpoint(ref_cfg, prompts) if ref_cfg else None
    run = audit_endpoint(cfg, prompts)
    base_results = reference.levels[0].results if reference else run.levels[0].results

    checks = []
    if info.get("rule"):
        lossy = bool(info.get("lossy"))
        checks.append(_check("lossy-rule", not lossy, f"server rule {info['rule']!r} is "
                             + ("LOSSY" if lossy else "exact"), {"rule": info["rule"], "lossy": lossy}))
    checks.append(_equivalence(run, base_results, reference_kind))
    checks.append(_corruption(run, base_results))
    checks.append(_slices(run, reference))
    checks.append(_load(run, reference))
    record = _record(run, reference, kind, info, reference_kind, prompts, chat, max_tokens, concurrency,
                     suite_spec, suite_size, started)
    checks.append(_check("record", True, f"endpoint {run.url} ({kind}), model {run.model}; "
                                         f"{len(record['retest_triggers'])} re-test triggers",
                         {"kind": kind, "model": run.model}, informational=True))
    failed = [c["name"] for c in checks if not c["passed"]]
    samples = [{"slice": p.slice, "prompt": p.prompt, "reference": r.text or "", "speculative": g.text or ""}
               for p, r, g in list(zip(prompts, base_results, run.levels[-1].results))[:6]]
    return {"verdict": "fail" if failed else "pass", "failed_checks": failed,
            "elapsed_s": round(time.perf_counter() - t0, 1), "checks": checks, "record": record,
            "samples": samples, "endpoint_runs": {"endpoint": run.to_dict(),
                                                  "reference": reference.to_dict() if reference else None}}


def _check(name, passed, summary, figures=None, details=None, informational=False) -> dict:
    return {"name": name, "passed": passed, "informational": informational, "summary": summary,
            "elapsed_s": 0.0, "figures": figures or {}, "details": details}


def _equivalence(run: EndpointRun, refs: list[PromptResult], reference_kind: str) -> dict:
    from ..equivalence import TIE_MARGIN
    from ..runner import EXACT_MATCH_MIN

    from .client import _margin_at
    per_batch, rows, failures = [], [], []
    margins_known = any(r.top2_margins for r in refs)
    for level in run.levels:
        counts = {"identical": 0, "near-tie": 0, "divergence": 0}
        for ref, got in zip(refs, level.results):
            if not (ref.ok and got.ok):
                verdict, at, margin = "divergence", None, None
            else:
                at = first_divergence(ref.text, got.text)
                margin = _margin_at(ref, at) if at is not None else None
                verdict = ("identical" if at is None else
                           "near-tie" if margin is not None and margin < TIE_MARGIN else "divergence")
            counts[verdict] += 1
            rows.append({"batch": level.concurrency, "id": got.id, "slice": got.slice, "exact": at is None,
                         "first_divergence": at, "margin": margin, "verdict": verdict,
                         "error": got.error or ref.error})
        n = len(level.results)
        rate = counts["identical"] / n if n else 0.0
        allowed = max(1, math.floor((1 - EXACT_MATCH_MIN) * n))
        ok = counts["divergence"] == 0 and (rate >= EXACT_MATCH_MIN or n - counts["identical"] <= allowed)
        per_batch.append({"batch": level.concurrency, "rows_decoded_together": min(level.concurrency, n),
                          "prompts": n, "exact_match_rate": rate, **counts, "passed": ok})
        if counts["divergence"]:
            failures.append(f"c={level.concurrency}: {counts['divergence']} divergence(s)"
                            + ("" if margins_known else " (no logprobs: margins unknown)"))
        elif not ok:
            failures.append(f"c={level.concurrency}: exact match {rate:.0%} < {EXACT_MATCH_MIN:.0%}")
    summary = ("exact match (text) " + ", ".join(f"c{r['batch']} {r['exact_match_rate']:.0%}" for r in per_batch)
               + ("" if not failures else "; " + "; ".join(failures)))
    figures = {"exact_match_by_batch": {str(r["batch"]): r["exact_match_rate"] for r in per_batch},
               "min_exact_match": min(r["exact_match_rate"] for r in per_batch),
               "divergences": sum(r["divergence"] for r in per_batch),
               "near_ties": sum(r["near-tie"] for r in per_batch), "tie_margin": TIE_MARGIN,
               "exact_match_threshold": EXACT_MATCH_MIN, "prompts": len(refs), "reference": reference_kind,
               "compared_on": "text (batch = concurrent clients)", "reference_logprobs": margins_known}
    return _check("equivalence", not failures, summary, figures, {"per_batch": per_batch, "prompts": rows})


def _pseudo_tokens(text: str) -> list[int]:
    """Words, punctuation and whitespace runs as ids: the token stand-in for signatures."""
    ids: dict[str, int] = {}
    return [ids.setdefault(w, len(ids)) for w in WORD.findall(text)]


def _signatures(r: PromptResult):
    from ..corruption import signatures
    lps = [x for x in (r.token_logprobs or []) if x is not None]
    ppl = math.exp(-sum(lps) / len(lps)) if lps else None
    return signatures(_pseudo_tokens(r.text or ""), r.text or "", r.finish_reason == "stop", ppl)


def _corruption(run: EndpointRun, refs: list[PromptResult]) -> dict:
    from ..corruption import new_signatures
    ref_sigs = [_signatures(r) if r.ok else None for r in refs]
    flagged, per_batch = [], []
    for level in run.levels:
        n = 0
        for ref, rs, got in zip(refs, ref_sigs, level.results):
            if rs is None or not got.ok or got.text == ref.text:
                continue
            flags = new_signatures(_signatures(got), rs)
            if flags:
                n += 1
                flagged.append({"batch": level.concurrency, "id": got.id, "slice": got.slice, "signatures": flags,
                                "text": (got.text or "")[-200:]})
        per_batch.append({"batch": level.concurrency, "outputs": len(level.results), "flagged": n})
    total = sum(r["outputs"] for r in per_batch)
    summary = (f"no new corruption signature in {total} endpoint outputs" if not flagged
               else f"{len(flagged)} of {total} endpoint outputs show signatures their reference lacks")
    return _check("corruption", not flagged, summary, {"outputs_checked": total, "flagged": len(flagged),
                                                       "tokens": "words (the API returns no token ids)"},
                  {"per_batch": per_batch, "flagged": flagged[:50]})


def _tps(results: list[PromptResult]) -> float | None:
    toks = sum(r.completion_tokens or 0 for r in results if r.ok)
    secs = sum(r.latency_s or 0.0 for r in results if r.ok)
    return toks / secs if secs else None


def _slice_row(name: str, spec: list[PromptResult], plain: list[PromptResult] | None, pooled=None) -> dict:
    infos = [r.server_info for r in spec if r.ok and r.server_info]
    drafted = sum(i.get("drafted") or 0 for i in infos)
    accepted = sum(i.get("accepted") or 0 for i in infos)
    passes = sum(i.get("target_passes") or 0 for i in infos)
    toks = sum(r.completion_tokens or 0 for r in spec if r.ok)
    mal = toks / passes if passes else (_tokens_per_pass(pooled) if pooled else None)
    rate = accepted / drafted if drafted else (pooled.acceptance_rate if pooled else None)
    per_pos = pooled.acceptance_per_position if pooled else []
    s_tps, p_tps = _tps(spec), (_tps(plain) if plain else None)
    return {"slice": name, "prompts": len(spec), "tokens": toks, "mean_accepted_length": mal, "acceptance_rate": rate,
            "acceptance_per_position": [a for a in per_pos if a is not None], "plain_tokens_per_s": p_tps,
            "speculative_tokens_per_s": s_tps, "speedup": s_tps / p_tps if s_tps and p_tps else None}


def _tokens_per_pass(spec) -> float | None:
    """Tokens per target pass where the server counts passes (verispec), else vLLM's
    1 + accepted / drafts (per verification, bonus token included) or SGLang's gauge."""
    return spec.tokens_per_target_pass or spec.mean_acceptance_length


def _slices(run: EndpointRun, reference: EndpointRun | None) -> dict:
    level = run.levels[0]
    plain = reference.levels[0].results if reference else None
    names = list(dict.fromkeys(r.slice for r in level.results))
    rows = []
    for name in names:
        idx = [i for i, r in enumerate(level.results) if r.slice == name]
        rows.append(_slice_row(name, [level.results[i] for i in idx], [plain[i] for i in idx] if plain else None))
    pooled = _slice_row("pooled", level.results, plain, level.spec)
    ranked = [r for r in rows if r["speedup"] is not None] or rows
    key = (lambda r: r["speedup"]) if any(r["speedup"] is not None for r in rows) else (
        lambda r: r["mean_accepted_length"] or 0)
    best, worst = (max(ranked, key=key)["slice"], min(ranked, key=key)["slice"]) if ranked else (None, None)
    summary = (f"concurrency {level.concurrency}: pooled speedup "
               + (f"{pooled['speedup']:.2f}x" if pooled["speedup"] else "n/a (no separate reference)")
               + (f", {pooled['mean_accepted_length']:.2f} tokens/target pass" if pooled["mean_accepted_length"]
                  else ""))
    figures = {"pooled_speedup": pooled["speedup"], "pooled_mean_accepted_length": pooled["mean_accepted_length"],
               "pooled_acceptance_rate": pooled["acceptance_rate"], "best_slice": best, "worst_slice": worst,
               "server_counters": level.spec.to_dict() if level.spec else None}
    return _check("slices", True, summary, figures, {"slices": rows, "pooled": pooled}, informational=True)


def _load(run: EndpointRun, reference: EndpointRun | None) -> dict:
    ref_by_c = {lv.concurrency: lv for lv in reference.levels} if reference else {}
    points = []
    for lv in run.levels:
        ok = [r for r in lv.results if r.ok]
        ref = ref_by_c.get(lv.concurrency)
        s_tps = lv.completion_tokens / lv.wall_s if lv.wall_s else None
        p_tps = ref.completion_tokens / ref.wall_s if ref and ref.wall_s else None

        def ms_per_token(results):
            v = [1000 * r.latency_s / r.completion_tokens for r in results if r.ok and r.completion_tokens]
            return sum(v) / len(v) if v else None
        points.append({"batch": lv.concurrency,
                       "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok) / len(ok) if ok else 0,
                       "plain_tokens_per_s": p_tps, "speculative_tokens_per_s": s_tps,
                       "plain_ms_per_token": ms_per_token(ref.results) if ref else None,
                       "speculative_ms_per_token": ms_per_token(lv.results),
                       "mean_accepted_length": _tokens_per_pass(lv.spec) if lv.spec else None,
                       "speedup": s_tps / p_tps if s_tps and p_tps else None,
                       "server_counters": lv.spec.to_dict() if lv.spec else None})
    below = [p["batch"] for p in points if p["speedup"] is not None and p["speedup"] < 1]
    summary = ("throughput per load level: " + ", ".join(
        f"c{p['batch']} {p['speculative_tokens_per_s'] or 0:.1f} tok/s"
        + (f" ({p['speedup']:.2f}x)" if p["speedup"] else "") for p in points)
        + (f"; slower than the reference from concurrency {below[0]}" if below else ""))
    return _check("load", True, summary, {"crossover_concurrency": below[0] if below else None},
                  {"points": {"short": points}}, informational=True)


def _record(run, reference, kind, info, reference_kind, prompts, chat, max_tokens, concurrency, suite_spec,
            suite_size, started) -> dict:
    import hashlib
    import json

    from ..record import PACKAGES, _version
    digest = hashlib.sha256(json.dumps([[p.id, p.slice, p.prompt] for p in prompts]).encode()).hexdigest()
    drafter = {"spec": info.get("drafter") or "server-side", "name": info.get("drafter") or f"{kind} (server-side)",
               "k": info.get("k", "?"), "policy": f"FixedK({info['k']})" if "k" in info else "unknown",
               "model_files": None}
    rec = {
        "started_at": started,
        "target": {"spec": run.model, "name": run.model, "files": None},
        "drafter": drafter,
        "rule": info.get("rule", "unknown (server-side)"),
        "engine": {"endpoint": run.url, "server": kind, "reference": reference_kind,
                   "batch_sizes": list(concurrency), "max_tokens": max_tokens},
        "endpoint": {"url": run.url, "kind": kind, "model": run.model, "logprobs": run.logprobs,
                     "reference": reference.url if reference else None, "reference_kind": reference_kind},
        "seed": 0,
        "temperature": 0.0,
        "suite": {"spec": suite_spec, "prompts_audited": len(prompts), "prompts_in_suite": suite_size or len(prompts),
                  "sha256_of_audited_prompts": digest},
        "prompt_format": "chat (the server's template)" if chat else "raw text",
        "sizes": {"name": "endpoint", "max_new_tokens": max_tokens},
        "packages": {name: _version(name) for name in PACKAGES} | {"python": sys.version.split()[0]},
        "machine": {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
                    "role": "client (the server's machine is not visible)"},
    }
    rec["retest_triggers"] = [{"trigger": t, "audited": v} for t, v in (
        ("served model", run.model), ("server software and version", kind),
        ("drafter / k / rule (server-side)", f"{drafter['name']}, k={drafter['k']}, {rec['rule']}"),
        ("concurrency beyond the audited levels", list(concurrency)),
        ("prompt format / chat template", rec["prompt_format"]),
        ("workload mix (suite slices)", digest[:16]))]
    return rec
