"""Invalid calls raise flashattn.Error naming the argument, and write nothing: an error that is both a
ValueError and a RuntimeError (flash_attn's checks raise RuntimeError), whether the C++ core or the
Python layer (ranks, head dims, softmax_scale, integer ranges) makes the check."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")

import flashattn  # noqa: E402


def t(*shape, dtype=torch.float16):
    return torch.randn(shape).to(dtype)


CASES = {
    "dtype": (lambda: flashattn.flash_attn_func(t(1, 4, 2, 16, dtype=torch.float64), t(1, 4, 2, 16), t(1, 4, 2, 16)),
              "q: unsupported element type"),
    "mixed_dtype": (lambda: flashattn.flash_attn_func(t(1, 4, 2, 16), t(1, 4, 2, 16, dtype=torch.bfloat16),
                                                      t(1, 4, 2, 16)), "k: must have q's dtype"),
    "k_shape": (lambda: flashattn.flash_attn_func(t(1, 4, 2, 16), t(2, 4, 2, 16), t(2, 4, 2, 16)), "k: wrong shape"),
    "v_shape": (lambda: flashattn.flash_attn_func(t(1, 4, 2, 16), t(1, 4, 2, 16), t(1, 5, 2, 16)), "v: wrong shape"),
    "heads": (lambda: flashattn.flash_attn_func(t(1, 4, 3, 16), t(1, 4, 2, 16), t(1, 4, 2, 16)),
              "k: number of heads"),
    "head_dim": (lambda: flashattn.flash_attn_func(t(1, 4, 2, 264), t(1, 4, 2, 264), t(1, 4, 2, 264)),
                 "q: head dimension"),
    "dropout_p": (lambda: flashattn.flash_attn_func(t(1, 4, 2, 16), t(1, 4, 2, 16), t(1, 4, 2, 16), 1.5),
                  "dropout_p"),
    "window": (lambda: flashattn.flash_attn_func(t(1, 4, 2, 16), t(1, 4, 2, 16), t(1, 4, 2, 16),
                                                 window_size=(-3, 0)), "window_left"),
    "softcap": (lambda: flashattn.flash_attn_func(t(1, 4, 2, 16), t(1, 4, 2, 16), t(1, 4, 2, 16), softcap=-1.0),
                "softcap"),
    "alibi_shape": (lambda: flashattn.flash_attn_func(t(1, 4, 2, 16), t(1, 4, 2, 16), t(1, 4, 2, 16),
                                                      alibi_slopes=torch.rand(3)), "alibi_slopes: wrong shape"),
    "alibi_dtype": (lambda: flashattn.flash_attn_func(t(1, 4, 2, 16), t(1, 4, 2, 16), t(1, 4, 2, 16),
                                                      alibi_slopes=torch.rand(2, dtype=torch.float16)),
                    "alibi_slopes"),
    "cu_seqlens_dtype": (lambda: flashattn.flash_attn_varlen_func(
        t(8, 2, 16), t(8, 2, 16), t(8, 2, 16), torch.tensor([0, 8]), torch.tensor([0, 8], dtype=torch.int32), 8, 8),
        "cu_seqlens_q"),
    "max_seqlen": (lambda: flashattn.flash_attn_varlen_func(
        t(8, 2, 16), t(8, 2, 16), t(8, 2, 16), torch.tensor([0, 8], dtype=torch.int32),
        torch.tensor([0, 8], dtype=torch.int32), 4, 8), "max_seqlen_q"),
    "qkv_shape": (lambda: flashattn.flash_attn_qkvpacked_func(t(1, 4, 2, 2, 16)), "qkv"),
    "cache_seqlens": (lambda: flashattn.flash_attn_with_kvcache(
        t(1, 1, 2, 16), t(1, 8, 2, 16), t(1, 8, 2, 16), cache_seqlens=torch.tensor([3])), "cache_seqlens"),
    "cache_overflow": (lambda: flashattn.flash_attn_with_kvcache(
        t(1, 1, 2, 16), t(1, 8, 2, 16), t(1, 8, 2, 16), t(1, 2, 2, 16), t(1, 2, 2, 16), cache_seqlens=7),
        "cache_seqlens"),
    "block_table": (lambda: flashattn.flash_attn_with_kvcache(
        t(1, 1, 2, 16), t(2, 4, 2, 16), t(2, 4, 2, 16), cache_seqlens=6,
        block_table=torch.tensor([[0, 5]], dtype=torch.int32)), "block_table"),
    "rotary_dim": (lambda: flashattn.flash_attn_with_kvcache(
        t(1, 1, 2, 16), t(1, 8, 2, 16), t(1, 8, 2, 16), t(1, 1, 2, 16), t(1, 1, 2, 16), t(9, 4), t(9, 4),
        cache_seqlens=1), "rotary_cos"),
    # Checks of the Python layer, made before anything is padded or passed to the core.
    "rank": (lambda: flashattn.flash_attn_func(t(4, 2, 16), t(1, 4, 2, 16), t(1, 4, 2, 16)),
             r"q: must be .* \(rank 4\)"),
    "varlen_rank": (lambda: flashattn.flash_attn_varlen_func(
        t(1, 8, 2, 16), t(8, 2, 16), t(8, 2, 16), torch.tensor([0, 8], dtype=torch.int32),
        torch.tensor([0, 8], dtype=torch.int32), 8, 8), r"q: must be .* \(rank 3\)"),
    "head_dim_zero": (lambda: flashattn.flash_attn_func(t(1, 4, 2, 0), t(1, 4, 2, 0), t(1, 4, 2, 0)),
                      r"q: head dimension .* in \[1, 256\]"),
    "softmax_scale_zero": (lambda: flashattn.flash_attn_func(t(1, 4, 2, 16), t(1, 4, 2, 16), t(1, 4, 2, 16),
                                                             softmax_scale=0.0), "softmax_scale: must be a finite"),
    "softmax_scale_nan": (lambda: flashattn.flash_attn_func(t(1, 4, 2, 16), t(1, 4, 2, 16), t(1, 4, 2, 16),
                                                            softmax_scale=float("nan")), "softmax_scale"),
    "window_int32": (lambda: flashattn.flash_attn_func(t(1, 4, 2, 16), t(1, 4, 2, 16), t(1, 4, 2, 16),
                                                       window_size=(2**31, 0)),
                     r"window_size\[0\]: must be an int in"),
    "max_seqlen_int32": (lambda: flashattn.flash_attn_varlen_func(
        t(8, 2, 16), t(8, 2, 16), t(8, 2, 16), torch.tensor([0, 8], dtype=torch.int32),
        torch.tensor([0, 8], dtype=torch.int32), 8, -2**40), "max_seqlen_k: must be an int in"),
    "kvcache_k_rank": (lambda: flashattn.flash_attn_with_kvcache(
        t(1, 1, 2, 16), t(1, 8, 2, 16), t(1, 8, 2, 16), t(1, 2, 16), t(1, 1, 2, 16), cache_seqlens=1),
        r"k: must be .* \(rank 4\)"),
    "numpy_rank": (lambda: flashattn.flash_attn_func(np.ones((4, 2, 16), np.float16),
                                                     *(np.ones((1, 4, 2, 16), np.float16),) * 2),
                   r"q: must be .* \(rank 4\)"),
    "numpy_softmax_scale": (lambda: flashattn.flash_attn_func(
        *(np.ones((1, 4, 2, 16), np.float16),) * 3, softmax_scale=-1.0), "softmax_scale: must be a finite"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_error_names_the_argument(case):
    """Caught as RuntimeError (flash_attn's callers) and as ValueError alike."""
    call, fragment = CASES[case]
    with pytest.raises(RuntimeError, match=fragment) as caught:
        call()
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, flashattn.Error)


def test_nothing_written_on_error():
    k_cache = t(1, 8, 2, 16)
    before = k_cache.clone()
    with pytest.raises(ValueError):
        flashattn.flash_attn_with_kvcache(t(1, 1, 2, 16), k_cache, k_cache.clone(), t(1, 2, 2, 16),
                                          t(1, 2, 2, 16), cache_seqlens=7)
    assert torch.equal(k_cache, before)


def test_non_tensor_argument():
    with pytest.raises(TypeError, match="k: expected a torch.Tensor"):
        flashattn.flash_attn_func(t(1, 4, 2, 16), None, t(1, 4, 2, 16))


def test_fp32_rejected_on_cuda():
    """fp32 runs on the CPU backends only; CUDA tensors of fp32 get a ValueError naming the rule."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU visible: a CUDA tensor cannot be made here")
    if "cuda" not in flashattn.compiled_backends():
        pytest.skip("this build has no CUDA backend (-DFLASHATTN_CUDA=ON)")
    q = torch.randn(1, 4, 2, 16, device="cuda")
    with pytest.raises(ValueError, match="fp16 and bf16"):
        flashattn.flash_attn_func(q, q, q)
