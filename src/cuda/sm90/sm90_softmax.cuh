// src/cuda/sm90/sm90_softmax.cuh — the online softmax of the Hopper forward on wgmma accumulators:
// the (row, column) view of a fragment, per-row max and sum with quad shuffles, exp2 with the
// softmax scale folded into one FFMA, and the final normalisation and log-sum-exp.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "common/exp2_poly.h"
#include "cuda/device/math.cuh"

namespace flashattn::cuda::sm90 {

using namespace cute;

// A wgmma m64nN fp32 accumulator fragment is ((2, 2, N/8), MMA_M, MMA_N) per thread: (column
// pair, row + 8, 8-column group). As (rows, columns): rows (2, MMA_M), columns (2, N/8, MMA_N).
// A score row lives in the four threads of a quad.
template <class L>
__device__ __forceinline__ auto rowcol_layout(L acc) {
  static_assert(decltype(rank(acc))::value == 3 && decltype(rank<0>(acc))::value == 3,
                "expects a wgmma accumulator layout ((2,2,N/8), MMA_M, MMA_N)");
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

// The same fragment as the A operand of an RS wgmma over K = N: its k16 slices are pairs of
// 8-column groups, and a 16-bit A fragment of m64k16 is (column pair, row + 8, column + 8) —
// element for element the accumulator's order, so P feeds P·V without data movement.
template <class L>
__device__ __forceinline__ auto acc_as_a_operand_layout(L acc) {
  auto groups = logical_divide(get<0, 2>(acc), Tile<_2>{});  // ((2, N/16))
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0, 0>(groups)), get<1>(acc),
                     coalesce(make_layout(get<0, 1>(groups), get<2>(acc))));
}

// Element-wise conversion of an fp32 fragment into a 16-bit one of the same layout (packed
// cvt.rn.bf16x2 / f16x2 pairs).
template <class To, class SrcEngine, class SrcLayout, class DstEngine, class DstLayout>
__device__ __forceinline__ void convert_fragment(const Tensor<SrcEngine, SrcLayout>& src,
                                                 Tensor<DstEngine, DstLayout>& dst) {
  constexpr int kN = decltype(size(src))::value;
  static_assert(kN % 2 == 0, "converted in pairs");
  using Converter = cutlass::NumericArrayConverter<To, float, 2>;
  CUTE_UNROLL
  for (int i = 0; i < kN; i += 2) {
    cutlass::Array<float, 2> in;
    in[0] = src(i);
    in[1] = src(i + 1);
    const cutlass::Array<To, 2> out = Converter::convert(in);
    dst(i) = out[0];
    dst(i + 1) = out[1];
  }
}

// Row max and sum of kRows rows across a quad.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Lazy rescaling (kLazy; which kernels take it: fwd_lazy_rescale in sm90_fwd.h): a row keeps the
// maximum its exponentials are measured from until a key tile's maximum passes it by more than
// kLazyRescaleLog2 (scaled, log2 units), so that the probabilities of a later tile stay at most
// 2^kLazyRescaleLog2 = 256 (exact in the fp32 sums and O; P's 16-bit rounding is relative, the same
// at any magnitude), and O's rescale (dv / 2 multiplies per thread and step) is skipped by every
// warp whose rows all kept theirs. The same softmax: the row sum and O are relative to the same
// kept maximum, and lse adds it back.
inline constexpr float kLazyRescaleLog2 = 8.0f;

// Running max and sum of the rows one thread holds. Scores stay raw (q·k) until exp2, which
// takes x · (softmax_scale · log2 e) − max · (softmax_scale · log2 e) as one FFMA.
template <int kRows, bool kLazy = false>
struct OnlineSoftmax {
  float row_max[kRows];  // raw score units; −∞ until a row sees a visible key
  float row_sum[kRows];  // this thread's part of Σ exp, relative to row_max
  float scale_log2;      // softmax_scale · log2(e)

  __device__ __forceinline__ explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -device::kInf;
      row_sum[r] = 0.0f;
    }
  }

  // s: (rows, cols) view of one key tile's scores (masked ones −∞). Replaces them with
  // exp2(x·c − max·c) and returns in `correction` the factor by which what was accumulated
  // before this tile (O and the sums) shrinks: exp2((old max − new max) · c); 0 where the row had
  // seen nothing yet; exactly 1 where the row keeps its maximum (kLazy: the new one passes it by
  // at most kLazyRescaleLog2, scaled). kFirst: nothing was accumulated (correction unused).
  // kPolyCols: of every 8 columns of the thread's rows, the first kPolyCols take their exponential
  // from common::exp2_poly (FMA and integer pipes) instead of the MUFU (the softcap kernels, whose
  // tanh queues on the MUFU too: FLASHATTN_SM90_FWD_SOFTCAP_POLY_EXP).
  template <bool kFirst, int kPolyCols = 0, class S>
  __device__ __forceinline__ void step(S& s, float (&correction)[kRows]) {
    static_assert(decltype(size<0>(s))::value == kRows, "one running max per row");
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float tile_max = row_max[r];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) tile_max = fmaxf(tile_max, s(r, c));
      tile_max = quad_max(tile_max);
      // A row that has seen only masked keys keeps max −∞; exp2(−∞ − 0) = 0 then, never NaN.
      float max_scaled = tile_max == -device::kInf ? 0.0f : tile_max * scale_log2;
      if constexpr (!kFirst) {
        const float old_scaled = row_max[r] == -device::kInf ? -device::kInf : row_max[r] * scale_log2;
        // Kept: a finite old maximum that the new one passes by at most kLazyRescaleLog2 (false
        // for an old −∞, whose difference is +∞, and for NaN).
        const bool keep = kLazy && max_scaled - old_scaled <= kLazyRescaleLog2;
        if (keep) {
          max_scaled = old_scaled;
          tile_max = row_max[r];
          correction[r] = 1.0f;
        } else {
          correction[r] = device::exp2_ftz(old_scaled - max_scaled);
          row_sum[r] *= correction[r];
        }
      }
      row_max[r] = tile_max;
      float sum = 0.0f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        const float x = fmaf(s(r, c), scale_log2, -max_scaled);
        s(r, c) = c % 8 < kPolyCols ? common::exp2_poly(x) : device::exp2_ftz(x);
        sum += s(r, c);
      }
      row_sum[r] += sum;
    }
  }

  // step, with kPolyCols of every 8 columns on the FMA pipe where `poly` (warp-uniform: the
  // softcap kernels' call has softcap on) and every exponential on the MUFU otherwise.
  template <bool kFirst, int kPolyCols, class S>
  __device__ __forceinline__ void step_poly_if(bool poly, S& s, float (&correction)[kRows]) {
    if constexpr (kPolyCols > 0) {
      if (poly) {
        step<kFirst, kPolyCols>(s, correction);
      } else {
        step<kFirst>(s, correction);
      }
    } else {
      step<kFirst>(s, correction);
    }
  }

  // o: (rows, cols) view of the output accumulator; multiplies row r by correction[r]. With kLazy,
  // only where a row of the warp changed its maximum (a warp-uniform branch: the others'
  // corrections are exactly 1).
  template <class O>
  __device__ __forceinline__ static void rescale(O& o, const float (&correction)[kRows]) {
    if constexpr (kLazy) {
      bool changed = false;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) changed |= correction[r] != 1.0f;
      if (!__any_sync(0xffffffffu, changed)) return;
    }
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= correction[r];
    }
  }

  // Normalises o by the row sums (times out_scale: dropout's 1 / (1 − p)) and returns each row's
  // natural-log lse (+∞ and o = 0 for a row without a visible key, SPEC §2.5).
  template <class O>
  __device__ __forceinline__ void finalize(O& o, float (&lse)[kRows], float out_scale = 1.0f) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(row_sum[r]);
      // A NaN sum (a NaN score the row sees) is not empty: it stays NaN in o and lse.
      const bool empty = sum == 0.0f;
      // sum ≥ 1 (the row's max contributes exp2(0)): the MUFU reciprocal and log2 are exact
      // enough here.
      const float inv = empty ? 0.0f : __fdividef(out_scale, sum);
      lse[r] = empty ? device::kInf : (row_max[r] * scale_log2 + __log2f(sum)) * device::kLn2;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= inv;
    }
  }
};

}  // namespace flashattn::cuda::sm90
