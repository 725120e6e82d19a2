"""Shared helpers for benchmarks: prompts, HF reference runs, timing."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from verispec.audit.suite import load_suite  # noqa: E402


def suite_prompts(per_slice: int, slices: list[str] | None = None):
    by: dict[str, list] = {}
    for p in load_suite("default"):
        if slices is None or p.slice in slices:
            by.setdefault(p.slice, []).append(p)
    return [p for ps in by.values() for p in ps[:per_slice]]


def hf_generate(hf, tok, ids_list: list[list[int]], max_new: int, batch: int, **kw) -> float:
    """Greedy HF generate, fixed length (no EOS); returns generated tokens."""
    n = 0
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    for i in range(0, len(ids_list), batch):
        chunk = ids_list[i:i + batch]
        L = max(map(len, chunk))
        x = torch.full((len(chunk), L), pad, dtype=torch.long)
        m = torch.zeros((len(chunk), L), dtype=torch.long)
        for b, ids in enumerate(chunk):  # left padding, as HF batched generation wants
            x[b, L - len(ids):] = torch.tensor(ids)
            m[b, L - len(ids):] = 1
        with torch.no_grad():
            out = hf.generate(x, attention_mask=m, max_new_tokens=max_new, min_new_tokens=max_new,
                              do_sample=False, pad_token_id=pad, **kw)
        n += (out.shape[1] - L) * len(chunk)
    return n


class Timer:
    def __enter__(self):
        self.t = time.perf_counter()
        return self

    def __exit__(self, *a):
        self.s = time.perf_counter() - self.t
