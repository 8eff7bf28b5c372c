"""Bad arguments and bad index values, with guard memory (issue: "never outside the caller's
buffers").

Every bad Python argument raises ValueError or TypeError whose message starts with the argument's
name (never an unpacking error, a ZeroDivisionError or the binding's signature dump). KV caches
sit inside poisoned guard zones: a refused call changes no byte of the buffer, and a valid call
made after every refusal, in the same process, is right and leaves the guards alone. NaN in the
inputs propagates as in the float64 reference, and the rows of a varlen batch that no sequence
covers get zero outputs and gradients.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")

import flashattn  # noqa: E402
from reference import attend  # noqa: E402

F = flashattn.flash_attn_func
VARLEN = flashattn.flash_attn_varlen_func
KV = flashattn.flash_attn_with_kvcache


def t(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype)


def qkv(b=1, s=8, h=2, d=16):
    return t(b, s, h, d), t(b, s, h, d), t(b, s, h, d)


def packed(total=10, h=2, d=16):
    return t(total, h, d), t(total, h, d), t(total, h, d)


CU = torch.tensor([0, 4, 10], dtype=torch.int32)
BIG = 2**40


def kv_args():
    """q (2, 1, 2, 16) and a (2, 32, 2, 16) cache pair."""
    return t(2, 1, 2, 16), t(2, 32, 2, 16), t(2, 32, 2, 16)


# (call, exception type, the argument the message must start with)
BAD_ARGUMENTS = {
    "q_rank3": (lambda: F(t(8, 2, 16), *qkv()[1:]), ValueError, "q"),
    "k_rank5": (lambda: F(qkv()[0], t(1, 1, 8, 2, 16), qkv()[2]), ValueError, "k"),
    "head_dim_0": (lambda: F(t(1, 8, 2, 0), t(1, 8, 2, 0), t(1, 8, 2, 0)), ValueError, "q"),
    "v_head_dim_300": (lambda: F(*qkv()[:2], t(1, 8, 2, 300)), ValueError, "v"),
    "q_list": (lambda: F([[1.0]], *qkv()[1:]), TypeError, "q"),
    "alibi_list": (lambda: F(*qkv(), alibi_slopes=[0.5, 0.25]), TypeError, "alibi_slopes"),
    "softmax_scale_0": (lambda: F(*qkv(), softmax_scale=0.0), ValueError, "softmax_scale"),
    "softmax_scale_negative": (lambda: F(*qkv(), softmax_scale=-0.1), ValueError, "softmax_scale"),
    "softmax_scale_nan": (lambda: F(*qkv(), softmax_scale=math.nan), ValueError, "softmax_scale"),
    "softmax_scale_inf": (lambda: F(*qkv(), softmax_scale=math.inf), ValueError, "softmax_scale"),
    "softmax_scale_str": (lambda: F(*qkv(), softmax_scale="0.1"), TypeError, "softmax_scale"),
    "softcap_tiny": (lambda: F(*qkv(), softcap=1e-40), ValueError, "flashattn::forward: options.softcap"),
    "softcap_str": (lambda: F(*qkv(), softcap="big"), TypeError, "softcap"),
    "dropout_str": (lambda: F(*qkv(), dropout_p="x"), TypeError, "dropout_p"),
    "window_2_pow_40": (lambda: F(*qkv(), window_size=(BIG, 0)), ValueError, "window_size[0]"),
    "window_float": (lambda: F(*qkv(), window_size=(0, 1.5)), TypeError, "window_size[1]"),
    "window_triple": (lambda: F(*qkv(), window_size=(1, 2, 3)), ValueError, "window_size"),
    "varlen_q_rank4": (lambda: VARLEN(*qkv(), CU, CU, 6, 6), ValueError, "q"),
    "varlen_head_dim_0": (lambda: VARLEN(t(10, 2, 0), t(10, 2, 0), t(10, 2, 0), CU, CU, 6, 6), ValueError, "q"),
    "varlen_cu_list": (lambda: VARLEN(*packed(), [0, 4, 10], CU, 6, 6), TypeError, "cu_seqlens_q"),
    "varlen_max_seqlen_2_pow_40": (lambda: VARLEN(*packed(), CU, CU, BIG, 6), ValueError, "max_seqlen_q"),
    "varlen_max_seqlen_float": (lambda: VARLEN(*packed(), CU, CU, 6, 6.5), TypeError, "max_seqlen_k"),
    "kv_q_rank3": (lambda: KV(t(2, 2, 16), *kv_args()[1:], cache_seqlens=3), ValueError, "q"),
    "kv_cache_seqlens_list": (lambda: KV(*kv_args(), cache_seqlens=[3, 4]), TypeError, "cache_seqlens"),
    "kv_cache_seqlens_2_pow_40": (lambda: KV(*kv_args(), cache_seqlens=BIG), ValueError, "cache_seqlens"),
    "kv_cache_seqlens_float": (lambda: KV(*kv_args(), cache_seqlens=3.0), TypeError, "cache_seqlens"),
    "kv_block_table_list": (lambda: KV(*kv_args(), cache_seqlens=3, block_table=[[0], [1]]), TypeError,
                            "block_table"),
    "kv_batch_idx_list": (lambda: KV(*kv_args(), cache_seqlens=3, cache_batch_idx=[0, 1]), TypeError,
                          "cache_batch_idx"),
    "kv_new_k_list": (lambda: KV(*kv_args(), [1.0], [1.0], cache_seqlens=3), TypeError, "k"),
    "kv_rotary_list": (lambda: KV(*kv_args(), rotary_cos=[1.0], rotary_sin=[1.0], cache_seqlens=3), TypeError,
                       "rotary_cos"),
    "kv_num_splits_2_pow_40": (lambda: KV(*kv_args(), cache_seqlens=3, num_splits=BIG), ValueError, "num_splits"),
    "kv_window_2_pow_40": (lambda: KV(*kv_args(), cache_seqlens=3, window_size=(-1, BIG)), ValueError,
                           "window_size[1]"),
    "kv_softmax_scale_0": (lambda: KV(*kv_args(), cache_seqlens=3, softmax_scale=0), ValueError, "softmax_scale"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_argument_message_names_it(case):
    call, error, name = BAD_ARGUMENTS[case]
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error or isinstance(info.value, flashattn.Error), type(info.value)
    assert str(info.value).startswith(name + ":"), str(info.value)


def np16(*shape):
    return np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)


NUMPY_BAD_ARGUMENTS = {
    "q_rank3": (lambda: F(np16(8, 2, 16), np16(1, 8, 2, 16), np16(1, 8, 2, 16)), ValueError, "q"),
    "head_dim_0": (lambda: F(np16(1, 8, 2, 0), np16(1, 8, 2, 0), np16(1, 8, 2, 0)), ValueError, "q"),
    "softmax_scale_0": (lambda: F(np16(1, 8, 2, 16), np16(1, 8, 2, 16), np16(1, 8, 2, 16), softmax_scale=0.0),
                        ValueError, "softmax_scale"),
    "window_2_pow_40": (lambda: F(np16(1, 8, 2, 16), np16(1, 8, 2, 16), np16(1, 8, 2, 16), window_size=(BIG, 0)),
                        ValueError, "window_size[0]"),
    "alibi_list": (lambda: F(np16(1, 8, 2, 16), np16(1, 8, 2, 16), np16(1, 8, 2, 16), alibi_slopes=[1.0, 1.0]),
                   TypeError, "alibi_slopes"),
    "varlen_max_seqlen_2_pow_40": (lambda: VARLEN(np16(10, 2, 16), np16(10, 2, 16), np16(10, 2, 16), CU.numpy(),
                                                  CU.numpy(), BIG, 6), ValueError, "max_seqlen_q"),
    "kv_cache_seqlens_list": (lambda: KV(np16(2, 1, 2, 16), np16(2, 32, 2, 16), np16(2, 32, 2, 16),
                                         cache_seqlens=[3, 4]), TypeError, "cache_seqlens"),
    "kv_cache_seqlens_2_pow_40": (lambda: KV(np16(2, 1, 2, 16), np16(2, 32, 2, 16), np16(2, 32, 2, 16),
                                             cache_seqlens=BIG), ValueError, "cache_seqlens"),
}


@pytest.mark.parametrize("case", list(NUMPY_BAD_ARGUMENTS))
def test_bad_numpy_argument_message_names_it(case):
    call, error, name = NUMPY_BAD_ARGUMENTS[case]
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(name + ":"), str(info.value)


# --- guard memory around the KV cache ---------------------------------------------------------

GUARD = 64  # poisoned elements before and after each cache


class GuardedCache:
    """A (b, capacity, hk, d) float32 cache in the middle of a NaN-poisoned buffer."""

    def __init__(self, shape, seed):
        n = math.prod(shape)
        self.buffer = torch.full((GUARD + n + GUARD,), math.nan, dtype=torch.float32)
        self.cache = self.buffer[GUARD:GUARD + n].view(shape)
        self.cache.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))

    def bits(self):
        return self.buffer.view(torch.int32).clone()

    def guards_poisoned(self):
        return bool(torch.isnan(self.buffer[:GUARD]).all() and torch.isnan(self.buffer[-GUARD:]).all())


B, CAP, H, D, NEW = 2, 16, 2, 16, 2


def kv_fault_cases():
    lens = torch.tensor([3, 5], dtype=torch.int32)
    rows = torch.tensor([1, 0], dtype=torch.int32)
    cos, sin = t(20, D // 2), t(20, D // 2)
    return {
        "negative_cache_seqlens": (dict(cache_seqlens=torch.tensor([-1, 5], dtype=torch.int32)), "cache_seqlens"),
        "append_past_capacity": (dict(cache_seqlens=torch.tensor([3, CAP - 1], dtype=torch.int32)), "cache_seqlens"),
        "cache_seqlens_int_max": (dict(cache_seqlens=torch.tensor([3, 2**31 - 1], dtype=torch.int32)),
                                  "cache_seqlens"),
        "batch_idx_past_rows": (dict(cache_seqlens=lens, cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)),
                                "cache_batch_idx"),
        "negative_batch_idx": (dict(cache_seqlens=lens, cache_batch_idx=torch.tensor([-1, 0], dtype=torch.int32)),
                               "cache_batch_idx"),
        "rotary_too_short": (dict(cache_seqlens=lens, cache_batch_idx=rows, rotary_cos=cos[:6], rotary_sin=sin[:6]),
                             "rotary_cos"),
        "cache_seqlens_int64": (dict(cache_seqlens=lens.long()), "cache_seqlens"),
    }


@pytest.mark.parametrize("case", list(kv_fault_cases()))
def test_kvcache_bad_index_values_leave_every_byte_and_the_next_call_is_right(case):
    kwargs, name = kv_fault_cases()[case]
    kc, vc = GuardedCache((B, CAP, H, D), 1), GuardedCache((B, CAP, H, D), 2)
    q, k_new, v_new = t(B, 1, H, D), t(B, NEW, H, D), t(B, NEW, H, D)
    before = (kc.bits(), vc.bits())
    with pytest.raises(ValueError) as info:
        KV(q, kc.cache, vc.cache, k_new, v_new, **kwargs)
    assert name + ":" in str(info.value), str(info.value)
    assert torch.equal(kc.bits(), before[0]) and torch.equal(vc.bits(), before[1])

    # A valid call in the same process: the new keys land at cache_seqlens, out is the reference's.
    lens = [3, 5]
    k_ref, v_ref = kc.cache.clone(), vc.cache.clone()
    out = KV(q, kc.cache, vc.cache, k_new, v_new, cache_seqlens=torch.tensor(lens, dtype=torch.int32))
    assert kc.guards_poisoned() and vc.guards_poisoned()
    for b, n in enumerate(lens):
        k_ref[b, n:n + NEW], v_ref[b, n:n + NEW] = k_new[b], v_new[b]
        assert torch.equal(kc.cache[b, :n + NEW], k_ref[b, :n + NEW])
        ref, _ = attend(q[b].numpy(), k_ref[b, :n + NEW].numpy(), v_ref[b, :n + NEW].numpy(), scale=D**-0.5)
        np.testing.assert_allclose(out[b].numpy(), ref, atol=1e-5)


def test_paged_bad_block_table_leaves_every_byte():
    pages, page = 5, 8
    kc, vc = GuardedCache((pages, page, H, D), 3), GuardedCache((pages, page, H, D), 4)
    before = (kc.bits(), vc.bits())
    for table in ([[0, 5], [1, 2]], [[0, 1], [-1, 2]]):
        with pytest.raises(ValueError, match="block_table:"):
            KV(t(B, 1, H, D), kc.cache, vc.cache, t(B, NEW, H, D), t(B, NEW, H, D),
               cache_seqlens=torch.tensor([7, 6], dtype=torch.int32),
               block_table=torch.tensor(table, dtype=torch.int32))
        assert torch.equal(kc.bits(), before[0]) and torch.equal(vc.bits(), before[1])


# --- NaN, uncovered rows, tiny softcaps --------------------------------------------------------


def test_nan_in_q_or_visible_k_propagates_and_a_masked_one_does_not():
    q, k, v = qkv(s=70)
    q[0, 5, 0, 3] = math.nan
    k[0, 66, 1, 3] = math.nan
    out, lse, _ = F(q, k, v, causal=True, return_attn_probs=True)
    nan_rows_h0 = torch.isnan(out[0, :, 0]).any(-1).nonzero().flatten().tolist()
    nan_rows_h1 = torch.isnan(out[0, :, 1]).any(-1).nonzero().flatten().tolist()
    assert nan_rows_h0 == [5]
    assert nan_rows_h1 == list(range(66, 70))  # key 66 is masked for the queries before it
    assert torch.isnan(lse[0, 0, 5]) and torch.isfinite(lse[0, 0, :5]).all()


def test_rows_no_sequence_covers_get_zero_outputs_and_gradients():
    q, k, v = (x.requires_grad_() for x in packed(total=14))
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 11], dtype=torch.int32)
    out, lse, _ = VARLEN(q, k, v, cu_q, cu_k, 5, 6, causal=True, return_attn_probs=True)
    assert torch.equal(out[9:], torch.zeros_like(out[9:]))
    assert torch.isinf(lse[:, 9:]).all() and torch.isfinite(lse[:, :9]).all()
    out.sum().backward()
    assert torch.equal(q.grad[9:], torch.zeros_like(q.grad[9:]))
    assert torch.equal(k.grad[11:], torch.zeros_like(k.grad[11:]))
    assert torch.equal(v.grad[11:], torch.zeros_like(v.grad[11:]))
    assert torch.isfinite(q.grad).all() and q.grad[:9].abs().sum() > 0


def test_tiny_softcap_gives_the_mean_of_the_visible_values():
    q, k, v = qkv(s=40)
    out = F(q, k, v, softcap=1e-30)
    torch.testing.assert_close(out, v.mean(dim=1, keepdim=True).expand_as(out), atol=1e-5, rtol=0)


def test_device_index_check_controls():
    """The synchronous device-side index check is an option (off by default), and
    check_index_errors() returns quietly when no call recorded a violation (docs/errors.md)."""
    assert flashattn._C.Options().check_indices is False
    opt = flashattn._C.Options()
    opt.check_indices = True
    assert opt.check_indices is True
    assert flashattn.check_index_errors() is None


VARLEN_FAULTS = {
    "decreasing_cu_seqlens_q": ([0, 7, 4], [0, 4, 10], 10, 10, "varlen.cu_seqlens_q"),
    "cu_seqlens_k_past_tokens": ([0, 4, 10], [0, 4, 11], 10, 11, "varlen.cu_seqlens_k"),
    "max_seqlen_q_below_a_sequence": ([0, 4, 10], [0, 4, 10], 5, 6, "varlen.max_seqlen_q"),
}


@pytest.mark.parametrize("case", list(VARLEN_FAULTS))
def test_varlen_bad_index_values_then_a_valid_call_is_right(case):
    cu_q, cu_k, max_q, max_k, name = VARLEN_FAULTS[case]
    q, k, v = packed(total=10)
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match=f": {name}: "):
        VARLEN(q, k, v, as_i32(cu_q), as_i32(cu_k), max_q, max_k)
    cu = as_i32([0, 4, 10])
    out = VARLEN(q, k, v, cu, cu, 6, 6, causal=True)
    for a, b in ((0, 4), (4, 10)):
        ref, _ = attend(q[a:b].numpy(), k[a:b].numpy(), v[a:b].numpy(), scale=16**-0.5, causal=True)
        np.testing.assert_allclose(out[a:b].numpy(), ref, atol=1e-5)
