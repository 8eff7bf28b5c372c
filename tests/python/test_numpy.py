"""The same functions on NumPy arrays (forward only), checked with the NumPy oracle. Runs without
PyTorch."""

from __future__ import annotations

import numpy as np
import pytest

import flashattn
from reference import attend, check_spec


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def check_batch(q, k, v, out, lse, name, **kw):
    kw.setdefault("scale", q.shape[-1] ** -0.5)
    f32 = lambda x: x.astype(np.float32)  # noqa: E731
    refs = [attend(f32(q[i]), f32(k[i]), f32(v[i]), **kw) for i in range(q.shape[0])]
    naives = [attend(f32(q[i]), f32(k[i]), f32(v[i]), lowprec=name, **kw) for i in range(q.shape[0])]
    red = max(q.shape[1], k.shape[1], q.shape[-1])
    check_spec("out", f32(out), np.stack([r[0] for r in refs]), np.stack([n[0] for n in naives]), name,
               reduction=red)
    if lse is not None:
        check_spec("lse", lse, np.stack([r[1] for r in refs]), np.stack([n[1] for n in naives]), "float32",
                   reduction=red)


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["float16", "float32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [32, 20])
def test_flash_attn_func(rng, dtype, causal, head_dim):
    q, k, v = rand(rng, (2, 37, 4, head_dim), dtype), rand(rng, (2, 45, 2, head_dim), dtype), \
        rand(rng, (2, 45, 2, head_dim), dtype)
    out, lse, s_dmask = flashattn.flash_attn_func(q, k, v, causal=causal, window_size=(20, -1),
                                                  return_attn_probs=True)
    assert isinstance(out, np.ndarray) and out.dtype == dtype and s_dmask is None
    check_batch(q, k, v, out, lse, np.dtype(dtype).name, causal=causal, window=(20, -1))


def test_bfloat16_through_ml_dtypes(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (NumPy bfloat16)")
    bf16 = ml_dtypes.bfloat16
    q, k, v = rand(rng, (1, 29, 2, 64), bf16), rand(rng, (1, 31, 2, 64), bf16), rand(rng, (1, 31, 2, 64), bf16)
    out, lse, _ = flashattn.flash_attn_func(q, k, v, softcap=4.0, return_attn_probs=True)
    assert out.dtype == bf16
    check_batch(q, k, v, out, lse, "bfloat16", softcap=4.0)


def test_packed_and_alibi(rng):
    qkv = rand(rng, (2, 21, 3, 2, 16), np.float16)
    slopes = rng.random(2).astype(np.float32)
    out = flashattn.flash_attn_qkvpacked_func(qkv, alibi_slopes=slopes, causal=True)
    check_batch(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], out, None, "float16", causal=True, slopes=slopes)
    q, kv = rand(rng, (2, 5, 4, 16), np.float16), rand(rng, (2, 21, 2, 2, 16), np.float16)
    out = flashattn.flash_attn_kvpacked_func(q, kv, softmax_scale=0.1)
    check_batch(q, kv[:, :, 0], kv[:, :, 1], out, None, "float16", scale=0.1)


def test_varlen(rng):
    lq, lk = [3, 0, 14], [5, 2, 19]
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q, k, v = rand(rng, (17, 2, 24), np.float16), rand(rng, (26, 1, 24), np.float16), rand(rng, (26, 1, 24), np.float16)
    out, lse, _ = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 14, 19, causal=True, return_attn_probs=True)
    assert lse.shape == (2, 17)
    for i in range(3):
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        args = [x.astype(np.float32) for x in (q[sq], k[sk], v[sk])]
        ref, ref_lse = attend(*args, scale=24 ** -0.5, causal=True)
        naive, _ = attend(*args, scale=24 ** -0.5, causal=True, lowprec="float16")
        check_spec("out", out[sq].astype(np.float32), ref, naive, "float16", reduction=24)
    qkv = rand(rng, (17, 3, 2, 24), np.float16)
    out = flashattn.flash_attn_varlen_qkvpacked_func(qkv, cu_q, 14)
    assert out.shape == (17, 2, 24)


def test_kvcache_appends_in_place(rng):
    q = rand(rng, (2, 1, 2, 32), np.float16)
    k_cache, v_cache = rand(rng, (2, 8, 1, 32), np.float16), rand(rng, (2, 8, 1, 32), np.float16)
    k_new, v_new = rand(rng, (2, 1, 1, 32), np.float16), rand(rng, (2, 1, 1, 32), np.float16)
    out, lse = flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=3,
                                                 return_softmax_lse=True)
    np.testing.assert_array_equal(k_cache[:, 3], k_new[:, 0])
    np.testing.assert_array_equal(v_cache[:, 3], v_new[:, 0])
    check_batch(q, k_cache[:, :4], v_cache[:, :4], out, lse, "float16", max_seqlen_k=8)


def test_dropout_reproducible_under_np_random_seed(rng):
    q, k, v = rand(rng, (1, 16, 2, 16), np.float16), rand(rng, (1, 16, 2, 16), np.float16), \
        rand(rng, (1, 16, 2, 16), np.float16)
    np.random.seed(3)
    a = flashattn.flash_attn_func(q, k, v, dropout_p=0.5)
    np.random.seed(3)
    b = flashattn.flash_attn_func(q, k, v, dropout_p=0.5)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, flashattn.flash_attn_func(q, k, v))


def test_errors_name_the_argument(rng):
    q = rand(rng, (1, 4, 2, 16), np.float16)
    with pytest.raises(ValueError, match="q: unsupported element type"):
        flashattn.flash_attn_func(q.astype(np.float64), q, q)
    with pytest.raises(ValueError, match="k: wrong shape"):
        flashattn.flash_attn_func(q, q[:, :, :1, :8], q)
    with pytest.raises(ValueError, match="dropout_p"):
        flashattn.flash_attn_func(q, q, q, dropout_p=1.0)
    with pytest.raises(ValueError, match="window_size"):
        flashattn.flash_attn_func(q, q, q, window_size=3)
    with pytest.raises(TypeError, match="q: expected a torch.Tensor or numpy.ndarray"):
        flashattn.flash_attn_func([1.0], q, q)
    assert issubclass(flashattn.Error, ValueError)
