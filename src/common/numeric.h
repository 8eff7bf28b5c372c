// src/common/numeric.h — storage types f16/bf16 and their exact conversions to and from fp32,
// bit-level so the same code runs on the host (no _Float16 needed) and on the device.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/macros.h"

namespace flashattn::common {

struct f16_t {
  std::uint16_t bits;
};
struct bf16_t {
  std::uint16_t bits;
};
// float8 e4m3 ("e4m3fn"): sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinity, NaN is
// S.1111.111, the largest finite value 448 = 1.75 · 2^8, the smallest subnormal 2^-9.
struct e4m3_t {
  std::uint8_t bits;
};

FA_HOST_DEVICE std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
FA_HOST_DEVICE float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

FA_HOST_DEVICE float to_float(float x) { return x; }
FA_HOST_DEVICE float to_float(bf16_t x) { return bits_float(std::uint32_t(x.bits) << 16); }
FA_HOST_DEVICE float to_float(f16_t x) {
  const std::uint32_t sign = std::uint32_t(x.bits & 0x8000u) << 16;
  const std::uint32_t exp = (x.bits >> 10) & 0x1fu;
  std::uint32_t mant = x.bits & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_float(sign);
  // Subnormal: value = mant · 2^-24, exact in fp32.
  const float mag = float(mant) * 5.9604644775390625e-8f;
  return bits_float(sign | float_bits(mag));
}

FA_HOST_DEVICE float to_float(e4m3_t x) {
  const std::uint32_t sign = std::uint32_t(x.bits & 0x80u) << 24;
  const std::uint32_t exp = (x.bits >> 3) & 0xfu;
  const std::uint32_t mant = x.bits & 0x7u;
  if (exp == 0xf && mant == 0x7) return bits_float(sign | 0x7fc00000u);  // NaN
  if (exp != 0) return bits_float(sign | ((exp + 120u) << 23) | (mant << 20));
  return bits_float(sign | float_bits(float(mant) * 0.001953125f));  // subnormal: mant · 2^-9, exact
}

// |f| / unit rounded to an integer, nearest even, for the subnormal range of a narrower format
// (unit its smallest subnormal, a power of two: the scaling is exact).
FA_HOST_DEVICE std::uint32_t subnormal_steps(std::uint32_t abs_bits, float inv_unit) {
  const float scaled = bits_float(abs_bits) * inv_unit;
  std::uint32_t q = std::uint32_t(scaled);
  const float rem = scaled - float(q);
  if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;
  return q;
}

// fp32 → e4m3, round to nearest even, with subnormals; NaN, infinities and magnitudes that round
// past 448 give NaN (the format has no infinity), as PyTorch's conversion to float8_e4m3fn does.
FA_HOST_DEVICE e4m3_t to_e4m3(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint8_t sign = std::uint8_t((u >> 24) & 0x80u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x43e80000u) return e4m3_t{std::uint8_t(sign | 0x7fu)};  // > 464 (NaN and inf too)
  if (abs < 0x3c800000u) {
    // Below 2^-6: subnormal (or zero), in steps of 2^-9 (8 steps are 2^-6, the smallest normal).
    return e4m3_t{std::uint8_t(sign | subnormal_steps(abs, 512.0f))};
  }
  std::uint32_t r = abs + 0x7ffffu + ((abs >> 20) & 1u);  // round the mantissa to 3 bits
  r -= 120u << 23;                                         // rebias the exponent 127 → 7
  return e4m3_t{std::uint8_t(sign | (r >> 20))};
}

// fp32 → bf16, round to nearest even; NaN stays NaN.
FA_HOST_DEVICE bf16_t to_bf16(float f) {
  std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{std::uint16_t((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{std::uint16_t(u >> 16)};
}

// fp32 → fp16, round to nearest even, with subnormals, overflow to inf, NaN kept.
FA_HOST_DEVICE f16_t to_f16(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint16_t sign = std::uint16_t((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return f16_t{std::uint16_t(sign | 0x7e00u)};
  if (abs >= 0x477ff000u) return f16_t{std::uint16_t(sign | 0x7c00u)};  // rounds to ≥ 65520: inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero), in steps of 2^-24.
    return f16_t{std::uint16_t(sign | subnormal_steps(abs, 16777216.0f))};
  }
  std::uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u);  // round mantissa to 10 bits
  r -= 112u << 23;                                       // rebias exponent 127 → 15
  return f16_t{std::uint16_t(sign | (r >> 13))};
}

template <class T>
FA_HOST_DEVICE T from_float(float f);
template <>
FA_HOST_DEVICE float from_float<float>(float f) { return f; }
template <>
FA_HOST_DEVICE bf16_t from_float<bf16_t>(float f) { return to_bf16(f); }
template <>
FA_HOST_DEVICE f16_t from_float<f16_t>(float f) { return to_f16(f); }
template <>
FA_HOST_DEVICE e4m3_t from_float<e4m3_t>(float f) { return to_e4m3(f); }

// Round an fp32 value to T's precision and back (what storing then loading would give).
template <class T>
FA_HOST_DEVICE float round_to(float f) {
  return to_float(from_float<T>(f));
}

}  // namespace flashattn::common
