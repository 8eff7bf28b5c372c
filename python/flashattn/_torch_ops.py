"""The low-level operators, registered with torch.library under the namespace ``flashattn``.

They mirror the reference C++ functions (fwd, bwd, varlen_fwd, varlen_bwd, fwd_kvcache), each
with a fake (meta) implementation so that torch.compile traces them without graph breaks:

    torch.ops.flashattn.fwd(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                            window_size_right, softcap, alibi_slopes, rng_state, sinks=None,
                            dropout_row_offset=0, dropout_col_offset=0)
        -> (out, softmax_lse, rng_state)
    torch.ops.flashattn.bwd(dout, q, k, v, out, softmax_lse, dropout_p, softmax_scale, causal,
                            window_size_left, window_size_right, softcap, alibi_slopes,
                            deterministic, rng_state, dropout_row_offset=0, dropout_col_offset=0)
        -> (dq, dk, dv, softmax_d)

sinks (the last argument of fwd, varlen_fwd and fwd_kvcache: after varlen_fwd's block_table and
fwd_kvcache's cache_leftpad) is an optional (h,) float32 tensor of attention sinks (docs/sinks.md):
the forward's lse then includes them, so bwd needs nothing more for dq, dk, dv; the sinks'
gradient is -sum(exp(sinks - lse) * softmax_d) over the rows (sink_grad).

dropout_row_offset / dropout_col_offset (the last two arguments of fwd, bwd, varlen_fwd and
varlen_bwd; multiples of 16, at most 2^30, default 0): row i and key j of the call draw the
dropout mask of positions (dropout_row_offset + i, dropout_col_offset + j) of a longer sequence
(docs/dropout.md), so that a computation cut into blocks (ring attention) draws the mask of one
call over the whole sequence. A backward takes the offsets of its forward.

rng_state is an int64 tensor [seed, offset] on the tensors' device (docs/dropout.md). When
dropout_p > 0 and no rng_state is given, fwd draws one from PyTorch's default generator; the
returned rng_state is what backward needs to regenerate the same mask. Under torch.compile pass
rng_state explicitly (the autograd functions of this package do), so that the op stays a pure
function of its inputs.

Outputs are allocated here (torch.empty, torch.empty_like) and written by the C++ core in place;
inputs are read through DLPack (capsules, _dl) with their strides, without copies. So is the
workspace the core asks for (none for CPU tensors): a uint8 tensor from PyTorch's allocator, so
that device scratch lives in the caching allocator and the library never allocates memory
itself. The entry point asks for it through workspace_alloc (_launch) with the size it needs, in
the same call: a separate size query would convert and check every argument a second time. On
CUDA that is the stream's _C.KeptWorkspace, whose array serves the next calls while it holds
enough. The fake implementations need no workspace: it is internal to each op.

`call(name, *args)` is how the flash_attn_* functions invoke these ops: the implementation runs
directly when nothing needs the dispatcher (direct_call_allowed), else through torch.ops.flashattn.
"""

import atexit
import operator
from typing import Optional

import torch
from torch import Tensor
from torch.utils.dlpack import to_dlpack

from flashattn import _C
from flashattn._common import WORKSPACE_ALIGNMENT, shared_options

_RNG_STATE_LEN = 2  # [seed, offset]


def _dl(x):
    """x for _C: a tensor as a DLPack capsule (consumed by the call that imports it), anything
    else unchanged. torch.utils.dlpack.to_dlpack costs a fraction of a microsecond; handed the
    tensor itself, the extension would call Tensor.__dlpack__, a Python method that costs about
    ten times as much and, for a CUDA tensor used off the default stream, makes the default
    stream wait on the current one (the kernels run on the current stream, passed explicitly).
    Unlike Tensor.__dlpack__, to_dlpack also takes a tensor that requires grad (no detach())."""
    return to_dlpack(x) if isinstance(x, Tensor) else x


def _call(fn, *args, **kwargs):
    """fn of _C with every tensor argument passed as a DLPack capsule. Keyword arguments that are
    None are left out: the binding's default for each of them is None, and every argument passed
    costs the binding a lookup and a conversion."""
    return fn(*[_dl(a) for a in args], **{name: _dl(a) for name, a in kwargs.items() if a is not None})


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


# Per device, made on first use: its type, its index, its workspace_alloc for the _C entry
# points (nbytes → a workspace on the device, as a capsule) and, on CUDA, one per stream
# (_kept_workspace). torch.device.type costs about 0.2 µs on every access, more than this lookup.
_DEVICES: dict = {}
# Emptied at exit, while the extension's types still exist: the per-stream _C.KeptWorkspace
# objects would otherwise outlive them (nanobind reports them as leaked).
atexit.register(_DEVICES.clear)
# The current stream's handle without a torch.cuda.Stream object (microseconds less per call; the
# function inductor's generated code uses), where this PyTorch has it.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or (
    lambda: torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
# The current CUDA device's index: _CAPTURING asks about that device's current stream.
_CURRENT_DEVICE = getattr(torch._C, "_cuda_getDevice", None) or (lambda: torch.cuda.current_device())
# The largest workspace kept for a stream's next call: a decoding step's split-KV partials are a
# few MB; a long backward's dQ accumulator may be gigabytes, which stay the caching allocator's.
KEPT_WORKSPACE_MAX = 64 << 20


def _kept_workspace(device: torch.device):
    """workspace_alloc for the calls on one CUDA stream: a _C.KeptWorkspace, whose last array (up
    to KEPT_WORKSPACE_MAX bytes) is the next call's workspace while it holds enough, with no round
    trip into Python; a call that needs more asks it for a new one through torch.empty. Calls made
    one after the other on one stream run in that order, so the next call's kernels use the bytes
    after the last call's are done with them; another stream has its own; a call from another
    host thread while one holds it gets a workspace of its own (the keeper's busy flag, in the
    extension). Each round trip for a new workspace had cost about 7 µs of a decoding step's host
    time on an H100 machine (bench/host_overhead.py). _launch hands it out only while the stream
    is not captured into a CUDA graph: a captured call gets a workspace of the graph's own pool,
    kept by nobody here, so that replays and later calls never share one."""
    return _C.KeptWorkspace(lambda nbytes: to_dlpack(_workspace(nbytes, device)), KEPT_WORKSPACE_MAX)


def _launch(device: torch.device):
    """(num_threads, workspace_alloc, stream) of a call on device: the CPU backend's threads (it
    follows torch.set_num_threads, as PyTorch's own CPU kernels do; 0 elsewhere), the allocator
    of its scratch (on CUDA the stream's _kept_workspace, unless the stream is being captured
    into a CUDA graph), and the current CUDA stream's handle (0 off CUDA)."""
    entry = _DEVICES.get(device)
    if entry is None:
        entry = _DEVICES[device] = (device.type, device.index, lambda nbytes: to_dlpack(_workspace(nbytes, device)),
                                    {})
    kind, index, alloc, streams = entry
    if kind == "cpu":
        return torch.get_num_threads(), alloc, 0
    if kind != "cuda":
        return 0, alloc, 0
    if _RAW_STREAM is not None and index is not None:
        stream = _RAW_STREAM(index)
    else:
        stream = torch.cuda.current_stream(device).cuda_stream
    # (Capture is asked about the current device's stream: for tensors on another device the
    # answer says nothing about theirs, and such a call takes a workspace of its own.)
    if _CAPTURING() or index != _CURRENT_DEVICE():
        return 0, alloc, stream
    kept = streams.get(stream)
    if kept is None:
        kept = streams[stream] = _kept_workspace(device)
    return 0, kept, stream


def release_kept_workspaces() -> None:
    """Forgets every stream's kept workspace (flashattn.release_workspaces): PyTorch's caching
    allocator gets the bytes back once the calls that used them are done, which the stream order
    ensures."""
    for entry in _DEVICES.values():
        entry[3].clear()


def _stream(device: torch.device) -> int:
    return _launch(device)[2]


def _row_stats(shape, device) -> Tensor:
    """An fp32 lse / softmax_d tensor. Row-major strides are spelled out so that an empty one
    (seqlen_q == 0) has the strides the core's contiguity check expects (products of the sizes,
    zeros included) rather than PyTorch's. (Here and in _new_out, torch.empty gets the sizes as
    separate arguments: handed a tuple, its argument parsing takes about a microsecond more per
    call.)"""
    if 0 not in shape:  # then PyTorch's contiguous strides are those products
        return torch.empty(*shape, dtype=torch.float32, device=device)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return torch.empty_strided(tuple(shape), tuple(reversed(strides)), dtype=torch.float32, device=device)


_CONTIGUOUS = torch.contiguous_format


# FP8 inputs (float8_e4m3fn q, k, v) give a bfloat16 out, as in FlashAttention-3 (docs/fp8.md).
_FP8 = getattr(torch, "float8_e4m3fn", None)
_FP8_OUT = torch.bfloat16


def _out_dtype(q: Tensor) -> torch.dtype:
    return _FP8_OUT if q.dtype is _FP8 else q.dtype


def _new_out(q: Tensor, head_dim: int, head_dim_v: int) -> Tensor:
    """A forward's out: q's shape with head dim head_dim_v (q's is head_dim), q's dtype (bfloat16
    for FP8 inputs) and device, contiguous. Where the head dims and dtypes agree, torch.empty_like
    makes the same tensor as torch.empty in about 0.3 µs less."""
    if q.dtype is _FP8:
        return torch.empty(*q.shape[:-1], head_dim_v, dtype=_FP8_OUT, device=q.device)
    if head_dim == head_dim_v:
        return torch.empty_like(q, memory_format=_CONTIGUOUS)
    return torch.empty(*q.shape[:-1], head_dim_v, dtype=q.dtype, device=q.device)


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
        raise _C.Error(
            "rng_state: backward with dropout_p > 0 needs the rng_state returned by the forward"
        )
    return rng_state.detach()


def _options(num_threads, softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic=False,
             num_splits=0, dropout_row_offset=0, dropout_col_offset=0):
    """The call's Options, shared with other calls of the same values (never modified: the C++
    side copies it; see shared_options)."""
    return shared_options(softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic,
                          num_threads, num_splits, dropout_row_offset, dropout_col_offset)


# --- batch mode ------------------------------------------------------------------------------


def _fwd(
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
    sinks: Optional[Tensor] = None,
    dropout_row_offset: int = 0,
    dropout_col_offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv) -> out (b, sq, h, dv),
    softmax_lse (b, h, sq) fp32, rng_state (2,) int64."""
    return _fwd_into(None, q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                     softcap, alibi_slopes, rng_state, sinks, dropout_row_offset, dropout_col_offset)


def _fwd_into(out, q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
              alibi_slopes, rng_state, sinks=None, dropout_row_offset=0, dropout_col_offset=0, *, need_lse=True):
    """_fwd writing into `out` (the caller's (b, sq, h, dv) tensor; None: a new one). need_lse
    False: no softmax_lse is allocated or written (None in its place)."""
    b, sq, h, _ = q.shape
    return _forward_call(out, (b, h, sq), q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                         window_size_right, softcap, alibi_slopes, rng_state, sinks, dropout_row_offset,
                         dropout_col_offset, need_lse)


def _forward_call(out, lse_shape, q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                  softcap, alibi_slopes, rng_state, sinks, dropout_row_offset, dropout_col_offset, need_lse,
                  **varlen):
    """The forward of _fwd_into and _varlen_fwd_into: `out` (None: a new one) and a softmax_lse of
    lse_shape (None where need_lse is False) written; varlen: the varlen/paged keywords of
    _C.forward. Returns (out, lse, rng_state)."""
    if out is None:
        out = _new_out(q, q.shape[-1], v.shape[-1])
    lse = _row_stats(lse_shape, q.device) if need_lse else None
    state = _rng_state_for(rng_state, dropout_p, q.device)
    num_threads, alloc, stream = _launch(q.device)
    opt = _options(num_threads, softmax_scale, causal, window_size_left, window_size_right, softcap, dropout_p,
                   dropout_row_offset=dropout_row_offset, dropout_col_offset=dropout_col_offset)
    _call(
        _C.forward,
        q, k, v, out, lse,
        options=opt,
        alibi_slopes=alibi_slopes,
        rng_state=state if dropout_p > 0.0 else None,
        workspace_alloc=alloc,
        stream=stream,
        sinks=sinks,
        **varlen,
    )
    return out, lse, state


fwd = torch.library.custom_op("flashattn::fwd", mutates_args=())(_fwd)


@fwd.register_fake
def _fwd_fake(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
              softcap, alibi_slopes, rng_state, sinks=None, dropout_row_offset=0, dropout_col_offset=0):
    b, sq, h, _ = q.shape
    return (
        q.new_empty((b, sq, h, v.shape[-1]), dtype=_out_dtype(q)),
        q.new_empty((b, h, sq), dtype=torch.float32),
        q.new_empty((_RNG_STATE_LEN,), dtype=torch.int64),
    )


def _bwd(
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
    dropout_row_offset: int = 0,
    dropout_col_offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> dq, dk, dv (shapes of q, k, v; contiguous), softmax_d (b, h, sq) fp32."""
    b, sq, h, _ = q.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    softmax_d = _row_stats((b, h, sq), q.device)
    inputs = (dout, q, k, v, out, softmax_lse)
    num_threads, alloc, stream = _launch(q.device)
    opt = _options(num_threads, softmax_scale, causal, window_size_left, window_size_right, softcap, dropout_p,
                   deterministic, dropout_row_offset=dropout_row_offset, dropout_col_offset=dropout_col_offset)
    _call(
        _C.backward,
        *inputs, dq, dk, dv, softmax_d,
        options=opt,
        alibi_slopes=alibi_slopes,
        rng_state=_require_rng_state(rng_state, dropout_p),
        workspace_alloc=alloc,
        stream=stream,
    )
    return dq, dk, dv, softmax_d


bwd = torch.library.custom_op("flashattn::bwd", mutates_args=())(_bwd)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, softmax_lse, dropout_p, softmax_scale, causal, window_size_left,
              window_size_right, softcap, alibi_slopes, deterministic, rng_state, dropout_row_offset=0,
              dropout_col_offset=0):
    b, sq, h, _ = q.shape
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        q.new_empty((b, h, sq), dtype=torch.float32),
    )


# --- varlen mode -----------------------------------------------------------------------------


def _varlen_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Optional[Tensor],
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
    block_table: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    dropout_row_offset: int = 0,
    dropout_col_offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """q (total_q, h, d), k (total_k, hk, d), v (total_k, hk, dv), cu_seqlens_q/k (b + 1) int32
    -> out (total_q, h, dv), softmax_lse (h, total_q) fp32, rng_state (2,) int64.
    block_table (b, max_blocks_per_seq) int32 (paged prefill): k/v are paged caches
    (num_blocks, page_size, hk, d/dv), the key counts seqused_k (or cu_seqlens_k, then optional)."""
    return _varlen_fwd_into(None, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                            dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                            alibi_slopes, rng_state, block_table, sinks, dropout_row_offset, dropout_col_offset)


def _varlen_fwd_into(out, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, dropout_p,
                     softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
                     rng_state, block_table=None, sinks=None, dropout_row_offset=0, dropout_col_offset=0, *,
                     need_lse=True):
    """_varlen_fwd writing into `out` (the caller's (total_q, h, dv) tensor; None: a new one);
    need_lse as for _fwd_into."""
    total_q, h, _ = q.shape
    return _forward_call(out, (h, total_q), q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                         window_size_right, softcap, alibi_slopes, rng_state, sinks, dropout_row_offset,
                         dropout_col_offset, need_lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                         seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         block_table=block_table)


varlen_fwd = torch.library.custom_op("flashattn::varlen_fwd", mutates_args=())(_varlen_fwd)


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                     dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                     alibi_slopes, rng_state, block_table=None, sinks=None, dropout_row_offset=0,
                     dropout_col_offset=0):
    total_q, h, _ = q.shape
    return (
        q.new_empty((total_q, h, v.shape[-1]), dtype=_out_dtype(q)),
        q.new_empty((h, total_q), dtype=torch.float32),
        q.new_empty((_RNG_STATE_LEN,), dtype=torch.int64),
    )


def _varlen_bwd(
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
    dropout_row_offset: int = 0,
    dropout_col_offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> dq, dk, dv (shapes of q, k, v; contiguous), softmax_d (h, total_q) fp32."""
    total_q, h, _ = q.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    softmax_d = _row_stats((h, total_q), q.device)
    inputs = (dout, q, k, v, out, softmax_lse)
    num_threads, alloc, stream = _launch(q.device)
    opt = _options(num_threads, softmax_scale, causal, window_size_left, window_size_right, softcap, dropout_p,
                   deterministic, dropout_row_offset=dropout_row_offset, dropout_col_offset=dropout_col_offset)
    varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    _call(
        _C.backward,
        *inputs, dq, dk, dv, softmax_d,
        options=opt,
        alibi_slopes=alibi_slopes,
        rng_state=_require_rng_state(rng_state, dropout_p),
        workspace_alloc=alloc,
        stream=stream,
        **varlen,
    )
    return dq, dk, dv, softmax_d


varlen_bwd = torch.library.custom_op("flashattn::varlen_bwd", mutates_args=())(_varlen_bwd)


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                     max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                     window_size_right, softcap, alibi_slopes, deterministic, rng_state,
                     dropout_row_offset=0, dropout_col_offset=0):
    total_q, h, _ = q.shape
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        q.new_empty((h, total_q), dtype=torch.float32),
    )


# --- KV cache --------------------------------------------------------------------------------


def _fwd_kvcache(
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
    cache_leftpad: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """q (b, sq, h, d) against k_cache/v_cache (b_cache, sk_cache, hk, d/dv), or paged
    (num_blocks, page_size, hk, d/dv) with block_table (b, max_blocks) int32. k/v
    (b, sk_new, hk, d/dv) are written into the caches in place at cache_seqlens first.
    -> out (b, sq, h, dv), softmax_lse (b, h, sq) fp32. num_splits: split-KV of the CUDA forward
    (0: heuristic, 1: never, n: n splits); the CPU backend ignores it. cache_leftpad (b,) int32:
    the keys of sequence i start at row cache_leftpad[i] of its cache row."""
    return _fwd_kvcache_into(None, q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin,
                             cache_batch_idx, block_table, alibi_slopes, softmax_scale, causal,
                             window_size_left, window_size_right, softcap, rotary_interleaved, num_splits,
                             cache_leftpad, sinks)


def _fwd_kvcache_into(out, q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
                      block_table, alibi_slopes, softmax_scale, causal, window_size_left, window_size_right,
                      softcap, rotary_interleaved, num_splits, cache_leftpad=None, sinks=None, *, need_lse=True):
    """_fwd_kvcache writing into `out` (the caller's (b, sq, h, dv) tensor; None: a new one);
    need_lse as for _fwd_into."""
    b, sq, h, d = q.shape
    device = q.device
    if out is None:
        out = _new_out(q, d, v_cache.shape[-1])
    lse = _row_stats((b, h, sq), device) if need_lse else None
    num_threads, alloc, stream = _launch(device)
    opt = shared_options(softmax_scale, causal, window_size_left, window_size_right, softcap, 0.0, False, num_threads,
                         num_splits)
    # Spelled out rather than through _call, whose list and dict cost more than the binding's
    # conversion of the optional tensors left None: this is a decoding step's whole Python cost
    # beside the checks (bench/host_overhead.py). Every tensor here is a torch.Tensor (the op's
    # schema, or the checks of flash_attn_with_kvcache, say so). The inputs a decoding step
    # rarely has are left out where they are all None: each keyword the binding matches costs
    # about 0.1 µs even as None (0.6 µs for these six, against 7.6 µs for the whole call on a
    # 2-core CPU host). (A dict of the given ones, passed as **kwargs, saves almost nothing: the
    # binding's parsing of a dict costs as much.)
    if (rotary_cos is None and rotary_sin is None and cache_batch_idx is None and cache_leftpad is None
            and alibi_slopes is None and sinks is None):
        _C.forward_kvcache(
            to_dlpack(q), to_dlpack(k_cache), to_dlpack(v_cache), to_dlpack(out),
            None if lse is None else to_dlpack(lse),
            options=opt,
            k=None if k is None else to_dlpack(k),
            v=None if v is None else to_dlpack(v),
            cache_seqlens=None if cache_seqlens is None else to_dlpack(cache_seqlens),
            block_table=None if block_table is None else to_dlpack(block_table),
            rotary_interleaved=rotary_interleaved,
            workspace_alloc=alloc,
            stream=stream,
        )
        return out, lse
    _C.forward_kvcache(
        to_dlpack(q), to_dlpack(k_cache), to_dlpack(v_cache), to_dlpack(out), None if lse is None else to_dlpack(lse),
        options=opt,
        k=None if k is None else to_dlpack(k),
        v=None if v is None else to_dlpack(v),
        cache_seqlens=None if cache_seqlens is None else to_dlpack(cache_seqlens),
        cache_batch_idx=None if cache_batch_idx is None else to_dlpack(cache_batch_idx),
        cache_leftpad=None if cache_leftpad is None else to_dlpack(cache_leftpad),
        block_table=None if block_table is None else to_dlpack(block_table),
        rotary_cos=None if rotary_cos is None else to_dlpack(rotary_cos),
        rotary_sin=None if rotary_sin is None else to_dlpack(rotary_sin),
        rotary_interleaved=rotary_interleaved,
        alibi_slopes=None if alibi_slopes is None else to_dlpack(alibi_slopes),
        workspace_alloc=alloc,
        stream=stream,
        sinks=None if sinks is None else to_dlpack(sinks),
    )
    return out, lse


fwd_kvcache = torch.library.custom_op("flashattn::fwd_kvcache", mutates_args=("k_cache", "v_cache"))(
    _fwd_kvcache
)


@fwd_kvcache.register_fake
def _fwd_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin,
                      cache_batch_idx, block_table, alibi_slopes, softmax_scale, causal,
                      window_size_left, window_size_right, softcap, rotary_interleaved, num_splits,
                      cache_leftpad=None, sinks=None):
    b, sq, h, _ = q.shape
    return (
        q.new_empty((b, sq, h, v_cache.shape[-1])),
        q.new_empty((b, h, sq), dtype=torch.float32),
    )


# --- combine -----------------------------------------------------------------------------------


def combine(out_partial: Tensor, lse_partial: Tensor, out: Tensor, lse: Optional[Tensor] = None) -> None:
    """The core's combine, in place: merges partial results over disjoint key sets.
    out_partial (splits, b, sq, h, dv) fp32 and lse_partial (splits, b, h, sq) fp32 contiguous ->
    out (b, sq, h, dv) of any float dtype (last dim contiguous) and lse (b, h, sq) fp32
    contiguous. A split whose lse is not finite (a row that saw no key there) counts for nothing.
    Not differentiable (no autograd history is recorded)."""
    _call(_C.combine, out_partial.detach(), lse_partial.detach(), out, lse, stream=_stream(out_partial.device))


# --- the sinks' gradient ------------------------------------------------------------------------


def sink_grad(sinks: Tensor, lse: Tensor, softmax_d: Tensor) -> Tensor:
    """d loss / d sinks (h,) float32 from the forward's lse and the backward's softmax_d = rowsum(dout
    * out), both (b, h, sq) or varlen (h, total_q): -sum over the rows of exp(sinks - lse) * softmax_d
    (docs/sinks.md). Rows that no sequence covers (lse = +inf, softmax_d = 0) add 0."""
    if lse.dim() == 3:
        weights = torch.exp(sinks.view(1, -1, 1) - lse)
        return -(weights * softmax_d).sum(dim=(0, 2))
    weights = torch.exp(sinks.view(-1, 1) - lse)
    return -(weights * softmax_d).sum(dim=1)


# --- direct calls ------------------------------------------------------------------------------

_IMPLS = {"fwd": _fwd, "bwd": _bwd, "varlen_fwd": _varlen_fwd, "varlen_bwd": _varlen_bwd,
          "fwd_kvcache": _fwd_kvcache}
# The forwards that can write the caller's out tensor directly (call_into).
_IMPLS_INTO = {"fwd": _fwd_into, "varlen_fwd": _varlen_fwd_into, "fwd_kvcache": _fwd_kvcache_into}
# The arguments each op writes in place (a tuple of them from its arguments): fwd_kvcache's
# k_cache and v_cache.
_MUTATED = {"fwd_kvcache": operator.itemgetter(1, 2)}
_CHECKS = ("_len_torch_dispatch_stack", "_is_torch_function_mode_enabled", "_are_functorch_transforms_active")
_DIRECT = all(hasattr(torch._C, name) for name in _CHECKS) and hasattr(torch.autograd, "_profiler_enabled")
# The state functions direct_call_allowed asks on every call, looked up once (each lookup through
# torch._C costs about as much as the call itself). Under torch.compile only is_compiling is
# traced: the others are not reached there.
if _DIRECT:
    _modes_active = (torch.autograd._profiler_enabled, torch._C._len_torch_dispatch_stack,
                     torch._C._is_torch_function_mode_enabled, torch._C._are_functorch_transforms_active)
    _profiler_enabled, _dispatch_modes, _function_modes, _functorch_active = _modes_active
# (torch.compile recognises the function itself, under any name: traced, it is True.)
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch._C.is_grad_enabled
# The argument types of the ops that are never tensors.
_PLAIN_TYPES = frozenset((bool, int, float, str))


def direct_call_allowed(args) -> bool:
    """Whether an op call with these arguments may run its implementation directly instead of
    through the torch.library dispatcher, which adds tens of microseconds per call — as much as a
    whole decoding step's kernels. Only for plain CPU/CUDA tensors in eager mode: torch.compile,
    dispatch and function modes (FakeTensor, FlopCounterMode, a torch.device context), functorch
    transforms (vmap, grad), the profiler (which records the op by name), tensor subclasses,
    other devices and inputs that autograd would track all take the registered op, which serves
    them (or refuses them, as for autograd: the differentiable entry points are the autograd
    functions of _torch_api, which call the ops with gradients off)."""
    if not _DIRECT or torch.compiler.is_compiling():
        return False
    profiler, dispatch_modes, function_modes, functorch = _modes_active
    if profiler() or dispatch_modes() or function_modes() or functorch():
        return False
    grad = _grad_enabled()
    # A plain loop (a generator costs a microsecond more over the twenty arguments of the KV-cache
    # op, most of them None or numbers), None first and then the other plain types by their type
    # alone (isinstance costs more). A plain tensor is told by its type alone; any other instance
    # of Tensor is a subclass.
    for a in args:
        if a is None:
            continue
        t = type(a)
        if t is Tensor:
            if not (a.is_cuda or a.is_cpu) or (grad and a.requires_grad):
                return False
        elif t not in _PLAIN_TYPES and isinstance(a, Tensor):
            return False
    return True


def _plain_tensor(x, grad) -> bool:
    """Whether direct_call_allowed lets the tensor argument x through (grad: gradients are on)."""
    return type(x) is Tensor and (x.is_cuda or x.is_cpu) and not (grad and x.requires_grad)


def call_fwd_kvcache_into(out, q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
                          block_table, alibi_slopes, softmax_scale, causal, window_size_left, window_size_right,
                          softcap, rotary_interleaved, num_splits, cache_leftpad, sinks, *, need_lse):
    """call_into("fwd_kvcache", out, q, ..., sinks, need_lse=need_lse), for flash_attn_with_kvcache,
    whose checks leave only some arguments to test: q, k_cache and v_cache are torch.Tensors, the
    other tensors torch.Tensors or None, softmax_scale a float, window_size_* and num_splits
    ints. A call without out= that direct_call_allowed would let through is tested here on its
    tensor arguments and the three values the caller passes as they are, by the same rules, and
    runs the op's implementation directly; anything else goes to call_into. On a 2-core CPU host
    this adds 2.7 µs to the implementation's time where call_into adds 3.9 µs: the generic
    test's loop over the twenty arguments, their packing into a tuple and unpacking, and the
    lookup of the mutated arguments are left out."""
    # (Plain bool/int/float values for causal, softcap and rotary_interleaved: then none of them
    # is a tensor. Anything else, a 0-d tensor or a NumPy scalar, takes the generic test.)
    if (out is None and _DIRECT and not _is_compiling()
            and type(causal) in _PLAIN_TYPES and type(softcap) in _PLAIN_TYPES
            and type(rotary_interleaved) in _PLAIN_TYPES
            and not (_profiler_enabled() or _dispatch_modes() or _function_modes() or _functorch_active())):
        grad = _grad_enabled()
        # (_plain_tensor spelled out for the three tensors every call has: 0.25 µs less.)
        if (type(q) is Tensor and type(k_cache) is Tensor and type(v_cache) is Tensor
                and (q.is_cuda or q.is_cpu) and (k_cache.is_cuda or k_cache.is_cpu)
                and (v_cache.is_cuda or v_cache.is_cpu)
                and not (grad and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad))
                and (cache_seqlens is None or _plain_tensor(cache_seqlens, grad))
                and (k is None or _plain_tensor(k, grad)) and (v is None or _plain_tensor(v, grad))
                and (block_table is None or _plain_tensor(block_table, grad))
                and (rotary_cos is None or _plain_tensor(rotary_cos, grad))
                and (rotary_sin is None or _plain_tensor(rotary_sin, grad))
                and (cache_batch_idx is None or _plain_tensor(cache_batch_idx, grad))
                and (cache_leftpad is None or _plain_tensor(cache_leftpad, grad))
                and (alibi_slopes is None or _plain_tensor(alibi_slopes, grad))
                and (sinks is None or _plain_tensor(sinks, grad))):
            result = _IMPLS_INTO["fwd_kvcache"](
                None, q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
                block_table, alibi_slopes, softmax_scale, causal, window_size_left, window_size_right, softcap,
                rotary_interleaved, num_splits, cache_leftpad, sinks, need_lse=need_lse)
            _increment_versions((k_cache, v_cache))
            return result
    return call_into("fwd_kvcache", out, q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin,
                     cache_batch_idx, block_table, alibi_slopes, softmax_scale, causal, window_size_left,
                     window_size_right, softcap, rotary_interleaved, num_splits, cache_leftpad, sinks,
                     need_lse=need_lse)


def call(name: str, *args):
    """torch.ops.flashattn.<name>(*args), run directly when direct_call_allowed (the same
    implementation, the same results; the version counters of the tensors the op mutates are
    bumped as the dispatcher would)."""
    if direct_call_allowed(args):
        result = _IMPLS[name](*args)
        _bump_versions(name, args)
        return result
    return getattr(torch.ops.flashattn, name)(*args)



def _kernel_layout(out: Tensor, head_dim_v: int) -> bool:
    """Whether the core can write `out` as the op's out: its head dim (no padding sliced off),
    the last dimension contiguous, 16-byte aligned, the other strides multiples of 8 elements."""
    return (out.shape[-1] == head_dim_v and out.stride(-1) == 1 and out.data_ptr() % 16 == 0
            and all(s % 8 == 0 for s in out.stride()[:-1]))


def _takes_tuples(increment) -> bool:
    """Whether torch._C._increment_version takes a tuple of tensors, as newer PyTorch's does (older
    ones take one tensor)."""
    try:
        increment((torch.empty(0),))
    except (TypeError, RuntimeError):
        return False
    return True


# One call for all the tensors of a call where this PyTorch allows it (about 0.3 µs less than a
# call of torch.autograd.graph.increment_version per tensor, which wraps it).
_increment_versions = (torch._C._increment_version if _takes_tuples(torch._C._increment_version)
                       else lambda tensors: [torch.autograd.graph.increment_version(t) for t in tensors])


def _bump_versions(name, args, out=None):
    """The version counters of the tensors a direct call of op `name` wrote in place (its mutated
    arguments, and the caller's out), bumped as the dispatcher would."""
    mutated = _MUTATED.get(name)
    written = () if mutated is None else mutated(args)
    if out is not None:
        written += (out,)
    if written:
        _increment_versions(written)


def call_into(name: str, out: Optional[Tensor], *args, need_lse: bool = True):
    """call(name, *args) for a forward (fwd, varlen_fwd, fwd_kvcache) whose result goes into
    `out`, a flash_attn_* function's out= (None: a new tensor), already checked against the
    caller's result shape, dtype and device. Its head dim may be the caller's, narrower than the
    zero-padded one the op computes (args[2], v or v_cache, has the op's). Where the op may run
    directly (direct_call_allowed) and out is exactly the op's out in the kernels' layout (last
    dimension contiguous, 16-byte aligned, other strides multiples of 8 elements), the core writes
    out itself after validating the call, so nothing is written when it refuses. Otherwise the op
    runs as usual and its result is copied into out. Returns the op's values with out first.
    need_lse False: the caller drops the softmax_lse, so a direct call neither allocates nor
    writes it and returns None in its place (the op through the dispatcher always returns it)."""
    if out is None:
        if not direct_call_allowed(args):
            return getattr(torch.ops.flashattn, name)(*args)
        result = _IMPLS_INTO[name](None, *args, need_lse=need_lse)
        _bump_versions(name, args)
        return result
    # (direct_call_allowed first: under torch.compile it is False, and data_ptr is not traced.)
    if direct_call_allowed(args + (out,)) and _kernel_layout(out, args[2].shape[-1]):
        result = _IMPLS_INTO[name](out, *args, need_lse=need_lse)
        _bump_versions(name, args, out)
        return result
    result = call(name, *args)
    with torch.no_grad():
        out.copy_(result[0][..., :out.shape[-1]])
    return (out,) + tuple(result[1:])
