// src/common/exp2_poly.h — 2^x on the FMA and integer pipes instead of the special-function unit
// (MUFU): x = n + f with n = ⌊x⌋, 2^f by a cubic on [0, 1), 2^n put into the exponent bits. The
// sm90 forward's softcap kernels evaluate some of a tile's exponentials this way
// (FLASHATTN_SM90_FWD_SOFTCAP_POLY_EXP), where tanh and exp2 both queue on MUFU (16 results per
// clock per SM). Shared with the host so that tests/cpp/test_exp2_poly.cpp checks the very
// arithmetic the kernels run.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/macros.h"

namespace flashattn::common {

// p(f) = 1 + f·(c1 + f·(c2 + f·c3)) with c1 + c2 + c3 = 1 (p(0) = 1, p(1) = 2 up to rounding),
// fitted for the least maximum relative error to 2^f on [0, 1]: 1.03e-4 (2^-13.2), below the
// 16-bit rounding of P (2^-9 bf16, 2^-11 fp16) that every probability gets before P·V.
inline constexpr float kExp2PolyC1 = 0.69542435f;
inline constexpr float kExp2PolyC2 = 0.22630768f;
inline constexpr float kExp2PolyC3 = 0.07826797f;

// 2^x for x ≤ 127: results below 2^-126 (x < −126) are 0, as the MUFU's ex2.approx.ftz gives;
// −∞ gives 0 and NaN gives NaN. t = x + 1.5·2^23 rounded down holds ⌊x⌋ in its low mantissa bits
// (|x| < 2^22), so (bits(t) << 23) + bits(1.0f) is 2^⌊x⌋ — wrapping to +0.0 at ⌊x⌋ = −127.
FA_HOST_DEVICE float exp2_poly(float x) {
  constexpr float kMagic = 12582912.0f;  // 1.5 · 2^23
  x = x < -127.0f ? -127.0f : x;         // a comparison, so that NaN stays NaN
#if defined(__CUDA_ARCH__)
  const float t = __fadd_rd(x, kMagic);
  const std::uint32_t t_bits = __float_as_uint(t);
#else
  const float t = kMagic + std::floor(x);
  std::uint32_t t_bits;
  std::memcpy(&t_bits, &t, sizeof t_bits);
#endif
  const float f = x - (t - kMagic);  // in [0, 1)
  const float p = fmaf(fmaf(fmaf(kExp2PolyC3, f, kExp2PolyC2), f, kExp2PolyC1), f, 1.0f);
  const std::uint32_t scale_bits = (t_bits << 23) + 0x3f800000u;
#if defined(__CUDA_ARCH__)
  return p * __uint_as_float(scale_bits);
#else
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return p * scale;
#endif
}

}  // namespace flashattn::common
