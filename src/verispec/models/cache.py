"""A preallocated key/value cache with one length per row.

Rows are slots of a fixed-size pool. A row's valid keys/values are positions
[0, lengths[row]); anything written past that is invisible, because attention
masks derive from lengths. Rollback is therefore a length change, never a copy.

The interface every backend's cache keeps (the engine, drafters, policy and prompt cache
use nothing else): alloc, free, truncate, lengths [R] (CPU), in_use [R], max_rows,
max_len, rows_in_use, snapshot(row) -> opaque, restore(row, snapshot); and, on a backend
whose model verifies draft trees (supports_trees), keep_slots(rows, starts, slots).
"""

from __future__ import annotations

import torch


def as_int_list(x) -> list[int]:
    """Row ids or lengths as a list of ints: from an int, a list, a tuple or a tensor."""
    if isinstance(x, (list, tuple)):
        return [int(v) for v in x]
    return [int(v) for v in torch.as_tensor(x).reshape(-1).tolist()]


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

    def claim(self, rows) -> None:
        """Take these rows, empty, by number (a draft model's cache mirrors the target's rows):
        alloc's effect on rows the caller chose, through the same release."""
        rows = as_int_list(rows)
        self._release(rows, [0] * len(rows))
        self.in_use[rows] = True
        self.lengths[rows] = 0

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
        rows, new = as_int_list(rows), as_int_list(new_lengths)
        if len(new) == 1:  # one length for every row
            new = new * len(rows)
        if len(new) != len(rows):
            raise ValueError(f"truncate needs one length per row ({len(rows)} rows, {len(new)} lengths)")
        lengths = self.lengths.numpy()  # [R] a view; plain ints below: this runs every engine step
        if any(n < 0 or n > lengths[r] for r, n in zip(rows, new)):
            raise ValueError("truncate can only shorten a row")
        self._release(rows, new)
        lengths[rows] = new


class KVCache(RowPool):
    def __init__(self, num_layers: int, max_rows: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32):
        super().__init__(max_rows, max_len)
        # one scratch slot past max_len takes the writes of padding tokens in ragged batches
        shape = (num_layers, max_rows, num_kv_heads, max_len + 1, head_dim)  # [L, R, Hkv, S, D]
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.scratch = max_len  # index of the padding slot

    # -- trees (forward's tree=, the CausalLM protocol) ------------------------------
    def keep_slots(self, rows, starts, slots) -> None:
        """After a tree verify pass: row rows[i]'s accepted path is slots[i] (slot 0 the root,
        then one slot per accepted node, each written at starts[i] + slot); move those keys and
        values to starts[i], starts[i] + 1, ..., where a linear sequence keeps them. The caller
        truncates the row to its committed length afterwards."""
        for row, st, sl in zip(as_int_list(rows), as_int_list(starts), slots):
            if all(s == i for i, s in enumerate(sl)):
                continue  # the path is already in place (a chain, or the first branch)
            src = torch.tensor([st + s for s in sl])
            dst = torch.arange(st, st + len(sl))
            # the right-hand side is gathered before it is written: overlapping moves are safe
            self.k[:, row, :, dst] = self.k[:, row, :, src]
            self.v[:, row, :, dst] = self.v[:, row, :, src]

    # -- snapshots (models/prefill.py) --------------------------------------------
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
