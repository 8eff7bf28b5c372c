"""flashattn — exact fused attention (FlashAttention) over a C++ core.

The functions below have the names, positional order, defaults and return values of the
``flash_attn`` 2.x package. They take PyTorch tensors (with autograd) or NumPy arrays (forward
only). PyTorch CPU tensors and NumPy arrays run on the CPU backend; CUDA tensors go to the CUDA
backends (a build configured with -DFLASHATTN_CUDA=ON; other builds raise flashattn.Error naming that
option).

Semantics (SPEC §2): scores softmax_scale·q·kᵀ (default 1/sqrt(headdim)), optional soft-capping
and ALiBi, a causal / sliding-window mask aligned to the bottom-right corner, dropout with
probability dropout_p. Rows with no visible key give out = 0 and lse = +inf.

Attention sinks (``sinks=``, docs/sinks.md; FlashAttention's ``learnable_sink``, vLLM's and
transformers' ``s_aux``): a (nheads,) tensor of per-head logits, in the units of the scores (not
multiplied by softmax_scale), that join each row's softmax denominator and carry no value:
lse = log(exp(sink) + Σ exp(scores)). A row with no visible key then has out = 0 and lse = sink.
Differentiable (the sinks get their gradient); float32, or cast to it from another float dtype.
flash_attn_func, flash_attn_varlen_func and flash_attn_with_kvcache take them (keyword-only).

Differences from flash_attn:
- With return_attn_probs=True the third value (S_dmask) is None: the fused kernels never
  materialise the attention probabilities.
- softmax_lse is not differentiable (as in flash_attn); gradients flow through out only.
- out= (every function): the result is written into the caller's tensor, which is returned; it
  must have the result's shape, q's dtype and device (checked before anything runs, so a refused
  out is never written), and the call must not record autograd history.
- flash_attn_varlen_func also takes, as vLLM's version does, seqused_k, return_softmax_lse and a
  paged K/V through block_table (forward only); cu_seqlens_k and the max_seqlen values may then
  be passed by keyword, cu_seqlens_k left out when seqused_k gives the key counts.
- Dropout seeds come from PyTorch's default generator of the tensors' device (NumPy: NumPy's
  global generator); see flashattn._torch_ops.draw_rng_state.
- Window sizes below -1 and a negative softcap are errors here; flashattn.flash_attn_interface
  (flash_attn's module, private functions included) reads them as "off", takes softmax_scale=0.0
  as a zero scale and returns S_dmask as an empty tensor, as flash_attn does. Code written for
  flash_attn therefore changes ``from flash_attn import ...`` to
  ``from flashattn.flash_attn_interface import ...`` (python/README.md, "Drop-in modules").

Invalid arguments raise flashattn.Error, a ValueError and a RuntimeError, whose message names the
argument.
"""

from __future__ import annotations

import numpy as _np

from flashattn import _C
from flashattn import numpy as _numpy_impl
from flashattn._C import Error, build_info, check_index_errors, compiled_backends

try:
    import torch as _torch
except ImportError:  # NumPy-only installation
    _torch = None

if _torch is not None:
    from flashattn import _torch_api
    from flashattn import _torch_ops  # noqa: F401  (registers torch.ops.flashattn.*)
else:
    _torch_api = None


def build_config() -> str:
    """How this installation was built: whether it has the CUDA backend, for which
    architectures, and why (the decision `pip install .` made; see python/README.md)."""
    try:
        from flashattn import _build_config
    except ImportError:  # run from a source tree
        return "unknown (not an installed build)"
    return _build_config.CUDA


def release_workspaces() -> None:
    """Drops the workspace each CUDA stream keeps for its next call (up to
    _torch_ops.KEPT_WORKSPACE_MAX bytes per stream that has made a call), so that
    torch.cuda.empty_cache() can return the memory; the next call on a stream allocates afresh.
    Call it between steps, not while another thread is inside a call."""
    if _torch is not None:
        _torch_ops.release_kept_workspaces()


try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("flashattn")
except PackageNotFoundError:  # run from a source tree
    __version__ = "0+unknown"

__all__ = [
    "Error",
    "build_config",
    "build_info",
    "check_index_errors",
    "compiled_backends",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "release_workspaces",
]


def _impl(name, x):
    """The implementation for the array type of the first argument."""
    if isinstance(x, _np.ndarray):
        return _numpy_impl
    if _torch is not None and isinstance(x, _torch.Tensor):
        return _torch_api
    installed = "" if _torch is not None else " (PyTorch is not installed)"
    raise TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray{installed}, got {type(x).__name__}")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    out=None, sinks=None):
    """Attention of q over k, v.

    q: (batch, seqlen_q, nheads, headdim); k: (batch, seqlen_k, nheads_k, headdim);
    v: (batch, seqlen_k, nheads_k, headdim_v). nheads % nheads_k == 0 (MQA/GQA: query head i reads
    key/value head i // (nheads // nheads_k)). float16 or bfloat16 (float32 on the CPU).
    window_size: (left, right), -1 = unbounded; query i sees keys
    [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]. causal = right 0.
    softcap > 0: scores become softcap·tanh(scores / softcap).
    alibi_slopes: (nheads,) or (batch, nheads) float32; adds -slope·|i + seqlen_k - seqlen_q - j|.
    deterministic: bitwise reproducible backward.
    sinks: (nheads,) attention sink logits (see the module docstring), or None.

    out: optional (batch, seqlen_q, nheads, headdim_v) tensor the result is written into (and
    returned); no autograd through it.

    Returns out (batch, seqlen_q, nheads, headdim_v), or with return_attn_probs=True
    (out, softmax_lse (batch, nheads, seqlen_q) float32, None).
    """
    return _impl("q", q).flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size,
                                         softcap, alibi_slopes, deterministic, return_attn_probs,
                                         out=out, sinks=sinks)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, out=None):
    """flash_attn_func with q, k, v packed: qkv (batch, seqlen, 3, nheads, headdim), read in place.
    The gradient is one packed dqkv."""
    return _impl("qkv", qkv).flash_attn_qkvpacked_func(
        qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, out)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, out=None):
    """flash_attn_func with k, v packed: kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    return _impl("q", q).flash_attn_kvpacked_func(
        q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, out)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, seqused_k=None,
                           return_softmax_lse=False, out=None, sinks=None):
    """Variable-length sequences packed along the first dimension.

    q: (total_q, nheads, headdim); k: (total_k, nheads_k, headdim); v: (total_k, nheads_k,
    headdim_v); cu_seqlens_q/k: (batch + 1,) int32 prefix sums starting at 0; max_seqlen_q/k:
    the longest sequence (required; keywords allow leaving cu_seqlens_k out, see below). Masks and
    positions count from each sequence's start. seqused_k: (batch,) int32, only the first
    seqused_k[i] keys of sequence i are used.

    Paged prefill (vLLM's call): with block_table (batch, max_blocks_per_seq) int32, k and v are
    paged caches (num_blocks, page_size, nheads_k, headdim[_v]) and row i of block_table lists the
    pages of sequence i in order. The key count of sequence i is seqused_k[i] (vLLM), or its
    cu_seqlens_k length when seqused_k is None (flash_attn); cu_seqlens_k may be None then. With
    both, seqused_k[i] may not exceed the cu_seqlens_k length. Forward only (no autograd).

    sinks: (nheads,) attention sink logits (see the module docstring), or None.

    out: optional (total_q, nheads, headdim_v) tensor the result is written into (and returned);
    no autograd through it. Returns out, or (out, softmax_lse (nheads, total_q)) with
    return_softmax_lse=True, or (out, softmax_lse, None) with return_attn_probs=True.
    """
    return _impl("q", q).flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
        causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table,
        seqused_k, return_softmax_lse, out=out, sinks=sinks)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0,
                                     alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, out=None):
    """flash_attn_varlen_func with qkv (total, 3, nheads, headdim) and one cu_seqlens."""
    return _impl("qkv", qkv).flash_attn_varlen_qkvpacked_func(
        qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, deterministic, return_attn_probs, out)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False, *, out=None):
    """flash_attn_varlen_func with kv (total_k, 2, nheads_k, headdim)."""
    return _impl("q", q).flash_attn_varlen_kvpacked_func(
        q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
        causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, out)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, out=None,
                            sinks=None):
    """Decoding / chunked prefill against a KV cache (forward only).

    q: (batch, seqlen_q, nheads, headdim). k_cache/v_cache: (batch_cache, seqlen_cache, nheads_k,
    headdim[_v]), or paged (num_blocks, page_size, nheads_k, headdim[_v]) with block_table
    (batch, max_blocks_per_seq) int32. k/v (batch, seqlen_new, nheads_k, headdim[_v]), when given,
    are written into the caches IN PLACE at positions cache_seqlens[i] ... (then attended to).
    cache_seqlens: int or (batch,) int32, the valid keys per sequence before the append (None:
    the whole cache). cache_batch_idx: (batch,) int32 cache row of each sequence.
    cache_leftpad: (batch,) int32 left padding (needs cache_seqlens; not with block_table): the
    keys of sequence i are cache rows [cache_leftpad[i], cache_seqlens[i] + seqlen_new), with mask
    and ALiBi positions counted from cache_leftpad[i]; k/v and rotary positions stay cache rows.
    rotary_cos/rotary_sin: (seqlen_ro, rotary_dim / 2); k is rotated at its cache positions, q at
    cache_seqlens + i when causal or windowed, else at cache_seqlens. rotary_interleaved pairs
    dims (0, 1), (2, 3), ... instead of (i, i + rotary_dim / 2). num_splits: split-KV on
    CUDA (0: heuristic, 1: never split, n: n splits); ignored on the CPU. Head dims that are not a
    multiple of 8 work as elsewhere (the caches are then zero-padded copies, and appended rows are
    copied back into the caller's caches). sinks: (nheads,) attention sink logits, or None. out:
    optional (batch, seqlen_q, nheads, headdim_v) tensor the result is written into (and returned).
    Returns out, or (out, softmax_lse (batch, nheads, seqlen_q)).
    """
    return _impl("q", q).flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
        alibi_slopes, num_splits, return_softmax_lse, out=out, sinks=sinks)
