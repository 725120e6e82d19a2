"""Finding llama-cpp-python and the llama.cpp shared library it drives.

The ggml backend talks to llama.cpp through llama-cpp-python's ctypes bindings
(``llama_cpp.llama_cpp``), pinned to LLAMA_CPP_PYTHON_VERSION. The library is looked up
in this order:

1. ``$LLAMA_CPP_LIB_PATH`` when set (llama-cpp-python's own switch: a folder holding
   libllama.so and libggml*.so);
2. the library that ``pip install llama-cpp-python`` built into the package (``llama_cpp/lib``);
3. the shared build of ``scripts/build_llama_cpp.sh`` in
   ``<cache>/llama.cpp/<version>/lib``, for a package installed without its own build
   (``scripts/install.sh --gguf`` does that: one llama.cpp compile serves the backend and
   the llama.cpp tools the benchmarks run beside verispec).

Without the package, or with no library found, MissingGgufExtraError says which command
installs it. Importing this module imports nothing of llama.cpp; ``bindings()`` does, once.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from pathlib import Path

from ..config import UnsupportedModelError

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
INSTALL_HINT = ("pip install 'verispec[gguf]' (builds llama-cpp-python once, ~15 min on 2 cores), "
                "or bash scripts/install.sh --gguf (reuses scripts/build_llama_cpp.sh's cached build)")

_lock = threading.Lock()
_ll = None
_log_cb = None  # the C log callback must outlive every call into the library
# llama.cpp's CPU backend reads GGML_CPU_TILED_MM once, at the first matrix multiplication of
# the process (ggml-cpu/tiled/tiled.cpp), and keeps the answer: None until a decode has run,
# then whether its tiled K-quant kernel was switched off for the whole process
_tiled_off_at_first_decode: bool | None = None
TILED_MM_ENV = "GGML_CPU_TILED_MM"


class MissingGgufExtraError(UnsupportedModelError):
    """The ggml backend was asked for, but llama-cpp-python (the `gguf` extra) is missing."""


def available() -> bool:
    """Whether llama-cpp-python is installed (cheap: no import, no library load)."""
    return importlib.util.find_spec("llama_cpp") is not None


def cached_lib_dir() -> Path:
    from ..presets import cache_dir
    return cache_dir() / "llama.cpp" / LLAMA_CPP_PYTHON_VERSION / "lib"


def _library_dir() -> Path | None:
    """Where libllama.so will be loaded from, or None where there is none; sets
    LLAMA_CPP_LIB_PATH for the cached shared build (case 3 above) before the import."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None:
        raise MissingGgufExtraError(f"the ggml backend needs llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}: "
                                    f"{INSTALL_HINT}")
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    if override:
        return Path(override)
    own = Path(next(iter(spec.submodule_search_locations))) / "lib"
    if any(own.glob("libllama.*")):
        return own
    cached = cached_lib_dir()
    if any(cached.glob("libllama.*")):
        os.environ["LLAMA_CPP_LIB_PATH"] = str(cached)
        return cached
    return None


def note_first_decode() -> None:
    """Called before every llama_decode (cheap): from the first one on, the process's choice of
    llama.cpp's tiled K-quant kernel is fixed."""
    global _tiled_off_at_first_decode
    if _tiled_off_at_first_decode is None:
        _tiled_off_at_first_decode = os.environ.get(TILED_MM_ENV) == "0"


def switch_off_tiled_matmul() -> bool:
    """Switch llama.cpp's tiled K-quant matrix kernel off for this process, if it still can be:
    -> whether it is off. The kernel (Q2_K..Q6_K and IQ weights that are not repacked, 8 or
    more tokens per pass) sums in another order than the one-token kernel, so a row's logits
    would depend on how many tokens share its pass. ggml reads the switch once, at the
    process's first matrix multiplication, so it can be set only before the first decode."""
    if _tiled_off_at_first_decode is None:
        os.environ[TILED_MM_ENV] = "0"
        return True
    return _tiled_off_at_first_decode


def bindings():
    """llama_cpp.llama_cpp, imported and initialised once (backend init, logging at errors only)."""
    global _ll, _log_cb
    with _lock:
        if _ll is not None:
            return _ll
        where = _library_dir()
        if where is None:
            raise MissingGgufExtraError(
                "llama-cpp-python is installed without its llama.cpp library (installed with "
                f"LLAMA_BUILD=OFF?) and there is no cached build in {cached_lib_dir()}: run "
                "bash scripts/build_llama_cpp.sh, or pip install --force-reinstall "
                f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}")
        try:
            import llama_cpp
            import llama_cpp.llama_cpp as ll
        except (OSError, RuntimeError) as e:  # the library is there but does not load
            raise MissingGgufExtraError(f"llama-cpp-python could not load libllama from {where}: {e}. "
                                        f"Fix: {INSTALL_HINT}") from e
        version = getattr(llama_cpp, "__version__", None)
        if version != LLAMA_CPP_PYTHON_VERSION:
            raise MissingGgufExtraError(
                f"llama-cpp-python {version} is installed; the ggml backend is pinned to "
                f"{LLAMA_CPP_PYTHON_VERSION} (its ctypes layout follows that release): {INSTALL_HINT}")

        @ll.llama_log_callback
        def _log(level, text, user_data):  # GGML_LOG_LEVEL_ERROR = 4: pass errors through
            if level == 4 and text:
                os.write(2, b"llama.cpp: " + text)

        _log_cb = _log
        ll.llama_log_set(_log_cb, ctypes.c_void_p(0))
        ll.llama_backend_init()
        _ll = ll
        return ll
