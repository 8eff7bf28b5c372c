// src/cuda/sm80/sm80_family.cu — the sm80 family's face (sm80_family.h): its checks, split-KV
// planning, workspace layout and launches, over the generated registry.
#include "cuda/sm80/sm80_family.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "cuda/cuda_backend.h"
#include "cuda/cuda_common.h"
#include "cuda/device_query.h"
#include "cuda/sm80/sm80_bwd.h"
#include "cuda/sm80/sm80_fwd.h"
#include "cuda/sm80/sm80_registry.h"
#include "cuda/sm80/sm80_smem.h"
#include "flashattn/error.h"

namespace flashattn::cuda::sm80 {
namespace {

// A forward CTA of 4 warps may hold up to 255 registers per thread: 128 · 255 ≈ half of the 64K
// register file, so two fit an SM; the 8-warp tile (d 256) takes it all.
constexpr int kRegisterFileSize = 65536;
constexpr int kMaxRegistersPerThread = 256;
constexpr int kWarpSize = 32;

std::atomic<int> smem_cap{0};  // set_smem_limit_for_testing; 0 = none

// The compiled head dim of `family` that serves p (the smallest that holds max(d, dv)), or 0.
int head_dim_for(Family family, const common::AttentionParams& p) {
  return compiled_head_dim(family, p.storage, std::max(p.head_dim, p.head_dim_v));
}

// Whether the smallest tile of a kernel (`need` bytes of shared memory per block) fits a block of
// the current device; otherwise *why_not says so. what: "forward" or "backward".
bool smem_fits(const char* what, int head_dim, int need, std::string* why_not) {
  const int limit = smem_per_block_limit();
  if (need <= limit) return true;
  *why_not = std::string("the ") + what + " at head dim " + std::to_string(head_dim) + " needs " +
             std::to_string(need) + " bytes of shared memory per block; this GPU allows " + std::to_string(limit);
  return false;
}

// A compiled kernel of `family` for the head dim, then the layout checks of every family.
bool can_serve_common(const common::AttentionParams& p, Family family,
                      std::initializer_list<std::pair<const char*, const common::RowHeadTensor*>> tensors,
                      std::string* why_not) {
  if ((p.storage == common::Storage::f16 || p.storage == common::Storage::bf16) && head_dim_for(family, p) == 0) {
    *why_not = missing_kernel_reason(family, p.storage, std::max(p.head_dim, p.head_dim_v));
    return false;
  }
  return detail::can_serve_layout(p, tensors, why_not);
}

// The backward's workspace layout: the fp32 dQ accumulator (rows rounded per sequence to
// kBwdTileRowsHost, see sm80_bwd_kernel.cuh; the instantiated head dim wide), then
// (deterministic) the counters.
struct BwdLayout {
  int m_blocks = 0;
  std::size_t dq_accum_bytes = 0;
  std::size_t counter_bytes = 0;
};

BwdLayout bwd_layout_of(const common::AttentionParams& p, std::int64_t total_q_rows) {
  constexpr std::size_t kTile = kBwdTileRowsHost;
  BwdLayout l;
  l.m_blocks = (p.max_seqlen_q + kBwdRowBlock - 1) / kBwdRowBlock;
  // Bounds both layouts (dense: b · ⌈sq⌉ ≤ total + b · kTile rows), so the size needs no cu_seqlens.
  const std::size_t rows = std::size_t(total_q_rows) + (std::size_t(p.batch) + 1) * kTile;
  l.dq_accum_bytes = detail::workspace_align_up(rows * std::size_t(p.heads) *
                                                std::size_t(head_dim_for(Family::bwd, p)) * sizeof(float));
  if (p.deterministic) {
    l.counter_bytes =
        detail::workspace_align_up(std::size_t(p.batch) * std::size_t(p.heads) * std::size_t(l.m_blocks) * sizeof(int));
  }
  return l;
}

void check_launch(const char* what, cudaError_t err) {
  if (err != cudaSuccess) {
    throw Error(std::string("flashattn::") + what + " (CUDA): kernel launch failed: " + cudaGetErrorString(err));
  }
}

}  // namespace

int smem_per_block_limit() {
  constexpr int kUnknown = 1 << 30;
  const int asked = current_device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  const int bytes = asked > 0 ? asked : kUnknown;
  const int cap = smem_cap.load(std::memory_order_relaxed);
  return cap > 0 && cap < bytes ? cap : bytes;
}

void set_smem_limit_for_testing(int bytes) { smem_cap.store(bytes > 0 ? bytes : 0, std::memory_order_relaxed); }

std::string forward_refusal(const common::AttentionParams& p, int* head_dim) {
  std::string why;
  if (!can_serve_common(p, Family::fwd, {{"q", &p.q}, {"k", &p.k}, {"v", &p.v}, {"out", &p.out}}, &why)) {
    return why;
  }
  // The smallest tile (the full variant's) must fit a block's shared memory on this device.
  *head_dim = head_dim_for(Family::fwd, p);
  if (!smem_fits("forward", *head_dim, fwd_smem_bytes(*head_dim, fwd_tile(*head_dim, true)), &why)) return why;
  return "";
}

namespace {
// Packed GQA (fwd_pack) of the forward of p at head_dim, whose variant is full or not: a row block
// holds (query row, head) pairs of one kv head; the full variant never packs.
int pack_of(const common::AttentionParams& p, int head_dim, bool full) {
  return full ? 1 : fwd_pack(p, fwd_tile(head_dim, false).block_m);
}
}  // namespace

int forward_pack(const common::AttentionParams& p) {
  const int head_dim = head_dim_for(Family::fwd, p);
  return head_dim == 0 ? 1 : pack_of(p, head_dim, fwd_runs_full(p, head_dim, smem_per_block_limit()));
}

int forward_num_splits(const common::AttentionParams& p) {
  if (p.num_splits > 0) return std::min(p.num_splits, kMaxSplits);
  const int head_dim = head_dim_for(Family::fwd, p);
  if (head_dim == 0 || p.batch <= 0 || p.heads <= 0 || p.max_seqlen_q <= 0 || p.max_seqlen_k <= 0) return 1;
  const bool full = fwd_runs_full(p, head_dim, smem_per_block_limit());
  // Packed GQA: in the packed kernel's tile.
  const int pack = pack_of(p, head_dim, full);
  // The short-sequence tile runs unsplit (its CTAs are many and short already).
  if (!full && pack == 1 && fwd_runs_short(p, head_dim)) return 1;
  const FwdTile tile = pack > 1 ? fwd_tile_packed(head_dim) : fwd_tile(head_dim, full);
  const int m_blocks = (p.max_seqlen_q * pack + tile.block_m - 1) / tile.block_m;
  const int n_blocks = widest_row_block_key_tiles(p, tile.block_m, tile.block_n, pack);
  const int ctas_per_sm = std::max(1, kRegisterFileSize / (tile.warps * kWarpSize * kMaxRegistersPerThread));
  const std::int64_t ctas = std::int64_t(m_blocks) * (p.heads / pack) * p.batch;
  return num_splits_heuristic(ctas, n_blocks, current_sm_count() * ctas_per_sm, kMaxSplits);
}

void forward(const common::AttentionParams& p, int head_dim, const std::uint64_t* rng_state, void* workspace,
             std::size_t workspace_bytes, cudaStream_t stream) {
  // Split only when asked for (or chosen) and the workspace holds the partials; a misaligned
  // workspace is used from its first aligned byte on. (The split kernels must be compiled for the
  // same head dim.)
  const bool split_compiled = head_dim_for(Family::fwd_split, p) == head_dim;
  const int splits = workspace != nullptr && workspace_bytes > 0 && split_compiled ? forward_num_splits(p) : 1;
  const SplitKvPartials partials = carve_split_partials(p, splits, workspace, workspace_bytes);
  if (partials.num_splits > 1) {
    check_launch("forward", dispatch_fwd_split(p.storage, head_dim, p, partials, rng_state, stream));
    combine_split_partials(p, partials.out_partial, partials.lse_partial, partials.num_splits, stream);
    return;
  }
  check_launch("forward", dispatch_fwd(p.storage, head_dim, p, rng_state, stream));
}

std::string backward_refusal(const common::AttentionParams& p) {
  std::string why;
  if (!can_serve_common(p, Family::bwd,
                        {{"q", &p.q},
                         {"k", &p.k},
                         {"v", &p.v},
                         {"out", &p.out},
                         {"dout", &p.dout},
                         {"dq", &p.dq},
                         {"dk", &p.dk},
                         {"dv", &p.dv}},
                        &why)) {
    return why;
  }
  // The smallest configuration (sm80_bwd.h) must fit a block's shared memory on this device.
  const int head_dim = head_dim_for(Family::bwd, p);
  if (!smem_fits("backward", head_dim, bwd_min_smem_bytes(head_dim), &why)) return why;
  return "";
}

std::size_t backward_workspace_size(const common::AttentionParams& p, std::int64_t total_q_rows) {
  const BwdLayout l = bwd_layout_of(p, total_q_rows);
  return l.dq_accum_bytes + l.counter_bytes;
}

void backward(const common::AttentionParams& p, std::int64_t total_q_rows, void* workspace, cudaStream_t stream,
              const std::uint64_t* rng_state) {
  const BwdLayout l = bwd_layout_of(p, total_q_rows);
  BwdScratch ws;
  ws.dq_accum = static_cast<float*>(workspace);
  ws.dq_accum_bytes = l.dq_accum_bytes;
  ws.m_blocks = l.m_blocks;
  if (p.deterministic) {
    ws.counters = reinterpret_cast<int*>(static_cast<char*>(workspace) + l.dq_accum_bytes);
    ws.counter_bytes = l.counter_bytes;
  }
  check_launch("backward", dispatch_bwd(p.storage, head_dim_for(Family::bwd, p), p, ws, rng_state, stream));
}

std::string compiled_kernels() {
  std::string list;
  const std::pair<Family, const char*> kinds[] = {
      {Family::fwd, "fwd"}, {Family::fwd_split, "split-KV fwd"}, {Family::bwd, "bwd"}};
  for (const auto& [kind, name] : kinds) {
    list += std::string(list.empty() ? "" : "; ") + "sm80 " + name + ": f16 d " +
            compiled_head_dims(kind, common::Storage::f16) + ", bf16 d " +
            compiled_head_dims(kind, common::Storage::bf16);
  }
  return list;
}

}  // namespace flashattn::cuda::sm80
