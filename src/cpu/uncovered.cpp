// src/cpu/uncovered.cpp — the rows of a varlen batch that no sequence covers. cu_seqlens may end
// before the packed tensors do (the reference API allows it; those tokens are ignored): their
// outputs are still defined, as those of tokens that attend to nothing and are seen by no query —
// out = 0 and lse = +∞ (a row without visible keys, SPEC §2.5), and zero gradients (dq, dk, dv,
// softmax_d).
#include <algorithm>
#include <cstdint>
#include <limits>

#include "common/numeric.h"
#include "cpu/cpu.h"
#include "cpu/storage_dispatch.h"

namespace flashattn::cpu {
namespace {

// Zeroes rows [row_begin, row_end) of every head of a packed (total, heads, dim) tensor.
template <class T>
void zero_rows(const common::RowHeadTensor& t, std::int64_t row_begin, std::int64_t row_end, int heads, int dim) {
  auto* data = static_cast<T*>(t.data);
  const T zero = common::from_float<T>(0.0f);
  for (std::int64_t r = row_begin; r < row_end; ++r) {
    for (int h = 0; h < heads; ++h) {
      T* row = data + r * t.row_stride + std::int64_t(h) * t.head_stride;
      std::fill(row, row + dim, zero);
    }
  }
}

// Sets entries [row_begin, row_end) of every head of an lse-like (heads, total) array.
void fill_row_stats(float* stats, std::int64_t head_stride, std::int64_t row_begin, std::int64_t row_end, int heads,
                    float value) {
  if (stats == nullptr) return;
  for (int h = 0; h < heads; ++h) {
    std::fill(stats + std::int64_t(h) * head_stride + row_begin, stats + std::int64_t(h) * head_stride + row_end, value);
  }
}

}  // namespace

void fill_uncovered_rows(const common::AttentionParams& p, std::int64_t total_q, std::int64_t total_k, bool backward) {
  if (!p.is_varlen()) return;
  const std::int64_t q_end = p.cu_seqlens_q[p.batch];
  with_storage(p.storage, [&](auto tag) {
    using T = decltype(tag);
    if (!backward) {
      zero_rows<T>(p.out, q_end, total_q, p.heads, p.head_dim_v);
      fill_row_stats(p.lse, p.lse_head_stride, q_end, total_q, p.heads, std::numeric_limits<float>::infinity());
      return;
    }
    // (Only the backward reads cu_seqlens_k: a paged forward may have none.)
    const std::int64_t k_end = p.cu_seqlens_k[p.batch];
    zero_rows<T>(p.dq, q_end, total_q, p.heads, p.head_dim);
    fill_row_stats(p.softmax_d, p.lse_head_stride, q_end, total_q, p.heads, 0.0f);
    zero_rows<T>(p.dk, k_end, total_k, p.heads_k, p.head_dim);
    zero_rows<T>(p.dv, k_end, total_k, p.heads_k, p.head_dim_v);
  });
}

}  // namespace flashattn::cpu
