"""Fast exact fp32 linear layer for few-row (decode / verify) batches.

``y = x @ W.T + b`` with ``x [..., in]`` and ``W [out, in]`` in fp32, tuned for
the speculative-decoding hot path where only 1..16 rows (tokens) go through
each layer.  That regime is memory-bandwidth-bound: the ideal cost of N rows
is one read of ``W``.  torch's CPU ``F.linear`` (MKL) gets N=1 right but takes
2-4x longer for N=2..16 on this hardware; this module reads ``W`` once for all
rows.

Usage::

    from verispec.models.fastlinear import PackedLinear, backend_name

    lin = PackedLinear(weight, bias)   # weight [out, in] fp32, bias [out] or None
    y = lin(x)                         # x [..., in] fp32 -> y [..., out] fp32
    backend_name()                     # "native-avx512", "native-avx2" or "torch-..."

Backends
--------
``native-<isa>``
    A small C kernel (``csrc/fastlinear.c``) compiled with the system C
    compiler (``$CC`` or ``gcc``/``cc``, ``-O3 -march=native -fopenmp``) the
    first time a :class:`PackedLinear` is built (never at import), loaded with
    ctypes and cached under ``$VERISPEC_CACHE/kernels`` (default
    ``~/.cache/verispec/kernels``), keyed by source hash, compiler, flags and
    CPU.  A build takes ~2 s.  Each build records the library's SHA-256 in a
    sidecar file (``<name>.so.sha256``, written atomically after the library);
    a cached library is loaded only if it is a regular file owned by this user,
    writable by nobody else, and its bytes hash to that digest (checked on the
    open file, which is then what ``dlopen`` maps, through ``/proc/self/fd``).
    Anything else (tampered, truncated, a missing or mismatching digest) is
    never loaded: it is rebuilt, with a warning logged, or the torch fallback
    is used.  The weight is repacked once into 16-column
    panels (``[ceil(out/16), in, 16]``, zero padded; the original is not kept,
    so memory stays ~1x the weight -- freeing the caller's copy is the caller's
    business).  Each 64-byte weight vector is read once and used for every row
    (register blocking over rows), the output dimension is split across
    ``torch.get_num_threads()`` threads.  With OpenMP those are torch's own
    intra-op threads (the library binds to the libgomp torch already loaded).
    It is used for every N: measured here it beats MKL at N = 512 too, so
    prefill gains as well (``max_native_rows`` hands large N to torch if wanted).

``torch-mkldnn`` / ``torch``
    Used when the kernel can't be built or loaded (no compiler, no AVX2/FMA,
    a failed self-check) or when forced.  The best pure-torch path measured here is
    oneDNN with a weight prepacked once
    (``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``),
    about 2.5x faster than ``F.linear`` for N = 2..16 and no slower at N = 1.
    If that op is missing, plain ``F.linear``.

Environment
-----------
``VERISPEC_LINEAR``
    ``torch`` forces the torch fallback; ``native`` insists on the kernel (a
    build failure raises instead of falling back); unset / ``auto``: kernel
    if possible, else torch.  Read only here, when a PackedLinear is built.
``VERISPEC_CACHE``
    Root of the cache directory (``<root>/kernels``).
``CC``
    C compiler to use (default ``gcc``, then ``cc``).

Exactness and batch invariance
------------------------------
Native kernel: every output element is ONE fp32 accumulator updated with FMA
in increasing ``k`` order starting from 0, with the bias added last::

    y[n, o] = fma(W[o, in-1], x[n, in-1], ... fma(W[o, 0], x[n, 0], 0.0)) + b[o]

That order depends on neither N, the row/panel blocking N selects, the thread
count nor which thread computes the column, so the kernel is **bitwise
batch-invariant**: ``lin(x[i:j])`` equals ``lin(x)[i:j]`` exactly, and the
same row gives the same bits whatever else is in the batch.  The order differs
from MKL's, so results match ``F.linear`` within fp32 rounding (observed
max abs diff ~1e-5 relative to the output scale), not bitwise.  The torch
fallback is not batch-invariant (MKL/oneDNN pick kernels by N); check
:attr:`PackedLinear.batch_invariant`.

Inference only: a call with ``x.requires_grad`` under grad mode raises.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading as _threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["PackedLinear", "backend_name", "native_info"]

log = logging.getLogger(__name__)

ENV_BACKEND = "VERISPEC_LINEAR"
ENV_CACHE = "VERISPEC_CACHE"  # paths.cache_dir() reads it

_SRC_PATH = Path(__file__).with_name("csrc") / "fastlinear.c"
_ABI_VERSION = 3
_PANEL = 16
_NATIVE_ISAS = ("avx512", "avx2")  # "generic" C path is correct but slow on x86
_BASE_FLAGS = ["-O3", "-march=native", "-std=gnu11", "-fPIC", "-shared", "-fno-math-errno"]
_COMPILE_TIMEOUT_S = 120

_i64 = ctypes.c_int64
_vp = ctypes.c_void_p


# --------------------------------------------------------------------------
# native library: build, cache, load (once per process, on first use)
# --------------------------------------------------------------------------


@dataclass
class _NativeState:
    """What the one-time build/load produced.  Tests swap in a fresh one."""

    tried: bool = False
    lib: ctypes.CDLL | None = None
    isa: str = ""
    threading: str = ""
    so_path: str = ""
    sha256: str = ""  # digest of the library that was loaded (verified before loading)
    compile_seconds: float | None = None  # None: loaded from cache
    error: str = ""
    lock: _threading.Lock = field(default_factory=_threading.Lock)


_STATE = _NativeState()


def _cache_dir() -> Path:
    from ..paths import cache_dir
    return cache_dir() / "kernels"


def _cpu_signature() -> str:
    """Identifies the CPU features -march=native compiles for."""
    sig = [platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            wanted = ("flags", "model name", "cpu family", "model", "features", "cpu part")
            seen = set()
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip().lower()
                if key in wanted and key not in seen:
                    seen.add(key)
                    sig.append(f"{key}={' '.join(sorted(val.split()))}")
                if not line.strip() and seen:
                    break  # first processor block is enough
    except OSError:
        sig.append(platform.processor())
    return "\n".join(sig)


def _find_compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or (cc if os.path.isfile(cc) else None)
    return shutil.which("gcc") or shutil.which("cc")


def _compiler_id(cc: str) -> str:
    try:
        r = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return (r.stdout or r.stderr).splitlines()[0] if (r.stdout or r.stderr) else cc
    except (OSError, subprocess.SubprocessError):
        return cc


def _declare(lib: ctypes.CDLL) -> None:
    lib.fl_isa.restype = ctypes.c_char_p
    lib.fl_isa.argtypes = []
    lib.fl_threading.restype = ctypes.c_char_p
    lib.fl_threading.argtypes = []
    lib.fl_abi_version.restype = ctypes.c_int
    lib.fl_abi_version.argtypes = []
    lib.fl_pack.restype = None
    lib.fl_pack.argtypes = [_vp, _i64, _i64, _i64, _vp, ctypes.c_int]
    lib.fl_unpack.restype = None
    lib.fl_unpack.argtypes = [_vp, _i64, _i64, _vp, _i64, ctypes.c_int]
    lib.fl_forward.restype = None
    lib.fl_forward.argtypes = [_vp, _i64, _i64, _i64, _vp, _vp, _i64, _vp, _i64, ctypes.c_int]


def _self_check(lib: ctypes.CDLL) -> None:
    """Tiny end-to-end check against a float64 reference (guards miscompiles)."""
    g = torch.Generator().manual_seed(1234)
    for out, inn, n in ((37, 19, 3), (16, 64, 9), (5, 1, 1)):
        w = torch.randn(out, inn, generator=g)
        b = torch.randn(out, generator=g)
        x = torch.randn(n, inn, generator=g)
        wp = torch.empty((out + _PANEL - 1) // _PANEL, inn, _PANEL)
        lib.fl_pack(w.data_ptr(), w.stride(0), out, inn, wp.data_ptr(), 1)
        y = torch.empty(n, out)
        lib.fl_forward(x.data_ptr(), x.stride(0), n, inn, wp.data_ptr(), b.data_ptr(), out,
                       y.data_ptr(), y.stride(0), 2)
        ref = (x.double() @ w.double().T + b.double()).float()
        if not torch.allclose(y, ref, rtol=1e-5, atol=1e-5):
            raise RuntimeError(f"fastlinear self-check failed (max diff {(y - ref).abs().max():.3g})")
        y1 = torch.empty(1, out)
        lib.fl_forward(x[-1:].data_ptr(), inn, 1, inn, wp.data_ptr(), b.data_ptr(), out,
                       y1.data_ptr(), out, 1)
        if not torch.equal(y1, y[-1:]):
            raise RuntimeError("fastlinear self-check: result depends on batch size")


_DIGEST_SUFFIX = ".sha256"


def _digest_path(so: Path) -> Path:
    return so.with_name(so.name + _DIGEST_SUFFIX)


class _Untrusted(Exception):
    """A cached kernel library that must not be loaded."""


class _NoDigest(_Untrusted):
    """No digest recorded (a library from before digests were recorded, or a partial
    write): rebuilt without alarm, never loaded."""


def _sha256_fd(fd: int) -> str:
    h, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, offset):
        h.update(chunk)
        offset += len(chunk)
    return h.hexdigest()


def _check_owned(fd: int, what: Path) -> None:
    """The open file must be a regular file of this user that nobody else can write."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise _Untrusted(f"{what} is not a regular file")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise _Untrusted(f"{what} is owned by uid {st.st_uid}, not by this user")
    if st.st_mode & 0o022:
        raise _Untrusted(f"{what} is writable by group or others (mode {oct(st.st_mode & 0o777)})")


def _open_verified(so: Path) -> tuple[int, str]:
    """Open the library and check it against its recorded digest; returns (fd, sha256).
    The digest is computed from the open file, and that same file is what gets loaded
    (see _dlopen), so a swap after the check cannot slip in. Raises _Untrusted."""
    digest_file = _digest_path(so)
    try:
        dfd = os.open(digest_file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise _NoDigest(f"no recorded digest for {so.name} ({e.strerror})") from None
    try:
        _check_owned(dfd, digest_file)
        want = os.read(dfd, 256).decode("ascii", "replace").strip()
    finally:
        os.close(dfd)
    try:
        fd = os.open(so, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise _Untrusted(f"cannot open {so.name} ({e.strerror})") from None
    try:
        _check_owned(fd, so)
        got = _sha256_fd(fd)
        if got != want:
            raise _Untrusted(f"{so.name} has SHA-256 {got[:16]}..., its recorded digest is "
                             f"{want[:16] or '(empty)'}...")
    except BaseException:
        os.close(fd)
        raise
    return fd, got


def _dlopen(fd: int, so: Path) -> ctypes.CDLL:
    """Load the library from the open (verified) file descriptor."""
    via = f"/proc/self/fd/{fd}"
    return ctypes.CDLL(via if os.path.exists(via) else str(so))


def _write_digest(digest: str, digest_final: Path) -> None:
    """Record the SHA-256 of the built library at digest_final, atomically."""
    fd, tmp = tempfile.mkstemp(prefix=".fastlinear-", suffix=_DIGEST_SUFFIX, dir=digest_final.parent)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(digest + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, digest_final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _build(cc: str, src: bytes, out_dir: Path) -> tuple[str, float | None, int, str]:
    """Compile (or reuse a verified cached) shared library; returns (path, seconds or
    None if cached, an open fd of the verified library, its SHA-256)."""
    cid = _compiler_id(cc)
    attempts = [_BASE_FLAGS + ["-fopenmp"], _BASE_FLAGS]  # OpenMP is optional
    errors = []
    for flags in attempts:
        key = hashlib.sha256(
            b"\0".join([src, cc.encode(), cid.encode(), " ".join(flags).encode(),
                        _cpu_signature().encode(), str(_ABI_VERSION).encode()])
        ).hexdigest()[:24]
        so = out_dir / f"fastlinear-{key}.so"
        if so.exists() or _digest_path(so).exists():
            try:
                fd, digest = _open_verified(so)
                return str(so), None, fd, digest
            except _Untrusted as e:
                (log.info if isinstance(e, _NoDigest) else log.warning)(
                    "fastlinear: not loading the cached kernel %s: %s; rebuilding it", so, e)
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".fastlinear-", suffix=".so", dir=out_dir)
        os.close(fd)
        csrc = out_dir / f".fastlinear-{key}-{os.getpid()}.c"
        try:
            csrc.write_bytes(src)
            t0 = time.perf_counter()
            r = subprocess.run([cc, *flags, "-o", tmp, str(csrc)], capture_output=True, text=True,
                               timeout=_COMPILE_TIMEOUT_S)
            dt = time.perf_counter() - t0
            if r.returncode == 0:
                os.chmod(tmp, 0o755)  # whatever the umask: writable by this user only
                # this process loads the file it just built, through an fd opened now;
                # the cache gets the library first, then its digest (both atomic): a
                # reader that sees a new library with an old digest rebuilds, never loads it
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    digest = _sha256_fd(fd)
                    os.replace(tmp, so)
                    _write_digest(digest, _digest_path(so))
                except BaseException:
                    os.close(fd)
                    raise
                return str(so), dt, fd, digest
            errors.append(f"{' '.join(flags)}: {r.stderr.strip()[-2000:]}")
        finally:
            for p in (tmp, csrc):
                try:
                    os.unlink(p)
                except OSError:
                    pass
    raise RuntimeError("compilation failed:\n" + "\n".join(errors))


def _load_native() -> _NativeState:
    """Build/load the kernel once per process; never raises (see state.error)."""
    st = _STATE
    if st.tried:
        return st
    with st.lock:
        if st.tried:
            return st
        try:
            if not _SRC_PATH.is_file():
                raise RuntimeError(f"kernel source missing: {_SRC_PATH}")
            cc = _find_compiler()
            if cc is None:
                raise RuntimeError("no C compiler found (set CC)")
            src = _SRC_PATH.read_bytes()
            try:
                so, secs, fd, digest = _build(cc, src, _cache_dir())
            except OSError:  # cache dir not writable: build in a private temp dir
                so, secs, fd, digest = _build(cc, src, Path(tempfile.mkdtemp(prefix="verispec-kernels-")))
            # torch is imported, so its libgomp.so.1 is already loaded and the
            # kernel's libgomp.so.1 dependency resolves to it (same soname).
            try:
                lib = _dlopen(fd, Path(so))
            finally:
                os.close(fd)
            _declare(lib)
            if lib.fl_abi_version() != _ABI_VERSION:
                raise RuntimeError("stale kernel library (ABI mismatch)")
            _self_check(lib)
            st.lib = lib
            st.isa = lib.fl_isa().decode()
            st.threading = lib.fl_threading().decode()
            st.so_path = so
            st.sha256 = digest
            st.compile_seconds = secs
        except Exception as e:  # noqa: BLE001 -- any failure means "use torch"
            st.lib = None
            st.error = f"{type(e).__name__}: {e}"
        st.tried = True
    return st


def _env_mode() -> str:
    mode = os.environ.get(ENV_BACKEND, "auto").strip().lower() or "auto"
    if mode not in ("auto", "native", "torch"):
        raise ValueError(f"{ENV_BACKEND}={mode!r}: expected 'auto', 'native' or 'torch'")
    return mode


def _native_usable(st: _NativeState, mode: str) -> bool:
    if st.lib is None:
        return False
    return st.isa in _NATIVE_ISAS or mode == "native"


_MKLDNN_OK: bool | None = None


def _mkldnn_ok() -> bool:
    """oneDNN prepacked linear available and correct here (checked once)."""
    global _MKLDNN_OK
    if _MKLDNN_OK is None:
        try:
            ok = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            if ok:
                g = torch.Generator().manual_seed(7)
                w, b, x = torch.randn(24, 40, generator=g), torch.randn(24, generator=g), torch.randn(3, 40, generator=g)
                wm = torch.ops.mkldnn._reorder_linear_weight(w, 8)
                y = torch.ops.mkldnn._linear_pointwise(x, wm, b, "none", [], "")
                ok = torch.allclose(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
            _MKLDNN_OK = bool(ok)
        except Exception:  # noqa: BLE001
            _MKLDNN_OK = False
    return _MKLDNN_OK


def _torch_backend_name() -> str:
    return "torch-mkldnn" if _mkldnn_ok() else "torch"


def backend_name() -> str:
    """Backend a PackedLinear built now would use.

    ``"native-avx512"`` / ``"native-avx2"``, or ``"torch-mkldnn"`` / ``"torch"``
    for the fallback.  Like a first PackedLinear, this builds/loads the kernel
    if that has not happened yet (it is never done at import).
    """
    mode = _env_mode()
    if mode != "torch":
        st = _load_native()
        if _native_usable(st, mode):
            return f"native-{st.isa}"
    return _torch_backend_name()


def native_info() -> dict:
    """Diagnostics about the native kernel (triggers the one-time build)."""
    st = _load_native()
    return {
        "available": st.lib is not None,
        "isa": st.isa,
        "threading": st.threading,
        "so_path": st.so_path,
        "sha256": st.sha256,
        "compile_seconds": st.compile_seconds,
        "error": st.error,
    }


# --------------------------------------------------------------------------
# the layer
# --------------------------------------------------------------------------


class PackedLinear:
    """``y = x @ weight.T + bias`` in fp32, fast for few rows; inference only.

    Args:
        weight: ``[out, in]`` float32 CPU tensor (any strides).  Repacked once;
            no reference to it is kept in the native or mkldnn backends (the
            plain ``torch`` backend keeps the tensor itself, not a copy).
        bias: ``[out]`` float32 or None (copied, it is small).
        max_native_rows: hand batches with more rows than this to torch
            (None, the default: the kernel takes every N -- it is faster than
            MKL here at all sizes measured, and only it is batch-invariant;
            with a cap, ``batch_invariant`` is False).

    Attributes: ``backend`` (str), ``batch_invariant`` (bool),
    ``in_features``, ``out_features``.
    """

    __slots__ = ("in_features", "out_features", "backend", "batch_invariant", "max_native_rows",
                 "_wp", "_bias", "_wm", "_w", "_fwd", "_wp_ptr", "_b_ptr", "_lib")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 max_native_rows: int | None = None):
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError("weight must be a 2-D tensor [out, in]")
        if weight.dtype != torch.float32:
            raise TypeError(f"PackedLinear is fp32-only, got weight dtype {weight.dtype}")
        out, inn = weight.shape
        if bias is not None:
            if bias.shape != (out,):
                raise ValueError(f"bias must have shape ({out},), got {tuple(bias.shape)}")
            if bias.dtype != torch.float32:
                raise TypeError(f"PackedLinear is fp32-only, got bias dtype {bias.dtype}")
        self.in_features = int(inn)
        self.out_features = int(out)
        self.max_native_rows = max_native_rows
        self._wp = self._wm = self._w = self._fwd = self._lib = None
        self._wp_ptr = self._b_ptr = None
        weight = weight.detach()
        self._bias = None if bias is None else bias.detach().contiguous().clone()
        on_cpu = weight.device.type == "cpu" and (bias is None or bias.device.type == "cpu")

        mode = _env_mode()
        st = _load_native() if (mode != "torch" and on_cpu) else None
        if st is not None and _native_usable(st, mode):
            self._lib = st.lib
            self._fwd = st.lib.fl_forward
            npanel = (out + _PANEL - 1) // _PANEL
            w = weight if weight.stride(1) == 1 else weight.contiguous()
            self._wp = torch.empty(npanel, inn, _PANEL, dtype=torch.float32)
            if out and inn:
                st.lib.fl_pack(w.data_ptr(), w.stride(0), out, inn, self._wp.data_ptr(),
                               torch.get_num_threads())
            del w
            self._wp_ptr = self._wp.data_ptr()
            self._b_ptr = None if self._bias is None else self._bias.data_ptr()
            self.backend = f"native-{st.isa}"
            self.batch_invariant = max_native_rows is None  # torch above the cap is not
        else:
            if mode == "native":
                err = st.error if st is not None else f"weight on {weight.device}"
                raise RuntimeError(f"{ENV_BACKEND}=native but the native kernel is unavailable: {err}")
            if on_cpu and out and inn and _mkldnn_ok():
                self._wm = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 8)
                self.backend = "torch-mkldnn"
            else:
                self._w = weight
                self.backend = "torch"
            self.batch_invariant = False

    # -- helpers -----------------------------------------------------------

    def _torch_forward(self, x2: torch.Tensor) -> torch.Tensor:
        if self._wm is not None:
            return torch.ops.mkldnn._linear_pointwise(x2, self._wm, self._bias, "none", [], "")
        if self._w is not None:
            return torch.nn.functional.linear(x2, self._w, self._bias)
        # native backend asked to delegate (max_native_rows): panels -> torch
        n = x2.shape[0]
        y = torch.matmul(x2, self._wp)  # [npanel, n, 16]
        y = y.permute(1, 0, 2).reshape(n, -1)[:, : self.out_features]
        return y + self._bias if self._bias is not None else y.contiguous()

    def unpacked_weight(self) -> torch.Tensor:
        """A fresh ``[out, in]`` copy of the weight (for checks / export)."""
        if self._w is not None:
            return self._w.clone()
        if self._wm is not None:
            return self._wm.to_dense().clone()
        w = torch.empty(self.out_features, self.in_features)
        if self.out_features and self.in_features:
            self._lib.fl_unpack(self._wp_ptr, self.out_features, self.in_features, w.data_ptr(),
                                self.in_features, torch.get_num_threads())
        return w

    @property
    def bias(self) -> torch.Tensor | None:
        return self._bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self._bias is not None}, backend={self.backend}")

    def __repr__(self) -> str:
        return f"PackedLinear({self.extra_repr()})"

    # -- call --------------------------------------------------------------

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        inn, out = self.in_features, self.out_features
        if x.dim() == 0 or x.shape[-1] != inn:
            raise ValueError(f"expected x [..., {inn}], got {tuple(x.shape)}")
        if x.dtype != torch.float32:
            raise TypeError(f"PackedLinear is fp32-only, got x dtype {x.dtype}")
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("PackedLinear is inference-only: call it under torch.no_grad() "
                               "or torch.inference_mode()")
        if x.dim() == 2:  # fast path: no reshapes
            x2, n, lead = x, x.shape[0], None
        else:
            lead = x.shape[:-1]
            n = math.prod(lead)
            x2 = x.reshape(n, inn)
        fwd = self._fwd
        if fwd is None or (self.max_native_rows is not None and n > self.max_native_rows):
            if self._w is None and x2.stride(-1) != 1:
                x2 = x2.contiguous()
            y = self._torch_forward(x2)
        else:
            if not x2.is_cpu:
                raise ValueError(f"native PackedLinear runs on CPU, got x on {x.device}")
            if inn > 1 and x2.stride(1) != 1:  # the kernel wants unit stride along k
                x2 = x2.contiguous()
            y = torch.empty(n, out, dtype=torch.float32)
            if n and out:
                fwd(x2.data_ptr(), x2.stride(0), n, inn, self._wp_ptr, self._b_ptr, out,
                    y.data_ptr(), out, torch.get_num_threads())
        return y if lead is None else y.view(*lead, out)

    forward = __call__
