"""FP8 forward calls through flashattn.fa3 (docs/fp8.md): float8_e4m3fn q, k, v with (batch,
nheads_k) descale factors into a bfloat16 out. A bfloat16 problem is quantised to e4m3 under
power-of-two descales and its inputs are set to the dequantised values (exact in bfloat16), so the
FP8 call must pass that problem's SPEC §7 check against the float64 reference — batch and varlen,
causal, windows, GQA; descales that are absent mean 1; the refusals name the argument."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn import fa3  # noqa: E402
from torch_checks import check_batch, check_varlen  # noqa: E402

FP8 = torch.float8_e4m3fn


def _descales(batch, hk, generator):
    """(batch, hk) float32 powers of two from 1/4 to 4."""
    return torch.pow(2.0, torch.randint(-2, 3, (batch, hk), generator=generator).float())


def _quantise(x, descale, sequence_of_row, group):
    """x (rows..., heads, d) bfloat16 -> (e4m3 of x / descale, the dequantised values as bfloat16);
    sequence_of_row: the batch index of each leading row (dense: arange over the batch)."""
    scale = descale[sequence_of_row][:, None, :].repeat_interleave(group, dim=-1)  # (rows, 1, heads)
    scale = scale.transpose(1, 2)  # (rows, heads, 1)
    if x.dim() == 4:
        scale = scale[:, None]  # (b, 1, heads, 1)
    x8 = (x.float() / scale).to(FP8)
    return x8, (x8.float() * scale).to(torch.bfloat16)


def _problem(b, sq, sk, h, hk, d, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, heads, d, generator=g).to(torch.bfloat16)
               for n, heads in ((sq, h), (sk, hk), (sk, hk)))
    ds = [_descales(b, hk, g) for _ in range(3)]
    rows = torch.arange(b)
    q8, qe = _quantise(q, ds[0], rows, h // hk)
    k8, ke = _quantise(k, ds[1], rows, 1)
    v8, ve = _quantise(v, ds[2], rows, 1)
    return (q8, k8, v8), (qe, ke, ve), ds


@pytest.mark.parametrize("causal,window,gqa", [(True, (-1, -1), 2), (False, (7, 3), 4), (False, (-1, -1), 1)])
def test_fp8_batch_matches_the_reference_of_the_descaled_values(causal, window, gqa):
    (q8, k8, v8), (qe, ke, ve), (dq, dk, dv) = _problem(2, 37, 53, 4, 4 // gqa, 64, 3)
    out, lse = fa3.flash_attn_func(q8, k8, v8, causal=causal, window_size=window, q_descale=dq, k_descale=dk,
                                   v_descale=dv, return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and out.shape == qe.shape
    check_batch(qe, ke, ve, out, lse, causal=causal, window=window)


def test_fp8_varlen_matches_the_reference_of_the_descaled_values():
    g = torch.Generator().manual_seed(8)
    lens_q, lens_k, h, hk, d = [9, 0, 30], [20, 4, 33], 4, 2, 64
    cu_q = [0, 9, 9, 39]
    cu_k = [0, 20, 24, 57]
    q = torch.randn(cu_q[-1], h, d, generator=g).to(torch.bfloat16)
    k = torch.randn(cu_k[-1], hk, d, generator=g).to(torch.bfloat16)
    v = torch.randn(cu_k[-1], hk, d, generator=g).to(torch.bfloat16)
    dq, dk, dv = (_descales(3, hk, g) for _ in range(3))
    seq_q = torch.repeat_interleave(torch.arange(3), torch.tensor(lens_q))
    seq_k = torch.repeat_interleave(torch.arange(3), torch.tensor(lens_k))
    q8, qe = _quantise(q, dq, seq_q, h // hk)
    k8, ke = _quantise(k, dk, seq_k, 1)
    v8, ve = _quantise(v, dv, seq_k, 1)
    out, lse = fa3.flash_attn_varlen_func(
        q8, k8, v8, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), 30, 33,
        causal=True, q_descale=dq, k_descale=dk, v_descale=dv, return_attn_probs=True)
    assert out.dtype == torch.bfloat16
    check_varlen(qe, ke, ve, cu_q, cu_k, out, lse, max_seqlen_k=33, causal=True)


def test_fp8_without_descales_means_one():
    (q8, k8, v8), _, _ = _problem(1, 16, 16, 2, 2, 32, 5)
    ones = torch.ones(1, 2)
    a = fa3.flash_attn_func(q8, k8, v8, causal=True)
    b = fa3.flash_attn_func(q8, k8, v8, causal=True, q_descale=ones, k_descale=ones, v_descale=ones)
    assert torch.equal(a, b)
    packed = torch.stack([q8, k8, v8], dim=2)  # (b, s, 3, h, d)
    assert torch.equal(fa3.flash_attn_qkvpacked_func(packed, causal=True), a)


def test_fp8_refusals_name_the_argument():
    (q8, k8, v8), (qe, ke, ve), (dq, dk, dv) = _problem(1, 8, 8, 2, 2, 32, 6)
    with pytest.raises(ValueError, match="q_descale: descale factors go with float8_e4m3 inputs"):
        fa3.flash_attn_func(qe, ke, ve, q_descale=dq)
    with pytest.raises(ValueError, match="k_descale: wrong shape"):
        fa3.flash_attn_func(q8, k8, v8, k_descale=torch.ones(1, 3))
    with pytest.raises(ValueError, match="k: must have q's dtype"):
        fa3.flash_attn_func(q8, ke, ve)
    with pytest.raises(TypeError, match="v_descale: expected a torch.Tensor or None"):
        fa3.flash_attn_func(q8, k8, v8, v_descale=2.0)
    cache = torch.zeros(1, 16, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q_descale: descale factors go with float8_e4m3 inputs"):
        fa3.flash_attn_with_kvcache(qe, cache, cache, q_descale=dq)
    cache8 = cache.to(FP8)
    with pytest.raises(ValueError, match="rotary_cos: no rotary embedding with FP8 inputs"):
        fa3.flash_attn_with_kvcache(q8, cache8, cache8, rotary_cos=torch.ones(16, 8), rotary_sin=torch.ones(16, 8),
                                    cache_seqlens=4)
    # The backward takes no FP8 inputs: flash_attn_func's autograd refuses in the backward.
    q8g = q8.clone().requires_grad_()
    out = flashattn.flash_attn_func(q8g, k8, v8)
    assert out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="q: float8_e4m3 inputs are for the forwards only"):
        out.float().sum().backward()


def test_fp8_cuda_tensors_are_refused_with_the_reason():
    if not torch.cuda.is_available() or "cuda" not in flashattn.compiled_backends():
        pytest.skip("no GPU or no CUDA backend in this build: the CUDA refusal needs CUDA tensors")
    (q8, k8, v8), _, _ = _problem(1, 8, 8, 2, 2, 32, 7)
    with pytest.raises(ValueError, match="q: FP8 attention runs on the CPU backends only"):
        fa3.flash_attn_func(q8.cuda(), k8.cuda(), v8.cuda())


def test_fp8_kvcache_appends_the_new_rows_and_attends():
    """The KV-cache call with e4m3 q, caches and new rows (contiguous and paged): the new rows'
    bytes land at cache_seqlens and nothing else in the caches changes; each sequence's output
    equals (bit for bit: the same values and path) flash_attn_func's FP8 forward over its keys."""
    g = torch.Generator().manual_seed(11)
    b, sq, h, hk, d, new, cap = 2, 2, 4, 2, 32, 3, 32
    cached = [5, 20]
    q8 = torch.randn(b, sq, h, d, generator=g).to(FP8)
    k_new, v_new = (torch.randn(b, new, hk, d, generator=g).to(FP8) for _ in range(2))
    dq, dk, dv = (_descales(b, hk, g) for _ in range(3))
    for paged in (False, True):
        if paged:
            k_cache, v_cache = (torch.randn(2 * cap // 16 + 1, 16, hk, d, generator=g).to(FP8) for _ in range(2))
            table = torch.tensor([[1, 3], [0, 4]], dtype=torch.int32)  # 2 pages of 16 per sequence
            rows = lambda c, i, n: torch.cat([c[p] for p in table[i].tolist()])[:n]  # noqa: E731
        else:
            k_cache, v_cache = (torch.randn(b, cap, hk, d, generator=g).to(FP8) for _ in range(2))
            table = None
            rows = lambda c, i, n: c[i, :n]  # noqa: E731
        before = (k_cache.view(torch.uint8).clone(), v_cache.view(torch.uint8).clone())
        seqlens = torch.tensor(cached, dtype=torch.int32)
        out = fa3.flash_attn_with_kvcache(q8, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                          page_table=table, causal=True, q_descale=dq, k_descale=dk, v_descale=dv)
        assert out.dtype == torch.bfloat16
        for i in range(b):
            n = cached[i] + new
            k_i, v_i = rows(k_cache, i, n), rows(v_cache, i, n)
            assert torch.equal(k_i[cached[i]:].view(torch.uint8), k_new[i].view(torch.uint8))
            assert torch.equal(v_i[cached[i]:].view(torch.uint8), v_new[i].view(torch.uint8))
            assert torch.equal(k_i[:cached[i]].view(torch.uint8), rows(before[0].view(FP8), i, cached[i]).view(torch.uint8))
            ref = fa3.flash_attn_func(q8[i:i + 1], k_i[None], v_i[None], causal=True, q_descale=dq[i:i + 1],
                                      k_descale=dk[i:i + 1], v_descale=dv[i:i + 1])
            assert (out[i:i + 1].float() - ref.float()).abs().max().item() <= 2 ** -7 * ref.float().abs().max().item()


def test_fp8_through_flash_attn_varlen_func_paged_or_not():
    """flashattn's own flash_attn_varlen_func takes FP8 inputs too (descales 1, bfloat16 out), over
    packed keys or a paged cache (block_table, seqused_k): the same bits as flashattn.fa3's."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(20, 4, 32, generator=g).to(FP8)
    k = torch.randn(30, 2, 32, generator=g).to(FP8)
    cu_q = torch.tensor([0, 5, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, 30], dtype=torch.int32)
    packed = flashattn.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 15, 20, causal=True)
    assert packed.dtype == torch.bfloat16
    assert torch.equal(packed, fa3.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 15, 20, causal=True))
    pages = torch.full((4, 16, 2, 32), float("nan")).to(FP8)  # unused rows NaN: reading one would show
    pages[1, :10], pages[2], pages[3, :4] = k[:10], k[10:26], k[26:30]
    table = torch.tensor([[1, 0], [2, 3]], dtype=torch.int32)
    paged = flashattn.flash_attn_varlen_func(q, pages, pages, cu_q, None, 15, 20, causal=True, block_table=table,
                                             seqused_k=torch.tensor([10, 20], dtype=torch.int32))
    assert torch.equal(packed, paged)


def test_fp8_kvcache_varlen_queries_and_new_keys():
    """flashattn.fa3.flash_attn_with_kvcache with varlen queries (cu_seqlens_q) and varlen new keys
    (cu_seqlens_k_new) over a paged e4m3 cache — the call of serving engines with an FP8 cache:
    the new rows land at cache_seqlens, and each sequence's rows equal the FP8 forward over its
    keys."""
    g = torch.Generator().manual_seed(12)
    hk, h, d = 2, 4, 32
    cached, new_lens, q_lens = [7, 18], [2, 3], [2, 5]
    q8 = torch.randn(sum(q_lens), h, d, generator=g).to(FP8)
    k_new, v_new = (torch.randn(sum(new_lens), hk, d, generator=g).to(FP8) for _ in range(2))
    k_cache, v_cache = (torch.randn(6, 16, hk, d, generator=g).to(FP8) for _ in range(2))
    table = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)
    dq, dk, dv = (_descales(2, hk, g) for _ in range(3))
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)  # noqa: E731
    out = fa3.flash_attn_with_kvcache(q8, k_cache, v_cache, k_new, v_new, cache_seqlens=torch.tensor(cached, dtype=torch.int32),
                                      page_table=table, cu_seqlens_q=cu(q_lens), cu_seqlens_k_new=cu(new_lens),
                                      max_seqlen_q=max(q_lens), causal=True, q_descale=dq, k_descale=dk, v_descale=dv)
    assert out.dtype == torch.bfloat16 and out.shape == (sum(q_lens), h, d)
    q_rows, new_rows = cu(q_lens).tolist(), cu(new_lens).tolist()
    for i in range(2):
        n = cached[i] + new_lens[i]
        rows = lambda c: torch.cat([c[p] for p in table[i].tolist()])[:n]  # noqa: E731
        k_i, v_i = rows(k_cache), rows(v_cache)
        assert torch.equal(k_i[cached[i]:].view(torch.uint8), k_new[new_rows[i]:new_rows[i + 1]].view(torch.uint8))
        ref = fa3.flash_attn_func(q8[None, q_rows[i]:q_rows[i + 1]], k_i[None], v_i[None], causal=True,
                                  q_descale=dq[i:i + 1], k_descale=dk[i:i + 1], v_descale=dv[i:i + 1])
        got = out[q_rows[i]:q_rows[i + 1]].float()
        assert (got - ref[0].float()).abs().max().item() <= 2 ** -7 * ref.float().abs().max().item()
