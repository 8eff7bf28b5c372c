// src/cuda/sm90/sm90_fwd.cu — which calls the Hopper forward family serves (host code).
#include "cuda/sm90/sm90_fwd.h"
#include "cuda/sm90/sm90_tile_scheduler.cuh"

#include "cuda/cuda_backend.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

namespace flashattn::cuda::sm90 {
namespace {

// A TMA descriptor takes strides below 2^40 bytes; a zero stride (a broadcast view) is left to
// the sm80 kernels.
constexpr std::int64_t kTmaStrideLimitBytes = std::int64_t(1) << 40;
// Extents are 32-bit (the descriptor's shape here is int32).
constexpr std::int64_t kTmaRowLimit = std::int64_t(1) << 31;

}  // namespace

std::string tma_layout_problem(const char* name, const common::RowHeadTensor& t, std::int64_t rows, int heads, int batch,
                               std::int64_t element_bytes) {
  const std::pair<std::int64_t, std::int64_t> strides[] = {{t.row_stride, rows}, {t.head_stride, heads}, {t.batch_stride, batch}};
  for (const auto& [stride, extent] : strides) {
    if (extent > 1 && (stride <= 0 || stride * element_bytes >= kTmaStrideLimitBytes)) {
      return std::string(name) + ": its strides must be positive and below 2^40 bytes for the TMA loads";
    }
  }
  return "";
}

std::string fwd_unsupported(const common::AttentionParams& p, int head_dim) {
  if (head_dim > 0 && (p.head_dim > head_dim || p.head_dim_v > fwd_head_dim_v(head_dim))) {
    return "head dims " + std::to_string(p.head_dim) + " / " + std::to_string(p.head_dim_v) +
           " exceed the instantiation's " + std::to_string(head_dim) + " / " + std::to_string(fwd_head_dim_v(head_dim));
  }
  const bool paged = p.is_paged();
  if (paged && !kFwdPaged) {
    return "paged KV caches are not in this family yet (built without -DFLASHATTN_SM90_FWD_PAGED=1)";
  }
  if (paged && (p.page_size <= 0 || p.page_size % kFwdPageChunkRows != 0)) {
    return "paged K/V: this family takes page sizes that are multiples of " + std::to_string(kFwdPageChunkRows) +
           " rows";
  }
  // (A paged varlen call may give its key counts by seqused_k alone: its keys are found by pages.)
  if (p.is_varlen() && !paged && p.cu_seqlens_k == nullptr) {
    return "varlen keys without cu_seqlens_k are not in this family";
  }
  const bool cache = p.cache_seqlens != nullptr || p.cache_batch_idx != nullptr;
  if (cache && p.is_varlen()) return "varlen queries over a KV cache are not in this family yet";
  if (p.sinks != nullptr) return "attention sinks are not in this family yet";
  // A TMA descriptor needs every extent ≥ 1 (and an empty tensor may have no address at all).
  const bool varlen = p.is_varlen();
  const std::int64_t rows_q = varlen ? p.total_q : p.max_seqlen_q;
  // The TMA view of K and V: packed rows (varlen), a cache's or the batch's rows, or one page.
  const std::int64_t rows_k = paged ? p.page_size : varlen ? p.total_k : p.max_seqlen_k;
  if (p.max_seqlen_k == 0 || rows_k == 0) {
    return "no keys: nothing for the TMA loads (the rows are written empty elsewhere)";
  }
  if (rows_q >= kTmaRowLimit || rows_k >= kTmaRowLimit) return "more than 2^31 − 1 packed rows for a TMA descriptor";
  const std::int64_t element_bytes = 2;
  const int batch = varlen ? 1 : p.batch;
  const std::int64_t batch_k = paged ? p.cache_batches : varlen ? 1 : p.cache_batches > 0 ? p.cache_batches : p.batch;
  if (paged && (batch_k <= 0 || batch_k >= kTmaRowLimit)) return "paged K/V: 1 to 2^31 − 1 pages for a TMA descriptor";
  // O stored by TMA (fwd_tma_store; the dense kernels): its strides as for the loads, and the
  // 16-byte alignment of its address and strides that a TMA descriptor needs.
  if (fwd_tma_store(head_dim, fwd_score_mod(p)) && !fwd_varlen_kernel(p)) {
    const std::string problem = tma_layout_problem("out", p.out, rows_q, p.heads, batch, element_bytes);
    if (!problem.empty()) return problem;
    const auto misaligned = [&](std::int64_t stride, std::int64_t extent) {
      return extent > 1 && (stride * element_bytes) % 16 != 0;
    };
    if (reinterpret_cast<std::uintptr_t>(p.out.data) % 16 != 0 || misaligned(p.out.row_stride, rows_q) ||
        misaligned(p.out.head_stride, p.heads) || misaligned(p.out.batch_stride, batch)) {
      return "out: its address and strides must be multiples of 16 bytes for the TMA store";
    }
  }
  for (const auto& [name, t, rows, heads, batches] :
       {std::tuple<const char*, const common::RowHeadTensor*, std::int64_t, int, int>{"q", &p.q, rows_q, p.heads, batch},
        {"k", &p.k, rows_k, p.heads_k, int(batch_k)},
        {"v", &p.v, rows_k, p.heads_k, int(batch_k)}}) {
    const std::string problem = tma_layout_problem(name, *t, rows, heads, batches, element_bytes);
    if (!problem.empty()) return problem;
  }
  return "";
}

namespace {
// An integer from the environment, or `otherwise` where it is unset or empty.
std::int64_t env_int(const char* name, std::int64_t otherwise) {
  const char* env = std::getenv(name);
  return env != nullptr && *env != '\0' ? std::strtoll(env, nullptr, 10) : otherwise;
}
}  // namespace

FwdSections fwd_l2_sections(const common::AttentionParams& p, int block_m, int sms) {
  const int pairs = p.heads * p.batch;
  const bool alternate = env_int("FLASHATTN_SM90_FWD_L2_SECTION_ALT", 1) != 0;
  if (pairs <= 0) return {1, alternate};
  const std::int64_t m_blocks = (p.max_seqlen_q + block_m - 1) / block_m;
  // No limit by default; a limit set (≥ 0) leaves longer calls one section of every pair.
  const std::int64_t row_blocks = env_int("FLASHATTN_SM90_FWD_L2_SECTION_ROWS", -1);
  if (row_blocks >= 0 && m_blocks > row_blocks) return {pairs, alternate};
  const std::int64_t element_bytes = 2;
  const std::int64_t kv_head_bytes = std::max<std::int64_t>(
      1, std::int64_t(p.max_seqlen_k) * (p.head_dim + p.head_dim_v) * element_bytes);
  // The pairs whose K/V fit in `mib` MiB: whole groups of query heads, at least one kv head's.
  auto pairs_in = [&](std::int64_t mib) {
    const std::int64_t kv_heads = std::max<std::int64_t>(1, (mib << 20) / kv_head_bytes);
    return int(std::min<std::int64_t>(pairs, kv_heads * p.group_size()));
  };
  const std::int64_t set_mib = env_int("FLASHATTN_SM90_FWD_L2_SECTION_MB", -1);
  if (set_mib == 0) return {pairs, alternate};
  if (set_mib > 0) return {pairs_in(set_mib), alternate};
  const int small_pairs = pairs_in(kFwdL2SectionMiB);
  // At least 1.5 rounds of tiles (sms of them per round) in a section of the smaller share.
  if (sms <= 0 || 2 * std::int64_t(small_pairs) * m_blocks >= 3 * std::int64_t(sms)) return {small_pairs, alternate};
  return {pairs_in(kFwdL2SectionWideMiB), alternate};
}

int fwd_fast_divmod_mismatch(const common::AttentionParams& p, int block_m, int section, int splits, bool alternate) {
  const int m_blocks = (p.max_seqlen_q + block_m - 1) / block_m;
  const int pairs = p.heads * p.batch;
  const int rising = common::MaskedTileOrder::rising_parity_of(pairs, section, alternate);
  const FwdTileDivisors d = FwdTileDivisors::make(p, block_m, section, splits);
  const bool masked = p.has_mask();
  for (int i = 0; i < m_blocks * pairs * splits; ++i) {
    const FwdTileIndex a = splits > 1 ? d.decode<true>(i, masked, rising) : d.decode<false>(i, masked, rising);
    const FwdTileIndex b = splits > 1 ? decode_tile_index<true>(p, block_m, i, section, rising, splits)
                                      : decode_tile_index<false>(p, block_m, i, section, rising, splits);
    if (a.m_block != b.m_block || a.head != b.head || a.batch != b.batch || a.kv_head != b.kv_head ||
        a.split != b.split) {
      return i;
    }
  }
  return -1;
}

bool fwd_tma_store_built(int head_dim, bool score_mod) { return fwd_tma_store(head_dim, score_mod); }

bool fwd_paged_built() { return kFwdPaged; }

namespace {
// Whether a call may take a second tile compiled for the plain dense kernel only (the tall d 64
// and wide d 256 tiles): a dense call (no varlen, seqused_k or KV cache, not paged), not split,
// without softcap, ALiBi or dropout.
bool plain_dense_call(const common::AttentionParams& p, int num_splits) {
  return num_splits <= 1 && !fwd_score_mod(p) && !fwd_varlen_kernel(p) && !p.is_paged();
}
}  // namespace

bool fwd_d64_tall_built() { return kFwdD64Tall; }

bool fwd_d64_tall(const common::AttentionParams& p, int num_splits) {
  if (!kFwdD64Tall || !plain_dense_call(p, num_splits)) return false;
  if (p.window_left >= 0 || p.window_right >= 0) return false;  // a sliding window: the 128-row tile
  const int from = p.causal ? env_int("FLASHATTN_SM90_FWD_D64_TALL_CAUSAL_FROM", 8192)
                            : env_int("FLASHATTN_SM90_FWD_D64_TALL_FROM", 8192);
  return from > 0 && p.max_seqlen_q >= from && p.max_seqlen_k >= from;
}

bool fwd_split_built() { return kFwdSplit; }

int fwd_num_splits(const common::AttentionParams& p, int head_dim, int sms) {
  if (!kFwdSplit) return 1;
  if (p.num_splits > 0) return std::min(p.num_splits, kMaxSplits);
  if (head_dim <= 0 || p.batch <= 0 || p.heads <= 0 || p.max_seqlen_q <= 0 || p.max_seqlen_k <= 0) return 1;
  const FwdTileShape tile = fwd_tile(head_dim);
  const int m_blocks = (p.max_seqlen_q + tile.block_m - 1) / tile.block_m;
  const int n_blocks = widest_row_block_key_tiles(p, tile.block_m, tile.block_n, 1);
  return num_splits_heuristic(std::int64_t(m_blocks) * p.heads * p.batch, n_blocks, sms, kMaxSplits);
}

bool fwd_d256_wide_built() { return kFwdD256Wide; }

bool fwd_d256_wide(const common::AttentionParams& p, int num_splits) {
  if (!kFwdD256Wide || !plain_dense_call(p, num_splits)) return false;
  const std::int64_t from = env_int("FLASHATTN_SM90_FWD_D256_WIDE_FROM", 2048);
  return from > 0 && p.max_seqlen_k >= from;
}

int fwd_page_box_rows(int page_size) {
  const bool wide = page_size > 0 && page_size % 64 == 0 && env_int("FLASHATTN_SM90_FWD_PAGE_BOX", 64) != 16;
  return wide ? 64 : kFwdPageChunkRows;
}

bool fwd_dynamic_built() { return kFwdDynamic; }

#if FLASHATTN_SM90_FWD_DYNAMIC
namespace {
// The dynamic schedule's counters, zero at load and again after every launch that uses one.
__device__ int g_fwd_tile_counters[kFwdTileCounters];
}  // namespace
#endif

int* fwd_tile_counter(const common::AttentionParams& p, cudaStream_t stream) {
#if FLASHATTN_SM90_FWD_DYNAMIC
  if (!p.has_mask() && !p.is_varlen()) return nullptr;
  const char* env = std::getenv("FLASHATTN_SM90_FWD_SCHEDULE");
  if (env != nullptr && std::string(env) == "static") return nullptr;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
    cudaGetLastError();
    return nullptr;
  }
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return nullptr;
  // Each (device, stream) keeps the counter it was first given: launches on one stream run one
  // after the other, so no two launches in flight share a counter.
  static std::mutex mutex;
  static std::map<int, std::pair<int*, std::map<cudaStream_t, int>>> devices;
  const std::lock_guard<std::mutex> lock(mutex);
  auto& [base, streams] = devices[device];
  if (base == nullptr) {
    void* address = nullptr;
    if (cudaGetSymbolAddress(&address, g_fwd_tile_counters) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    base = static_cast<int*>(address);
  }
  auto it = streams.find(stream);
  if (it == streams.end()) {
    if (int(streams.size()) >= kFwdTileCounters) return nullptr;
    it = streams.emplace(stream, int(streams.size())).first;
  }
  return base + it->second;
#else
  (void)p;
  (void)stream;
  return nullptr;
#endif
}

bool fwd_snake_walk() {
  const char* env = std::getenv("FLASHATTN_SM90_FWD_WALK");
  return env == nullptr || std::string(env) != "plain";
}

}  // namespace flashattn::cuda::sm90
