"""The drafter-consistency check replays a replayable drafter (suffix decoding without its
global cache) on a fresh replica of it (Drafter.replica): on an engine's greedy runs the
replica proposes every chain and every tree the drafter proposed, and a trace entry that
differs from what it proposes is a mismatch."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import native_from_hf, tiny_hf
from verispec.audit.consistency import check_request, oracle_for
from verispec.drafters.suffix import SuffixDrafter, SuffixSettings
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.policy import FixedK

V = 41


@pytest.fixture(scope="module")
def target():
    return native_from_hf(tiny_hf("llama", seed=2, vocab=V))


def _runs(target, width: int, batch: int):
    g = torch.Generator().manual_seed(3)
    prompts = [(torch.randint(3, V, (4,), generator=g).tolist() * 5)[:n] for n in (9, 14, 20, 6)]
    drafter = SuffixDrafter(SuffixSettings(min_token_prob=0.0, cache_nodes=0, width=width))
    eng = Engine(target, drafter, FixedK(4), EngineConfig(max_batch=batch, max_len=64, trace=True))
    reqs = [Request(p, GenerationParams(max_new_tokens=16)) for p in prompts]
    eng.run(reqs)
    return drafter, reqs


@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("batch", [1, 4])
def test_a_replica_replays_every_proposal(target, width, batch):
    drafter, reqs = _runs(target, width, batch)
    oracle = oracle_for(drafter, target)
    assert oracle.kind == "replay" and drafter.replica() is not drafter
    compared = 0
    for r in reqs:
        c, _, bad = check_request(oracle, r, 4, {})
        assert bad == [], bad[:3]
        compared += c
    assert compared > 20
    if width > 1:  # some step's drafts branched, so trees were replayed too
        assert any(t is not None for r in reqs for t in r.stats.trace_trees)


def test_a_stale_proposal_is_a_mismatch(target):
    drafter, reqs = _runs(target, 1, 1)
    r = next(r for r in reqs if any(len(d) for _, d, _, _ in r.stats.trace))
    i = next(i for i, (_, d, _, _) in enumerate(r.stats.trace) if d)
    n0, drafted, acc, k = r.stats.trace[i]
    r.stats.trace[i] = (n0, [(drafted[0] + 1) % V] + drafted[1:], acc, k)
    _, _, bad = check_request(oracle_for(drafter, target), r, 4, {})
    assert bad and bad[0]["step"] == i


def test_a_drafter_with_a_global_cache_is_not_replayed(target):
    assert oracle_for(SuffixDrafter(SuffixSettings()), target) is None
