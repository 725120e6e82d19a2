"""Real presets: assemble, verify and convert SmolLM2-135M into a temporary cache, then load it.

The Qwen presets take minutes and gigabytes to convert; only their (cheap) status is checked,
and only when VERISPEC_TEST_QWEN=1.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from verispec.models.loading import resolve_model
from verispec.models.presets import PRESETS, missing_dists, preset_status

pytestmark = pytest.mark.slow


def _require_installed(name):
    missing = missing_dists(PRESETS[name])
    if missing:
        pytest.skip(f"{name} not installed (missing {missing}); run `verispec models pull {name}`")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    _require_installed("smollm2-135m")
    root = tmp_path_factory.mktemp("verispec-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("VERISPEC_CACHE", str(root))
    t0 = time.perf_counter()
    mf = resolve_model("smollm2-135m", progress=False)
    first = time.perf_counter() - t0
    yield root, mf, first
    mp.undo()


def test_smollm2_converted_dir(smollm2):
    root, mf, _ = smollm2
    assert mf.source == "preset" and mf.name == "smollm2-135m"
    assert mf.path == root / "smollm2-135m"
    assert mf.sha256 == PRESETS["smollm2-135m"].sha256
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "verispec.json"):
        assert (mf.path / f).is_file(), f
    assert not list(root.rglob("*.gguf")) and not list(root.glob(".tmp-*"))
    config = json.loads((mf.path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    assert "quantization_config" not in config
    assert set(mf.files) >= {"config.json", "model.safetensors", "tokenizer.json"}


def test_smollm2_loads_and_generates(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, mf, _ = smollm2
    tok = AutoTokenizer.from_pretrained(mf.path)
    model = AutoModelForCausalLM.from_pretrained(mf.path)
    assert model.dtype == torch.float32
    ids = tok("def fib(n):", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0][ids["input_ids"].shape[1]:])
    assert out.shape[1] > ids["input_ids"].shape[1]
    assert text.strip(), text
    # Same weights as the GGUF: the greedy continuation of a code prompt is code.
    assert "return" in text or "if" in text or "fib" in text, text


def test_smollm2_tokenizer_round_trip(smollm2):
    from transformers import AutoTokenizer

    _, mf, _ = smollm2
    tok = AutoTokenizer.from_pretrained(mf.path)
    for text in ("def fib(n):", "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"):
        ids = tok(text)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.chat_template


def test_smollm2_second_resolve_is_fast(smollm2, monkeypatch):
    root, mf, first = smollm2
    monkeypatch.setenv("VERISPEC_CACHE", str(root))
    t0 = time.perf_counter()
    again = resolve_model("smollm2-135m", progress=False)
    elapsed = time.perf_counter() - t0
    assert again.path == mf.path and again.sha256 == mf.sha256
    assert elapsed < 15, f"second resolve took {elapsed:.1f}s (first {first:.1f}s)"
    status = preset_status("smollm2-135m")
    assert status["installed"] and status["converted"] and status["path"] == mf.path
    assert status["size_bytes"] > 500e6  # fp32 135M parameters


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("VERISPEC_TEST_QWEN") != "1", reason="set VERISPEC_TEST_QWEN=1")
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_qwen_preset_status(name):
    t0 = time.perf_counter()
    status = preset_status(name)
    assert time.perf_counter() - t0 < 5  # no hashing
    assert status["sha256"] == PRESETS[name].sha256
    assert status["installed"] == (not missing_dists(PRESETS[name]))
    if status["installed"]:
        assert status["payload_bytes"] > 300e6
    if status["converted"]:
        assert (status["path"] / "config.json").is_file()
        assert status["size_bytes"] > PRESETS[name].approx_params * 3
