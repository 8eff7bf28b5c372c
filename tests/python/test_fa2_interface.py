"""flashattn.flash_attn_interface: flash_attn 2.x's module, private building blocks included —
their argument specs, return tuples, gradients written in place, a two-block ring-attention step
built from them, and flash_attn's argument conventions — against the float64 oracle (SPEC §7)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")

import flashattn  # noqa: E402
from flashattn import flash_attn_interface as fai  # noqa: E402

from conftest import torch_devices  # noqa: E402
from reference import check_spec  # noqa: E402
from torch_checks import check_batch, check_varlen, gradient_magnitude, randn, to_np  # noqa: E402
from torch_reference import batch_grads, dtype_name  # noqa: E402

# flash_attn 2.8's argument lists: (name, default) with NO_DEFAULT for positional-only ones.
NO_DEFAULT = object()
_ATTN_TAIL = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
              ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
_FWD_MID = ["dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap",
            "alibi_slopes"]
_BWD_TAIL = ["dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap",
             "alibi_slopes", "deterministic"]
_BWD_HEAD = ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv"]
_VARLEN = ["cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]


KEYWORD_ONLY = {name: ["out"] for name in (
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache")}
KEYWORD_ONLY["flash_attn_varlen_func"] = ["seqused_k", "return_softmax_lse", "out", "s_aux"]
KEYWORD_ONLY["flash_attn_with_kvcache"] = ["out", "s_aux"]


def _required(names):
    return [(n, NO_DEFAULT) for n in names]


SIGNATURES = {
    "flash_attn_func": _required(["q", "k", "v"]) + _ATTN_TAIL,
    "flash_attn_qkvpacked_func": _required(["qkv"]) + _ATTN_TAIL,
    "flash_attn_kvpacked_func": _required(["q", "kv"]) + _ATTN_TAIL,
    "flash_attn_varlen_func": _required(["q", "k", "v"] + _VARLEN) + _ATTN_TAIL + [("block_table", None)],
    "flash_attn_varlen_qkvpacked_func": _required(["qkv", "cu_seqlens", "max_seqlen"]) + _ATTN_TAIL,
    "flash_attn_varlen_kvpacked_func": _required(["q", "kv"] + _VARLEN) + _ATTN_TAIL,
    "flash_attn_with_kvcache": _required(["q", "k_cache", "v_cache"]) + [
        ("k", None), ("v", None), ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
        ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None), ("softmax_scale", None),
        ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("rotary_interleaved", True),
        ("alibi_slopes", None), ("num_splits", 0), ("return_softmax_lse", False)],
    "_flash_attn_forward": _required(["q", "k", "v"] + _FWD_MID + ["return_softmax"]),
    "_flash_attn_varlen_forward": _required(["q", "k", "v"] + _VARLEN + ["dropout_p", "softmax_scale", "causal"]) + [
        ("window_size_left", -1), ("window_size_right", -1), ("softcap", 0.0), ("alibi_slopes", None),
        ("return_softmax", False), ("block_table", None), ("leftpad_k", None), ("seqused_k", None),
        ("zero_tensors", False)],
    "_flash_attn_backward": _required(_BWD_HEAD + _BWD_TAIL) + [("rng_state", None)],
    "_flash_attn_varlen_backward": _required(_BWD_HEAD + _VARLEN + _BWD_TAIL) + [
        ("rng_state", None), ("zero_tensors", False)],
}


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_argspec(name):
    """Callers fill these functions' keyword arguments from inspect.getfullargspec (ring-attention
    code does): names, order and defaults are flash_attn's."""
    fn = getattr(fai, name)
    assert inspect.isfunction(fn)
    spec = inspect.getfullargspec(fn)
    defaults = spec.defaults or ()
    got = list(zip(spec.args, [NO_DEFAULT] * (len(spec.args) - len(defaults)) + list(defaults)))
    assert got == SIGNATURES[name]
    assert spec.varargs is None and spec.varkw is None
    # Beyond flash_attn's arguments, only the documented keyword-only extras: out= on every public
    # function, vLLM's seqused_k and return_softmax_lse on the varlen one, and vLLM's s_aux (the
    # sinks) on the varlen and KV-cache ones.
    assert spec.kwonlyargs == KEYWORD_ONLY.get(name, [])
    assert all(spec.kwonlydefaults[n] in (None, False) for n in spec.kwonlyargs)


def batch_inputs(shape, dtype, device, seed):
    b, sq, sk, h, hk, d, dv = shape
    g = torch.Generator().manual_seed(seed)
    return (randn((b, sq, h, d), dtype, device, g), randn((b, sk, hk, d), dtype, device, g),
            randn((b, sk, hk, dv), dtype, device, g), randn((b, sq, h, dv), dtype, device, g))


def softmax_d_reference(dout, out):
    """Row sums of dout·out in float64, as (..., heads, rows)."""
    return (dout.double() * out.double()).sum(-1).transpose(-1, -2)


# (batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, head_dim_v): GQA with d != dv, and a head
# dim that is padded for the kernels.
PRIVATE_SHAPES = [(2, 37, 53, 4, 2, 64, 32), (1, 19, 19, 2, 1, 36, 36)]


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", PRIVATE_SHAPES, ids=str)
def test_private_forward_backward(shape, dtype, device):
    q, k, v, dout = batch_inputs(shape, dtype, device, seed=1)
    scale = 0.3
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(q, k, v, 0.0, scale, True, 9, -1, 0.0, None, False)
    assert out.shape == q.shape[:-1] + (v.shape[-1],) and out.dtype == q.dtype
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert s_dmask.numel() == 0 and s_dmask.dtype == q.dtype
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,)
    check_batch(q, k, v, out, lse, softmax_scale=scale, causal=True, window=(9, -1))

    dq, dk, dv = torch.full_like(q, 7.0), torch.full_like(k, 7.0), torch.full_like(v, 7.0)
    pointers = [x.data_ptr() for x in (dq, dk, dv)]
    softmax_d = fai._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, True, 9, -1, 0.0,
                                         None, False, rng_state)
    assert [x.data_ptr() for x in (dq, dk, dv)] == pointers  # written in place
    check_batch(q, k, v, out, lse, grads=(dq, dk, dv), dout=dout, softmax_scale=scale, causal=True,
                window=(9, -1))
    assert softmax_d.dtype == torch.float32
    torch.testing.assert_close(softmax_d.cpu().double(), softmax_d_reference(dout, out).cpu(),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", torch_devices())
def test_private_dropout_rng_state(device):
    """The forward's rng_state takes the backward to the same dropout mask (recomputed from
    docs/dropout.md by the oracle); a None dq is allowed (that gradient is not wanted)."""
    q, k, v, dout = batch_inputs((2, 24, 40, 2, 2, 32, 32), torch.bfloat16, device, seed=2)
    torch.manual_seed(5)
    out, lse, _, rng_state = fai._flash_attn_forward(q, k, v, 0.2, 0.25, False, -1, -1, 0.0, None, True)
    assert rng_state.device == q.device and rng_state[0] != 0
    check_batch(q, k, v, out, lse, softmax_scale=0.25, dropout_p=0.2, rng_state=rng_state)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq = torch.empty_like(q)
    fai._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.2, 0.25, False, -1, -1, 0.0, None, False,
                             rng_state)
    check_batch(q, k, v, out, lse, grads=(dq, dk, dv), dout=dout, softmax_scale=0.25, dropout_p=0.2,
                rng_state=rng_state)
    dk_again = torch.empty_like(k)
    fai._flash_attn_backward(dout, q, k, v, out, lse, None, dk_again, None, 0.2, 0.25, False, -1, -1, 0.0,
                             None, True, rng_state)
    torch.testing.assert_close(dk_again, dk)


def cu(lengths, device):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)


@pytest.mark.parametrize("device", torch_devices())
def test_private_varlen(device):
    lq, lk = [5, 0, 23, 11], [9, 6, 30, 11]
    h, hk, d = 4, 2, 40
    g = torch.Generator().manual_seed(3)
    q = randn((sum(lq), h, d), torch.float16, device, g)
    k = randn((sum(lk), hk, d), torch.float16, device, g)
    v = randn((sum(lk), hk, d), torch.float16, device, g)
    dout = randn((sum(lq), h, d), torch.float16, device, g)
    cq, ck = cu(lq, device), cu(lk, device)
    out, lse, s_dmask, rng_state = fai._flash_attn_varlen_forward(q, k, v, cq, ck, max(lq), max(lk), 0.0, None,
                                                                  True, softcap=2.5)
    assert lse.shape == (h, sum(lq)) and lse.dtype == torch.float32 and s_dmask.numel() == 0
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    softmax_d = fai._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cq, ck, max(lq), max(lk),
                                                0.0, d ** -0.5, True, -1, -1, 2.5, None, False, rng_state)
    check_varlen(q, k, v, cq.tolist(), ck.tolist(), out, lse, max_seqlen_k=max(lk), grads=(dq, dk, dv),
                 dout=dout, causal=True, softcap=2.5)
    assert softmax_d.shape == (h, sum(lq))
    torch.testing.assert_close(softmax_d.cpu().double(), softmax_d_reference(dout, out).cpu(),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", torch_devices())
def test_private_varlen_seqused_k_and_zero_tensors(device):
    """seqused_k: only the first seqused_k[i] keys of sequence i count — the same as the packed
    keys with the rest cut out. zero_tensors: rows after the last sequence are out 0, lse -inf."""
    lq, lk, used = [6, 13], [20, 17], [8, 17]
    h, d = 2, 32
    g = torch.Generator().manual_seed(4)
    q = randn((sum(lq) + 3, h, d), torch.bfloat16, device, g)  # 3 rows that belong to no sequence
    k = randn((sum(lk), h, d), torch.bfloat16, device, g)
    v = randn((sum(lk), h, d), torch.bfloat16, device, g)
    cq, ck = cu(lq, device), cu(lk, device)
    seqused = torch.tensor(used, dtype=torch.int32, device=device)
    out, lse, _, _ = fai._flash_attn_varlen_forward(q, k, v, cq, ck, max(lq), max(lk), 0.0, None, False,
                                                    seqused_k=seqused, zero_tensors=True)
    keep = torch.cat([torch.arange(int(ck[i]), int(ck[i]) + used[i]) for i in range(len(lq))])
    check_varlen(q, k[keep.to(device)], v[keep.to(device)], cq.tolist(), cu(used, "cpu").tolist(), out, lse,
                 max_seqlen_k=max(used))
    assert torch.all(out[sum(lq):] == 0) and torch.all(lse[:, sum(lq):] == float("-inf"))


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("with_seqused", [False, True], ids=["cu_seqlens_k", "seqused_k"])
def test_private_varlen_leftpad_k(with_seqused, device):
    """leftpad_k: sequence i's keys start leftpad_k[i] rows into it and end at seqused_k[i] (or its
    cu_seqlens_k length), masks counted from there — the same as the packed call on those keys
    alone, against the float64 oracle; causal, ALiBi and GQA, an empty sequence, a padding of 0."""
    lq, lk, pad, used = [6, 3, 13, 4], [20, 5, 17, 9], [3, 5, 0, 9], [15, 5, 17, 9]
    counts = used if with_seqused else lk
    h, hk, d = 4, 2, 32
    g = torch.Generator().manual_seed(12)
    q = randn((sum(lq), h, d), torch.bfloat16, device, g)
    k = randn((sum(lk), hk, d), torch.bfloat16, device, g)
    v = randn((sum(lk), hk, d), torch.bfloat16, device, g)
    alibi = torch.rand((h,), generator=g).to(device)
    cq, ck = cu(lq, device), cu(lk, device)
    seqused = torch.tensor(used, dtype=torch.int32, device=device) if with_seqused else None
    out, lse, _, _ = fai._flash_attn_varlen_forward(
        q, k, v, cq, ck, max(lq), max(lk), 0.0, None, True, alibi_slopes=alibi, seqused_k=seqused,
        leftpad_k=torch.tensor(pad, dtype=torch.int32, device=device))
    starts = ck.tolist()
    keep = torch.cat([torch.arange(starts[i] + pad[i], starts[i] + counts[i]) for i in range(len(lq))]).to(device)
    kept = [c - p for c, p in zip(counts, pad)]
    ref_out, ref_lse, _, _ = fai._flash_attn_varlen_forward(q, k[keep], v[keep], cq, cu(kept, device), max(lq),
                                                            max(kept), 0.0, None, True, alibi_slopes=alibi)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    check_varlen(q, k[keep], v[keep], cq.tolist(), cu(kept, "cpu").tolist(), out, lse, max_seqlen_k=max(kept),
                 causal=True, alibi=alibi)


def test_private_varlen_leftpad_k_errors():
    """A padding past the sequence's keys, or with a paged K/V: flashattn.Error naming leftpad_k."""
    x = torch.zeros((9, 2, 16), dtype=torch.bfloat16)
    cq = cu([4, 5], "cpu")
    for pad, fragment in (([5, 0], r"leftpad_k: entry 0 must lie in \[0, 4\]"), ([0, -1], "leftpad_k: entry 1"),
                          ([0], r"leftpad_k: must be \(2,\)")):
        with pytest.raises(flashattn.Error, match=fragment):
            fai._flash_attn_varlen_forward(x, x, x, cq, cq, 5, 5, 0.0, None, False,
                                           leftpad_k=torch.tensor(pad, dtype=torch.int32))
    with pytest.raises(flashattn.Error, match="leftpad_k: must be a 1-D int32"):
        fai._flash_attn_varlen_forward(x, x, x, cq, cq, 5, 5, 0.0, None, False, leftpad_k=torch.tensor([0, 0]))
    with pytest.raises(flashattn.Error, match=r"leftpad_k: cannot be combined with a paged K/V"):
        fai._flash_attn_varlen_forward(x, x.view(9, 1, 2, 16), x.view(9, 1, 2, 16), cq, cq, 5, 5, 0.0, None, False,
                                       block_table=torch.zeros((2, 5), dtype=torch.int32),
                                       leftpad_k=torch.tensor([0, 0], dtype=torch.int32))


def call_by_argspec(fn, **given):
    """fn called as ring-attention code calls it: every argument by name, from
    inspect.getfullargspec (None where there is no default, softcap 0.0), updated with `given`."""
    spec = inspect.getfullargspec(fn)
    defaults = spec.defaults or ()
    params = dict(zip(spec.args, (None,) * (len(spec.args) - len(defaults)) + tuple(defaults)))
    params["softcap"] = 0.0
    params.update(given)
    return fn(**params)


@pytest.mark.parametrize("device", torch_devices())
def test_ring_attention_step(device):
    """What ring attention does with these functions: attention over two blocks of keys, each by
    _flash_attn_forward, merged through their lse; each block's gradients by _flash_attn_backward
    from the merged out and lse, summed over the blocks for dq. Equal to attention over all keys.
    The calls pass every argument by name, from the functions' argument specs."""
    q, k, v, dout = batch_inputs((2, 32, 48, 4, 2, 64, 64), torch.bfloat16, device, seed=6)
    blocks = [(k[:, :20], v[:, :20]), (k[:, 20:], v[:, 20:])]
    scale = 64 ** -0.5
    out_acc, lse_acc = None, None
    for kb, vb in blocks:
        out_b, lse_b, _, _ = call_by_argspec(fai._flash_attn_forward, q=q, k=kb, v=vb, dropout_p=0.0,
                                             softmax_scale=scale, causal=False, window_size_left=-1,
                                             window_size_right=-1, alibi_slopes=None, return_softmax=False)
        lse_b = lse_b.transpose(1, 2).unsqueeze(-1)  # (b, sq, h, 1)
        if out_acc is None:
            out_acc, lse_acc = out_b.float(), lse_b
            continue
        lse_new = torch.logaddexp(lse_acc, lse_b)
        out_acc = out_acc * torch.exp(lse_acc - lse_new) + out_b.float() * torch.exp(lse_b - lse_new)
        lse_acc = lse_new
    out = out_acc.to(q.dtype)
    lse = lse_acc.squeeze(-1).transpose(1, 2)  # (b, h, sq), not contiguous: as ring attention passes it
    check_batch(q, k, v, out, lse, softmax_scale=scale)

    dq = torch.zeros_like(q, dtype=torch.float32)
    dks, dvs = [], []
    for kb, vb in blocks:
        dq_b, dk_b, dv_b = torch.empty_like(q), torch.empty_like(kb), torch.empty_like(vb)
        call_by_argspec(fai._flash_attn_backward, dout=dout, q=q, k=kb, v=vb, out=out, softmax_lse=lse, dq=dq_b,
                        dk=dk_b, dv=dv_b, dropout_p=0.0, softmax_scale=scale, causal=False, window_size_left=-1,
                        window_size_right=-1, alibi_slopes=None, deterministic=False)
        dq += dq_b.float()
        dks.append(dk_b)
        dvs.append(dv_b)
    check_batch(q, k, v, out, lse, grads=(dq.to(q.dtype), torch.cat(dks, 1), torch.cat(dvs, 1)), dout=dout,
                softmax_scale=scale)


def test_private_functions_compile():
    """A ring step traced whole by torch.compile (fullgraph) gives the eager results."""
    q, k, v, dout = batch_inputs((1, 16, 16, 2, 2, 32, 32), torch.float32, "cpu", seed=11)

    def step(q, k, v, dout):
        out, lse, _, _ = fai._flash_attn_forward(q, k, v, 0.0, 0.2, True, -1, -1, 0.0, None, False)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        fai._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.2, True, -1, -1, 0.0, None, False)
        return out, dq, dk, dv

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for got, expected in zip(compiled(q, k, v, dout), step(q, k, v, dout)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("device", torch_devices())
def test_public_functions(device):
    """The seven functions give flashattn's results; S_dmask is an empty tensor, as flash_attn's
    without dropout."""
    q, k, v, _ = batch_inputs((2, 9, 12, 2, 1, 16, 16), torch.bfloat16, device, seed=7)
    out, lse, s_dmask = fai.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(s_dmask, torch.Tensor) and s_dmask.numel() == 0
    torch.testing.assert_close(out, flashattn.flash_attn_func(q, k, v, causal=True))
    qkv = torch.stack([q, q, q], dim=2)
    kv = torch.stack([k, v], dim=2)
    torch.testing.assert_close(fai.flash_attn_qkvpacked_func(qkv), flashattn.flash_attn_func(q, q, q),
                               rtol=0, atol=0)
    torch.testing.assert_close(fai.flash_attn_kvpacked_func(q, kv), flashattn.flash_attn_func(q, k, v),
                               rtol=0, atol=0)
    cq, ck = cu([9, 9], device), cu([12, 12], device)
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    ref = flat(flashattn.flash_attn_func(q, k, v))
    varlen = fai.flash_attn_varlen_func(flat(q), flat(k), flat(v), cq, ck, 9, 12, return_attn_probs=True)
    assert varlen[2].numel() == 0
    torch.testing.assert_close(varlen[0], ref)
    torch.testing.assert_close(fai.flash_attn_varlen_kvpacked_func(flat(q), flat(kv), cq, ck, 9, 12), ref)
    torch.testing.assert_close(fai.flash_attn_varlen_qkvpacked_func(flat(qkv), cq, 9),
                               flat(flashattn.flash_attn_func(q, q, q)))
    out_kv, lse_kv = fai.flash_attn_with_kvcache(q, k.clone(), v.clone(), window_size=(-4, -9),
                                                 return_softmax_lse=True)
    check_batch(q, k, v, out_kv, lse_kv)


@pytest.mark.parametrize("device", torch_devices())
def test_negative_window_and_softcap_mean_off(device):
    q, k, v, _ = batch_inputs((1, 15, 21, 2, 2, 32, 32), torch.float16, device, seed=8)
    plain = flashattn.flash_attn_func(q, k, v, softmax_scale=0.2, causal=True)
    torch.testing.assert_close(fai.flash_attn_func(q, k, v, softmax_scale=0.2, causal=True, window_size=(-7, -2),
                                                   softcap=-1.0), plain, rtol=0, atol=0)
    out, *_ = fai._flash_attn_forward(q, k, v, 0.0, 0.2, True, -3, -5, -2.0, None, False)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    with pytest.raises(flashattn.Error, match="window_left"):  # the top-level functions stay strict
        flashattn.flash_attn_func(q, k, v, window_size=(-7, 0))


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_scale_zero(causal, device):
    """softmax_scale=0.0 is a zero scale, as in flash_attn: every query averages the values of the
    keys it sees; dq and dk vanish. (None is the default 1/sqrt(headdim).)"""
    q, k, v, dout = batch_inputs((2, 11, 11, 2, 1, 24, 24), torch.bfloat16, device, seed=9)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse, _ = fai.flash_attn_func(qg, kg, vg, softmax_scale=0.0, causal=causal, return_attn_probs=True)
    check_batch(q, k, v, out, lse, softmax_scale=0.0, causal=causal)
    out.backward(dout)
    assert qg.grad.abs().max() < 1e-30 and kg.grad.abs().max() < 1e-30
    ref = batch_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), lowprec=False, scale=0.0, causal=causal)
    naive = batch_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), lowprec=True, scale=0.0, causal=causal)
    check_spec("dv", to_np(vg.grad), ref[3].numpy(), naive[3].numpy(), dtype_name(q.dtype),
               magnitude=gradient_magnitude("dv", q, k, v, dout, 0.0), reduction=24)
    out_default = fai.flash_attn_func(q, k, v, softmax_scale=None, causal=causal)
    torch.testing.assert_close(out_default, flashattn.flash_attn_func(q, k, v, causal=causal), rtol=0, atol=0)


@pytest.mark.parametrize("device", torch_devices())
def test_errors(device):
    """Invalid calls raise flashattn.Error, which code written for flash_attn catches as
    RuntimeError."""
    assert issubclass(flashattn.Error, ValueError) and issubclass(flashattn.Error, RuntimeError)
    q, k, v, _ = batch_inputs((1, 4, 4, 2, 2, 16, 16), torch.float16, device, seed=10)
    with pytest.raises(RuntimeError, match="k"):
        fai.flash_attn_func(q, k[..., :8], v)
    with pytest.raises(RuntimeError, match="dropout_p"):
        fai._flash_attn_forward(q, k, v, 1.5, 0.25, False, -1, -1, 0.0, None, False)
    with pytest.raises(RuntimeError, match="window_size"):
        fai.flash_attn_func(q, k, v, window_size=3)
    flat = q.reshape(-1, 2, 16)
    cq = cu([4], device)
    with pytest.raises(RuntimeError, match="leftpad_k: entry 0 must lie in"):
        fai._flash_attn_varlen_forward(flat, flat, flat, cq, cq, 4, 4, 0.0, None, False, leftpad_k=cq[1:] + 1)
    # A paged K/V (block_table) and cache_leftpad are served (tests/python/test_paged_prefill.py);
    # here their shape errors name them.
    paged = flat.reshape(1, 4, 2, 16)
    with pytest.raises(RuntimeError, match=r"block_table: wrong shape; expected \(1, max_blocks_per_seq\)"):
        fai._flash_attn_varlen_forward(flat, paged, paged, cq, cq, 4, 4, 0.0, None, False, block_table=cq)
    with pytest.raises(RuntimeError, match="cache_leftpad"):
        fai.flash_attn_with_kvcache(q, k, v, cache_seqlens=cq[:1].expand(1), cache_leftpad=cq[:2])


@pytest.mark.parametrize("device", torch_devices())
def test_s_aux_is_vllms_sinks(device):
    """s_aux (vLLM's keyword, which transformers' continuous batching passes where a kernel's
    signature has it) is flashattn's sinks= on the varlen function over a paged cache and on the
    KV-cache function: the same result bit for bit, and not the result without sinks."""
    g = torch.Generator().manual_seed(31)
    h, hk, d, page = 4, 2, 32, 16
    lq, lk = [3, 5], [20, 37]
    sinks = torch.randn(h, generator=g).mul(2).to(device)
    q = randn((sum(lq), h, d), torch.bfloat16, device, g)
    k_cache, v_cache = (randn((6, page, hk, d), torch.bfloat16, device, g) for _ in range(2))
    table = torch.randperm(6, generator=g)[:6].view(2, 3).to(torch.int32).to(device)
    cu_q = torch.tensor([0, lq[0], sum(lq)], dtype=torch.int32, device=device)
    used = torch.tensor(lk, dtype=torch.int32, device=device)
    common = dict(causal=True, block_table=table, seqused_k=used)
    got = fai.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, max(lq), max(lk), s_aux=sinks, **common)
    want = flashattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, max(lq), max(lk), sinks=sinks,
                                            **common)
    plain = fai.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, max(lq), max(lk), **common)
    assert torch.equal(got, want) and not torch.equal(got, plain)

    qb = randn((2, 1, h, d), torch.bfloat16, device, g)
    new = [randn((2, 1, hk, d), torch.bfloat16, device, g) for _ in range(2)]
    caches = [randn((2, 24, hk, d), torch.bfloat16, device, g) for _ in range(2)]
    seqlens = torch.tensor([7, 19], dtype=torch.int32, device=device)

    def call(fn, **sink):
        kc, vc = (c.clone() for c in caches)
        return fn(qb, kc, vc, *new, cache_seqlens=seqlens, causal=True, **sink)

    got = call(fai.flash_attn_with_kvcache, s_aux=sinks)
    assert torch.equal(got, call(flashattn.flash_attn_with_kvcache, sinks=sinks))
    assert not torch.equal(got, call(fai.flash_attn_with_kvcache))
