"""Engine equivalence on tiny random models: plain and speculative decoding against
Hugging Face `generate` (greedy, batch 1) on the same weights."""

import pytest
import torch

from tests.tiny import assert_varied, native_from_hf, tiny_hf
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.layerskip import LayerSkipDrafter
from verispec.drafters.lookup import PromptLookupDrafter
from verispec.drafters.suffix import SuffixDrafter, SuffixSettings
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.policy import FixedK

V = 97
EMBED_SCALE = 20.0  # output that depends on the context (see tiny_hf)


@pytest.fixture(scope="module")
def models():
    hf = tiny_hf("qwen2", seed=0, vocab=V, embed_scale=EMBED_SCALE)
    target = native_from_hf(hf)
    # a draft that agrees often but not always: the target's weights plus noise
    noisy = tiny_hf("qwen2", seed=0, vocab=V, embed_scale=EMBED_SCALE)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return hf, target, native_from_hf(noisy)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(1, 40, (1,), generator=g))
        base = torch.randint(0, V, (L,), generator=g).tolist()
        if i % 2:  # repetitive prompts give prompt lookup something to find
            base = (base[:5] * 8)[:L]
        out.append(base)
    return out


def _hf_reference(hf, prompts, max_new):
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return refs


@pytest.fixture(scope="module")
def reference(models):
    hf = models[0]
    prompts = _prompts(16)
    max_new = [5 + (i * 7) % 20 for i in range(16)]  # rows finish at different times
    refs = [_hf_reference(hf, [p], m)[0] for p, m in zip(prompts, max_new)]
    assert_varied(refs)
    return prompts, max_new, refs


def _run(engine, prompts, max_new, stop=()):
    reqs = [Request(p, GenerationParams(max_new_tokens=m, stop_token_ids=stop)) for p, m in zip(prompts, max_new)]
    engine.run(reqs)
    return reqs


@pytest.mark.parametrize("batch", [1, 3, 8, 16])
def test_plain_matches_hf(models, reference, batch):
    _, target, _ = models
    prompts, max_new, refs = reference
    reqs = _run(Engine(target, config=EngineConfig(max_batch=batch, max_len=128)), prompts, max_new)
    assert [r.output_ids for r in reqs] == refs


@pytest.mark.parametrize("drafter_name", ["draft", "layerskip", "lookup", "suffix"])
@pytest.mark.parametrize("batch,k", [(1, 3), (4, 2), (8, 5), (16, 4)])
def test_speculative_matches_hf(models, reference, drafter_name, batch, k):
    _, target, draft = models
    prompts, max_new, refs = reference
    drafter = {"draft": lambda: DraftModelDrafter(draft, V, max_rows=batch, max_len=128),
               "layerskip": lambda: LayerSkipDrafter(target, 2),
               "lookup": lambda: PromptLookupDrafter(3),
               # a short walk floor, so that drafts from the global cache (earlier requests) run too
               "suffix": lambda: SuffixDrafter(SuffixSettings(min_token_prob=0.0))}[drafter_name]()
    eng = Engine(target, drafter, FixedK(k), EngineConfig(max_batch=batch, max_len=128))
    reqs = _run(eng, prompts, max_new)
    assert [r.output_ids for r in reqs] == refs
    assert eng.cache.rows_in_use == 0  # every row was freed
    drafted = sum(r.stats.drafted for r in reqs)
    accepted = sum(r.stats.accepted for r in reqs)
    assert drafted > 0
    if drafter_name == "suffix":
        assert drafter.cache.stats()["sequences"] == len(prompts)  # every finished request was learnt
    if drafter_name == "draft":
        assert 0 < accepted < drafted  # the ragged case really happened


def test_stop_tokens_end_rows(models, reference):
    _, target, draft = models
    prompts, max_new, refs = reference
    # the stop token is whatever the reference emits 3rd in row 0: that row must stop there
    stop = refs[0][2]
    eng = Engine(target, DraftModelDrafter(draft, V, max_rows=4, max_len=128), FixedK(3),
                 EngineConfig(max_batch=4, max_len=128))
    reqs = _run(eng, prompts, max_new, stop=(stop,))
    for r, ref in zip(reqs, refs):
        cut = ref.index(stop) + 1 if stop in ref else len(ref)
        assert r.output_ids == ref[:cut]
        assert r.finish_reason == ("stop" if stop in ref else "length")


def test_out_of_vocabulary_prompt_is_refused(models):
    eng = Engine(models[1], config=EngineConfig(max_batch=4, max_len=128))
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add(Request([1, 2, 10_000]))
    assert not eng.has_work


def test_failed_prefill_frees_rows(models, monkeypatch):
    _, target, _ = models
    eng = Engine(target, config=EngineConfig(max_batch=4, max_len=128))
    bad = Request([1, 2, 3, 4])
    eng.add(bad)

    def broken(*a, **k):
        raise RuntimeError("model failure")
    with monkeypatch.context() as m:
        m.setattr(target, "forward", broken)
        assert eng.step() == [bad]  # the failing request ends; the step does not raise
    assert eng.cache.rows_in_use == 0 and bad.finished and bad.finish_reason == "error"
    assert "RuntimeError: model failure" in bad.error
    good = Request([1, 2, 3], GenerationParams(max_new_tokens=3))
    eng.run([good])  # the engine still serves
    assert len(good.output_ids) == 3


def test_verify_pass_is_not_padded_past_the_longest_draft(models, reference, monkeypatch):
    """Prompt lookup often finds fewer drafts than asked (none, without a match): the
    verify pass covers 1 + the longest draft found, not 1 + k."""
    _, target, _ = models
    prompts, max_new, refs = reference
    widths = []
    real = target.forward
    monkeypatch.setattr(target, "forward", lambda x, *a, **kw: (widths.append(x.shape[1]), real(x, *a, **kw))[1])
    eng = Engine(target, PromptLookupDrafter(3), FixedK(6), EngineConfig(max_batch=4, max_len=128, trace=True))
    reqs = [Request(p, GenerationParams(max_new_tokens=m)) for p, m in zip(prompts[:8], max_new[:8])]
    for r in reqs:
        eng.add(r)
    seen = set()
    while eng.has_work:
        running = list(eng.running) + list(eng.waiting)[:4 - len(eng.running)]
        widths.clear()
        eng.step()
        longest = max(len(r.stats.trace[-1][1]) for r in running)
        assert widths[-1] == 1 + longest
        seen.add(longest)
    assert [r.output_ids for r in reqs] == refs[:8]
    assert 0 in seen and max(seen) > 0  # steps without any match, and steps with drafts
