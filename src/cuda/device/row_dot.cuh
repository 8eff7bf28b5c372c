// src/cuda/device/row_dot.cuh — softmax_d = rowsum(dO ∘ O) in fp32, many rows per thread block: the
// backward preprocess of every kernel family.
#pragma once

#include <cute/config.hpp>
#include <vector_types.h>

#include <cstring>

namespace flashattn::cuda::device {

// The dot products of kRows pairs of rows per group of kLanes consecutive lanes (kLanes divides
// 32): lane `sub` of the group reads 8 consecutive elements (16 bytes) of each row per step (cols
// is a multiple of 8 and the rows 16-byte aligned: the layout checks of every family), and every
// load of a step is issued before its products, so that a warp has all its rows' loads in flight
// at once (one row per warp at a time left the loads latency-bound, and lanes idle where
// cols < 256). a_rows[r] == nullptr: row r is past the sequence, its dot is 0. Every lane of the
// warp must call this (the sums are shuffles over the group); each lane returns its group's dots.
template <class Element, int kLanes, int kRows>
__device__ __forceinline__ void group_row_dots(float (&dot)[kRows], const Element* const (&a_rows)[kRows],
                                               const Element* const (&b_rows)[kRows], int cols, int sub) {
  static_assert(kLanes >= 1 && kLanes <= 32 && 32 % kLanes == 0, "a group's lanes lie within a warp");
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) dot[r] = 0.0f;
  for (int col = sub * 8; col < cols; col += kLanes * 8) {
    uint4 a[kRows], b[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      a[r] = a_rows[r] != nullptr ? *reinterpret_cast<const uint4*>(a_rows[r] + col) : make_uint4(0, 0, 0, 0);
      b[r] = b_rows[r] != nullptr ? *reinterpret_cast<const uint4*>(b_rows[r] + col) : make_uint4(0, 0, 0, 0);
    }
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      Element x[8], y[8];
      std::memcpy(x, &a[r], sizeof x);
      std::memcpy(y, &b[r], sizeof y);
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) dot[r] = fmaf(float(x[e]), float(y[e]), dot[r]);
    }
  }
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    CUTE_UNROLL
    for (int m = kLanes / 2; m >= 1; m /= 2) dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], m);
  }
}

// The lanes per row of a head dim: 8 elements each, at most a warp.
constexpr int row_dot_lanes(int head_dim) { return head_dim / 8 < 32 ? head_dim / 8 : 32; }

}  // namespace flashattn::cuda::device
