// src/cuda/device/score_mod.cuh — softcap and ALiBi (src/common's ScoreMod) as the kernels of
// every family evaluate them on their score tiles: the same function in fewer instructions.
#pragma once

#include "common/score_mod.h"
#include "cuda/device/math.cuh"

namespace flashattn::cuda::device {

// common::ScoreMod (s = c·tanh(scale·dot / c) − slope·|i + sk − sq − j|) as the kernels of every
// family evaluate it on an accumulator tile, in "raw" units that the kernels' single exp2 multiplier
// (score_to_log2 = out_scale · log2 e) turns into log2 units — raw · out_scale is the natural-log
// score:
//   softcap on:  raw = tanh(k · dot) − slope' · dist    out_scale = c, k = scale / c
//   ALiBi only:  raw = mul · dot − slope' · dist        out_scale = scale, mul = 1 (scale folded
//                                                        into the exp2 multiplier; out_scale = 1,
//                                                        mul = scale for a scale too small to divide by)
//   neither:     raw = dot                               out_scale = scale (the plain path)
// with slope' = slope / out_scale. Per element: one MUFU.TANH and one FP op for the softcap, three
// FP ops for ALiBi. (The generic ScoreMod took an IEEE division, a precise tanhf and a 64-bit
// distance converted to float: a third of the plain forward's speed. tanh as 1 − 2 / (1 + e^{2y})
// took two MUFU operations, EX2 and RCP, beside the softmax's EX2 — the unit the forward waits on.)
// tanh.approx.f32 is within 2^-10.99 of tanh relatively, so the score c · tanh carries at most
// |s| · 2^-11: a quarter of the bf16 rounding of the score that SPEC §7's naive attention carries
// (|s| · 2^-9), whose bound is 3× with softcap. The distance is an int32 per row
// (i + sk − sq − col0: every term below 2^31) less a compile-time column offset per element, exact
// in float below 2^24.
struct TileScoreMod {
  bool softcap = false;
  bool alibi = false;
  float out_scale = 1.0f;
  float k = 1.0f;          // softcap on: the tanh argument per unit of dot product
  float mul = 1.0f;        // ALiBi without softcap: the factor on the dot product
  float slope = 0.0f;      // slope'
  int diag = 0;            // sk − sq

  __device__ __forceinline__ TileScoreMod(const common::ScoreMod<float>& m, bool enabled) {
    softcap = enabled && m.softcap > 0.0f;
    alibi = enabled && m.alibi_slope != 0.0f;
    const bool fold = fabsf(m.scale) >= 1e-20f;
    out_scale = softcap ? m.softcap : (alibi && !fold ? 1.0f : m.scale);
    k = softcap ? m.scale / m.softcap : 1.0f;
    mul = alibi && !softcap && !fold ? m.scale : 1.0f;
    slope = alibi ? m.alibi_slope / out_scale : 0.0f;
    diag = int(m.diag_offset);
  }
  __device__ __forceinline__ static float tanh(float y) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(y));
    return t;
  }
  // ALiBi against columns col0 + Δ: base = i + diag − col0, in float once per row, and then
  // raw = mul · x − slope' · |base − Δ| per element.
  __device__ __forceinline__ float alibi_base(int i, int col0) const { return float(i + diag - col0); }
  __device__ __forceinline__ float add_alibi(float x, float base, int delta) const {
    return fmaf(x, mul, -slope * fabsf(base - float(delta)));
  }
};

}  // namespace flashattn::cuda::device
