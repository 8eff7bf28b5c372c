"""The attention of reference.py in PyTorch, for gradients: autograd of the float64 function is the
oracle for dq, dk, dv, and autograd of the rounded float32 emulation is naive_lowprec (SPEC §7)."""

from __future__ import annotations

import numpy as np
import torch

from reference import alibi_distance, normalised_window, visible

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def dtype_name(dtype):
    return _DTYPE_NAMES[dtype]


def _rounder(dtype, lowprec):
    if not lowprec or dtype == torch.float32:
        return lambda x: x
    return lambda x: x.to(dtype).to(torch.float32)


def attend(q, k, v, *, scale, causal=False, window=(-1, -1), max_seqlen_k=None, softcap=0.0,
           slopes=None, keep=None, dropout_p=0.0, rnd=lambda x: x):
    """q (sq, h, d), k (sk, hk, d), v (sk, hk, dv) in the compute dtype -> out (sq, h, dv)."""
    sq, h, _ = q.shape
    sk, hk, _ = k.shape
    max_seqlen_k = sk if max_seqlen_k is None else max_seqlen_k
    group = h // hk
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = rnd(rnd(torch.einsum("ihd,jhd->hij", q, k)) * scale)
    if softcap > 0:
        s = rnd(softcap * torch.tanh(s / softcap))
    if slopes is not None:
        dist = torch.from_numpy(alibi_distance(sq, sk)).to(q.dtype)
        s = rnd(s - slopes.to(q.dtype)[:, None, None] * dist)
    left, right = normalised_window(causal, window, max_seqlen_k)
    vis = torch.from_numpy(visible(sq, sk, left, right))
    s = s.masked_fill(~vis, float("-inf"))
    m = s.amax(dim=-1, keepdim=True) if sk > 0 else torch.zeros((h, sq, 1), dtype=q.dtype)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    p = rnd(e / torch.where(denom > 0, denom, torch.ones_like(denom)))
    if keep is not None:
        keep_t = torch.from_numpy(keep).to(q.dtype)
        p = rnd(p * keep_t / (1.0 - float(np.float32(dropout_p))))
    return rnd(torch.einsum("hij,jhd->ihd", p, v))


def batch_grads(q, k, v, dout, *, lowprec, seq_fn=None, **kw):
    """Gradients of the batch-mode attention (q (b, sq, h, d) ...) in float64 (lowprec False) or
    the rounded float32 emulation (lowprec True). seq_fn(b) -> extra kwargs per sequence (keep,
    slopes). Returns (out, dq, dk, dv) as float64 tensors."""
    ftype = torch.float32 if lowprec else torch.float64
    rnd = _rounder(q.dtype, lowprec)
    qf, kf, vf = (x.detach().to(ftype).requires_grad_() for x in (q, k, v))
    outs = []
    for b in range(q.shape[0]):
        extra = seq_fn(b) if seq_fn else {}
        outs.append(attend(qf[b], kf[b], vf[b], rnd=rnd, **kw, **extra))
    out = torch.stack(outs)
    dq, dk, dv = torch.autograd.grad(out, (qf, kf, vf), dout.to(ftype))
    return tuple(x.detach().double() for x in (out, dq, dk, dv))


def varlen_grads(q, k, v, dout, cu_q, cu_k, *, lowprec, seq_fn=None, **kw):
    """Varlen counterpart of batch_grads: q (total_q, h, d), cu_q/cu_k lists of prefix sums."""
    ftype = torch.float32 if lowprec else torch.float64
    rnd = _rounder(q.dtype, lowprec)
    qf, kf, vf = (x.detach().to(ftype).requires_grad_() for x in (q, k, v))
    outs = []
    for b in range(len(cu_q) - 1):
        extra = seq_fn(b) if seq_fn else {}
        outs.append(attend(qf[cu_q[b]:cu_q[b + 1]], kf[cu_k[b]:cu_k[b + 1]], vf[cu_k[b]:cu_k[b + 1]],
                           rnd=rnd, **kw, **extra))
    out = torch.cat(outs)
    total_q = q.shape[0]
    if out.shape[0] < total_q:  # rows past the last prefix sum are not part of any sequence
        out = torch.cat([out, torch.zeros((total_q - out.shape[0],) + out.shape[1:], dtype=ftype)])
    dq, dk, dv = torch.autograd.grad(out, (qf, kf, vf), dout.to(ftype), allow_unused=True)
    return tuple(x.detach().double() for x in (out, dq, dk, dv))
