"""llama.cpp's llama-server as a peer for the endpoint audit's tests and benchmarks.

The binary is the one scripts/build_llama_cpp.sh builds from the vendored llama.cpp of the
pinned llama-cpp-python sdist, cached outside the repo at
``$VERISPEC_CACHE/llama.cpp/<version>/bin/llama-server``. `binary()` finds it, or builds
it (about 11 minutes on 2 cores, once; VERISPEC_NO_LLAMA_BUILD=1 skips instead) where
cmake and a compiler are present, or says why it cannot.

    with LlamaServer(gguf, spec=NGRAM) as s:   # s.url: http://127.0.0.1:<port>
        ...
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx

VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
ROOT = Path(__file__).resolve().parents[1]
# prompt-lookup speculation: draft the 4 tokens that followed the last match of the final 3
NGRAM = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "4")


def cache_root() -> Path:
    from verispec.paths import cache_dir
    return cache_dir()


def binary(build: bool = True) -> tuple[Path | None, str]:
    """(path of llama-server, "") or (None, why not)."""
    path = cache_root() / "llama.cpp" / VERSION / "bin" / "llama-server"
    if not build or os.environ.get("VERISPEC_NO_LLAMA_BUILD") == "1":
        if path.is_file() and os.access(path, os.X_OK):
            return path, ""
        return None, f"{path} not built (run: bash scripts/build_llama_cpp.sh; ~5-11 min on 2 cores)"
    # the script returns at once when its cached build was made with its current flags, and
    # rebuilds one made with others (an AMX build crashes: scripts/build_llama_cpp.sh says why)
    missing = [t for t in ("cmake", "c++", "tar") if shutil.which(t) is None]
    if missing:
        if path.is_file() and os.access(path, os.X_OK):
            return path, ""  # built earlier; its flags cannot be checked without the tools
        return None, f"{path} not built and cannot be: {', '.join(missing)} not on PATH"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_cpp.sh")], capture_output=True, text=True)
    if r.returncode != 0 or not path.is_file():
        return None, f"scripts/build_llama_cpp.sh failed (exit {r.returncode}): {r.stderr[-500:]}"
    return path, ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server on 127.0.0.1 with Prometheus metrics, no busy polling, `slots` slots."""

    def __init__(self, model: Path, *, spec: tuple[str, ...] = (), slots: int = 8, ctx_per_slot: int = 512,
                 threads: int = 1, extra: tuple[str, ...] = (), log: Path | None = None, start_timeout_s: float = 180):
        exe, why = binary()
        if exe is None:
            raise RuntimeError(why)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-np", str(slots),
                    "-c", str(ctx_per_slot * slots), "--metrics", "--poll", "0", "-t", str(threads), *spec, *extra]
        self.log = log or Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-server-{self.port}.log"
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {self.log.read_text()[-800:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.__exit__()
        raise RuntimeError(f"llama-server did not become healthy in {self.start_timeout_s:.0f} s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
