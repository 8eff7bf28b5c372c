"""flashattn.flash_attn_interface — the module ``flash_attn.flash_attn_interface`` of the
``flash_attn`` 2.x package (2.7/2.8) over this library, for code that imports from it directly:

    from flashattn.flash_attn_interface import flash_attn_func, _flash_attn_forward, ...

It has the seven public functions and the four private ones that ring-attention and other
training code call (``_flash_attn_forward``, ``_flash_attn_backward``,
``_flash_attn_varlen_forward``, ``_flash_attn_varlen_backward``) with flash_attn's argument
names, order and defaults — plain Python functions, so ``inspect.getfullargspec`` reads them —
and its return values:

- ``_flash_attn_forward`` / ``_flash_attn_varlen_forward`` -> ``(out, softmax_lse, S_dmask,
  rng_state)``: softmax_lse float32 (batch, nheads, seqlen_q) or (nheads, total_q), rng_state the
  int64 pair [seed, offset] that the backward needs when dropout_p > 0;
- ``_flash_attn_backward`` / ``_flash_attn_varlen_backward`` write dq, dk, dv IN PLACE (any of
  them may be None) and return softmax_d, float32 (batch, nheads, seqlen_q) or (nheads, total_q).

flash_attn's argument conventions hold here (the top-level ``flashattn`` functions are stricter
and reject these values):

- a negative window size (either side) means unbounded, as -1 does;
- softcap <= 0 means no soft-capping;
- softmax_scale=0.0 is a scale of zero — every score 0, so each query averages the values of the
  keys it sees (with ALiBi: weighted by the bias alone) — and only None means 1/sqrt(headdim);
- S_dmask (the third value with return_attn_probs=True / return_softmax=True) is an empty tensor:
  the fused kernels never form the attention probabilities. flash_attn returns the same empty
  tensor without dropout and the probabilities with the dropout pattern in their sign with
  dropout; here the dropout pattern is instead a pure function of rng_state, recomputable as
  docs/dropout.md describes.

leftpad_k of the varlen forward (keys of sequence i from row cu_seqlens_k[i] + leftpad_k[i] on,
seqused_k[i] - leftpad_k[i] of them, or its cu_seqlens_k length minus leftpad_k[i]; masks count
from there) is served as a paged K/V of one-row pages, without copying the keys; not with
block_table (flash_attn refuses that too). block_table (paged K/V) works in the varlen forward,
as in flash_attn forward only. Every public function also
takes out= (keyword), and flash_attn_varlen_func seqused_k and return_softmax_lse, as vLLM's
version of this module does. Invalid arguments raise flashattn.Error, which is both a ValueError and a RuntimeError
(flash_attn raises RuntimeError from its C++ checks).

Head dims that are not a multiple of 8 work everywhere (zero-padded for the kernels, sliced off
the results). The private functions do not record autograd history: they are the building blocks
of a caller's own torch.autograd.Function.
"""

from __future__ import annotations

import numpy as np
import torch

import flashattn
from flashattn import _torch_ops
from flashattn._common import check_dropout_p, resolve_softmax_scale, window_pair
from flashattn._torch_api import _pad_head_dim
from flashattn._torch_ops import draw_rng_state

# The seven public functions, defined below with flash_attn's conventions.
__all__ = [name for name in flashattn.__all__ if name.startswith("flash_attn_")]

# The core reads softmax_scale = 0 as "the default, 1/sqrt(d)". flash_attn's literal zero is
# passed as the smallest normal float32 instead: scale·(q·k) then rounds to 0 in the scores (the
# exponentials are exactly 1) for any |q·k| below about 1e31, and the gradients through the
# scale (dq, dk) are below float32's normal range, where they vanish as a zero scale's do.
_ZERO_SCALE = float(np.finfo(np.float32).tiny)


# --- flash_attn's argument conventions -> the core's ------------------------------------------


def _scale_or_default(softmax_scale):
    """softmax_scale for the top-level functions: None stays the default, 0.0 becomes zero."""
    if softmax_scale is None:
        return None
    return _ZERO_SCALE if float(softmax_scale) == 0.0 else float(softmax_scale)


def _scale(softmax_scale, head_dim):
    """softmax_scale for the ops, resolved against the caller's head dim."""
    scale = resolve_softmax_scale(softmax_scale, head_dim)
    return _ZERO_SCALE if scale == 0.0 else scale


def _window(left, right):
    """(left, right) with every negative size read as unbounded (-1)."""
    return (-1 if left < 0 else int(left)), (-1 if right < 0 else int(right))


def _window_size(window_size):
    return _window(*window_pair(window_size))


def _softcap(softcap):
    return float(softcap) if softcap > 0 else 0.0


def _empty_s_dmask(x):
    """flash_attn's S_dmask when the probabilities are not returned: an empty tensor."""
    if isinstance(x, np.ndarray):
        return np.empty((0,), dtype=x.dtype)
    return torch.empty((0,), dtype=x.dtype, device=x.device)


def _with_s_dmask(result, x):
    """(out, lse, None) from the top-level functions -> (out, lse, empty S_dmask)."""
    if isinstance(result, tuple) and len(result) == 3:
        out, lse, _ = result
        return out, lse, _empty_s_dmask(x)
    return result


# --- the seven public functions ------------------------------------------------------------------


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    out=None):
    """flashattn.flash_attn_func with flash_attn's argument conventions (see the module)."""
    return _with_s_dmask(flashattn.flash_attn_func(
        q, k, v, dropout_p, _scale_or_default(softmax_scale), causal, _window_size(window_size),
        _softcap(softcap), alibi_slopes, deterministic, return_attn_probs, out=out), q)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, out=None):
    """flashattn.flash_attn_qkvpacked_func with flash_attn's argument conventions."""
    return _with_s_dmask(flashattn.flash_attn_qkvpacked_func(
        qkv, dropout_p, _scale_or_default(softmax_scale), causal, _window_size(window_size),
        _softcap(softcap), alibi_slopes, deterministic, return_attn_probs, out=out), qkv)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, out=None):
    """flashattn.flash_attn_kvpacked_func with flash_attn's argument conventions."""
    return _with_s_dmask(flashattn.flash_attn_kvpacked_func(
        q, kv, dropout_p, _scale_or_default(softmax_scale), causal, _window_size(window_size),
        _softcap(softcap), alibi_slopes, deterministic, return_attn_probs, out=out), q)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, seqused_k=None,
                           return_softmax_lse=False, out=None, s_aux=None):
    """flashattn.flash_attn_varlen_func with flash_attn's argument conventions (paged K/V through
    block_table with cu_seqlens_k or, as vLLM calls it, seqused_k and cu_seqlens_k=None; see
    flashattn's docstring). s_aux: per-head attention sinks, vLLM's name (flashattn's sinks=,
    docs/sinks.md)."""
    return _with_s_dmask(flashattn.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        _scale_or_default(softmax_scale), causal, _window_size(window_size), _softcap(softcap),
        alibi_slopes, deterministic, return_attn_probs, block_table, seqused_k=seqused_k,
        return_softmax_lse=return_softmax_lse, out=out, sinks=s_aux), q)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0,
                                     alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, out=None):
    """flashattn.flash_attn_varlen_qkvpacked_func with flash_attn's argument conventions."""
    return _with_s_dmask(flashattn.flash_attn_varlen_qkvpacked_func(
        qkv, cu_seqlens, max_seqlen, dropout_p, _scale_or_default(softmax_scale), causal,
        _window_size(window_size), _softcap(softcap), alibi_slopes, deterministic,
        return_attn_probs, out=out), qkv)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False, *, out=None):
    """flashattn.flash_attn_varlen_kvpacked_func with flash_attn's argument conventions."""
    return _with_s_dmask(flashattn.flash_attn_varlen_kvpacked_func(
        q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        _scale_or_default(softmax_scale), causal, _window_size(window_size), _softcap(softcap),
        alibi_slopes, deterministic, return_attn_probs, out=out), q)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, out=None,
                            s_aux=None):
    """flashattn.flash_attn_with_kvcache with flash_attn's argument conventions; s_aux: per-head
    attention sinks, vLLM's name (flashattn's sinks=, docs/sinks.md)."""
    return flashattn.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, _scale_or_default(softmax_scale), causal,
        _window_size(window_size), _softcap(softcap), rotary_interleaved, alibi_slopes, num_splits,
        return_softmax_lse, out=out, sinks=s_aux)


# --- the private building blocks -----------------------------------------------------------------


def _plain(x):
    """x without autograd history, its head dim zero-padded to the kernels' multiple."""
    return None if x is None else _pad_head_dim(x.detach())


def _store(dst, src):
    """Writes a gradient into the caller's buffer (flash_attn's dq/dk/dv are outputs)."""
    if dst is not None:
        with torch.no_grad():
            dst.copy_(src[..., :dst.shape[-1]])


def _zero_rows_after(x, end):
    """x (rows, ...) with the rows from index `end` on set to zero — rows that belong to no
    sequence — without reading `end` (a device tensor) back to the host."""
    keep = (torch.arange(x.shape[0], device=x.device) < end).view((-1,) + (1,) * (x.dim() - 1))
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                        window_size_right, softcap, alibi_slopes, return_softmax):
    """q (batch, seqlen_q, nheads, d), k (batch, seqlen_k, nheads_k, d), v (..., dv) ->
    (out (batch, seqlen_q, nheads, dv), softmax_lse (batch, nheads, seqlen_q) float32,
    S_dmask (empty), rng_state (2,) int64)."""
    dropout_p = check_dropout_p(dropout_p)
    left, right = _window(window_size_left, window_size_right)
    rng_state = draw_rng_state(q.device) if dropout_p > 0.0 else None
    out, lse, rng_state = _torch_ops.call(
        "fwd", _plain(q), _plain(k), _plain(v), dropout_p, _scale(softmax_scale, q.shape[-1]),
        bool(causal), left, right, _softcap(softcap), alibi_slopes, rng_state)
    return out[..., :v.shape[-1]], lse, _empty_s_dmask(q), rng_state


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p, softmax_scale, causal, window_size_left=-1,
                               window_size_right=-1, softcap=0.0, alibi_slopes=None,
                               return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False):
    """q (total_q, nheads, d), k (total_k, nheads_k, d), v (..., dv), cu_seqlens_q/k
    (batch + 1,) int32; seqused_k (batch,) int32: the keys of each sequence that are used ->
    (out (total_q, nheads, dv), softmax_lse (nheads, total_q) float32, S_dmask (empty),
    rng_state). leftpad_k (batch,) int32: the keys of sequence i start leftpad_k[i] rows into it
    (_left_padded_keys). zero_tensors: rows past cu_seqlens_q[-1] get out 0 and softmax_lse -inf
    (else they are unspecified)."""
    if leftpad_k is not None:
        k, v, cu_seqlens_k, seqused_k, block_table = _left_padded_keys(k, v, cu_seqlens_k, seqused_k, leftpad_k,
                                                                        max_seqlen_k, block_table)
    dropout_p = check_dropout_p(dropout_p)
    left, right = _window(window_size_left, window_size_right)
    rng_state = draw_rng_state(q.device) if dropout_p > 0.0 else None
    out, lse, rng_state = _torch_ops.call(
        "varlen_fwd", _plain(q), _plain(k), _plain(v), cu_seqlens_q, cu_seqlens_k, seqused_k,
        int(max_seqlen_q), int(max_seqlen_k), dropout_p, _scale(softmax_scale, q.shape[-1]),
        bool(causal), left, right, _softcap(softcap), alibi_slopes, rng_state, block_table)
    out = out[..., :v.shape[-1]]
    if zero_tensors:
        end = cu_seqlens_q[-1]
        out = _zero_rows_after(out, end)
        lse = torch.where(torch.arange(lse.shape[1], device=lse.device) < end, lse, float("-inf"))
    return out, lse, _empty_s_dmask(q), rng_state


def _left_padded_keys(k, v, cu_seqlens_k, seqused_k, leftpad_k, max_seqlen_k, block_table):
    """flash_attn's leftpad_k: sequence i's keys are rows cu_seqlens_k[i] + leftpad_k[i] ... of k,
    v (total_k, nheads_k, d), seqused_k[i] - leftpad_k[i] of them (without seqused_k, its
    cu_seqlens_k length less leftpad_k[i]); masks and ALiBi count from that row. Served as a paged
    K/V of one-row pages (views of k and v, nothing copied) whose block table (batch,
    max_seqlen_k) lists those rows in order. Checks 0 ≤ leftpad_k[i] ≤ the sequence's key count on
    the host. -> (k pages, v pages, cu_seqlens_k None, seqused_k, block_table)."""
    if block_table is not None:
        raise flashattn.Error("leftpad_k: cannot be combined with a paged K/V (block_table), as in flash_attn")
    for name, x in (("leftpad_k", leftpad_k), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or x.dim() != 1:
            got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise flashattn.Error(f"{name}: must be a 1-D int32 tensor; got {got}")
    batch = cu_seqlens_k.shape[0] - 1
    if leftpad_k.shape[0] != batch or leftpad_k.device != k.device:
        raise flashattn.Error(f"leftpad_k: must be ({batch},) on k's device; got {tuple(leftpad_k.shape)} on "
                              f"{leftpad_k.device}")
    starts, pad = cu_seqlens_k.long(), leftpad_k.long()
    counts = seqused_k.long() if seqused_k is not None else starts[1:] - starts[:-1]
    bad = (pad < 0) | (pad > counts)
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0])
        raise flashattn.Error(f"leftpad_k: entry {b} must lie in [0, {int(counts[b])}] (the keys of sequence {b}); "
                              f"got {int(pad[b])}")
    table = _one_row_pages(starts[:-1] + pad, int(max_seqlen_k), k.shape[0])
    return k.unsqueeze(1), v.unsqueeze(1), None, (counts - pad).to(torch.int32), table


def _one_row_pages(first, length, rows):
    """The block table (batch, length) int32 over `rows` pages of one row each whose sequence i
    reads rows first[i], first[i] + 1, ...: left-padded keys served as a paged K/V. Entries past a
    sequence's keys are never read; clamped, they still name a page that exists."""
    table = first.unsqueeze(1) + torch.arange(length, device=first.device)
    return table.clamp(0, max(rows - 1, 0)).to(torch.int32)


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                         causal, window_size_left, window_size_right, softcap, alibi_slopes,
                         deterministic, rng_state=None):
    """The gradients of _flash_attn_forward's out, written into dq, dk, dv (shapes of q, k, v);
    rng_state: the forward's, when dropout_p > 0. Returns softmax_d (batch, nheads, seqlen_q)
    float32, the row sums of dout·out."""
    dropout_p = check_dropout_p(dropout_p)
    left, right = _window(window_size_left, window_size_right)
    grads = _torch_ops.call(
        "bwd", _plain(dout), _plain(q), _plain(k), _plain(v), _plain(out),
        softmax_lse.detach().contiguous(), dropout_p, _scale(softmax_scale, q.shape[-1]),
        bool(causal), left, right, _softcap(softcap), alibi_slopes, bool(deterministic),
        rng_state if dropout_p > 0.0 else None)
    for dst, src in zip((dq, dk, dv), grads):
        _store(dst, src)
    return grads[3]


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                                causal, window_size_left, window_size_right, softcap, alibi_slopes,
                                deterministic, rng_state=None, zero_tensors=False):
    """The varlen counterpart of _flash_attn_backward: dq, dk, dv written in place; returns
    softmax_d (nheads, total_q) float32. zero_tensors: gradient rows past the last sequence
    (cu_seqlens_q[-1] for dq, cu_seqlens_k[-1] for dk, dv) are zero."""
    dropout_p = check_dropout_p(dropout_p)
    left, right = _window(window_size_left, window_size_right)
    grad_q, grad_k, grad_v, softmax_d = _torch_ops.call(
        "varlen_bwd", _plain(dout), _plain(q), _plain(k), _plain(v), _plain(out),
        softmax_lse.detach().contiguous(), cu_seqlens_q, cu_seqlens_k, None, int(max_seqlen_q),
        int(max_seqlen_k), dropout_p, _scale(softmax_scale, q.shape[-1]), bool(causal), left,
        right, _softcap(softcap), alibi_slopes, bool(deterministic),
        rng_state if dropout_p > 0.0 else None)
    if zero_tensors:
        grad_q = _zero_rows_after(grad_q, cu_seqlens_q[-1])
        grad_k = _zero_rows_after(grad_k, cu_seqlens_k[-1])
        grad_v = _zero_rows_after(grad_v, cu_seqlens_k[-1])
    for dst, src in zip((dq, dk, dv), (grad_q, grad_k, grad_v)):
        _store(dst, src)
    return softmax_d
