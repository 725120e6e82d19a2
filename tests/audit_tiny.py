"""A tiny audit setup: random Llama target and a noisy draft copy (tests/tiny.py), a
character-level fake tokenizer and an in-memory suite, so a whole audit runs in seconds."""

from __future__ import annotations

import contextlib

import torch

from tests.tiny import native_from_hf, tiny_hf
from verispec.audit.context import AuditConfig, AuditSizes
from verispec.audit.floor import FloorBudget
from verispec.audit.runner import run_audit
from verispec.audit.suite import SuitePrompt
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.models import LoadedModel

V = 32
EMBED_SCALE = 10.0

TINY_SIZES = AuditSizes("tiny", prompts_per_slice=None, max_new_tokens=24, distribution_tokens=3000,
                        distribution_max_new=60, seeded_prompts=None, seeded_max_new=24, short_context=12,
                        long_context=48, long_max_batch=None, load_rounds=1, load_steps=2,
                        floor=FloorBudget(seeds=3, candidates=3, max_new_tokens=12, population=2, confirm=1,
                                          repeats=2))


class CharTokenizer:
    """Characters -> ids 3..V-1 (0-2 stay special: 2 is the tiny model's EOS); no chat template."""

    eos_token_id = None
    chat_template = None

    def __call__(self, text: str) -> dict:
        return {"input_ids": [3 + ord(c) % (V - 3) for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids if not (skip_special_tokens and i < 3))


def tiny_suite() -> list[SuitePrompt]:
    texts = {
        "copy": ["abcabcabcabc", "the cat the cat the cat", "xyzxyzxy"],
        "prose": ["a quick brown fox jumps over the lazy dog", "hello", "speculative decoding is exact"],
        "code": ["def f(x): return x + 1", "for i in range(10): print(i)", "{}"],
        "noise": ["q8#kd!2", "zzq", "m3v9x1b7n5c2"],
    }
    return [SuitePrompt(f"{s}-{i}", s, t) for s, ts in texts.items() for i, t in enumerate(ts)]


def tiny_models():
    # embeddings scaled: a drafter whose cache misses a token must draft differently
    hf = tiny_hf("llama", seed=5, vocab=V, embed_scale=EMBED_SCALE)
    with torch.no_grad():
        hf.lm_head.weight.mul_(4.0)  # peaked distributions, as real models have
    target = native_from_hf(hf)
    d = tiny_hf("llama", seed=5, vocab=V, embed_scale=EMBED_SCALE)
    with torch.no_grad():
        d.lm_head.weight.mul_(4.0)
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.03)  # agrees often, not always
    return target, native_from_hf(d)


def tiny_drafter_factory(models, kind: str = "draft-model"):
    """(max_rows, max_len) -> a drafter: the noisy draft copy, prompt lookup, suffix decoding
    or layer-skip."""
    from verispec.drafters.layerskip import LayerSkipDrafter
    from verispec.drafters.lookup import PromptLookupDrafter
    target, draft = models
    if kind == "draft-model":
        return lambda rows, max_len: DraftModelDrafter(draft, V, max_rows=rows, max_len=max_len)
    if kind == "lookup":
        return lambda rows, max_len: PromptLookupDrafter(3)
    if kind == "layerskip":
        return lambda rows, max_len: LayerSkipDrafter(target, 1)
    if kind.startswith("suffix"):  # "suffix[:options]", as --draft takes it
        from verispec.drafters.suffix import SuffixDrafter, SuffixSettings
        return lambda rows, max_len: SuffixDrafter(SuffixSettings.parse(kind.partition(":")[2]))
    raise ValueError(kind)


def tiny_audit(models, *, rule: str = "rejection", fault: str | None = None, seed: int = 0,
               sizes: AuditSizes = TINY_SIZES, batch_sizes=(1, 4, 8), policy: str = "fixed",
               drafter: str = "draft-model", settings=None, **config):
    """Fixed k by default: the faults live in the speculative path, which must run. settings:
    the sampled checks' (None: AuditConfig's defaults, as `verispec audit` without flags);
    config: further AuditConfig fields."""
    target, draft = models
    cfg = AuditConfig(target="tiny-llama", draft=f"tiny-{drafter}", k=3, policy=policy, rule=rule,
                      batch_sizes=batch_sizes, sizes=sizes, seed=seed, inject_fault=fault, **config,
                      **({} if settings is None else {"settings": settings}))
    return run_audit(cfg, target=LoadedModel(target, CharTokenizer(), None),
                     drafter_factory=tiny_drafter_factory(models, drafter), prompts=tiny_suite())


@contextlib.contextmanager
def one_thread():
    """Tiny models are all overhead: one torch thread is faster, and on a busy machine two
    spinning threads can be 20x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
