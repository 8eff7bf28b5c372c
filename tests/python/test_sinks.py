"""Attention sinks (docs/sinks.md) through the Python package: flash_attn_func, the varlen and
KV-cache functions, the FlashAttention-3 names (flashattn.fa3: learnable_sink, s_aux), autograd of
the sinks, the low-level ops under opcheck, NumPy, and the errors. The reference is the formula
written out here in float64 (the sink as one more softmax column with no value), its gradients
from torch.autograd; the bound is SPEC §7's, with the same formula in the input dtype as
naive_lowprec. CUDA variants run where a GPU and a CUDA build exist, and otherwise report that they
were not run."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")

import flashattn  # noqa: E402
from flashattn import _torch_ops, fa3  # noqa: E402

DEVICES = ["cpu", "cuda"]
UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def need(device):
    """Skips, saying so, where the device cannot run."""
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("not run: no GPU (this CUDA variant needs one)")
        if "cuda" not in flashattn.compiled_backends():
            pytest.skip("not run: this build has no CUDA backend (-DFLASHATTN_CUDA=ON)")


def reference(q, k, v, sinks, scale, causal):
    """(out, lse) of attention with sinks, computed in q's dtype (float64 for the oracle):
    q (b, sq, h, d), k/v (b, sk, hk, d), sinks (h,). Bottom-right causal mask; a row without keys
    gets out 0 and lse = its sink."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kr = k.repeat_interleave(h // hk, dim=2)
    vr = v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kr) * scale
    if causal:
        i = torch.arange(sq).view(-1, 1)
        j = torch.arange(sk).view(1, -1)
        s = s.masked_fill((j > i + sk - sq).to(s.device), float("-inf"))
    sink_col = sinks.to(s.dtype).view(1, h, 1, 1).expand(b, h, sq, 1)
    full = torch.cat([s, sink_col], dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    p = torch.softmax(full, dim=-1)[..., :sk]
    out = torch.einsum("bhij,bjhd->bihd", p, vr)
    return out, lse


def within_spec(name, got, ref, naive, unit):
    """SPEC §7: max|got − ref| ≤ 2·max|naive − ref| + 2·max|ref|·unit (NaN fails)."""
    got, ref, naive = (x.detach().cpu().double() for x in (got, ref, naive))
    err = (got - ref).abs().max().item() if got.numel() else 0.0
    bound = 2 * (naive - ref).abs().max().item() + 2 * ref.abs().max().item() * unit
    assert not math.isnan(err), f"{name}: NaN"
    assert err <= bound, f"{name}: error {err:.3e} above the bound {bound:.3e}"


def problem(device, dtype, b=2, sq=37, sk=53, h=4, hk=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(s, generator=g).to(dtype)  # noqa: E731
    q, k, v, dout = make(b, sq, h, d), make(b, sk, hk, d), make(b, sk, hk, d), make(b, sq, h, d)
    # Sinks around log(sk): the weight of the sink competes with the keys'.
    sinks = (torch.rand(h, generator=g) * 5 - 1).float()
    return [x.to(device) for x in (q, k, v, dout, sinks)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_gradients_match_the_formula(device, dtype, causal):
    need(device)
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("fp32 is a CPU-only dtype (SPEC §1)")
    q, k, v, dout, sinks = problem(device, dtype, sq=70 if causal else 37)  # causal: rows without keys
    scale = q.shape[-1] ** -0.5
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out, lse, _ = flashattn.flash_attn_func(*leaves[:3], causal=causal, sinks=leaves[3], return_attn_probs=True)
    out.backward(dout)
    grads = [x.grad for x in leaves]
    assert grads[3].dtype == torch.float32 and grads[3].shape == sinks.shape

    def run(dt):
        xs = [x.detach().cpu().to(dt).requires_grad_() for x in (q, k, v)]
        s = sinks.detach().cpu().to(torch.float64 if dt == torch.float64 else torch.float32).requires_grad_()
        o, l = reference(*xs, s, scale, causal)
        o.backward(dout.cpu().to(dt))
        return o, l, [x.grad for x in xs] + [s.grad]

    ref_out, ref_lse, ref_grads = run(torch.float64)
    naive_out, naive_lse, naive_grads = run(dtype)
    # the dtype's rounding plus fp32 accumulation over the longest reduction (SPEC §2)
    unit = UNIT[dtype] + max(q.shape[1], k.shape[1], q.shape[-1]) * 2.0**-24
    within_spec("out", out, ref_out, naive_out, unit)
    within_spec("lse", lse, ref_lse, naive_lse, unit)
    rows = q.shape[0] * q.shape[1]  # dsinks sums over every row of a head
    for name, ours, r, n in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, naive_grads):
        within_spec(name, ours, r, n, unit + rows * 2.0**-24)
    assert grads[3].abs().max() > 1e-3  # the sinks weigh in: a gradient that is not vacuous
    # The sinks change the result (a test that could not fail otherwise).
    plain = flashattn.flash_attn_func(q, k, v, causal=causal)
    assert (plain - out.detach()).abs().max() > 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_rows_without_keys_and_minus_infinity(device, monkeypatch):
    need(device)
    # Bits are compared within one kernel family: on Hopper GPUs the sm90 forward would take the
    # call without sinks, and sinks run in the sm80 family.
    monkeypatch.setenv("FLASHATTN_CUDA_FAMILY", "sm80")
    q, k, v, _, sinks = problem(device, torch.float16, sq=20, sk=8)
    out, lse, _ = flashattn.flash_attn_func(q, k, v, causal=True, sinks=sinks, return_attn_probs=True)
    # Rows 0..11 see no key: out 0, lse the sink exactly.
    assert torch.equal(out[:, :12], torch.zeros_like(out[:, :12]))
    assert torch.equal(lse[:, :, :12], sinks.view(1, -1, 1).expand(2, -1, 12))
    # −∞ is no sink: the same bits as without (lse +inf on those rows), and a zero gradient.
    none = torch.full_like(sinks, float("-inf")).requires_grad_()
    a, la, _ = flashattn.flash_attn_func(q, k, v, causal=True, sinks=none, return_attn_probs=True)
    b, lb, _ = flashattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert torch.isinf(la[:, :, :12]).all()
    a.float().sum().backward()
    assert torch.equal(none.grad, torch.zeros_like(none.grad))


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_matches_per_sequence_calls(device):
    need(device)
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(3)
    lens_q, lens_k = [5, 0, 31], [17, 4, 30]
    h, hk, d = 4, 2, 64
    q = torch.randn(sum(lens_q), h, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(sum(lens_k), hk, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(sum(lens_k), hk, d, generator=g).to(device=device, dtype=dtype)
    sinks = torch.randn(h, generator=g).to(device).requires_grad_()
    cu = lambda lens: torch.tensor(np.cumsum([0] + lens), dtype=torch.int32, device=device)  # noqa: E731
    out = flashattn.flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), causal=True,
                                           sinks=sinks)
    out.float().sum().backward()
    want_grad = torch.zeros_like(sinks)
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k):
        s = sinks.detach().clone().requires_grad_()
        piece = flashattn.flash_attn_func(q[None, q0:q0 + lq], k[None, k0:k0 + lk], v[None, k0:k0 + lk], causal=True,
                                          sinks=s)
        torch.testing.assert_close(piece[0], out[q0:q0 + lq].detach(), rtol=0, atol=1e-2)
        if lq:
            piece.float().sum().backward()
            want_grad += s.grad
        q0, k0 = q0 + lq, k0 + lk
    torch.testing.assert_close(sinks.grad, want_grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_prefill_and_out_with_sinks(device):
    """Sinks with the other keyword-only arguments of the varlen function: a paged K/V (block_table,
    seqused_k, cu_seqlens_k left out) and out= give the packed call's result and lse."""
    need(device)
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(5)
    lens_q, lens_k, page, h, hk, d = [5, 0, 31], [17, 4, 40], 16, 4, 2, 64
    q = torch.randn(sum(lens_q), h, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(sum(lens_k), hk, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(sum(lens_k), hk, d, generator=g).to(device=device, dtype=dtype)
    sinks = torch.randn(h, generator=g).to(device)
    cu = lambda lens: torch.tensor(np.cumsum([0] + lens), dtype=torch.int32, device=device)  # noqa: E731
    want, want_lse = flashattn.flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                                      causal=True, sinks=sinks, return_softmax_lse=True)
    pages = [-(-n // page) for n in lens_k]
    order = torch.randperm(sum(pages), generator=g).tolist()
    k_cache = torch.zeros(sum(pages), page, hk, d, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    block_table = torch.zeros(len(lens_k), max(pages), dtype=torch.int32)
    k0 = 0
    for i, n in enumerate(lens_k):
        for j in range(pages[i]):
            blk = order.pop()
            block_table[i, j] = blk
            rows = slice(k0 + j * page, k0 + min(n, (j + 1) * page))
            k_cache[blk, :rows.stop - rows.start] = k[rows]
            v_cache[blk, :rows.stop - rows.start] = v[rows]
        k0 += n
    out = torch.empty_like(want)
    with torch.no_grad():
        got, got_lse = flashattn.flash_attn_varlen_func(
            q, k_cache, v_cache, cu(lens_q), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=True,
            block_table=block_table.to(device), seqused_k=torch.tensor(lens_k, dtype=torch.int32, device=device),
            return_softmax_lse=True, out=out, sinks=sinks)
    assert got is out
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_with_sinks(device):
    need(device)
    q, k, v, _, sinks = problem(device, torch.float16, b=2, sq=3, sk=40, h=8, hk=2)
    cache_seqlens = torch.tensor([40, 25], dtype=torch.int32, device=device)
    out, lse = flashattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=cache_seqlens, causal=True, sinks=sinks,
                                                 return_softmax_lse=True)
    for i, n in enumerate((40, 25)):
        want, want_lse, _ = flashattn.flash_attn_func(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=True,
                                                      sinks=sinks, return_attn_probs=True)
        torch.testing.assert_close(out[i:i + 1], want, rtol=0, atol=2e-3)
        torch.testing.assert_close(lse[i:i + 1], want_lse, rtol=0, atol=1e-4)
    plain = flashattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=cache_seqlens, causal=True)
    assert (plain - out).abs().max() > 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_fa3_learnable_sink_and_s_aux(device):
    need(device)
    q, k, v, dout, sinks = problem(device, torch.bfloat16)
    want = flashattn.flash_attn_func(q, k, v, causal=True, sinks=sinks)
    for name in ("learnable_sink", "s_aux"):
        s = sinks.clone().requires_grad_()
        got = fa3.flash_attn_func(q, k, v, causal=True, **{name: s})
        assert torch.equal(got, want), name
        got.backward(dout)
        assert s.grad is not None and torch.isfinite(s.grad).all(), name
    with pytest.raises(flashattn.Error, match="s_aux"):
        fa3.flash_attn_func(q, k, v, learnable_sink=sinks, s_aux=sinks)
    # varlen and the KV cache take the same names
    b, sq, h, d = q.shape
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=device)
    cu_k = torch.arange(0, (b + 1) * k.shape[1], k.shape[1], dtype=torch.int32, device=device)
    got = fa3.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, sq, k.shape[1],
                                     causal=True, learnable_sink=sinks)
    torch.testing.assert_close(got, want.flatten(0, 1), rtol=0, atol=1e-2)
    got = fa3.flash_attn_with_kvcache(q, k, v, causal=True, s_aux=sinks)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2)


def test_low_precision_sinks_are_cast_and_get_their_gradient():
    q, k, v, dout, sinks = problem("cpu", torch.bfloat16)
    s16 = sinks.to(torch.bfloat16).requires_grad_()
    s32 = s16.detach().float().requires_grad_()
    a = flashattn.flash_attn_func(q, k, v, sinks=s16)
    b = flashattn.flash_attn_func(q, k, v, sinks=s32)
    assert torch.equal(a, b)
    a.backward(dout)
    b.backward(dout)
    assert s16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(s16.grad.float(), s32.grad, rtol=1e-2, atol=1e-3)


def test_errors_name_the_argument():
    q, k, v, _, sinks = problem("cpu", torch.float16)
    with pytest.raises(flashattn.Error, match=r"sinks: wrong shape; expected \(4\), got \(3\)"):
        flashattn.flash_attn_func(q, k, v, sinks=sinks[:3])
    with pytest.raises(flashattn.Error, match="sinks: attention sinks are fp32"):
        flashattn.flash_attn_func(q, k, v, sinks=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(flashattn.Error, match="sinks: must be contiguous"):
        flashattn.flash_attn_func(q, k, v, sinks=torch.zeros(8)[::2])
    with pytest.raises(TypeError, match="sinks"):
        flashattn.flash_attn_func(q, k, v, sinks=[0.0] * 4)
    with pytest.raises(flashattn.Error, match="sinks: wrong shape"):
        flashattn.flash_attn_with_kvcache(q, k, v, sinks=torch.zeros(2))


def test_ops_take_sinks_under_opcheck():
    q, k, v, _, sinks = problem("cpu", torch.float16, sq=9, sk=11)
    args = (q, k, v, 0.0, 0.125, True, -1, -1, 0.0, None, None, sinks)
    torch.library.opcheck(torch.ops.flashattn.fwd.default, args)
    out, lse, _ = torch.ops.flashattn.fwd(*args)
    # the op's lse includes the sink: log(exp(lse_without) + exp(sink))
    _, lse0, _ = torch.ops.flashattn.fwd(*args[:-1])
    torch.testing.assert_close(lse, torch.logaddexp(lse0, sinks.view(1, -1, 1)), rtol=0, atol=1e-5)
    softmax_d = torch.randn(lse.shape)
    want = -(torch.exp(sinks.view(1, -1, 1) - lse) * softmax_d).sum(dim=(0, 2))
    torch.testing.assert_close(_torch_ops.sink_grad(sinks, lse, softmax_d), want)


def test_numpy_takes_sinks():
    q, k, v, _, sinks = problem("cpu", torch.float16)
    want = flashattn.flash_attn_func(q, k, v, causal=True, sinks=sinks)
    got = flashattn.flash_attn_func(q.numpy(), k.numpy(), v.numpy(), causal=True, sinks=sinks.numpy())
    np.testing.assert_array_equal(got, want.numpy())
