"""The batch-invariant ggml cache: every row's KV cells in position order, no pass of one token.

What makes a row's logits on llama.cpp's CPU backend depend on the rest of the batch, and
what this cache (with GgmlModel(batch_invariant=True)) does about each:

- Weight repacking (the CPU "extra" buffer types): Q4_0/Q4_K/Q8_0/IQ4_NL matrices are
  repacked and blocks of 4 tokens take another kernel than the remainder. Off: the model
  is loaded with use_extra_bufts = false (llama.cpp's --no-repack).
- The tiled K-quant kernel (Q2_K..Q6_K weights that are not repacked, 8 or more tokens per
  pass). Off: GGML_CPU_TILED_MM=0, which ggml reads once per process (lib.switch_off_tiled_matmul).
- Flash attention (forced on) takes a tiled kernel for 64 or more query tokens: a pass holds
  at most 63 tokens (kvcache.MAX_UBATCH_TOKENS).
- Flash attention splits the KV range across threads for a pass of exactly one token once
  the context reaches 512 cells, and merges the parts in another order (with one thread
  the single part merges back bitwise): at more than one thread and past 256 used cells no
  llama_decode here holds one token. A one-token forward then gets a second, throwaway
  token in a sequence of its own (DUMMY), removed again right after; a longer feed is
  split so that no piece is a single token. (llamafile's tinyBLAS also serves only passes of 2 or more tokens; on the
  files measured it agrees with the one-token kernel bitwise, see benchmarks/RESULTS.md.)
- Attention over the unified KV buffer sums in cell storage order, skipping other rows'
  cells exactly (masked cells are not visited), so a row's attention is what a fresh
  decode computes exactly when its own cells lie in position order. llama.cpp places a
  pass's tokens in the first free cells from its head, so a cell freed below the head (a
  row leaving, or rolled back, beside rows decoded after it) would take a later token of
  another row before that row's earlier ones. This cache never frees a cell below the last
  used one: such cells are handed to the sequence GARBAGE (llama_memory_seq_cp, then
  seq_rm of the row), which no token attends to; cells at the top of the used range are
  freed for real (a batch-1 rollback always is). While no cell below the head is free,
  llama.cpp places a pass at head, head + 1, ... in feed order: the cache mirrors that
  placement (which cell holds which row and position) and does not ask llama.cpp for it.
  When the garbage grows past half the live cells (or a feed would not fit), it compacts:
  every row's cells are copied out (llama_state_seq_get_data), the buffer is cleared and
  the rows are copied back one after another, each contiguous, in position order.

A row's logits then equal a fresh single-row one-pass decode bitwise, whatever the batch,
the pass widths, the rollbacks and the thread count (tests/engine/test_ggml_backend.py).
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..cache import CacheFullError
from .kvcache import MAX_UBATCH_TOKENS, GgmlCache

EMPTY, GARBAGE_CELL = -1, -2  # _owner values besides a row index


class GgmlOrderedCache(GgmlCache):
    """GgmlCache with its cells kept in position order per row (see the module docstring).
    Two sequence ids past the rows: GARBAGE holds dead cells until the next compaction,
    DUMMY the throwaway token that pads a one-token pass."""

    def __init__(self, model, max_rows: int, max_len: int):
        rows_x_len = max_rows * max_len
        # room for garbage between compactions; +1: the dummy token of a one-token pass
        self._want_cells = rows_x_len + max(512, rows_x_len // 4) + 1
        super().__init__(model, max_rows, max_len)
        self.garbage_seq, self.dummy_seq = max_rows, max_rows + 1
        self.capacity = self._ll.llama_n_ctx(self.ctx)
        self._owner = np.full(self.capacity, EMPTY, np.int32)  # [C] row (or EMPTY/GARBAGE_CELL) per cell
        self._cell = np.full((max_rows, max_len), EMPTY, np.int64)  # [R, max_len] cell per position
        self._head = 0  # cells [0, head) are used (live or garbage); all above are free
        self._garbage = 0
        self._dirty = False  # llama.cpp's layout is no longer known (a failed decode): compact first
        self.compactions = 0

    def _context_params(self, p, max_rows: int, max_len: int) -> None:
        super()._context_params(p, max_rows, max_len)
        p.n_ctx = self._want_cells
        p.n_batch = p.n_ubatch = MAX_UBATCH_TOKENS
        p.n_seq_max = max_rows + 2  # the rows, GARBAGE, DUMMY
        p.flash_attn_type = self._ll.LLAMA_FLASH_ATTN_TYPE_ENABLED  # its one-chunk kernel (docstring)

    # -- feeding ------------------------------------------------------------------
    def _spans(self, n: int) -> list[tuple[int, int]]:
        """Pieces of at most MAX_UBATCH_TOKENS tokens, none of exactly one unless n == 1
        (which _decode pads)."""
        w = MAX_UBATCH_TOKENS
        cuts = list(range(0, n, w)) + [n]
        if len(cuts) > 2 and cuts[-1] - cuts[-2] == 1:
            cuts[-2] -= 1  # ... 63, 1 -> ... 62, 2
        return list(zip(cuts[:-1], cuts[1:]))

    def _decode(self, tok, pos, seq, want, pad_seq=None) -> int:
        N = len(tok)
        # the split-KV path: one token, >= 512 cells (n_kv is the used range padded to 256), and
        # more than one thread (on one, its single part merges to the one-chunk result bitwise)
        pad = N == 1 and self._threads > 1 and self._head + N > 256
        if self._dirty or self._head + N + pad > self.capacity or self._garbage > max(256, self.live_cells // 2):
            self.compact()
        if self._head + N + pad > self.capacity:
            raise CacheFullError(f"no room for {N} tokens in {self.capacity} cells after compaction")
        try:  # with a second token in DUMMY: flash attention's split-KV path takes one-token passes only
            n_out = super()._decode(tok, pos, seq, want, self.dummy_seq if pad else None)
        except BaseException:
            self._dirty = True  # what llama.cpp kept of the pass is unknown: compact before the next
            raise
        cells = self._head + np.arange(N)
        self._owner[cells] = seq
        self._cell[seq, pos] = cells
        self._head += N
        if pad:  # the dummy sits in the topmost cell: freeing it leaves nothing free below the head
            self._ll.llama_memory_seq_rm(self.mem, self.dummy_seq, -1, -1)
        return n_out

    @property
    def live_cells(self) -> int:
        return self._head - self._garbage

    # -- rollback and free ------------------------------------------------------------
    def _release(self, rows, new_lengths) -> None:
        if self._dirty:  # layout unknown: plain removal; the next decode compacts
            return super()._release(rows, new_lengths)
        ll, mem = self._ll, self.mem
        todo = [(int(r), int(n)) for r, n in zip(rows, new_lengths) if int(self.held[int(r)]) > int(n)]
        # the row holding the topmost cell first: freeing it can bring the next one to the top
        todo.sort(key=lambda rn: -int(self._cell[rn[0], int(self.held[rn[0]]) - 1]))
        for r, n in todo:
            h = int(self.held[r])
            cells = self._cell[r, n:h]  # increasing: the row's cells are in position order
            top = 0  # how many of them form the top of the used range, [head - top, head)
            while top < len(cells) and cells[len(cells) - 1 - top] == self._head - 1 - top:
                top += 1
            split = h - top  # positions [n, split) become garbage, [split, h) are freed
            if split > n:
                ll.llama_memory_seq_cp(mem, r, self.garbage_seq, n, split)
                if not ll.llama_memory_seq_rm(mem, r, n, split):
                    raise RuntimeError(f"llama.cpp could not hand positions [{n}, {split}) of row {r} to garbage")
                self._owner[cells[:split - n]] = GARBAGE_CELL
                self._garbage += split - n
            if top:
                if not ll.llama_memory_seq_rm(mem, r, split, -1):
                    raise RuntimeError(f"llama.cpp could not remove positions >= {split} of row {r}")
                self._owner[cells[split - n:]] = EMPTY
                self._head -= top
            self._cell[r, n:h] = EMPTY
            self.held[r] = n

    # -- compaction ---------------------------------------------------------------------
    def compact(self) -> None:
        """Copy every row out, clear the buffer, copy the rows back contiguously (row after
        row, each in position order): no garbage left, nothing free below the head."""
        ll = self._ll
        saved = []
        for r in range(self.max_rows):
            if ll.llama_memory_seq_pos_max(self.mem, r) < 0:
                continue
            size = ll.llama_state_seq_get_size(self.ctx, r)
            buf = (ctypes.c_uint8 * size)()
            if ll.llama_state_seq_get_data(self.ctx, buf, size, r) != size:
                raise RuntimeError(f"llama.cpp could not copy the state of row {r}")
            saved.append((r, buf))
        ll.llama_memory_clear(self.mem, False)
        self._owner[:] = EMPTY
        self._cell[:] = EMPTY
        self._head = self._garbage = 0
        self.held.zero_()
        self._dirty = False
        for r, buf in saved:
            self._place_restored(r, buf)
        self.compactions += 1

    def _place_restored(self, r: int, buf) -> None:
        """llama_state_seq_set_data of row r: its cells land at head, head + 1, ... (nothing is
        free below the head), in the order they were saved."""
        ll = self._ll
        if ll.llama_state_seq_set_data(self.ctx, buf, len(buf), r) == 0:
            self._dirty = True
            raise CacheFullError(f"llama.cpp could not restore row {r}")
        T = ll.llama_memory_seq_pos_max(self.mem, r) + 1
        if ll.llama_memory_seq_pos_min(self.mem, r) != 0 and T > 0:
            self._dirty = True
            raise RuntimeError(f"row {r} came back without its first positions")
        cells = self._head + np.arange(T)
        self._owner[cells] = r
        self._cell[r, :T] = cells
        self._head += T
        self.held[r] = T

    # -- snapshots -------------------------------------------------------------------------
    def restore(self, row: int, snap) -> None:
        T, data = snap
        if T > self.max_len:
            raise CacheFullError(f"a snapshot of {T} positions does not fit rows of {self.max_len}")
        self._release([row], [0])
        self.lengths[row] = 0
        if self._dirty or self._head + T > self.capacity:
            self.compact()
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        try:
            self._place_restored(row, buf)
        except (CacheFullError, RuntimeError):
            self.held[row] = T  # a partial restore, bounded by the snapshot; the cache is dirty: plain removal
            self._release([row], [0])
            raise
        self.lengths[row] = T
