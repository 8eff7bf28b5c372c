// src/cuda/device/bwd_prepost.cuh — the backward's pre- and postprocess pieces of every kernel family:
// softmax_d = rowsum(dO ∘ O) in fp32, many rows per thread block, and dQ written through shared
// memory in 16-byte pieces.
#pragma once

#include <cute/config.hpp>
#include <vector_types.h>

#include <cstdint>
#include <cstring>

#include "common/params.h"

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

// The lanes per row of a head dim: 8 elements each, at most a warp, a power of two (d 96: 8 lanes,
// half of them taking a second step).
constexpr int row_dot_lanes(int head_dim) {
  int lanes = 1;
  while (lanes < 32 && 2 * lanes * 8 <= head_dim) lanes *= 2;
  return lanes;
}

// One thread's share of a preprocess block of kThreads threads over kRows rows of (batch, head)
// from row `block_row0`: groups of row_dot_lanes(kHeadDim) lanes take a row each, kPasses rows per
// thread, row(r) its r-th; dot[r] is that row's softmax_d (0 past seqlen_q). Every thread of the
// block constructs it (the sums are shuffles); the group's lane 0 (writer()) then stores.
template <class Element, int kHeadDim, int kThreads, int kRows>
struct SoftmaxDRows {
  static constexpr int kLanes = row_dot_lanes(kHeadDim);
  static constexpr int kRowsPerPass = kThreads / kLanes;
  static constexpr int kPasses = kRows / kRowsPerPass;
  static_assert(kPasses * kRowsPerPass == kRows, "the passes cover the block's rows");
  int first;
  int sub;
  float dot[kPasses];

  __device__ __forceinline__ SoftmaxDRows(const common::AttentionParams& p, int batch, int head, int block_row0,
                                          int seqlen_q)
      : first(block_row0 + int(threadIdx.x) / kLanes), sub(int(threadIdx.x) % kLanes) {
    const auto* dout = static_cast<const Element*>(p.dout.data);
    const auto* out = static_cast<const Element*>(p.out.data);
    const Element* do_rows[kPasses];
    const Element* o_rows[kPasses];
    CUTE_UNROLL
    for (int r = 0; r < kPasses; ++r) {
      const int i = row(r);
      do_rows[r] = i < seqlen_q ? dout + p.q_offset(p.dout, batch, i, head) : nullptr;
      o_rows[r] = i < seqlen_q ? out + p.q_offset(p.out, batch, i, head) : nullptr;
    }
    group_row_dots<Element, kLanes>(dot, do_rows, o_rows, p.head_dim_v, sub);
  }
  __device__ __forceinline__ int row(int r) const { return first + r * kRowsPerPass; }
  __device__ __forceinline__ bool writer() const { return sub == 0; }
};

// dQ of a row block through shared memory: the threads put their fragment's pairs of adjacent
// columns into a row-major tile (rows padded by 16 bytes: a warp's pairs, 8 rows × 4 columns, fall
// in distinct banks), then the block writes the rows below seqlen_q, columns below d, in 16-byte
// pieces (a fragment's own 32-bit stores use half of each 32-byte sector they touch); a
// transposed fragment (the sm90 80-row tile) puts single elements (put_one). The kernel declares the tile: __shared__ alignas(16) std::uint16_t tile[StagedDq<...>::kElems].
template <class Element, int kBlockM, int kHeadDim, int kThreads>
struct StagedDq {
  static constexpr int kPitch = kHeadDim + 8;   // elements per staged row
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte pieces per row
  static constexpr int kElems = kBlockM * kPitch;
  static_assert(sizeof(Element) == 2 && kBlockM * kChunks % kThreads == 0, "16-bit dQ, whole passes");
  std::uint16_t* tile;

  __device__ __forceinline__ void put(int row, int col, float a, float b) const {
    const Element pair[2] = {Element(a), Element(b)};
    std::memcpy(&tile[row * kPitch + col], pair, sizeof pair);
  }
  __device__ __forceinline__ void put_one(int row, int col, float a) const {
    const Element e(a);
    std::memcpy(&tile[row * kPitch + col], &e, sizeof e);
  }
  // After every put of the block.
  __device__ __forceinline__ void write(const common::AttentionParams& p, int batch, int head, int m_start,
                                        int seqlen_q) const {
    __syncthreads();
    auto* dq = static_cast<Element*>(p.dq.data);
    CUTE_UNROLL
    for (int pass = 0; pass < kBlockM * kChunks / kThreads; ++pass) {
      const int k = pass * kThreads + int(threadIdx.x);
      const int row = k / kChunks, col = k % kChunks * 8;
      if (m_start + row >= seqlen_q || col >= p.head_dim) continue;
      *reinterpret_cast<uint4*>(dq + p.q_offset(p.dq, batch, m_start + row, head) + col) =
          *reinterpret_cast<const uint4*>(&tile[row * kPitch + col]);
    }
  }
};

}  // namespace flashattn::cuda::device
