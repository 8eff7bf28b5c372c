// src/cuda/device/row_dot.cuh — softmax_d of one row, rowsum(dO ∘ O) in fp32, by one warp: the
// backward preprocess of every kernel family.
#pragma once

#include <cute/config.hpp>
#include <vector_types.h>

namespace flashattn::cuda::device {

// The dot product of the first `cols` elements of two rows, summed over the 32 lanes of a warp
// (every lane returns it). Each lane reads 8 consecutive elements (16 bytes) per step: cols is a
// multiple of 8 and the rows are 16-byte aligned (the layout checks of every family).
template <class Element>
__device__ __forceinline__ float warp_row_dot(const Element* a_row, const Element* b_row, int cols, int lane) {
  float dot = 0.0f;
  for (int col = lane * 8; col < cols; col += 32 * 8) {
    Element a[8], b[8];
    *reinterpret_cast<uint4*>(a) = *reinterpret_cast<const uint4*>(a_row + col);
    *reinterpret_cast<uint4*>(b) = *reinterpret_cast<const uint4*>(b_row + col);
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) dot = fmaf(float(a[e]), float(b[e]), dot);
  }
  CUTE_UNROLL
  for (int m = 16; m >= 1; m /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, m);
  return dot;
}

}  // namespace flashattn::cuda::device
