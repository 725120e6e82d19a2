"""Where verispec keeps what it builds and converts once per machine (converted weights,
compiled kernels, the llama.cpp build, measured cost models, vLLM's environment for the
tests): one rule, which scripts/*.sh repeat in shell."""

from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE = "VERISPEC_CACHE"


def cache_dir() -> Path:
    """``$VERISPEC_CACHE``, else ``$XDG_CACHE_HOME/verispec``, else ``~/.cache/verispec`` (not created)."""
    explicit = os.environ.get(ENV_CACHE)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "verispec"
    return Path.home() / ".cache" / "verispec"
