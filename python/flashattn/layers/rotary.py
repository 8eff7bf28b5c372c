"""flashattn.layers.rotary — the module ``flash_attn.layers.rotary`` of the ``flash_attn`` 2.x
package: rotary position embedding (RoPE) of queries and keys, with autograd, on any device.

    apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                     cu_seqlens=None, max_seqlen=None)
    apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False,
                          seqlen_offsets=0, num_heads_q=None)        # in place
    apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets=0)   # in place
    RotaryEmbedding(dim, base=10000.0, interleaved=False, scale_base=None, pos_idx_in_fp32=True,
                    device=None)

cos, sin: (seqlen_ro, rotary_dim / 2); the first rotary_dim entries of each head are rotated,
the rest pass through. The token at position p (its index in its sequence plus seqlen_offsets,
an int or one per sequence) takes row p of the tables; a position past the tables is left as it
is. Non-interleaved (GPT-NeoX) rotation i turns entries (i, i + rotary_dim/2), interleaved (GPT-J)
(2i, 2i + 1).

The rotation is the library's (src/common/rotary.h, which the KV-cache append applies to keys):
in float32, (a, b) -> (fma(a, cos, -(b·sin)), fma(a, sin, b·cos)) with the products b·sin and
b·cos rounded once, then the storage rounding. The C++ core applies it only inside
flash_attn_with_kvcache, so it is computed here in PyTorch with the same roundings (the fused
multiply-add as an exact float64 product and difference rounded once to float32); a test holds
these values bit-equal to the keys the KV-cache append writes. The gradient of a rotation by θ is
the rotation by -θ.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from flashattn._C import Error

__all__ = ["RotaryEmbedding", "apply_rotary_emb", "apply_rotary_emb_kv_", "apply_rotary_emb_qkv_"]


def _fma_float32(a, b, c):
    """fmaf(a, b, c) for float32 a, b, c: the float64 product of two float32 values is exact;
    the sum is rounded to float64 and then to float32, which is the single rounding of the fused
    multiply-add but for a float32 tie that the first rounding created (vanishingly rare)."""
    return (a.double() * b.double() + c.double()).float()


def _rotate(x, cos, sin, interleaved, conjugate):
    """x (..., d) with its first rotary_dim entries rotated; cos/sin (..., rotary_dim / 2)
    broadcastable against x's leading dims and already gathered per position."""
    half = cos.shape[-1]
    rot = x[..., :2 * half].float()
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
    else:
        a, b = rot[..., :half], rot[..., half:]
    cos, sin = cos.float(), sin.float()
    if conjugate:
        sin = -sin
    new_a = _fma_float32(a, cos, -(b * sin))
    new_b = _fma_float32(a, sin, b * cos)
    pairs = torch.stack((new_a, new_b), dim=-1).flatten(-2) if interleaved else torch.cat((new_a, new_b), dim=-1)
    return pairs.to(x.dtype)


def _positions(x, seqlen_offsets, cu_seqlens):
    """The position of every token of x: (batch, seqlen) for x (batch, seqlen, heads, d), or
    (total,) for varlen x (total, heads, d), plus where a row belongs to no sequence (varlen)."""
    if cu_seqlens is None:
        batch, seqlen = x.shape[0], x.shape[1]
        pos = torch.arange(seqlen, device=x.device).unsqueeze(0).expand(batch, seqlen)
        if isinstance(seqlen_offsets, Tensor):
            return pos + seqlen_offsets.to(x.device).long().view(-1, 1), None
        return pos + int(seqlen_offsets), None
    rows = torch.arange(x.shape[0], device=x.device)
    cu = cu_seqlens.to(x.device).long()
    seq = torch.searchsorted(cu[1:], rows, right=True)  # the sequence of each row
    outside = seq >= cu.numel() - 1
    seq = seq.clamp(max=cu.numel() - 2)
    pos = rows - cu[seq]
    if isinstance(seqlen_offsets, Tensor):
        pos = pos + seqlen_offsets.to(x.device).long()[seq]
    else:
        pos = pos + int(seqlen_offsets)
    return pos, outside


def _tables_at(cos, sin, pos, outside):
    """cos/sin rows at pos (any shape), as (*pos.shape, 1, rotary_dim / 2) to broadcast over
    heads: rows past the tables (and rows outside every sequence) are the identity."""
    seqlen_ro = cos.shape[0]
    identity = pos >= seqlen_ro
    if outside is not None:
        identity = identity | outside
    idx = pos.clamp(max=seqlen_ro - 1)
    c = torch.where(identity.unsqueeze(-1), torch.ones((), dtype=cos.dtype, device=cos.device), cos[idx])
    s = torch.where(identity.unsqueeze(-1), torch.zeros((), dtype=sin.dtype, device=sin.device), sin[idx])
    return c.unsqueeze(-2), s.unsqueeze(-2)


def _check_tables(x, cos, sin):
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise Error(f"rotary_cos/sin: cos and sin must both be (seqlen_ro, rotary_dim / 2); got "
                    f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if 2 * cos.shape[1] > x.shape[-1]:
        raise Error(f"cos: rotary_dim = 2 · cos.shape[1] = {2 * cos.shape[1]} must be at most the head dim "
                    f"{x.shape[-1]}")
    if cos.shape[0] == 0:
        raise Error("cos: the tables need at least one position (seqlen_ro ≥ 1)")


def _apply(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, conjugate, inplace):
    """x rotated at its positions; written into x when inplace."""
    pos, outside = _positions(x, seqlen_offsets, cu_seqlens)
    c, s = _tables_at(cos.to(x.device), sin.to(x.device), pos, outside)
    rotated = _rotate(x, c, s, interleaved, conjugate)
    rot = rotated.shape[-1]
    if inplace:
        x[..., :rot].copy_(rotated)
        return x
    return torch.cat((rotated, x[..., rot:]), dim=-1)


def _save(ctx, seqlen_offsets, *tensors):
    """Saves tensors and seqlen_offsets (a tensor is saved as one, an int kept on ctx)."""
    is_tensor = isinstance(seqlen_offsets, Tensor)
    ctx.int_offsets = None if is_tensor else seqlen_offsets
    ctx.save_for_backward(*tensors, *((seqlen_offsets,) if is_tensor else ()))


def _saved(ctx, count):
    """The `count` tensors _save saved, and seqlen_offsets."""
    saved = ctx.saved_tensors
    return saved[:count], (saved[count] if len(saved) > count else ctx.int_offsets)


class _ApplyRotaryEmb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens):
        out = _apply(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, False, inplace)
        if inplace:
            ctx.mark_dirty(x)
        _save(ctx, seqlen_offsets, cos, sin, cu_seqlens)
        ctx.interleaved = interleaved
        return out

    @staticmethod
    def backward(ctx, dout):
        (cos, sin, cu_seqlens), offsets = _saved(ctx, 3)
        dx = _apply(dout, cos, sin, ctx.interleaved, offsets, cu_seqlens, True, False)
        return dx, None, None, None, None, None, None


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False,
                     seqlen_offsets: Union[int, Tensor] = 0, cu_seqlens: Optional[Tensor] = None,
                     max_seqlen: Optional[int] = None):
    """x (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with cu_seqlens
    (batch + 1,): positions then count from each sequence's start. seqlen_offsets: int or
    (batch,) added to the positions. max_seqlen is accepted for flash_attn's signature (the
    positions come from cu_seqlens). Returns the rotated x (x itself when inplace)."""
    _check_tables(x, cos, sin)
    if cu_seqlens is None and x.dim() != 4:
        raise Error(f"x: must be (batch, seqlen, nheads, headdim) without cu_seqlens; got {tuple(x.shape)}")
    if cu_seqlens is not None and x.dim() != 3:
        raise Error(f"x: must be (total, nheads, headdim) with cu_seqlens; got {tuple(x.shape)}")
    return _ApplyRotaryEmb.apply(x, cos, sin, bool(interleaved), bool(inplace), seqlen_offsets, cu_seqlens)


# flash_attn's older name of the same function.
apply_rotary_emb_func = apply_rotary_emb


def _q_and_k(qkv, num_heads_q):
    """Views of q and k inside qkv (batch, seqlen, 3, nheads, d) or (batch, seqlen,
    num_heads_q + 2·num_heads_k, d)."""
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise Error(f"qkv: must be (batch, seqlen, 3, nheads, headdim); got {tuple(qkv.shape)}")
        return qkv[:, :, 0], qkv[:, :, 1]
    if qkv.dim() != 4 or num_heads_q is None:
        raise Error("qkv: must be (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + "
                    f"2·num_heads_k, headdim) with num_heads_q given; got {tuple(qkv.shape)}, "
                    f"num_heads_q={num_heads_q}")
    num_heads_k = (qkv.shape[2] - num_heads_q) // 2
    if num_heads_k <= 0 or num_heads_q + 2 * num_heads_k != qkv.shape[2]:
        raise Error(f"num_heads_q: qkv's {qkv.shape[2]} heads are not num_heads_q ({num_heads_q}) + 2·num_heads_k")
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + num_heads_k]


class _ApplyRotaryEmbQK_(torch.autograd.Function):
    """Rotates the q and k parts of a packed tensor in place (k with its own tables)."""

    @staticmethod
    def forward(ctx, packed, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q, kv_only):
        ctx.args = (interleaved, num_heads_q, kv_only)
        _save(ctx, seqlen_offsets, cos, sin, cos_k, sin_k)
        _rotate_packed(packed, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q, kv_only, False)
        ctx.mark_dirty(packed)
        return packed

    @staticmethod
    def backward(ctx, dpacked):
        (cos, sin, cos_k, sin_k), offsets = _saved(ctx, 4)
        interleaved, num_heads_q, kv_only = ctx.args
        grad = dpacked.clone()
        _rotate_packed(grad, cos, sin, cos_k, sin_k, interleaved, offsets, num_heads_q, kv_only, True)
        return grad, None, None, None, None, None, None, None, None


def _rotate_packed(packed, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q, kv_only, conjugate):
    parts = [(packed[:, :, 0], cos_k, sin_k)] if kv_only else list(zip(_q_and_k(packed, num_heads_q),
                                                                       (cos, cos_k), (sin, sin_k)))
    for x, c, s in parts:
        _apply(x, c, s, interleaved, seqlen_offsets, None, conjugate, True)


def apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False,
                          seqlen_offsets: Union[int, Tensor] = 0, num_heads_q: Optional[int] = None):
    """Rotates q and k of qkv IN PLACE: qkv (batch, seqlen, 3, nheads, headdim), or (batch,
    seqlen, num_heads_q + 2·num_heads_k, headdim) (GQA) with num_heads_q. k takes cos_k/sin_k
    where given (XPos), else cos/sin. Returns qkv."""
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    q, _ = _q_and_k(qkv, num_heads_q)
    _check_tables(q, cos, sin)
    _check_tables(q, cos_k, sin_k)
    return _ApplyRotaryEmbQK_.apply(qkv, cos, sin, cos_k, sin_k, bool(interleaved), seqlen_offsets, num_heads_q,
                                    False)


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets: Union[int, Tensor] = 0):
    """Rotates k of kv (batch, seqlen, 2, nheads, headdim) IN PLACE. Returns kv."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise Error(f"kv: must be (batch, seqlen, 2, nheads, headdim); got {tuple(kv.shape)}")
    _check_tables(kv, cos, sin)
    return _ApplyRotaryEmbQK_.apply(kv, cos, sin, cos, sin, bool(interleaved), seqlen_offsets, None, True)


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embedding (RoFormer) over the first `dim` entries of each head, applied in
    place. Frequencies base^(-2i/dim); with scale_base, XPos: q's tables are multiplied and k's
    divided by a per-position decay ((2i + 0.4·dim) / (1.4·dim))^((p - seqlen/2) / scale_base).
    The cos/sin tables are cached, in the inputs' dtype, for the longest sequence seen so far.

    pos_idx_in_fp32 (True, the default): the positions, their products with the frequencies and
    cos/sin are float32, with the frequencies recomputed in float32 when the module has been
    converted to another dtype (``.to(torch.bfloat16)`` converts the inv_freq buffer too): in
    bfloat16 the position 257 would already be 256. False: the positions and those products are
    in inv_freq's dtype, as the buffer is (float32 unless the module was converted), and cos/sin
    are taken in that dtype; the XPos decay stays float32 either way."""

    def __init__(self, dim: int, base=10000.0, interleaved=False, scale_base=None, pos_idx_in_fp32=True,
                 device=None):
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.scale_base = scale_base
        self.pos_idx_in_fp32 = pos_idx_in_fp32
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)
        self.register_buffer("scale", self._xpos_scale(device) if scale_base is not None else None,
                             persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _inv_freq(self, device=None):
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        return 1.0 / (self.base ** exponents)

    def _xpos_scale(self, device=None):
        return (torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) + 0.4 * self.dim) / (1.4 * self.dim)

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        stale = (self._cos_cached is None or seqlen > self._seq_len_cached or self._cos_cached.device != device
                 or self._cos_cached.dtype != dtype or (self.training and self._cos_cached.is_inference()))
        if not stale:
            return
        self._seq_len_cached = seqlen
        # With pos_idx_in_fp32, float32 throughout: positions and their products with the
        # frequencies are large, and a module converted to bf16 would otherwise build its tables in
        # bf16. Without it, in the buffer's dtype, whatever it is.
        if self.pos_idx_in_fp32:
            inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._inv_freq(device)
        else:
            inv_freq = self.inv_freq
        positions = torch.arange(seqlen, dtype=inv_freq.dtype, device=device)
        freqs = torch.outer(positions, inv_freq.to(device))
        cos, sin = torch.cos(freqs), torch.sin(freqs)
        if self.scale is None:
            self._cos_cached, self._sin_cached = cos.to(dtype), sin.to(dtype)
            return
        scale = self.scale if self.scale.dtype == torch.float32 else self._xpos_scale(device)
        power = (torch.arange(seqlen, dtype=torch.float32, device=device) - seqlen // 2) / self.scale_base
        decay = scale.to(device) ** power.unsqueeze(1)
        self._cos_cached, self._sin_cached = (cos * decay).to(dtype), (sin * decay).to(dtype)
        self._cos_k_cached, self._sin_k_cached = (cos / decay).to(dtype), (sin / decay).to(dtype)

    def forward(self, qkv: Tensor, kv: Optional[Tensor] = None, seqlen_offset: Union[int, Tensor] = 0,
                max_seqlen: Optional[int] = None, num_heads_q: Optional[int] = None):
        """qkv (batch, seqlen, 3, nheads, headdim) or (batch, seqlen, num_heads_q + 2·num_heads_k,
        headdim) when kv is None; else q (batch, seqlen, nheads, headdim) and kv (batch, seqlen,
        2, nheads_k, headdim). seqlen_offset: int or (batch,); with a tensor pass max_seqlen, the
        length the tables must cover. Rotates in place; returns qkv, or (q, kv)."""
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        elif self._cos_cached is None:
            raise Error("max_seqlen: needed with a tensor seqlen_offset, to size the cos/sin tables")
        xpos = self.scale is not None
        cos_k = self._cos_k_cached if xpos else self._cos_cached
        sin_k = self._sin_k_cached if xpos else self._sin_cached
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached, cos_k if xpos else None,
                                         sin_k if xpos else None, self.interleaved, seqlen_offset, num_heads_q)
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, self.interleaved, True, seqlen_offset)
        return q, apply_rotary_emb_kv_(kv, cos_k, sin_k, self.interleaved, seqlen_offset)
