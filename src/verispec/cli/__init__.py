"""The `verispec` command: generate, models, audit and serve (a module each; what they
share, each defined once, in common.py)."""

from __future__ import annotations

import argparse
import sys

from .common import UsageError, pick_threads, set_threads

__all__ = ["UsageError", "build_parser", "main", "pick_threads", "set_threads"]


def build_parser() -> argparse.ArgumentParser:
    from .audit import add_audit_parser
    from .generate import add_generate_parser
    from .models import add_models_parser
    from .serve import add_serve_parser

    p = argparse.ArgumentParser(prog="verispec", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    add_generate_parser(sub)
    add_models_parser(sub)
    add_audit_parser(sub)
    add_serve_parser(sub)
    return p


def main(argv=None) -> int:
    from ..omp import spin_for_ggml, wants_ggml
    if wants_ggml(sys.argv[1:] if argv is None else list(argv)):
        spin_for_ggml()  # before build_parser() loads torch (omp.py says why)
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # what was given, for checks of mode (cli/audit.py)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # user-facing errors from lower layers: a message, not a traceback
        from ..drafters.draft_model import TokenizerMismatchError
        from ..models.attention import NotBatchInvariantError
        from ..models.config import UnsupportedModelError
        from ..models.loading import ModelNotFoundError
        if isinstance(e, (UnsupportedModelError, ModelNotFoundError, TokenizerMismatchError,
                          NotBatchInvariantError, FileNotFoundError)):
            print(f"verispec: error: {e}", file=sys.stderr)
            return 2
        raise
