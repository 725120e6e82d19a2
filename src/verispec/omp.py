"""OpenMP's spin time for llama.cpp's threads (the ggml backend), set before torch loads.

llama.cpp's CPU backend, built with OpenMP (as scripts/build_llama_cpp.sh and pip build it),
runs every graph on OpenMP threads. In a verispec process those are the threads of the one
libgomp that torch loaded first (ggml binds to that copy). Between two decodes the engine's
Python step takes ~2-3 ms at batch 1, longer than libgomp's default spin (GOMP_SPINCOUNT
300,000), so the worker threads go to sleep and every decode pays their wake-up. Measured on
Qwen2.5-Coder 1.5B Q4_K_M, 2 threads, a bare llama_decode loop: 15.0 tok/s by default and
15.6-15.8 with a spin of 3,000,000, llama-bench's own speed (its loop leaves no gap).
llama.cpp asks the same of Intel's OpenMP runtime (KMP_BLOCKTIME=200 ms in ggml-cpu.c); GNU
libgomp reads its setting once, when it loads, so this must run before torch is imported.
It touches nothing of this module's importer but the environment, and only for runs on ggml:
on the native runtime torch's threads keep libgomp's default.
"""

from __future__ import annotations

import os
import sys

GGML_SPINCOUNT = "3000000"


def wants_ggml(argv: list[str]) -> bool:
    """Whether a command line asks for the ggml backend: --backend ggml, or a .gguf file."""
    for i, a in enumerate(argv):
        if a == "--backend=ggml" or (a == "--backend" and i + 1 < len(argv) and argv[i + 1] == "ggml"):
            return True
        if a.lower().endswith(".gguf"):
            return True
    return False


def spin_for_ggml() -> bool:
    """Set GOMP_SPINCOUNT for llama.cpp's threads; -> whether it will take effect. Left alone
    where the user set GOMP_SPINCOUNT or OMP_WAIT_POLICY, and where torch (so libgomp) is
    already loaded."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules:
        return False
    os.environ["GOMP_SPINCOUNT"] = GGML_SPINCOUNT
    return True
