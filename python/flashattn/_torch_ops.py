"""The low-level operators, registered with torch.library under the namespace ``flashattn``.

They mirror the reference C++ functions (fwd, bwd, varlen_fwd, varlen_bwd, fwd_kvcache), each
with a fake (meta) implementation so that torch.compile traces them without graph breaks:

    torch.ops.flashattn.fwd(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                            window_size_right, softcap, alibi_slopes, rng_state)
        -> (out, softmax_lse, rng_state)
    torch.ops.flashattn.bwd(dout, q, k, v, out, softmax_lse, dropout_p, softmax_scale, causal,
                            window_size_left, window_size_right, softcap, alibi_slopes,
                            deterministic, rng_state)
        -> (dq, dk, dv, softmax_d)

rng_state is an int64 tensor [seed, offset] on the tensors' device (docs/dropout.md). When
dropout_p > 0 and no rng_state is given, fwd draws one from PyTorch's default generator; the
returned rng_state is what backward needs to regenerate the same mask. Under torch.compile pass
rng_state explicitly (the autograd functions of this package do), so that the op stays a pure
function of its inputs.

Outputs are allocated here with torch.empty and written by the C++ core in place; inputs are
read through DLPack with their strides, without copies. So is the workspace the core asks for
(_C.*_workspace_size: 0 for CPU tensors): a uint8 tensor from PyTorch's allocator, so that device
scratch lives in the caching allocator and the library never allocates memory itself. The fake
implementations need no workspace: it is internal to each op.
"""

from typing import Optional

import torch
from torch import Tensor

from flashattn import _C
from flashattn._common import WORKSPACE_ALIGNMENT, make_options

_RNG_STATE_LEN = 2  # [seed, offset]


def _plain(t: Optional[Tensor]) -> Optional[Tensor]:
    # DLPack refuses tensors that require grad; the core only reads them.
    return None if t is None else t.detach()


def _stream(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return 0


def _num_threads(device: torch.device) -> int:
    # The CPU backend follows torch.set_num_threads, as PyTorch's own CPU kernels do.
    return torch.get_num_threads() if device.type == "cpu" else 0


def _workspace(nbytes: int, device: torch.device) -> Optional[Tensor]:
    """A 1-D uint8 scratch tensor of nbytes on device, WORKSPACE_ALIGNMENT-aligned; None when the
    core needs none."""
    if nbytes == 0:
        return None
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    # CUDA's caching allocator hands out 512-byte aligned blocks, so this holds there; the CPU
    # allocator guarantees less, and then the buffer is over-allocated and sliced.
    if buf.data_ptr() % WORKSPACE_ALIGNMENT == 0:
        return buf
    buf = torch.empty(nbytes + WORKSPACE_ALIGNMENT - 1, dtype=torch.uint8, device=device)
    start = -buf.data_ptr() % WORKSPACE_ALIGNMENT
    return buf[start:start + nbytes]


def _row_stats(shape, device) -> Tensor:
    """An fp32 lse / softmax_d tensor. Row-major strides are spelled out so that an empty one
    (seqlen_q == 0) has the strides the core's contiguity check expects (products of the sizes,
    zeros included) rather than PyTorch's."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return torch.empty_strided(tuple(shape), tuple(reversed(strides)), dtype=torch.float32, device=device)


def draw_rng_state(device: torch.device) -> Tensor:
    """A fresh [seed, offset] pair from the default generator of ``device``.

    Every call draws a new 64-bit seed, so the Philox streams of different calls never
    coincide, and the offset starts at 0; torch.manual_seed makes the sequence of draws (and so
    the dropout masks) reproducible. The draw is an ordinary random op on the tensors' device:
    torch.compile traces it and CUDA graphs replay it with new values.
    """
    seed = torch.randint(
        -(2**63), 2**63 - 1, (1,), dtype=torch.int64, device=device
    )
    return torch.cat([seed, torch.zeros(1, dtype=torch.int64, device=device)])


def _rng_state_for(rng_state: Optional[Tensor], dropout_p: float, device: torch.device) -> Tensor:
    """The rng_state that a forward returns (a new tensor: outputs may not alias inputs)."""
    if dropout_p <= 0.0:
        return torch.zeros(_RNG_STATE_LEN, dtype=torch.int64, device=device)
    if rng_state is None:
        return draw_rng_state(device)
    return rng_state.detach().to(device=device, dtype=torch.int64).contiguous().clone()


def _require_rng_state(rng_state: Optional[Tensor], dropout_p: float) -> Optional[Tensor]:
    if dropout_p <= 0.0:
        return None
    if rng_state is None:
        raise ValueError(
            "rng_state: backward with dropout_p > 0 needs the rng_state returned by the forward"
        )
    return rng_state.detach()


def _options(q, softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic=False,
             num_splits=0):
    return make_options(
        softmax_scale=softmax_scale,
        causal=causal,
        window_left=window_left,
        window_right=window_right,
        softcap=softcap,
        dropout_p=dropout_p,
        deterministic=deterministic,
        num_threads=_num_threads(q.device),
        num_splits=num_splits,
    )


# --- batch mode ------------------------------------------------------------------------------


@torch.library.custom_op("flashattn::fwd", mutates_args=())
def fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    rng_state: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv) -> out (b, sq, h, dv),
    softmax_lse (b, h, sq) fp32, rng_state (2,) int64."""
    b, sq, h, _ = q.shape
    out = torch.empty((b, sq, h, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = _row_stats((b, h, sq), q.device)
    state = _rng_state_for(rng_state, dropout_p, q.device)
    q, k, v, alibi_slopes = _plain(q), _plain(k), _plain(v), _plain(alibi_slopes)
    opt = _options(q, softmax_scale, causal, window_size_left, window_size_right, softcap, dropout_p)
    nbytes = _C.forward_workspace_size(q, k, v, options=opt, alibi_slopes=alibi_slopes)
    _C.forward(
        q, k, v, out, lse,
        options=opt,
        alibi_slopes=alibi_slopes,
        rng_state=state if dropout_p > 0.0 else None,
        workspace=_workspace(nbytes, q.device),
        stream=_stream(q.device),
    )
    return out, lse, state


@fwd.register_fake
def _fwd_fake(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
              softcap, alibi_slopes, rng_state):
    b, sq, h, _ = q.shape
    return (
        q.new_empty((b, sq, h, v.shape[-1])),
        q.new_empty((b, h, sq), dtype=torch.float32),
        q.new_empty((_RNG_STATE_LEN,), dtype=torch.int64),
    )


@torch.library.custom_op("flashattn::bwd", mutates_args=())
def bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    deterministic: bool,
    rng_state: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> dq, dk, dv (shapes of q, k, v; contiguous), softmax_d (b, h, sq) fp32."""
    b, sq, h, _ = q.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    softmax_d = _row_stats((b, h, sq), q.device)
    inputs = tuple(_plain(t) for t in (dout, q, k, v, out, softmax_lse))
    opt = _options(q, softmax_scale, causal, window_size_left, window_size_right, softcap, dropout_p,
                   deterministic)
    alibi_slopes = _plain(alibi_slopes)
    nbytes = _C.backward_workspace_size(*inputs, options=opt, alibi_slopes=alibi_slopes)
    _C.backward(
        *inputs, dq, dk, dv, softmax_d,
        options=opt,
        alibi_slopes=alibi_slopes,
        rng_state=_require_rng_state(rng_state, dropout_p),
        workspace=_workspace(nbytes, q.device),
        stream=_stream(q.device),
    )
    return dq, dk, dv, softmax_d


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, softmax_lse, dropout_p, softmax_scale, causal, window_size_left,
              window_size_right, softcap, alibi_slopes, deterministic, rng_state):
    b, sq, h, _ = q.shape
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        q.new_empty((b, h, sq), dtype=torch.float32),
    )


# --- varlen mode -----------------------------------------------------------------------------


@torch.library.custom_op("flashattn::varlen_fwd", mutates_args=())
def varlen_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    seqused_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    rng_state: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """q (total_q, h, d), k (total_k, hk, d), v (total_k, hk, dv), cu_seqlens_q/k (b + 1) int32
    -> out (total_q, h, dv), softmax_lse (h, total_q) fp32, rng_state (2,) int64."""
    total_q, h, _ = q.shape
    out = torch.empty((total_q, h, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = _row_stats((h, total_q), q.device)
    state = _rng_state_for(rng_state, dropout_p, q.device)
    q, k, v, alibi_slopes = _plain(q), _plain(k), _plain(v), _plain(alibi_slopes)
    opt = _options(q, softmax_scale, causal, window_size_left, window_size_right, softcap, dropout_p)
    varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    nbytes = _C.forward_workspace_size(q, k, v, options=opt, alibi_slopes=alibi_slopes, **varlen)
    _C.forward(
        q, k, v, out, lse,
        options=opt,
        alibi_slopes=alibi_slopes,
        rng_state=state if dropout_p > 0.0 else None,
        workspace=_workspace(nbytes, q.device),
        stream=_stream(q.device),
        **varlen,
    )
    return out, lse, state


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                     dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                     alibi_slopes, rng_state):
    total_q, h, _ = q.shape
    return (
        q.new_empty((total_q, h, v.shape[-1])),
        q.new_empty((h, total_q), dtype=torch.float32),
        q.new_empty((_RNG_STATE_LEN,), dtype=torch.int64),
    )


@torch.library.custom_op("flashattn::varlen_bwd", mutates_args=())
def varlen_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    seqused_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    deterministic: bool,
    rng_state: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> dq, dk, dv (shapes of q, k, v; contiguous), softmax_d (h, total_q) fp32."""
    total_q, h, _ = q.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    softmax_d = _row_stats((h, total_q), q.device)
    inputs = tuple(_plain(t) for t in (dout, q, k, v, out, softmax_lse))
    opt = _options(q, softmax_scale, causal, window_size_left, window_size_right, softcap, dropout_p,
                   deterministic)
    alibi_slopes = _plain(alibi_slopes)
    varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    nbytes = _C.backward_workspace_size(*inputs, options=opt, alibi_slopes=alibi_slopes, **varlen)
    _C.backward(
        *inputs, dq, dk, dv, softmax_d,
        options=opt,
        alibi_slopes=alibi_slopes,
        rng_state=_require_rng_state(rng_state, dropout_p),
        workspace=_workspace(nbytes, q.device),
        stream=_stream(q.device),
        **varlen,
    )
    return dq, dk, dv, softmax_d


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                     max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                     window_size_right, softcap, alibi_slopes, deterministic, rng_state):
    total_q, h, _ = q.shape
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        q.new_empty((h, total_q), dtype=torch.float32),
    )


# --- KV cache --------------------------------------------------------------------------------


@torch.library.custom_op("flashattn::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor],
    v: Optional[Tensor],
    cache_seqlens: Optional[Tensor],
    rotary_cos: Optional[Tensor],
    rotary_sin: Optional[Tensor],
    cache_batch_idx: Optional[Tensor],
    block_table: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    rotary_interleaved: bool,
    num_splits: int,
) -> tuple[Tensor, Tensor]:
    """q (b, sq, h, d) against k_cache/v_cache (b_cache, sk_cache, hk, d/dv), or paged
    (num_blocks, page_size, hk, d/dv) with block_table (b, max_blocks) int32. k/v
    (b, sk_new, hk, d/dv) are written into the caches in place at cache_seqlens first.
    -> out (b, sq, h, dv), softmax_lse (b, h, sq) fp32. num_splits: split-KV of the CUDA forward
    (0: heuristic, 1: never, n: n splits); the CPU backend ignores it."""
    b, sq, h, _ = q.shape
    out = torch.empty((b, sq, h, v_cache.shape[-1]), dtype=q.dtype, device=q.device)
    lse = _row_stats((b, h, sq), q.device)
    q, k_cache, v_cache = _plain(q), k_cache.detach(), v_cache.detach()
    opt = _options(q, softmax_scale, causal, window_size_left, window_size_right, softcap, 0.0,
                   num_splits=num_splits)
    extra = dict(
        k=_plain(k), v=_plain(v), cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
        block_table=block_table, rotary_cos=_plain(rotary_cos), rotary_sin=_plain(rotary_sin),
        rotary_interleaved=rotary_interleaved, alibi_slopes=_plain(alibi_slopes),
    )
    nbytes = _C.forward_kvcache_workspace_size(q, k_cache, v_cache, options=opt, **extra)
    _C.forward_kvcache(
        q, k_cache, v_cache, out, lse,
        options=opt,
        workspace=_workspace(nbytes, q.device),
        stream=_stream(q.device),
        **extra,
    )
    return out, lse


@fwd_kvcache.register_fake
def _fwd_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin,
                      cache_batch_idx, block_table, alibi_slopes, softmax_scale, causal,
                      window_size_left, window_size_right, softcap, rotary_interleaved, num_splits):
    b, sq, h, _ = q.shape
    return (
        q.new_empty((b, sq, h, v_cache.shape[-1])),
        q.new_empty((b, h, sq), dtype=torch.float32),
    )
