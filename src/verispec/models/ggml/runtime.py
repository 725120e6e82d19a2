"""ggml backend: llama.cpp's CPU kernels on a GGUF file as shipped (quantized, no conversion).

GgmlModel implements the CausalLM protocol (models/__init__.py) over llama-cpp-python's
low-level bindings. GgmlCache is its KV cache: one llama.cpp context with one sequence id
per cache row in a unified KV buffer, so that a ragged batch (every row with its own
positions and its own number of new tokens) is one ``llama_decode``, one graph over the
weights. The cache keeps the same interface as models/cache.KVCache (alloc, free, truncate,
lengths, in_use, snapshot, restore): the engine, the drafters and the policy see no
difference. GgmlModel.forward lays a batch out as one flat feed (token, position, row, whether
its logits are wanted) and hands it to the cache, which decodes it and advances the rows;
rollback is the cache's truncate, ``llama_memory_seq_rm`` from the row's new length.

Numerics, by default: not batch-invariant. The CPU kernels a row goes through can depend on
how many tokens share its decode (on Q4_K weights llama.cpp repacks the matrices and
multiplies blocks of 4 tokens with one kernel and the remainder with another; Q6_K weights
take a tiled kernel from 8 tokens on), and attention sums over the unified KV buffer in
cell order, which rows leaving and rollbacks reshuffle; a token's logits move by a small
amount with what shares its pass. tests/engine/test_ggml_backend.py measures this noise
against the backend's own single-row decoding; benchmarks/RESULTS.md reports it.
GgmlModel(batch_invariant=True) turns every one of these off (ordered.py): its rows are
bitwise a fresh single-row decode, whatever the batch.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from pathlib import Path

import numpy as np
import torch

from ..cache import as_int_list
from ..config import ModelConfig, UnsupportedModelError
from .kvcache import GgmlCache
from .lib import LLAMA_CPP_PYTHON_VERSION, bindings
from .ordered import GgmlOrderedCache

log = logging.getLogger("verispec")


class UnsupportedFeatureError(UnsupportedModelError):
    """The backend cannot do what was asked (e.g. layer-skip on ggml)."""


LAYER_SKIP_UNSUPPORTED = (
    "layer-skip drafting needs the target's first N layers followed by its final norm and LM "
    "head; llama.cpp's API runs the whole model graph and has no such exit, so the ggml backend "
    "cannot self-draft. Use --draft lookup or a draft model, or --backend native")

# weight types that llama.cpp's tiled K-quant kernel takes (ggml-cpu/tiled/tiled.cpp)
_TILED_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"}


def _require_untiled(path: Path) -> None:
    """Batch-invariant numerics need llama.cpp's tiled K-quant kernel off (8 or more tokens per
    pass take it, fewer take the one-token kernel); ggml fixes that switch at the process's
    first decode. Refused where it is on and the file has weights it would take."""
    from ..attention import NotBatchInvariantError
    from .lib import TILED_MM_ENV, switch_off_tiled_matmul

    if switch_off_tiled_matmul():
        return
    import gguf

    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    if kinds & _TILED_TYPES:
        raise NotBatchInvariantError(
            f"{path.name} has {', '.join(sorted(kinds & _TILED_TYPES))} weights, which llama.cpp's tiled "
            f"kernel takes in passes of 8 or more tokens; ggml fixed {TILED_MM_ENV} at this process's "
            f"first decode, before this batch-invariant model: start with {TILED_MM_ENV}=0 in the "
            "environment, or load the batch-invariant model first")


def amx_compiled(ll) -> bool:
    """Whether the loaded llama.cpp was built with its AMX buffer type (a native build on a CPU
    with AMX-INT8: Sapphire Rapids and later). That buffer type repacks Q4_K weights and, in the
    pinned release, crashes the process in ggml_backend_amx_mul_mat on the first pass of more
    than one token (ggml-org/llama.cpp#20824; measured here: llama-server at start-up and
    llama-bench -p 8 end in SIGSEGV). scripts/build_llama_cpp.sh builds without it; a library
    that pip built may have it."""
    return b"AMX_INT8 = 1" in (ll.llama_print_system_info() or b"")


def _int_from_meta(meta: dict, key: str, default=None):
    v = meta.get(key)
    return default if v is None else int(float(v))


class GgmlModel:
    """A GGUF model in llama.cpp. See the module docstring and the CausalLM protocol."""

    runtime = "ggml"
    partial_layers = False  # forward(num_layers < L) is impossible: no layer-skip
    # by default logits move with pass width and KV cell order (see the module docstring): the
    # audit then takes its near-tie margin from this backend's measured noise
    # (audit/equivalence.tie_margin_for); set per model in __init__
    noisy_numerics = True
    backend_fault = None  # a backend as loaded: its forward is llama.cpp's own

    def __init__(self, path: str | Path, sha256: str, *, batch_invariant: bool = False):
        ll = bindings()
        self._ll = ll
        self.path = Path(path)
        self.sha256 = sha256
        # batch_invariant: a row's logits bitwise independent of the batch, the pass widths and
        # rollbacks (ordered.py says how); the audit then keeps the fp32 tie margin
        self.batch_invariant = batch_invariant
        self.noisy_numerics = not batch_invariant
        if batch_invariant:
            _require_untiled(self.path)
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 0
        # no repacked weights (llama.cpp's --no-repack) in the batch-invariant mode, and none
        # where the extra buffer types include the AMX one, which crashes (amx_compiled)
        params.use_extra_bufts = not batch_invariant
        if params.use_extra_bufts and amx_compiled(ll):
            params.use_extra_bufts = False
            log.warning("llama.cpp was built with its AMX buffer type, which crashes on passes of more "
                        "than one token (ggml-org/llama.cpp#20824): loading %s without repacked weights "
                        "(slower). bash scripts/build_llama_cpp.sh builds llama.cpp without AMX.",
                        self.path.name)
        model = ll.llama_model_load_from_file(str(self.path).encode(), params)
        if not model:
            raise UnsupportedModelError(f"llama.cpp could not load {self.path} (not a GGUF model it "
                                        "supports, or a damaged file)")
        self._model = model
        weakref.finalize(self, ll.llama_model_free, model)
        self._vocab = ll.llama_model_get_vocab(model)
        self.config = self._read_config()

    def _meta(self) -> dict[str, str]:
        ll, out = self._ll, {}
        buf = ctypes.create_string_buffer(4096)
        for i in range(ll.llama_model_meta_count(self._model)):
            if ll.llama_model_meta_key_by_index(self._model, i, buf, len(buf)) < 0:
                continue
            key = buf.value.decode("utf-8", "replace")
            n = ll.llama_model_meta_val_str_by_index(self._model, i, buf, len(buf))
            if n >= 0:
                out[key] = buf.value.decode("utf-8", "replace")
        return out

    def _read_config(self) -> ModelConfig:
        ll, m = self._ll, self._meta()
        arch = m.get("general.architecture", "unknown")
        L = ll.llama_model_n_layer(self._model)
        H = ll.llama_model_n_head(self._model)
        E = ll.llama_model_n_embd(self._model)
        eos = _int_from_meta(m, "tokenizer.ggml.eos_token_id")
        return ModelConfig(
            arch=arch, vocab_size=ll.llama_vocab_n_tokens(self._vocab), hidden_size=E,
            intermediate_size=_int_from_meta(m, f"{arch}.feed_forward_length", 0),
            num_layers=L, num_heads=H, num_kv_heads=ll.llama_model_n_head_kv(self._model),
            head_dim=_int_from_meta(m, f"{arch}.attention.key_length", E // max(H, 1)),
            rms_norm_eps=float(m.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(m.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=ll.llama_model_n_ctx_train(self._model),
            tie_word_embeddings=False, attention_bias=arch == "qwen2",
            eos_token_ids=() if eos is None else (eos,))

    @property
    def backend(self) -> str:
        """The kernels: llama.cpp's CPU backend through llama-cpp-python (pinned version)."""
        return f"ggml-cpu/llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}" + ("/invariant" if self.batch_invariant else "")

    def fingerprint(self) -> str:
        """The GGUF file's SHA-256 (the weights as shipped), marked as run by ggml."""
        return f"ggml:{self.sha256}"

    @property
    def lib(self):
        """The llama-cpp-python low-level bindings (lib.bindings()) this model was loaded with:
        what its caches call llama.cpp through."""
        return self._ll

    def new_context(self, params):
        """A llama.cpp context over this model's weights, made with `params` (a
        llama_context_params): a cache's own; NULL where llama.cpp cannot make one."""
        return self._ll.llama_init_from_model(self._model, params)

    def new_cache(self, max_rows: int, max_len: int) -> GgmlCache:
        if self.batch_invariant:
            return GgmlOrderedCache(self, max_rows, max_len)
        return GgmlCache(self, max_rows, max_len)

    @property
    def supports_trees(self) -> bool:
        """Whether forward(tree=...) runs a tree of branches in one pass: by giving a token the
        sequence ids of every branch through it. The batch-invariant cache keeps one sequence per
        row in a fixed cell order (ordered.py) and has no such pass."""
        return not self.batch_invariant

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: GgmlCache, rows, num_new=None, *,
                last_only: bool = False, num_layers: int | None = None,
                tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """tokens [B,T] long; rows [B] cache rows; num_new [B] valid tokens per row (default T).

        Each row's tokens take positions lengths[row] + arange(num_new[b]) in its own
        sequence; padding (t >= num_new[b]) is not fed at all. One llama_decode per
        kvcache.MAX_DECODE_TOKENS tokens (a verify pass is one). Returns logits [B,T,V] (zeros at
        padding), or [B,V] at each row's last valid token with last_only.

        tree = (depth [B,T], visible [B,T,T]) (the CausalLM protocol): the tokens are the slots
        of a tree, each at position start + depth and in the sequences of every branch
        (root-to-leaf path) through it, so that it attends to its ancestors and to no sibling;
        GgmlCache.keep_slots() then keeps one path.
        """
        if num_layers is not None and num_layers != self.config.num_layers:
            raise UnsupportedFeatureError(LAYER_SKIP_UNSUPPORTED)
        if cache.model is not self:
            raise ValueError("this cache belongs to another model")
        B, T = tokens.shape
        rows_l = as_int_list(rows)
        n_l = [T] * B if num_new is None else as_int_list(num_new)
        if len(rows_l) != B or len(n_l) != B:
            raise ValueError("rows and num_new need one entry per batch row")
        if any(n < 0 or n > T for n in n_l):
            raise ValueError("num_new must lie in [0, T]")
        lengths = cache.lengths.numpy()  # [R] a view: the bookkeeping below is numpy, not torch ops
        start = lengths[rows_l]  # [B]
        stop = start + np.asarray(n_l, dtype=np.int64)  # [B] each row's length after the feed
        V = self.config.vocab_size
        # the flat feed, row after row: batch index b, time t, token, position, sequence id
        full = all(n == T for n in n_l)
        if full:  # every row feeds T tokens (every decode step, most verify passes)
            b_idx, t_idx = np.repeat(np.arange(B), T), np.tile(np.arange(T), B)  # [N]
            tok = tokens.numpy().reshape(-1)
        else:
            b_idx = np.repeat(np.arange(B), n_l)  # [N]
            t_idx = np.concatenate([np.arange(n) for n in n_l]) if B else np.zeros(0, np.int64)  # [N]
            tok = tokens.numpy()[b_idx, t_idx]
        seq = np.asarray(rows_l, dtype=np.int64)[b_idx]
        branches = None
        if tree is None:
            pos = start[b_idx] + t_idx
        else:
            if not self.supports_trees:
                raise UnsupportedFeatureError("draft trees need several sequences per row, which the ggml "
                                              "batch-invariant mode does not have; draft linearly")
            pos = start[b_idx] + tree[0].numpy()[b_idx, t_idx]
            branches = _branches(tree[1].numpy(), rows_l, n_l)
        want = (t_idx == (stop - start - 1)[b_idx]) if last_only else np.ones(len(b_idx), bool)
        # without padding (every row feeds T tokens, or last_only with each row feeding one
        # or more) llama.cpp's outputs fill `out` in order: copied as blocks into an empty
        # tensor, with no zero fill and no scatter
        dense = all(n > 0 for n in n_l) if last_only else full
        shape = (B, V) if last_only else (B, T, V)
        out = torch.empty(shape, dtype=torch.float32) if dense else torch.zeros(shape, dtype=torch.float32)
        at = None  # where each wanted token's logits go in out's [B*T or B, V] view
        if not dense:
            sel = np.flatnonzero(want)
            at = b_idx[sel] if last_only else b_idx[sel] * T + t_idx[sel]
        cache.feed(rows_l, stop, tok, pos, seq, want, out.view(-1, V), at, branches=branches)
        return out


def _branches(visible: np.ndarray, rows: list[int], n_l: list[int]):
    """A tree feed's branches: per token (row after row), how many root-to-leaf paths of its
    row pass through it and which ([N], [N, TREE_MAX_BRANCHES]); per row, slot -> the first
    branch through it. visible [B,T,T]: slot u is t or an ancestor of t."""
    from .kvcache import TREE_MAX_BRANCHES

    N = sum(n_l)
    n_branch = np.ones(N, np.int32)
    branch = np.zeros((N, TREE_MAX_BRANCHES), np.int32)
    on_branch, o = {}, 0
    for b, (r, n) in enumerate(zip(rows, n_l)):
        vis = visible[b, :n, :n]
        below = vis.sum(0) - 1  # [n] slots that have this one as a strict ancestor
        leaves = np.flatnonzero(below == 0)
        if len(leaves) > TREE_MAX_BRANCHES:
            raise ValueError(f"a draft tree of {len(leaves)} branches; the ggml backend verifies at most "
                             f"{TREE_MAX_BRANCHES}")
        member = vis[leaves]  # [leaves, n]: slot t lies on branch j
        firsts = {}
        for t in range(n):
            js = np.flatnonzero(member[:, t])
            n_branch[o + t] = len(js)
            branch[o + t, :len(js)] = js
            firsts[t] = int(js[0])
        on_branch[r] = firsts
        o += n
    return n_branch, branch, on_branch
