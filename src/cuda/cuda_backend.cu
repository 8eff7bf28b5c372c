// src/cuda/cuda_backend.cu — which CUDA kernel family serves a forward call, and the call itself.
#include "cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "common/mask.h"
#include "cuda/cuda_common.h"
#include "cuda/family.h"
#include "flashattn/error.h"

namespace flashattn::cuda {

SplitPartialsLayout split_partials_layout(const common::AttentionParams& p, int splits) {
  SplitPartialsLayout l;
  l.out_bytes = detail::workspace_align_up(std::size_t(splits) * std::size_t(p.batch) * std::size_t(p.max_seqlen_q) *
                                           std::size_t(p.heads) * std::size_t(p.head_dim_v) * sizeof(float));
  l.lse_bytes = detail::workspace_align_up(std::size_t(splits) * std::size_t(p.batch) * std::size_t(p.heads) *
                                           std::size_t(p.max_seqlen_q) * sizeof(float));
  return l;
}

SplitKvPartials carve_split_partials(const common::AttentionParams& p, int splits, void* workspace,
                                     std::size_t workspace_bytes) {
  SplitKvPartials partials;
  if (splits <= 1 || workspace == nullptr) return partials;
  const auto base = reinterpret_cast<std::uintptr_t>(workspace);
  const std::size_t skip = detail::workspace_align_up(base) - base;
  const SplitPartialsLayout layout = split_partials_layout(p, splits);
  if (workspace_bytes < skip || workspace_bytes - skip < layout.out_bytes + layout.lse_bytes) return partials;
  partials.out_partial = reinterpret_cast<float*>(base + skip);
  partials.lse_partial = reinterpret_cast<float*>(base + skip + layout.out_bytes);
  partials.num_splits = splits;
  return partials;
}

void combine_split_partials(const common::AttentionParams& p, float* out_partial, float* lse_partial, int splits,
                            cudaStream_t stream) {
  CombineParams c;
  c.splits = splits;
  c.batch = p.batch;
  c.heads = p.heads;
  c.max_seqlen_q = p.max_seqlen_q;
  c.head_dim_v = p.head_dim_v;
  c.out_partial = out_partial;
  c.out_partial_head_stride = p.head_dim_v;
  c.out_partial_row_stride = std::int64_t(p.heads) * c.out_partial_head_stride;
  c.out_partial_batch_stride = std::int64_t(p.max_seqlen_q) * c.out_partial_row_stride;
  c.out_partial_split_stride = std::int64_t(p.batch) * c.out_partial_batch_stride;
  c.lse_partial = lse_partial;
  c.lse_partial_head_stride = p.max_seqlen_q;
  c.lse_partial_batch_stride = std::int64_t(p.heads) * c.lse_partial_head_stride;
  c.lse_partial_split_stride = std::int64_t(p.batch) * c.lse_partial_batch_stride;
  c.out = p.out;
  c.out_storage = p.storage;
  c.lse = p.lse;
  c.lse_batch_stride = p.lse_batch_stride;
  c.lse_head_stride = p.lse_head_stride;
  c.cu_seqlens_q = p.cu_seqlens_q;
  c.sinks = p.sinks;
  c.index_error = p.index_error;
  c.after_primary = true;  // the split kernel just launched on `stream`
  combine(c, stream);
}

bool can_serve_forward(const common::AttentionParams& p, std::string* why_not) {
  const FamilyChoice choice = choose_forward_family(p);
  if (!choice.served && why_not) *why_not = choice.why_not;
  return choice.served;
}

int num_splits_heuristic(std::int64_t ctas, int n_blocks, int slots, int max_splits) {
  // A grid that fills this share of the slots is not split: the last wave gains little, and the
  // partials and the combine cost memory traffic.
  constexpr double kFullEnough = 0.8;
  // A split count whose efficiency is this close to the best is good enough.
  constexpr double kNearBest = 0.85;
  if (ctas <= 0 || slots <= 0 || n_blocks <= 1 || double(ctas) >= kFullEnough * slots) return 1;
  const int most = std::min({max_splits, slots, n_blocks});
  auto tiles_per_split = [&](int s) { return (n_blocks + s - 1) / s; };
  auto eligible = [&](int s) { return s == 1 || tiles_per_split(s) != tiles_per_split(s - 1); };
  auto efficiency = [&](int s) {
    const double waves = double(ctas) * s / slots;
    return waves / std::ceil(waves);
  };
  double best = 0.0;
  for (int s = 1; s <= most; ++s) {
    if (eligible(s)) best = std::max(best, efficiency(s));
  }
  for (int s = 1; s <= most; ++s) {
    if (eligible(s) && efficiency(s) >= kNearBest * best) return s;
  }
  return 1;
}

int widest_row_block_key_tiles(const common::AttentionParams& p, int block_m, int block_n, int pack) {
  const common::Mask mask = common::make_mask(p.causal, p.window_left, p.window_right, p.max_seqlen_k,
                                              p.max_seqlen_q, p.max_seqlen_k);
  auto tiles_of_rows = [&](int row_begin, int row_end) {
    const int lo = mask.block_col_begin(row_begin) / block_n;
    const int hi = (mask.block_col_end(row_end) + block_n - 1) / block_n;
    return std::max(hi - lo, 0);
  };
  const int m_blocks = (p.max_seqlen_q * pack + block_m - 1) / block_m;
  return std::max(tiles_of_rows(0, std::min((block_m + pack - 1) / pack, p.max_seqlen_q)),
                  tiles_of_rows((m_blocks - 1) * block_m / pack, p.max_seqlen_q));
}

int forward_num_splits(const common::AttentionParams& p) {
  const FamilyChoice choice = choose_forward_family(p);
  return choice.served ? family_num_splits(choice, p) : 1;
}

std::size_t forward_workspace_size(const common::AttentionParams& p) {
  return forward_workspace_size(choose_forward_family(p), p);
}

std::size_t forward_workspace_size(const FamilyChoice& choice, const common::AttentionParams& p) {
  const int splits = choice.served ? family_num_splits(choice, p) : 1;
  if (splits <= 1) return 0;
  const SplitPartialsLayout l = split_partials_layout(p, splits);
  return l.out_bytes + l.lse_bytes;
}

void forward(const common::AttentionParams& p, void* stream, const std::uint64_t* rng_state, void* workspace,
             std::size_t workspace_bytes) {
  forward(choose_forward_family(p), p, stream, rng_state, workspace, workspace_bytes);
}

void forward(const FamilyChoice& choice, const common::AttentionParams& p, void* stream,
             const std::uint64_t* rng_state, void* workspace, std::size_t workspace_bytes) {
  if (!choice.served) throw Error("flashattn::forward (CUDA): " + choice.why_not);
  if (p.batch == 0 || p.max_seqlen_q == 0) return;  // nothing to compute (SPEC §5 special cases)
  family_forward(choice, p, rng_state, workspace, workspace_bytes, static_cast<cudaStream_t>(stream));
}

std::string compiled_kernels() { return compiled_kernels_of_families(); }

}  // namespace flashattn::cuda
