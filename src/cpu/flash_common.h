// src/cpu/flash_common.h — helpers shared by the CPU flash forward (flash_fwd.cpp) and backward
// (flash_bwd.cpp): aligned fp32 scratch, row loads and stores with dtype conversion, rounding to
// the storage precision, a vector exp2, the dropout keep tile, and the query rows that see a key
// block. Semantics (mask, score, dropout bits, conversions) come from src/common/; this file only
// arranges them for tiles.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "common/mask.h"
#include "common/numeric.h"
#include "common/params.h"
#include "common/philox.h"
#include "cpu/tile_gemm.h"

namespace flashattn::cpu::flash {

inline constexpr float kLog2e = 1.44269504088896340736f;  // log2(e): exp(x) = exp2(x · log2 e)
inline constexpr float kLn2 = 0.69314718055994530942f;    // ln(2) = 1 / log2(e)
inline constexpr float kInfinity = __builtin_inff();
inline constexpr int kScratchAlign = 64;  // bytes: one cache line, one VecF

inline constexpr int round_up(int x, int multiple) {
  return (x + multiple - 1) / multiple * multiple;
}
inline constexpr int ceil_div(int x, int y) { return (x + y - 1) / y; }

// The forward's matmul FLOPs without the mask: 2·h·sq·sk·(d + dv) summed over the batch (what
// the thread count is sized by).
inline double attention_flops(const common::AttentionParams& p) {
  double flops = 0.0;
  for (int b = 0; b < p.batch; ++b) {
    flops += 2.0 * p.heads * double(p.seqlen_q(b)) * double(p.seqlen_k(b)) * double(p.head_dim + p.head_dim_v);
  }
  return flops;
}

// A cache-line aligned fp32 array, zero-filled at allocation unless asked not to be.
class FloatBuffer {
 public:
  struct Uninitialized {};

  FloatBuffer() = default;
  FloatBuffer(std::size_t count, Uninitialized)
      : data_(
            static_cast<float*>(::operator new[](bytes(count), std::align_val_t(kScratchAlign)))) {}
  explicit FloatBuffer(std::size_t count) : FloatBuffer(count, Uninitialized{}) {
    std::fill(data_.get(), data_.get() + count, 0.0f);
  }
  float* get() const { return data_.get(); }

 private:
  static std::size_t bytes(std::size_t count) {
    const std::size_t b = count * sizeof(float);
    return b == 0 ? kScratchAlign : (b + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
  }
  struct Free {
    void operator()(float* p) const { ::operator delete[](p, std::align_val_t(kScratchAlign)); }
  };
  std::unique_ptr<float, Free> data_;
};

// --- dtype conversion of rows --------------------------------------------------------------------

#if defined(__AVX512F__)
// The masked-zero forms of the conversion intrinsics, with every lane on, are the plain
// instructions; GCC 12's unmasked forms trip -Wmaybe-uninitialized inside its own headers.
inline constexpr __mmask16 kAllLanes = 0xFFFF;
#endif

// dst[e] = to_float(src[e]) for e < n.
template <class T>
inline void load_row(const T* src, int n, float* dst) {
  for (int e = 0; e < n; ++e) dst[e] = common::to_float(src[e]);
}
// fp16 → fp32 is exact, so the F16C instruction gives exactly common::to_float's values; GCC does
// not vectorise the branchy bit-level version, and this load sits in the inner tile loop.
template <>
inline void load_row<common::f16_t>(const common::f16_t* src, int n, float* dst) {
  int e = 0;
#if defined(__AVX512F__)
  for (; e + 16 <= n; e += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + e));
    _mm512_storeu_ps(dst + e, _mm512_maskz_cvtph_ps(kAllLanes, h));
  }
#elif defined(__F16C__)
  for (; e + 8 <= n; e += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e));
    _mm256_storeu_ps(dst + e, _mm256_cvtph_ps(h));
  }
#endif
  for (; e < n; ++e) dst[e] = common::to_float(src[e]);
}

// dst[e] = from_float<T>(src[e] · scale) for e < n.
template <class T>
inline void store_row(const float* src, float scale, int n, T* dst) {
  for (int e = 0; e < n; ++e) dst[e] = common::from_float<T>(src[e] * scale);
}
#if defined(__AVX512F__) || defined(__F16C__)
// vcvtps2ph with round-to-nearest-even is IEEE fp32 → fp16 conversion (subnormals, overflow to
// inf), the function common::to_f16 computes bit by bit.
inline constexpr int kF16RoundNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
template <>
inline void store_row<common::f16_t>(const float* src, float scale, int n, common::f16_t* dst) {
  int e = 0;
#if defined(__AVX512F__)
  for (; e + 16 <= n; e += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(src + e), _mm512_set1_ps(scale));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + e),
                        _mm512_maskz_cvtps_ph(kAllLanes, x, kF16RoundNearest));
  }
#else
  for (; e + 8 <= n; e += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(src + e), _mm256_set1_ps(scale));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + e), _mm256_cvtps_ph(x, kF16RoundNearest));
  }
#endif
  for (; e < n; ++e) dst[e] = common::from_float<common::f16_t>(src[e] * scale);
}
#endif

// x[e] = round_to<T>(x[e]) for e < n: what storing to T and loading back gives.
template <class T>
inline void round_row(float* x, int n) {
  for (int e = 0; e < n; ++e) x[e] = common::round_to<T>(x[e]);
}
template <>
inline void round_row<float>(float*, int) {}
#if defined(__AVX512F__) || defined(__F16C__)
template <>
inline void round_row<common::f16_t>(float* x, int n) {
  int e = 0;
#if defined(__AVX512F__)
  for (; e + 16 <= n; e += 16) {
    const __m512 v = _mm512_loadu_ps(x + e);
    _mm512_storeu_ps(x + e, _mm512_maskz_cvtph_ps(
                                kAllLanes, _mm512_maskz_cvtps_ph(kAllLanes, v, kF16RoundNearest)));
  }
#else
  for (; e + 8 <= n; e += 8) {
    _mm256_storeu_ps(x + e, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + e), kF16RoundNearest)));
  }
#endif
  for (; e < n; ++e) x[e] = common::round_to<common::f16_t>(x[e]);
}
#endif

// --- vector math ---------------------------------------------------------------------------------

typedef std::int32_t VecI __attribute__((vector_size(kVecWidth * sizeof(std::int32_t))));

inline VecF max_vec(VecF a, VecF b) { return a > b ? a : b; }

// x, materialised as an fp32 value: keeps the compiler from fusing the product that made x into
// a following add (FMA contraction) where the product's rounding is part of the algorithm.
inline VecF rounded(VecF x) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+v"(x));  // x stays in its vector register (a VecF is one register wide)
#elif defined(__aarch64__)
  __asm__("" : "+w"(x));
#else
  __asm__("" : "+m"(x));
#endif
  return x;
}

// 2^x, elementwise, with relative error ≈ 1 ulp. Results below 2^-64 flush to 0, including
// x = −∞, which is how masked scores become probability 0. The attention callers' arguments are
// ≤ 0 up to rounding (score − row max, or score − lse): a probability below 2^-64 of the row's
// largest (or of its sum) is below fp32 resolution of any sum it joins, and flushing it keeps the
// backward's products (P · dP, dS · K, dSᵀ · Q) out of the subnormal range, where x86 FMAs take
// microcode assists — with ALiBi's distant keys the backward ran 35% slower. Arguments above 127
// clamp to 2^127 (tanh_vec relies on that).
inline VecF exp2_vec(VecF x) {
  constexpr float kMinExponent = -64.0f;
  constexpr float kMaxExponent = 127.0f;
  // Adding 1.5 · 2^23 pushes the fraction bits out of the mantissa: (x + magic) − magic is x
  // rounded to the nearest integer, for |x| < 2^22.
  constexpr float kRoundMagic = 12582912.0f;
  // Taylor coefficients ln(2)^k / k! of 2^f; for |f| ≤ 1/2 the degree-7 truncation error is
  // below 1e-8, under fp32's own rounding.
  constexpr float kC1 = 6.9314718055994531e-1f, kC2 = 2.4022650695910071e-1f;
  constexpr float kC3 = 5.5504108664821580e-2f, kC4 = 9.6181291076284772e-3f;
  constexpr float kC5 = 1.3333558146428443e-3f, kC6 = 1.5403530393381609e-4f;
  constexpr float kC7 = 1.5252733804059841e-5f;
  constexpr int kMantissaBits = 23;
  // Clamped on both sides: a finite x far below −64 (a sink far above the scores makes the
  // backward's s − lse about −290) would shift n out of the int range (undefined behaviour); the
  // final select gives those lanes 0 anyway.
  const VecF low_clamped = x < kMinExponent ? splat(kMinExponent) : x;
  const VecF clamped = x > kMaxExponent ? splat(kMaxExponent) : low_clamped;
  const VecF n = (clamped + kRoundMagic) - kRoundMagic;
  const VecF f = clamped - n;  // in [−1/2, 1/2]
  VecF poly = splat(kC7);
  poly = poly * f + kC6;
  poly = poly * f + kC5;
  poly = poly * f + kC4;
  poly = poly * f + kC3;
  poly = poly * f + kC2;
  poly = poly * f + kC1;
  poly = poly * f + 1.0f;
  // Multiply by 2^n by adding n to the exponent field; n ≥ −126 keeps the result normal.
  const VecI scaled = VecI(poly) + (__builtin_convertvector(n, VecI) << kMantissaBits);
  const VecF result = VecF(scaled);
  return x < kMinExponent ? VecF{} : result;
}

// tanh(x), elementwise, within ~2 ulp: below |x| = 0.625 the odd polynomial x + x·z·P(z), z = x²
// (P of degree 4, fitted here to tanh(x)/x on [0, 0.625]: 0.83 ulp in fp32 Horner form); above,
// 1 − 2 / (1 + 2^(2|x| log2 e)) with the sign of x, where no cancellation is left (tanh ≥ 0.55).
// Large |x| saturate to ±1 (exp2_vec clamps its argument); NaN stays NaN.
inline VecF tanh_vec(VecF x) {
  constexpr float kSmall = 0.625f;
  constexpr float kP0 = -0.33333292603492737f, kP1 = 0.13331712782382965f, kP2 = -0.053762901574373245f;
  constexpr float kP3 = 0.020716270431876183f, kP4 = -0.005792558658868074f;
  constexpr float kTwoLog2e = 2.8853900817779268f;
  const VecF ax = x < 0.0f ? -x : x;
  const VecF z = x * x;
  VecF poly = splat(kP4);
  poly = poly * z + kP3;
  poly = poly * z + kP2;
  poly = poly * z + kP1;
  poly = poly * z + kP0;
  const VecF small = x + x * z * poly;
  const VecF large_abs = 1.0f - 2.0f / (1.0f + exp2_vec(ax * kTwoLog2e));
  const VecF large = x < 0.0f ? -large_abs : large_abs;
  return ax < kSmall ? small : (x != x ? x : large);
}

// common::ScoreMod over one vector of scores, in vector form: s = c·tanh(scale·dot / c) −
// slope·|i + sk − sq − j|, the division by c as a product with 1/c. The distance is taken in fp32
// from `base` = i + sk − sq and the key index j (exact below 2^24, as the scalar form's conversion
// of the distance to fp32 is). slope and base are per lane: the forward's lanes are queries of
// different heads and rows, the backward's are keys of one row.
struct VecScoreMod {
  float scale = 1.0f, softcap = 0.0f, inv_softcap = 0.0f;
  bool alibi = false;
  explicit VecScoreMod(const common::ScoreMod<float>& m, bool any_alibi)
      : scale(m.scale), softcap(m.softcap), inv_softcap(m.softcap > 0 ? 1.0f / m.softcap : 0.0f),
        alibi(any_alibi) {}
  // The score of lanes with dot products `dot`, ALiBi slopes `slope`, i + sk − sq `base`, keys j.
  VecF apply(VecF dot, VecF slope, VecF base, VecF j) const {
    VecF s = dot * scale;
    if (softcap > 0) s = tanh_vec(s * inv_softcap) * softcap;
    if (alibi) s -= alibi_term(slope, base, j);
    return s;
  }
  // slope · |i + sk − sq − j|
  static VecF alibi_term(VecF slope, VecF base, VecF j) {
    const VecF dist = base - j;
    return slope * (dist < 0.0f ? -dist : dist);
  }
};

// --- masks ---------------------------------------------------------------------------------------

// Query rows [lo, hi) that see at least one key of [j0, j1). Both row bounds col_begin(i) and
// col_end(i) grow with i, so "sees a key ≥ j0" (col_end(i) > j0) holds from some row on and
// "sees a key < j1" (col_begin(i) < j1) up to some row: two binary searches.
inline std::pair<int, int> rows_seeing_keys(const common::Mask& m, int j0, int j1) {
  int lo = 0, hi = m.seqlen_q;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (m.col_end(mid) > j0)
      hi = mid;
    else
      lo = mid + 1;
  }
  const int first = lo;
  hi = m.seqlen_q;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (m.col_begin(mid) >= j1)
      hi = mid;
    else
      lo = mid + 1;
  }
  return {first, lo};
}

// --- dropout -------------------------------------------------------------------------------------

inline constexpr int kDropoutBlock = 16;  // the 16×16 block of the counter layout (common/philox.h)
inline constexpr int kDropoutLanes = 32;  // lanes per block, 8 elements each
// One block row or column as one vector of 16 lanes, whatever the VecF width: the two-register
// permute below picks from the block's 32 lane words.
typedef std::int32_t DropoutVecI __attribute__((vector_size(kDropoutBlock * sizeof(std::int32_t))));
typedef float DropoutVecF __attribute__((vector_size(kDropoutBlock * sizeof(float))));

// Where each element of a 16×16 block finds its keep bit: the lane and the bit within the lane's
// 8, from common::dropout_lane / dropout_element, arranged so that one block row (fixed i, the 16
// keys) or one block column (fixed j, the 16 queries) is one vector of lane / bit indices.
struct DropoutBlockTable {
  DropoutVecI lane_of_row[kDropoutBlock], bit_of_row[kDropoutBlock];  // [i mod 16], over j mod 16
  DropoutVecI lane_of_col[kDropoutBlock], bit_of_col[kDropoutBlock];  // [j mod 16], over i mod 16

  DropoutBlockTable() {
    for (int a = 0; a < kDropoutBlock; ++a) {
      for (int b = 0; b < kDropoutBlock; ++b) {
        lane_of_row[a][b] = common::dropout_lane(a, b);
        bit_of_row[a][b] = common::dropout_element(a, b);
        lane_of_col[a][b] = common::dropout_lane(b, a);
        bit_of_col[a][b] = common::dropout_element(b, a);
      }
    }
  }
};

inline const DropoutBlockTable& dropout_block_table() {
  static const DropoutBlockTable table;
  return table;
}

// keep(i, j) ∈ {0, 1} for queries [i0, i0 + rows) × keys [j0, j0 + cols) of one (batch, head),
// written to keep[(i − i0) · stride_i + (j − j0) · stride_j]. One Philox call serves the 8
// elements of one lane of a 16×16 block (common/philox.h), so the bits are drawn per block. A
// whole block with unit stride along j (or i) is expanded 16 elements at a time: a two-register
// permute picks each element's lane word, a variable shift its bit.
inline void dropout_keep_tile(const common::DropoutParams& dp, std::uint64_t stream, int i0,
                              int rows, int j0, int cols, float* keep, int stride_i, int stride_j) {
  constexpr int kB = kDropoutBlock;
  const DropoutBlockTable& table = dropout_block_table();
  const DropoutVecI one = DropoutVecI{} + 1;
  const auto store_block_row = [](float* dst, DropoutVecF x) { std::memcpy(dst, &x, sizeof x); };
  for (int bi = i0 / kB; bi * kB < i0 + rows; ++bi) {
    for (int bj = j0 / kB; bj * kB < j0 + cols; ++bj) {
      alignas(kScratchAlign) std::uint32_t bits[kDropoutLanes];
      for (int lane = 0; lane < kDropoutLanes; ++lane) {
        bits[lane] = common::dropout_keep_bits(dp, stream, bi, bj, lane);
      }
      const int i_lo = std::max(i0, bi * kB), i_hi = std::min(i0 + rows, (bi + 1) * kB);
      const int j_lo = std::max(j0, bj * kB), j_hi = std::min(j0 + cols, (bj + 1) * kB);
      const bool whole = i_hi - i_lo == kB && j_hi - j_lo == kB;
      float* corner =
          keep + std::int64_t(i_lo - i0) * stride_i + std::int64_t(j_lo - j0) * stride_j;
      DropoutVecI lanes_lo, lanes_hi;  // the Philox words of lanes 0..15 and 16..31
      std::memcpy(&lanes_lo, bits, sizeof lanes_lo);
      std::memcpy(&lanes_hi, bits + kDropoutBlock, sizeof lanes_hi);
      if (whole && stride_j == 1) {
        for (int a = 0; a < kB; ++a) {
          const DropoutVecI word = __builtin_shuffle(lanes_lo, lanes_hi, table.lane_of_row[a]);
          store_block_row(corner + std::int64_t(a) * stride_i,
                          __builtin_convertvector((word >> table.bit_of_row[a]) & one, DropoutVecF));
        }
      } else if (whole && stride_i == 1) {
        for (int b = 0; b < kB; ++b) {
          const DropoutVecI word = __builtin_shuffle(lanes_lo, lanes_hi, table.lane_of_col[b]);
          store_block_row(corner + std::int64_t(b) * stride_j,
                          __builtin_convertvector((word >> table.bit_of_col[b]) & one, DropoutVecF));
        }
      } else {
        for (int i = i_lo; i < i_hi; ++i) {
          for (int j = j_lo; j < j_hi; ++j) {
            const std::uint32_t bit =
                (bits[common::dropout_lane(i, j)] >> common::dropout_element(i, j)) & 1u;
            keep[std::int64_t(i - i0) * stride_i + std::int64_t(j - j0) * stride_j] = float(bit);
          }
        }
      }
    }
  }
}

// Whether the score is the plain scaled dot product, s = scale · dot with scale > 0, as
// common::ScoreMod computes it without softcap and ALiBi. Then the kernels keep raw dot products
// in their tiles and fold the scale into the exp2 argument (the row max of the dots is the row max
// of the scores); otherwise they call the ScoreMod on every element.
inline bool is_plain_scale(const common::ScoreMod<float>& mod) {
  return !(mod.softcap > 0) && mod.alibi_slope == 0 && mod.scale > 0;
}

}  // namespace flashattn::cpu::flash
