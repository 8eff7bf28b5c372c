"""flashattn.fa3 — the interface of FlashAttention-3 (``flash_attn_interface`` of its ``hopper/``
package) over this library, for code written against it:

    from flashattn.fa3 import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Its own argument order (no dropout_p: ``flash_attn_func(q, k, v, softmax_scale, causal, ...)``),
names (``page_table``, ``seqused_q/k``, ``cu_seqlens_k_new``) and return values:

- ``flash_attn_func`` / ``flash_attn_qkvpacked_func`` / ``flash_attn_varlen_func`` -> out, or
  (out, softmax_lse) with return_attn_probs=True; differentiable in q, k, v;
- ``flash_attn_with_kvcache`` -> out, or (out, softmax_lse, out_accum, softmax_lse_accum) with
  return_softmax_lse=True — the last two are empty tensors (split-KV partials stay internal here);
- ``flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None)`` -> (out,
  softmax_lse): out_partial (splits, batch, seqlen, nheads, headdim) and lse_partial (splits,
  batch, seqlen, nheads), float32; softmax_lse (batch, seqlen, nheads).

flash_attn_with_kvcache takes varlen queries (q (total_q, nheads, d) with cu_seqlens_q and
max_seqlen_q) and varlen new keys (k, v (total_new, nheads_k, d) with cu_seqlens_k_new), over a
contiguous or paged (page_table) cache: the new keys are rotated (rotary_cos/sin) and written into
the cache at cache_seqlens[i]..., then each sequence's queries attend to its cache, bottom-right
aligned as in every function here.

Attention sinks: flash_attn_func, flash_attn_varlen_func and flash_attn_with_kvcache take
``learnable_sink`` (FlashAttention's name for them) or ``s_aux`` (the name in vLLM's build of this
interface), a (nheads,) tensor of per-head logits in score units that join each row's softmax
denominator (docs/sinks.md; flashattn's own name is ``sinks``); differentiable where the function is.

Argument conventions are those of flash_attn (flashattn.flash_attn_interface): negative window
sizes and softcap <= 0 mean off, softmax_scale=0.0 is a zero scale. num_splits, pack_gqa,
sm_margin and scheduler_metadata are performance hints of FlashAttention-3's kernels: accepted
and not needed here (the CUDA backend picks its split-KV itself). What the library does not
have raises NotImplementedError naming the argument: qv, attention_chunk != 0, cache_leftpad
with FP8 inputs.

seqused_q (flash_attn_varlen_func): the used rows are gathered into a packed batch of their own,
attended, and scattered back (differentiable); the others get out 0, lse +inf and dq 0, where
FlashAttention-3 leaves them unwritten. The gather reads the counts back to the host.
cache_leftpad (flash_attn_with_kvcache, contiguous caches; page_table refuses it, as in
FlashAttention-3): the keys of sequence i are the cache rows from cache_leftpad[i] on, masks
counted from there; in the varlen path the cache is read as pages of one row. rotary_seqlens: the
rotary position of each sequence's first new key and of its queries, in place of cache_seqlens
(FlashAttention-3 reads it only when new keys are appended, and so here); such a call takes the
varlen path (rotation and append in PyTorch).

FP8 (docs/fp8.md): flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func and
flash_attn_with_kvcache (varlen queries and new keys too; no rotary) take float8_e4m3fn q, k and v (caches
and new rows) with optional (batch, nheads_k) float32 q_descale, k_descale and v_descale, and
return a bfloat16 out, as FlashAttention-3 does; forward only, on CPU tensors for now (CUDA
tensors are refused with the reason until a CUDA kernel takes e4m3).
"""

from __future__ import annotations

import torch

import flashattn
from flashattn import _C, _fp8, _torch_api, _torch_ops
from flashattn._common import int_arg
from flashattn.flash_attn_interface import _one_row_pages, _scale, _scale_or_default, _softcap, _window_size
from flashattn.layers.rotary import apply_rotary_emb

__all__ = [
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
]

_WHAT = {
    "qv": "a separate query part for the value head dim",
    "attention_chunk": "chunked attention, attention_chunk != 0",
}


def _refuse(**arguments):
    """NotImplementedError naming the first argument that asks for what the library lacks."""
    for name, value in arguments.items():
        if value is not None and not (name == "attention_chunk" and value == 0):
            raise NotImplementedError(f"{name}: not supported by flashattn ({_WHAT[name]})")


def _sinks(learnable_sink, s_aux):
    """The attention sinks given under either name (not both)."""
    if learnable_sink is not None and s_aux is not None:
        raise _C.Error("s_aux: the same argument as learnable_sink (attention sinks); give one of them, not both")
    return learnable_sink if learnable_sink is not None else s_aux


def _fp8_call(q, k, v, descales, softmax_scale, causal, window_size, softcap, sinks, varlen=None):
    """Whether the call is an FP8 one (float8_e4m3fn inputs or descale factors given), and then
    its (out, softmax_lse) through the op flashattn::fwd_fp8 (varlen: (cu_seqlens_q, cu_seqlens_k,
    seqused_k, max_seqlen_q, max_seqlen_k)). -> None for other calls."""
    if not (_fp8.is_fp8(q, k, v) or any(d is not None for d in descales)):
        return None
    for name, x in (("q", q), ("k", k), ("v", v)) + tuple(zip(("q_descale", "k_descale", "v_descale"), descales)):
        (_torch_api._check_optional_tensor if name.endswith("descale") else _torch_api._check_tensor)(name, x)
    left, right = _window_size(window_size)
    cu_q, cu_k, used_k, max_q, max_k = varlen if varlen is not None else (None, None, None, 0, 0)
    return _fp8.fwd_fp8(q, k, v, *descales, cu_q, cu_k, used_k, int(max_q), int(max_k), None,
                        _scale(softmax_scale, q.shape[-1]), bool(causal), left, right, _softcap(softcap),
                        None if sinks is None else _torch_api._sinks_fp32(sinks))


def _attend(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs, sinks=None):
    out, lse, _ = flashattn.flash_attn_func(q, k, v, 0.0, _scale_or_default(softmax_scale), causal,
                                            _window_size(window_size), _softcap(softcap), None, deterministic,
                                            True, sinks=sinks)
    return (out, lse) if return_attn_probs else out


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False,
                    learnable_sink=None, s_aux=None):
    """q (batch, seqlen_q, nheads, d), k (batch, seqlen_k, nheads_k, d), v (..., dv) -> out, or
    (out, softmax_lse (batch, nheads, seqlen_q)) with return_attn_probs. learnable_sink / s_aux:
    (nheads,) attention sinks. FP8: float8_e4m3fn q, k, v with (batch, nheads_k) descales ->
    bfloat16 out."""
    _refuse(qv=qv, attention_chunk=attention_chunk)
    fp8 = _fp8_call(q, k, v, (q_descale, k_descale, v_descale), softmax_scale, causal, window_size, softcap,
                    _sinks(learnable_sink, s_aux))
    if fp8 is not None:
        return fp8 if return_attn_probs else fp8[0]
    return _attend(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
                   _sinks(learnable_sink, s_aux))


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None,
                              v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                              deterministic=False, num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """qkv (batch, seqlen, 3, nheads, d), or (batch, seqlen, num_heads_q + 2·num_heads_k, d) with
    num_heads_q (GQA)."""
    _refuse(attention_chunk=attention_chunk)
    if qkv.dim() == 5 and qkv.shape[-3] == 3:
        q, k, v = qkv.unbind(dim=-3)
    elif qkv.dim() == 4 and num_heads_q is not None and (qkv.shape[2] - num_heads_q) % 2 == 0:
        num_heads_k = (qkv.shape[2] - num_heads_q) // 2
        q, k, v = qkv.split([num_heads_q, num_heads_k, num_heads_k], dim=-2)
    else:
        raise _C.Error(f"qkv: must be (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + "
                       f"2·num_heads_k, headdim) with num_heads_q; got {tuple(qkv.shape)}, num_heads_q={num_heads_q}")
    fp8 = _fp8_call(q, k, v, (q_descale, k_descale, v_descale), softmax_scale, causal, window_size, softcap, None)
    if fp8 is not None:
        return fp8 if return_attn_probs else fp8[0]
    return _attend(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                           k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                           num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                           return_attn_probs=False, learnable_sink=None, s_aux=None):
    """q (total_q, nheads, d), k (total_k, nheads_k, d), v (..., dv); cu_seqlens_q/k (batch + 1,)
    int32; seqused_k (batch,) int32: only the first seqused_k[i] keys of sequence i are used ->
    out (total_q, nheads, dv), or (out, softmax_lse (nheads, total_q)). seqused_q (batch,) int32:
    only the first seqused_q[i] queries of sequence i are attended (its length for the causal and
    window alignment too); the other rows get out 0, lse +inf and dq 0 (see _with_used_queries).
    learnable_sink / s_aux: (nheads,) attention sinks. FP8: as flash_attn_func."""
    _refuse(qv=qv, attention_chunk=attention_chunk)
    if seqused_q is not None:
        return _with_used_queries(
            q, cu_seqlens_q, seqused_q, return_attn_probs,
            lambda q_used, cu_used: flash_attn_varlen_func(
                q_used, k, v, cu_used, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, seqused_k, softmax_scale,
                causal, qv, q_descale, k_descale, v_descale, window_size, attention_chunk, softcap, num_splits,
                pack_gqa, deterministic, sm_margin, True, learnable_sink, s_aux))
    fp8 = _fp8_call(q, k, v, (q_descale, k_descale, v_descale), softmax_scale, causal, window_size, softcap,
                    _sinks(learnable_sink, s_aux),
                    varlen=(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k))
    if fp8 is not None:
        return fp8 if return_attn_probs else fp8[0]
    for name, x in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _torch_api._check_tensor(name, x)
    sinks = _sinks(learnable_sink, s_aux)
    _torch_api._check_optional_tensor("learnable_sink" if learnable_sink is not None else "s_aux", sinks)
    out, lse = _torch_api._FlashAttnVarlenFunc.apply(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), 0.0,
        _scale_or_default(softmax_scale), causal, _window_size(window_size), _softcap(softcap), None,
        deterministic, seqused_k, _torch_api._sinks_fp32(sinks))
    return (out, lse) if return_attn_probs else out


def _used_query_rows(cu_seqlens_q, seqused_q, total_q):
    """The rows of packed queries (total_q, ...) that seqused_q keeps — the first seqused_q[i] of
    sequence i — and their own prefix sums -> (rows (n,) int64, cu_used (batch + 1,) int32). Reads
    the counts back to the host: their sum sizes the gather (one wait for a device)."""
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("seqused_q", seqused_q)):
        _torch_api._check_tensor(name, x)
        if x.dtype != torch.int32 or x.dim() != 1:
            raise _C.Error(f"{name}: must be a 1-D int32 tensor; got {x.dtype} of shape {tuple(x.shape)}")
    batch = cu_seqlens_q.numel() - 1
    if seqused_q.shape[0] != batch or seqused_q.device != cu_seqlens_q.device:
        raise _C.Error(f"seqused_q: must be ({batch},), one count per sequence of cu_seqlens_q, on its device; got "
                       f"{tuple(seqused_q.shape)} on {seqused_q.device}")
    # (cu_seqlens_q reaches the core only through these rows: its own rules are checked here.)
    starts, used = cu_seqlens_q.long(), seqused_q.long()
    lengths = starts[1:] - starts[:-1]
    bad = torch.cat([starts[:1] < 0, starts[-1:] > total_q, lengths < 0, (used < 0) | (used > lengths)])
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0])
        if first < 2:
            raise _C.Error(f"cu_seqlens_q: must start at ≥ 0 and end at most at total_q ({total_q}); got "
                           f"{cu_seqlens_q.tolist()}")
        if first < 2 + batch:
            raise _C.Error(f"cu_seqlens_q: must be non-decreasing; got {cu_seqlens_q.tolist()}")
        b = first - 2 - batch
        raise _C.Error(f"seqused_q: entry {b} must lie in [0, {int(lengths[b])}] (sequence {b}'s length in "
                       f"cu_seqlens_q); got {int(used[b])}")
    cu_used = torch.cat([used.new_zeros(1), used.cumsum(0)])
    seq, index = _rows_of(cu_used, int(cu_used[-1]))
    return starts[seq] + index, cu_used.to(torch.int32)


def _with_used_queries(q, cu_seqlens_q, seqused_q, return_attn_probs, attend_used):
    """flash_attn_varlen_func with seqused_q: the used rows are gathered into a packed batch of
    their own (cu_seqlens from seqused_q), attended by attend_used(q_used, cu_used) -> (out, lse),
    and scattered back. The rows past seqused_q[i] get out 0 and lse +inf — as the rows that no
    sequence covers and the rows without keys do here (FlashAttention-3 leaves them unwritten) —
    and dq 0; autograd runs through the gather and the scatter."""
    rows, cu_used = _used_query_rows(cu_seqlens_q, seqused_q, q.shape[0])
    out_used, lse_used = attend_used(q.index_select(0, rows), cu_used)
    out = out_used.new_zeros((q.shape[0],) + tuple(out_used.shape[1:])).index_copy(0, rows, out_used)
    if not return_attn_probs:
        return out
    lse = lse_used.new_full((lse_used.shape[0], q.shape[0]), float("inf")).index_copy(1, rows, lse_used)
    return out, lse


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merges partial results over disjoint key sets: out_partial (splits, batch, seqlen, nheads,
    headdim) and lse_partial (splits, batch, seqlen, nheads), float32 -> (out (batch, seqlen,
    nheads, headdim) of out_dtype (default float32; written into `out` when given), softmax_lse
    (batch, seqlen, nheads) float32). Not differentiable."""
    if out_partial.dim() != 5 or lse_partial.dim() != 4:
        raise _C.Error(f"out_partial: must be (splits, batch, seqlen, nheads, headdim) with lse_partial (splits, "
                       f"batch, seqlen, nheads); got {tuple(out_partial.shape)} and {tuple(lse_partial.shape)}")
    splits, batch, seqlen, nheads, head_dim = out_partial.shape
    if out is None:
        out = torch.empty((batch, seqlen, nheads, head_dim), dtype=out_dtype or out_partial.dtype,
                          device=out_partial.device)
    lse = torch.empty((batch, nheads, seqlen), dtype=torch.float32, device=out_partial.device)
    # The core takes lse_partial as (splits, batch, nheads, seqlen).
    _torch_ops.combine(out_partial, lse_partial.transpose(2, 3).contiguous(), out, lse)
    return out, lse.transpose(1, 2)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False, learnable_sink=None, s_aux=None):
    """q (batch, seqlen_q, nheads, d), or (total_q, nheads, d) with cu_seqlens_q / max_seqlen_q.
    k_cache/v_cache (batch_cache, seqlen_cache, nheads_k, d/dv), or paged (num_blocks, page_size,
    nheads_k, d/dv) with page_table (batch, max_blocks) int32. k/v (batch, seqlen_new, nheads_k,
    d/dv), or (total_new, nheads_k, d/dv) with cu_seqlens_k_new: appended IN PLACE at
    cache_seqlens[i] (rotated when rotary_cos/sin are given), then attended to. cache_leftpad
    (batch,) int32: the keys of sequence i start at row cache_leftpad[i] of its cache row (the
    core's rule, flashattn.flash_attn_with_kvcache; not with page_table or FP8). rotary_seqlens
    (batch,) int32: with new keys and rotary_cos/sin, the rotary position of sequence i's first new
    key (and of its queries) instead of cache_seqlens[i]; ignored without new keys, as in
    FlashAttention-3. learnable_sink / s_aux: (nheads,) attention sinks. Not differentiable. FP8:
    float8_e4m3fn q, caches and k/v with (batch, nheads_k) descales, no rotary -> bfloat16 out."""
    _refuse(qv=qv, attention_chunk=attention_chunk)
    if cache_leftpad is not None and page_table is not None:
        raise _C.Error("cache_leftpad: cannot be combined with a paged cache (page_table), as in FlashAttention-3")
    if rotary_seqlens is not None and (rotary_cos is None or k is None):
        rotary_seqlens = None  # (FlashAttention-3 reads it only where new keys are rotated)
    window = _window_size(window_size)
    scale = _scale_or_default(softmax_scale)
    sinks = _sinks(learnable_sink, s_aux)
    descales = (q_descale, k_descale, v_descale)
    if _fp8.is_fp8(q, k_cache, v_cache, k, v) or any(d is not None for d in descales):
        if cache_leftpad is not None:
            raise NotImplementedError("cache_leftpad: not supported with FP8 inputs by flashattn (the op "
                                      "flashattn::fwd_kvcache_fp8 takes no left padding)")
        for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            _torch_api._check_tensor(name, x)
        if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
            # One length for every sequence, as in flash_attn.
            cache_seqlens = torch.full((q.shape[0],), int_arg("cache_seqlens", cache_seqlens), dtype=torch.int32,
                                       device=q.device)
        for name, x in (("k", k), ("v", v), ("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                        ("page_table", page_table)) + tuple(zip(("q_descale", "k_descale", "v_descale"), descales)):
            _torch_api._check_optional_tensor(name, x)
        if rotary_cos is not None or rotary_sin is not None:
            raise _C.Error("rotary_cos: no rotary embedding with FP8 inputs (rotated e4m3 values would be rounded "
                           "again); rotate before quantising")
        fp8_sinks = None if sinks is None else _torch_api._sinks_fp32(sinks)

        def attend_fp8(q_batch, k_new, v_new, lengths):
            return _fp8.fwd_kvcache_fp8(q_batch, k_cache, v_cache, k_new, v_new, lengths, cache_batch_idx, page_table,
                                        *descales, _scale(softmax_scale, q.shape[-1]), bool(causal), *window,
                                        _softcap(softcap), fp8_sinks)

        if cu_seqlens_q is None and cu_seqlens_k_new is None:
            out, lse = attend_fp8(q, k, v, cache_seqlens)
        else:
            # (New e4m3 rows are appended below as they are; the attention is the FP8 op's varlen one
            # over the cache as pages.)
            def attend_fp8_varlen(q_rows, cu_q, block_table, lengths, max_q, capacity):
                return _fp8.fwd_fp8(q_rows, k_cache, v_cache, *descales, cu_q, None, lengths, max_q, capacity,
                                    block_table, _scale(softmax_scale, q.shape[-1]), bool(causal), *window,
                                    _softcap(softcap), fp8_sinks)

            out, lse = _varlen_kvcache(q, k_cache, v_cache, k, v, None, None, cache_seqlens, cache_batch_idx,
                                       page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, scale, causal, window,
                                       _softcap(softcap), rotary_interleaved, sinks, attend=attend_fp8_varlen)
    elif cu_seqlens_q is None and cu_seqlens_k_new is None and rotary_seqlens is None:
        out, lse = flashattn.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            page_table, scale, causal, window, _softcap(softcap), rotary_interleaved, None, num_splits, True,
            sinks=sinks)
    else:
        out, lse = _varlen_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                   cache_batch_idx, page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, scale,
                                   causal, window, _softcap(softcap), rotary_interleaved, sinks,
                                   cache_leftpad=cache_leftpad, rotary_seqlens=rotary_seqlens)
    if not return_softmax_lse:
        return out
    no_partials = torch.empty((0,), dtype=torch.float32, device=out.device)
    return out, lse, no_partials, no_partials


# --- varlen queries / new keys over a KV cache ---------------------------------------------------


def _rows_of(cu_seqlens, total):
    """For packed rows (total,) of sequences cu_seqlens (batch + 1,): each row's sequence and
    its index within it."""
    counts = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=total)
    return seq, torch.arange(total, device=counts.device) - cu_seqlens[seq]


def _rotate_at(x, cos, sin, interleaved, positions):
    """Rows x (n, heads, d) rotated at their own positions (n,)."""
    if x.shape[0] == 0:
        return x
    if int(positions.max()) >= cos.shape[0]:
        raise _C.Error(f"rotary_cos: must cover every rotated position; expected seqlen_ro > "
                       f"{int(positions.max())}, got {cos.shape[0]}")
    return apply_rotary_emb(x.unsqueeze(1), cos, sin, interleaved, seqlen_offsets=positions).squeeze(1)


def _append(k_cache, v_cache, k, v, seq, positions, cache_batch_idx, page_table):
    """Writes rows k, v (n, heads_k, d) of sequences seq at cache positions `positions`."""
    if k.shape[0] == 0:
        return
    if page_table is not None:
        page_size = k_cache.shape[1]
        capacity = page_table.shape[1] * page_size
        where = (page_table[seq, positions // page_size].long(), positions % page_size)
    else:
        capacity = k_cache.shape[1]
        rows = seq if cache_batch_idx is None else cache_batch_idx.long()[seq]
        where = (rows, positions)
    if int(positions.max()) >= capacity:
        raise _C.Error(f"k: the new keys do not fit in the cache; position {int(positions.max())} of a capacity "
                       f"of {capacity} keys per sequence")
    k_cache.index_put_(where, k)
    v_cache.index_put_(where, v)


def _append_new_keys(k_cache, v_cache, k, v, cu_seqlens_k_new, batch, old, rotary, cache_batch_idx, page_table):
    """Appends k, v (batch, seqlen_new, hk, d), or varlen (total_new, hk, d), at cache_seqlens (old)
    of each sequence, rotated at the positions from the rotary tuple's first position of each
    sequence -> the lengths after the append."""
    device = k_cache.device
    if cu_seqlens_k_new is not None:
        k_seq, k_idx = _rows_of(cu_seqlens_k_new.long(), k.shape[0])
        k_rows, v_rows = k, v
    else:
        k_seq = torch.arange(k.shape[0], device=device).repeat_interleave(k.shape[1])
        k_idx = torch.arange(k.shape[1], device=device).repeat(k.shape[0])
        k_rows, v_rows = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
    positions = old[k_seq] + k_idx
    if rotary is not None:
        cos, sin, interleaved, _, first = rotary
        k_rows = _rotate_at(k_rows, cos, sin, interleaved, first[k_seq] + k_idx)
    _append(k_cache, v_cache, k_rows, v_rows, k_seq, positions, cache_batch_idx, page_table)
    return old + torch.bincount(k_seq, minlength=batch)


def _per_sequence(name, x, batch, device):
    """An optional (batch,) int32 argument on the cache's device, as int64 (None stays None)."""
    if x is None:
        return None
    _torch_api._check_tensor(name, x)
    if x.dtype != torch.int32 or tuple(x.shape) != (batch,) or x.device != device:
        raise _C.Error(f"{name}: must be int32 of shape ({batch},) on the cache's device; got {x.dtype} of shape "
                       f"{tuple(x.shape)} on {x.device}")
    return x.long()


def _varlen_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                    page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, softmax_scale, causal, window,
                    softcap, rotary_interleaved, sinks=None, attend=None, cache_leftpad=None, rotary_seqlens=None):
    """flash_attn_with_kvcache with varlen queries or new keys (or rotary_seqlens):
    _varlen_queries_over_cache, queries (batch, seqlen_q, h, d) given without cu_seqlens_q taken as
    varlen rows of seqlen_q each (out and lse then shaped back). attend: as
    _varlen_queries_over_cache's (FP8 calls: the FP8 op)."""
    if page_table is not None and cache_batch_idx is not None:
        raise _C.Error("cache_batch_idx: cannot be combined with a paged cache (page_table)")
    if cache_seqlens is None:
        raise _C.Error("cache_seqlens: is required with cu_seqlens_q, cu_seqlens_k_new, cache_leftpad or "
                       "rotary_seqlens")
    if cu_seqlens_q is not None or cu_seqlens_k_new is not None:
        batch = (cu_seqlens_q if cu_seqlens_q is not None else cu_seqlens_k_new).numel() - 1
    else:
        batch = q.shape[0]
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=k_cache.device)
    old = cache_seqlens.long()
    leftpad = _per_sequence("cache_leftpad", cache_leftpad, batch, k_cache.device)
    if leftpad is not None and bool(((leftpad < 0) | (leftpad > old)).any()):
        # (Checked before anything is appended; the core's rule for cache_leftpad.)
        b = int(torch.nonzero((leftpad < 0) | (leftpad > old))[0])
        raise _C.Error(f"cache_leftpad: entry {b} must lie in [0, cache_seqlens[{b}]] = [0, {int(old[b])}]; got "
                       f"{int(leftpad[b])}")
    rotary_first = _per_sequence("rotary_seqlens", rotary_seqlens, batch, k_cache.device)
    # Queries rotate at their own positions when causal or windowed (FlashAttention's rule), from
    # rotary_seqlens where given, else from cache_seqlens.
    rotary = None if rotary_cos is None else (rotary_cos, rotary_sin, rotary_interleaved,
                                              causal or window != (-1, -1), old if rotary_first is None else rotary_first)
    if cu_seqlens_q is not None:
        return _varlen_queries_over_cache(q, k_cache, v_cache, k, v, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q,
                                          batch, old, rotary, cache_batch_idx, page_table, softmax_scale, causal,
                                          window, softcap, sinks, attend, leftpad)
    if q.dim() != 4 or q.shape[0] != batch:
        raise _C.Error(f"q: must be (batch, seqlen_q, nheads, headdim) with the batch of cu_seqlens_k_new ({batch}) "
                       f"when cu_seqlens_q is not given; got {tuple(q.shape)}")
    sq, h = q.shape[1], q.shape[2]
    cu_q = torch.arange(0, (batch + 1) * sq, sq, dtype=torch.int32, device=q.device)
    out, lse = _varlen_queries_over_cache(q.reshape(batch * sq, h, q.shape[3]), k_cache, v_cache, k, v, cu_q,
                                          cu_seqlens_k_new, sq, batch, old, rotary, cache_batch_idx, page_table,
                                          softmax_scale, causal, window, softcap, sinks, attend, leftpad)
    return out.reshape(batch, sq, h, out.shape[-1]), lse.reshape(h, batch, sq).transpose(0, 1)


def _varlen_queries_over_cache(q, k_cache, v_cache, k, v, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, batch, old,
                               rotary, cache_batch_idx, page_table, softmax_scale, causal, window, softcap, sinks,
                               attend=None, leftpad=None):
    """Varlen queries (total_q, h, d) over a KV cache, as serving engines call it: the queries
    rotated and the new keys appended here, then one varlen attention over the cache as pages
    (block_table; a contiguous cache is pages of its whole length, one per sequence, through
    cache_batch_idx where given) with seqused_k the lengths after the append — the bottom-right
    alignment of causal and window masks is the same — without padding the queries into a batch.
    attend(q, cu_seqlens_q, block_table, seqused_k, max_seqlen_q, max_seqlen_k) -> (out, lse): that
    attention instead of the library's varlen function (FP8: the FP8 op). leftpad (batch,) int64: a
    contiguous cache's keys of sequence i start at that row (_left_padded_pages)."""
    if rotary is not None:
        cos, sin, interleaved, by_row, first = rotary
        q_seq, q_idx = _rows_of(cu_seqlens_q.long(), q.shape[0])
        # Rotated before anything is appended, so that a short table leaves the caches as they were.
        q = _rotate_at(q, cos, sin, interleaved, first[q_seq] + (q_idx if by_row else 0))
    new = old
    if k is not None:
        new = _append_new_keys(k_cache, v_cache, k, v, cu_seqlens_k_new, batch, old, rotary, cache_batch_idx,
                               page_table)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if batch > 0 else 0
    if page_table is not None:
        block_table, capacity = page_table, page_table.shape[1] * k_cache.shape[1]
    else:
        rows = cache_batch_idx if cache_batch_idx is not None else torch.arange(batch, device=k_cache.device)
        block_table, capacity = rows.to(torch.int32).unsqueeze(1), k_cache.shape[1]
    # The attention sees the capacity as max_seqlen_k: lengths past it are named here where that
    # costs no wait for a device (on a GPU the device-side check names seqused_k / max_seqlen_k).
    if new.device.type == "cpu" and new.numel() > 0 and int(new.max()) > capacity:
        raise _C.Error(f"cache_seqlens: must leave every sequence's keys within the cache's capacity of {capacity}; "
                       f"got {int(new.max())} keys")
    max_seqlen_q = int_arg("max_seqlen_q", max_seqlen_q)
    if leftpad is not None:
        k_cache, v_cache, block_table, new = _left_padded_pages(k_cache, v_cache, block_table[:, 0], leftpad, new)
    if attend is not None:
        return attend(q, cu_seqlens_q, block_table, new.to(torch.int32), max_seqlen_q, capacity)
    return flashattn.flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q, capacity, 0.0, softmax_scale, causal, window, softcap,
        None, False, False, block_table, seqused_k=new.to(torch.int32), return_softmax_lse=True, sinks=sinks)


def _left_padded_pages(k_cache, v_cache, rows, leftpad, new):
    """cache_leftpad over a contiguous cache (b_cache, seqlen_cache, hk, d) in the varlen path:
    the cache as pages of one row each (a view where its first two axes merge, else a copy made
    after the append) and a block table (batch, seqlen_cache) that lists for sequence i the rows
    of its cache row `rows[i]` from leftpad[i] on, so that the attention's key j is cache row
    leftpad[i] + j — masks then count from there, as in the core's cache_leftpad. -> (k_pages,
    v_pages, block_table, the key counts new - leftpad)."""
    b_cache, seqlen_cache = k_cache.shape[:2]
    table = _one_row_pages(rows.long() * seqlen_cache + leftpad, seqlen_cache, b_cache * seqlen_cache)
    pages = [c.reshape(b_cache * seqlen_cache, 1, *c.shape[2:]) for c in (k_cache, v_cache)]
    return pages[0], pages[1], table, new - leftpad
