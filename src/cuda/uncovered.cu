// src/cuda/uncovered.cu — see uncovered.h.
#include "cuda/uncovered.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "common/numeric.h"
#include "flashattn/error.h"

namespace flashattn::cuda {
namespace {

constexpr int kThreads = 256;
// The rows past cu_seqlens[b] are few or none: a small grid that strides over them.
constexpr std::int64_t kMaxBlocks = 128;

// Every element (row_begin ≤ row r < total, head h, column c) of a packed (total, heads, dim)
// tensor, spread over the grid.
template <class T>
__device__ void zero_rows(const common::RowHeadTensor& t, std::int64_t row_begin, std::int64_t total, int heads,
                          int dim) {
  const std::int64_t elements = (total - row_begin) * heads * dim;
  const T zero = common::from_float<T>(0.0f);
  for (std::int64_t e = std::int64_t(blockIdx.x) * kThreads + threadIdx.x; e < elements;
       e += std::int64_t(gridDim.x) * kThreads) {
    const std::int64_t r = row_begin + e / (std::int64_t(heads) * dim);
    const int h = int(e / dim % heads), c = int(e % dim);
    static_cast<T*>(t.data)[r * t.row_stride + std::int64_t(h) * t.head_stride + c] = zero;
  }
}

__device__ void fill_stats(float* stats, std::int64_t head_stride, std::int64_t row_begin, std::int64_t total,
                           int heads, float value) {
  if (stats == nullptr) return;
  const std::int64_t elements = (total - row_begin) * heads;
  for (std::int64_t e = std::int64_t(blockIdx.x) * kThreads + threadIdx.x; e < elements;
       e += std::int64_t(gridDim.x) * kThreads) {
    stats[(e % heads) * head_stride + row_begin + e / heads] = value;
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    uncovered_rows_kernel(const common::AttentionParams p, std::int64_t total_q, std::int64_t total_k, bool backward) {
  if (p.index_check_failed()) return;  // cu_seqlens failed the index check: they are not used
  const std::int64_t q_end = p.cu_seqlens_q[p.batch];
  if (!backward) {
    zero_rows<T>(p.out, q_end, total_q, p.heads, p.head_dim_v);
    fill_stats(p.lse, p.lse_head_stride, q_end, total_q, p.heads, __int_as_float(0x7f800000));  // +∞
    return;
  }
  // (Only the backward reads cu_seqlens_k: a paged forward may have none.)
  const std::int64_t k_end = p.cu_seqlens_k[p.batch];
  zero_rows<T>(p.dq, q_end, total_q, p.heads, p.head_dim);
  fill_stats(p.softmax_d, p.lse_head_stride, q_end, total_q, p.heads, 0.0f);
  zero_rows<T>(p.dk, k_end, total_k, p.heads_k, p.head_dim);
  zero_rows<T>(p.dv, k_end, total_k, p.heads_k, p.head_dim_v);
  if (p.seqused_k == nullptr) return;
  // Keys of sequence b past seqused_k[b] are no sequence's keys either: zero gradients.
  for (int b = 0; b < p.batch; ++b) {
    const std::int64_t end = p.cu_seqlens_k[b + 1];
    const std::int64_t begin = std::min<std::int64_t>(end, p.cu_seqlens_k[b] + std::int64_t(p.seqused_k[b]));
    zero_rows<T>(p.dk, begin, end, p.heads_k, p.head_dim);
    zero_rows<T>(p.dv, begin, end, p.heads_k, p.head_dim_v);
  }
}

}  // namespace

void fill_uncovered_rows(const common::AttentionParams& p, std::int64_t total_q, std::int64_t total_k, bool backward,
                         void* stream) {
  if (!p.is_varlen() || p.batch == 0) return;
  const std::int64_t rows = std::max(total_q * p.heads, total_k * p.heads_k);
  const int blocks = int(std::clamp<std::int64_t>((rows + kThreads - 1) / kThreads, 1, kMaxBlocks));
  auto* s = static_cast<cudaStream_t>(stream);
  switch (p.storage) {
    case common::Storage::f16: uncovered_rows_kernel<common::f16_t><<<blocks, kThreads, 0, s>>>(p, total_q, total_k, backward); break;
    case common::Storage::bf16: uncovered_rows_kernel<common::bf16_t><<<blocks, kThreads, 0, s>>>(p, total_q, total_k, backward); break;
    case common::Storage::f32: uncovered_rows_kernel<float><<<blocks, kThreads, 0, s>>>(p, total_q, total_k, backward); break;
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw Error(std::string("flashattn (CUDA): launch of the uncovered-rows kernel failed: ") + cudaGetErrorString(err));
  }
}

}  // namespace flashattn::cuda
