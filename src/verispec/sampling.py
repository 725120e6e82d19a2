"""Logits -> probabilities (temperature, top-k, top-p, min-p) and per-request randomness.

Temperature 0 means greedy: the distribution is one-hot at the argmax (first index
on ties, as torch.argmax), so every rule that is exact for sampling is exact for
greedy decoding too.

Randomness. A *seeded* sampled request draws with Gumbel-max noise keyed on
(seed, position) (`keyed_gumbel`, float64 uniforms), in plain and speculative decoding
alike: the token at sequence index i is argmax(log p_i + g(seed, i)), a sample from
p_i, whatever was drafted. So turning speculation on or off, or changing the drafter,
k, the policy or the batch, never changes the tokens of a seeded request (the
`coupled` verification rule is what makes speculative decoding emit exactly those
tokens). An *unseeded* request draws from a `torch.Generator` seeded from OS entropy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Below this a temperature is refused: logits / T overflows fp32 for T ~ 1e-38, and long
# before that the distribution is argmax up to ties. Send 0 for greedy decoding.
MIN_TEMPERATURE = 0.01


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off: drop tokens below min_p x the top token's probability
    seed: int | None = None
    # noise keyed on (seed, position) instead of a generator: None = whenever a seed is
    # given (the default: same seed, same tokens); False = a generator seeded from the
    # seed (the rule then decides, e.g. rejection sampling); True needs a seed
    coupled: bool | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, "
                             f"got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.coupled and self.seed is None:
            raise ValueError("coupled sampling needs a seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def keyed(self) -> bool:
        """Sampled with noise keyed on (seed, position) rather than a generator."""
        if self.greedy or self.seed is None:
            return False
        return True if self.coupled is None else self.coupled

    def make_generator(self) -> torch.Generator:
        g = torch.Generator()
        if self.seed is None:
            g.seed()  # fresh OS entropy: unseeded requests are independent
        else:
            g.manual_seed(self.seed % 2 ** 64)
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
    probs = logits.softmax(-1)
    if params.min_p > 0.0:
        # relative to the most likely token after the other filters (vLLM, llama.cpp)
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [N, V] -> tokens [N] drawn with the given generator (never the global RNG)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def keyed_gumbel(seed: int, positions, V: int) -> torch.Tensor:
    """Gumbel(0,1) noise [len(positions), V] (float64), a pure function of (seed, position).

    Float64 uniforms: a float32 uniform is a multiple of 2^-24, which caps the largest
    Gumbel at ~16.6 and quantises the sampling of small probabilities."""
    out = torch.empty(len(positions), V, dtype=torch.float64)
    for i, pos in enumerate(positions):
        g = torch.Generator().manual_seed((seed * 0x9E3779B1 + pos * 0x85EBCA77) % (2 ** 63))
        u = torch.rand(V, generator=g, dtype=torch.float64).clamp_(min=2.0 ** -60)
        out[i] = -torch.log(-torch.log(u))
    return out


def sample_token(probs: torch.Tensor, params: SamplingParams, generator, position: int) -> int:
    """One token from probs [V] for the token at sequence index `position`."""
    if params.greedy:
        return int(probs.argmax())
    if params.keyed:
        return int((torch.log(probs.double()) + keyed_gumbel(params.seed, [position], probs.shape[-1])[0]).argmax())
    return int(sample(probs[None], generator)[0])
