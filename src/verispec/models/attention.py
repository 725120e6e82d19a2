"""Attention for the native runtime: torch's SDPA (default) and a batch-invariant version.

Both take q [B,H,T,D], keys/vals [B,Hkv,S,D] (H a multiple of Hkv; query head h reads
key/value head h // (H/Hkv)), mask [B,1,T,S] (True: key visible to the query) and the
softmax scale, and return [B,H,T,D].

`sdpa_attention` is fast, but its reduction orders depend on S, T, B and the mask: a
row's output changes in its last bits with the batch it runs in and with how many
positions one forward covers (T = 1 when decoding, T = k+1 when verifying).

`invariant_attention` makes every query's output a function of its own query vector
and its row's visible keys/values only (positions 0..p for a query at position p), so
the bits do not depend on B, T, S, the other rows or their lengths. Its reductions
are the fixed-order FMA chains of the fastlinear kernel (models/csrc/fastlinear.c),
which PackedLinear's batch invariance already rests on:

    score[j,n] = fma-chain over d = 0..D-1 of k[j,d] * (q[n,d] * scale)
    m[n]       = max over visible j of score[j,n]                  (exact in any order)
    e[j,n]     = exp(score[j,n] - m[n]), exactly 0 for masked j
    acc[n,:]   = fma-chain over j = 0..S-1 of e[j,n] * v[j,:]
    den[n]     = fma-chain over j = 0..S-1 of e[j,n] * 1
    out[n,:]   = acc[n,:] / den[n]

A chain over j in increasing order is unchanged by trailing terms e = 0 (fma(v, 0, x)
== x for finite v), so keys past the query's position -- other rows' longer lengths,
the rest of a verify pass, stale cache entries -- change nothing. The max, the
subtraction, the masking and the division are exact elementwise operations; exp is
torch's vectorised exp, whose result for an element does not depend on where it sits
in the tensor (tests/engine/test_batch_invariant.py checks it, and fails loudly should
a torch build change that). The price: two small single-threaded kernel calls per
(row, KV head) and layer instead of one SDPA call (benchmarks/bench_batch_invariant.py).

`invariant_silu` replaces F.silu in the batch-invariant mode (see its docstring). The
other reductions of a forward pass already are batch-invariant: RMSNorm's mean over E
and the sampler's softmax/cumsum over V run serially per row in a fixed order that
depends only on the row length (tested too).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

_PW = 16  # the kernel's panel width: weights are packed as [ceil(out/16), in, 16]


def sdpa_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [B,H,T,D], keys/vals [B,Hkv,S,D], mask [B,1,T,S] -> [B,H,T,D] (torch SDPA)."""
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != keys.shape[1])


class NotBatchInvariantError(RuntimeError):
    """The batch-invariant mode was asked for where the kernels cannot provide it."""


_FWD = None  # the kernel's fl_forward, resolved once


def invariant_kernel():
    """fl_forward of the fastlinear C library; NotBatchInvariantError if it is not in use."""
    global _FWD
    if _FWD is None:
        from .fastlinear import _load_native, backend_name

        name = backend_name()
        st = _load_native()
        if not name.startswith("native") or st.lib is None:
            raise NotBatchInvariantError(
                f"batch-invariant mode needs the native fastlinear kernel, but the linear backend "
                f"is {name!r} ({st.error or 'forced by VERISPEC_LINEAR'}); its reduction order "
                f"depends on the batch, so outputs would silently differ between batch sizes")
        _FWD = st.lib.fl_forward
    return _FWD


_BIAS: tuple = (None, None)  # (mask, its additive bias): every layer of a pass reuses it


def _mask_bias(mask: torch.Tensor) -> torch.Tensor:
    """mask [B,1,T,S] bool -> additive bias [B,1,1,T,S]: 0 where visible, -inf elsewhere."""
    global _BIAS
    memo = _BIAS  # one read: another thread replacing _BIAS cannot mix two passes
    if memo[0] is not mask:
        bias = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
        memo = _BIAS = (mask, bias[:, :, None])
    return memo[1]


_WORKSPACE = threading.local()
_WORKSPACE_MAX = 1 << 23  # floats per reused buffer (32 MiB); larger ones are allocated afresh


def _buffer(slot: str, *shape: int) -> torch.Tensor:
    """A scratch tensor reused across layers and passes (per thread; contents undefined).
    A fresh megabyte-sized buffer costs more in page faults than the attention itself."""
    n = math.prod(shape)
    if n > _WORKSPACE_MAX:
        return torch.empty(shape)
    bufs = _WORKSPACE.__dict__.setdefault("bufs", {})
    buf = bufs.get(slot)
    if buf is None or buf.numel() < n:
        buf = bufs[slot] = torch.empty(max(n, 2 * (0 if buf is None else buf.numel())))
    return buf[:n].view(shape)


def invariant_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """q [B,H,T,D], keys/vals [B,Hkv,S,D], mask [B,1,T,S] -> [B,H,T,D], batch-invariant.

    Every query must see at least one key (causal decoding: key 0 is always visible).
    """
    fwd = invariant_kernel()
    B, H, T, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    G = H // Hkv
    N = G * T  # queries per (row, KV head), n = g*T + t
    Np, Dp = -(-N // _PW) * _PW, -(-D // _PW) * _PW
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    # 1. scaled queries packed as the kernel's weight [B,Hkv,Np/16,D,16], zero padded to Np
    qz = _buffer("q", B, Hkv, Np, D)
    qz[:, :, N:].zero_()
    torch.mul(q.view(B, Hkv, G, T, D), scale, out=qz[:, :, :N].view(B, Hkv, G, T, D))
    qp = _buffer("qp", B, Hkv, Np // _PW, D, _PW)
    qp.copy_(qz.view(B, Hkv, Np // _PW, _PW, D).transpose(-1, -2))
    # 2. scores [B,Hkv,S,Np] (keys are the kernel's rows): one FMA chain over D each
    st = _buffer("scores", B, Hkv, S, Np)
    ks0, ks1, kld = (x * 4 for x in keys.stride()[:3])
    kb, qb, sb = keys.data_ptr(), qp.data_ptr(), st.data_ptr()
    qs0, qs1 = qp.stride(0) * 4, qp.stride(1) * 4
    ss0, ss1 = st.stride(0) * 4, st.stride(1) * 4
    for b in range(B):
        for h in range(Hkv):
            fwd(kb + b * ks0 + h * ks1, kld // 4, S, D, qb + b * qs0 + h * qs1, None, Np,
                sb + b * ss0 + h * ss1, Np, 1)
    # 3. masked softmax numerators e [B,Hkv,N,S] (rows over keys, as the next call reads them)
    e = _buffer("e", B, Hkv, N, S)
    torch.add(st[..., :N].view(B, Hkv, S, G, T).permute(0, 1, 3, 4, 2), _mask_bias(mask),
              out=e.view(B, Hkv, G, T, S))
    e.sub_(e.amax(-1, keepdim=True)).exp_()  # masked keys: exp(-inf) == 0 exactly
    # 4. values packed as the kernel's weight [B,Hkv,Dp/16+1,S,16]; the extra panel's first
    #    column is all ones, so output column Dp is the softmax denominator
    vp = _buffer("v", B, Hkv, Dp // _PW + 1, S, _PW)
    vpad = vals if Dp == D else F.pad(vals, (0, Dp - D))
    vp[:, :, :-1] = vpad.reshape(B, Hkv, S, Dp // _PW, _PW).permute(0, 1, 3, 2, 4)
    vp[:, :, -1] = _ONES
    acc = _buffer("acc", B, Hkv, N, Dp + 1)
    eb, vb, ab = e.data_ptr(), vp.data_ptr(), acc.data_ptr()
    es0, es1 = e.stride(0) * 4, e.stride(1) * 4
    vs0, vs1 = vp.stride(0) * 4, vp.stride(1) * 4
    as0, as1 = acc.stride(0) * 4, acc.stride(1) * 4
    for b in range(B):
        for h in range(Hkv):
            fwd(eb + b * es0 + h * es1, S, N, S, vb + b * vs0 + h * vs1, None, Dp + 1,
                ab + b * as0 + h * as1, Dp + 1, 1)
    out = torch.empty(B, Hkv, N, D)
    torch.div(acc[..., :D], acc[..., Dp:], out=out)
    return out.view(B, H, T, D)


def invariant_silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)): F.silu's vectorised body and scalar tail round differently, so
    an element's result depends on where it falls in the tensor (and on how threads split
    it); exp, add and division do not."""
    return x / torch.exp(-x).add_(1.0)


_ONES = torch.zeros(_PW)
_ONES[0] = 1.0
