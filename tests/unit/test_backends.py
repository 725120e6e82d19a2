"""Backend selection and its errors (no llama.cpp needed: these run everywhere)."""

import importlib.util

import pytest

from verispec.models import BACKENDS, load_model, resolve_backend
from verispec.models.config import UnsupportedModelError
from verispec.models.ggml import lib


def test_backends_listed():
    assert BACKENDS == ("native", "ggml")


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(UnsupportedModelError, match="unknown backend 'cuda'.*auto, native, ggml"):
        resolve_backend("smollm2-135m", "cuda")


def test_auto_picks_ggml_for_gguf_paths_only_where_installed(monkeypatch):
    monkeypatch.setattr(lib, "available", lambda: True)
    import verispec.models.ggml as g
    monkeypatch.setattr(g, "available", lambda: True)
    assert resolve_backend("/x/model.Q4_K_M.GGUF", None) == "ggml"
    assert resolve_backend("smollm2-135m", "auto") == "native"  # presets stay native by default
    assert resolve_backend("some/dir", None) == "native"
    assert resolve_backend("smollm2-135m", "ggml") == "ggml"
    monkeypatch.setattr(g, "available", lambda: False)
    assert resolve_backend("/x/model.gguf", None) == "native"  # converted, as before the extra


def _hide_llama_cpp(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name.split(".")[0] == "llama_cpp" else real(name, *a, **k))
    monkeypatch.setattr(lib, "_ll", None)


def test_missing_extra_names_the_install_command(monkeypatch):
    _hide_llama_cpp(monkeypatch)
    assert not lib.available()
    with pytest.raises(lib.MissingGgufExtraError, match=r"pip install 'verispec\[gguf\]'"):
        lib.bindings()


def test_missing_extra_through_load_model(monkeypatch, tmp_path):
    _hide_llama_cpp(monkeypatch)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(lib.MissingGgufExtraError, match=r"verispec\[gguf\]"):
        load_model(str(f), backend="ggml", progress=False)


def test_package_without_library_says_how_to_build(monkeypatch, tmp_path):
    """llama-cpp-python installed with LLAMA_BUILD=OFF and no cached build: the error names
    the build script (and never loads a library)."""
    pkg = tmp_path / "site" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    spec = importlib.util.spec_from_file_location("llama_cpp", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: spec if name == "llama_cpp" else real(name, *a, **k))
    monkeypatch.setattr(lib, "_ll", None)
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(lib.MissingGgufExtraError, match="build_llama_cpp.sh"):
        lib.bindings()


def test_ggml_refuses_non_gguf_specs(tmp_path, monkeypatch):
    from verispec.models.loading import ModelNotFoundError, resolve_gguf
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="runs GGUF files"):
        resolve_gguf(str(tmp_path))


def test_amx_builds_are_detected_from_llama_cpps_system_info():
    # the AMX buffer type of the pinned llama.cpp crashes on passes of more than one token; the
    # backend then loads without extra buffer types (runtime.amx_compiled decides)
    from verispec.models.ggml.runtime import amx_compiled

    class FakeBindings:
        def __init__(self, info):
            self.info = info

        def llama_print_system_info(self):
            return self.info

    assert amx_compiled(FakeBindings(b"CPU : SSE3 = 1 | AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1 |"))
    assert not amx_compiled(FakeBindings(b"CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | OPENMP = 1 |"))
    assert not amx_compiled(FakeBindings(None))


def test_every_backend_states_the_causal_lm_protocol():
    """Each backend, and the audit's view of a model with a fault in its forward, states every
    capability of the CausalLM protocol (config aside, set per model), so that no caller
    probes a model for one with a default."""
    from verispec.audit.faults.null import BackendView
    from verispec.models import CausalLM
    from verispec.models.ggml.runtime import GgmlModel
    from verispec.models.llama import LlamaModel

    stated = [n for n in CausalLM.__annotations__ if n != "config"]
    stated += ["new_cache", "forward", "backend", "fingerprint"]
    assert {"supports_trees", "backend_fault", "runtime"} <= set(stated)
    for cls in (LlamaModel, GgmlModel, BackendView):
        missing = [n for n in stated if not (hasattr(cls, n) or n in cls.__annotations__)]
        assert not missing, (cls.__name__, missing)


def test_the_widest_draft_tree_fits_a_ggml_cache_row():
    """verify/ and models/ share no import: the ggml cache states its own limit on a tree
    pass's branches, which the widest draft tree must stay within."""
    from verispec.models.ggml.kvcache import LLAMA_MAX_SEQ, TREE_MAX_BRANCHES
    from verispec.verify.tree import MAX_BRANCHES

    assert MAX_BRANCHES <= TREE_MAX_BRANCHES <= LLAMA_MAX_SEQ
