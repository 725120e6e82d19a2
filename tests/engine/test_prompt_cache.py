"""The exact-prompt KV cache: a restored row decodes exactly as a prefilled one."""

import pytest
import torch

from tests.engine.test_engine_tiny import V, _prompts
from tests.tiny import native_from_hf, tiny_hf
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import Engine, EngineConfig, GenerationParams, PromptCache, Request
from verispec.policy import FixedK


@pytest.fixture(scope="module")
def models():
    hf = tiny_hf("qwen2", seed=0, vocab=V, embed_scale=20.0)
    noisy = tiny_hf("qwen2", seed=0, vocab=V, embed_scale=20.0)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.03)
    return native_from_hf(hf), native_from_hf(noisy)


def _run(target, drafter, k, prompts, cache=None, batch=4):
    eng = Engine(target, drafter, FixedK(k), EngineConfig(max_batch=batch, max_len=96), prompt_cache=cache)
    reqs = [Request(p, GenerationParams(max_new_tokens=12, ignore_eos=True)) for p in prompts]
    eng.run(reqs)
    return [r.output_ids for r in reqs], eng


def test_restored_prompts_decode_as_prefilled_ones(models):
    target, draft = models
    prompts = _prompts(10, seed=3)
    ref, _ = _run(target, None, 0, prompts)
    pc, dpc = PromptCache(), PromptCache()
    for attempt in range(2):  # the first run fills the caches, the second only restores
        drafter = DraftModelDrafter(draft, V, max_rows=4, max_len=120)
        drafter.prompt_cache = dpc
        out, eng = _run(target, drafter, 3, prompts, cache=pc)
        assert out == ref, attempt
    distinct = len({tuple(p[:-1]) for p in prompts if len(p) > 1})
    assert pc.hits == distinct and dpc.hits == distinct
    assert len(pc) == distinct
    # a plain engine reuses the same snapshots
    out, _ = _run(target, None, 0, prompts, cache=pc)
    assert out == ref and pc.hits == 2 * distinct


def test_budget_evicts_least_recently_used(models):
    target, _ = models
    cache = target.new_cache(2, 64)
    rows = cache.alloc(1)
    pc = PromptCache(max_tokens=10)
    for ids in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]):
        cache.truncate(rows, [0])
        target.forward(torch.tensor([ids]), cache, rows, last_only=True)
        pc.save(cache, rows[0], ids)
    assert len(pc) == 2  # 4 + 4 + 3 > 10: the oldest went
    assert not pc.restore(cache, rows[0], [1, 2, 3, 4])
    assert pc.restore(cache, rows[0], [9, 10, 11]) and int(cache.lengths[rows[0]]) == 3
    with pytest.raises(ValueError, match="holds 3 tokens"):
        pc.save(cache, rows[0], [1, 2])
    with pytest.raises(ValueError):
        PromptCache(max_tokens=0)
