"""The quick audit's greedy checks (equivalence with its null run, drafter consistency) on the
ggml backend, in parts that resume: on a shared 2-core machine whose CPU is handed out in
slots of ~12 minutes, the Qwen pair's greedy runs alone do not fit one slot. Each call runs
stages until --budget seconds are spent, saves what it made to --state (a pickle of the
finished requests and the adaptive policy's measured costs) and exits; the next call goes
on. The stages are the audit's own (audit/runner.greedy_runs, in its order): plain and
speculative batch 1 interleaved prompt by prompt, speculative at each other batch size,
drafting forced at the largest; then equivalence.equivalence_check and
consistency.drafter_consistency_check, unchanged, on those runs. Prints the checks' summaries
and, with --json, writes their results.

    python benchmarks/ggml_audit_parts.py --state /tmp/qwen.pkl --budget 600   # again until done
    # a fault, reusing the clean run's plain reference (the reference never runs inside a fault):
    python benchmarks/ggml_audit_parts.py --state /tmp/fault.pkl --reference-from /tmp/qwen.pkl \\
        --inject-fault rollback-off-by-one --batches 1
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

GGUF = Path(os.environ.get("VERISPEC_CACHE", Path.home() / ".cache/verispec")) / "gguf"


def build_context(args):
    from verispec.audit.context import AuditConfig, AuditContext, AuditSizes, encode, select_prompts
    from verispec.audit.progress import PlainProgress
    from verispec.audit.runner import drafter_factory_from_spec
    from verispec.audit.suite import load_suite
    from verispec.cli import set_threads
    from verispec.models import load_model
    target = load_model(args.target, backend="ggml", progress=False)
    set_threads(args.threads, target.model)
    factory, _ = drafter_factory_from_spec(args.draft, target.model, target.tokenizer)
    cfg = AuditConfig(target=args.target, draft=args.draft, k=8, policy="adaptive", sizes=AuditSizes.quick(),
                      batch_sizes=tuple(args.batches), inject_fault=args.inject_fault)
    tok, model = target.tokenizer, target.model
    chosen = select_prompts(load_suite("default"), cfg.sizes.prompts_per_slice)
    chat = bool(getattr(tok, "chat_template", None))
    stops = tuple(dict.fromkeys(tuple(model.config.eos_token_ids) + ((tok.eos_token_id,) if tok.eos_token_id is not None else ())))
    return AuditContext(config=cfg, model=model, tokenizer=tok, drafter_factory=factory, suite=load_suite("default"),
                        prompts=chosen, prompt_ids=[encode(tok, p.prompt, chat) for p in chosen], chat=chat,
                        stops=stops, progress=PlainProgress())


def save(path, state):
    for reqs in [state["reference"], *state["spec"].values(), *([state["forced"][1]] if state["forced"] else [])]:
        for r in reqs:
            r.generator = None
    tmp = Path(str(path) + ".tmp")
    tmp.write_bytes(pickle.dumps(state))
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(GGUF / "qwen2.5-coder-1.5b-instruct.gguf"))
    ap.add_argument("--draft", default=str(GGUF / "qwen2.5-coder-0.5b-instruct.gguf"))
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    ap.add_argument("--state", required=True)
    ap.add_argument("--reference-from", default=None, help="take the plain reference from this state")
    ap.add_argument("--inject-fault", default=None)
    ap.add_argument("--budget", type=float, default=600.0, help="seconds; no new stage starts after it")
    ap.add_argument("--threads", default="auto", type=lambda s: s if s == "auto" else int(s))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    from verispec.audit import consistency
    from verispec.audit.context import GreedyRuns
    from verispec.audit.equivalence import equivalence_check
    from verispec.engine import GenerationParams, Request
    from verispec.policy import FixedK

    ctx = build_context(args)
    path = Path(args.state)
    state = pickle.loads(path.read_bytes()) if path.exists() else {
        "reference": [], "spec": {}, "forced": None, "costs": {}, "seconds": {}, "results": None}
    if args.reference_from and not state["reference"]:
        state["reference"] = pickle.loads(Path(args.reference_from).read_bytes())["reference"]
    ctx.costs.update(state["costs"])
    params, n = ctx.greedy_params(), len(ctx.prompt_ids)
    max_len = max(map(len, ctx.prompt_ids)) + params.max_new_tokens

    def spent():
        return time.perf_counter() - t0

    def stage_done(name, s):
        state["seconds"][name] = round(state["seconds"].get(name, 0.0) + s, 1)
        state["costs"] = dict(ctx.costs)
        save(path, state)
        print(f"[{spent():.0f} s] {name}: {s:.1f} s", flush=True)

    # 1. plain and speculative batch 1, interleaved prompt by prompt (runner.greedy_runs)
    spec1 = state["spec"].setdefault(1, [])
    if len(spec1) < n:
        plain = ctx.engine(1, max_len, speculative=False, rule="rejection")
        eng1 = ctx.engine(1, max_len)
        warm = GenerationParams(max_new_tokens=4)
        plain.run([Request(ctx.prompt_ids[0][:8], warm)])
        eng1.run([Request(ctx.prompt_ids[0][:8], warm)])
        while len(spec1) < n and spent() < args.budget:
            i, s = len(spec1), time.perf_counter()
            if len(state["reference"]) <= i:
                state["reference"].append(plain.run([Request(ctx.prompt_ids[i], params)])[0])
            spec1.append(eng1.run([Request(ctx.prompt_ids[i], params)])[0])
            stage_done("b1", time.perf_counter() - s)
    # 2. speculative at the other batch sizes, then drafting forced at the largest
    for b in ctx.config.greedy_batch_sizes:
        if b == 1 or b in state["spec"] or len(spec1) < n or spent() >= args.budget:
            continue
        s, reqs = time.perf_counter(), [Request(ids, params) for ids in ctx.prompt_ids]
        ctx.engine(min(b, n), max_len).run(reqs)
        state["spec"][b] = reqs
        stage_done(f"b{b}", time.perf_counter() - s)
    b_max = max(ctx.config.greedy_batch_sizes)
    ready = len(spec1) == n and all(b in state["spec"] for b in ctx.config.greedy_batch_sizes)
    if ready and state["forced"] is None and spent() < args.budget:
        s, reqs = time.perf_counter(), [Request(ids, params) for ids in ctx.prompt_ids]
        ctx.engine(min(b_max, n), max_len, policy=FixedK(ctx.config.forced_k)).run(reqs)
        state["forced"] = (b_max, reqs)
        stage_done(f"forced k={ctx.config.forced_k} b{b_max}", time.perf_counter() - s)
    # 3. the checks, unchanged, on the finished runs (with the noise measurement and null run)
    if state["forced"] is not None and state["results"] is None and spent() < args.budget:
        runs = GreedyRuns(state["reference"], state["spec"], sum(state["seconds"].values()), state["forced"])
        s = time.perf_counter()
        checks = [equivalence_check(ctx, runs), consistency.drafter_consistency_check(ctx, runs)]
        state["results"] = [c.to_dict() for c in checks]
        stage_done("checks", time.perf_counter() - s)
    if state["results"] is None:
        print(f"not finished: run again (stages done: {state['seconds']})")
        return 3
    for c in state["results"]:
        print(("PASS " if c["passed"] else "FAIL ") + c["name"] + ": " + c["summary"])
    print(f"stage seconds: {state['seconds']}; total {sum(state['seconds'].values()):.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"fault": args.inject_fault, "seconds": state["seconds"],
                                               "checks": state["results"]}, indent=1, default=str))
    return 0 if all(c["passed"] for c in state["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
