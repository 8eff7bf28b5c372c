// src/cuda/split_kv.h — where the CTAs of a split-KV forward leave their partial results, in the
// layout the combine kernel (cuda/combine.h) and flashattn::combine take; shared by the kernel
// families that split.
#pragma once

#include <cstdint>

#include "common/params.h"

namespace flashattn::cuda {

// Where the CTAs of a split-KV launch leave their partial results (device memory, fp32), in the
// layout flashattn::combine takes: out_partial (splits, b, max_seqlen_q, h, dv) and lse_partial
// (splits, b, h, max_seqlen_q), both contiguous — also for varlen batches, whose sequence b uses
// rows [0, seqlen_q(b)) of batch entry b. Rows a split saw no key of get lse = +∞ (weight 0).
struct SplitKvPartials {
  float* out_partial = nullptr;
  float* lse_partial = nullptr;
  int num_splits = 1;

  // Offsets of (split, batch, row, head) in out_partial (then + column) and lse_partial.
  FA_HOST_DEVICE std::int64_t out_offset(const common::AttentionParams& p, int split, int b, int i, int hh) const {
    return (((std::int64_t(split) * p.batch + b) * p.max_seqlen_q + i) * p.heads + hh) * p.head_dim_v;
  }
  FA_HOST_DEVICE std::int64_t lse_offset(const common::AttentionParams& p, int split, int b, int hh, int i) const {
    return ((std::int64_t(split) * p.batch + b) * p.heads + hh) * p.max_seqlen_q + i;
  }
};

}  // namespace flashattn::cuda
