"""Paged prefill (flash_attn_varlen_func with block_table, as vLLM calls it), out= on every
function, return_softmax_lse on the varlen function, cache_leftpad and head-dim padding of the
KV-cache function — against the float64 oracle of the same keys gathered back in order (SPEC §7).

Every test runs on the CPU and on CUDA; without a GPU (or without the CUDA backend) the CUDA
variant reports as skipped with the reason ("not run: ...")."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")

import flashattn  # noqa: E402
import flashattn.flash_attn_interface as fai  # noqa: E402

from torch_checks import check_varlen, randn  # noqa: E402


def _cuda_reason():
    if not torch.cuda.is_available():
        return "not run: no GPU (the CUDA variant of this test needs one)"
    if "cuda" not in flashattn.compiled_backends():
        return "not run: a GPU is visible but this build has no CUDA backend (-DFLASHATTN_CUDA=ON)"
    return None


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(_cuda_reason() is not None,
                                                              reason=str(_cuda_reason())))]


def cu(lengths, device):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)


def scatter_pages(k, v, lengths, cu_k, page_size, generator, extra_pages=1):
    """The keys [0, lengths[i]) of each packed sequence, copied into shuffled pages of a NaN-filled
    cache (num_blocks, page_size, hk, d); unused block_table entries point past the cache (never
    read). -> k_cache, v_cache, block_table (on k's device)."""
    blocks = [-(-n // page_size) for n in lengths]
    num_blocks = sum(blocks) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    table = torch.full((len(lengths), max(blocks) + extra_pages), num_blocks + 5, dtype=torch.int32)
    shape = (num_blocks, page_size) + tuple(k.shape[1:])
    k_cache = torch.full(shape, float("nan"), dtype=k.dtype)
    v_cache = torch.full(shape[:-1] + (v.shape[-1],), float("nan"), dtype=v.dtype)
    nxt = 0
    for i, n in enumerate(lengths):
        for blk in range(blocks[i]):
            page = order[nxt]
            nxt += 1
            table[i, blk] = page
            rows = slice(blk * page_size, min(n, (blk + 1) * page_size))
            count = rows.stop - rows.start
            k_cache[page, :count] = k[cu_k[i] + rows.start:cu_k[i] + rows.stop].cpu()
            v_cache[page, :count] = v[cu_k[i] + rows.start:cu_k[i] + rows.stop].cpu()
    return k_cache.to(k.device), v_cache.to(v.device), table.to(k.device)


def paged_problem(device, dtype, lq, lk, h, hk, d, page_size, seed, dv=None):
    g = torch.Generator().manual_seed(seed)
    q = randn((sum(lq), h, d), dtype, device, g)
    k = randn((sum(lk), hk, d), dtype, device, g)
    v = randn((sum(lk), hk, dv or d), dtype, device, g)
    ck = cu(lk, "cpu").tolist()
    k_cache, v_cache, table = scatter_pages(k, v, lk, ck, page_size, g)
    return q, k, v, k_cache, v_cache, table


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("lengths", ["seqused_k", "cu_seqlens_k"])
@pytest.mark.parametrize("mask", ["causal", "window", "none"])
def test_paged_prefill(mask, lengths, page_size, dtype, device):
    lq, lk = [1, 17, 0, 40, 5], [33, 17, 9, 300, 0]  # a decoding row, an empty query, no keys
    h, hk, d = 8, 2, 64
    q, k, v, k_cache, v_cache, table = paged_problem(device, dtype, lq, lk, h, hk, d, page_size, 41)
    causal, window = mask == "causal", (7, 3) if mask == "window" else (-1, -1)
    kwargs = dict(seqused_k=cu(lk, device).diff().to(torch.int32)) if lengths == "seqused_k" else {}
    cu_k = cu(lk, device) if lengths == "cu_seqlens_k" else None
    out, lse = flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu(lq, device), cu_k, max(lq), max(lk),
                                                causal=causal, window_size=window, block_table=table,
                                                return_softmax_lse=True, **kwargs)
    assert out.shape == (sum(lq), h, d) and lse.shape == (h, sum(lq))
    check_varlen(q, k, v, cu(lq, "cpu").tolist(), cu(lk, "cpu").tolist(), out, lse, max_seqlen_k=max(lk),
                 causal=causal, window=window)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_prefill_page_size_one_and_seqused_below_cu(device):
    """Pages of one row (SGLang's caches; the CUDA kernels then read the block table row by row),
    GQA 8:1, and seqused_k below the cu_seqlens_k lengths with both given: only the used keys are
    read."""
    lq, lk, used = [3, 9], [20, 12], [11, 12]
    h, hk, d = 8, 1, 32
    g = torch.Generator().manual_seed(42)
    q = randn((sum(lq), h, d), torch.bfloat16, device, g)
    k = randn((sum(lk), hk, d), torch.bfloat16, device, g)
    v = randn((sum(lk), hk, d), torch.bfloat16, device, g)
    ck = cu(lk, "cpu").tolist()
    k_cache, v_cache, table = scatter_pages(k, v, used, ck, 1, g)
    out = flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu(lq, device), cu(lk, device), max(lq), max(lk),
                                           causal=True, block_table=table,
                                           seqused_k=torch.tensor(used, dtype=torch.int32, device=device))
    keep = torch.cat([torch.arange(ck[i], ck[i] + used[i]) for i in range(len(lk))]).to(device)
    check_varlen(q, k[keep], v[keep], cu(lq, "cpu").tolist(), cu(used, "cpu").tolist(), out, None,
                 max_seqlen_k=max(lk), causal=True)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_prefill_vllm_call(device):
    """The call vLLM's FlashAttention backend makes, all by keyword: out= written in place,
    cu_seqlens_k left out, seqused_k the key counts; head dim 40 and a padded head dim 36."""
    lq, lk = [4, 1, 13], [20, 50, 13]
    for d in (40, 36):
        q, k, v, k_cache, v_cache, table = paged_problem(device, torch.bfloat16, lq, lk, 4, 4, d, 16, 43)
        out = torch.full_like(q, float("nan"))
        result = flashattn.flash_attn_varlen_func(
            q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu(lq, device), max_seqlen_q=max(lq),
            seqused_k=torch.tensor(lk, dtype=torch.int32, device=device), max_seqlen_k=max(lk),
            softmax_scale=d ** -0.5, causal=True, alibi_slopes=None, window_size=(-1, -1),
            block_table=table, softcap=0.0)
        assert result is out
        check_varlen(q, k, v, cu(lq, "cpu").tolist(), cu(lk, "cpu").tolist(), out, None, max_seqlen_k=max(lk),
                     causal=True)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_prefill_refusals(device):
    lq, lk = [3, 5], [20, 9]
    q, k, v, k_cache, v_cache, table = paged_problem(device, torch.float16, lq, lk, 2, 2, 32, 16, 44)
    used = torch.tensor(lk, dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    bad = table.clone()
    bad[0, 1] = k_cache.shape[0]  # sequence 0 (20 keys) uses entries 0 and 1
    with pytest.raises(flashattn.Error, match=r"block_table: entry \(0, 1\) is not a page of the cache"):
        flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu(lq, device), None, max(lq), max(lk),
                                         block_table=bad, seqused_k=used, out=out)
        flashattn.check_index_errors()  # CUDA: a violation found on the device
    assert torch.isnan(out).all(), "out was written"
    with pytest.raises(flashattn.Error, match="seqused_k or cu_seqlens_k"):
        flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu(lq, device), None, max(lq), max(lk),
                                         block_table=table)
    with pytest.raises(ValueError, match="k: must be .num_blocks, page_size"):
        flashattn.flash_attn_varlen_func(q, k, v, cu(lq, device), None, max(lq), max(lk), block_table=table,
                                         seqused_k=used)
    with pytest.raises(flashattn.Error, match="block_table: a paged K/V has no backward"):
        flashattn.flash_attn_varlen_func(q.clone().requires_grad_(), k_cache, v_cache, cu(lq, device), None,
                                         max(lq), max(lk), block_table=table, seqused_k=used)
    with torch.no_grad():  # the same call without autograd runs
        flashattn.flash_attn_varlen_func(q.clone().requires_grad_(), k_cache, v_cache, cu(lq, device), None,
                                         max(lq), max(lk), block_table=table, seqused_k=used)


def test_paged_prefill_numpy():
    lq, lk = [2, 6], [18, 7]
    q, k, v, k_cache, v_cache, table = paged_problem("cpu", torch.float32, lq, lk, 2, 1, 16, 16, 45)
    used = np.array(lk, dtype=np.int32)
    out = np.full(q.shape, np.nan, dtype=np.float32)
    result, lse = flashattn.flash_attn_varlen_func(
        q.numpy(), k_cache.numpy(), v_cache.numpy(), cu(lq, "cpu").numpy(), None, max(lq), max(lk), causal=True,
        block_table=table.numpy(), seqused_k=used, return_softmax_lse=True, out=out)
    assert result is out and lse.shape == (2, sum(lq))
    check_varlen(q, k, v, cu(lq, "cpu").tolist(), cu(lk, "cpu").tolist(), torch.from_numpy(out),
                 torch.from_numpy(lse), max_seqlen_k=max(lk), causal=True)


# --- return_softmax_lse and out= -------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_return_softmax_lse(device):
    lq, lk = [5, 11], [9, 30]
    g = torch.Generator().manual_seed(46)
    q = randn((sum(lq), 2, 32), torch.float16, device, g)
    k = randn((sum(lk), 2, 32), torch.float16, device, g)
    args = (q, k, k, cu(lq, device), cu(lk, device), max(lq), max(lk))
    out, lse = flashattn.flash_attn_varlen_func(*args, causal=True, return_softmax_lse=True)
    out3, lse3, none = flashattn.flash_attn_varlen_func(*args, causal=True, return_attn_probs=True)
    assert none is None and torch.equal(out, out3) and torch.equal(lse, lse3)
    assert torch.is_tensor(flashattn.flash_attn_varlen_func(*args, causal=True))
    out_fa, lse_fa = fai.flash_attn_varlen_func(*args, causal=True, return_softmax_lse=True)
    assert torch.equal(out_fa, out) and torch.equal(lse_fa, lse)
    check_varlen(q, k, k, cu(lq, "cpu").tolist(), cu(lk, "cpu").tolist(), out, lse, max_seqlen_k=max(lk),
                 causal=True)


def _calls(device, d):
    """(name, call(out=...) -> result, the result's shape) for every function, on one problem."""
    g = torch.Generator().manual_seed(47)
    b, s, h = 2, 12, 2
    q = randn((b, s, h, d), torch.bfloat16, device, g)
    kv = randn((b, s, 2, h, d), torch.bfloat16, device, g)
    qkv = randn((b, s, 3, h, d), torch.bfloat16, device, g)
    lens = [5, 19]
    cs = cu(lens, device)
    qv = randn((sum(lens), h, d), torch.bfloat16, device, g)
    kvv = randn((sum(lens), 2, h, d), torch.bfloat16, device, g)
    qkvv = randn((sum(lens), 3, h, d), torch.bfloat16, device, g)
    k_cache = randn((b, 20, h, d), torch.bfloat16, device, g)
    v_cache = randn((b, 20, h, d), torch.bfloat16, device, g)
    seqlens = torch.tensor([7, 20], dtype=torch.int32, device=device)
    return [
        ("flash_attn_func", lambda **o: flashattn.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=True, **o),
         q.shape),
        ("flash_attn_qkvpacked_func", lambda **o: flashattn.flash_attn_qkvpacked_func(qkv, causal=True, **o),
         q.shape),
        ("flash_attn_kvpacked_func", lambda **o: flashattn.flash_attn_kvpacked_func(q, kv, **o), q.shape),
        ("flash_attn_varlen_func", lambda **o: flashattn.flash_attn_varlen_func(
            qv, kvv[:, 0], kvv[:, 1], cs, cs, max(lens), max(lens), causal=True, **o), qv.shape),
        ("flash_attn_varlen_qkvpacked_func", lambda **o: flashattn.flash_attn_varlen_qkvpacked_func(
            qkvv, cs, max(lens), **o), qv.shape),
        ("flash_attn_varlen_kvpacked_func", lambda **o: flashattn.flash_attn_varlen_kvpacked_func(
            qv, kvv, cs, cs, max(lens), max(lens), **o), qv.shape),
        ("flash_attn_with_kvcache", lambda **o: flashattn.flash_attn_with_kvcache(
            q[:, :3], k_cache, v_cache, cache_seqlens=seqlens, causal=True, **o), q[:, :3].shape),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [32, 20])  # 20: the head dim is padded for the kernels
def test_out_written_in_place(d, device):
    for name, call, shape in _calls(device, d):
        expected = call()
        out = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)
        result = call(out=out)
        assert result is out, name
        assert torch.equal(out, expected), name
        # A strided out (every other entry of the first axis of a wider buffer).
        wide = torch.full((2 * shape[0],) + tuple(shape[1:]), float("nan"), dtype=torch.bfloat16, device=device)
        assert call(out=wide[::2]) is not None
        assert torch.equal(wide[::2], expected), name
        assert torch.isnan(wide[1::2]).all(), f"{name}: rows outside the view were written"


@pytest.mark.parametrize("device", DEVICES)
def test_out_refused_writes_nothing(device):
    for name, call, shape in _calls(device, 32):
        for bad, match in ((torch.full(shape[:-1] + (shape[-1] + 8,), float("nan"), dtype=torch.bfloat16,
                                       device=device), "out: wrong shape"),
                           (torch.full(shape, float("nan"), dtype=torch.float16, device=device),
                            "out: must have q's dtype")):
            with pytest.raises(flashattn.Error, match=match):
                call(out=bad)
            assert torch.isnan(bad).all(), f"{name}: a refused out was written"
        with pytest.raises(TypeError, match="out: expected a torch.Tensor"):
            call(out=np.zeros(shape, dtype=np.float32))


def test_out_refused_under_autograd():
    g = torch.Generator().manual_seed(48)
    q = randn((1, 8, 2, 32), torch.float32, "cpu", g).requires_grad_()
    out = torch.full((1, 8, 2, 32), float("nan"))
    with pytest.raises(flashattn.Error, match="out: not supported when autograd records the call"):
        flashattn.flash_attn_func(q, q, q, out=out)
    assert torch.isnan(out).all()
    with torch.no_grad():
        assert flashattn.flash_attn_func(q, q, q, out=out) is out
    assert torch.isfinite(out).all()


def test_out_numpy():
    rng = np.random.default_rng(49)
    q = rng.standard_normal((2, 6, 2, 16)).astype(np.float32)
    expected = flashattn.flash_attn_func(q, q, q, causal=True)
    out = np.full_like(q, np.nan)
    assert flashattn.flash_attn_func(q, q, q, causal=True, out=out) is out
    np.testing.assert_array_equal(out, expected)
    bad = np.full((2, 6, 2, 8), np.nan, dtype=np.float32)
    with pytest.raises(flashattn.Error, match="out: wrong shape"):
        flashattn.flash_attn_func(q, q, q, out=bad)
    assert np.isnan(bad).all()
    cache = rng.standard_normal((2, 10, 2, 16)).astype(np.float32)
    out = np.full((2, 1, 2, 16), np.nan, dtype=np.float32)
    res = flashattn.flash_attn_with_kvcache(q[:, :1], cache, cache, cache_seqlens=4, out=out)
    assert res is out and np.isfinite(out).all()


def test_kvcache_padded_head_dim_numpy():
    """NumPy: head dim 12 (padded for the core); the appended row reaches the caller's cache and
    the result matches PyTorch's."""
    rng = np.random.default_rng(52)
    q = rng.standard_normal((2, 1, 2, 12)).astype(np.float32)
    k_cache = rng.standard_normal((2, 8, 2, 12)).astype(np.float32)
    v_cache = rng.standard_normal((2, 8, 2, 12)).astype(np.float32)
    k_new = rng.standard_normal((2, 1, 2, 12)).astype(np.float32)
    kc_torch, vc_torch = torch.from_numpy(k_cache.copy()), torch.from_numpy(v_cache.copy())
    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=3, causal=True)
    np.testing.assert_array_equal(k_cache[:, 3:4], k_new)
    np.testing.assert_array_equal(v_cache[:, 3:4], k_new)
    expected = flashattn.flash_attn_with_kvcache(torch.from_numpy(q), kc_torch, vc_torch, torch.from_numpy(k_new),
                                                 torch.from_numpy(k_new), cache_seqlens=3, causal=True)
    np.testing.assert_array_equal(out, expected.numpy())


# --- the KV-cache function: cache_leftpad, head-dim padding ---------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_leftpad(causal, device):
    """Sequence i attends to cache rows [leftpad[i], seqlens[i] + seqlen_new): the oracle is the
    varlen problem of exactly those rows; the padding rows hold NaN."""
    b, sq, h, hk, d, capacity, new = 3, 2, 4, 2, 64, 40, 3
    seqlens, leftpad = [20, 5, 33], [4, 0, 33]
    g = torch.Generator().manual_seed(50)
    q = randn((b, sq, h, d), torch.float16, device, g)
    k_cache = randn((b, capacity, hk, d), torch.float16, device, g)
    v_cache = randn((b, capacity, hk, d), torch.float16, device, g)
    for i in range(b):
        k_cache[i, :leftpad[i]] = float("nan")
        v_cache[i, :leftpad[i]] = float("nan")
    k_new = randn((b, new, hk, d), torch.float16, device, g)
    v_new = randn((b, new, hk, d), torch.float16, device, g)
    out, lse = flashattn.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device),
        cache_leftpad=torch.tensor(leftpad, dtype=torch.int32, device=device), causal=causal,
        return_softmax_lse=True)
    keys = [seqlens[i] + new - leftpad[i] for i in range(b)]
    k_packed = torch.cat([k_cache[i, leftpad[i]:seqlens[i] + new] for i in range(b)])
    v_packed = torch.cat([v_cache[i, leftpad[i]:seqlens[i] + new] for i in range(b)])
    assert torch.equal(k_cache[:, 20:23][0], k_new[0])  # appended at the absolute rows
    lse_varlen = lse.permute(1, 0, 2).reshape(h, b * sq)
    check_varlen(q.reshape(b * sq, h, d), k_packed, v_packed, cu([sq] * b, "cpu").tolist(), cu(keys, "cpu").tolist(),
                 out.reshape(b * sq, h, d), lse_varlen, max_seqlen_k=max(keys), causal=causal)
    with pytest.raises(flashattn.Error, match=r"cache_leftpad: entry 1 must lie in \[0, cache_seqlens\[1\]\]"):
        flashattn.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device),
            cache_leftpad=torch.tensor([0, 9, 0], dtype=torch.int32, device=device))
        flashattn.check_index_errors()


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_padded_head_dim_appends(device):
    """Head dims 36 / 20 (not multiples of 8): the caches are padded copies for the kernels, and
    the appended rows reach the caller's caches."""
    b, sq, h, d, dv, capacity, new = 2, 3, 2, 36, 20, 16, 3
    seqlens = [5, 9]
    g = torch.Generator().manual_seed(51)
    q = randn((b, sq, h, d), torch.bfloat16, device, g)
    k_cache = randn((b, capacity, h, d), torch.bfloat16, device, g)
    v_cache = randn((b, capacity, h, dv), torch.bfloat16, device, g)
    k_new = randn((b, new, h, d), torch.bfloat16, device, g)
    v_new = randn((b, new, h, dv), torch.bfloat16, device, g)
    before = k_cache.clone()
    out = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                            cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device),
                                            causal=True)
    assert out.shape == (b, sq, h, dv)
    for i in range(b):
        assert torch.equal(k_cache[i, seqlens[i]:seqlens[i] + new], k_new[i])
        assert torch.equal(v_cache[i, seqlens[i]:seqlens[i] + new], v_new[i])
        assert torch.equal(k_cache[i, :seqlens[i]], before[i, :seqlens[i]])
    keys = [n + new for n in seqlens]
    k_packed = torch.cat([k_cache[i, :keys[i]] for i in range(b)])
    v_packed = torch.cat([v_cache[i, :keys[i]] for i in range(b)])
    check_varlen(q.reshape(b * sq, h, d), k_packed, v_packed, cu([sq] * b, "cpu").tolist(), cu(keys, "cpu").tolist(),
                 out.reshape(b * sq, h, dv), None, max_seqlen_k=capacity, causal=True)


# --- the ops: opcheck of the new arguments, torch.compile of a paged call with out= --------------


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_paged_and_leftpad(device):
    lq, lk = [3, 6], [20, 9]
    q, k, v, k_cache, v_cache, table = paged_problem(device, torch.bfloat16, lq, lk, 4, 2, 32, 16, 53)
    used = torch.tensor(lk, dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.flashattn.varlen_fwd.default,
                          (q, k_cache, v_cache, cu(lq, device), None, used, max(lq), max(lk), 0.0, 0.2, True, -1, -1,
                           0.0, None, None, table))
    g = torch.Generator().manual_seed(54)
    make = lambda *s: randn(s, torch.float16, device, g)  # noqa: E731
    q, kc, vc, kn, vn = make(2, 3, 4, 32), make(2, 16, 2, 32), make(2, 16, 2, 32), make(2, 2, 2, 32), make(2, 2, 2, 32)
    seqlens = torch.tensor([3, 7], dtype=torch.int32, device=device)
    leftpad = torch.tensor([1, 7], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.flashattn.fwd_kvcache.default,
                          (q, kc, vc, kn, vn, seqlens, None, None, None, None, None, 0.17, True, -1, -1, 0.0, True, 0,
                           leftpad))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_paged_prefill_with_out(device):
    """The vLLM-style call traced whole by torch.compile (fullgraph): the same result as eager,
    written into out."""
    lq, lk = [4, 1], [30, 17]
    q, k, v, k_cache, v_cache, table = paged_problem(device, torch.float16, lq, lk, 4, 2, 32, 16, 55)
    used = torch.tensor(lk, dtype=torch.int32, device=device)
    cq = cu(lq, device)

    def step(q, out):
        return flashattn.flash_attn_varlen_func(q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cq, max_seqlen_q=4,
                                                seqused_k=used, max_seqlen_k=30, causal=True, block_table=table)

    eager = step(q, torch.empty_like(q)).clone()
    out = torch.full_like(q, float("nan"))
    with torch.no_grad():
        torch.compile(step, fullgraph=True)(q, out)
    assert torch.equal(out, eager)
