"""`verispec serve` in a subprocess for the tests, as tests/vllm_server.py and
tests/llama_server.py start their servers:

    with VerispecServer("smollm2-135m", "--draft", "lookup") as url:   # http://127.0.0.1:<port>
        ...

The real CLI on 127.0.0.1 and a free port, this checkout's sources first on PYTHONPATH, its
output in a log file whose tail a failed start reports; SIGTERM on exit (uvicorn drains and
stops), SIGKILL after 30 s."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def VerispecServer(target: str, *args: str, start_timeout_s: float = 180):  # noqa: N802 - used as a class
    """args: any further `verispec serve` options (--draft, --k, --threads, ...)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    log = tempfile.NamedTemporaryFile("w+", prefix=f"verispec-serve-{port}-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", "--target", target, "--port", str(port),
                             "--log-level", "warning", *args], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def tail() -> str:
        return Path(log.name).read_text(errors="replace")[-1500:]

    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"verispec serve exited with {proc.returncode}: {tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"verispec serve did not start in {start_timeout_s:.0f} s: {tail()}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)
