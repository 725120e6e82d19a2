"""Models: the CausalLM protocol, the native Llama-family runtime, loaders and presets.

CausalLM protocol (what the engine relies on)::

    config: ModelConfig
    new_cache(max_rows, max_len) -> KVCache
    forward(tokens [B,T], cache, rows [B], num_new [B] | None, *, last_only=False,
            num_layers=None) -> logits [B,T,V] (or [B,V] with last_only)
    backend: str                        the kernels it runs on, and
    fingerprint() -> str                a stable identity of its weights: what caches
                                        keyed on the model key on (the adaptive policy's
                                        measured costs, policy/costs.py; not the engine)

The models layer knows nothing of speculation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .cache import CacheFullError, KVCache
from .config import ModelConfig, UnsupportedModelError


class CausalLM(Protocol):
    config: ModelConfig

    def new_cache(self, max_rows: int, max_len: int) -> KVCache: ...

    def forward(self, tokens: torch.Tensor, cache: KVCache, rows, num_new=None, *,
                last_only: bool = False, num_layers: int | None = None) -> torch.Tensor: ...

    @property
    def backend(self) -> str: ...

    def fingerprint(self) -> str: ...


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Any
    files: Any  # loading.ModelFiles: where the weights came from (hashes for the audit)


def load_model(spec: str, *, progress: bool = True, batch_invariant: bool = False) -> LoadedModel:
    """Resolve a preset name, local directory, GGUF file or hub id and load it natively.

    batch_invariant: bitwise batch-invariant numerics (LlamaModel's batch_invariant)."""
    from transformers import AutoTokenizer

    from .llama import LlamaModel
    from .loading import resolve_model

    files = resolve_model(spec, progress=progress)
    model = LlamaModel.from_dir(files.path, batch_invariant=batch_invariant)
    tokenizer = AutoTokenizer.from_pretrained(str(files.path))
    return LoadedModel(model=model, tokenizer=tokenizer, files=files)


__all__ = ["CausalLM", "KVCache", "CacheFullError", "ModelConfig", "UnsupportedModelError",
           "LoadedModel", "load_model"]
