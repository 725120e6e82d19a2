"""The adaptive policy's cost model on disk: a hit skips the measurement, any change of
what a timing depends on misses, a corrupt file is measured over, and step times that
drift from the entry rewrite it."""

import json
import math
import os

import pytest
import torch

from tests.tiny import native_from_hf, tiny_hf
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.lookup import PromptLookupDrafter
from verispec.policy import AdaptiveConfig, FixedK, make_policy
from verispec.policy import costs as costs_mod
from verispec.policy.adaptive import AdaptivePolicy, CostModel
from verispec.policy.costs import CostCache, CostRefresher, cached_costs

V = 61


@pytest.fixture(scope="module")
def target():
    return native_from_hf(tiny_hf("llama", seed=0, vocab=V))


@pytest.fixture()
def spy(monkeypatch):
    """measure_costs replaced by a synthetic grid of the right shape; calls recorded."""
    calls = []

    def fake(target, drafter, max_batch, max_k, **kw):
        calls.append((max_batch, max_k))
        bps, tps = costs_mod._batch_points(max_batch), costs_mod._token_points(max_k)
        grid = tuple(tuple(0.01 * (1 + 0.1 * b * t) for t in tps) for b in bps)
        return CostModel(tuple(bps), tuple(tps), grid, tuple(bps), tuple(0.001 * b for b in bps),
                         draft_free=isinstance(drafter, PromptLookupDrafter),
                         halts=bool(getattr(drafter, "halts", False)))
    monkeypatch.setattr(costs_mod, "measure_costs", fake)
    return calls


def test_second_start_reads_the_cache_and_skips_the_measurement(tmp_path, target, spy):
    cache = CostCache(tmp_path / "costs")
    p1 = make_policy("adaptive", target, PromptLookupDrafter(3), 4, 5, cost_cache=cache)
    assert len(spy) == 1 and isinstance(p1, AdaptivePolicy)
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())["source"] == "measured"
    p2 = make_policy("adaptive", target, PromptLookupDrafter(3), 4, 5, cost_cache=cache)
    assert len(spy) == 1  # not measured again
    assert p2.costs == p1.costs and p2.costs.draft_free and p2.trims
    assert not list((tmp_path / "costs").glob(".*.tmp"))  # atomic writes leave no temporary file


def test_no_cache_measures_every_time(target, spy):
    for _ in range(2):
        make_policy("adaptive", target, PromptLookupDrafter(3), 4, 5)
    assert len(spy) == 2
    assert isinstance(make_policy("fixed", target, PromptLookupDrafter(3), 4, 5), FixedK) and len(spy) == 2


def test_what_a_timing_depends_on_is_in_the_key(tmp_path, target, spy):
    cache = CostCache(tmp_path)
    draft = native_from_hf(tiny_hf("llama", seed=1, vocab=V))
    look = PromptLookupDrafter(3)
    base = cache.entry(target, look, 4, 5).path
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        other_threads = cache.entry(target, look, 4, 5).path
    finally:
        torch.set_num_threads(threads)
    assert cache.entry(target, look, 4, 5).path == base  # deterministic
    others = {
        "threads": other_threads,
        "k": cache.entry(target, look, 4, 6).path,
        "max_batch": cache.entry(target, look, 8, 5).path,
        "model": cache.entry(draft, look, 4, 5).path,
        "ngram": cache.entry(target, PromptLookupDrafter(2), 4, 5).path,
        "draft model": cache.entry(target, DraftModelDrafter(draft, V, max_rows=4, max_len=32), 4, 5).path,
    }
    assert base not in others.values() and len(set(others.values())) == len(others), others
    # and each of them misses: measured once per key
    cached_costs(target, look, 4, 5, cache)
    cached_costs(target, look, 4, 6, cache)
    cached_costs(draft, look, 4, 5, cache)
    cached_costs(target, look, 4, 5, cache)
    assert spy == [(4, 5), (4, 6), (4, 5)]


def test_fingerprint_is_stable_and_follows_the_weights():
    a = native_from_hf(tiny_hf("llama", seed=0, vocab=V))
    b = native_from_hf(tiny_hf("llama", seed=0, vocab=V))
    c = native_from_hf(tiny_hf("llama", seed=3, vocab=V))
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    assert "/sdpa" in a.backend


@pytest.mark.parametrize("content", [
    b"", b"{not json", b"\xff\xfe\x00garbage", b"[]", b'{"format": 1}',
    "wrong key",  # a valid entry written for another key (a hash collision, a copied file)
    "negative time",  # a valid layout with a time no measurement gives
])
def test_a_corrupt_or_foreign_file_is_measured_over(tmp_path, target, spy, content):
    cache = CostCache(tmp_path)
    look = PromptLookupDrafter(3)
    entry = cache.entry(target, look, 4, 5)
    good = cached_costs(target, look, 4, 5, cache)[0]
    assert len(spy) == 1
    if content == "wrong key":
        doc = json.loads(entry.path.read_text())
        doc["key"]["k"] = 6
        content = json.dumps(doc).encode()
    elif content == "negative time":
        doc = json.loads(entry.path.read_text())
        doc["costs"]["target_s"][0][0] = -1.0
        content = json.dumps(doc).encode()
    entry.path.write_bytes(content)
    assert entry.load() is None
    costs, _ = cached_costs(target, look, 4, 5, cache)
    assert len(spy) == 2 and costs == good
    assert entry.load() == good  # rewritten whole


def test_a_failed_write_is_not_fatal(tmp_path, target, spy):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    costs, entry = cached_costs(target, PromptLookupDrafter(3), 4, 5, CostCache(blocker / "costs"))
    assert costs is not None and entry.load() is None


def test_cost_model_round_trips():
    c = CostModel.from_total_tokens((1, 64), (1.0, 2.0), (1, 8), (0.1, 0.2), max_batch=3, max_tokens=4, halts=True)
    assert CostModel.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ValueError):
        CostModel.from_dict({**c.to_dict(), "batch_pts": [2, 1, 3]})


class R:
    def __init__(self, rid):
        self.request_id, self.finished = rid, False


def _entry_policy(tmp_path, target, spy, **cfg):
    cache = CostCache(tmp_path)
    drafter = DraftModelDrafter(target, V, max_rows=4, max_len=32)
    costs, entry = cached_costs(target, drafter, 4, 4, cache)
    return AdaptivePolicy(costs, max_k=4, config=AdaptiveConfig(**cfg), cost_entry=entry), entry


def test_drift_beyond_the_tolerance_rewrites_the_entry(tmp_path, target, spy):
    p, entry = _entry_policy(tmp_path, target, spy)
    before = entry.load()
    m1 = float(before.target(2, 1))
    m3 = float(before.target(2, 3))
    d = float(before.draft(2))
    for i in range(6 * p.config.drift_min_steps):  # every pass measured at twice the model
        T = 1 if i % 2 else 3
        p.observe_costs(2, T, 2, T - 1, 2 * (T - 1) * d, 2.0 * (m1 if T == 1 else m3))
    assert p.refresher.refreshes == 1
    doc = json.loads(entry.path.read_text())
    assert doc["source"] == "refreshed"
    after = entry.load()
    assert after.target_s[0][0] == pytest.approx(2 * before.target_s[0][0], rel=0.05)
    assert after.target_s[-1][-1] == pytest.approx(2 * before.target_s[-1][-1], rel=0.05)
    assert after.draft_s[0] == pytest.approx(2 * before.draft_s[0], rel=0.05)
    # the running policy keeps the model it started with; the next start reads the new one
    assert p.costs == before
    p2, _ = _entry_policy(tmp_path, target, spy)
    assert p2.costs == after and len(spy) == 1
    # ... and does not rewrite it again at the same speed: it now matches the entry
    m1, m3 = float(after.target(2, 1)), float(after.target(2, 3))
    for i in range(3 * p2.config.drift_min_steps):
        T = 1 if i % 2 else 3
        p2.observe_costs(2, T, 2, T - 1, (T - 1) * float(after.draft(2)), m1 if T == 1 else m3)
    assert p2.refresher.refreshes == 0


def test_drift_within_the_tolerance_or_too_short_leaves_the_entry(tmp_path, target, spy):
    p, entry = _entry_policy(tmp_path, target, spy)
    written = entry.path.read_bytes()
    m1 = float(p.costs.target(2, 1))
    for _ in range(200):  # 10% slower: within the 25% tolerance
        p.observe_costs(2, 1, 0, 0, 0.0, 1.1 * m1)
    for _ in range(p.config.drift_min_steps // 2):  # a short spell of 3x: too few steps
        p.observe_costs(2, 2, 2, 1, 0.0, 3.0 * float(p.costs.target(2, 2)))
    assert p.refresher.refreshes == 0 and entry.path.read_bytes() == written


def test_refreshed_pools_the_measured_shapes():
    costs = CostModel((1, 2), (1, 2, 3), ((1.0, 1.0, 1.0), (1.0, 1.0, 1.0)), (1, 2), (0.1, 0.1))
    r = CostRefresher(entry=None, tolerance=0.25, min_steps=4, keep=1.0, max_swing=4.0)
    import numpy as np
    # batch 2: three passes over 3 tokens measured at 5 s each (forgotten sums: 15 s over 3)
    out = r.refreshed(costs, {2: (np.array([0.0, 0.0, 15.0]), np.array([0.0, 0.0, 3.0]))})
    assert out.target_s[0] == (1.0, 1.0, 1.0)  # no ratios observed: the model as it was
    assert out.target_s[1][2] == pytest.approx((1.0 + 15.0) / 4.0)
    assert all(b >= a for a, b in zip(out.target_s[1], out.target_s[1][1:]))
    assert math.isclose(out.draft_s[0], 0.1)


def test_config_defaults_and_overrides():
    cfg = AdaptiveConfig()
    assert (cfg.min_gain, cfg.replan_every, cfg.prior, cfg.decay, cfg.min_probe, cfg.max_probe) == \
        (0.05, 16, 0.6, 0.1, 8, 128)
    p = AdaptivePolicy(CostModel.from_total_tokens((1, 64), (1.0, 1.0), (1, 64), (0.1, 0.2)), max_k=4, prior=0.0)
    assert p.config.prior == 0.0 and p.config.min_gain == 0.05
    with pytest.raises(TypeError):
        AdaptivePolicy(p.costs, max_k=4, no_such_tunable=1)
    with pytest.raises(ValueError):
        AdaptiveConfig(decay=1.5)
    with pytest.raises(Exception):
        cfg.prior = 0.1  # frozen


def test_default_cache_lives_under_verispec_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    assert CostCache.default().root == tmp_path / "costs"
    assert os.fspath(CostCache.default().root).startswith(os.fspath(tmp_path))
