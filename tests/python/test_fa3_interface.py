"""flashattn.fa3: FlashAttention-3's interface — argument specs, results and gradients against the
float64 oracle, seqused_k, flash_attn_combine, the KV-cache function with varlen queries and new
keys over a paged cache (against the library's batch KV-cache path, sequence by sequence), and
what it refuses."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")

import flashattn  # noqa: E402
from flashattn import fa3  # noqa: E402

from conftest import torch_devices  # noqa: E402
from torch_checks import check_batch, check_varlen, randn  # noqa: E402

NO_DEFAULT = object()
_HINTS = [("num_splits", 1), ("pack_gqa", None), ("deterministic", False), ("sm_margin", 0),
          ("return_attn_probs", False)]
_FP8 = [("q_descale", None), ("k_descale", None), ("v_descale", None)]
_MASKING = [("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0)]


def _required(names):
    return [(n, NO_DEFAULT) for n in names]


# Attention sinks, after FlashAttention-3's own arguments: its name and vLLM's (docs/sinks.md).
_SINKS = [("learnable_sink", None), ("s_aux", None)]

# FlashAttention-3's argument lists (hopper/flash_attn_interface.py), and the sinks.
SIGNATURES = {
    "flash_attn_func": _required(["q", "k", "v"]) + [("softmax_scale", None), ("causal", False), ("qv", None)]
    + _FP8 + _MASKING + _HINTS + _SINKS,
    "flash_attn_qkvpacked_func": _required(["qkv"]) + [("softmax_scale", None), ("causal", False)] + _FP8
    + _MASKING + [("deterministic", False), ("num_heads_q", None), ("sm_margin", 0), ("return_attn_probs", False)],
    "flash_attn_varlen_func": _required(["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                         "max_seqlen_k"])
    + [("seqused_q", None), ("seqused_k", None), ("softmax_scale", None), ("causal", False), ("qv", None)]
    + _FP8 + _MASKING + _HINTS + _SINKS,
    "flash_attn_combine": _required(["out_partial", "lse_partial"]) + [("out", None), ("out_dtype", None)],
    "flash_attn_with_kvcache": _required(["q", "k_cache", "v_cache"]) + [
        ("k", None), ("v", None), ("qv", None), ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
        ("cache_batch_idx", None), ("cache_leftpad", None), ("page_table", None), ("cu_seqlens_q", None),
        ("cu_seqlens_k_new", None), ("max_seqlen_q", None), ("rotary_seqlens", None)] + _FP8 + [
        ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("attention_chunk", 0),
        ("softcap", 0.0), ("rotary_interleaved", True), ("scheduler_metadata", None), ("num_splits", 0),
        ("pack_gqa", None), ("sm_margin", 0), ("return_softmax_lse", False)] + _SINKS,
}


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_argspec(name):
    spec = inspect.getfullargspec(getattr(fa3, name))
    defaults = spec.defaults or ()
    got = list(zip(spec.args, [NO_DEFAULT] * (len(spec.args) - len(defaults)) + list(defaults)))
    assert got == SIGNATURES[name]


def cu(lengths, device):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)


@pytest.mark.parametrize("device", torch_devices())
def test_flash_attn_func(device):
    """FA3's order (softmax_scale, causal positionally), (out, lse) on request, gradients."""
    g = torch.Generator().manual_seed(1)
    q = randn((2, 29, 4, 64), torch.bfloat16, device, g)
    k = randn((2, 41, 2, 64), torch.bfloat16, device, g)
    v = randn((2, 41, 2, 64), torch.bfloat16, device, g)
    dout = randn((2, 29, 4, 64), torch.bfloat16, device, g)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = fa3.flash_attn_func(qg, kg, vg, 0.2, True, window_size=(12, -3), softcap=5.0, return_attn_probs=True)
    out.backward(dout)
    check_batch(q, k, v, out, lse, grads=(qg.grad, kg.grad, vg.grad), dout=dout, softmax_scale=0.2, causal=True,
                window=(12, -1), softcap=5.0)
    assert isinstance(fa3.flash_attn_func(q, k, v), torch.Tensor)


@pytest.mark.parametrize("device", torch_devices())
def test_qkvpacked(device):
    """qkv (b, s, 3, h, d) and the GQA layout (b, s, hq + 2·hk, d): the gradient is one dqkv."""
    g = torch.Generator().manual_seed(2)
    qkv = randn((2, 17, 3, 2, 32), torch.float16, device, g).requires_grad_()
    out = fa3.flash_attn_qkvpacked_func(qkv, causal=True)
    out.sum().backward()
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv.unbind(2))
    ref = flashattn.flash_attn_func(q, k, v, causal=True)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(qkv.grad, torch.stack([q.grad, k.grad, v.grad], 2), rtol=0, atol=0)

    packed = randn((1, 9, 4 + 2 * 1, 32), torch.float16, device, g)
    out = fa3.flash_attn_qkvpacked_func(packed, num_heads_q=4)
    torch.testing.assert_close(out, flashattn.flash_attn_func(packed[:, :, :4], packed[:, :, 4:5],
                                                              packed[:, :, 5:6]), rtol=0, atol=0)


def varlen_inputs(lq, lk, h, d, device, seed):
    """Packed bf16 q, k, v and dout of sequences of lq queries and lk keys."""
    g = torch.Generator().manual_seed(seed)
    return tuple(randn((sum(n), h, d), torch.bfloat16, device, g) for n in (lq, lk, lk, lq))


@pytest.mark.parametrize("device", torch_devices())
def test_varlen_seqused_k(device):
    """seqused_k: only the first seqused_k[i] keys of sequence i count, forward and backward;
    the unused keys get no gradient."""
    lq, lk, used = [7, 0, 12], [10, 5, 20], [4, 5, 13]
    q, k, v, dout = varlen_inputs(lq, lk, 2, 48, device, 3)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    seqused = torch.tensor(used, dtype=torch.int32, device=device)
    out, lse = fa3.flash_attn_varlen_func(qg, kg, vg, cu(lq, device), cu(lk, device), max(lq), max(lk),
                                          seqused_k=seqused, causal=True, return_attn_probs=True)
    out.backward(dout)
    starts = cu(lk, "cpu").tolist()
    keep = torch.cat([torch.arange(starts[i], starts[i] + used[i]) for i in range(3)]).to(device)
    dropped = torch.ones(sum(lk), dtype=torch.bool, device=device)
    dropped[keep] = False
    check_varlen(q, k[keep], v[keep], cu(lq, "cpu").tolist(), cu(used, "cpu").tolist(), out, lse,
                 max_seqlen_k=max(used), grads=(qg.grad, kg.grad[keep], vg.grad[keep]), dout=dout, causal=True)
    assert torch.all(kg.grad[dropped] == 0) and torch.all(vg.grad[dropped] == 0)


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_seqused_q(causal, device):
    """seqused_q: only the first seqused_q[i] queries of sequence i are attended (the causal mask
    aligned to that length), as the same call on those rows alone gives them, out and lse and dq
    bit-equal; the other rows get out 0, lse +inf and dq 0; against the float64 oracle too."""
    lq, used_q, lk, used_k = [7, 0, 12, 5], [4, 0, 12, 0], [10, 5, 20, 3], [9, 5, 13, 3]
    q, k, v, dout = varlen_inputs(lq, lk, 2, 40, device, 21)
    seqused_k = torch.tensor(used_k, dtype=torch.int32, device=device)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = fa3.flash_attn_varlen_func(qg, kg, vg, cu(lq, device), cu(lk, device), max(lq), max(lk),
                                          seqused_q=torch.tensor(used_q, dtype=torch.int32, device=device),
                                          seqused_k=seqused_k, causal=causal, return_attn_probs=True)
    out.backward(dout)
    starts = cu(lq, "cpu").tolist()
    used = torch.cat([torch.arange(starts[i], starts[i] + used_q[i]) for i in range(len(lq))]).to(device)
    unused = torch.ones(sum(lq), dtype=torch.bool, device=device)
    unused[used] = False
    assert torch.all(out[unused] == 0) and torch.all(lse[:, unused] == float("inf"))
    assert torch.all(qg.grad[unused] == 0)
    q_alone = q[used].clone().requires_grad_()
    k_alone, v_alone = (x.clone().requires_grad_() for x in (k, v))
    out_alone, lse_alone = fa3.flash_attn_varlen_func(q_alone, k_alone, v_alone, cu(used_q, device), cu(lk, device),
                                                      max(lq), max(lk), seqused_k=seqused_k, causal=causal,
                                                      return_attn_probs=True)
    out_alone.backward(dout[used])
    torch.testing.assert_close(out[used], out_alone, rtol=0, atol=0)
    torch.testing.assert_close(lse[:, used], lse_alone, rtol=0, atol=0)
    for name, a, b in (("dq", qg.grad[used], q_alone.grad), ("dk", kg.grad, k_alone.grad),
                       ("dv", vg.grad, v_alone.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    k_starts = cu(lk, "cpu").tolist()
    keep = torch.cat([torch.arange(k_starts[i], k_starts[i] + used_k[i]) for i in range(len(lk))]).to(device)
    check_varlen(q[used], k[keep], v[keep], cu(used_q, "cpu").tolist(), cu(used_k, "cpu").tolist(), out[used],
                 lse[:, used], max_seqlen_k=max(used_k), grads=(qg.grad[used], kg.grad[keep], vg.grad[keep]),
                 dout=dout[used], causal=causal)
    assert isinstance(fa3.flash_attn_varlen_func(q, k, v, cu(lq, device), cu(lk, device), max(lq), max(lk),
                                                 seqused_q=torch.tensor(used_q, dtype=torch.int32, device=device)),
                      torch.Tensor)


def test_varlen_seqused_q_errors():
    """seqused_q past its sequence's length, of the wrong dtype or batch: flashattn.Error naming it."""
    q = torch.zeros((9, 2, 16), dtype=torch.bfloat16)
    cq = cu([4, 5], "cpu")
    for used, fragment in (([5, 0], r"seqused_q: entry 0 must lie in \[0, 4\]"), ([0, -1], "seqused_q: entry 1"),
                           ([1, 1, 1], r"seqused_q: must be \(2,\)")):
        with pytest.raises(flashattn.Error, match=fragment):
            fa3.flash_attn_varlen_func(q, q, q, cq, cq, 5, 5, seqused_q=torch.tensor(used, dtype=torch.int32))
    with pytest.raises(flashattn.Error, match="seqused_q: must be a 1-D int32"):
        fa3.flash_attn_varlen_func(q, q, q, cq, cq, 5, 5, seqused_q=torch.tensor([1, 1]))
    with pytest.raises(flashattn.Error, match="cu_seqlens_q: must start at"):
        fa3.flash_attn_varlen_func(q, q, q, cu([4, 6], "cpu"), cq, 6, 5,
                                   seqused_q=torch.tensor([1, 1], dtype=torch.int32))


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16], ids=str)
def test_combine(out_dtype, device):
    """Attention over three blocks of keys, merged by flash_attn_combine, is attention over all."""
    g = torch.Generator().manual_seed(4)
    q = randn((2, 11, 3, 32), torch.bfloat16, device, g)
    k = randn((2, 30, 3, 32), torch.bfloat16, device, g)
    v = randn((2, 30, 3, 32), torch.bfloat16, device, g)
    parts = [fa3.flash_attn_func(q, k[:, a:b], v[:, a:b], return_attn_probs=True) for a, b in ((0, 7), (7, 19),
                                                                                              (19, 30))]
    out_partial = torch.stack([o.float() for o, _ in parts])  # (splits, b, sq, h, d)
    lse_partial = torch.stack([lse.transpose(1, 2) for _, lse in parts])  # (splits, b, sq, h)
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial, out_dtype=out_dtype)
    assert out.dtype == (out_dtype or torch.float32) and lse.shape == (2, 11, 3)
    check_batch(q, k, v, out.to(torch.bfloat16), lse.transpose(1, 2))
    given = torch.empty((2, 11, 3, 32), dtype=torch.float32, device=device)
    out_into, _ = fa3.flash_attn_combine(out_partial, lse_partial, out=given)
    assert out_into is given and torch.equal(given.to(out.dtype), out)


def paged_like(cache_rows, table, page_size):
    """cache_rows (b, cap, hk, d) laid out in the blocks that table (b, cap / page_size) names."""
    blocks = torch.empty((table.numel(), page_size) + tuple(cache_rows.shape[2:]), dtype=cache_rows.dtype,
                         device=cache_rows.device)
    for i in range(table.shape[0]):
        for j in range(table.shape[1]):
            blocks[table[i, j]] = cache_rows[i, j * page_size:(j + 1) * page_size]
    return blocks


def shuffled_table(batch, blocks_per_seq, device, g):
    return torch.randperm(batch * blocks_per_seq, generator=g).view(batch, blocks_per_seq).to(torch.int32).to(device)


def unpaged(blocks, table):
    return torch.stack([blocks[table[i].long()].flatten(0, 1) for i in range(table.shape[0])])


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_varlen_paged(causal, device):
    """Chunked prefill as serving engines call it: varlen queries and new keys of each sequence,
    appended (rotated) into a paged cache and attended to. Each sequence equals the library's
    batch KV-cache call on its own (rotation, append and attention), cache contents bit-equal."""
    # Pages of 4 rows: the CUDA kernels read the entries of pages under 16 rows row by row.
    b, hq, hk, d = 3, 4, 2, 32
    cap, page = 24, 4
    old, n_new, n_q = [5, 0, 9], [2, 3, 1], [2, 3, 1]
    g = torch.Generator().manual_seed(5)
    cache_k = randn((b, cap, hk, d), torch.bfloat16, device, g)
    cache_v = randn((b, cap, hk, d), torch.bfloat16, device, g)
    q = randn((sum(n_q), hq, d), torch.bfloat16, device, g)
    k_new = randn((sum(n_new), hk, d), torch.bfloat16, device, g)
    v_new = randn((sum(n_new), hk, d), torch.bfloat16, device, g)
    angles = np.outer(np.arange(cap), 10000.0 ** (-np.arange(0, d, 2) / d))
    cos = torch.from_numpy(np.cos(angles)).to(device=device, dtype=torch.bfloat16)
    sin = torch.from_numpy(np.sin(angles)).to(device=device, dtype=torch.bfloat16)
    table = shuffled_table(b, cap // page, device, g)
    k_blocks, v_blocks = paged_like(cache_k, table, page), paged_like(cache_v, table, page)
    seqlens = torch.tensor(old, dtype=torch.int32, device=device)
    out, lse, accum, lse_accum = fa3.flash_attn_with_kvcache(
        q, k_blocks, v_blocks, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
        page_table=table, cu_seqlens_q=cu(n_q, device), cu_seqlens_k_new=cu(n_new, device), max_seqlen_q=max(n_q),
        causal=causal, rotary_interleaved=False, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (hq, sum(n_q)) and accum.numel() == 0 and lse_accum.numel() == 0
    cq, ck = cu(n_q, "cpu").tolist(), cu(n_new, "cpu").tolist()
    for i in range(b):
        k_ref, v_ref = cache_k[i:i + 1].clone(), cache_v[i:i + 1].clone()
        out_ref, lse_ref = flashattn.flash_attn_with_kvcache(
            q[cq[i]:cq[i + 1]].unsqueeze(0), k_ref, v_ref, k_new[ck[i]:ck[i + 1]].unsqueeze(0),
            v_new[ck[i]:ck[i + 1]].unsqueeze(0), cos, sin, cache_seqlens=seqlens[i:i + 1], causal=causal,
            rotary_interleaved=False, return_softmax_lse=True)
        torch.testing.assert_close(out[cq[i]:cq[i + 1]], out_ref[0])
        torch.testing.assert_close(lse[:, cq[i]:cq[i + 1]], lse_ref[0])
        assert torch.equal(unpaged(k_blocks, table)[i], k_ref[0])
        assert torch.equal(unpaged(v_blocks, table)[i], v_ref[0])



@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_batch_queries_varlen_new_keys(paged, device):
    """Queries as a batch (b, sq, h, d) with varlen new keys (cu_seqlens_k_new) and a rotary
    embedding: out (b, sq, h, d) and lse (b, h, sq), each sequence equal to the library's batch
    KV-cache call with its own new keys; the caches receive the rotated keys."""
    b, sq, hq, hk, d, cap, page = 3, 2, 4, 2, 32, 24, 8
    old, n_new = [5, 0, 9], [2, 3, 1]
    g = torch.Generator().manual_seed(13)
    cache_k = randn((b, cap, hk, d), torch.bfloat16, device, g)
    cache_v = randn((b, cap, hk, d), torch.bfloat16, device, g)
    q = randn((b, sq, hq, d), torch.bfloat16, device, g)
    k_new = randn((sum(n_new), hk, d), torch.bfloat16, device, g)
    v_new = randn((sum(n_new), hk, d), torch.bfloat16, device, g)
    angles = np.outer(np.arange(cap), 10000.0 ** (-np.arange(0, d, 2) / d))
    cos = torch.from_numpy(np.cos(angles)).to(device=device, dtype=torch.bfloat16)
    sin = torch.from_numpy(np.sin(angles)).to(device=device, dtype=torch.bfloat16)
    seqlens = torch.tensor(old, dtype=torch.int32, device=device)
    kwargs = {}
    if paged:
        table = shuffled_table(b, cap // page, device, g)
        k_arg, v_arg = paged_like(cache_k, table, page), paged_like(cache_v, table, page)
        kwargs["page_table"] = table
    else:
        k_arg, v_arg = cache_k.clone(), cache_v.clone()
    out, lse, *_ = fa3.flash_attn_with_kvcache(
        q, k_arg, v_arg, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
        cu_seqlens_k_new=cu(n_new, device), causal=True, return_softmax_lse=True, **kwargs)
    assert out.shape == q.shape and lse.shape == (b, hq, sq)
    k_after = unpaged(k_arg, table) if paged else k_arg
    ck = cu(n_new, "cpu").tolist()
    for i in range(b):
        k_ref, v_ref = cache_k[i:i + 1].clone(), cache_v[i:i + 1].clone()
        out_ref, lse_ref = flashattn.flash_attn_with_kvcache(
            q[i:i + 1], k_ref, v_ref, k_new[ck[i]:ck[i + 1]].unsqueeze(0), v_new[ck[i]:ck[i + 1]].unsqueeze(0), cos,
            sin, cache_seqlens=seqlens[i:i + 1], causal=True, return_softmax_lse=True)
        torch.testing.assert_close(out[i:i + 1], out_ref)
        torch.testing.assert_close(lse[i:i + 1], lse_ref)
        assert torch.equal(k_after[i], k_ref[0])
    with pytest.raises(flashattn.Error, match="q: "):
        fa3.flash_attn_with_kvcache(q[:2], k_arg, v_arg, k_new, v_new, cache_seqlens=seqlens,
                                    cu_seqlens_k_new=cu(n_new, device), **kwargs)


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("layout", ["paged", "batch_idx", "contiguous"])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_kvcache_varlen_queries_without_new_keys(mask, layout, device):
    """The call serving engines make every step (SGLang's extend and decode): varlen queries over
    the cache as it is, with page_table, cache_batch_idx or neither, sinks, and max_seqlen_q left
    out once — each sequence equals the library's batch KV-cache call on its own, and the caches
    are not written."""
    b, hq, hk, d, cap, page = 3, 4, 2, 40, 32, 8
    lengths, n_q = [7, 32, 1], [3, 1, 1]
    g = torch.Generator().manual_seed(11)
    rows = 4  # cache rows: cache_batch_idx picks three of them
    cache_k = randn((rows, cap, hk, d), torch.bfloat16, device, g)
    cache_v = randn((rows, cap, hk, d), torch.bfloat16, device, g)
    q = randn((sum(n_q), hq, d), torch.bfloat16, device, g)
    sinks = torch.randn((hq,), generator=g).to(device)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    idx = torch.tensor([2, 0, 3], dtype=torch.int32, device=device) if layout == "batch_idx" else None
    picked = [int(i) for i in idx.tolist()] if idx is not None else list(range(b))
    kwargs = {}
    if layout == "paged":
        table = shuffled_table(b, cap // page, device, g)
        k_arg = paged_like(cache_k[:b], table, page)
        v_arg = paged_like(cache_v[:b], table, page)
        kwargs["page_table"] = table
    else:
        k_arg, v_arg = cache_k, cache_v
        kwargs["cache_batch_idx"] = idx
    k_before, v_before = k_arg.clone(), v_arg.clone()
    window = (5, 0) if mask == "window" else (-1, -1)
    causal = mask == "causal"
    out, lse, *_ = fa3.flash_attn_with_kvcache(
        q, k_arg, v_arg, cache_seqlens=seqlens, cu_seqlens_q=cu(n_q, device),
        max_seqlen_q=None if layout == "contiguous" else max(n_q), causal=causal, window_size=window,
        softcap=0.0 if mask == "none" else 20.0, learnable_sink=sinks, return_softmax_lse=True, **kwargs)
    assert out.shape == q.shape and lse.shape == (hq, sum(n_q))
    assert torch.equal(k_arg, k_before) and torch.equal(v_arg, v_before)
    cq = cu(n_q, "cpu").tolist()
    for i in range(b):
        out_ref, lse_ref = flashattn.flash_attn_with_kvcache(
            q[cq[i]:cq[i + 1]].unsqueeze(0), cache_k[picked[i]:picked[i] + 1], cache_v[picked[i]:picked[i] + 1],
            cache_seqlens=seqlens[i:i + 1], causal=causal, window_size=window,
            softcap=0.0 if mask == "none" else 20.0, return_softmax_lse=True, sinks=sinks)
        torch.testing.assert_close(out[cq[i]:cq[i + 1]], out_ref[0])
        torch.testing.assert_close(lse[:, cq[i]:cq[i + 1]], lse_ref[0])


def kvcache_inputs(b, cap, hk, d, q_shape, new_shape, device, seed):
    """bf16 caches (b, cap, hk, d), queries of q_shape and new keys/values of new_shape."""
    g = torch.Generator().manual_seed(seed)
    return tuple(randn(shape, torch.bfloat16, device, g) for shape in ((b, cap, hk, d),) * 2 + (q_shape,)
                 + (new_shape,) * 2)


def rotary_tables(n, d, device):
    angles = np.outer(np.arange(n), 10000.0 ** (-np.arange(0, d, 2) / d))
    return tuple(torch.from_numpy(f(angles)).to(device=device, dtype=torch.bfloat16) for f in (np.cos, np.sin))


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_kvcache_leftpad(varlen, device):
    """cache_leftpad over a contiguous cache, with new keys appended (rotated) and a causal mask:
    each sequence equals the library's KV-cache call with the same left padding — in the batch
    path the same call; with varlen queries and new keys (the cache read as pages of one row) the
    same attention; the caches receive the same rows."""
    b, hq, hk, d, cap = 3, 4, 2, 32, 24
    old, leftpad, n_q, n_new = [9, 5, 12], [3, 0, 12], [2, 3, 1], [2, 3, 1]
    if not varlen:
        n_q, n_new = [2] * b, [2] * b
    cache_k, cache_v, q, k_new, v_new = kvcache_inputs(b, cap, hk, d, (sum(n_q), hq, d), (sum(n_new), hk, d), device,
                                                       23)
    cos, sin = rotary_tables(cap, d, device)
    seqlens, pads = (torch.tensor(x, dtype=torch.int32, device=device) for x in (old, leftpad))
    k_arg, v_arg = cache_k.clone(), cache_v.clone()
    if varlen:
        args = (q, k_arg, v_arg, k_new, v_new)
        kwargs = dict(cu_seqlens_q=cu(n_q, device), cu_seqlens_k_new=cu(n_new, device), max_seqlen_q=max(n_q))
    else:
        args = (q.view(b, 2, hq, d), k_arg, v_arg, k_new.view(b, 2, hk, d), v_new.view(b, 2, hk, d))
        kwargs = {}
    out, lse, *_ = fa3.flash_attn_with_kvcache(*args, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
                                               cache_leftpad=pads, causal=True, return_softmax_lse=True, **kwargs)
    if varlen:
        assert out.shape == q.shape and lse.shape == (hq, sum(n_q))
    else:
        k_ref, v_ref = cache_k.clone(), cache_v.clone()
        out_ref, lse_ref = flashattn.flash_attn_with_kvcache(
            args[0], k_ref, v_ref, args[3], args[4], cos, sin, cache_seqlens=seqlens, cache_leftpad=pads, causal=True,
            return_softmax_lse=True)
        torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
        torch.testing.assert_close(lse, lse_ref, rtol=0, atol=0)
        out, lse = out.flatten(0, 1), lse.transpose(0, 1).flatten(1, 2)
    cq, ck = cu(n_q, "cpu").tolist(), cu(n_new, "cpu").tolist()
    for i in range(b):
        k_ref, v_ref = cache_k[i:i + 1].clone(), cache_v[i:i + 1].clone()
        out_ref, lse_ref = flashattn.flash_attn_with_kvcache(
            q[cq[i]:cq[i + 1]].unsqueeze(0), k_ref, v_ref, k_new[ck[i]:ck[i + 1]].unsqueeze(0),
            v_new[ck[i]:ck[i + 1]].unsqueeze(0), cos, sin, cache_seqlens=seqlens[i:i + 1],
            cache_leftpad=pads[i:i + 1], causal=True, return_softmax_lse=True)
        torch.testing.assert_close(out[cq[i]:cq[i + 1]], out_ref[0])
        torch.testing.assert_close(lse[:, cq[i]:cq[i + 1]], lse_ref[0])
        assert torch.equal(k_arg[i], k_ref[0]) and torch.equal(v_arg[i], v_ref[0])
    before = k_arg.clone()
    with pytest.raises(flashattn.Error, match=r"cache_leftpad: entry 1 must lie in \[0, cache_seqlens\[1\]\]"):
        fa3.flash_attn_with_kvcache(*args, cache_seqlens=seqlens, causal=True,
                                    cache_leftpad=torch.tensor([0, 9, 0], dtype=torch.int32, device=device), **kwargs)
        flashattn.check_index_errors()  # CUDA tensors: the device-side check's finding reaches the host here
    assert torch.equal(k_arg, before)


@pytest.mark.parametrize("device", torch_devices())
def test_kvcache_rotary_seqlens(device):
    """rotary_seqlens: the new keys and the queries rotate from rotary_seqlens[i] instead of
    cache_seqlens[i] — the library's call whose tables start rotary_seqlens[i] - cache_seqlens[i]
    rows later — while the keys are written at cache_seqlens[i]; without new keys it is ignored."""
    b, sq, hq, hk, d, cap = 3, 2, 4, 2, 32, 24
    old, first = [5, 0, 9], [7, 3, 9]
    cache_k, cache_v, q, k_new, v_new = kvcache_inputs(b, cap, hk, d, (b, sq, hq, d), (b, sq, hk, d), device, 29)
    cos, sin = rotary_tables(cap + 8, d, device)
    seqlens, rotary_seqlens = (torch.tensor(x, dtype=torch.int32, device=device) for x in (old, first))
    k_arg, v_arg = cache_k.clone(), cache_v.clone()
    out = fa3.flash_attn_with_kvcache(q, k_arg, v_arg, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                      cache_seqlens=seqlens, rotary_seqlens=rotary_seqlens, causal=True,
                                      rotary_interleaved=False)
    for i in range(b):
        shift = first[i] - old[i]
        k_ref, v_ref = cache_k[i:i + 1].clone(), cache_v[i:i + 1].clone()
        out_ref = flashattn.flash_attn_with_kvcache(
            q[i:i + 1], k_ref, v_ref, k_new[i:i + 1], v_new[i:i + 1], cos[shift:], sin[shift:],
            cache_seqlens=seqlens[i:i + 1], causal=True, rotary_interleaved=False)
        torch.testing.assert_close(out[i:i + 1], out_ref)
        assert torch.equal(k_arg[i], k_ref[0]) and torch.equal(v_arg[i], v_ref[0])
    plain = fa3.flash_attn_with_kvcache(q, cache_k, cache_v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
                                        causal=True)
    ignored = fa3.flash_attn_with_kvcache(q, cache_k, cache_v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
                                          rotary_seqlens=rotary_seqlens, causal=True)
    torch.testing.assert_close(ignored, plain, rtol=0, atol=0)


@pytest.mark.parametrize("device", torch_devices())
def test_kvcache_batch(device):
    """Without varlen arguments: the library's KV-cache function under FA3's names (page_table)."""
    g = torch.Generator().manual_seed(6)
    page = 8
    q = randn((2, 1, 4, 32), torch.bfloat16, device, g)
    k_cache = randn((2, 2 * page, 2, 32), torch.bfloat16, device, g)
    v_cache = randn((2, 2 * page, 2, 32), torch.bfloat16, device, g)
    table = torch.tensor([[1, 0], [3, 2]], dtype=torch.int32, device=device)
    k_blocks, v_blocks = paged_like(k_cache, table, page), paged_like(v_cache, table, page)
    lengths = torch.tensor([2 * page, 9], dtype=torch.int32, device=device)
    out = fa3.flash_attn_with_kvcache(q, k_blocks, v_blocks, cache_seqlens=lengths, page_table=table,
                                      num_splits=3, pack_gqa=True)
    ref = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
    torch.testing.assert_close(out, ref)


def test_kvcache_varlen_queries_past_the_capacity():
    """cache_seqlens past the cache's capacity, with varlen queries: an error naming it."""
    q = torch.zeros((2, 2, 32), dtype=torch.bfloat16)
    k_cache = torch.zeros((1, 16, 2, 32), dtype=torch.bfloat16)
    with pytest.raises(flashattn.Error, match="cache_seqlens"):
        fa3.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=17, cu_seqlens_q=cu([2], "cpu"),
                                    max_seqlen_q=2)


def test_kvcache_checks_before_writing():
    """A rotary table too short for the queries (long enough for the new key) is an error that
    leaves the cache as it was."""
    g = torch.Generator().manual_seed(7)
    q = randn((3, 2, 32), torch.bfloat16, "cpu", g)
    k_new, v_new = randn((1, 2, 32), torch.bfloat16, "cpu", g), randn((1, 2, 32), torch.bfloat16, "cpu", g)
    k_cache, v_cache = randn((1, 16, 2, 32), torch.bfloat16, "cpu", g), randn((1, 16, 2, 32), torch.bfloat16, "cpu", g)
    before = k_cache.clone()
    cos = sin = torch.ones((7, 16), dtype=torch.bfloat16)
    with pytest.raises(flashattn.Error, match="rotary_cos"):
        fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                    cache_seqlens=5, cu_seqlens_q=cu([3], "cpu"), cu_seqlens_k_new=cu([1], "cpu"),
                                    max_seqlen_q=3, causal=True)
    assert torch.equal(k_cache, before)


def test_refusals():
    q = torch.zeros((1, 4, 2, 16), dtype=torch.bfloat16)
    # (Descale factors are FP8 arguments, tested in test_fp8.py.)
    cases = {
        "qv": lambda: fa3.flash_attn_func(q, q, q, qv=q),
        "attention_chunk": lambda: fa3.flash_attn_func(q, q, q, attention_chunk=2),
        "cache_leftpad": lambda: fa3.flash_attn_with_kvcache(q.to(torch.float8_e4m3fn), q.to(torch.float8_e4m3fn),
                                                             q.to(torch.float8_e4m3fn), cache_seqlens=4,
                                                             cache_leftpad=cu([1], "cpu")[1:]),
    }
    for name, call in cases.items():
        with pytest.raises(NotImplementedError, match=name):
            call()
    # A paged cache with left padding is an error of the call, as in FlashAttention-3.
    with pytest.raises(flashattn.Error, match=r"cache_leftpad: cannot be combined with a paged cache \(page_table\)"):
        fa3.flash_attn_with_kvcache(q, q, q, cache_seqlens=4, cache_leftpad=cu([1], "cpu")[1:],
                                    page_table=torch.zeros((1, 1), dtype=torch.int32))
