"""omp.py: the OpenMP spin for llama.cpp's threads is set only for ggml runs, only before torch."""

import os
import subprocess
import sys

from verispec.omp import GGML_SPINCOUNT, wants_ggml


def test_wants_ggml_reads_the_backend_flag_and_gguf_paths():
    assert wants_ggml(["generate", "--backend", "ggml", "--model", "smollm2-135m"])
    assert wants_ggml(["audit", "--backend=ggml"])
    assert wants_ggml(["serve", "--target", "/x/Model.Q4_K_M.GGUF"])
    assert not wants_ggml(["generate", "--backend", "native", "--model", "smollm2-135m"])
    assert not wants_ggml(["audit", "--quick"])
    assert not wants_ggml(["generate", "--backend"])


def _spin_in_fresh_process(code: str, env: dict) -> str:
    full = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")} | env
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_spin_is_set_before_torch_and_never_after_or_over_the_users_choice():
    before = "from verispec.omp import spin_for_ggml; import os; print(spin_for_ggml(), os.environ.get('GOMP_SPINCOUNT'))"
    assert _spin_in_fresh_process(before, {}) == f"True {GGML_SPINCOUNT}"
    after = "import torch; " + before
    assert _spin_in_fresh_process(after, {}) == "False None"
    assert _spin_in_fresh_process(before, {"OMP_WAIT_POLICY": "PASSIVE"}) == "False None"
    assert _spin_in_fresh_process(before, {"GOMP_SPINCOUNT": "10"}) == "False 10"
