"""Logits -> probabilities (temperature, top-k, top-p) and seeded per-request sampling.

Temperature 0 means greedy: the distribution is one-hot at the argmax (first index
on ties, as torch.argmax), so every rule that is exact for sampling is exact for
greedy decoding too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None
    # Gumbel-max with noise keyed on (seed, position): plain and speculative decoding
    # with the same seed emit the same tokens (the "coupled" verification rule)
    coupled: bool = False

    def __post_init__(self):
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.coupled and self.seed is None:
            raise ValueError("coupled sampling needs a seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self) -> torch.Generator:
        g = torch.Generator()
        if self.seed is None:
            g.seed()  # fresh OS entropy: unseeded requests are independent
        else:
            g.manual_seed(self.seed)
        return g


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probs [..., V] (fp32), the distribution tokens are drawn from."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (keep at least one)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [N, V] -> tokens [N] drawn with the given generator (never the global RNG)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def keyed_gumbel(seed: int, positions, V: int) -> torch.Tensor:
    """Gumbel(0,1) noise [len(positions), V], a pure function of (seed, position)."""
    out = torch.empty(len(positions), V)
    for i, pos in enumerate(positions):
        g = torch.Generator().manual_seed((seed * 0x9E3779B1 + pos * 0x85EBCA77) % (2 ** 63))
        u = torch.rand(V, generator=g).clamp_(min=1e-20)
        out[i] = -torch.log(-torch.log(u))
    return out


def sample_token(probs: torch.Tensor, params: SamplingParams, generator, position: int) -> int:
    """One token from probs [V] for the token at sequence index `position`."""
    if params.greedy:
        return int(probs.argmax())
    if params.coupled:
        return int((torch.log(probs) + keyed_gumbel(params.seed, [position], probs.shape[-1])[0]).argmax())
    return int(sample(probs[None], generator)[0])
