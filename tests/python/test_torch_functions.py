"""flash_attn_func and the packed variants on PyTorch tensors: forward and gradients against the
float64 oracle with SPEC §7, for every argument."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")

import flashattn  # noqa: E402
from flashattn._torch_ops import draw_rng_state  # noqa: E402

from conftest import torch_devices  # noqa: E402
from torch_checks import check_batch, randn  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# (batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, head_dim_v): the odd and the tiny, GQA
# 1/2/8, head dims that need padding (59, 33) and d != dv.
SHAPES = [
    (1, 1, 1, 1, 1, 8, 8),
    (2, 113, 203, 4, 2, 64, 64),
    (1, 239, 1, 2, 1, 32, 32),
    (1, 40, 96, 8, 1, 128, 128),
    (2, 17, 33, 3, 3, 40, 24),
    (1, 31, 31, 2, 2, 59, 59),
    (2, 7, 9, 2, 1, 33, 17),
]

MASKS = {
    "full": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "window": (False, (16, 8)),
    "causal_window": (True, (24, -1)),
}


def make_inputs(shape, dtype, device, seed=0):
    b, sq, sk, h, hk, d, dv = shape
    g = torch.Generator().manual_seed(seed)
    return (randn((b, sq, h, d), dtype, device, g), randn((b, sk, hk, d), dtype, device, g),
            randn((b, sk, hk, dv), dtype, device, g))


def run(q, k, v, *, grads=True, **kw):
    """flash_attn_func forward (+ backward with a random dout); returns out, lse, grads, dout."""
    qg, kg, vg = (x.clone().requires_grad_(grads) for x in (q, k, v))
    out, lse, s_dmask = flashattn.flash_attn_func(qg, kg, vg, return_attn_probs=True, **kw)
    assert s_dmask is None
    assert out.shape == q.shape[:-1] + (v.shape[-1],) and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    if not grads:
        return out, lse, None, None
    dout = torch.randn_like(out)
    out.backward(dout)
    return out, lse, (qg.grad, kg.grad, vg.grad), dout


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_backward(shape, dtype, mask, device):
    causal, window = MASKS[mask]
    q, k, v = make_inputs(shape, dtype, device)
    out, lse, grads, dout = run(q, k, v, causal=causal, window_size=window)
    check_batch(q, k, v, out, lse, grads=grads, dout=dout, causal=causal, window=window)


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(dtype, causal, device):
    q, k, v = make_inputs((2, 37, 53, 4, 2, 64, 64), dtype, device, seed=1)
    q = q * 4  # large scores, so that the cap matters
    out, lse, grads, dout = run(q, k, v, causal=causal, softcap=2.5)
    check_batch(q, k, v, out, lse, grads=grads, dout=dout, causal=causal, softcap=2.5)


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes_h", "slopes_bh"])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi(per_batch, causal, device):
    q, k, v = make_inputs((2, 29, 45, 4, 1, 32, 32), torch.bfloat16, device, seed=2)
    shape = (2, 4) if per_batch else (4,)
    alibi = torch.rand(shape, generator=torch.Generator().manual_seed(3)).to(device)
    out, lse, grads, dout = run(q, k, v, causal=causal, alibi_slopes=alibi)
    check_batch(q, k, v, out, lse, grads=grads, dout=dout, causal=causal, alibi=alibi)


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("softmax_scale", [0.05, 0.3])
def test_softmax_scale(softmax_scale, device):
    q, k, v = make_inputs((1, 21, 30, 2, 2, 48, 48), torch.float16, device, seed=4)
    out, lse, grads, dout = run(q, k, v, softmax_scale=softmax_scale)
    check_batch(q, k, v, out, lse, grads=grads, dout=dout, softmax_scale=softmax_scale)


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", ["full", "causal_window"])
@pytest.mark.parametrize("dropout_p", [0.17, 0.5])
def test_dropout_matches_reference_mask(dropout_p, mask, dtype, device):
    """The keep mask is the Philox mask of docs/dropout.md for the rng_state drawn from PyTorch's
    default generator; forward and gradients match the reference with that mask."""
    causal, window = MASKS[mask]
    q, k, v = make_inputs((2, 45, 38, 2, 1, 32, 32), dtype, device, seed=5)
    torch.manual_seed(1234)
    rng_state = draw_rng_state(torch.device(device))
    torch.manual_seed(1234)
    out, lse, grads, dout = run(q, k, v, dropout_p=dropout_p, causal=causal, window_size=window)
    check_batch(q, k, v, out, lse, grads=grads, dout=dout, causal=causal, window=window,
                dropout_p=dropout_p, rng_state=rng_state)


@pytest.mark.parametrize("device", torch_devices())
def test_window_normalised_when_longer_than_keys(device):
    q, k, v = make_inputs((1, 9, 12, 2, 2, 16, 16), torch.float16, device, seed=6)
    wide = flashattn.flash_attn_func(q, k, v, window_size=(12, 100))
    full = flashattn.flash_attn_func(q, k, v)
    assert torch.equal(wide, full)


@pytest.mark.parametrize("device", torch_devices())
def test_deterministic_backward_is_bitwise_reproducible(device):
    q, k, v = make_inputs((2, 70, 90, 4, 1, 64, 64), torch.bfloat16, device, seed=7)
    results = []
    for _ in range(2):
        torch.manual_seed(0)  # the same dout
        _, _, grads, _ = run(q, k, v, causal=True, deterministic=True)
        results.append(grads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", torch_devices())
def test_empty_keys_and_queries(device):
    # seqlen_k == 0: out = 0, lse = +inf; seqlen_q == 0: empty results, zero dk/dv.
    q, k, v = make_inputs((1, 5, 0, 2, 2, 16, 16), torch.float16, device, seed=8)
    out, lse, _ = flashattn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isinf(lse).all() and (lse > 0).all()
    q, k, v = make_inputs((1, 0, 6, 2, 2, 16, 16), torch.float16, device, seed=9)
    out, lse, grads, _ = run(q, k, v)
    assert out.shape == (1, 0, 2, 16)
    assert torch.equal(grads[1], torch.zeros_like(k)) and torch.equal(grads[2], torch.zeros_like(v))


@pytest.mark.parametrize("device", torch_devices())
def test_fully_masked_rows_give_zero_not_nan(device):
    # seqlen_q > seqlen_k with causal: the first rows see no key.
    q, k, v = make_inputs((1, 12, 4, 2, 2, 16, 16), torch.float16, device, seed=10)
    out, lse, grads, dout = run(q, k, v, causal=True)
    assert torch.equal(out[:, :8], torch.zeros_like(out[:, :8]))
    assert torch.isinf(lse[..., :8]).all()
    check_batch(q, k, v, out, lse, grads=grads, dout=dout, causal=True)


@pytest.mark.parametrize("device", torch_devices())
def test_non_contiguous_views(device):
    """(b, h, s, d) tensors transposed to (b, s, h, d): strides are read as they are."""
    b, s, h, d = 2, 33, 4, 64
    g = torch.Generator().manual_seed(11)
    q = randn((b, h, s, d), torch.float16, device, g).transpose(1, 2)
    k = randn((b, h, s, d), torch.float16, device, g).transpose(1, 2)
    v = randn((b, h, s, d), torch.float16, device, g).transpose(1, 2)
    assert not q.is_contiguous()
    out, lse, grads, dout = run(q, k, v, causal=True)
    check_batch(q, k, v, out, lse, grads=grads, dout=dout, causal=True)


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_qkvpacked(dtype, head_dim, device):
    b, s, h = 2, 41, 4
    qkv = randn((b, s, 3, h, head_dim), dtype, device, torch.Generator().manual_seed(12))
    packed = qkv.clone().requires_grad_()
    out, lse, _ = flashattn.flash_attn_qkvpacked_func(packed, 0.0, None, True, return_attn_probs=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert packed.grad.shape == qkv.shape
    q, k, v = qkv.unbind(2)
    grads = packed.grad.unbind(2)
    check_batch(q, k, v, out, lse, grads=grads, dout=dout, causal=True)


@pytest.mark.parametrize("device", torch_devices())
def test_kvpacked(device):
    b, sq, sk, h, hk, d = 2, 19, 57, 6, 2, 32
    g = torch.Generator().manual_seed(13)
    q = randn((b, sq, h, d), torch.bfloat16, device, g)
    kv = randn((b, sk, 2, hk, d), torch.bfloat16, device, g)
    qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse, _ = flashattn.flash_attn_kvpacked_func(qg, kvg, window_size=(5, 3), return_attn_probs=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    k, v = kv.unbind(2)
    dk, dv = kvg.grad.unbind(2)
    check_batch(q, k, v, out, lse, grads=(qg.grad, dk, dv), dout=dout, window=(5, 3))


def test_positional_order_and_defaults():
    """The signatures of flash_attn 2.x: names, order and defaults."""
    import inspect

    expected = {
        "flash_attn_func": ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size",
                            "softcap", "alibi_slopes", "deterministic", "return_attn_probs", "out", "sinks"],
        "flash_attn_qkvpacked_func": ["qkv", "dropout_p", "softmax_scale", "causal", "window_size",
                                      "softcap", "alibi_slopes", "deterministic", "return_attn_probs", "out"],
        "flash_attn_kvpacked_func": ["q", "kv", "dropout_p", "softmax_scale", "causal", "window_size",
                                     "softcap", "alibi_slopes", "deterministic", "return_attn_probs", "out"],
        "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                   "max_seqlen_k", "dropout_p", "softmax_scale", "causal", "window_size",
                                   "softcap", "alibi_slopes", "deterministic", "return_attn_probs",
                                   "block_table", "seqused_k", "return_softmax_lse", "out", "sinks"],
        "flash_attn_with_kvcache": ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin",
                                    "cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table",
                                    "softmax_scale", "causal", "window_size", "softcap",
                                    "rotary_interleaved", "alibi_slopes", "num_splits",
                                    "return_softmax_lse", "out", "sinks"],
    }
    defaults = {"dropout_p": 0.0, "softmax_scale": None, "causal": False, "window_size": (-1, -1),
                "softcap": 0.0, "alibi_slopes": None, "deterministic": False, "return_attn_probs": False,
                "rotary_interleaved": True, "num_splits": 0, "return_softmax_lse": False,
                "k": None, "cache_seqlens": None, "cache_leftpad": None, "block_table": None,
                "seqused_k": None, "out": None, "sinks": None}
    # flashattn's extras past flash_attn's arguments are keyword-only.
    extras = {"out", "sinks"}
    extras_of = {"flash_attn_varlen_func": extras | {"seqused_k", "return_softmax_lse"}}
    for fn_name, params in expected.items():
        sig = inspect.signature(getattr(flashattn, fn_name))
        assert list(sig.parameters) == params, fn_name
        for p in sig.parameters.values():
            if p.name in defaults and p.default is not inspect.Parameter.empty:
                assert p.default == defaults[p.name], f"{fn_name}.{p.name}"
            if p.name in extras_of.get(fn_name, extras):
                assert p.kind == inspect.Parameter.KEYWORD_ONLY, f"{fn_name}.{p.name}"
