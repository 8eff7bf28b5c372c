"""flashattn.distributed — context parallelism: attention over a sequence sharded across the ranks
of a torch.distributed process group (any backend: NCCL on CUDA, gloo on the CPU).

Each rank holds a shard of the sequence (of q, k and v alike: self-attention) and gets the
attention output of its own query rows, as if ``flash_attn_func`` had run on the whole sequence on
one device; gradients flow back to the local q, k, v.

- ``ring_flash_attn_func`` / ``ring_flash_attn_varlen_func``: ring attention. The key/value
  blocks travel around the ring (P2P ``batch_isend_irecv``, the next block in flight while the
  current one is computed, on a stream of its own on CUDA); each rank merges its partial
  (out, lse) pairs with the library's combine, in fp32. In the backward the K/V blocks go around
  again with their fp32 dK/dV accumulators one step behind them, so every rank ends up with the
  gradients of its own block. Each (query shard, key block) pair is computed exactly: the
  global causal / sliding-window mask is expressed per block with the library's bottom-right
  aligned windows on cropped views (blocks that see nothing are skipped), and ALiBi of global
  distances by the library's ALiBi with the slope's sign chosen per call and the call's lse
  shifted by a constant (see _alibi_calls). With dropout every call is told where its rows and
  keys sit in the sequence (the library's dropout position offsets), so that it draws its part of
  the mask of one call over the whole sequence (see _aligned).
- ``ulysses_flash_attn_func``: head parallelism by all-to-all (DeepSpeed-Ulysses). Two
  all-to-alls trade the sequence shard for a head shard, each rank attends over the whole
  sequence for nheads / world heads, and one all-to-all trades back.
- ``shard`` / ``unshard`` (``zigzag_shard`` / ``zigzag_unshard``): cut a batch into the shards
  these functions expect, and put the shards back together.

Layouts. ``layout="contiguous"`` gives rank r the r-th of world consecutive chunks.
``layout="zigzag"`` cuts the sequence into 2·world chunks and gives rank r chunks r and
2·world − 1 − r, so that under a causal mask every rank has the same amount of work (with
contiguous shards the last rank computes 2·world − 1 times as much as the first). Lengths need not
divide: chunk i of n chunks of a length-L sequence has L // n + (i < L % n) tokens.

Which to pick: ring attention works for any head count and keeps only two K/V blocks per rank
in memory; its communication (world − 1 K/V blocks forward, twice that plus the dK/dV
accumulators backward) hides behind the computation when the shards are long enough. Ulysses
needs nheads % world == 0 (and nheads_k % world == 0 or world % nheads_k == 0), moves less data
(4 all-to-alls of a shard each way) but cannot overlap them, and supports everything the
single-device function does. Prefer Ulysses when the heads divide across the ranks and the
interconnect is fast all-to-all (NVLink within a node); prefer ring attention across nodes, for
few heads, or for very long sequences.

Dropout. Both draw exactly the mask of a single-device call over the whole sequence with the same
rng_state (drawn on the group's first rank from PyTorch's default generator, as flash_attn_func
draws it, and broadcast). Ring attention with ``dropout_p > 0`` needs every shard to start at a
multiple of 16 tokens (the mask's 16 × 16 blocks, where a call's position offsets must lie): with
n chunks (world for contiguous, 2·world for zigzag) a length L with L % (16·n) == 0 or
L % (16·n) == 16·n − 1 (or L ≤ 1, or a world of one); other lengths raise NotImplementedError
saying so. Its calls then cover one pair of shard segments each (and, in a varlen batch, one
sequence each), so a step makes more, smaller calls than without dropout.
"""

from __future__ import annotations

import contextlib
import functools
from collections import namedtuple

import torch
import torch.distributed as dist

from flashattn import _C, _torch_ops
from flashattn._common import (
    BATCH_LAYOUT,
    VARLEN_LAYOUT,
    check_dropout_p,
    resolve_softmax_scale,
    window_pair,
)
from flashattn._torch_api import _check_inputs, _pad_head_dim

__all__ = [
    "LAYOUTS",
    "local_cu_seqlens",
    "ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "shard",
    "ulysses_flash_attn_func",
    "unshard",
    "zigzag_shard",
    "zigzag_unshard",
]

LAYOUTS = ("contiguous", "zigzag")
_INF = float("inf")
# P2P tags: K/V blocks and dK/dV accumulators are separate messages between the same two ranks.
_TAG_KV, _TAG_DKV = 17, 18


# --- layouts: which tokens each rank holds ------------------------------------------------------

# One contiguous run of a rank's tokens: `local` is its start in the rank's buffer, `start` its
# position in the sequence, `length` its token count.
Segment = namedtuple("Segment", "local start length")


def _split(length, parts):
    """Sizes of `parts` near-equal chunks of `length` tokens (the first length % parts one larger)."""
    return [length // parts + (i < length % parts) for i in range(parts)]


@functools.lru_cache(maxsize=1024)
def _segments(length, world, rank, layout):
    """The runs of a length-`length` sequence that `rank` holds, in its local order."""
    if layout == "contiguous":
        sizes = _split(length, world)
        return (Segment(0, sum(sizes[:rank]), sizes[rank]),)
    sizes = _split(length, 2 * world)
    first, second = rank, 2 * world - 1 - rank
    return (Segment(0, sum(sizes[:first]), sizes[first]),
            Segment(sizes[first], sum(sizes[:second]), sizes[second]))


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise _C.Error(f"layout: must be one of {LAYOUTS}; got {layout!r}")


def _group_info(group):
    if not dist.is_available() or not dist.is_initialized():
        raise _C.Error("group: torch.distributed is not initialised (call torch.distributed.init_process_group)")
    return dist.get_rank(group), dist.get_world_size(group)


def _token_runs(world, rank, layout, seqlen=None, cu_seqlens=None):
    """(start in the whole tensor, length) of the runs a rank holds, in local order: of one
    sequence of `seqlen` tokens, or of each sequence of a varlen batch (cu_seqlens, a list)."""
    if cu_seqlens is None:
        return [(s.start, s.length) for s in _segments(seqlen, world, rank, layout)]
    return [(cu_seqlens[b] + s.start, s.length)
            for b in range(len(cu_seqlens) - 1)
            for s in _segments(cu_seqlens[b + 1] - cu_seqlens[b], world, rank, layout)]


def _as_list(cu_seqlens):
    return [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]


def shard(x, group=None, *, layout="zigzag", dim=1, cu_seqlens=None):
    """This rank's shard of x: the tokens of the sequence axis `dim` (batch tensors, e.g.
    (batch, seqlen, nheads, headdim) with dim=1) that `layout` gives it, in local order. With
    cu_seqlens ((batch + 1) prefix sums of the whole varlen batch) x is (total_tokens, ...) and
    each sequence is sharded on its own along dim 0. Not differentiable."""
    _check_layout(layout)
    rank, world = _group_info(group)
    if cu_seqlens is not None:
        runs = _token_runs(world, rank, layout, cu_seqlens=_as_list(cu_seqlens))
        dim = 0
    else:
        runs = _token_runs(world, rank, layout, seqlen=x.shape[dim])
    return torch.cat([x.narrow(dim, start, n) for start, n in runs], dim=dim)


def unshard(x, group=None, *, layout="zigzag", dim=1, cu_seqlens=None):
    """The whole tensor from every rank's shard (the inverse of ``shard``, on every rank): an
    all-gather, then the runs put back in sequence order. Not differentiable."""
    _check_layout(layout)
    rank, world = _group_info(group)
    if cu_seqlens is not None:
        cu = _as_list(cu_seqlens)
        dim = 0
        runs = [_token_runs(world, p, layout, cu_seqlens=cu) for p in range(world)]
    else:
        lengths = _gather_lengths(x.shape[dim], group, x.device)
        runs = [_token_runs(world, p, layout, seqlen=sum(lengths)) for p in range(world)]
    sizes = [sum(n for _, n in r) for r in runs]
    if x.shape[dim] != sizes[rank]:
        raise _C.Error(f"x: rank {rank} holds {x.shape[dim]} tokens along dim {dim}; layout {layout!r} gives it "
                       f"{sizes[rank]}")
    pieces = _all_gather_uneven(x, sizes, dim, group)
    placed = []
    for p in range(world):
        offset = 0
        for start, n in runs[p]:
            placed.append((start, pieces[p].narrow(dim, offset, n)))
            offset += n
    placed.sort(key=lambda item: item[0])
    return torch.cat([piece for _, piece in placed], dim=dim)


zigzag_shard = functools.partial(shard, layout="zigzag")
zigzag_shard.__doc__ = "shard(x, group, dim=1, cu_seqlens=None) with layout='zigzag'."
zigzag_unshard = functools.partial(unshard, layout="zigzag")
zigzag_unshard.__doc__ = "unshard(x, group, dim=1, cu_seqlens=None) with layout='zigzag'."


def local_cu_seqlens(cu_seqlens, group=None, *, layout="zigzag"):
    """The prefix sums of this rank's shard of a varlen batch (cu_seqlens of the whole batch):
    where each sequence's tokens start in the buffer ``shard(..., cu_seqlens=cu_seqlens)`` gives."""
    _check_layout(layout)
    rank, world = _group_info(group)
    cu = _as_list(cu_seqlens)
    local = [0]
    for b in range(len(cu) - 1):
        local.append(local[-1] + sum(s.length for s in _segments(cu[b + 1] - cu[b], world, rank, layout)))
    device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None
    return torch.tensor(local, dtype=torch.int32, device=device)


def _shared_rng_state(dropout_p, group, device):
    """The [seed, offset] of one dropout call over the whole sequence (None without dropout):
    drawn on the group's first rank from PyTorch's default generator, as a single-device call
    draws it, and broadcast, so that every rank draws its part of the same mask."""
    if dropout_p == 0.0:
        return None
    shared = _torch_ops.draw_rng_state(device).to(_comm_device(group, device))
    dist.broadcast(shared, _global_rank(group, 0), group=group)
    return shared.to(device)


def _global_rank(group, rank):
    """The global rank of `group`'s rank `rank` (P2P and broadcast address ranks globally)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _comm_device(group, device):
    """Where the group's backend takes tensors: their own device, except CUDA tensors over a
    backend without NCCL (gloo), which go through host memory."""
    if device.type == "cuda" and "nccl" not in str(dist.get_backend(group)).lower():
        return torch.device("cpu")
    return device


def _gather_lengths(n, group, device):
    """Every rank's value of the int n (a small all-gather)."""
    world = dist.get_world_size(group)
    mine = torch.tensor([n], dtype=torch.int64, device=_comm_device(group, device))
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]


def _all_gather_uneven(x, sizes, dim, group):
    """Every rank's x (sizes[p] long along dim on rank p): padded to the longest, gathered, cut."""
    longest = max(sizes)
    pad = list(x.shape)
    pad[dim] = longest - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim=dim) if pad[dim] else x
    padded = padded.to(_comm_device(group, x.device)).contiguous()
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return [g.narrow(dim, 0, n).to(x.device) for g, n in zip(gathered, sizes)]


# --- the exact mask of one block -------------------------------------------------------------------
#
# Rows i and columns j of a block are local indices into a rank's q and into the K/V block of
# another rank; each belongs to a Segment. For a pair of segments, the global mask
# "j_g − i_g in [−left, right]" is a band on the local difference j − i: [D − left, D + right]
# with D = (q.start − q.local) − (k.start − k.local). The library's mask of a call on rows
# [r0, r1) and columns [c0, c1) is the band j'' − i'' in [c − wl, c + wr] of the call's own
# indices, c = (c1 − c0) − (r1 − r0) (bottom-right aligned), a window ≥ the call's key count
# being unbounded. A call is exact when, in every segment pair it covers, the two bands select
# the same cells. Cropping a pair to the rows and columns that see anything always makes it
# exact: the last cropped row then sees the last cropped column, so the call's diagonal lies in
# the band. Wider calls (one per query segment, or one for the whole block) are tried first.

# flip and shift: the ALiBi terms of the call (below); 1 and 0 without ALiBi. at: with dropout,
# the global (row, column) of the call's first cell, its dropout position offsets; else None.
_Call = namedtuple("_Call", "r0 r1 c0 c1 wl wr flip shift at", defaults=(1, 0, None))

# The dropout mask's blocks are 16 x 16 (docs/dropout.md): a call's position offsets are multiples of it.
_MASK_BLOCK = 16


def _pair_band(qs, ks, left, right):
    d = (qs.start - qs.local) - (ks.start - ks.local)
    return (d - left if left >= 0 else -_INF), (d + right if right >= 0 else _INF)


def _rect_of(qs, ks):
    return qs.local, qs.local + qs.length, ks.local, ks.local + ks.length


def _clip(band, rect):
    """The part of a band (on j − i) that a rectangle's cells reach, or None."""
    r0, r1, c0, c1 = rect
    lo, hi = max(band[0], c0 - (r1 - 1)), min(band[1], (c1 - 1) - r0)
    return (lo, hi) if r0 < r1 and c0 < c1 and lo <= hi else None


def _crop(rect, band):
    """The smallest rectangle inside rect holding every cell of the band, or None."""
    clipped = _clip(band, rect)
    if clipped is None:
        return None
    lo, hi = clipped
    r0, r1, c0, c1 = rect
    return (max(r0, c0 - hi), min(r1, c1 - lo), max(c0, r0 + lo), min(c1, r1 - 1 + hi + 1))


def _intersect(a, b):
    r0, r1, c0, c1 = max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3])
    return (r0, r1, c0, c1) if r0 < r1 and c0 < c1 else None


def _library_band(rect, wl, wr):
    """The cells a library call on rect with window (wl, wr) sees, as a band on local j − i."""
    r0, r1, c0, c1 = rect
    sk = c1 - c0
    wl, wr = (-1 if w >= sk else w for w in (wl, wr))  # the library's normalisation (SPEC §2)
    diag = sk - (r1 - r0) + c0 - r0
    return (diag - wl if wl >= 0 else -_INF), (diag + wr if wr >= 0 else _INF)


def _fit(rect, pairs):
    """A window (wl, wr) with which one library call on rect sees exactly the cells of the
    pairs' bands inside rect, or None."""
    r0, r1, c0, c1 = rect
    diag = (c1 - c0) - (r1 - r0) + c0 - r0
    inside = [(sub, band) for prect, band in pairs if (sub := _intersect(rect, prect)) is not None]
    lefts = [-1] + sorted({int(diag - b[0]) for _, b in inside if b[0] > -_INF and diag - b[0] >= 0})
    rights = [-1] + sorted({int(b[1] - diag) for _, b in inside if b[1] < _INF and b[1] - diag >= 0})
    for wl in lefts:
        for wr in rights:
            ours = _library_band(rect, wl, wr)
            if all(_clip(ours, sub) == _clip(band, sub) for sub, band in inside):
                return wl, wr
    return None


def _bbox(rects):
    return (min(r[0] for r in rects), max(r[1] for r in rects), min(r[2] for r in rects), max(r[3] for r in rects))


@functools.lru_cache(maxsize=4096)
def _plan(q_segments, k_segments, left, right, alibi=False, dropout=False):
    """The library calls (rows, columns, window) that compute exactly the part of the global
    mask between a rank's query segments and a K/V block's segments; () when it is empty. With
    alibi, also the ALiBi bias of global positions (one segment pair per call; see _alibi_calls).
    With dropout, also the dropout mask of global positions (one segment pair per call, starting
    on the mask's blocks; see _aligned)."""
    if dropout:
        q_segments, k_segments = _joined(q_segments), _joined(k_segments)
    if alibi or dropout:
        return tuple(call for qs in q_segments for ks in k_segments for call in _pair_calls(qs, ks, left, right,
                                                                                             alibi, dropout))
    pairs = [(_rect_of(qs, ks), _pair_band(qs, ks, left, right)) for qs in q_segments for ks in k_segments]
    crops = [c for rect, band in pairs if (c := _crop(rect, band)) is not None]
    if not crops:
        return ()
    whole = _bbox(crops)
    window = _fit(whole, pairs)
    if window is not None:
        return (_Call(*whole, *window),)
    calls = []
    for qs in q_segments:
        mine = [(_rect_of(qs, ks), _pair_band(qs, ks, left, right)) for ks in k_segments]
        rows = [c for rect, band in mine if (c := _crop(rect, band)) is not None]
        if not rows:
            continue
        rect = _bbox(rows)
        window = _fit(rect, pairs)
        if window is not None:
            calls.append(_Call(*rect, *window))
            continue
        for rect, band in mine:
            calls.extend(_cropped_calls(rect, band, pairs))
    return tuple(_merge_rows(calls, pairs))


def _cropped_calls(rect, band, pairs, align=None):
    """The cells of one pair's band inside rect, cropped: one call, except where the library's
    normalisation (a window ≥ the call's key count is unbounded) stands in the way — a crop much
    taller than wide — and the rows are halved until each part fits (one row always does).
    align: see _aligned."""
    crop = _aligned(_crop(rect, band), rect, align)
    if crop is None:
        return []
    window = _fit(crop, pairs)
    if window is not None:
        return [_Call(*crop, *window)]
    top, bottom = _halves(crop, align)
    return _cropped_calls(top, band, pairs, align) + _cropped_calls(bottom, band, pairs, align)


def _halves(rect, align):
    """rect cut in two between its rows, near the middle: with align, on a row of the mask's
    blocks, so that the lower half's calls start there."""
    r0, r1, c0, c1 = rect
    mid = (r0 + r1) // 2
    if align is not None:
        mid -= (mid + align[0]) % _MASK_BLOCK
        if mid <= r0:
            mid += _MASK_BLOCK
        if mid >= r1:
            raise NotImplementedError(
                f"dropout_p: ring attention with dropout cannot compute the {r1 - r0} x {c1 - c0} block at global "
                f"rows {r0 + align[0]} and keys {c0 + align[1]} exactly: the library's window normalisation needs "
                f"it cut between rows, and no row of it starts a block of the dropout mask")
    return (r0, mid, c0, c1), (mid, r1, c0, c1)


# Dropout of global positions. A call draws the mask of the cells (row_offset + i, col_offset + j)
# of its own indices i, j, the offsets being multiples of 16 (docs/dropout.md). So with dropout a
# call covers rows of one query segment and columns of one key segment (each a contiguous run of
# global positions: local index + shift, align = (row shift, column shift)), and its first row and
# column are at global multiples of 16. A cropped rectangle is extended up and left to the
# previous such rows and columns, never out of the rectangle it was cropped from (whose first row
# and column are such positions: a segment's start, or a cut made by _halves). The cells it gains
# lie outside the band (the crop held all of the band's cells in that rectangle), and the window
# is fitted again on the extended rectangle; its diagonal c1 − r1 is unchanged. Rows it gains see
# nothing in that call: their lse there is not finite, which the combine ignores, and in the
# backward they add nothing. A cut between rows (_halves) is made on such a row too, or else the
# extended lower part would hold cells of the upper one twice. A rank's two segments that follow
# each other in the sequence are one run here (_joined).

def _aligned(crop, rect, align):
    """crop extended to start on the dropout mask's blocks inside rect (align given), else crop."""
    if crop is None or align is None:
        return crop
    r0, r1, c0, c1 = crop
    r0 = max(rect[0], r0 - (r0 + align[0]) % _MASK_BLOCK)
    c0 = max(rect[2], c0 - (c0 + align[1]) % _MASK_BLOCK)
    return r0, r1, c0, c1


def _pair_calls(qs, ks, left, right, alibi, dropout):
    """The calls of one segment pair: with alibi (_alibi_calls), with dropout (aligned, _aligned),
    or both; each call's `at` set with dropout."""
    rect, band = _rect_of(qs, ks), _pair_band(qs, ks, left, right)
    shifts = (qs.start - qs.local, ks.start - ks.local)
    align = shifts if dropout else None
    if alibi:
        calls = _alibi_calls(rect, band, shifts[0] - shifts[1], align)
    else:
        calls = _cropped_calls(rect, band, [(rect, band)], align)
    if not dropout:
        return calls
    placed = []
    for c in calls:
        at = (c.r0 + shifts[0], c.c0 + shifts[1])
        if at[0] % _MASK_BLOCK or at[1] % _MASK_BLOCK:
            raise NotImplementedError(
                f"dropout_p: ring attention with dropout needs every shard to start at a multiple of {_MASK_BLOCK} "
                f"tokens; a block starts at global row {at[0]}, key {at[1]}")
        placed.append(c._replace(at=at))
    return placed


def _diagonal(rect):
    """The local j − i of a call's bottom-right aligned diagonal (its sk − sq, shifted)."""
    r0, r1, c0, c1 = rect
    return (c1 - c0) - (r1 - r0) + c0 - r0


# ALiBi of global positions. In a cell of a segment pair the global distance is |δ − d| (δ = j − i
# local, d the pair's offset); the library's bias in a call is −slope·|δ − diag| (diag: the call's
# diagonal). Where d = diag they agree. Elsewhere, a call whose cells all lie on one side of d
# (sign τ of δ − d) and on one side of diag (sign σ of δ − diag) computes −slope·|δ − d| exactly as
# the library's bias with the slope multiplied by flip = τ·σ plus the constant slope·shift, shift =
# τ·(d − diag): a per-row constant, which the softmax leaves alone and which only moves the call's
# lse (lse += slope·shift; the backward is given lse − slope·shift). A cell band that straddles d or
# diag is cut there, so every call qualifies. Numerically the shift is exact enough: a large
# shift means a distant block, whose weight exp(−slope·distance) is negligible.

def _alibi_calls(rect, band, d, align=None):
    crop = _aligned(_crop(rect, band), rect, align)
    if crop is None:
        return []
    lo, hi = _clip(band, crop)
    diag = _diagonal(crop)
    if d != diag:
        for cut in (diag, d):
            if lo < cut < hi:
                return _alibi_calls(crop, (lo, cut), d, align) + _alibi_calls(crop, (cut + 1, hi), d, align)
    window = _fit(crop, [(crop, band)])
    if window is None:  # the library's window normalisation; halve the rows (as _cropped_calls)
        top, bottom = _halves(crop, align)
        return _alibi_calls(top, band, d, align) + _alibi_calls(bottom, band, d, align)
    if d == diag:
        return [_Call(*crop, *window)]
    tau = 1 if lo >= d else -1
    sigma = 1 if lo >= diag else -1
    return [_Call(*crop, *window, tau * sigma, tau * (d - diag))]


def _merge_rows(calls, pairs):
    """Calls on the same columns and adjacent rows, as one call where that is exact."""
    calls = sorted(calls, key=lambda c: (c.c0, c.c1, c.r0))
    merged = []
    for call in calls:
        last = merged[-1] if merged else None
        if last is not None and (last.c0, last.c1, last.r1) == (call.c0, call.c1, call.r0):
            rect = (last.r0, call.r1, call.c0, call.c1)
            window = _fit(rect, pairs)
            if window is not None:
                merged[-1] = _Call(*rect, *window)
                continue
        merged.append(call)
    return merged


# --- calls on tensors --------------------------------------------------------------------------------

# One library call of a ring step: rows / cols index the sequence axis (dim 1) of the rank's q and
# of the K/V block (slices, or index tensors for varlen batches); varlen is None for a batch call,
# else (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of the gathered rows and columns.
# alibi: None without ALiBi; else (flip, shift) of the call (batch), or per gathered sequence
# (varlen) the tensors (sequence index, flip, shift, rows). drop: None without dropout; else
# (row offset, column offset, seq) with seq the index of the call's sequence in a varlen batch
# (whose Philox streams and ALiBi slopes the call takes), None for batch tensors.
_TensorCall = namedtuple("_TensorCall", "rows cols wl wr varlen alibi drop", defaults=(None,))


def _take(x, index):
    return x[:, index] if isinstance(index, slice) else x.index_select(1, index)


def _add_rows(acc, index, x):
    """acc[:, index] += x in fp32 (index: a slice, or an index tensor without repeats)."""
    if isinstance(index, slice):
        acc[:, index] += x
    else:
        acc.index_add_(1, index, x.to(acc.dtype))


def _shard_lengths(local, seqlen, layout, rank, world, group, device):
    """Every rank's token count: from the whole sequence's length when the caller gives it, else
    by an all-gather of the local counts (on CUDA that waits for the device: one synchronisation
    per call, which seqlen= saves)."""
    if seqlen is None:
        return _gather_lengths(local, group, device)
    lengths = [sum(s.length for s in _segments(int(seqlen), world, p, layout)) for p in range(world)]
    if lengths[rank] != local:
        raise _C.Error(f"seqlen: layout {layout!r} of a {seqlen}-token sequence gives rank {rank} {lengths[rank]} "
                       f"tokens; q holds {local}")
    return lengths


def _joined(segments):
    """The segments with those that follow each other both in the buffer and in the sequence
    made one (the two chunks of the middle rank of a zigzag layout, or of a world of one)."""
    runs = []
    for s in segments:
        if s.length == 0:
            continue
        last = runs[-1] if runs else None
        if last is not None and s.local == last.local + last.length and s.start == last.start + last.length:
            runs[-1] = Segment(last.local, last.start, last.length + s.length)
        else:
            runs.append(s)
    return tuple(runs)


def _check_dropout_shards(length, world, layout, what):
    """With dropout every shard must start at a multiple of 16 tokens (the dropout mask's block,
    where each call's position offsets lie; a rank's two chunks that follow each other count as
    one shard): with a world of one, any length; else with n chunks (world for contiguous,
    2·world for zigzag) a length L with L % (16·n) == 0 or 16·n − 1, or L ≤ 1 (the empty chunks of
    a shorter sequence are left out)."""
    starts = [s.start for p in range(world) for s in _joined(_segments(length, world, p, layout))]
    if all(start % _MASK_BLOCK == 0 for start in starts):
        return
    n = world if layout == "contiguous" else 2 * world
    raise NotImplementedError(
        f"dropout_p: ring attention with dropout needs every shard to start at a multiple of {_MASK_BLOCK} tokens "
        f"(the dropout mask's blocks); layout {layout!r} of {what} ({length} tokens) over {world} ranks gives starts "
        f"{sorted(starts)}; use a length that is a multiple of {_MASK_BLOCK * n} ({_MASK_BLOCK} x {n} chunks) or "
        f"one less")


class _BatchLayout:
    """Batch tensors (b, s, h, d): one sequence, the same shards in every batch row."""

    def __init__(self, lengths, layout, rank, world, dropout=False):
        self.seqlen = sum(lengths)
        expected = [sum(s.length for s in _segments(self.seqlen, world, p, layout)) for p in range(world)]
        if lengths != expected:
            raise _C.Error(f"q: the ranks hold {lengths} tokens; layout {layout!r} of a {self.seqlen}-token sequence "
                           f"gives {expected} (shard the batch with flashattn.distributed.shard(..., "
                           f"layout={layout!r}))")
        if dropout:
            _check_dropout_shards(self.seqlen, world, layout, "the sequence")
        self.layout, self.rank, self.world, self.lengths = layout, rank, world, lengths

    def block_tokens(self, src):
        return self.lengths[src]

    def calls(self, src, left, right, device, alibi, dropout=False):
        plan = _plan(_segments(self.seqlen, self.world, self.rank, self.layout),
                     _segments(self.seqlen, self.world, src, self.layout), left, right, alibi, dropout)
        return [_TensorCall(slice(c.r0, c.r1), slice(c.c0, c.c1), c.wl, c.wr, None,
                            (c.flip, c.shift) if alibi else None, (*c.at, None) if dropout else None) for c in plan]


class _VarlenLayout:
    """Varlen tensors (total, h, d), seen as (1, total, h, d): every sequence sharded on its own."""

    def __init__(self, cu_seqlens, layout, rank, world, dropout=False):
        self.cu, self.layout, self.rank, self.world = cu_seqlens, layout, rank, world
        if dropout:
            for b in range(len(cu_seqlens) - 1):
                _check_dropout_shards(self._len(b), world, layout, f"sequence {b}")
        self.starts = []  # starts[p][b]: where sequence b begins in rank p's buffer
        self.lengths = []
        for p in range(world):
            starts, n = [], 0
            for b in range(len(cu_seqlens) - 1):
                starts.append(n)
                n += sum(s.length for s in _segments(self._len(b), world, p, layout))
            self.starts.append(starts)
            self.lengths.append(n)

    def _len(self, b):
        return self.cu[b + 1] - self.cu[b]

    def block_tokens(self, src):
        return self.lengths[src]

    def calls(self, src, left, right, device, alibi, dropout=False):
        if dropout:
            return self._dropout_calls(src, left, right, alibi)
        # Calls of the same window go into one varlen call; a call whose rows or columns meet
        # those of an earlier call of its sequence goes into a later round, so that no row or
        # column repeats within one varlen call (its results are added by index).
        rounds = {}
        for b in range(len(self.cu) - 1):
            n = self._len(b)
            placed = {}  # (wl, wr, round) -> this sequence's calls there
            for c in _plan(_segments(n, self.world, self.rank, self.layout),
                           _segments(n, self.world, src, self.layout), left, right, alibi):
                k = 0
                while any(p.r0 < c.r1 and c.r0 < p.r1 or p.c0 < c.c1 and c.c0 < p.c1
                          for p in placed.get((c.wl, c.wr, k), ())):
                    k += 1
                placed.setdefault((c.wl, c.wr, k), []).append(c)
                qs, ks = self.starts[self.rank][b], self.starts[src][b]
                rounds.setdefault((c.wl, c.wr, k), []).append(
                    (qs + c.r0, qs + c.r1, ks + c.c0, ks + c.c1, b, c.flip, c.shift))
        calls = []
        for (wl, wr, _), spans in rounds.items():
            rows = torch.cat([torch.arange(sp[0], sp[1]) for sp in spans])
            cols = torch.cat([torch.arange(sp[2], sp[3]) for sp in spans])
            n_rows = torch.tensor([sp[1] - sp[0] for sp in spans])
            n_cols = torch.tensor([sp[3] - sp[2] for sp in spans])
            zero = torch.zeros(1, dtype=torch.int64)
            varlen = (torch.cat((zero, n_rows.cumsum(0))).to(device=device, dtype=torch.int32),
                      torch.cat((zero, n_cols.cumsum(0))).to(device=device, dtype=torch.int32),
                      int(n_rows.max()), int(n_cols.max()))
            terms = None
            if alibi:
                terms = (torch.tensor([sp[4] for sp in spans], device=device),
                         torch.tensor([float(sp[5]) for sp in spans], device=device),
                         torch.tensor([float(sp[6]) for sp in spans], device=device), n_rows.to(device))
            calls.append(_TensorCall(rows.to(device), cols.to(device), wl, wr, varlen, terms))
        return calls

    def _dropout_calls(self, src, left, right, alibi):
        """With dropout, one batch call per sequence and planned call, on slices of the buffers:
        the single-device varlen mask of sequence b uses the Philox streams offset + b·nheads + h,
        and one call's position offsets hold for one run of one sequence only."""
        calls = []
        for b in range(len(self.cu) - 1):
            n = self._len(b)
            qs, ks = self.starts[self.rank][b], self.starts[src][b]
            for c in _plan(_segments(n, self.world, self.rank, self.layout),
                           _segments(n, self.world, src, self.layout), left, right, alibi, True):
                calls.append(_TensorCall(slice(qs + c.r0, qs + c.r1), slice(ks + c.c0, ks + c.c1), c.wl, c.wr, None,
                                         (c.flip, c.shift) if alibi else None, (*c.at, b)))
        return calls


def _alibi_terms(call, slopes):
    """(the slopes to give the library call, the shift of its lse (broadcastable to (b, h, n)))
    for ALiBi slopes (h) or (b, h); (None, None) without ALiBi."""
    if slopes is None:
        return None, None
    if call.varlen is None:
        flip, shift = call.alibi
        seq = None if call.drop is None else call.drop[2]
        if seq is not None and slopes.dim() == 2:
            slopes = slopes[seq:seq + 1]                                     # a varlen sequence's (1, h)
        per_row = slopes if slopes.dim() == 2 else slopes[None]              # (b or 1, h)
        return (slopes * flip).contiguous(), (per_row * shift)[..., None]
    seq, flip, shift, n_rows = call.alibi
    per_seq = slopes if slopes.dim() == 2 else slopes[None].expand(int(seq.max()) + 1, -1)
    span = per_seq.index_select(0, seq)                                      # (sequences of the call, h)
    rows_shift = (span * shift[:, None]).repeat_interleave(n_rows, dim=0)   # (n, h)
    return (span * flip[:, None]).contiguous(), rows_shift.t()[None]


def _dropout_terms(call, dropout):
    """(dropout_p, rng_state, row offset, column offset) of one call; dropout: None or the ring
    call's (dropout_p, rng_state, nheads). A varlen sequence b's call takes the streams of b in
    the single-device call: the offset advanced by b·nheads (docs/dropout.md)."""
    if dropout is None:
        return 0.0, None, 0, 0
    p, state, heads = dropout
    row, col, seq = call.drop
    if seq:
        state = state.clone()
        state[1] += seq * heads
    return p, state, row, col


def _forward_call(q, k, v, call, scale, softcap, slopes, dropout=None):
    """out (b, n, h, dv) in q's dtype and lse (b, h, n) fp32 of one call (varlen: b = 1)."""
    qc, kc, vc = _take(q, call.rows), _take(k, call.cols), _take(v, call.cols)
    if call.varlen is None:
        p, state, row, col = _dropout_terms(call, dropout)
        out, lse, _ = _torch_ops.call("fwd", qc, kc, vc, p, scale, False, call.wl, call.wr, softcap, slopes, state,
                                      None, row, col)
        return out, lse
    cu_q, cu_k, max_q, max_k = call.varlen
    out, lse, _ = _torch_ops.call("varlen_fwd", qc[0], kc[0], vc[0], cu_q, cu_k, None, max_q, max_k, 0.0, scale,
                                  False, call.wl, call.wr, softcap, slopes, None)
    return out[None], lse[None]


def _backward_call(dout, q, k, v, out, lse, call, scale, softcap, slopes, deterministic, dropout=None):
    """dq, dk, dv of one call, given the whole row's out and lse (in the call's terms: minus its
    ALiBi shift), so that P and softmax_d are those of the whole sequence."""
    rows, cols = call.rows, call.cols
    args = (_take(dout, rows), _take(q, rows), _take(k, cols), _take(v, cols), _take(out, rows))
    if call.varlen is None:
        p, state, row, col = _dropout_terms(call, dropout)
        dq, dk, dv, _ = _torch_ops.call("bwd", *args, lse, p, scale, False, call.wl, call.wr, softcap, slopes,
                                        deterministic, state, row, col)
        return dq, dk, dv
    cu_q, cu_k, max_q, max_k = call.varlen
    dq, dk, dv, _ = _torch_ops.call("varlen_bwd", *(a[0] for a in args), lse[0], cu_q, cu_k, None, max_q, max_k,
                                    0.0, scale, False, call.wl, call.wr, softcap, slopes, deterministic, None)
    return dq[None], dk[None], dv[None]


def _merge(acc_out, acc_lse, rows, out, lse):
    """Folds one call's (out, lse) into the running fp32 (acc_out, acc_lse) of its rows with the
    library's combine. acc_out (b, s, h, dv) fp32, acc_lse (b, h, s) fp32."""
    parts = torch.stack((_take(acc_out, rows), out.to(torch.float32)))          # (2, b, n, h, dv)
    if isinstance(rows, slice):
        lses = torch.stack((acc_lse[:, :, rows], lse))                          # (2, b, h, n)
        dest = acc_out[:, rows]
    else:
        lses = torch.stack((acc_lse.index_select(2, rows), lse))
        dest = torch.empty_like(parts[0])
    merged_lse = torch.empty_like(lse)
    _torch_ops.combine(parts, lses, dest, merged_lse)
    if isinstance(rows, slice):
        acc_lse[:, :, rows] = merged_lse
    else:
        acc_out.index_copy_(1, rows, dest)
        acc_lse.index_copy_(2, rows, merged_lse)


# --- moving blocks around the ring ---------------------------------------------------------------

_SIMULATE_COMMUNICATION = False


@contextlib.contextmanager
def _compute_only():
    """Within this context the ring functions send nothing: each rank computes with its own
    block in place of the one it would receive (same shapes when the shards are equal). For
    benchmarks: the time of the computation alone, beside the time with communication."""
    global _SIMULATE_COMMUNICATION
    before, _SIMULATE_COMMUNICATION = _SIMULATE_COMMUNICATION, True
    try:
        yield
    finally:
        _SIMULATE_COMMUNICATION = before


class _Ring:
    """P2P to the next rank and from the previous one, in flight while the caller computes. With
    NCCL the transfers are issued from a CUDA stream of their own, which first waits for the work
    that produced the buffer; the compute stream waits for the transfer only when it needs the
    data. CUDA tensors over gloo travel through host copies (correct, not fast: for tests on one
    GPU)."""

    def __init__(self, group, device):
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        self.next, self.prev = (_global_rank(group, (self.rank + step) % self.world) for step in (1, -1))
        self.host = _comm_device(group, device) != device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and not self.host else None
        self.device = device
        self.simulate = _SIMULATE_COMMUNICATION

    def start(self, send, recv, tag):
        """Sends `send` to the next rank and starts receiving `recv` from the previous one; the
        handle is for wait()."""
        if self.simulate:
            if recv.shape == send.shape:
                recv.copy_(send)
            return [], None, None
        if self.host:
            send, landing = send.cpu(), torch.empty(recv.shape, dtype=recv.dtype)
        else:
            landing = recv
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, landing, self.prev, self.group, tag)]
        copy_back = (landing, recv) if self.host else None
        if self.stream is None:
            # The handle keeps the (host) send buffer alive until the transfer is waited for.
            return dist.batch_isend_irecv(ops), copy_back, send
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            reqs = dist.batch_isend_irecv(ops)
        # The caching allocator must not hand these buffers out again before the transfer is done.
        send.record_stream(self.stream)
        recv.record_stream(self.stream)
        return reqs, None, send

    def wait(self, handle):
        reqs, copy_back, _ = handle
        if self.stream is None:
            for r in reqs:
                r.wait()
            if copy_back is not None:
                copy_back[1].copy_(copy_back[0])
            return
        with torch.cuda.stream(self.stream):
            for r in reqs:
                r.wait()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


def _pack(k, v):
    """k and v in one flat buffer: one message per block."""
    return torch.cat((k.reshape(-1), v.reshape(-1)))


def _unpack(buf, b, n, heads, d, dv):
    nk = b * n * heads * d
    return buf[:nk].view(b, n, heads, d), buf[nk:].view(b, n, heads, dv)


# --- ring attention ----------------------------------------------------------------------------------


class _RingAttention(torch.autograd.Function):
    """q (b, s, h, d), k (b, s, hk, d), v (b, s, hk, dv): this rank's shard (varlen: b = 1).
    dropout_p > 0: every call draws its part of the mask of the whole sequence's call with
    rng_state (the same on every rank), forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, layout, scale, left, right, softcap, alibi_slopes, deterministic, group, dropout_p,
                rng_state):
        head_dim_v = v.shape[-1]
        q_p, k_p, v_p = _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v)
        b, s, h, _ = q_p.shape
        hk, d, dv = k_p.shape[2], k_p.shape[3], v_p.shape[3]
        ring = _Ring(group, q.device)
        acc_out = torch.zeros((b, s, h, dv), dtype=torch.float32, device=q.device)
        acc_lse = torch.full((b, h, s), -_INF, dtype=torch.float32, device=q.device)
        block = _pack(k_p, v_p)
        dropout = None if dropout_p == 0.0 else (dropout_p, rng_state, h)
        steps = []
        for step in range(ring.world):
            src = (ring.rank - step) % ring.world
            if step + 1 < ring.world:
                incoming = block.new_empty(b * layout.block_tokens((src - 1) % ring.world) * hk * (d + dv))
                pending = ring.start(block, incoming, _TAG_KV)
            kb, vb = _unpack(block, b, layout.block_tokens(src), hk, d, dv)
            calls = [(call, *_alibi_terms(call, alibi_slopes))
                     for call in layout.calls(src, left, right, q.device, alibi_slopes is not None,
                                              dropout is not None)]
            steps.append(calls)
            for call, slopes, lse_shift in calls:
                out, lse = _forward_call(q_p, kb, vb, call, scale, softcap, slopes, dropout)
                _merge(acc_out, acc_lse, call.rows, out, lse if lse_shift is None else lse + lse_shift)
            if step + 1 < ring.world:
                ring.wait(pending)
                block = incoming
        # A row that saw no key anywhere (only possible for an empty sequence) has lse +inf (SPEC §2).
        lse = torch.where(acc_lse == -_INF, _INF, acc_lse)
        out_p = acc_out.to(q.dtype)
        ctx.save_for_backward(q_p, k_p, v_p, out_p, lse, rng_state)
        ctx.steps, ctx.layout, ctx.group = steps, layout, group
        ctx.args = (scale, softcap, deterministic, dropout_p)
        ctx.head_dims = (q.shape[-1], k.shape[-1], head_dim_v)
        ctx.mark_non_differentiable(lse)
        return out_p[..., :head_dim_v], lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q_p, k_p, v_p, out_p, lse, rng_state = ctx.saved_tensors
        scale, softcap, deterministic, dropout_p = ctx.args
        layout = ctx.layout
        head_dim, head_dim_k, head_dim_v = ctx.head_dims
        dout_p = _pad_head_dim(dout)
        b, s, h, _ = q_p.shape
        hk, d, dv = k_p.shape[2], k_p.shape[3], v_p.shape[3]
        dropout = None if dropout_p == 0.0 else (dropout_p, rng_state, h)
        ring = _Ring(ctx.group, q_p.device)
        dq_acc = torch.zeros(q_p.shape, dtype=torch.float32, device=q_p.device)
        block = _pack(k_p, v_p)
        grads_in = pending_grads = None
        for step in range(ring.world):
            src = (ring.rank - step) % ring.world
            nxt = (src - 1) % ring.world
            if step + 1 < ring.world:
                incoming = block.new_empty(b * layout.block_tokens(nxt) * hk * (d + dv))
                pending = ring.start(block, incoming, _TAG_KV)
            n = layout.block_tokens(src)
            kb, vb = _unpack(block, b, n, hk, d, dv)
            grads = torch.zeros(b * n * hk * (d + dv), dtype=torch.float32, device=q_p.device)
            dk_acc, dv_acc = _unpack(grads, b, n, hk, d, dv)
            for call, slopes, lse_shift in ctx.steps[step]:
                rows = call.rows
                lse_rows = lse[:, :, rows] if isinstance(rows, slice) else lse.index_select(2, rows)
                lse_rows = (lse_rows if lse_shift is None else lse_rows - lse_shift).contiguous()
                dq, dk, dv_ = _backward_call(dout_p, q_p, kb, vb, out_p, lse_rows, call, scale, softcap, slopes,
                                             deterministic, dropout)
                _add_rows(dq_acc, call.rows, dq)
                _add_rows(dk_acc, call.cols, dk)
                _add_rows(dv_acc, call.cols, dv_)
            if pending_grads is not None:
                # The accumulator of this block, from the ranks that computed with it before.
                ring.wait(pending_grads)
                grads += grads_in
            if ring.world > 1:
                # On to the next rank, which computes with this block next; after the last step
                # it arrives home, at the block's own rank.
                grads_in = grads.new_empty(b * layout.block_tokens(nxt) * hk * (d + dv))
                pending_grads = ring.start(grads, grads_in, _TAG_DKV)
            else:
                grads_in = grads
            if step + 1 < ring.world:
                ring.wait(pending)
                block = incoming
        if pending_grads is not None:
            ring.wait(pending_grads)
        dk, dv_ = _unpack(grads_in, b, s, hk, d, dv)
        return (dq_acc[..., :head_dim].to(q_p.dtype), dk[..., :head_dim_k].to(k_p.dtype),
                dv_[..., :head_dim_v].to(v_p.dtype)) + (None,) * 10


def _ring_arguments(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, layout, batch):
    _check_layout(layout)
    heads = q.shape[-2]
    if alibi_slopes is not None and (alibi_slopes.dtype != torch.float32 or alibi_slopes.device != q.device
                                     or tuple(alibi_slopes.shape) not in ((heads,), (batch, heads))):
        raise _C.Error(f"alibi_slopes: must be float32 of shape ({heads},) or ({batch}, {heads}) on q's device; got "
                       f"{alibi_slopes.dtype} {tuple(alibi_slopes.shape)} on {alibi_slopes.device}")
    if softcap < 0:
        raise _C.Error(f"softcap: must be ≥ 0; got {softcap}")
    left, right = window_pair(window_size)
    if left < -1 or right < -1:
        raise _C.Error(f"window_size: sizes must be ≥ -1; got {window_size!r}")
    if causal:
        right = 0
    if k.shape[-3] != q.shape[-3] or v.shape[-3] != q.shape[-3]:
        raise _C.Error(f"k: ring attention is self-attention over one sharded sequence: q, k and v must hold the "
                       f"same tokens; got {q.shape[-3]}, {k.shape[-3]} and {v.shape[-3]}")
    return resolve_softmax_scale(softmax_scale, q.shape[-1]), left, right, float(softcap)


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                         group=None, layout="contiguous", seqlen=None):
    """flash_attn_func over a sequence sharded across `group` (default: the world), by ring attention.

    q (batch, seqlen_local, nheads, headdim), k/v (batch, seqlen_local, nheads_k, headdim[_v]):
    this rank's shard of one sequence (of q, k and v alike), cut by ``shard(x, layout=layout)``.
    causal, window_size, softcap and alibi_slopes ((nheads,) or (batch, nheads) fp32) apply to
    global positions, as on one device; GQA/MQA as in flash_attn_func. Returns this rank's out
    (batch, seqlen_local, nheads, headdim_v), or with return_attn_probs=True (out, softmax_lse
    (batch, nheads, seqlen_local), None). dropout_p > 0 draws the mask of flash_attn_func on the
    whole sequence with the same rng_state (drawn on the group's first rank, as flash_attn_func
    draws it, and broadcast); it needs every shard to start at a multiple of 16 tokens: a length
    that is a multiple of 16·world (contiguous) or 16·2·world (zigzag), or one less
    (NotImplementedError otherwise; see the module). seqlen: the whole sequence's length,
    optional — without it the ranks all-gather their local lengths, which on CUDA synchronises
    with the device.
    """
    _check_inputs((("q", q), ("k", k), ("v", v)), 4, BATCH_LAYOUT, (("alibi_slopes", alibi_slopes),))
    dropout_p = check_dropout_p(dropout_p)
    scale, left, right, softcap = _ring_arguments(q, k, v, softmax_scale, causal, window_size, softcap,
                                                  alibi_slopes, layout, q.shape[0])
    rank, world = _group_info(group)
    lengths = _shard_lengths(q.shape[1], seqlen, layout, rank, world, group, q.device)
    plan = _BatchLayout(lengths, layout, rank, world, dropout_p > 0.0)
    rng_state = _shared_rng_state(dropout_p, group, q.device)
    out, lse = _RingAttention.apply(q, k, v, plan, scale, left, right, softcap, alibi_slopes, bool(deterministic),
                                    group, dropout_p, rng_state)
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
                                *, group=None, layout="contiguous"):
    """flash_attn_varlen_func over a varlen batch whose every sequence is sharded across `group`.

    cu_seqlens_q / cu_seqlens_k: the prefix sums of the WHOLE batch ((batch + 1) int32, equal:
    self-attention), the same on every rank. q (total_local, nheads, headdim), k/v (total_local,
    nheads_k, headdim[_v]): this rank's tokens, as ``shard(x, cu_seqlens=cu_seqlens_q,
    layout=layout)`` cuts them (``local_cu_seqlens`` gives their boundaries). max_seqlen_q/k are
    checked against cu_seqlens. Returns this rank's out (total_local, nheads, headdim_v), or
    (out, softmax_lse (nheads, total_local), None). block_table (paged K/V) is not supported.
    dropout_p > 0 draws the mask of flash_attn_varlen_func on the whole batch (sequence b on the
    Philox streams of batch index b) and needs every sequence's length to qualify as in
    ring_flash_attn_func; it is slower than without dropout: each step makes one call per sequence
    and segment pair instead of a few varlen calls for all sequences.
    """
    if block_table is not None:
        raise NotImplementedError("block_table: paged K/V is not supported by ring attention (each rank's K/V shard "
                                  "travels as one contiguous block)")
    _check_inputs((("q", q), ("k", k), ("v", v)), 3, VARLEN_LAYOUT, (("alibi_slopes", alibi_slopes),))
    cu_q, cu_k = _as_list(cu_seqlens_q), _as_list(cu_seqlens_k)
    if cu_q != cu_k:
        raise _C.Error("cu_seqlens_k: ring attention is self-attention: cu_seqlens_k must equal cu_seqlens_q")
    longest = max((cu_q[i + 1] - cu_q[i] for i in range(len(cu_q) - 1)), default=0)
    if max(int(max_seqlen_q), int(max_seqlen_k)) < longest:
        raise _C.Error(f"max_seqlen_q: must be at least the longest sequence of cu_seqlens_q ({longest}); got "
                       f"{max_seqlen_q} and max_seqlen_k {max_seqlen_k}")
    dropout_p = check_dropout_p(dropout_p)
    scale, left, right, softcap = _ring_arguments(q, k, v, softmax_scale, causal, window_size, softcap,
                                                  alibi_slopes, layout, len(cu_q) - 1)
    rank, world = _group_info(group)
    plan = _VarlenLayout(cu_q, layout, rank, world, dropout_p > 0.0)
    if q.shape[0] != plan.lengths[rank]:
        raise _C.Error(f"q: rank {rank} holds {q.shape[0]} tokens; layout {layout!r} of cu_seqlens gives it "
                       f"{plan.lengths[rank]} (shard with flashattn.distributed.shard(..., cu_seqlens=...))")
    rng_state = _shared_rng_state(dropout_p, group, q.device)
    out, lse = _RingAttention.apply(q[None], k[None], v[None], plan, scale, left, right, softcap, alibi_slopes,
                                    bool(deterministic), group, dropout_p, rng_state)
    out, lse = out[0], lse[0]
    return (out, lse, None) if return_attn_probs else out


# --- Ulysses: all-to-all over heads ----------------------------------------------------------------


class _SeqHeadExchange:
    """The all-to-alls between sequence shards (b, s_local, H, ...) and head shards (b, S, H / world,
    ...), S in sequence order."""

    def __init__(self, lengths, layout, rank, world, group, device):
        self.lengths, self.rank, self.world, self.group = lengths, rank, world, group
        seqlen = sum(lengths)
        # Where each token of the rank-ordered concatenation of the shards sits in the sequence.
        order = [start + i for p in range(world) for start, n in _token_runs(world, p, layout, seqlen=seqlen)
                 for i in range(n)]
        self.to_sequence = None if order == sorted(order) else torch.tensor(order, device=device).argsort()
        self.to_ranks = None if self.to_sequence is None else torch.tensor(order, device=device)

    def _all_to_all(self, recv, send, recv_sizes, send_sizes):
        host = _comm_device(self.group, send.device)
        landing = recv if host == recv.device else torch.empty(recv.shape, dtype=recv.dtype, device=host)
        dist.all_to_all_single(landing, send.to(host), recv_sizes, send_sizes, group=self.group)
        if landing is not recv:
            recv.copy_(landing)

    def to_heads(self, x):
        """x (b, s_local, H, *rest) -> (b, S, H / world, *rest)."""
        b, s, heads = x.shape[:3]
        rest = x.shape[3:]
        part = heads // self.world
        send = x.reshape(b, s, self.world, part, *rest).movedim(2, 0).contiguous()
        recv = x.new_empty((sum(self.lengths) * b * part * _numel(rest),))
        unit = b * part * _numel(rest)
        self._all_to_all(recv, send.reshape(-1), [n * unit for n in self.lengths], [s * unit] * self.world)
        pieces = torch.split(recv, [n * unit for n in self.lengths])
        y = torch.cat([p.view(b, n, part, *rest) for p, n in zip(pieces, self.lengths)], dim=1)
        return y if self.to_sequence is None else y.index_select(1, self.to_sequence)

    def to_sequence_shards(self, y):
        """y (b, S, H / world, *rest) -> (b, s_local, H, *rest)."""
        if self.to_ranks is not None:
            y = y.index_select(1, self.to_ranks)
        b, _, part = y.shape[:3]
        rest = y.shape[3:]
        s = self.lengths[self.rank]
        unit = b * part * _numel(rest)
        send = torch.cat([c.reshape(-1) for c in torch.split(y, self.lengths, dim=1)])
        recv = y.new_empty((self.world * s * unit,))
        self._all_to_all(recv, send, [s * unit] * self.world, [n * unit for n in self.lengths])
        return recv.view(self.world, b, s, part, *rest).movedim(0, 2).reshape(b, s, self.world * part, *rest)


def _numel(shape):
    n = 1
    for x in shape:
        n *= x
    return n


def _ulysses_rng(rng_state, rank, heads_per_rank, heads, b):
    """The [seed, offset] of batch row b's call on this rank's heads, so that its Philox streams
    are those of the same heads in a single-device call over all heads (docs/dropout.md:
    stream = offset + batch·nheads + head)."""
    state = rng_state.clone()
    state[1] += b * heads + rank * heads_per_rank
    return state


class _UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, exchange, kv_repeat, dropout_p, scale, left, right, softcap, alibi_slopes,
                deterministic, rng_state):
        head_dim, head_dim_k, head_dim_v = q.shape[-1], k.shape[-1], v.shape[-1]
        q_p, k_p, v_p = _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v)
        if kv_repeat > 1:
            k_p, v_p = k_p.repeat_interleave(kv_repeat, dim=2), v_p.repeat_interleave(kv_repeat, dim=2)
        qh, kh, vh = exchange.to_heads(q_p), exchange.to_heads(k_p), exchange.to_heads(v_p)
        heads, part = q.shape[2], qh.shape[2]
        slopes = None
        if alibi_slopes is not None:
            sl = slice(exchange.rank * part, (exchange.rank + 1) * part)
            slopes = (alibi_slopes[sl] if alibi_slopes.dim() == 1 else alibi_slopes[:, sl]).contiguous()
        outs, lses = [], []
        # With dropout, one call per batch row: the offset of each puts its heads' Philox streams
        # where the single-device call has them.
        rows = range(qh.shape[0]) if dropout_p > 0.0 and qh.shape[0] > 1 else [None]
        for row in rows:
            sel = slice(None) if row is None else slice(row, row + 1)
            state = None if dropout_p == 0.0 else _ulysses_rng(rng_state, exchange.rank, part, heads, row or 0)
            row_slopes = slopes if slopes is None or slopes.dim() == 1 else slopes[sel]
            out, lse, _ = _torch_ops.call("fwd", qh[sel], kh[sel], vh[sel], dropout_p, scale, False, left, right,
                                          softcap, row_slopes, state)
            outs.append(out)
            lses.append(lse)
        out_h, lse_h = torch.cat(outs), torch.cat(lses)
        out = exchange.to_sequence_shards(out_h)
        lse = exchange.to_sequence_shards(lse_h.transpose(1, 2)).transpose(1, 2).contiguous()
        ctx.save_for_backward(qh, kh, vh, out_h, lse_h, slopes, rng_state)
        ctx.exchange, ctx.kv_repeat = exchange, kv_repeat
        ctx.args = (dropout_p, scale, left, right, softcap, deterministic)
        ctx.head_dims = (head_dim, head_dim_k, head_dim_v)
        ctx.mark_non_differentiable(lse)
        return out[..., :head_dim_v], lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        qh, kh, vh, out_h, lse_h, slopes, rng_state = ctx.saved_tensors
        dropout_p, scale, left, right, softcap, deterministic = ctx.args
        exchange = ctx.exchange
        head_dim, head_dim_k, head_dim_v = ctx.head_dims
        douth = exchange.to_heads(_pad_head_dim(dout))
        heads = qh.shape[2] * exchange.world
        rows = range(qh.shape[0]) if dropout_p > 0.0 and qh.shape[0] > 1 else [None]
        grads = []
        for row in rows:
            sel = slice(None) if row is None else slice(row, row + 1)
            state = None if dropout_p == 0.0 else _ulysses_rng(rng_state, exchange.rank, qh.shape[2], heads, row or 0)
            row_slopes = slopes if slopes is None or slopes.dim() == 1 else slopes[sel]
            grads.append(_torch_ops.call("bwd", douth[sel], qh[sel], kh[sel], vh[sel], out_h[sel],
                                         lse_h[sel].contiguous(), dropout_p, scale, False, left, right, softcap,
                                         row_slopes, deterministic, state)[:3])
        dq, dk, dv = (exchange.to_sequence_shards(torch.cat(g)) for g in zip(*grads))
        if ctx.kv_repeat > 1:
            b, s, hk_rep = dk.shape[:3]
            dk = dk.view(b, s, hk_rep // ctx.kv_repeat, ctx.kv_repeat, -1).sum(3)
            dv = dv.view(b, s, hk_rep // ctx.kv_repeat, ctx.kv_repeat, -1).sum(3)
        return (dq[..., :head_dim], dk[..., :head_dim_k], dv[..., :head_dim_v]) + (None,) * 10


def ulysses_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                            group=None, layout="contiguous", seqlen=None):
    """flash_attn_func over a sequence sharded across `group`, by all-to-all head parallelism.

    Arguments and results as ring_flash_attn_func; in addition alibi_slopes ((nheads,) or (batch,
    nheads) fp32, the same on every rank) and dropout_p > 0 work: the dropout mask is the one a
    single-device call with the same rng_state draws (the [seed, offset] pair is drawn on the
    group's first rank and broadcast). Needs nheads % world == 0, and nheads_k % world == 0 or
    world % nheads_k == 0 (then each K/V head is repeated world / nheads_k times). seqlen as in
    ring_flash_attn_func."""
    _check_inputs((("q", q), ("k", k), ("v", v)), 4, BATCH_LAYOUT, (("alibi_slopes", alibi_slopes),))
    _check_layout(layout)
    dropout_p = check_dropout_p(dropout_p)
    rank, world = _group_info(group)
    heads, heads_k = q.shape[2], k.shape[2]
    if heads % world:
        raise _C.Error(f"q: Ulysses spreads the {heads} query heads over the {world} ranks: nheads must be a "
                       f"multiple of the world size (use ring_flash_attn_func)")
    if heads_k % world and world % heads_k:
        raise _C.Error(f"k: {heads_k} key/value heads cannot be spread over {world} ranks: nheads_k % world == 0 "
                       f"or world % nheads_k == 0 is needed (use ring_flash_attn_func)")
    if heads_k == 0 or heads % heads_k:
        raise _C.Error(f"k: nheads ({heads}) must be a multiple of nheads_k ({heads_k})")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise _C.Error(f"k: Ulysses attention is self-attention over one sharded sequence: q, k and v must hold "
                       f"the same tokens; got {q.shape[1]}, {k.shape[1]} and {v.shape[1]}")
    if softcap < 0:
        raise _C.Error(f"softcap: must be ≥ 0; got {softcap}")
    left, right = window_pair(window_size)
    if causal:
        right = 0
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    lengths = _shard_lengths(q.shape[1], seqlen, layout, rank, world, group, q.device)
    _BatchLayout(lengths, layout, rank, world)  # checks the shard sizes
    exchange = _SeqHeadExchange(lengths, layout, rank, world, group, q.device)
    rng_state = _shared_rng_state(dropout_p, group, q.device)
    kv_repeat = 1 if heads_k % world == 0 else world // heads_k
    out, lse = _UlyssesAttention.apply(q, k, v, exchange, kv_repeat, dropout_p, scale, left, right, float(softcap),
                                       alibi_slopes, bool(deterministic), rng_state)
    return (out, lse, None) if return_attn_probs else out
