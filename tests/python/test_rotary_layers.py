"""flashattn.layers.rotary against a float64 rotation (reference.rotate) and against the keys the
KV-cache append rotates in place (bit-equal), with gradients, in-place variants and
RotaryEmbedding's tables."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")

import flashattn  # noqa: E402
from flashattn.layers.rotary import (  # noqa: E402
    RotaryEmbedding,
    apply_rotary_emb,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
)

from conftest import torch_devices  # noqa: E402
from reference import rotate  # noqa: E402
from torch_checks import randn, to_np  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def tables(seqlen_ro, rotary_dim, dtype, device, base=10000.0):
    inv_freq = base ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.outer(np.arange(seqlen_ro), inv_freq)
    as_t = lambda a: torch.from_numpy(a).to(device=device, dtype=dtype)  # noqa: E731
    return as_t(np.cos(angles)), as_t(np.sin(angles))


def reference(x, cos, sin, positions, interleaved):
    """x (seqlen, h, d) rotated in float64 at positions (seqlen,), identity past the tables."""
    cn, sn = to_np(cos).astype(np.float64), to_np(sin).astype(np.float64)
    inside = positions < cn.shape[0]
    idx = np.minimum(positions, cn.shape[0] - 1)
    c = np.where(inside[:, None], cn[idx], 1.0)
    s = np.where(inside[:, None], sn[idx], 0.0)
    return rotate(to_np(x), c, s, interleaved)


def assert_rounded_from(ours, ref, dtype):
    """ours is ref rounded to dtype (plus float32 arithmetic): within one unit of dtype."""
    if ref.size == 0:
        return
    err = np.abs(to_np(ours).astype(np.float64) - ref).max()
    bound = torch.finfo(dtype).eps * np.abs(ref).max() + 1e-6
    assert err <= bound, f"max error {err} > {bound}"


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_emb(interleaved, dtype, device):
    """Batch mode, rotary_dim < headdim, per-sequence offsets (one running past the tables)."""
    b, s, h, d, rd = 3, 13, 2, 40, 24
    g = torch.Generator().manual_seed(1)
    x = randn((b, s, h, d), dtype, device, g)
    cos, sin = tables(30, rd, dtype, device)
    offsets = torch.tensor([0, 5, 25], dtype=torch.int32, device=device)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    assert out.shape == x.shape and out.dtype == dtype
    for i in range(b):
        ref = reference(x[i], cos, sin, np.arange(s) + int(offsets[i]), interleaved)
        assert_rounded_from(out[i], ref, dtype)
    assert torch.equal(out[..., rd:], x[..., rd:])
    out_int = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=5)
    assert torch.equal(out_int[1], out[1])


@pytest.mark.parametrize("device", torch_devices())
def test_apply_rotary_emb_varlen(device):
    """With cu_seqlens positions restart at each sequence (plus its offset)."""
    lens, h, d = [4, 0, 9, 6], 3, 32
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(2)
    x = randn((sum(lens), h, d), torch.bfloat16, device, g)
    cos, sin = tables(20, d, torch.bfloat16, device)
    offsets = torch.tensor([3, 0, 1, 7], dtype=torch.int32, device=device)
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu, max_seqlen=max(lens))
    for i, n in enumerate(lens):
        start = int(cu[i])
        ref = reference(x[start:start + n], cos, sin, np.arange(n) + int(offsets[i]), False)
        assert_rounded_from(out[start:start + n], ref, torch.bfloat16)


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
def test_same_rotation_as_kvcache_append(interleaved, dtype, device):
    """The keys flash_attn_with_kvcache rotates into the cache are bit-equal to
    apply_rotary_emb's at the same positions: one rotation, src/common/rotary.h's roundings."""
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("fp32 is a CPU-only dtype (SPEC §1)")
    b, s, hk, d, rd, cap = 2, 7, 2, 64, 32, 24
    g = torch.Generator().manual_seed(3)
    k = randn((b, s, hk, d), dtype, device, g) * 3
    v = randn((b, s, hk, d), dtype, device, g)
    q = randn((b, 1, hk, d), dtype, device, g)
    cos, sin = tables(cap, rd, dtype, device)
    lengths = torch.tensor([2, 11], dtype=torch.int32, device=device)
    k_cache = torch.zeros((b, cap, hk, d), dtype=dtype, device=device)
    v_cache = torch.zeros((b, cap, hk, d), dtype=dtype, device=device)
    flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=lengths,
                                      rotary_interleaved=interleaved)
    ours = apply_rotary_emb(k, cos, sin, interleaved=interleaved, seqlen_offsets=lengths)
    for i in range(b):
        start = int(lengths[i])
        assert torch.equal(k_cache[i, start:start + s], ours[i])


def rotate_float64(x, cos, sin, offset, interleaved):
    """A differentiable float64 rotation of x (b, s, h, d) at positions offset + j."""
    half = cos.shape[1]
    c = cos.double()[offset:offset + x.shape[1], None, :]
    s = sin.double()[offset:offset + x.shape[1], None, :]
    rot = x[..., :2 * half]
    a, b_ = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    na, nb = a * c - b_ * s, a * s + b_ * c
    pairs = torch.stack((na, nb), dim=-1).flatten(-2) if interleaved else torch.cat((na, nb), dim=-1)
    return torch.cat((pairs, x[..., 2 * half:]), dim=-1)


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("interleaved", [False, True])
def test_gradient_and_inplace(interleaved, device):
    b, s, h, d, rd = 2, 9, 2, 24, 16
    g = torch.Generator().manual_seed(4)
    x = randn((b, s, h, d), torch.float32, device, g)
    dout = randn((b, s, h, d), torch.float32, device, g)
    cos, sin = tables(16, rd, torch.float32, device)
    xg = x.clone().requires_grad_()
    apply_rotary_emb(xg, cos, sin, interleaved=interleaved, seqlen_offsets=4).backward(dout)
    x64 = x.double().requires_grad_()
    rotate_float64(x64, cos, sin, 4, interleaved).backward(dout.double())
    torch.testing.assert_close(xg.grad.double(), x64.grad, rtol=1e-6, atol=1e-6)

    leaf = x.clone().requires_grad_()
    y = leaf * 1.0  # a non-leaf, as the output of a projection is
    out = apply_rotary_emb(y, cos, sin, interleaved=interleaved, inplace=True, seqlen_offsets=4)
    assert out is y
    assert torch.equal(out, apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=4))
    out.backward(dout)
    torch.testing.assert_close(leaf.grad, xg.grad, rtol=0, atol=0)


@pytest.mark.parametrize("device", torch_devices())
def test_qkv_and_kv_in_place(device):
    b, s, h, d = 2, 6, 3, 32
    g = torch.Generator().manual_seed(5)
    qkv0 = randn((b, s, 3, h, d), torch.bfloat16, device, g)
    cos, sin = tables(12, d, torch.bfloat16, device)
    cos_k, sin_k = cos * 0.5, sin * 0.5  # separate key tables (XPos)
    leaf = qkv0.clone().requires_grad_()
    qkv = leaf * 1
    assert apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, seqlen_offsets=2) is qkv
    assert torch.equal(qkv[:, :, 0], apply_rotary_emb(qkv0[:, :, 0], cos, sin, seqlen_offsets=2))
    assert torch.equal(qkv[:, :, 1], apply_rotary_emb(qkv0[:, :, 1], cos_k, sin_k, seqlen_offsets=2))
    assert torch.equal(qkv[:, :, 2], qkv0[:, :, 2])
    dqkv = torch.randn(qkv.shape, generator=g).to(device=device, dtype=torch.bfloat16)
    qkv.backward(dqkv)
    assert torch.equal(leaf.grad[:, :, 2], dqkv[:, :, 2])
    expected_dq = apply_rotary_emb(dqkv[:, :, 0].float(), cos.float(), -sin.float(), seqlen_offsets=2)
    torch.testing.assert_close(leaf.grad[:, :, 0].float(), expected_dq, rtol=1e-2, atol=1e-2)

    # GQA layout: (b, s, num_heads_q + 2·num_heads_k, d).
    packed0 = randn((b, s, 4 + 2 * 2, d), torch.bfloat16, device, g)
    packed = apply_rotary_emb_qkv_(packed0.clone(), cos, sin, num_heads_q=4, interleaved=True)
    assert torch.equal(packed[:, :, :6], apply_rotary_emb(packed0[:, :, :6], cos, sin, interleaved=True))
    assert torch.equal(packed[:, :, 6:], packed0[:, :, 6:])

    kv0 = randn((b, s, 2, h, d), torch.bfloat16, device, g)
    kv = apply_rotary_emb_kv_(kv0.clone(), cos, sin, seqlen_offsets=1)
    assert torch.equal(kv[:, :, 0], apply_rotary_emb(kv0[:, :, 0], cos, sin, seqlen_offsets=1))
    assert torch.equal(kv[:, :, 1], kv0[:, :, 1])


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("scale_base", [None, 64.0])
def test_rotary_embedding_module(scale_base, device):
    b, s, h, d, dim = 2, 10, 2, 32, 16
    module = RotaryEmbedding(dim, base=500.0, scale_base=scale_base, device=device)
    g = torch.Generator().manual_seed(6)
    qkv0 = randn((b, s, 3, h, d), torch.float32, device, g)
    qkv = module(qkv0.clone(), seqlen_offset=3)
    n = s + 3
    angles = np.outer(np.arange(n), 500.0 ** (-np.arange(0, dim, 2) / dim))
    decay = np.ones_like(angles)
    if scale_base is not None:
        decay = ((np.arange(0, dim, 2) + 0.4 * dim) / (1.4 * dim))[None, :] ** ((np.arange(n) - n // 2) / scale_base)[:, None]
    cos_q, sin_q = np.cos(angles) * decay, np.sin(angles) * decay
    cos_k, sin_k = np.cos(angles) / decay, np.sin(angles) / decay
    for part, (c, sn) in ((0, (cos_q, sin_q)), (1, (cos_k, sin_k))):
        for i in range(b):
            ref = rotate(to_np(qkv0[i, :, part]), c[3:], sn[3:], False)
            np.testing.assert_allclose(to_np(qkv[i, :, part]), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, :, 2], qkv0[:, :, 2])

    q0, kv0 = qkv0[:, :, 0].clone(), qkv0[:, :, 1:].clone()
    q, kv = module(q0.clone(), kv0.clone(), seqlen_offset=3)
    assert torch.equal(q, qkv[:, :, 0]) and torch.equal(kv[:, :, 0], qkv[:, :, 1])
    assert math.isclose(float(module._cos_cached[1, 1]), math.cos(500.0 ** (-2 / dim)) * float(decay[1, 1]),
                        rel_tol=1e-5)


def test_errors():
    x = torch.zeros((1, 4, 2, 16))
    cos, sin = tables(8, 32, torch.float32, "cpu")
    with pytest.raises(flashattn.Error, match="rotary_dim"):
        apply_rotary_emb(x, cos, sin)
    with pytest.raises(flashattn.Error, match="num_heads_q"):
        apply_rotary_emb_qkv_(torch.zeros((1, 4, 6, 16)), cos[:, :4], sin[:, :4])


def test_rotary_embedding_signature():
    """flash_attn's RotaryEmbedding(dim, base=10000.0, interleaved=False, scale_base=None,
    pos_idx_in_fp32=True, device=None), as inspect.getfullargspec reads it."""
    spec = inspect.getfullargspec(RotaryEmbedding.__init__)
    names = ["self", "dim", "base", "interleaved", "scale_base", "pos_idx_in_fp32", "device"]
    assert spec.args == names
    assert spec.defaults == (10000.0, False, None, True, None)
    assert spec.varargs is None and spec.varkw is None and not spec.kwonlyargs


@pytest.mark.parametrize("device", torch_devices())
def test_rotary_embedding_positions_dtype(device):
    """A module converted to bfloat16: with pos_idx_in_fp32 (the default) its tables are the float32
    ones rounded once; without, positions and angles are bfloat16 (position 601 is 600 there), so
    the tables at long positions differ."""
    dim, n = 16, 700
    x = randn((1, n, 3, 2, dim), torch.bfloat16, device, torch.Generator().manual_seed(9))
    tables_of = {}
    for in_fp32 in (True, False):
        module = RotaryEmbedding(dim, pos_idx_in_fp32=in_fp32, device=device).to(torch.bfloat16)
        assert module.inv_freq.dtype == torch.bfloat16
        module(x.clone())
        tables_of[in_fp32] = module._cos_cached, module._sin_cached
    inv_freq32 = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    angles32 = torch.outer(torch.arange(n, dtype=torch.float32, device=device), inv_freq32)
    assert torch.equal(tables_of[True][0], torch.cos(angles32).to(torch.bfloat16))
    assert torch.equal(tables_of[True][1], torch.sin(angles32).to(torch.bfloat16))
    inv_freq16 = inv_freq32.to(torch.bfloat16)
    angles16 = torch.outer(torch.arange(n, dtype=torch.bfloat16, device=device), inv_freq16)
    assert torch.equal(tables_of[False][0], torch.cos(angles16))
    assert torch.equal(tables_of[False][1], torch.sin(angles16))
    assert not torch.equal(tables_of[False][0], tables_of[True][0])
