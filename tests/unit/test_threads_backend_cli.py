"""`--threads` and `--backend` on generate and serve, as the audit has them: a count, or auto
(1 or all cores, whichever decodes faster now, timed on the loaded model); the backend is
passed to the loader (serve had no --backend before)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.tiny import native_from_hf, tiny_hf
from verispec.cli import build_parser, set_threads


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("cmd", [["generate", "--model", "m", "--prompt", "x"], ["serve", "--target", "m"]])
def test_threads_and_backend_arguments(cmd):
    p = build_parser()
    args = p.parse_args(cmd)
    assert args.threads == "auto" and args.backend == "auto"
    args = p.parse_args([*cmd, "--threads", "3", "--backend", "ggml"])
    assert args.threads == 3 and args.backend == "ggml"
    for bad in (["--threads", "0"], ["--threads", "many"], ["--backend", "cuda"]):
        with pytest.raises(SystemExit):
            p.parse_args([*cmd, *bad])


def test_set_threads_count_and_auto(capsys):
    set_threads(3)
    assert torch.get_num_threads() == 3
    set_threads("auto")  # no model yet: nothing to time, nothing changes
    assert torch.get_num_threads() == 3
    set_threads("auto", native_from_hf(tiny_hf("llama", seed=1, vocab=32)))
    assert torch.get_num_threads() in {1, os.cpu_count() or 1}
    err = capsys.readouterr().err
    assert err.startswith(f"threads: {torch.get_num_threads()} (decode tok/s by thread count: 1: ")
    set_threads("auto", native_from_hf(tiny_hf("llama", seed=1, vocab=32)), quiet=True)
    assert capsys.readouterr().err == ""


class _Loaded(Exception):
    pass


def test_serve_passes_backend_and_threads_to_the_loader(monkeypatch):
    """build_state loads with the chosen backend, and sets a thread count before loading."""
    import verispec.models as models
    from verispec.cli.serve import build_state
    seen = {}

    def fake_load(spec, **kw):
        seen.update(spec=spec, threads=torch.get_num_threads(), **kw)
        raise _Loaded

    monkeypatch.setattr(models, "load_model", fake_load)
    args = build_parser().parse_args(["serve", "--target", "x.gguf", "--backend", "ggml", "--threads", "2"])
    with pytest.raises(_Loaded):
        build_state(args)
    assert seen == {"spec": "x.gguf", "backend": "ggml", "threads": 2}
