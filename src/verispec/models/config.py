"""Model configuration for the native Llama-family runtime, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama-family model the native runtime can run exactly."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2: always)
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        arch = d.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {arch!r} is not supported by the native runtime "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedModelError(
                f"rope type {rope_type!r} is not supported (only the default RoPE is implemented)"
            )
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        if d.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention is not supported")
        if d.get("mlp_bias"):
            raise UnsupportedModelError("MLP biases are not supported")
        hidden = d["hidden_size"]
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            arch=arch,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf_dict(json.loads((Path(path) / "config.json").read_text()))
