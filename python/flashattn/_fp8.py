"""FP8 forward calls (docs/fp8.md): float8_e4m3fn q, k and v with optional (batch, nheads_k)
float32 descale factors, as FlashAttention-3 takes them, into a bfloat16 out. Forward only (no
autograd: FP8 attention has no backward here, as in FlashAttention-3) and, for now, on CPU
tensors only: the core refuses CUDA tensors with the reason until a CUDA kernel takes e4m3.

The op ``flashattn::fwd_fp8`` serves the batch, varlen and paged-prefill layouts of the forward
(cu_seqlens_q given: varlen; block_table given too: k and v are paged caches), and
``flashattn::fwd_kvcache_fp8`` the KV-cache call (batch-mode queries, contiguous or paged e4m3
caches, new rows appended in place; no rotary), so that torch.compile traces FP8 calls as it
traces the others.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from flashattn import _C, _torch_ops

# What an FP8 call writes: FlashAttention-3 gives FP8 inputs a bf16 output.
OUT_DTYPE = torch.bfloat16


def _out_and_lse(q: Tensor, v: Tensor, varlen: bool):
    rows = q.shape[:-1]
    out = torch.empty(*rows, v.shape[-1], dtype=OUT_DTYPE, device=q.device)
    if varlen:
        lse_shape = (q.shape[1], q.shape[0])
    else:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    return out, lse_shape


@torch.library.custom_op("flashattn::fwd_fp8", mutates_args=())
def fwd_fp8(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_descale: Optional[Tensor],
    k_descale: Optional[Tensor],
    v_descale: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    seqused_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_table: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """q (b, sq, h, d) or varlen (total_q, h, d), k/v likewise (or paged caches with
    block_table), all float8_e4m3fn; descales (b, hk) float32 or None -> out (..., h, dv)
    bfloat16, softmax_lse (b, h, sq) or (h, total_q) float32."""
    varlen = cu_seqlens_q is not None
    out, lse_shape = _out_and_lse(q, v, varlen)
    lse = _torch_ops._row_stats(lse_shape, q.device)
    num_threads, alloc, stream = _torch_ops._launch(q.device)
    opt = _torch_ops._options(num_threads, softmax_scale, causal, window_size_left, window_size_right, softcap, 0.0)
    _torch_ops._call(
        _C.forward, q, k, v, out, lse, options=opt, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, block_table=block_table,
        workspace_alloc=alloc, stream=stream, sinks=sinks, q_descale=q_descale, k_descale=k_descale,
        v_descale=v_descale,
    )
    return out, lse


@fwd_fp8.register_fake
def _fwd_fp8_fake(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                  max_seqlen_k, block_table, softmax_scale, causal, window_size_left, window_size_right, softcap,
                  sinks=None):
    varlen = cu_seqlens_q is not None
    out_shape = (*q.shape[:-1], v.shape[-1])
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    return q.new_empty(out_shape, dtype=OUT_DTYPE), q.new_empty(lse_shape, dtype=torch.float32)


def is_fp8(*tensors) -> bool:
    """Whether any of the tensors is float8_e4m3fn (an FP8 call)."""
    return any(isinstance(t, Tensor) and t.dtype == torch.float8_e4m3fn for t in tensors)


@torch.library.custom_op("flashattn::fwd_kvcache_fp8", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache_fp8(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor],
    v: Optional[Tensor],
    cache_seqlens: Optional[Tensor],
    cache_batch_idx: Optional[Tensor],
    block_table: Optional[Tensor],
    q_descale: Optional[Tensor],
    k_descale: Optional[Tensor],
    v_descale: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """The KV-cache call with float8_e4m3fn q (b, sq, h, d), caches (b_cache, sk_cache, hk, d) or
    paged (num_blocks, page_size, hk, d) with block_table, and new rows k/v (b, sk_new, hk, d),
    appended in place at cache_seqlens; descales (b, hk) float32 or None -> out (b, sq, h, dv)
    bfloat16, softmax_lse (b, h, sq) float32. No rotary."""
    b, sq, h, _ = q.shape
    out = torch.empty(b, sq, h, v_cache.shape[-1], dtype=OUT_DTYPE, device=q.device)
    lse = _torch_ops._row_stats((b, h, sq), q.device)
    num_threads, alloc, stream = _torch_ops._launch(q.device)
    opt = _torch_ops._options(num_threads, softmax_scale, causal, window_size_left, window_size_right, softcap, 0.0)
    _torch_ops._call(
        _C.forward_kvcache, q, k_cache, v_cache, out, lse, options=opt, k=k, v=v, cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, block_table=block_table, workspace_alloc=alloc, stream=stream, sinks=sinks,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
    )
    return out, lse


@fwd_kvcache_fp8.register_fake
def _fwd_kvcache_fp8_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, q_descale,
                          k_descale, v_descale, softmax_scale, causal, window_size_left, window_size_right, softcap,
                          sinks=None):
    b, sq, h, _ = q.shape
    return (q.new_empty((b, sq, h, v_cache.shape[-1]), dtype=OUT_DTYPE),
            q.new_empty((b, h, sq), dtype=torch.float32))
