"""Greedy equivalence against a non-speculative reference: exact match, first
divergence, and the reference's top-2 logit margin there (near-tie vs bug)."""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import asdict, dataclass

import torch

from ..engine import PromptCache

TIE_MARGIN = 1e-4  # a divergence below this top-2 logit margin is numerics, not a bug (fp32 backends)
EXACT_MATCH_MIN = 0.95  # at least this share of prompts identical


_MEASURED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> tie_margin_for's answer


def tie_margin_for(model) -> dict:
    """The near-tie margin on this model's backend, and where it comes from:
    {"value": margin, "source": ..., plus the measurement when there is one}.

    The native runtime computes in fp32 with kernels whose only variation is summation order,
    so TIE_MARGIN (1e-4) is its bound. A backend that declares `noisy_numerics` (ggml:
    8-bit-rounded activations, kernels that depend on how many tokens share a pass and on
    the KV cell order) moves a top-2 gap by far more than that in plain decoding, with no
    speculation: its margin is its own measured batching noise (models/noise.py: the
    largest change of a top-2 gap, against a fresh single-row decode), measured once per
    model, on the threads in use, and never below TIE_MARGIN."""
    if not model.noisy_numerics:
        return {"value": TIE_MARGIN, "source": "fixed (fp32 backend)"}
    if model not in _MEASURED:
        from ..models.noise import batching_noise
        t0 = time.perf_counter()
        noise = batching_noise(model, seeds=(0, 1, 2))
        _MEASURED[model] = {"value": max(TIE_MARGIN, noise["margin"]),
                            "source": "measured batching noise of the backend (models/noise.py)",
                            "backend": model.backend, "noise_logit": noise["logit"],
                            "noise_top2_gap": noise["margin"], "seconds": round(time.perf_counter() - t0, 1)}
    return dict(_MEASURED[model])


NULL_ALPHA = 0.01  # a noisy backend's near-tie count against its null run: family-wise, over the configs


def near_tie_allowance(n: int) -> int:
    """Non-identical outputs (all near-ties) tolerated among n prompts: misses <= floor(5% of
    n), but at least one, or 16 prompts would turn one benign numerical flip into a failure."""
    return max(1, math.floor((1 - EXACT_MATCH_MIN) * n + 1e-9))


@dataclass(frozen=True)
class Comparison:
    exact: bool
    first_divergence: int | None  # index into the generated tokens
    margin: float | None  # reference's top-2 logit margin at the first divergence
    verdict: str  # "identical" | "near-tie" | "divergence"

    def to_dict(self) -> dict:
        return asdict(self)


def first_divergence(ref: list[int], got: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), None if equal."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))


def top2_margin(logits: torch.Tensor) -> float:
    """logits [V] -> largest minus second-largest logit."""
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def reference_logits_at(model, prompt: list[int], ref: list[int], index: int) -> torch.Tensor:
    """Teacher-force the reference model: logits [V] that predicted ref[index]."""
    seq = prompt + ref[:index]
    cache = model.new_cache(1, len(seq) + 1)
    row = cache.alloc()
    return model.forward(torch.tensor([seq]), cache, row, last_only=True)[0]


def compare(prompt: list[int], ref: list[int], got: list[int], margin_fn, tie_margin: float = TIE_MARGIN) -> Comparison:
    """margin_fn(prompt, ref, index) -> logits [V] of the reference at that index."""
    i = first_divergence(ref, got)
    if i is None:
        return Comparison(True, None, None, "identical")
    if i >= len(ref):  # the candidate ran on past the reference's end: the reference stopped
        return Comparison(False, i, None, "divergence")
    m = top2_margin(margin_fn(prompt, ref, i))
    return Comparison(False, i, m, "near-tie" if m < tie_margin else "divergence")


def teacher_forced_logits(model, tokens: list[int], first: int = 0, num_layers: int | None = None,
                          prefixes=None) -> torch.Tensor:
    """One batch-1 pass of model over tokens -> logits [T - first, V]; row j is the output at
    position first + j, i.e. the distribution of tokens[first + j + 1]. Positions before
    `first` are prefilled without computing their logits (the LM head is a large share of a
    small model). num_layers < L gives the layer-skip draft's logits (see models/llama.py).
    prefixes: an engine.PromptCache for one (model, num_layers): the prefill of tokens[:first]
    is taken from it when an earlier call made it (the audit scores several outputs of each
    prompt), and put there otherwise; the numbers are those of the batch-1 prefill either way."""
    if not 0 <= first < len(tokens):
        raise ValueError(f"first must lie in [0, {len(tokens)}), got {first}")
    cache = model.new_cache(1, len(tokens))
    row = cache.alloc()
    if first > 0:
        head = tokens[:first]
        if prefixes is None or not prefixes.restore(cache, row[0], head):
            model.forward(torch.tensor([head]), cache, row, last_only=True, num_layers=num_layers)
            if prefixes is not None:
                prefixes.save(cache, row[0], head)
    return model.forward(torch.tensor([tokens[first:]]), cache, row, num_layers=num_layers)[0]


TF_PREFIX_TOKENS = 1 << 13  # the prompt prefills one check keeps for its teacher forcing


def prefix_cache():
    """A cache of prompt prefills for teacher_forced_logits (one per model and layer count)."""
    return PromptCache(max_tokens=TF_PREFIX_TOKENS)
