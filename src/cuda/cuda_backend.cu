// src/cuda/cuda_backend.cu — which CUDA kernel serves a call, and the call itself.
#include "cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "cuda/cuda_common.h"
#include "cuda/device_query.h"
#include "cuda/family.h"
#include "cuda/sm90/sm90_registry.h"
#include "cuda/sm80/sm80_fwd.h"
#include "cuda/sm80/sm80_registry.h"
#include "cuda/sm80/sm80_smem.h"
#include "flashattn/error.h"

namespace flashattn::cuda {
namespace {

int fwd_head_dim(const common::AttentionParams& p) { return detail::head_dim_for(sm80::Family::fwd, p); }

// --- split-KV ----------------------------------------------------------------------------------

// A forward CTA of 4 warps may hold up to 255 registers per thread: 128 · 255 ≈ half of the 64K
// register file, so two fit an SM; the 8-warp tile (d 256) takes it all.
constexpr int kRegisterFileSize = 65536;
constexpr int kMaxRegistersPerThread = 256;
constexpr int kWarpSize = 32;

}  // namespace

namespace sm80 {
namespace {
std::atomic<int> smem_cap{0};  // set_smem_limit_for_testing; 0 = none
}  // namespace

int smem_per_block_limit() {
  constexpr int kUnknown = 1 << 30;
  const int asked = current_device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  const int bytes = asked > 0 ? asked : kUnknown;
  const int cap = smem_cap.load(std::memory_order_relaxed);
  return cap > 0 && cap < bytes ? cap : bytes;
}

void set_smem_limit_for_testing(int bytes) { smem_cap.store(bytes > 0 ? bytes : 0, std::memory_order_relaxed); }

}  // namespace sm80

namespace {

// Bytes of the out and lse partials of `splits` splits, each region aligned.
std::size_t out_partial_bytes(const common::AttentionParams& p, int splits) {
  return detail::workspace_align_up(std::size_t(splits) * std::size_t(p.batch) * std::size_t(p.max_seqlen_q) *
                                    std::size_t(p.heads) * std::size_t(p.head_dim_v) * sizeof(float));
}
std::size_t lse_partial_bytes(const common::AttentionParams& p, int splits) {
  return detail::workspace_align_up(std::size_t(splits) * std::size_t(p.batch) * std::size_t(p.heads) *
                                    std::size_t(p.max_seqlen_q) * sizeof(float));
}

}  // namespace

std::string sm80_forward_refusal(const common::AttentionParams& p, int* head_dim) {
  // A key tile's page-table entries are staged in shared memory, kBlockN / 16 + 1 of them.
  if (p.is_paged() && p.page_size % 16 != 0) {
    return "paged K/V: the CUDA kernels take page sizes that are multiples of 16 rows";
  }
  std::string why;
  if (!detail::can_serve_common(p, sm80::Family::fwd, {{"q", &p.q}, {"k", &p.k}, {"v", &p.v}, {"out", &p.out}},
                                 &why)) {
    return why;
  }
  // The smallest tile (the full variant's) must fit a block's shared memory on this device.
  *head_dim = fwd_head_dim(p);
  if (!detail::smem_fits("forward", *head_dim, sm80::fwd_smem_bytes(*head_dim, sm80::fwd_tile(*head_dim, true)),
                         &why)) {
    return why;
  }
  return "";
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

int forward_num_splits(const common::AttentionParams& p) {
  if (p.num_splits > 0) return std::min(p.num_splits, kMaxSplits);
  const int head_dim = fwd_head_dim(p);
  if (head_dim == 0 || p.batch <= 0 || p.heads <= 0 || p.max_seqlen_q <= 0 || p.max_seqlen_k <= 0) return 1;
  const bool full = sm80::fwd_runs_full(p, head_dim, sm80::smem_per_block_limit());
  const sm80::FwdTile plain_tile = sm80::fwd_tile(head_dim, full);
  // Packed GQA (sm80::fwd_pack): a row block holds (query row, head) pairs of one kv head, in the
  // packed kernel's tile.
  const int pack = full ? 1 : sm80::fwd_pack(p, plain_tile.block_m);
  // The short-sequence tile runs unsplit (its CTAs are many and short already).
  if (!full && pack == 1 && sm80::fwd_runs_short(p, head_dim)) return 1;
  const sm80::FwdTile tile = pack > 1 ? sm80::fwd_tile_packed(head_dim) : plain_tile;
  const int m_blocks = (p.max_seqlen_q * pack + tile.block_m - 1) / tile.block_m;
  // Key tiles of the widest row block: with a bottom-right aligned causal mask the last block
  // sees the most keys; with a window (or sq > sk) the first can, so both ends are asked.
  const common::Mask mask = common::make_mask(p.causal, p.window_left, p.window_right, p.max_seqlen_k,
                                              p.max_seqlen_q, p.max_seqlen_k);
  auto tiles_of_rows = [&](int row_begin, int row_end) {
    const int lo = mask.block_col_begin(row_begin) / tile.block_n;
    const int hi = (mask.block_col_end(row_end) + tile.block_n - 1) / tile.block_n;
    return std::max(hi - lo, 0);
  };
  // (Packed row r is query row r / pack.)
  const int n_blocks = std::max(tiles_of_rows(0, std::min((tile.block_m + pack - 1) / pack, p.max_seqlen_q)),
                                tiles_of_rows((m_blocks - 1) * tile.block_m / pack, p.max_seqlen_q));
  const int ctas_per_sm = std::max(1, kRegisterFileSize / (tile.warps * kWarpSize * kMaxRegistersPerThread));
  const std::int64_t ctas = std::int64_t(m_blocks) * (p.heads / pack) * p.batch;
  return num_splits_heuristic(ctas, n_blocks, current_sm_count() * ctas_per_sm, kMaxSplits);
}

std::size_t forward_workspace_size(const common::AttentionParams& p) {
  const int splits = forward_num_splits(p);
  if (splits <= 1) return 0;
  return out_partial_bytes(p, splits) + lse_partial_bytes(p, splits);
}

void forward(const common::AttentionParams& p, void* stream, const std::uint64_t* rng_state, void* workspace,
             std::size_t workspace_bytes) {
  const FamilyChoice choice = choose_forward_family(p);
  if (!choice.served) throw Error("flashattn::forward (CUDA): " + choice.why_not);
  if (p.batch == 0 || p.max_seqlen_q == 0) return;  // nothing to compute (SPEC §5 special cases)
  const int head_dim = choice.head_dim;
  auto* s = static_cast<cudaStream_t>(stream);
  auto check = [](cudaError_t err) {
    if (err != cudaSuccess) {
      throw Error(std::string("flashattn::forward (CUDA): kernel launch failed: ") + cudaGetErrorString(err));
    }
  };
  if (choice.family == Family::sm90) {
    check(sm90::dispatch_fwd(p.storage, head_dim, p, rng_state, s));
    return;
  }

  // Split only when asked for (or chosen) and the workspace holds the partials; a misaligned
  // workspace is used from its first aligned byte on.
  // (The split kernels must be compiled for the same head dim.)
  const bool split_compiled = detail::head_dim_for(sm80::Family::fwd_split, p) == head_dim;
  const int splits = workspace != nullptr && workspace_bytes > 0 && split_compiled ? forward_num_splits(p) : 1;
  if (splits > 1) {
    const auto base = reinterpret_cast<std::uintptr_t>(workspace);
    const std::size_t skip = detail::workspace_align_up(base) - base;
    const std::size_t out_bytes = out_partial_bytes(p, splits);
    if (workspace_bytes >= skip && workspace_bytes - skip >= out_bytes + lse_partial_bytes(p, splits)) {
      sm80::SplitKvPartials partials;
      partials.out_partial = reinterpret_cast<float*>(base + skip);
      partials.lse_partial = reinterpret_cast<float*>(base + skip + out_bytes);
      partials.num_splits = splits;
      check(sm80::dispatch_fwd_split(p.storage, head_dim, p, partials, rng_state, s));
      CombineParams c;
      c.splits = splits;
      c.batch = p.batch;
      c.heads = p.heads;
      c.max_seqlen_q = p.max_seqlen_q;
      c.head_dim_v = p.head_dim_v;
      c.out_partial = partials.out_partial;
      c.out_partial_head_stride = p.head_dim_v;
      c.out_partial_row_stride = std::int64_t(p.heads) * c.out_partial_head_stride;
      c.out_partial_batch_stride = std::int64_t(p.max_seqlen_q) * c.out_partial_row_stride;
      c.out_partial_split_stride = std::int64_t(p.batch) * c.out_partial_batch_stride;
      c.lse_partial = partials.lse_partial;
      c.lse_partial_head_stride = p.max_seqlen_q;
      c.lse_partial_batch_stride = std::int64_t(p.heads) * c.lse_partial_head_stride;
      c.lse_partial_split_stride = std::int64_t(p.batch) * c.lse_partial_batch_stride;
      c.out = p.out;
      c.out_storage = p.storage;
      c.lse = p.lse;
      c.lse_batch_stride = p.lse_batch_stride;
      c.lse_head_stride = p.lse_head_stride;
      c.cu_seqlens_q = p.cu_seqlens_q;
      c.index_error = p.index_error;
      combine(c, stream);
      return;
    }
  }
  check(sm80::dispatch_fwd(p.storage, head_dim, p, rng_state, s));
}

std::string compiled_kernels() {
  std::string list;
  const std::pair<sm80::Family, const char*> families[] = {
      {sm80::Family::fwd, "fwd"}, {sm80::Family::fwd_split, "split-KV fwd"}, {sm80::Family::bwd, "bwd"}};
  for (const auto& [family, name] : families) {
    list += std::string(list.empty() ? "" : "; ") + "sm80 " + name + ": f16 d " +
            sm80::compiled_head_dims(family, common::Storage::f16) + ", bf16 d " +
            sm80::compiled_head_dims(family, common::Storage::bf16);
  }
  list += "; sm90 fwd: f16 d " + sm90::compiled_head_dims(sm90::Family::fwd, common::Storage::f16) + ", bf16 d " +
          sm90::compiled_head_dims(sm90::Family::fwd, common::Storage::bf16);
  return list;
}

}  // namespace flashattn::cuda
