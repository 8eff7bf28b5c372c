"""The flash_attn_* functions for PyTorch tensors: autograd over the torch.library ops.

Head dims that are not a multiple of 8 are zero-padded for the kernels and sliced off the
results (outputs and gradients); softmax_scale defaults to 1/sqrt of the caller's head dim.
Everything here is traceable by torch.compile (fullgraph=True).
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _forward_ad
import torch.nn.functional as F

from flashattn import _C, _torch_ops  # noqa: F401  (_torch_ops registers torch.ops.flashattn.*)
from flashattn._common import (
    BATCH_LAYOUT,
    HEAD_DIM_MULTIPLE,
    KVCACHE_LAYOUT,
    MAX_HEAD_DIM,
    PAGED_LAYOUT,
    VARLEN_LAYOUT,
    check_dropout_p,
    check_head_dim,
    check_out_layout,
    check_rank,
    int_arg,
    padded_head_dim,
    resolve_softmax_scale,
    window_pair,
)
from flashattn._torch_ops import draw_rng_state

_Tensor = torch.Tensor


def _pad_head_dim(x):
    d = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x if d % HEAD_DIM_MULTIPLE == 0 else F.pad(x, [0, padded_head_dim(d) - d])


def _check_tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")


def _check_optional_tensor(name, x):
    if x is not None and not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(x).__name__}")


def _check_inputs(named, rank, layout, optional=()):
    """Tensors, ranks and head dims of the (name, tensor) pairs in `named` (the attention
    inputs), and the optional tensors' types, before anything is padded or unpacked. (The
    flash_attn_* functions test the common case with _inputs_pass and _tensors_or_none first and
    come here for the error: these checks, with the names they carry, cost microseconds per call.)"""
    for name, x in named:
        _check_tensor(name, x)
        check_rank(name, x.shape, rank, layout)
        check_head_dim(name, x.shape[-1])
    for name, x in optional:
        _check_optional_tensor(name, x)


def _inputs_pass(rank, *inputs):
    """Whether every one of `inputs` passes _check_inputs' checks of an attention input (a
    torch.Tensor of the rank, head dim in [1, MAX_HEAD_DIM]); False sends the caller to
    _check_inputs, which raises the error naming the argument."""
    for x in inputs:
        if not isinstance(x, torch.Tensor):
            return False
        shape = x.shape
        if len(shape) != rank or not 1 <= shape[-1] <= MAX_HEAD_DIM:
            return False
    return True


def _tensors_or_none(*xs):
    """Whether each of xs is None or a torch.Tensor (the optional inputs' check, cheaply)."""
    for x in xs:
        if x is not None and not isinstance(x, torch.Tensor):
            return False
    return True


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
            dropout_p, scale, causal, left, right, softcap, alibi_slopes, rng_state, None, _detached(sinks),
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


def _result(out, lse, return_attn_probs, return_softmax_lse=False):
    # S_dmask (the attention probabilities with the dropout pattern) is a testing aid of the
    # reference implementation that the fused kernels never materialise: it is returned as None.
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_softmax_lse else out


def _needs_grad(*xs):
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


def _check_out(out, shape, q, inputs):
    """out= of a flash_attn_* function: a tensor of the result's shape (the caller's head dim),
    q's dtype and device, checked before anything runs, so that a refused out is never written.
    As with PyTorch's own out= variants there is no autograd through it: a call whose inputs
    require grad is refused."""
    if out is None:
        return
    _check_tensor("out", out)
    check_out_layout(out, shape, q.dtype)
    if out.device != q.device:
        raise _C.Error(f"out: must be on q's device; expected {q.device}, got {out.device}")
    if _needs_grad(*inputs):
        raise _C.Error(
            "out: not supported when autograd records the call (an input requires grad); call under "
            "torch.no_grad() or torch.inference_mode()"
        )


def _autograd_function_needed(*inputs):
    """Whether a flash_attn_* call without out= runs through its autograd function. That costs
    tens of microseconds per call on a slow host (as much as the rest of its Python) and gives a
    call that autograd does not record nothing: such a call runs the forward op alone, with the
    same results. The function stays wherever its own handling could differ: autograd records the
    call (an input requires grad, gradients on), torch.compile traces it (as before: no other
    check below is then made), functorch transforms and forward-mode AD (which it serves or
    refuses with its own errors) are active, or the profiler records it by name."""
    # (_torch_ops._DIRECT: this PyTorch has the functions asked here.)
    if not _torch_ops._DIRECT or torch.compiler.is_compiling() or _needs_grad(*inputs):
        return True
    return (torch.autograd._profiler_enabled() or torch._C._are_functorch_transforms_active()
            or getattr(_forward_ad, "_current_level", 0) >= 0)


def _forward_no_autograd(name, q, k, v, dropout_p, softmax_scale, window_size, op_args, need_lse):
    """What _FlashAttnFunc / _FlashAttnVarlenFunc.forward compute, in its order (the same errors
    first, the same draw of the dropout seed), for a call that autograd does not record (see
    _autograd_function_needed). op_args(q_p, k_p, v_p, scale, left, right, rng_state): the
    op's arguments. -> (out (the caller's head dim), softmax_lse (None where it may be, see
    _forward_only))."""
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    left, right = window_pair(window_size)
    q_p, k_p, v_p = _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v)
    rng_state = draw_rng_state(q.device) if dropout_p > 0.0 else None
    return _forward_only(name, None, v.shape[-1], *op_args(q_p, k_p, v_p, scale, left, right, rng_state),
                         need_lse=need_lse)


def _forward_only(name, out, head_dim_v, *args, need_lse=True):
    """The forward op `name` without autograd history (out= or a paged K/V), its result written
    into out when given. -> (out (the caller's head dim), softmax_lse). need_lse False: the
    caller does not return the softmax_lse, which may then be None (_torch_ops.call_into)."""
    res, lse = _torch_ops.call_into(name, out, *args, need_lse=need_lse)[:2]
    if out is None and res.shape[-1] != head_dim_v:  # (a view only where padding is cut off)
        res = res[..., :head_dim_v]
    return res, lse


def flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                    deterministic, return_attn_probs, out=None, sinks=None):
    if not (_inputs_pass(4, q, k, v) and _tensors_or_none(alibi_slopes, sinks)):
        _check_inputs((("q", q), ("k", k), ("v", v)), 4, BATCH_LAYOUT,
                      (("alibi_slopes", alibi_slopes), ("sinks", sinks)))
    dropout_p = check_dropout_p(dropout_p)
    sinks = _sinks_fp32(sinks)
    if out is not None:
        _check_out(out, q.shape[:-1] + (v.shape[-1],), q, (q, k, v, sinks))
    if out is None and _autograd_function_needed(q, k, v, alibi_slopes, sinks):
        res, lse = _FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                        alibi_slopes, deterministic, sinks)
    elif out is None:
        res, lse = _forward_no_autograd(
            "fwd", q, k, v, dropout_p, softmax_scale, window_size,
            lambda q_p, k_p, v_p, scale, left, right, rng_state: (
                q_p, k_p, v_p, dropout_p, scale, causal, left, right, softcap, alibi_slopes, rng_state,
                _detached(sinks)),
            need_lse=bool(return_attn_probs),
        )
    else:
        left, right = window_pair(window_size)
        rng_state = draw_rng_state(q.device) if dropout_p > 0.0 else None
        res, lse = _forward_only(
            "fwd", out, v.shape[-1], _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v), dropout_p,
            resolve_softmax_scale(softmax_scale, q.shape[-1]), causal, left, right, softcap, alibi_slopes,
            rng_state, _detached(sinks), need_lse=bool(return_attn_probs),
        )
    return _result(res, lse, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p, softmax_scale, causal, window_size, softcap,
                              alibi_slopes, deterministic, return_attn_probs, out=None):
    _check_tensor("qkv", qkv)
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise _C.Error(f"qkv: must be (batch, seqlen, 3, nheads, headdim); got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(2)  # views: the kernels read the packed tensor in place
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, out)


def flash_attn_kvpacked_func(q, kv, dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, deterministic, return_attn_probs, out=None):
    _check_tensor("kv", kv)
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise _C.Error(f"kv: must be (batch, seqlen_k, 2, nheads_k, headdim); got {tuple(kv.shape)}")
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, out)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, block_table, seqused_k=None,
                           return_softmax_lse=False, out=None, sinks=None):
    paged = block_table is not None
    if not (_inputs_pass(3, q) and _inputs_pass(4 if paged else 3, k, v)
            and _tensors_or_none(alibi_slopes, block_table, seqused_k, cu_seqlens_k, sinks)):
        _check_inputs((("q", q),), 3, VARLEN_LAYOUT)
        _check_inputs((("k", k), ("v", v)), 4 if paged else 3, PAGED_LAYOUT if paged else VARLEN_LAYOUT,
                      (("alibi_slopes", alibi_slopes), ("block_table", block_table), ("seqused_k", seqused_k),
                       ("cu_seqlens_k", cu_seqlens_k), ("sinks", sinks)))
    _check_tensor("cu_seqlens_q", cu_seqlens_q)
    if not paged:
        _check_tensor("cu_seqlens_k", cu_seqlens_k)
    max_seqlen_q = int_arg("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = int_arg("max_seqlen_k", max_seqlen_k)
    dropout_p = check_dropout_p(dropout_p)
    sinks = _sinks_fp32(sinks)
    if out is not None:
        _check_out(out, (q.shape[0], q.shape[1], v.shape[-1]), q, (q, k, v, sinks))
    if paged and _needs_grad(q, k, v, sinks):
        raise _C.Error(
            "block_table: a paged K/V has no backward (flash_attn has none either); call under "
            "torch.no_grad() or torch.inference_mode()"
        )
    if out is None and not paged and _autograd_function_needed(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                                                seqused_k, sinks):
        res, lse = _FlashAttnVarlenFunc.apply(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
            causal, window_size, softcap, alibi_slopes, deterministic, seqused_k, sinks,
        )
    elif out is None and not paged:
        res, lse = _forward_no_autograd(
            "varlen_fwd", q, k, v, dropout_p, softmax_scale, window_size,
            lambda q_p, k_p, v_p, scale, left, right, rng_state: (
                q_p, k_p, v_p, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, dropout_p,
                scale, causal, left, right, softcap, alibi_slopes, rng_state, None, _detached(sinks)),
            need_lse=bool(return_attn_probs or return_softmax_lse),
        )
    else:
        left, right = window_pair(window_size)
        rng_state = draw_rng_state(q.device) if dropout_p > 0.0 else None
        # A paged cache whose head dim is not a multiple of 8 is padded whole (a copy), as
        # flash_attn does.
        res, lse = _forward_only(
            "varlen_fwd", out, v.shape[-1], _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v), cu_seqlens_q,
            cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, dropout_p,
            resolve_softmax_scale(softmax_scale, q.shape[-1]), causal, left, right, softcap, alibi_slopes,
            rng_state, block_table, _detached(sinks), need_lse=bool(return_attn_probs or return_softmax_lse),
        )
    return _result(res, lse, return_attn_probs, return_softmax_lse)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                     window_size, softcap, alibi_slopes, deterministic,
                                     return_attn_probs, out=None):
    _check_tensor("qkv", qkv)
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise _C.Error(f"qkv: must be (total, 3, nheads, headdim); got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, None, out=out)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p, softmax_scale, causal, window_size, softcap,
                                    alibi_slopes, deterministic, return_attn_probs, out=None):
    _check_tensor("kv", kv)
    if kv.dim() != 4 or kv.shape[1] != 2:
        raise _C.Error(f"kv: must be (total_k, 2, nheads_k, headdim); got {tuple(kv.shape)}")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, None, out=out)


def flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                            cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                            window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                            return_softmax_lse, out=None, sinks=None):
    # One call per decoding step, where the host's time per call counts (bench/host_overhead.py):
    # the checks run in full, with their messages, only when the cheap test of the common case fails.
    # (_inputs_pass spelled out, with the shapes kept for below: 0.55 µs less per call on a 2-core
    # CPU host, of which 0.3 µs are the two Tensor.shape not asked again.)
    if not (isinstance(q, _Tensor) and isinstance(k_cache, _Tensor) and isinstance(v_cache, _Tensor)
            and len(q_shape := q.shape) == 4 and len(k_shape := k_cache.shape) == 4
            and len(v_shape := v_cache.shape) == 4 and 1 <= q_shape[-1] <= MAX_HEAD_DIM
            and 1 <= k_shape[-1] <= MAX_HEAD_DIM and 1 <= v_shape[-1] <= MAX_HEAD_DIM
            and _tensors_or_none(k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
                                 alibi_slopes, sinks)):
        _check_inputs(
            (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)), 4, KVCACHE_LAYOUT,
            (("k", k), ("v", v), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
             ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad), ("block_table", block_table),
             ("alibi_slopes", alibi_slopes), ("sinks", sinks)),
        )
        q_shape, v_shape = q.shape, v_cache.shape
    if k is not None:
        check_rank("k", k.shape, 4, BATCH_LAYOUT)
    if v is not None:
        check_rank("v", v.shape, 4, BATCH_LAYOUT)
    head_dim, head_dim_v = q_shape[-1], v_shape[-1]
    if out is not None:
        _check_out(out, q_shape[:-1] + (head_dim_v,), q, ())
    scale = resolve_softmax_scale(softmax_scale, head_dim)
    left, right = window_pair(window_size)
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        # One length for every sequence, as in flash_attn.
        cache_seqlens = torch.full((q_shape[0],), int_arg("cache_seqlens", cache_seqlens), dtype=torch.int32,
                                   device=k_cache.device)
    # Head dims that are not a multiple of 8 are zero-padded as in the other functions; the caches
    # then too (a copy of each, as flash_attn makes), and appended rows are copied back into the
    # caller's caches afterwards.
    padded = head_dim % HEAD_DIM_MULTIPLE != 0 or head_dim_v % HEAD_DIM_MULTIPLE != 0
    k_cache_p, v_cache_p = (_pad_head_dim(k_cache), _pad_head_dim(v_cache)) if padded else (k_cache, v_cache)
    # (Unpadded, a contiguous tensor's last stride is 1: _pad_head_dim would return it as it is,
    # and is_contiguous costs a fraction of its stride(-1).)
    if padded or not q.is_contiguous():
        q = _pad_head_dim(q)
    if k is not None:
        k = _pad_head_dim(k)
    if v is not None:
        v = _pad_head_dim(v)
    if sinks is not None:
        sinks = _sinks_fp32(sinks).detach()
    res, lse = _torch_ops.call_fwd_kvcache_into(
        out, q, k_cache_p, v_cache_p, k, v, cache_seqlens, rotary_cos, rotary_sin,
        cache_batch_idx, block_table, alibi_slopes, scale, causal, left, right, softcap, rotary_interleaved,
        int_arg("num_splits", num_splits), cache_leftpad, sinks, need_lse=bool(return_softmax_lse),
    )
    if k is not None:
        with torch.no_grad():
            for cache, cache_p in ((k_cache, k_cache_p), (v_cache, v_cache_p)):
                if cache_p is not cache:
                    cache.copy_(cache_p[..., :cache.shape[-1]])
    if padded and out is None and res.shape[-1] != head_dim_v:  # (a view only where padding is cut off)
        res = res[..., :head_dim_v]
    return (res, lse) if return_softmax_lse else res
