"""Tiny random Llama / Qwen2 checkpoints built with Hugging Face transformers, for fast tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from verispec.models.config import ModelConfig
from verispec.models.llama import LlamaModel


def tiny_hf(arch: str, seed: int = 0, tie: bool = False, vocab: int = 97, embed_scale: float = 1.0):
    """A random 3-layer model.  HF's init (std 0.02) leaves the embeddings so small that
    the output barely depends on the tokens and greedy decoding repeats one or two
    tokens; ``embed_scale`` (~20) makes the output vary with the context, so the ragged
    paths see varied acceptance patterns instead of a constant stream."""
    torch.manual_seed(seed)
    kw = dict(hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512,
              tie_word_embeddings=tie, rms_norm_eps=1e-5)
    if arch == "qwen2":
        hf = Qwen2ForCausalLM(Qwen2Config(**kw))
    else:
        hf = LlamaForCausalLM(LlamaConfig(**kw))
    # random init leaves biases at zero: make them count
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            if "norm" in name:
                p.normal_(1.0, 0.1)
        hf.model.embed_tokens.weight.mul_(embed_scale)
    hf.eval()
    return hf


def native_from_hf(hf) -> LlamaModel:
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return LlamaModel(cfg, sd)


def engine_pit(target, reqs, generator, temperature: float = 1.0) -> torch.Tensor:
    """Randomised PIT values of every emitted token: teacher-force the target on each
    finished sequence for its exact p at each emitted position. -> u [total tokens]."""
    from verispec.audit.stats import randomized_pit
    from verispec.sampling import SamplingParams, logits_to_probs

    cache = target.new_cache(1, max(len(r.tokens) for r in reqs))
    us = []
    for r in reqs:
        row = cache.alloc()
        logits = target.forward(torch.tensor([r.tokens[:-1]]), cache, row)[0]  # [T,V]
        cache.free(row)
        p = logits_to_probs(logits[len(r.prompt_ids) - 1:], SamplingParams(temperature=temperature))
        us.append(randomized_pit(p, torch.tensor(r.output_ids), generator))
    return torch.cat(us)


def assert_varied(outputs: list[list[int]], min_distinct_total: int = 20) -> None:
    """Guard against a degenerate reference: a test of ragged acceptance proves little
    if every row emits the same token over and over."""
    assert len({t for o in outputs for t in o}) >= min_distinct_total, "reference output is degenerate"
    long = [o for o in outputs if len(o) >= 8]  # greedy may fall into a short cycle in a few rows
    assert long and sum(len(set(o)) >= 3 for o in long) >= 0.75 * len(long), \
        "most reference rows repeat one or two tokens"
