"""Checks shared by the PyTorch tests: run a flashattn call, compute the float64 oracle and the
naive_lowprec reference, and apply SPEC §7 to out, lse, dq, dk and dv."""

from __future__ import annotations

import numpy as np
import torch

from reference import attend, check_spec, dropout_keep
from torch_reference import batch_grads, dtype_name, varlen_grads


def randn(shape, dtype, device, generator=None):
    return torch.randn(shape, dtype=torch.float32, generator=generator).to(device=device, dtype=dtype)


def to_np(x):
    return x.detach().cpu().to(torch.float32).numpy() if x.dtype != torch.float64 else x.detach().cpu().numpy()


def softcap_factor(softcap):
    return 3.0 if softcap > 0 else 2.0


def sequence_extras(b, h, seqlen_q, seqlen_k, alibi, rng_state, dropout_p):
    """Per-sequence keyword arguments of the references: ALiBi slopes and the dropout mask."""
    extra = {}
    if alibi is not None:
        slopes = alibi if alibi.dim() == 1 else alibi[b]
        extra["slopes"] = slopes.detach().cpu().double()
    if dropout_p > 0:
        seed, offset = (int(x) for x in rng_state.cpu().tolist())
        keep = np.stack([dropout_keep(seed, offset, b * h + hh, seqlen_q, seqlen_k, dropout_p) for hh in range(h)])
        extra["keep"] = keep
        extra["dropout_p"] = dropout_p
    return extra


def _np_extra(extra):
    out = dict(extra)
    if "slopes" in out:
        out["slopes"] = out["slopes"].numpy()
    return out


def gradient_magnitude(name, q, k, v, dout, scale):
    """A bound on the terms of dq = scale·Σ dS·k (or dk = scale·Σ dSᵀ·q), dS = P ∘ (dP − D), with
    |dP| ≤ dv·max|dout|·max|v|."""
    amax = lambda x: float(x.detach().abs().max()) if x.numel() else 0.0  # noqa: E731
    other = k if name == "dq" else q
    return 0.0 if name == "dv" else scale * amax(other) * v.shape[-1] * amax(dout) * amax(v)


def check_batch(q, k, v, out, lse, *, grads=None, dout=None, softmax_scale=None, causal=False,
                window=(-1, -1), softcap=0.0, alibi=None, dropout_p=0.0, rng_state=None):
    """q (b, sq, h, d) ... out and lse from flashattn; grads = (dq, dk, dv) when checked."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    name = dtype_name(q.dtype)
    factor = softcap_factor(softcap)
    kw = dict(scale=scale, causal=causal, window=window, softcap=softcap)
    qn, kn, vn = to_np(q), to_np(k), to_np(v)
    ref_out, ref_lse, naive_out, naive_lse = [], [], [], []
    extras = [sequence_extras(i, h, sq, sk, alibi, rng_state, dropout_p) for i in range(b)]
    for i in range(b):
        e = _np_extra(extras[i])
        o, l = attend(qn[i], kn[i], vn[i], **kw, **e)
        no, nl = attend(qn[i], kn[i], vn[i], lowprec=name, **kw, **e)
        ref_out.append(o), ref_lse.append(l), naive_out.append(no), naive_lse.append(nl)
    red = max(sq, sk, d, v.shape[-1])
    check_spec("out", to_np(out), np.stack(ref_out), np.stack(naive_out), name, factor, reduction=red)
    if lse is not None:
        check_spec("lse", to_np(lse), np.stack(ref_lse), np.stack(naive_lse), "float32", factor, reduction=red)
    if grads is None:
        return
    ref = batch_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), lowprec=False, seq_fn=lambda i: extras[i], **kw)
    naive = batch_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), lowprec=True, seq_fn=lambda i: extras[i], **kw)
    for gname, ours, r, n in zip(("dq", "dk", "dv"), grads, ref[1:], naive[1:]):
        check_spec(gname, to_np(ours), r.numpy(), n.numpy(), name, factor,
                   gradient_magnitude(gname, q, k, v, dout, scale), reduction=red)


def check_varlen(q, k, v, cu_q, cu_k, out, lse, *, max_seqlen_k, grads=None, dout=None,
                 softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
                 dropout_p=0.0, rng_state=None):
    """Varlen: q (total_q, h, d) ..., cu_q/cu_k Python lists of prefix sums."""
    total_q, h, d = q.shape
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    name = dtype_name(q.dtype)
    factor = softcap_factor(softcap)
    kw = dict(scale=scale, causal=causal, window=window, softcap=softcap, max_seqlen_k=max_seqlen_k)
    qn, kn, vn = to_np(q), to_np(k), to_np(v)
    batch = len(cu_q) - 1
    extras = [sequence_extras(i, h, cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i], alibi, rng_state, dropout_p)
              for i in range(batch)]
    ref_out, ref_lse, naive_out, naive_lse = [], [], [], []
    for i in range(batch):
        sl_q, sl_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        e = _np_extra(extras[i])
        o, l = attend(qn[sl_q], kn[sl_k], vn[sl_k], **kw, **e)
        no, nl = attend(qn[sl_q], kn[sl_k], vn[sl_k], lowprec=name, **kw, **e)
        ref_out.append(o), ref_lse.append(l), naive_out.append(no), naive_lse.append(nl)
    rows = cu_q[-1]  # rows past the last sequence belong to none; their output is unspecified
    red = max(max_seqlen_k, max(cu_q[i + 1] - cu_q[i] for i in range(batch)), d, v.shape[-1])
    check_spec("out", to_np(out)[:rows], np.concatenate(ref_out), np.concatenate(naive_out), name, factor,
               reduction=red)
    if lse is not None:
        check_spec("lse", to_np(lse)[:, :rows], np.concatenate(ref_lse, axis=1),
                   np.concatenate(naive_lse, axis=1), "float32", factor, reduction=red)
    if grads is None:
        return
    ref = varlen_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), cu_q, cu_k, lowprec=False,
                       seq_fn=lambda i: extras[i], **kw)
    naive = varlen_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), cu_q, cu_k, lowprec=True,
                         seq_fn=lambda i: extras[i], **kw)
    for gname, ours, r, n in zip(("dq", "dk", "dv"), grads, ref[1:], naive[1:]):
        rows_g = cu_q[-1] if gname == "dq" else cu_k[-1]
        check_spec(gname, to_np(ours)[:rows_g], r.numpy()[:rows_g], n.numpy()[:rows_g], name, factor,
                   gradient_magnitude(gname, q, k, v, dout, scale), reduction=red)
