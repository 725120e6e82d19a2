"""A preallocated key/value cache with one length per row.

Rows are slots of a fixed-size pool. A row's valid keys/values are positions
[0, lengths[row]); anything written past that is invisible, because attention
masks derive from lengths. Rollback is therefore a length change, never a copy.

The interface every backend's cache keeps (the engine, drafters, policy and prompt cache
use nothing else): alloc, free, truncate, lengths [R] (CPU), in_use [R], max_rows,
max_len, rows_in_use, snapshot(row) -> opaque, restore(row, snapshot).
"""

from __future__ import annotations

import torch


class CacheFullError(RuntimeError):
    """No free row, or a write past a row's capacity."""


class RowPool:
    """The row bookkeeping every backend's cache shares: max_rows slots, one length per row
    (lengths [R] and in_use [R] live on the CPU). A backend that stores its keys and values
    elsewhere (models/ggml/) overrides _release(rows) to drop what it holds past a row's
    new length."""

    def __init__(self, max_rows: int, max_len: int):
        self.lengths = torch.zeros(max_rows, dtype=torch.long)  # [R], lives on the CPU
        self.in_use = torch.zeros(max_rows, dtype=torch.bool)  # [R]
        self.max_rows = max_rows
        self.max_len = max_len  # usable positions per row

    def _release(self, rows: list[int], new_lengths: list[int]) -> None:
        """Backend hook: rows now hold only positions [0, new_lengths[i])."""

    # -- row lifecycle -------------------------------------------------------
    def alloc(self, n: int = 1) -> list[int]:
        free = (~self.in_use).nonzero().flatten().tolist()  # sync: small CPU tensor
        if len(free) < n:
            raise CacheFullError(f"KV cache has {len(free)} free rows, {n} requested")
        rows = free[:n]
        self._release(rows, [0] * n)
        self.in_use[rows] = True
        self.lengths[rows] = 0
        return rows

    def free(self, rows) -> None:
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1).tolist()
        self._release(rows, [0] * len(rows))
        self.in_use[rows] = False
        self.lengths[rows] = 0

    @property
    def rows_in_use(self) -> int:
        return int(self.in_use.sum())

    # -- lengths -------------------------------------------------------------
    def truncate(self, rows, new_lengths) -> None:
        """Roll rows back to new_lengths (<= current). A length change (and the backend's
        _release); nothing is copied."""
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        new_lengths = torch.as_tensor(new_lengths, dtype=torch.long).expand(rows.shape)
        if bool((new_lengths > self.lengths[rows]).any()) or bool((new_lengths < 0).any()):
            raise ValueError("truncate can only shorten a row")
        self._release(rows.tolist(), new_lengths.tolist())
        self.lengths[rows] = new_lengths


class KVCache(RowPool):
    def __init__(self, num_layers: int, max_rows: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32):
        super().__init__(max_rows, max_len)
        # one scratch slot past max_len takes the writes of padding tokens in ragged batches
        shape = (num_layers, max_rows, num_kv_heads, max_len + 1, head_dim)  # [L, R, Hkv, S, D]
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.scratch = max_len  # index of the padding slot

    # -- snapshots (engine/prompt_cache.py) --------------------------------------
    def snapshot(self, row: int):
        """A copy of the row's keys and values ([L, Hkv, lengths[row], D] each)."""
        T = int(self.lengths[row])
        return (T, self.k[:, row, :, :T].clone(), self.v[:, row, :, :T].clone())

    def restore(self, row: int, snap) -> None:
        """Fill row `row` with a snapshot taken by snapshot() on a cache of the same model."""
        T, k, v = snap
        if T > self.max_len:
            raise CacheFullError(f"a snapshot of {T} positions does not fit rows of {self.max_len}")
        self.k[:, row, :, :T] = k
        self.v[:, row, :, :T] = v
        self.lengths[row] = T
