"""The flash_attn_* functions for PyTorch tensors: autograd over the torch.library ops.

Head dims that are not a multiple of 8 are zero-padded for the kernels and sliced off the
results (outputs and gradients); softmax_scale defaults to 1/sqrt of the caller's head dim.
Everything here is traceable by torch.compile (fullgraph=True).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashattn import _C, _torch_ops  # noqa: F401  (_torch_ops registers torch.ops.flashattn.*)
from flashattn._common import (
    BATCH_LAYOUT,
    KVCACHE_LAYOUT,
    VARLEN_LAYOUT,
    check_dropout_p,
    check_head_dim,
    check_no_leftpad,
    check_rank,
    int_arg,
    padded_head_dim,
    resolve_softmax_scale,
    window_pair,
)
from flashattn._torch_ops import draw_rng_state


def _last_dim_contiguous(x):
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def _pad_head_dim(x):
    d = x.shape[-1]
    padded = padded_head_dim(d)
    x = _last_dim_contiguous(x)
    return x if padded == d else F.pad(x, [0, padded - d])


def _check_tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")


def _check_optional_tensor(name, x):
    if x is not None and not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(x).__name__}")


def _check_inputs(named, rank, layout, optional=()):
    """Tensors, ranks and head dims of the (name, tensor) pairs in `named` (the attention
    inputs), and the optional tensors' types, before anything is padded or unpacked."""
    for name, x in named:
        _check_tensor(name, x)
        check_rank(name, x.shape, rank, layout)
        check_head_dim(name, x.shape[-1])
    for name, x in optional:
        _check_optional_tensor(name, x)


def _detached(x):
    return None if x is None else x.detach()


def _sinks_fp32(sinks):
    """The core takes float32 sinks; a model's sinks in its own dtype (bf16 parameters) are cast,
    differentiably, so that their gradient flows back in that dtype."""
    if isinstance(sinks, torch.Tensor) and sinks.is_floating_point() and sinks.dtype != torch.float32:
        return sinks.float()
    return sinks


def _sink_grad_if_needed(ctx, index, sinks, lse, softmax_d):
    """The gradient of the sinks (argument `index` of the autograd function's forward), or None
    when there are none or autograd does not ask for it."""
    if sinks is None or not ctx.needs_input_grad[index]:
        return None
    return _torch_ops.sink_grad(sinks, lse, softmax_d)


class _FlashAttnFunc(torch.autograd.Function):
    """Batch mode: q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv)."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, sinks=None):
        head_dim, head_dim_v = q.shape[-1], v.shape[-1]
        scale = resolve_softmax_scale(softmax_scale, head_dim)
        left, right = window_pair(window_size)
        q_p, k_p, v_p = _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v)
        rng_state = draw_rng_state(q.device) if dropout_p > 0.0 else None
        out_p, lse, rng_state = _torch_ops.call(
            "fwd", q_p, k_p, v_p, dropout_p, scale, causal, left, right, softcap, alibi_slopes, rng_state,
            _detached(sinks),
        )
        ctx.save_for_backward(q_p, k_p, v_p, out_p, lse, rng_state, alibi_slopes, sinks)
        ctx.args = (dropout_p, scale, causal, left, right, softcap, deterministic)
        ctx.head_dims = (head_dim, head_dim_v)
        ctx.mark_non_differentiable(lse)
        return out_p[..., :head_dim_v], lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q_p, k_p, v_p, out_p, lse, rng_state, alibi_slopes, sinks = ctx.saved_tensors
        dropout_p, scale, causal, left, right, softcap, deterministic = ctx.args
        head_dim, head_dim_v = ctx.head_dims
        dq, dk, dv, softmax_d = _torch_ops.call(
            "bwd", _pad_head_dim(dout), q_p, k_p, v_p, out_p, lse, dropout_p, scale, causal, left, right,
            softcap, alibi_slopes, deterministic, rng_state if dropout_p > 0.0 else None,
        )
        dsinks = _sink_grad_if_needed(ctx, 10, sinks, lse, softmax_d)
        return (dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim_v]) + (None,) * 7 + (dsinks,)


class _FlashAttnVarlenFunc(torch.autograd.Function):
    """Varlen mode: q (total_q, h, d), k (total_k, hk, d), v (total_k, hk, dv); seqused_k
    (b,) int32 or None: the keys of each sequence that are used."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, seqused_k=None,
                sinks=None):
        head_dim, head_dim_v = q.shape[-1], v.shape[-1]
        scale = resolve_softmax_scale(softmax_scale, head_dim)
        left, right = window_pair(window_size)
        q_p, k_p, v_p = _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v)
        rng_state = draw_rng_state(q.device) if dropout_p > 0.0 else None
        out_p, lse, rng_state = _torch_ops.call(
            "varlen_fwd", q_p, k_p, v_p, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
            dropout_p, scale, causal, left, right, softcap, alibi_slopes, rng_state, _detached(sinks),
        )
        ctx.save_for_backward(q_p, k_p, v_p, out_p, lse, cu_seqlens_q, cu_seqlens_k, rng_state,
                              alibi_slopes, seqused_k, sinks)
        ctx.args = (max_seqlen_q, max_seqlen_k, dropout_p, scale, causal, left, right, softcap,
                    deterministic)
        ctx.head_dims = (head_dim, head_dim_v)
        ctx.mark_non_differentiable(lse)
        return out_p[..., :head_dim_v], lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q_p, k_p, v_p, out_p, lse, cu_q, cu_k, rng_state, alibi_slopes, seqused_k, sinks = ctx.saved_tensors
        max_q, max_k, dropout_p, scale, causal, left, right, softcap, deterministic = ctx.args
        head_dim, head_dim_v = ctx.head_dims
        dq, dk, dv, softmax_d = _torch_ops.call(
            "varlen_bwd", _pad_head_dim(dout), q_p, k_p, v_p, out_p, lse, cu_q, cu_k, seqused_k, max_q, max_k,
            dropout_p, scale, causal, left, right, softcap, alibi_slopes, deterministic,
            rng_state if dropout_p > 0.0 else None,
        )
        dsinks = _sink_grad_if_needed(ctx, 15, sinks, lse, softmax_d)
        return (dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim_v]) + (None,) * 12 + (dsinks,)


def _result(out, lse, return_attn_probs):
    # S_dmask (the attention probabilities with the dropout pattern) is a testing aid of the
    # reference implementation that the fused kernels never materialise: it is returned as None.
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                    deterministic, return_attn_probs, sinks=None):
    _check_inputs((("q", q), ("k", k), ("v", v)), 4, BATCH_LAYOUT,
                  (("alibi_slopes", alibi_slopes), ("sinks", sinks)))
    out, lse = _FlashAttnFunc.apply(q, k, v, check_dropout_p(dropout_p), softmax_scale, causal,
                                    window_size, softcap, alibi_slopes, deterministic, _sinks_fp32(sinks))
    return _result(out, lse, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p, softmax_scale, causal, window_size, softcap,
                              alibi_slopes, deterministic, return_attn_probs):
    _check_tensor("qkv", qkv)
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise _C.Error(f"qkv: must be (batch, seqlen, 3, nheads, headdim); got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(2)  # views: the kernels read the packed tensor in place
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, deterministic, return_attn_probs):
    _check_tensor("kv", kv)
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise _C.Error(f"kv: must be (batch, seqlen_k, 2, nheads_k, headdim); got {tuple(kv.shape)}")
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, block_table, sinks=None):
    if block_table is not None:
        raise NotImplementedError(
            "block_table: paged K/V in varlen mode is not supported; use flash_attn_with_kvcache"
        )
    _check_inputs((("q", q), ("k", k), ("v", v)), 3, VARLEN_LAYOUT,
                  (("alibi_slopes", alibi_slopes), ("sinks", sinks)))
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_tensor(name, x)
    out, lse = _FlashAttnVarlenFunc.apply(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int_arg("max_seqlen_q", max_seqlen_q),
        int_arg("max_seqlen_k", max_seqlen_k),
        check_dropout_p(dropout_p), softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, None, _sinks_fp32(sinks),
    )
    return _result(out, lse, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                     window_size, softcap, alibi_slopes, deterministic,
                                     return_attn_probs):
    _check_tensor("qkv", qkv)
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise _C.Error(f"qkv: must be (total, 3, nheads, headdim); got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, None)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p, softmax_scale, causal, window_size, softcap,
                                    alibi_slopes, deterministic, return_attn_probs):
    _check_tensor("kv", kv)
    if kv.dim() != 4 or kv.shape[1] != 2:
        raise _C.Error(f"kv: must be (total_k, 2, nheads_k, headdim); got {tuple(kv.shape)}")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, None)


def flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                            cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                            window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                            return_softmax_lse, sinks=None):
    check_no_leftpad(cache_leftpad)
    _check_inputs(
        (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)), 4, KVCACHE_LAYOUT,
        (("k", k), ("v", v), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
         ("cache_batch_idx", cache_batch_idx), ("block_table", block_table), ("alibi_slopes", alibi_slopes),
         ("sinks", sinks)),
    )
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    left, right = window_pair(window_size)
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        # One length for every sequence, as in flash_attn.
        cache_seqlens = torch.full((q.shape[0],), int_arg("cache_seqlens", cache_seqlens), dtype=torch.int32,
                                   device=k_cache.device)
    out, lse = _torch_ops.call(
        "fwd_kvcache", q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
        block_table, alibi_slopes, scale, causal, left, right, softcap, rotary_interleaved,
        int(num_splits), _detached(_sinks_fp32(sinks)),
    )
    return (out, lse) if return_softmax_lse else out
