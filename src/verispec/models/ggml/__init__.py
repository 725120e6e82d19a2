"""The ggml backend: GGUF files as shipped, run by llama.cpp through llama-cpp-python.

    loaded = load_ggml("qwen2.5-coder-1.5b")      # a preset's GGUF, or a path to a .gguf

lib.py finds llama-cpp-python and its library (the `gguf` extra); runtime.py holds the
model (GgmlModel, the CausalLM protocol), kvcache.py its KV cache (GgmlCache) and
ordered.py the cache's batch-invariant variant (GgmlOrderedCache).
"""

from __future__ import annotations

from pathlib import Path

from .lib import LLAMA_CPP_PYTHON_VERSION, MissingGgufExtraError, available
from .kvcache import GgmlCache
from .runtime import LAYER_SKIP_UNSUPPORTED, GgmlModel, UnsupportedFeatureError

__all__ = ["GgmlCache", "GgmlModel", "LAYER_SKIP_UNSUPPORTED", "LLAMA_CPP_PYTHON_VERSION",
           "MissingGgufExtraError", "UnsupportedFeatureError", "available", "load_ggml", "load_tokenizer"]


def load_tokenizer(files, *, progress: bool = True):
    """The Hugging Face tokenizer of a GGUF file, as transformers reads it from the file (the
    tokenizer the native backend's conversion writes, so both tokenize text alike). A
    converted preset's directory already holds it; otherwise it is read from the GGUF once
    and kept in ``<cache>/tokenizer-<sha256[:16]>/``."""
    from transformers import AutoTokenizer

    from ..loading import _install, _locked, _say
    from ..presets import PRESETS, cache_dir, converted_dir, is_converted

    if files.source == "preset" and is_converted(PRESETS[files.name]):
        return AutoTokenizer.from_pretrained(str(converted_dir(PRESETS[files.name])))
    root = cache_dir()
    key = f"tokenizer-{files.sha256[:16]}"
    target = root / key
    if not (target / "tokenizer_config.json").is_file():
        with _locked(root, key, progress=progress) as tmp:
            if not (target / "tokenizer_config.json").is_file():
                path = Path(files.path)
                _say(progress, f"reading the tokenizer of {path.name} (once)")
                tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=str(path))
                tok.save_pretrained(str(tmp / "tok"))
                _install(tmp / "tok", target, tmp)
    return AutoTokenizer.from_pretrained(str(target))


def load_ggml(spec: str, *, progress: bool = True, batch_invariant: bool = False):
    """A preset or .gguf path on the ggml backend -> models.LoadedModel (files: the GGUF,
    hashed). batch_invariant: llama.cpp without weight repacking and with ordered KV cells
    (ordered.py): bitwise batch-invariant logits, at the speed cost benchmarks/RESULTS.md gives."""
    from ..loading import LoadedModel, resolve_gguf

    files = resolve_gguf(spec, progress=progress)
    model = GgmlModel(files.path, files.sha256, batch_invariant=batch_invariant)
    return LoadedModel(model=model, tokenizer=load_tokenizer(files, progress=progress), files=files)
