"""The flash_attn_* functions for NumPy arrays (forward only; there is no autograd for NumPy).

The same functions of the top-level package accept NumPy arrays and come here. Arrays are read
in place with their strides; outputs are allocated with np.empty. float16 and float32 work as
they are; bfloat16 arrays of the ml_dtypes package are passed to the core as their uint16 bit
patterns (NumPy has no bfloat16 of its own), and outputs come back as ml_dtypes.bfloat16.

Dropout draws its seed from NumPy's global generator (reproducible under np.random.seed).
NumPy arrays live on the host, where the core needs no workspace today; the calls still pass
workspace_alloc, so that a CPU path that needs scratch gets it from here, aligned as the core
requires.
"""

from __future__ import annotations

import numpy as np

from flashattn import _C
from flashattn._common import (
    BATCH_LAYOUT,
    KVCACHE_LAYOUT,
    PAGED_LAYOUT,
    VARLEN_LAYOUT,
    WORKSPACE_ALIGNMENT,
    check_dropout_p,
    check_head_dim,
    check_out_layout,
    check_rank,
    int_arg,
    make_options,
    padded_head_dim,
    resolve_softmax_scale,
    window_pair,
)

_BF16_NAME = "bfloat16"


def _check_array(name, x):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(x).__name__}")


def _check_inputs(named, rank, layout, optional=()):
    """Arrays, ranks and head dims of the attention inputs in `named`, and the types of the
    optional arrays, before anything is padded or unpacked."""
    for name, x in named:
        _check_array(name, x)
        check_rank(name, x.shape, rank, layout)
        check_head_dim(name, x.shape[-1])
    for name, x in optional:
        if x is not None and not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: expected a numpy.ndarray or None, got {type(x).__name__}")


def _is_bf16(x) -> bool:
    return x is not None and x.dtype.name == _BF16_NAME


def _kernel_view(x):
    """The array the core reads: bfloat16 as its uint16 bits, others as they are."""
    if x is None:
        return None
    return x.view(np.uint16) if _is_bf16(x) else x


def _pad_head_dim(x):
    d = x.shape[-1]
    padded = padded_head_dim(d)
    if x.strides[-1] != x.itemsize:
        x = np.ascontiguousarray(x)
    if padded == d:
        return x
    return np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - d)])


def _workspace(nbytes: int):
    """A 1-D uint8 array of nbytes, WORKSPACE_ALIGNMENT-aligned (the calls' workspace_alloc)."""
    if nbytes == 0:
        return None
    buf = np.empty(nbytes + WORKSPACE_ALIGNMENT - 1, dtype=np.uint8)
    start = -buf.ctypes.data % WORKSPACE_ALIGNMENT
    return buf[start:start + nbytes]


def _dropout_seed(dropout_p: float) -> int:
    if dropout_p <= 0.0:
        return 0
    return int(np.random.randint(0, 2**63 - 1, dtype=np.int64))


def _check_out(out, shape, q):
    """out= of a flash_attn_* function: an array of the result's shape and q's dtype, checked
    before anything runs (a refused out is never written)."""
    if out is None:
        return
    _check_array("out", out)
    check_out_layout(out, shape, q.dtype)


def _into(out, result):
    if out is None:
        return result
    np.copyto(out, result)
    return out


def _forward(q, k, v, varlen, dropout_p, softmax_scale, causal, window_size, softcap,
             alibi_slopes, return_lse, out=None, return_softmax_lse=False, paged=False, sinks=None):
    _check_inputs((("q", q),), 4 if varlen is None else 3, BATCH_LAYOUT if varlen is None else VARLEN_LAYOUT)
    kv_rank = 4 if varlen is None or paged else 3
    _check_inputs((("k", k), ("v", v)), kv_rank,
                  BATCH_LAYOUT if varlen is None else PAGED_LAYOUT if paged else VARLEN_LAYOUT,
                  (("alibi_slopes", alibi_slopes), ("sinks", sinks)))
    dropout_p = check_dropout_p(dropout_p)
    _check_out(out, q.shape[:-1] + (v.shape[-1],), q)
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    left, right = window_pair(window_size)
    opt = make_options(
        softmax_scale=resolve_softmax_scale(softmax_scale, head_dim), causal=causal,
        window_left=left, window_right=right, softcap=softcap, dropout_p=dropout_p,
    )
    opt.dropout_seed = _dropout_seed(dropout_p)
    q_p, k_p, v_p = _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v)
    rows = q.shape[:-1]  # (b, sq, h) or varlen (total_q, h)
    res = np.empty(rows + (v_p.shape[-1],), dtype=q.dtype)
    if varlen is None:
        b, sq, h = rows
        lse = np.empty((b, h, sq), dtype=np.float32)
        varlen = {}
    else:
        total_q, h = rows
        lse = np.empty((h, total_q), dtype=np.float32)
    inputs = (_kernel_view(q_p), _kernel_view(k_p), _kernel_view(v_p))
    bf16_bits = _is_bf16(q)
    _C.forward(
        *inputs, _kernel_view(res), lse,
        options=opt, alibi_slopes=alibi_slopes, workspace_alloc=_workspace, bf16_bits=bf16_bits,
        sinks=sinks, **varlen,
    )
    res = _into(out, res[..., :head_dim_v])
    if return_lse:
        return res, lse, None
    return (res, lse) if return_softmax_lse else res


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, out=None, *,
                    sinks=None):
    return _forward(q, k, v, None, dropout_p, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, return_attn_probs, out, sinks=sinks)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, out=None):
    _check_array("qkv", qkv)
    if qkv.ndim != 5 or qkv.shape[2] != 3:
        raise _C.Error(f"qkv: must be (batch, seqlen, 3, nheads, headdim); got {qkv.shape}")
    return _forward(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], None, dropout_p, softmax_scale,
                    causal, window_size, softcap, alibi_slopes, return_attn_probs, out)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, out=None):
    _check_array("kv", kv)
    if kv.ndim != 5 or kv.shape[2] != 2:
        raise _C.Error(f"kv: must be (batch, seqlen_k, 2, nheads_k, headdim); got {kv.shape}")
    return _forward(q, kv[:, :, 0], kv[:, :, 1], None, dropout_p, softmax_scale, causal,
                    window_size, softcap, alibi_slopes, return_attn_probs, out)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, seqused_k=None,
                           return_softmax_lse=False, out=None, *, sinks=None):
    paged = block_table is not None
    named = (("cu_seqlens_q", cu_seqlens_q),) + ((("cu_seqlens_k", cu_seqlens_k),) if not paged else ())
    for name, x in named:
        _check_array(name, x)
    for name, x in (("cu_seqlens_k", cu_seqlens_k), ("seqused_k", seqused_k), ("block_table", block_table)):
        if x is not None:
            _check_array(name, x)
    varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                  block_table=block_table,
                  max_seqlen_q=int_arg("max_seqlen_q", max_seqlen_q),
                  max_seqlen_k=int_arg("max_seqlen_k", max_seqlen_k))
    return _forward(q, k, v, varlen, dropout_p, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, return_attn_probs, out, return_softmax_lse, paged, sinks)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0,
                                     alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, out=None):
    _check_array("qkv", qkv)
    if qkv.ndim != 4 or qkv.shape[1] != 3:
        raise _C.Error(f"qkv: must be (total, 3, nheads, headdim); got {qkv.shape}")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens,
                                  max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                                  window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, out=out)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False, out=None):
    _check_array("kv", kv)
    if kv.ndim != 4 or kv.shape[1] != 2:
        raise _C.Error(f"kv: must be (total_k, 2, nheads_k, headdim); got {kv.shape}")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs, out=out)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, out=None, *,
                            sinks=None):
    _check_inputs(
        (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)), 4, KVCACHE_LAYOUT,
        (("k", k), ("v", v), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
         ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad), ("block_table", block_table),
         ("alibi_slopes", alibi_slopes), ("sinks", sinks)),
    )
    left, right = window_pair(window_size)
    opt = make_options(
        softmax_scale=resolve_softmax_scale(softmax_scale, q.shape[-1]), causal=causal,
        window_left=left, window_right=right, softcap=softcap, num_splits=num_splits,
    )
    if cache_seqlens is not None and not isinstance(cache_seqlens, np.ndarray):
        # One length for every sequence, as in flash_attn.
        cache_seqlens = np.full((q.shape[0],), int_arg("cache_seqlens", cache_seqlens), dtype=np.int32)
    b, sq, h, _ = q.shape
    head_dim_v = v_cache.shape[-1]
    _check_out(out, (b, sq, h, head_dim_v), q)
    # Head dims that are not a multiple of 8: zero-padded copies of q and the caches for the core,
    # the appended rows copied back into the caller's caches afterwards.
    padded = padded_head_dim(q.shape[-1]) != q.shape[-1] or padded_head_dim(head_dim_v) != head_dim_v
    k_cache_p, v_cache_p = (_pad_head_dim(k_cache), _pad_head_dim(v_cache)) if padded else (k_cache, v_cache)
    if padded:
        q, k, v = (None if x is None else _pad_head_dim(x) for x in (q, k, v))
    res = np.empty((b, sq, h, v_cache_p.shape[-1]), dtype=q.dtype)
    lse = np.empty((b, h, sq), dtype=np.float32)
    arrays = (_kernel_view(q), _kernel_view(k_cache_p), _kernel_view(v_cache_p))
    extra = dict(
        k=_kernel_view(k), v=_kernel_view(v), cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
        rotary_cos=_kernel_view(rotary_cos), rotary_sin=_kernel_view(rotary_sin),
        rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes, bf16_bits=_is_bf16(q), sinks=sinks,
    )
    _C.forward_kvcache(*arrays, _kernel_view(res), lse, options=opt, workspace_alloc=_workspace, **extra)
    if k is not None:
        for cache, cache_p in ((k_cache, k_cache_p), (v_cache, v_cache_p)):
            if cache_p is not cache:
                cache[...] = cache_p[..., :cache.shape[-1]]
    res = _into(out, res[..., :head_dim_v])
    return (res, lse) if return_softmax_lse else res
