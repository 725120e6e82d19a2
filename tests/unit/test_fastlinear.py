"""verispec.models.fastlinear: exact fp32 few-row linear + its torch fallback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from verispec.models import fastlinear as fl

SRC = str(Path(fl.__file__).resolve().parents[2])


def _native() -> bool:
    return fl.backend_name().startswith("native")


needs_native = pytest.mark.skipif(not _native(), reason="native kernel unavailable here")


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    ref = F.linear(x, w, b)
    assert y.shape == ref.shape and y.dtype == torch.float32
    # Summation order differs from MKL's.  With unit-scale random data partial
    # sums grow like sqrt(k), so fp32 rounding differences grow like eps * in.
    atol = 3e-7 * w.shape[1] + 1e-6
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=atol)
    return float((y - ref).abs().max()) if y.numel() else 0.0


SHAPES = [(33, 577), (1, 1), (16, 16), (17, 15), (300, 1536), (1000, 64), (40, 1025)]
NS = [1, 2, 3, 5, 7, 8, 9, 13, 16, 17, 24, 31, 33, 40]


@pytest.mark.parametrize("out,inn", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_torch_linear(out, inn, with_bias):
    g = torch.Generator().manual_seed(out * 1000 + inn)
    w = torch.randn(out, inn, generator=g)
    b = torch.randn(out, generator=g) if with_bias else None
    lin = fl.PackedLinear(w, b)
    assert (lin.in_features, lin.out_features) == (inn, out)
    x = torch.randn(max(NS), inn, generator=g)
    for n in NS:
        _check(lin(x[:n]), x[:n], w, b)


def test_input_layouts():
    g = torch.Generator().manual_seed(0)
    out, inn = 70, 577
    w, b = torch.randn(out, inn, generator=g), torch.randn(out, generator=g)
    lin = fl.PackedLinear(w, b)
    big = torch.randn(12, 2 * inn, generator=g)
    cases = {
        "strided-k": big[:, ::2],  # stride 2 along the feature dim
        "row-offset": big[3:9, 5 : 5 + inn],  # storage offset, row stride 2*inn
        "transposed": torch.randn(inn, 6, generator=g).t(),
        "3d": torch.randn(2, 3, inn, generator=g),
        "3d-permuted": torch.randn(3, 2, inn, generator=g).permute(1, 0, 2),
        "expanded": torch.randn(1, inn, generator=g).expand(5, inn),  # row stride 0
        "1d": torch.randn(inn, generator=g),
        "empty": torch.randn(0, inn, generator=g),
        "4d": torch.randn(2, 2, 3, inn, generator=g),
    }
    for name, x in cases.items():
        y = lin(x)
        assert y.shape == (*x.shape[:-1], out), name
        _check(y, x, w, b)


def test_weight_layouts_and_unpack():
    g = torch.Generator().manual_seed(1)
    w_big = torch.randn(50, 80, generator=g)
    w = w_big[5:45:2, 3:73]  # non-contiguous rows and columns
    lin = fl.PackedLinear(w, None)
    x = torch.randn(4, 70, generator=g)
    _check(lin(x), x, w, None)
    torch.testing.assert_close(lin.unpacked_weight(), w, rtol=0, atol=0)
    lin_t = fl.PackedLinear(torch.randn(70, 20, generator=g).t(), None)  # column-major weight
    _check(lin_t(x), x, lin_t.unpacked_weight(), None)


def test_zero_sizes():
    lin = fl.PackedLinear(torch.randn(0, 8), None)
    assert lin(torch.randn(3, 8)).shape == (3, 0)
    b = torch.randn(5)
    lin = fl.PackedLinear(torch.randn(5, 0), b)
    y = lin(torch.randn(3, 0))
    torch.testing.assert_close(y, b.expand(3, 5))


def test_errors():
    w = torch.randn(8, 4)
    with pytest.raises(TypeError):
        fl.PackedLinear(w.double(), None)
    with pytest.raises(ValueError):
        fl.PackedLinear(w, torch.randn(7))
    lin = fl.PackedLinear(w, None)
    with pytest.raises(ValueError):
        lin(torch.randn(3, 5))
    with pytest.raises(TypeError):
        lin(torch.randn(3, 4, dtype=torch.float64))
    xg = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference-only"):
        lin(xg)
    with torch.no_grad():
        _check(lin(xg), xg.detach(), w, None)


@needs_native
def test_native_backend_and_invariance_flag():
    lin = fl.PackedLinear(torch.randn(8, 8), None)
    assert lin.backend == fl.backend_name() and lin.backend.startswith("native-")
    assert lin.batch_invariant
    info = fl.native_info()
    assert info["available"] and info["error"] == ""


@needs_native
@pytest.mark.parametrize("out,inn", [(8960 // 16, 1536), (33, 577), (300, 4099)])
def test_batch_invariance_bitwise(out, inn):
    """Row i's result does not depend on the other rows, N or thread count."""
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(out, inn, generator=g), torch.randn(out, generator=g)
    lin = fl.PackedLinear(w, b)
    x = torch.randn(40, inn, generator=g)
    full = lin(x)
    assert torch.equal(lin(x[:1]), full[:1])
    for n in (1, 2, 3, 7, 8, 9, 16, 17, 33):
        assert torch.equal(lin(x[:n]), full[:n]), n
    for i in (0, 5, 17, 39):
        assert torch.equal(lin(x[i : i + 1]), full[i : i + 1]), i
        assert torch.equal(lin(x[i : i + 11]), full[i : i + 11]), i
    nt = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(lin(x), full), t
    finally:
        torch.set_num_threads(nt)


@needs_native
def test_large_n_and_delegation():
    g = torch.Generator().manual_seed(6)
    w, b = torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    x = torch.randn(300, 96, generator=g)
    _check(fl.PackedLinear(w, b)(x), x, w, b)  # native at every N by default
    lin = fl.PackedLinear(w, b, max_native_rows=16)
    assert not lin.batch_invariant
    _check(lin(x), x, w, b)  # > 16 rows: torch on the packed panels
    _check(lin(x[:16]), x[:16], w, b)
    _check(fl.PackedLinear(w, None, max_native_rows=0)(x[:3]), x[:3], w, None)


# ---------------------------------------------------------------- fallback


def test_env_forces_torch(monkeypatch):
    monkeypatch.setenv(fl.ENV_BACKEND, "torch")
    assert fl.backend_name().startswith("torch")
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(33, 577, generator=g), torch.randn(33, generator=g)
    lin = fl.PackedLinear(w, b)
    assert lin.backend.startswith("torch") and not lin.batch_invariant
    for n in (1, 2, 8, 17, 40):
        x = torch.randn(n, 577, generator=g)
        _check(lin(x), x, w, b)
    xt = torch.randn(577, 3, generator=g).t()
    _check(lin(xt), xt, w, b)
    torch.testing.assert_close(lin.unpacked_weight(), w)


def test_env_rejects_unknown_value(monkeypatch):
    monkeypatch.setenv(fl.ENV_BACKEND, "fast-please")
    with pytest.raises(ValueError):
        fl.PackedLinear(torch.randn(4, 4), None)


def test_plain_torch_fallback(monkeypatch):
    monkeypatch.setenv(fl.ENV_BACKEND, "torch")
    monkeypatch.setattr(fl, "_MKLDNN_OK", False)
    assert fl.backend_name() == "torch"
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(20, 30, generator=g), torch.randn(20, generator=g)
    lin = fl.PackedLinear(w, b)
    assert lin.backend == "torch"
    x = torch.randn(2, 3, 30, generator=g)
    _check(lin(x), x, w, b)


def test_compile_failure_falls_back(monkeypatch, tmp_path):
    """No usable compiler: silently torch, backend_name() says so, error recorded."""
    monkeypatch.setattr(fl, "_STATE", fl._NativeState())
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv(fl.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.delenv(fl.ENV_BACKEND, raising=False)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(10, 12, generator=g)
    lin = fl.PackedLinear(w, None)
    assert lin.backend.startswith("torch")
    assert fl.backend_name().startswith("torch")
    assert fl.native_info()["available"] is False and fl.native_info()["error"]
    x = torch.randn(3, 12, generator=g)
    _check(lin(x), x, w, None)
    # "native" insists: no silent fallback
    monkeypatch.setenv(fl.ENV_BACKEND, "native")
    with pytest.raises(RuntimeError, match="native kernel is unavailable"):
        fl.PackedLinear(w, None)


def test_broken_compiler_falls_back(monkeypatch, tmp_path):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'broken compiler' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setattr(fl, "_STATE", fl._NativeState())
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv(fl.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.delenv(fl.ENV_BACKEND, raising=False)
    lin = fl.PackedLinear(torch.randn(4, 4), None)
    assert lin.backend.startswith("torch")
    assert "broken compiler" in fl.native_info()["error"]


@needs_native
def test_build_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv(fl.ENV_CACHE, str(tmp_path))
    monkeypatch.delenv(fl.ENV_BACKEND, raising=False)
    monkeypatch.setattr(fl, "_STATE", fl._NativeState())
    info = fl.native_info()
    assert info["available"], info["error"]
    assert info["compile_seconds"] is not None and info["compile_seconds"] < 30
    assert Path(info["so_path"]).parent == tmp_path / "kernels"
    monkeypatch.setattr(fl, "_STATE", fl._NativeState())
    info2 = fl.native_info()
    assert info2["compile_seconds"] is None and info2["so_path"] == info["so_path"]


def test_no_build_at_import(tmp_path):
    code = (
        "import verispec, verispec.models.fastlinear as f\n"
        "assert not f._STATE.tried\n"
        "import os; assert not os.path.exists(os.path.join(os.environ['VERISPEC_CACHE'], 'kernels'))\n"
        "print('ok')\n"
    )
    env = dict(os.environ, VERISPEC_CACHE=str(tmp_path), PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# -- the cached library is verified by its recorded SHA-256 before it is loaded ----------

_EVIL_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("loaded", f); fclose(f); }
}
int fl_abi_version(void) { return -1; }
"""


def _plant(tmp_path, so: Path) -> Path:
    """Replace `so` with a different, loadable library whose constructor writes a marker
    file when anything dlopens it; returns the marker's path."""
    marker = tmp_path / "planted-library-was-loaded"
    src = tmp_path / "evil.c"
    src.write_text(_EVIL_C % marker)
    evil = tmp_path / "evil.so"
    subprocess.run([fl._find_compiler(), "-shared", "-fPIC", "-o", str(evil), str(src)], check=True,
                   capture_output=True, timeout=120)
    # the marker does show a load: dlopen it once in another process
    subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(evil)!r})"], check=True, timeout=60)
    assert marker.read_text() == "loaded"
    marker.unlink()
    os.replace(evil, so)
    return marker


def _fresh(monkeypatch, tmp_path):
    monkeypatch.setenv(fl.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.delenv(fl.ENV_BACKEND, raising=False)
    monkeypatch.setattr(fl, "_STATE", fl._NativeState())
    return fl.native_info()


def _verify_on_disk(info):
    so = Path(info["so_path"])
    digest = Path(str(so) + ".sha256").read_text().strip()
    import hashlib
    assert hashlib.sha256(so.read_bytes()).hexdigest() == digest == info["sha256"]


@needs_native
@pytest.mark.parametrize("how", ["replaced", "digest-missing", "digest-replaced-too", "group-writable"])
def test_tampered_library_is_never_loaded(monkeypatch, tmp_path, caplog, how):
    info = _fresh(monkeypatch, tmp_path)
    assert info["available"] and info["compile_seconds"] is not None, info["error"]
    _verify_on_disk(info)
    so = Path(info["so_path"])
    digest_file = Path(str(so) + ".sha256")
    if how == "group-writable":  # the right bytes, but anyone in the group could change them
        marker = tmp_path / "not-planted"
        so.chmod(0o775)
    else:
        marker = _plant(tmp_path, so)
        if how == "digest-missing":
            digest_file.unlink()
        elif how == "digest-replaced-too":  # a digest for the planted library, written by someone else
            import hashlib
            digest_file.write_text(hashlib.sha256(so.read_bytes()).hexdigest() + "\n")
            digest_file.chmod(0o666)
    caplog.set_level("INFO", logger=fl.__name__)
    info2 = _fresh(monkeypatch, tmp_path)
    assert not marker.exists(), "the tampered library was loaded"
    assert info2["available"] and info2["compile_seconds"] is not None  # rebuilt, then loaded
    assert info2["so_path"] == info["so_path"]
    _verify_on_disk(info2)
    assert any("not loading the cached kernel" in r.getMessage() and "rebuilding" in r.getMessage()
               for r in caplog.records)
    info3 = _fresh(monkeypatch, tmp_path)  # the rebuilt one verifies: taken from the cache
    assert info3["available"] and info3["compile_seconds"] is None


@needs_native
def test_tampered_library_without_a_compiler_falls_back(monkeypatch, tmp_path, caplog):
    """Tampered and nothing to rebuild with: the torch fallback, with the reasons logged
    and recorded; the planted library is never loaded."""
    info = _fresh(monkeypatch, tmp_path)
    so = Path(info["so_path"])
    marker = _plant(tmp_path, so)
    caplog.set_level("WARNING", logger=fl.__name__)
    monkeypatch.setattr(fl, "_STATE", fl._NativeState())
    # the same compiler (the cache key includes it), but every compile now fails
    monkeypatch.setattr(fl.subprocess, "run", _failing_run(fl.subprocess.run))
    lin = fl.PackedLinear(torch.randn(4, 4), None)
    assert lin.backend.startswith("torch")
    assert not marker.exists()
    assert "compilation failed" in fl.native_info()["error"]
    assert any("SHA-256" in r.getMessage() for r in caplog.records)


def _failing_run(real_run):
    def run(cmd, *a, **kw):
        if "-o" in cmd:  # the compile step: fails; `cc --version` still answers
            return subprocess.CompletedProcess(cmd, 1, "", "compiler unavailable")
        return real_run(cmd, *a, **kw)
    return run
