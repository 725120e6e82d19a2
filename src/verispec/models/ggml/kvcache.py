"""The ggml backend's KV cache: one llama.cpp context with one sequence id per cache row in
a unified KV buffer (runtime.py says why a ragged batch is then one ``llama_decode``), with
models/cache.KVCache's interface, so that the engine, the drafters and the policy see no
difference. ordered.py derives the batch-invariant variant."""

from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..cache import CacheFullError, RowPool, as_int_list
from .lib import note_first_decode

if TYPE_CHECKING:
    from .runtime import GgmlModel

MAX_DECODE_TOKENS = 2048  # tokens per llama_decode call (n_batch); longer feeds are split
# Tokens per graph evaluation (n_ubatch). llama.cpp's CPU flash attention takes a tiled f32
# kernel for 64 or more query tokens and a one-chunk kernel (queries rounded to f16) below;
# with the default of 512 a row's logits then depend on how many tokens share its decode
# (measured on SmolLM2 Q4_1: up to 1.3 in a logit). Below 64 every pass takes the same
# attention kernel (on SmolLM2 a row's logits then no longer depend on the other rows or on
# how its tokens were split into passes: tests/engine/test_ggml_backend.py). Wider passes are split by llama.cpp
# itself; on this CPU a pass of 63 tokens is compute-bound, so the split costs little.
MAX_UBATCH_TOKENS = 63
# Sequence ids per row for draft trees: a tree's branches beyond the first take spare ids,
# each holding the row's history (llama_memory_seq_cp) plus its own path, so that a node's
# query sees its ancestors and no sibling. llama.cpp allows 256 ids in all (LLAMA_MAX_SEQ).
LLAMA_MAX_SEQ = 256
# The most branches (root-to-leaf paths) one row of a tree pass may hold: rows x branches
# ids fit LLAMA_MAX_SEQ for a batch of up to 32 rows. verify/tree.MAX_BRANCHES, the widest
# draft tree, stays within it (tests/unit/test_backends.py)
TREE_MAX_BRANCHES = 8

_STRAY_LENGTH = ("(row, length, positions llama.cpp holds) {}: a length changed outside truncate(), "
                 "alloc(), claim(), free() or restore(); llama.cpp's cells follow a length only through those")


class GgmlCache(RowPool):
    """A llama.cpp context as a KV cache with one length per row (models/cache.KVCache's
    interface; the row bookkeeping is RowPool's). Row r is sequence id r; its valid positions
    are [0, lengths[r]), and llama.cpp holds exactly those (`held`, equal to `lengths` between
    calls).

    The cache owns its decoding: feed() takes a model's flat batch, runs it and advances the
    rows' lengths. Rollback has one path, _release (truncate, alloc, claim, free, restore and a
    failed feed all go through it), which removes the cells past a row's new length with
    llama_memory_seq_rm. A length written directly is not a rollback here: feed() and
    snapshot() refuse a row whose length differs from what llama.cpp holds, rather than
    decode it at positions llama.cpp does not agree with."""

    def __init__(self, model: "GgmlModel", max_rows: int, max_len: int):
        ll = model.lib
        if max_rows < 1 or max_len < 1:
            raise ValueError("max_rows and max_len must be >= 1")
        super().__init__(max_rows, max_len)
        self.held = torch.zeros(max_rows, dtype=torch.long)  # [R] positions llama.cpp holds per row
        self._ll, self.model = ll, model
        p = ll.llama_context_default_params()
        self._n_seq_max = max_rows  # _context_params may add spare ids for draft trees
        self._context_params(p, max_rows, max_len)
        self._threads = torch.get_num_threads()
        p.n_threads = p.n_threads_batch = self._threads
        ctx = model.new_context(p)
        if not ctx:
            raise CacheFullError(f"llama.cpp could not create a context for {max_rows} rows x "
                                 f"{max_len} positions (out of memory?)")
        self.ctx = ctx
        self._finalizer = weakref.finalize(self, ll.llama_free, ctx)
        self.mem = ll.llama_get_memory(ctx)
        self.n_batch = ll.llama_n_batch(ctx)
        # the batch the decode reads: our own buffers, written with numpy, no per-token ctypes
        n = self.n_batch
        self._tok = np.zeros(n, np.int32)
        self._pos = np.zeros(n, np.int32)
        self._nseq = np.ones(n, np.int32)
        self._seq = np.zeros(n, np.int32)
        self._logits = np.zeros(n, np.int8)
        base = self._seq.ctypes.data
        self._seq_ptrs = (ctypes.POINTER(ll.llama_seq_id) * n)(
            *[ctypes.cast(base + 4 * i, ctypes.POINTER(ll.llama_seq_id)) for i in range(n)])
        self._batch = ll.llama_batch()
        self._batch.token = self._tok.ctypes.data_as(ctypes.POINTER(ll.llama_token))
        self._batch.embd = ctypes.POINTER(ctypes.c_float)()
        self._batch.pos = self._pos.ctypes.data_as(ctypes.POINTER(ll.llama_pos))
        self._batch.n_seq_id = self._nseq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self._batch.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(ctypes.POINTER(ll.llama_seq_id)))
        self._batch.logits = self._logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._out_key, self._out_view = None, None  # _outputs' view of llama.cpp's logits
        # a tree feed's tokens may belong to several sequences: their own id buffer
        self._seqm = np.zeros((n, TREE_MAX_BRANCHES), np.int32)
        mbase = self._seqm.ctypes.data
        self._seqm_ptrs = (ctypes.POINTER(ll.llama_seq_id) * n)(
            *[ctypes.cast(mbase + 4 * TREE_MAX_BRANCHES * i, ctypes.POINTER(ll.llama_seq_id)) for i in range(n)])
        self._scratch: dict[int, list[int]] = {}  # row -> the spare ids its live tree's branches 1.. hold
        self._on_branch: dict[int, dict[int, int]] = {}  # row -> slot -> a branch of its live tree holding it
        self._free_seqs = list(range(max_rows, self._n_seq_max))  # spare ids not held by any tree

    def _context_params(self, p, max_rows: int, max_len: int) -> None:
        """llama_context_params for this cache (GgmlOrderedCache changes them)."""
        p.n_ctx = max_rows * max_len  # one unified buffer: rows share its cells
        p.n_batch = min(MAX_DECODE_TOKENS, p.n_ctx)
        p.n_ubatch = min(MAX_UBATCH_TOKENS, p.n_batch)
        self._n_seq_max = min(LLAMA_MAX_SEQ, max_rows * TREE_MAX_BRANCHES)  # the rows, then spare ids
        p.n_seq_max = self._n_seq_max
        p.kv_unified = True  # one graph for a ragged batch (split streams need equal rows)
        p.no_perf = True

    def _spans(self, n: int) -> list[tuple[int, int]]:
        """[lo, hi) of the flat feed per llama_decode call."""
        return [(lo, min(lo + self.n_batch, n)) for lo in range(0, n, self.n_batch)]

    def close(self) -> None:
        """Free the llama.cpp context now (it is freed with the object otherwise)."""
        self._finalizer()

    # -- decoding (the model's forward) ------------------------------------------
    def feed(self, rows: list[int], stop: np.ndarray, tok: np.ndarray, pos: np.ndarray, seq: np.ndarray,
             want: np.ndarray, out: torch.Tensor, at: np.ndarray | None = None, branches=None) -> None:
        """Decode a flat feed and append it to its rows.

        rows [B] the rows fed (each once; a row may feed nothing) and stop [B] each one's
        length after the feed; tok, pos, seq, want [N] per token: the token, its position, its
        row (sequence id) and whether its logits are wanted, row after row, each row's
        positions running on from its length. The wanted tokens' logits, in feed order, are
        written to out [M, V]: to its rows `at` [n_wanted], or to rows 0, 1, ... where at is
        None. On any failure every fed row is rolled back to its length before the feed.

        branches (a draft tree feed): per token, the branches of its row it belongs to, as
        (n_branches [N], branch indices [N, TREE_MAX_BRANCHES]), and per row, slot -> one branch
        holding it (for keep_slots); branch 0 is the row's own sequence, the others take spare
        ids that hold the row's history first."""
        lengths, held = self.lengths.numpy(), self.held.numpy()  # [R] views
        if len(rows) and int(stop.max()) > self.max_len:
            raise CacheFullError(f"write to position {int(stop.max())} exceeds cache length {self.max_len}")
        if not np.array_equal(lengths[rows], held[rows]):
            raise RuntimeError(_STRAY_LENGTH.format(
                [(r, int(lengths[r]), int(held[r])) for r in rows if lengths[r] != held[r]]))
        self._sync_threads()
        V = out.shape[-1]
        at_t = None if at is None else torch.from_numpy(at)
        done = placed = 0  # logit rows written; feed tokens in llama.cpp's memory
        multi = None
        try:
            if branches is not None:
                multi = self._branch_ids(rows, seq, *branches)
            for lo, hi in self._spans(len(tok)):
                kw = {} if multi is None else {"multi": (multi[0][lo:hi], multi[1][lo:hi])}
                n_out = self._decode(tok[lo:hi], pos[lo:hi], seq[lo:hi], want[lo:hi], **kw)
                placed = hi
                if n_out:
                    got = self._outputs(n_out, V)  # [n_out,V] a view of llama.cpp's logits
                    if at_t is None:
                        out[done:done + n_out] = got
                    else:
                        out[at_t[done:done + n_out]] = got
                    done += n_out
        except BaseException:
            np.maximum.at(held, seq[:placed], pos[:placed] + 1)  # what the passes before placed
            self._release(rows, lengths[rows].tolist())
            raise
        lengths[rows] = held[rows] = stop

    def _sync_threads(self) -> None:
        """Follow torch's thread count (the project's one thread knob: --threads, the audit's
        pick_threads), so both backends run on the same cores."""
        n = torch.get_num_threads()
        if n != self._threads:
            self._ll.llama_set_n_threads(self.ctx, n, n)
            self._threads = n

    def _branch_ids(self, rows, seq, n_branch: np.ndarray, branch: np.ndarray, on_branch: dict):
        """Sequence ids for a tree feed: branch 0 of a row is its own id, branch j > 0 a spare
        id that first receives the row's history (so its queries see the cache, and llama.cpp's
        check that coupled sequences agree holds). -> (ids per token [N], ids [N, W])."""
        need: dict[int, int] = {}
        for r, nb in zip(seq.tolist(), n_branch.tolist()):
            need[r] = max(need.get(r, 1), nb)
        self._drop_scratch(list(need))
        if sum(n - 1 for n in need.values()) > len(self._free_seqs):
            raise CacheFullError(f"a tree pass needs {sum(n - 1 for n in need.values())} spare sequence ids; "
                                 f"this cache has {len(self._free_seqs)} (fewer rows or branches)")
        ids_of = {}
        for r, n in need.items():
            spare = [self._free_seqs.pop() for _ in range(n - 1)]
            self._scratch[r] = spare
            for sid in spare:
                self._ll.llama_memory_seq_cp(self.mem, r, sid, -1, -1)
            ids_of[r] = np.asarray([r, *spare], np.int32)
            self._on_branch[r] = on_branch.get(r, {})
        ids = np.zeros((len(seq), TREE_MAX_BRANCHES), np.int32)
        for i, (r, nb) in enumerate(zip(seq.tolist(), n_branch.tolist())):
            ids[i, :nb] = ids_of[r][branch[i, :nb]]
        return n_branch.astype(np.int32), ids

    def _drop_scratch(self, rows) -> None:
        """Remove the spare sequences of these rows' trees from llama.cpp and free their ids."""
        for r in rows:
            self._on_branch.pop(int(r), None)
            for sid in self._scratch.pop(int(r), ()):
                self._ll.llama_memory_seq_rm(self.mem, sid, -1, -1)
                self._free_seqs.append(sid)

    def keep_slots(self, rows, starts, slots) -> None:
        """After a tree pass (models/cache.KVCache.keep_slots): row r's accepted path is slots
        (slot 0 the root); positions in llama.cpp are depths already, so keeping the path is a
        change of sequence: where the path ends off the row's own branch, the row's sequence
        drops its tree positions and takes the path's positions from a branch that holds it.
        The spare sequences are removed either way; truncate() then trims to the committed
        length."""
        for r, st, sl in zip(as_int_list(rows), as_int_list(starts), slots):
            spare = self._scratch.get(r)
            if spare is None:
                continue
            on = self._on_branch.get(r, {}).get(sl[-1], 0)  # a branch that holds the path's last slot
            if on:
                ll = self._ll
                if not ll.llama_memory_seq_rm(self.mem, r, st + 1, -1):
                    raise RuntimeError(f"llama.cpp could not remove row {r}'s tree positions")
                ll.llama_memory_seq_cp(self.mem, spare[on - 1], r, st + 1, st + len(sl))
            self._drop_scratch([r])

    def _decode(self, tok, pos, seq, want, pad_seq: int | None = None, multi=None) -> int:
        """One llama_decode of a piece of the feed (N tokens, at most n_batch with the padding);
        -> number of logit rows it produced. pad_seq: a sequence id given one more, throwaway
        token (position 0, no logits) in the same pass (GgmlOrderedCache pads one-token passes).
        multi: (n_seq_id [N], seq ids [N, W]) for tokens in several sequences (a tree feed)."""
        N = len(tok)
        note_first_decode()
        self._tok[:N], self._pos[:N], self._seq[:N] = tok, pos, seq
        self._logits[:N] = want
        n_out = int(np.count_nonzero(want))  # counted before the decode, while caches are warm
        if pad_seq is not None:
            self._tok[N] = self._pos[N] = self._logits[N] = 0
            self._seq[N] = pad_seq
        self._batch.n_tokens = N + (pad_seq is not None)
        if multi is not None:
            self._nseq[:N], self._seqm[:N] = multi
            self._batch.seq_id = ctypes.cast(self._seqm_ptrs, ctypes.POINTER(ctypes.POINTER(self._ll.llama_seq_id)))
        try:
            rc = self._ll.llama_decode(self.ctx, self._batch)
        finally:
            if multi is not None:
                self._nseq[:N] = 1
                self._batch.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(ctypes.POINTER(self._ll.llama_seq_id)))
        if rc != 0:
            # llama.cpp can keep a prefix of a failed pass (the micro-batches before the failing
            # one): held bounds it from above, and feed's rollback removes it
            np.maximum.at(self.held.numpy(), seq, pos + 1)
            if rc == 1:
                raise CacheFullError(f"llama.cpp found no KV slot for {N} tokens "
                                     f"({self.max_rows} rows x {self.max_len} positions)")
            raise RuntimeError(f"llama_decode failed (return code {rc}) for a batch of {N} tokens")
        return n_out

    def _outputs(self, n_out: int, V: int) -> torch.Tensor:
        """The last decode's logits, [n_out, V]: a view of llama.cpp's output buffer (valid until
        the next decode). The view is made again only when the buffer moves or n_out changes."""
        ptr = self._ll.llama_get_logits(self.ctx)
        key = (ctypes.addressof(ptr.contents), n_out)
        if key != self._out_key:
            self._out_view = torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(n_out, V)))
            self._out_key = key
        return self._out_view

    # -- rows (the bookkeeping is models/cache.RowPool's) ---------------------------
    def _release(self, rows, new_lengths) -> None:
        """The one rollback: llama_memory_seq_rm of every position from the new length on, for
        the rows that hold any."""
        held = self.held.numpy()
        if self._scratch:  # a tree pass that did not reach keep_slots (undone, failed)
            self._drop_scratch([r for r in rows if int(r) in self._scratch])
        for r, n in zip(rows, new_lengths):
            r, n = int(r), int(n)
            if held[r] <= n:
                continue
            if not self._ll.llama_memory_seq_rm(self.mem, r, n, -1):
                raise RuntimeError(f"llama.cpp could not remove positions >= {n} of row {r}")
            held[r] = n

    # -- snapshots (models/prefill.py) ------------------------------------------------
    def snapshot(self, row: int):
        """The row's keys and values as llama.cpp's sequence state (bytes)."""
        ll = self._ll
        if self.lengths[row] != self.held[row]:
            raise RuntimeError(_STRAY_LENGTH.format([(row, int(self.lengths[row]), int(self.held[row]))]))
        size = ll.llama_state_seq_get_size(self.ctx, row)
        buf = (ctypes.c_uint8 * size)()
        if ll.llama_state_seq_get_data(self.ctx, buf, size, row) != size:
            raise RuntimeError(f"llama.cpp could not copy the state of row {row}")
        return (int(self.lengths[row]), bytes(buf))

    def restore(self, row: int, snap) -> None:
        """Fill row `row` (in use) with a snapshot taken by snapshot() on a cache of this model."""
        T, data = snap
        if T > self.max_len:
            raise CacheFullError(f"a snapshot of {T} positions does not fit rows of {self.max_len}")
        ll = self._ll
        self._release([row], [0])
        self.lengths[row] = 0
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if ll.llama_state_seq_set_data(self.ctx, buf, len(data), row) == 0:
            self.held[row] = T  # a partial restore, bounded by the snapshot
            self._release([row], [0])
            raise CacheFullError(f"llama.cpp could not restore a snapshot into row {row}")
        self.lengths[row] = self.held[row] = T
