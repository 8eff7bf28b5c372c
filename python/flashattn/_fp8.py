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

# What an FP8 call writes: FlashAttention-3 gives FP8 inputs a bf16 output (as _torch_ops does for
# flash_attn_func's FP8 inputs).
OUT_DTYPE = _torch_ops._FP8_OUT


def _lse_shape(q: Tensor, varlen: bool) -> tuple:
    """softmax_lse's shape: (h, total_q) for varlen q (total_q, h, d), else (b, h, sq)."""
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def _call(entry, q, k, v, out, softmax_scale, causal, window_size_left, window_size_right, softcap, /, **tensors):
    """entry (_C.forward or _C.forward_kvcache) with a new lse, the call's options, workspace
    allocator and stream, the other tensors as keywords (k and v among them for the KV-cache
    call's new rows: the parameters before them are positional only) -> (out, lse)."""
    lse = _torch_ops._row_stats(_lse_shape(q, tensors.get("cu_seqlens_q") is not None), q.device)
    num_threads, alloc, stream = _torch_ops._launch(q.device)
    opt = _torch_ops._options(num_threads, softmax_scale, causal, window_size_left, window_size_right, softcap, 0.0)
    _torch_ops._call(entry, q, k, v, out, lse, options=opt, workspace_alloc=alloc, stream=stream, **tensors)
    return out, lse


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
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=OUT_DTYPE, device=q.device)
    return _call(_C.forward, q, k, v, out, softmax_scale, causal, window_size_left, window_size_right, softcap,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
                 max_seqlen_k=max_seqlen_k, block_table=block_table, sinks=sinks, q_descale=q_descale,
                 k_descale=k_descale, v_descale=v_descale)


@fwd_fp8.register_fake
def _fwd_fp8_fake(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                  max_seqlen_k, block_table, softmax_scale, causal, window_size_left, window_size_right, softcap,
                  sinks=None):
    return (q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=OUT_DTYPE),
            q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32))


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
    out = torch.empty(*q.shape[:-1], v_cache.shape[-1], dtype=OUT_DTYPE, device=q.device)
    return _call(_C.forward_kvcache, q, k_cache, v_cache, out, softmax_scale, causal, window_size_left,
                 window_size_right, softcap, k=k, v=v, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                 block_table=block_table, sinks=sinks, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


@fwd_kvcache_fp8.register_fake
def _fwd_kvcache_fp8_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, q_descale,
                          k_descale, v_descale, softmax_scale, causal, window_size_left, window_size_right, softcap,
                          sinks=None):
    return (q.new_empty((*q.shape[:-1], v_cache.shape[-1]), dtype=OUT_DTYPE),
            q.new_empty(_lse_shape(q, False), dtype=torch.float32))
