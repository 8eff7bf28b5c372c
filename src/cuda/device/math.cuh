// src/cuda/device/math.cuh — numerics shared by every CUDA kernel family: the constants of the
// exp2/log2 formulation of the softmax and the MUFU exponential.
#pragma once

namespace flashattn::cuda::device {

constexpr float kLog2e = 1.4426950408889634f;  // exp(x) = exp2(x · log2(e))
constexpr float kLn2 = 0.6931471805599453f;    // log(x) = log2(x) · ln(2)
constexpr float kInf = __builtin_huge_valf();

// 2^x on the MUFU unit, flushing results below 2^-126 to zero. exp2f would add a range check and
// two multiplies around every MUFU.EX2 to keep denormal results — probabilities that small are
// below fp16/bf16 resolution of any row sum, so the plain instruction is exact enough.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace flashattn::cuda::device
