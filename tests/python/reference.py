"""Test oracles written from SPEC §2–§3, independent of the library: the attention of one sequence
in NumPy (float64, and the "naive_lowprec" emulation of SPEC §7), the Philox dropout mask of
docs/dropout.md, rotary embedding, and the SPEC §7 accuracy check. NumPy only, so that the NumPy
tests run where PyTorch is not installed."""

from __future__ import annotations

import numpy as np

# Unit roundoff of each storage type (half an ulp of 1).
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}


# --- masks ---------------------------------------------------------------------------------------


def normalised_window(causal, window, max_seqlen_k):
    left, right = window
    if causal:
        right = 0
    if left >= max_seqlen_k:
        left = -1
    if right >= max_seqlen_k:
        right = -1
    return left, right


def visible(seqlen_q, seqlen_k, left, right):
    """(seqlen_q, seqlen_k) bool: key j visible to query i, diagonal at the bottom-right."""
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    r = i + seqlen_k - seqlen_q
    ok = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        ok &= j >= r - left
    if right >= 0:
        ok &= j <= r + right
    return ok


def alibi_distance(seqlen_q, seqlen_k):
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    return np.abs(i + seqlen_k - seqlen_q - j).astype(np.float64)


# --- Philox dropout mask (docs/dropout.md) -----------------------------------------------------

_MASK32 = np.uint64(0xFFFFFFFF)
_MUL = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_WEYL = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 on arrays of 32-bit values held in uint64."""
    for _ in range(10):
        p0 = _MUL[0] * c0
        p1 = _MUL[1] * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _MASK32,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _MASK32)
        k0 = (k0 + _WEYL[0]) & _MASK32
        k1 = (k1 + _WEYL[1]) & _MASK32
    return c0, c1, c2, c3


def keep_threshold(p):
    # In fp32, exactly as the library rounds it: ⌊(1 − p)·65536 + 0.5⌋.
    p32 = np.float32(p)
    return int(np.float32(np.float32(1.0) - p32) * np.float32(65536.0) + np.float32(0.5))


def dropout_keep(seed, offset, stream, seqlen_q, seqlen_k, p):
    """(seqlen_q, seqlen_k) bool keep mask of one (batch, head) whose stream index is `stream`
    (= batch·h + head)."""
    seed = int(seed) % 2**64
    sub = (int(offset) + int(stream)) % 2**64
    i = np.arange(seqlen_q, dtype=np.uint64)[:, None] + np.zeros((1, seqlen_k), dtype=np.uint64)
    j = np.arange(seqlen_k, dtype=np.uint64)[None, :] + np.zeros((seqlen_q, 1), dtype=np.uint64)
    lane = np.uint64(4) * (i & np.uint64(7)) + ((j & np.uint64(7)) >> np.uint64(1))
    c0 = np.uint64(32) * (j >> np.uint64(4)) + lane
    c1 = i >> np.uint64(4)
    c2 = np.full_like(c0, sub & 0xFFFFFFFF)
    c3 = np.full_like(c0, sub >> 32)
    k0 = np.full_like(c0, seed & 0xFFFFFFFF)
    k1 = np.full_like(c0, seed >> 32)
    words = philox4x32_10(c0, c1, c2, c3, k0, k1)
    e = (np.uint64(4) * ((j >> np.uint64(3)) & np.uint64(1)) + np.uint64(2) * ((i >> np.uint64(3)) & np.uint64(1))
         + (j & np.uint64(1)))
    word = np.choose((e >> np.uint64(1)).astype(np.int64), words)
    u = (word >> (np.uint64(16) * (e & np.uint64(1)))) & np.uint64(0xFFFF)
    return u < np.uint64(keep_threshold(p))


# --- rounding ------------------------------------------------------------------------------------


def bf16_round(x):
    """Round float32 values to bfloat16 (nearest, ties to even), returned as float32."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) & np.uint64(0xFFFF0000)
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(x), out, np.asarray(x, dtype=np.float32))


def rounder(dtype_name):
    """x -> x rounded to the storage type, kept in float32 (the naive_lowprec emulation)."""
    if dtype_name == "float16":
        return lambda x: np.asarray(x, np.float32).astype(np.float16).astype(np.float32)
    if dtype_name == "bfloat16":
        return bf16_round
    return lambda x: np.asarray(x, np.float32)


# --- attention of one sequence -------------------------------------------------------------------


def attend(q, k, v, *, scale, causal=False, window=(-1, -1), max_seqlen_k=None, softcap=0.0,
           slopes=None, keep=None, dropout_p=0.0, lowprec=None):
    """q (sq, h, d), k (sk, hk, d), v (sk, hk, dv) -> out (sq, h, dv), lse (h, sq).

    lowprec=None: float64 throughout (the oracle). lowprec="float16"/"bfloat16"/"float32": the
    naive framework computation, float32 math with every materialised intermediate rounded.
    keep: (h, sq, sk) bool dropout mask.
    """
    sq, h, _ = q.shape
    sk, hk, _ = k.shape
    max_seqlen_k = sk if max_seqlen_k is None else max_seqlen_k
    ftype = np.float64 if lowprec is None else np.float32
    rnd = (lambda x: x) if lowprec is None else rounder(lowprec)
    group = h // hk
    qf = q.astype(ftype)
    kf = np.repeat(k.astype(ftype), group, axis=1)
    vf = np.repeat(v.astype(ftype), group, axis=1)
    s = rnd(rnd(np.einsum("ihd,jhd->hij", qf, kf)) * ftype(scale))
    if softcap > 0:
        s = rnd(ftype(softcap) * np.tanh(s / ftype(softcap)))
    if slopes is not None:
        s = rnd(s - np.asarray(slopes, ftype)[:, None, None] * alibi_distance(sq, sk).astype(ftype))
    left, right = normalised_window(causal, window, max_seqlen_k)
    s = np.where(visible(sq, sk, left, right)[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if sk > 0 else np.zeros((h, sq, 1), ftype)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    denom = e.sum(axis=-1, keepdims=True)
    p = rnd(e / np.where(denom > 0, denom, 1))
    with np.errstate(divide="ignore"):
        lse = np.where(denom[..., 0] > 0, m[..., 0] + np.log(np.where(denom > 0, denom, 1))[..., 0], np.inf)
    if keep is not None:
        p = rnd(p * keep / ftype(1.0 - np.float32(dropout_p)))
    out = rnd(np.einsum("hij,jhd->ihd", p, vf))
    return out, lse


# --- rotary embedding ---------------------------------------------------------------------------


def rotate(x, cos, sin, interleaved):
    """x (s, h, d) rotated over its first rotary_dim = 2·cos.shape[1] dims; cos/sin (s, rd/2)."""
    x = x.astype(np.float64).copy()
    half = cos.shape[1]
    c = cos.astype(np.float64)[:, None, :]
    s = sin.astype(np.float64)[:, None, :]
    if interleaved:
        a, b = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2] = a * c - b * s
        x[..., 1:2 * half:2] = a * s + b * c
    else:
        a, b = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half] = a * c - b * s
        x[..., half:2 * half] = a * s + b * c
    return x


# --- SPEC §7 ------------------------------------------------------------------------------------


def check_spec(name, ours, ref, naive, dtype_name, factor=2.0, magnitude=0.0, reduction=1):
    """max|ours − ref| ≤ factor·max|naive − ref| + 2·rounding, with
    rounding = max(max|ref|, magnitude)·(u(dtype) + reduction·u(float32)):
    the storage rounding of SPEC §7 plus the fp32 accumulation over the longest reduction (the
    bench's rule; it matters only for float32 inputs, whose naive reference sums more accurately
    than a sequential fp32 accumulation). Infinities must match exactly and NaN never passes.
    `magnitude` bounds the terms of a result that can vanish exactly (dq and dk of a row with one
    visible key are sums of terms that cancel), so that the rounding term does not collapse."""
    ours = np.asarray(ours, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    naive = np.asarray(naive, dtype=np.float64)
    assert ours.shape == ref.shape, f"{name}: shape {ours.shape} != reference {ref.shape}"
    assert not np.isnan(ours).any(), f"{name}: NaN in the result"
    finite = np.isfinite(ref)
    assert np.array_equal(ours[~finite], ref[~finite]), f"{name}: infinities differ from the reference"
    if not finite.any():
        return
    err = np.max(np.abs(ours[finite] - ref[finite]))
    naive_err = np.max(np.abs(naive[finite] - ref[finite]))
    unit = UNIT_ROUNDOFF[dtype_name] + reduction * UNIT_ROUNDOFF["float32"]
    tol = factor * naive_err + 2.0 * max(np.max(np.abs(ref[finite])), magnitude) * unit
    assert err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g} (naive error {naive_err:.3g})"
