"""Varlen and KV-cache functions on PyTorch tensors against the float64 oracle (SPEC §7)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")

import flashattn  # noqa: E402
from flashattn._torch_ops import draw_rng_state  # noqa: E402

from conftest import torch_devices  # noqa: E402
from reference import attend, check_spec, rotate  # noqa: E402
from torch_checks import check_varlen, randn, to_np  # noqa: E402
from torch_reference import dtype_name  # noqa: E402


def cu(lengths, device):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)


# Sequence lengths (q, k), zero-length segments included.
VARLEN_CASES = {
    "mixed": ([5, 0, 17, 33], [9, 4, 0, 40]),
    "single": ([64], [80]),
    "decode_like": ([1, 1, 1], [30, 7, 1]),
}


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen(case, causal, dtype, device):
    lq, lk = VARLEN_CASES[case]
    h, hk, d = 4, 2, 40  # d = 40: a head dim that the kernels take as it is
    g = torch.Generator().manual_seed(21)
    q = randn((sum(lq), h, d), dtype, device, g)
    k = randn((sum(lk), hk, d), dtype, device, g)
    v = randn((sum(lk), hk, d), dtype, device, g)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse, _ = flashattn.flash_attn_varlen_func(qg, kg, vg, cu(lq, device), cu(lk, device), max(lq), max(lk),
                                                   causal=causal, return_attn_probs=True)
    assert lse.shape == (h, sum(lq))
    dout = torch.randn_like(out)
    out.backward(dout)
    cq, ck = cu(lq, "cpu").tolist(), cu(lk, "cpu").tolist()
    check_varlen(q, k, v, cq, ck, out, lse, max_seqlen_k=max(lk), grads=(qg.grad, kg.grad, vg.grad),
                 dout=dout, causal=causal)


@pytest.mark.parametrize("device", torch_devices())
def test_varlen_features(device):
    """Window, softcap, ALiBi (b, h), dropout and a padded head dim in one varlen call."""
    lq, lk = [7, 21, 0], [12, 25, 3]
    h, hk, d = 2, 1, 30
    g = torch.Generator().manual_seed(22)
    q = randn((sum(lq), h, d), torch.bfloat16, device, g) * 2
    k = randn((sum(lk), hk, d), torch.bfloat16, device, g)
    v = randn((sum(lk), hk, d), torch.bfloat16, device, g)
    alibi = torch.rand((3, h), generator=g).to(device)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    kw = dict(window=(6, 2), softcap=3.0, alibi=alibi, dropout_p=0.25)
    torch.manual_seed(99)
    rng_state = draw_rng_state(torch.device(device))
    torch.manual_seed(99)
    out, lse, _ = flashattn.flash_attn_varlen_func(
        qg, kg, vg, cu(lq, device), cu(lk, device), max(lq), max(lk), 0.25, None, False, (6, 2), 3.0, alibi,
        False, True)
    dout = torch.randn_like(out)
    out.backward(dout)
    check_varlen(q, k, v, cu(lq, "cpu").tolist(), cu(lk, "cpu").tolist(), out, lse, max_seqlen_k=max(lk),
                 grads=(qg.grad, kg.grad, vg.grad), dout=dout, rng_state=rng_state, **kw)


@pytest.mark.parametrize("device", torch_devices())
def test_varlen_packed(device):
    lens = [11, 0, 26]
    h, d = 3, 32
    g = torch.Generator().manual_seed(23)
    qkv = randn((sum(lens), 3, h, d), torch.float16, device, g)
    cs = cu(lens, device)
    packed = qkv.clone().requires_grad_()
    out = flashattn.flash_attn_varlen_qkvpacked_func(packed, cs, max(lens), causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    q, k, v = qkv.unbind(1)
    check_varlen(q, k, v, cs.tolist(), cs.tolist(), out, None, max_seqlen_k=max(lens),
                 grads=packed.grad.unbind(1), dout=dout, causal=True)

    q = randn((sum(lens), 6, d), torch.float16, device, g)
    kv = randn((sum(lens), 2, h, d), torch.float16, device, g)
    out = flashattn.flash_attn_varlen_kvpacked_func(q, kv, cs, cs, max(lens), max(lens))
    k, v = kv.unbind(1)
    check_varlen(q, k, v, cs.tolist(), cs.tolist(), out, None, max_seqlen_k=max(lens))


# --- KV cache --------------------------------------------------------------------------------------


def gather_rows(cache, b, length, batch_idx, block_table):
    """The first `length` key rows of sequence b: (length, hk, d)."""
    if block_table is None:
        row = b if batch_idx is None else int(batch_idx[b])
        return cache[row, :length]
    page = cache.shape[1]
    rows = [cache[int(block_table[b, j // page]), j % page] for j in range(length)]
    return np.stack(rows) if rows else cache[0, :0]


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("layout", ["dense", "batch_idx", "paged"])
@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache(layout, rotary, causal, device):
    dtype = torch.float16
    b, sq, h, hk, d, sk_new = 3, 4, 4, 2, 64, 3
    g = torch.Generator().manual_seed(31)
    page, blocks_per_seq = 16, 4
    capacity = page * blocks_per_seq
    if layout == "paged":
        num_blocks = b * blocks_per_seq + 2
        k_cache = randn((num_blocks, page, hk, d), dtype, device, g)
        perm = torch.randperm(num_blocks, generator=g)[: b * blocks_per_seq]
        block_table = perm.reshape(b, blocks_per_seq).to(torch.int32).to(device)
        batch_idx = None
    else:
        rows = b + 2 if layout == "batch_idx" else b
        k_cache = randn((rows, capacity, hk, d), dtype, device, g)
        block_table = None
        batch_idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=device) if layout == "batch_idx" else None
    v_cache = randn(k_cache.shape, dtype, device, g)
    q = randn((b, sq, h, d), dtype, device, g)
    k_new = randn((b, sk_new, hk, d), dtype, device, g)
    v_new = randn((b, sk_new, hk, d), dtype, device, g)
    seqlens = torch.tensor([5, 0, 40], dtype=torch.int32, device=device)
    cos = sin = None
    if rotary:
        rd = 32
        angles = torch.rand((capacity + sq, rd // 2), generator=g) * 6.28
        cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    k_before, v_before = to_np(k_cache).copy(), to_np(v_cache).copy()

    out, lse = flashattn.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cos, sin, seqlens, batch_idx, None, block_table,
        causal=causal, rotary_interleaved=(rotary == "interleaved"), return_softmax_lse=True)

    # Expected cache contents: the appended rows (rotated keys) at seqlens[b] ..., the rest unchanged.
    qn, kn_new, vn_new = to_np(q), to_np(k_new), to_np(v_new)
    kc, vc = to_np(k_cache), to_np(v_cache)
    sl = seqlens.cpu().numpy()
    bt = None if block_table is None else block_table.cpu().numpy()
    bi = None if batch_idx is None else batch_idx.cpu().numpy()
    cn = None if cos is None else to_np(cos)
    sn = None if sin is None else to_np(sin)
    name = dtype_name(dtype)
    ref_out, ref_lse, naive_out, naive_lse = [], [], [], []
    for i in range(b):
        positions = np.arange(sl[i], sl[i] + sk_new)
        k_rows = kn_new[i]
        q_rows = qn[i]
        if rotary:
            k_rows = rotate(k_rows, cn[positions], sn[positions], rotary == "interleaved")
            q_pos = sl[i] + (np.arange(sq) if causal else np.zeros(sq, dtype=int))
            q_rows = rotate(q_rows, cn[q_pos], sn[q_pos], rotary == "interleaved")
            # The library stores rotated values in the input dtype.
            k_rows = k_rows.astype(np.float16).astype(np.float32)
            q_rows = q_rows.astype(np.float16).astype(np.float32)
        keys = gather_rows(kc, i, sl[i] + sk_new, bi, bt)
        vals = gather_rows(vc, i, sl[i] + sk_new, bi, bt)
        np.testing.assert_allclose(keys[sl[i]:], k_rows, rtol=2e-3, atol=2e-3)
        np.testing.assert_array_equal(vals[sl[i]:], vn_new[i])
        before_k = gather_rows(k_before, i, sl[i], bi, bt)
        np.testing.assert_array_equal(keys[:sl[i]], before_k)
        kw = dict(scale=d ** -0.5, causal=causal, max_seqlen_k=capacity)
        o, l_ = attend(q_rows, keys, vals, **kw)
        no, nl = attend(q_rows, keys, vals, lowprec=name, **kw)
        ref_out.append(o), ref_lse.append(l_), naive_out.append(no), naive_lse.append(nl)
    red = capacity
    check_spec("out", to_np(out), np.stack(ref_out), np.stack(naive_out), name, reduction=red)
    check_spec("lse", to_np(lse), np.stack(ref_lse), np.stack(naive_lse), "float32", reduction=red)


@pytest.mark.parametrize("device", torch_devices())
def test_kvcache_without_append(device):
    """cache_seqlens as an int, as a tensor, and absent (the whole cache); window and softcap."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(32)
    b, sq, h, hk, d, cap = 2, 3, 2, 1, 32, 20
    q = randn((b, sq, h, d), dtype, device, g)
    k_cache = randn((b, cap, hk, d), dtype, device, g)
    v_cache = randn((b, cap, hk, d), dtype, device, g)
    name = dtype_name(dtype)
    for seqlens in (11, torch.tensor([11, 11], dtype=torch.int32, device=device), None):
        out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, window_size=(4, 0),
                                                softcap=5.0)
        length = cap if seqlens is None else 11
        refs, naives = [], []
        for i in range(b):
            kw = dict(scale=d ** -0.5, window=(4, 0), softcap=5.0, max_seqlen_k=cap)
            args = (to_np(q)[i], to_np(k_cache)[i, :length], to_np(v_cache)[i, :length])
            refs.append(attend(*args, **kw)[0])
            naives.append(attend(*args, lowprec=name, **kw)[0])
        check_spec("out", to_np(out), np.stack(refs), np.stack(naives), name, factor=3.0, reduction=cap)


def test_kvcache_leftpad_needs_cache_seqlens():
    """cache_leftpad works (tests/python/test_paged_prefill.py); without cache_seqlens it is refused."""
    q = torch.randn(1, 1, 1, 8, dtype=torch.float16)
    cache = torch.randn(1, 4, 1, 8, dtype=torch.float16)
    with pytest.raises(flashattn.Error, match="cache_seqlens: is required with cache_leftpad"):
        flashattn.flash_attn_with_kvcache(q, cache, cache, cache_leftpad=torch.zeros(1, dtype=torch.int32))


@pytest.mark.parametrize("device", torch_devices())
def test_kvcache_num_splits(device):
    """num_splits (split-KV on CUDA; the CPU ignores it): every count gives the reference's result,
    a long context decoded in 1, 3 and 16 splits; a negative count is refused."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(33)
    b, h, hk, d, cap = 2, 8, 2, 64, 1500
    q = randn((b, 1, h, d), dtype, device, g)
    k_cache = randn((b, cap, hk, d), dtype, device, g)
    v_cache = randn((b, cap, hk, d), dtype, device, g)
    name = dtype_name(dtype)
    kw = dict(scale=d ** -0.5, max_seqlen_k=cap)
    refs, naives = [], []
    for i in range(b):
        args = (to_np(q)[i], to_np(k_cache)[i], to_np(v_cache)[i])
        refs.append(attend(*args, **kw)[0])
        naives.append(attend(*args, lowprec=name, **kw)[0])
    for splits in (0, 1, 3, 16):
        out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=splits)
        check_spec(f"out (num_splits={splits})", to_np(out), np.stack(refs), np.stack(naives), name, factor=3.0,
                   reduction=cap)
    with pytest.raises(ValueError, match="num_splits"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=-1)
