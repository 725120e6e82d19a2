"""A preallocated key/value cache with one length per row.

Rows are slots of a fixed-size pool. A row's valid keys/values are positions
[0, lengths[row]); anything written past that is invisible, because attention
masks derive from lengths. Rollback is therefore a length change, never a copy.
"""

from __future__ import annotations

import torch


class CacheFullError(RuntimeError):
    """No free row, or a write past a row's capacity."""


class KVCache:
    def __init__(self, num_layers: int, max_rows: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32):
        # one scratch slot past max_len takes the writes of padding tokens in ragged batches
        shape = (num_layers, max_rows, num_kv_heads, max_len + 1, head_dim)  # [L, R, Hkv, S, D]
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.lengths = torch.zeros(max_rows, dtype=torch.long)  # [R], lives on the CPU
        self.in_use = torch.zeros(max_rows, dtype=torch.bool)  # [R]
        self.max_rows = max_rows
        self.max_len = max_len  # usable positions per row
        self.scratch = max_len  # index of the padding slot

    # -- row lifecycle -------------------------------------------------------
    def alloc(self, n: int = 1) -> list[int]:
        free = (~self.in_use).nonzero().flatten().tolist()  # sync: small CPU tensor
        if len(free) < n:
            raise CacheFullError(f"KV cache has {len(free)} free rows, {n} requested")
        rows = free[:n]
        self.in_use[rows] = True
        self.lengths[rows] = 0
        return rows

    def free(self, rows) -> None:
        self.in_use[rows] = False
        self.lengths[rows] = 0

    @property
    def rows_in_use(self) -> int:
        return int(self.in_use.sum())

    # -- lengths -------------------------------------------------------------
    def truncate(self, rows, new_lengths) -> None:
        """Roll rows back to new_lengths (<= current). A length change, nothing is copied."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        new_lengths = torch.as_tensor(new_lengths, dtype=torch.long).expand(rows.shape)
        if bool((new_lengths > self.lengths[rows]).any()) or bool((new_lengths < 0).any()):
            raise ValueError("truncate can only shorten a row")
        self.lengths[rows] = new_lengths
