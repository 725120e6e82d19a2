"""Models: the CausalLM protocol, its backends, loaders and presets.

Backends, one module or folder each, chosen by load_model(spec, backend=...):
    native   llama.py (+ cache.py, attention.py, fastlinear.py): the Llama-family runtime in
             fp32 on converted weights; the reference
    ggml     ggml/: llama.cpp through llama-cpp-python on the GGUF file as shipped (quantized);
             the `gguf` extra; batch-invariant too when asked (ggml/ordered.py)

CausalLM protocol (what the engine relies on)::

    config: ModelConfig
    new_cache(max_rows, max_len) -> KVCache
    forward(tokens [B,T], cache, rows [B], num_new [B] | None, *, last_only=False,
            num_layers=None, tree=None) -> logits [B,T,V] (or [B,V] with last_only)
        tree = (depth [B,T], visible [B,T,T]), with supports_trees: token t of row b sits at
        position start + depth[b,t] and attends to the row's cache and to the pass's tokens
        u with visible[b,t,u]; the cache's keep_slots(rows, starts, slots) then keeps one
        root-to-leaf path of them (the caller builds both from its own trees)
    backend: str                        the kernels it runs on, and
    fingerprint() -> str                a stable identity of its weights: what caches
                                        keyed on the model key on (the adaptive policy's
                                        measured costs, policy/costs.py; not the engine)
    runtime: str                        the backend's name in BACKENDS (a draft model is
                                        loaded on its target's runtime)
    partial_layers: bool                forward takes num_layers < L (layer-skip drafting);
                                        False on ggml, whose forward then raises
    supports_trees: bool                forward takes tree= (above) and the cache keeps a
                                        path with keep_slots; False on ggml's batch-invariant
                                        mode (one sequence per row), whose forward then raises
    noisy_numerics: bool                batching moves its logits beyond fp32 rounding
    backend_fault: str | None           the fault a view of the model injects into its
                                        forward on purpose (audit/faults/null.py); None on a
                                        backend as loaded

The cache new_cache returns keeps KVCache's interface (models/cache.py): alloc, free,
truncate, lengths, in_use, max_rows, max_len, rows_in_use, snapshot, restore.

The models layer knows nothing of speculation.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .cache import CacheFullError, KVCache
from .config import ModelConfig, UnsupportedModelError
from .loading import LoadedModel

__all__ = ["BACKENDS", "CacheFullError", "CausalLM", "KVCache", "LoadedModel", "ModelConfig",
           "UnsupportedModelError", "load_model", "resolve_backend", "with_positions"]


class CausalLM(Protocol):
    config: ModelConfig

    def new_cache(self, max_rows: int, max_len: int) -> KVCache: ...

    def forward(self, tokens: torch.Tensor, cache: KVCache, rows, num_new=None, *,
                last_only: bool = False, num_layers: int | None = None,
                tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor: ...

    @property
    def backend(self) -> str: ...

    def fingerprint(self) -> str: ...

    runtime: str  # "native" or "ggml"
    partial_layers: bool  # forward(num_layers < L) runs the first layers (layer-skip drafting)
    noisy_numerics: bool  # batching moves its logits beyond fp32 rounding (the audit measures how far)
    supports_trees: bool  # forward(tree=...) runs a tree of branches in one pass; the cache has keep_slots
    backend_fault: str | None  # the name of a fault injected into forward on purpose; None as loaded


BACKENDS = ("native", "ggml")


def with_positions(model: CausalLM, positions) -> CausalLM:
    """The model (same weights) placing a pass's tokens at positions(start [B], T) -> [B,T]:
    the audit's fault suite breaks a ragged batch's RoPE positions this way for the engine
    under audit alone. Only the native runtime computes positions itself; a ggml model
    (llama.cpp places tokens) comes back unchanged."""
    from .llama import LlamaModel
    return model.with_positions(positions) if isinstance(model, LlamaModel) else model


def resolve_backend(spec: str, backend: str | None) -> str:
    """The backend load_model(spec, backend=...) uses: backend as given ("native" or "ggml");
    None or "auto" picks ggml for a path to a .gguf file when llama-cpp-python is installed,
    native otherwise (presets, directories, hub ids; and GGUF files without the extra,
    converted to fp32 as before)."""
    if backend in (None, "auto"):
        from .ggml import available
        return "ggml" if str(spec).lower().endswith(".gguf") and available() else "native"
    if backend not in BACKENDS:
        raise UnsupportedModelError(f"unknown backend {backend!r}; backends: auto, {', '.join(BACKENDS)}")
    return backend


def load_model(spec: str, *, progress: bool = True, batch_invariant: bool = False,
               backend: str | None = None) -> LoadedModel:
    """Resolve a preset name, local directory, GGUF file or hub id and load it on `backend`
    (see resolve_backend; "ggml" runs presets and .gguf files as shipped).

    batch_invariant: bitwise batch-invariant numerics (LlamaModel's batch_invariant on native,
    GgmlModel's on ggml)."""
    if resolve_backend(spec, backend) == "ggml":
        from .ggml import load_ggml
        return load_ggml(spec, progress=progress, batch_invariant=batch_invariant)
    from transformers import AutoTokenizer

    from .llama import LlamaModel
    from .loading import resolve_model

    files = resolve_model(spec, progress=progress)
    model = LlamaModel.from_dir(files.path, batch_invariant=batch_invariant)
    tokenizer = AutoTokenizer.from_pretrained(str(files.path))
    return LoadedModel(model=model, tokenizer=tokenizer, files=files)

