"""Native PyTorch runtime for the Llama family (Llama, Qwen2, SmolLM2).

forward(tokens [B,T], cache, rows [B], num_new [B]) writes the keys/values of the
new tokens at positions lengths[row] + arange(T), advances each row's length by its
own num_new (tokens past num_new[b] are padding: computed, written past the row's
length, never seen), and returns logits. Weights are read from Hugging Face
checkpoints (config.json + safetensors) under Hugging Face parameter names.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from .attention import (NotBatchInvariantError, invariant_attention, invariant_kernel, invariant_silu,
                        sdpa_attention)
from .cache import CacheFullError, KVCache
from .config import ModelConfig
from .fastlinear import PackedLinear


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x [..., E]; same order of operations as Hugging Face's LlamaRMSNorm in fp32
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _positions(start: torch.Tensor, T: int) -> torch.Tensor:
    """start [B] -> positions [B,T]: each row continues from its own length."""
    return start[:, None] + torch.arange(T)


class _Layer:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], p: str):
        q, k, v = (w.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv")
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([w.pop(f"{p}self_attn.{n}_proj.bias") for n in "qkv"])
        self.qkv = PackedLinear(torch.cat([q, k, v]), bias)  # one weight read for q, k and v
        self.o = PackedLinear(w.pop(f"{p}self_attn.o_proj.weight"))
        gate, up = w.pop(f"{p}mlp.gate_proj.weight"), w.pop(f"{p}mlp.up_proj.weight")
        self.gate_up = PackedLinear(torch.cat([gate, up]))
        self.down = PackedLinear(w.pop(f"{p}mlp.down_proj.weight"))
        self.ln_attn = w.pop(f"{p}input_layernorm.weight")
        self.ln_mlp = w.pop(f"{p}post_attention_layernorm.weight")


class LlamaModel:
    """Implements the CausalLM protocol (see models/__init__.py).

    batch_invariant=True: a row's logits are bitwise the same whatever the batch, the
    other rows and the number of positions per pass (see models/attention.py).
    """

    runtime = "native"
    # start [B], T -> the RoPE positions [B,T] of a pass's tokens (with_positions replaces it)
    positions = staticmethod(_positions)
    partial_layers = True  # forward(num_layers=N) runs the first N layers (layer-skip)
    noisy_numerics = False  # fp32: batching moves a logit within the audit's fixed TIE_MARGIN
    supports_trees = True  # forward(tree=...) runs a tree of branches in one pass (a mask per row)
    backend_fault = None  # a backend as loaded: its forward is this class's own

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], *,
                 batch_invariant: bool = False):
        self.config = cfg
        w = {k.removeprefix("model.") if k.startswith("model.") else k: v.float()
             for k, v in weights.items()}
        self.embed = w.pop("embed_tokens.weight")  # [V, E]
        self.layers = [_Layer(cfg, w, f"layers.{i}.") for i in range(cfg.num_layers)]
        self.norm = w.pop("norm.weight")
        head = w.pop("lm_head.weight", None)
        if head is None or cfg.tie_word_embeddings:
            head = self.embed
        self.lm_head = PackedLinear(head)
        leftover = [k for k in w if not k.endswith("rotary_emb.inv_freq")]
        if leftover:
            raise ValueError(f"unexpected parameters in checkpoint: {leftover[:5]}")
        d = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.scale = 1.0 / math.sqrt(d)
        self.batch_invariant = batch_invariant
        if batch_invariant:
            linears = [self.lm_head] + [lin for l in self.layers for lin in (l.qkv, l.o, l.gate_up, l.down)]
            bad = sorted({lin.backend for lin in linears if not lin.batch_invariant})
            if bad:
                raise NotBatchInvariantError(
                    f"batch-invariant mode needs the native linear kernel, but linear backend {bad} is "
                    "not batch-invariant (no C compiler? VERISPEC_LINEAR=torch?)")
            invariant_kernel()  # the attention's kernel: raises the same way
        self.attention = invariant_attention if batch_invariant else sdpa_attention
        self.act = invariant_silu if batch_invariant else F.silu

    @classmethod
    def from_dir(cls, path: str | Path, *, batch_invariant: bool = False) -> "LlamaModel":
        path = Path(path)
        cfg = ModelConfig.from_dir(path)
        weights: dict[str, torch.Tensor] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        for f in files:
            weights.update(load_file(str(f)))
        return cls(cfg, weights, batch_invariant=batch_invariant)

    def with_positions(self, positions) -> "LlamaModel":
        """This model (the same weights, not copied) placing a pass's tokens at
        positions(start [B], T) -> [B,T] instead: the audit's fault suite breaks a ragged
        batch's positions this way for the engine under audit alone."""
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__, positions=positions)
        return view

    @property
    def backend(self) -> str:
        """The kernels this model runs on: the linear layers' backend (models/fastlinear.py)
        and the attention's ('invariant' in batch-invariant mode, else 'sdpa')."""
        linears = {self.lm_head.backend} | {lin.backend for l in self.layers
                                             for lin in (l.qkv, l.o, l.gate_up, l.down)}
        return "+".join(sorted(linears)) + ("/invariant" if self.batch_invariant else "/sdpa")

    def fingerprint(self) -> str:
        """A stable identity of this model (caches keyed on the model, e.g. the policy's
        measured costs): SHA-256 over the config and the shape and a strided sample of
        the values of the tensors kept unpacked (embedding: about 4096 values; every norm
        weight in full). The packed linear weights are not read back; two checkpoints
        that differ only there share a fingerprint. The same weights give the same
        fingerprint in every process; computed once per model (~1 ms)."""
        fp = self.__dict__.get("_fingerprint")
        if fp is None:
            h = hashlib.sha256(repr(self.config).encode())
            flat = self.embed.reshape(-1)
            tensors = [flat[:: max(1, flat.numel() // 4096)], self.norm]
            tensors += [t for l in self.layers for t in (l.ln_attn, l.ln_mlp)]
            for t in [self.embed, *tensors]:
                h.update(repr(tuple(t.shape)).encode())
            for t in tensors:
                h.update(t.detach().contiguous().numpy().tobytes())
            fp = self.__dict__["_fingerprint"] = h.hexdigest()
        return fp

    @staticmethod
    def _tree_positions(start: torch.Tensor, slots: torch.Tensor, tree, S: int):
        """(RoPE positions [B,T], attention mask [B,1,T,S]) of a tree's slots: a slot
        sits at start + its depth and sees the cache before start and its own ancestors'
        slots (written at `slots`, which the fault suite may move)."""
        depth, visible = tree  # [B,T], [B,T,T]
        B, T = depth.shape
        pos = start[:, None] + depth  # [B,T]
        W = max(S, int(slots.max()) + 1)  # every slot has a column, even a padding one past S
        mask = (torch.arange(W)[None, None, :] < start[:, None, None]).expand(B, T, W).clone()  # the cache
        col = slots.clamp(min=0)[:, None, :].expand(B, T, T)  # [B,T(query),T(key slot)]
        mask.scatter_(2, col, visible | mask.gather(2, col))
        return pos, mask[:, :, :S][:, None]

    def new_cache(self, max_rows: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, max_rows, max_len, c.num_kv_heads, c.head_dim)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, rows, num_new=None, *,
                last_only: bool = False, num_layers: int | None = None,
                tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """tokens [B,T] long; rows [B] cache rows; num_new [B] valid tokens per row (default T).

        Returns logits [B,T,V], or [B,V] at each row's last valid token with last_only.
        num_layers < L runs the first num_layers layers then the final norm and LM head
        (layer-skip self-drafting); it writes only those layers' cache entries.

        tree = (depth [B,T], visible [B,T,T]) (the CausalLM protocol): the T tokens are the
        slots of a tree. Slot t is written to cache position start + t but placed (RoPE)
        at start + depth[b,t], and attends to the row's cache and to the slots u with
        visible[b,t,u]; KVCache.keep_slots() then moves the accepted path into place.
        """
        cfg = self.config
        B, T = tokens.shape
        rows_t = torch.as_tensor(rows, dtype=torch.long)  # [B]
        num_new_t = (torch.full((B,), T, dtype=torch.long) if num_new is None
                     else torch.as_tensor(num_new, dtype=torch.long))  # [B]
        start = cache.lengths[rows_t]  # [B]
        if bool((num_new_t > T).any()) or bool((num_new_t < 0).any()):
            raise ValueError("num_new must lie in [0, T]")
        S = max(int((start + num_new_t).max()), 1)  # keys attended to: up to the longest row
        if S > cache.max_len:  # lengths live on the CPU: no device sync
            raise CacheFullError(f"write to position {S} exceeds cache length {cache.max_len}")
        slots = self.positions(start, T)  # [B,T] where each token's keys and values go
        if tree is None:
            pos = slots
            # attention mask [B,1,T,S]: key j visible to query t iff j <= pos[b,t]
            mask = (torch.arange(S)[None, None, :] <= pos[:, :, None])[:, None]
        else:
            pos, mask = self._tree_positions(start, slots, tree, S)
        # padding tokens (t >= num_new[b]) write to the scratch slot, never into a live row
        pos_w = torch.where(torch.arange(T) < num_new_t[:, None], slots, cache.scratch)  # [B,T]
        ang = pos[..., None].float() * self.inv_freq  # [B,T,D/2]
        emb = torch.cat((ang, ang), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [B,1,T,D]
        contiguous = B == 1 or bool((rows_t.diff() == 1).all())
        r0 = int(rows_t[0])
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        b_idx = rows_t[:, None].expand(B, T)  # [B,T]

        x = F.embedding(tokens, self.embed)  # [B,T,E]
        n_layers = cfg.num_layers if num_layers is None else num_layers
        for li in range(n_layers):
            layer = self.layers[li]
            h = _rms_norm(x, layer.ln_attn, cfg.rms_norm_eps)
            qkv = layer.qkv(h)  # [B,T,(H+2Hkv)D]
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
            q = q.view(B, T, H, D).transpose(1, 2)  # [B,H,T,D]
            k = k.view(B, T, Hkv, D).transpose(1, 2)  # [B,Hkv,T,D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc, vc = cache.k[li], cache.v[li]  # [R,Hkv,S_max,D]
            kc[b_idx, :, pos_w] = k.transpose(1, 2)
            vc[b_idx, :, pos_w] = v.view(B, T, Hkv, D)
            if contiguous:
                keys, vals = kc[r0:r0 + B, :, :S], vc[r0:r0 + B, :, :S]  # views
            else:
                keys, vals = kc[rows_t, :, :S], vc[rows_t, :, :S]  # gathered copies
            att = self.attention(q, keys, vals, mask, self.scale)
            x = x + layer.o(att.transpose(1, 2).reshape(B, T, H * D))
            h = _rms_norm(x, layer.ln_mlp, cfg.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(self.act(gate) * up)
        cache.lengths[rows_t] = start + num_new_t
        if last_only:
            x = x[torch.arange(B), (num_new_t - 1).clamp(min=0)]  # [B,E]
        x = _rms_norm(x, self.norm, cfg.rms_norm_eps)
        return self.lm_head(x)
