// src/cuda/kvcache_append.cu — the KV-cache append and the q rotation on the device: one small
// kernel, one warp per head vector, the rotation itself from src/common/rotary.h.
#include "cuda/kvcache_append.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "common/numeric.h"
#include "common/rotary.h"
#include "cuda/cuda_common.h"
#include "cuda/index_check.cuh"
#include "flashattn/error.h"

namespace flashattn::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarpsPerBlock * kWarpSize;
// Enough blocks to fill any current GPU several times over; the grid-stride loop does the rest.
constexpr std::int64_t kMaxBlocks = 4096;

// One head vector as common::rotate sees it: read from src, written to dst (distinct memory).
template <class T>
struct HeadVector {
  const T* src;
  T* dst;
  __device__ float get(int i) const { return common::to_float(src[i]); }
  __device__ void set(int i, float v) const { dst[i] = common::from_float<T>(v); }
};

// The 32 lanes of a warp copy one head vector of `width` entries, the first rotary_dim rotated at
// `position` (rotary_dim 0: a plain copy). Lane l takes rotations l, l + 32, … and then entries
// rotary_dim + l, rotary_dim + l + 32, …, so neighbouring lanes touch neighbouring entries.
template <class T>
__device__ void copy_head_vector(const T* src, T* dst, int width, const common::AppendArgs& a, int rotary_dim,
                                 int position, int lane) {
  if (rotary_dim > 0) {
    const common::RotaryTableRow<T> cos{static_cast<const T*>(a.rotary_cos) + std::int64_t(position) * a.rotary_cos_stride};
    const common::RotaryTableRow<T> sin{static_cast<const T*>(a.rotary_sin) + std::int64_t(position) * a.rotary_sin_stride};
    HeadVector<T> x{src, dst};
    common::rotate(x, cos, sin, rotary_dim, a.rotary_interleaved, lane, kWarpSize);
  }
  for (int c = rotary_dim + lane; c < width; c += kWarpSize) dst[c] = src[c];
}

// Work items, one warp each: first the b · sk_new · hk new (k, v) head vectors, then (with
// q_rotated) the b · sq · h head vectors of q. Threads 0 … b − 1 of the grid also write the
// lengths after the append (with seqlens_after). Appending and rotating q touch disjoint memory,
// so the items need no order among themselves. With an active fold, every block first checks the
// call's index values itself (index_check.cuh).
template <class T>
__global__ void __launch_bounds__(kThreads)
    kvcache_append_kernel(const common::AttentionParams p, const common::AppendArgs a, bool q_positions_per_row,
                          std::int32_t* seqlens_after, T* q_rotated, const IndexFold fold) {
  // A bad cache_seqlens, cache_batch_idx, block_table or rotary table: nothing is written. The
  // fold's barrier first, by every thread of the block; the flag (set by this call's check kernel,
  // or by a fold's block) after it.
  if (fold.active() && !index_check_passes(fold)) return;
  if (p.index_check_failed()) return;
  const std::int64_t thread = std::int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const std::int64_t threads = std::int64_t(gridDim.x) * kThreads;
  if (seqlens_after != nullptr) {
    for (std::int64_t b = thread; b < p.batch; b += threads) seqlens_after[b] = a.cache_seqlens[b] + a.seqlen_new;
  }

  const int lane = threadIdx.x % kWarpSize;
  const std::int64_t kv_items = std::int64_t(p.batch) * a.seqlen_new * p.heads_k;
  const std::int64_t q_items = q_rotated != nullptr ? std::int64_t(p.batch) * p.max_seqlen_q * p.heads : 0;
  for (std::int64_t item = thread / kWarpSize; item < kv_items + q_items; item += threads / kWarpSize) {
    if (item < kv_items) {
      const int hk = int(item % p.heads_k);
      const int t = int(item / p.heads_k % a.seqlen_new);
      const int b = int(item / p.heads_k / a.seqlen_new);
      const int j = a.cache_seqlens[b] + t;  // cache row written, also the rotary position
      const T* k_src = static_cast<const T*>(a.k_new) + b * a.k_new_strides[0] + t * a.k_new_strides[1] +
                       hk * a.k_new_strides[2];
      const T* v_src = static_cast<const T*>(a.v_new) + b * a.v_new_strides[0] + t * a.v_new_strides[1] +
                       hk * a.v_new_strides[2];
      copy_head_vector(k_src, static_cast<T*>(p.k.data) + p.k_offset(p.k, b, j, hk), p.head_dim, a, a.rotary_dim,
                       j, lane);
      // Values are never rotated.
      copy_head_vector(v_src, static_cast<T*>(p.v.data) + p.k_offset(p.v, b, j, hk), p.head_dim_v, a, 0, j, lane);
    } else {
      const std::int64_t row = item - kv_items;  // row of the contiguous (b, sq, h, d) copy
      const int hh = int(row % p.heads);
      const int i = int(row / p.heads % p.max_seqlen_q);
      const int b = int(row / p.heads / p.max_seqlen_q);
      copy_head_vector(static_cast<const T*>(p.q.data) + p.q_offset(p.q, b, i, hh), q_rotated + row * p.head_dim,
                       p.head_dim, a, a.rotary_dim, common::rotary_q_position(a, b, i, q_positions_per_row), lane);
    }
  }
}

// The threads the kernel needs; 0: it does not run.
std::int64_t append_threads(const common::AttentionParams& p, const common::AppendArgs& a,
                            const std::int32_t* seqlens_after, const void* q_rotated) {
  const std::int64_t kv_items = std::int64_t(p.batch) * a.seqlen_new * p.heads_k;
  const std::int64_t q_items = q_rotated != nullptr ? std::int64_t(p.batch) * p.max_seqlen_q * p.heads : 0;
  return std::max((kv_items + q_items) * kWarpSize, seqlens_after != nullptr ? std::int64_t(p.batch) : 0);
}

// threads: append_threads of the call (> 0).
template <class T>
cudaError_t launch(const common::AttentionParams& p, const common::AppendArgs& a, bool q_positions_per_row,
                   std::int32_t* seqlens_after, void* q_rotated, const IndexFold& fold, std::int64_t threads,
                   cudaStream_t stream) {
  const int blocks = int(std::min((threads + kThreads - 1) / kThreads, kMaxBlocks));
  kvcache_append_kernel<T><<<blocks, kThreads, 0, stream>>>(p, a, q_positions_per_row, seqlens_after,
                                                            static_cast<T*>(q_rotated), fold);
  return cudaGetLastError();
}

}  // namespace

KvcacheWorkspace kvcache_workspace(std::int64_t batch, std::int64_t q_elements, std::size_t element_bytes,
                                   bool appends, bool rotary) {
  KvcacheWorkspace w;
  w.appends = appends;
  w.rotary = rotary;
  if (appends) {
    w.seqlens_after = w.bytes;
    w.bytes += detail::workspace_align_up(std::size_t(batch) * sizeof(std::int32_t));
  }
  if (rotary) {
    w.q_rotated = w.bytes;
    w.bytes += detail::workspace_align_up(std::size_t(q_elements) * element_bytes);
  }
  return w;
}

void kvcache_append(common::AttentionParams& p, const common::AppendArgs& a, bool q_positions_per_row,
                    const KvcacheWorkspace& region, void* workspace, void* stream, const common::IndexBounds& check,
                    bool forward_folds) {
  auto* base = static_cast<std::uint8_t*>(workspace);
  std::int32_t* seqlens_after = region.appends ? reinterpret_cast<std::int32_t*>(base + region.seqlens_after) : nullptr;
  void* q_rotated = region.rotary ? base + region.q_rotated : nullptr;
  const std::int64_t threads = append_threads(p, a, seqlens_after, q_rotated);
  const bool runs = threads > 0;
  IndexFold fold;
  if (check.any() && check.batch > 0) {
    if (runs && index_check_foldable(check)) {
      fold = fold_index_check(check);
    } else if (!runs && forward_folds && (index_check_foldable(check) || index_check_foldable_paged(check))) {
      p.index_fold = fold_index_check(check);
    } else {
      check_indices(check, stream);
    }
  }
  auto* s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaSuccess;
  if (runs) {
    switch (p.storage) {
      case common::Storage::f16:
        err = launch<common::f16_t>(p, a, q_positions_per_row, seqlens_after, q_rotated, fold, threads, s);
        break;
      case common::Storage::bf16:
        err = launch<common::bf16_t>(p, a, q_positions_per_row, seqlens_after, q_rotated, fold, threads, s);
        break;
      default: throw Error("flashattn::forward_kvcache (CUDA): the KV-cache append takes fp16 or bf16 only");
    }
  }
  if (err != cudaSuccess) {
    throw Error(std::string("flashattn::forward_kvcache (CUDA): append kernel launch failed: ") + cudaGetErrorString(err));
  }
  p.cache_seqlens = seqlens_after != nullptr ? seqlens_after : a.cache_seqlens;
  if (q_rotated != nullptr) p.q = common::contiguous_q(q_rotated, p);
}

}  // namespace flashattn::cuda
