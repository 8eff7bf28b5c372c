// src/cuda/sm90/sm90_bwd.cu — which calls the Hopper backward family serves, and its workspace
// (host code).
#include "cuda/sm90/sm90_bwd.h"

#include <cstdlib>
#include <string>

#include "cuda/cuda_common.h"
#include "cuda/sm90/sm90_fwd.h"

namespace flashattn::cuda::sm90 {

std::string bwd_unsupported(const common::AttentionParams& p, int head_dim) {
  if (p.seqused_k != nullptr && !p.is_varlen()) return "seqused_k without cu_seqlens is not in this family's backward";
  if (p.max_seqlen_q == 0) return "no query rows: nothing for the TMA loads (dK and dV are zeros elsewhere)";
  // The forward's TMA rules hold for q, k and v; dO is read the same way as q.
  const std::string why = fwd_unsupported(p, head_dim);
  if (!why.empty()) return why;
  const bool varlen = p.is_varlen();
  return tma_layout_problem("dout", p.dout, varlen ? p.total_q : p.max_seqlen_q, p.heads, varlen ? 1 : p.batch, 2);
}

bool bwd_tile_major(bool masked, bool deterministic, long long ctas, long long resident) {
  if (deterministic) return false;
  const char* env = std::getenv("FLASHATTN_SM90_BWD_TILE_MAJOR");
  if (env != nullptr && *env != '\0') return std::string(env) != "0";
  return masked && resident > 0 && ctas <= 2 * resident;
}

bool bwd_heads_inner(int group, bool deterministic) {
  if (!kBwdHeadsInner || deterministic || group <= 1) return false;
  const char* env = std::getenv("FLASHATTN_SM90_BWD_GQA_WALK");
  return env != nullptr && std::string(env) == "inner";
}

int bwd_stagger_tiles(int sm_count) {
  const int fallback = kBwdStagger ? sm_count / 4 : 0;
  const char* env = std::getenv("FLASHATTN_SM90_BWD_STAGGER_TILES");
  if (env == nullptr || *env == '\0') return fallback;
  char* end = nullptr;
  const long n = std::strtol(env, &end, 10);
  if (*end != '\0' || n < 0) return fallback;  // not a count: the default
  return int(n < sm_count ? n : sm_count);      // more than one tile per SM could not all be resident
}

bool bwd_dependent_launch() {
  const char* env = std::getenv("FLASHATTN_SM90_BWD_PDL");
  return env == nullptr || std::string(env) != "0";
}

bool bwd_wide_rows(const common::AttentionParams& p, int head_dim) {
  if (!kBwdWideRows || head_dim != 128 || p.has_mask() || p.softcap > 0.0f || p.alibi_slopes != nullptr ||
      p.dropout_p > 0.0f) {
    return false;
  }
  // Read once: the workspace a caller sized must be the one the launch lays out.
  static const bool enabled = [] {
    const char* env = std::getenv("FLASHATTN_SM90_BWD_WIDE_ROWS");
    return env == nullptr || std::string(env) != "0";
  }();
  return enabled;
}

BwdRows bwd_rows(const common::AttentionParams& p, int head_dim) {
  BwdRows r;
  r.block_m = bwd_tile(head_dim, bwd_wide_rows(p, head_dim)).block_m;
  r.padded_rows = (p.max_seqlen_q + r.block_m - 1) / r.block_m * r.block_m;
  const std::int64_t rows = p.is_varlen() ? p.total_q + std::int64_t(p.batch + 1) * r.block_m
                                          : std::int64_t(p.batch) * r.padded_rows;
  r.head_stride = (rows + r.block_m - 1) / r.block_m * r.block_m;
  return r;
}

BwdWorkspace bwd_workspace(const common::AttentionParams& p, int head_dim) {
  BwdWorkspace w;
  w.rows = bwd_rows(p, head_dim);
  const std::size_t rows = std::size_t(p.heads) * std::size_t(w.rows.head_stride);
  w.dq_accum_bytes = detail::workspace_align_up(rows * std::size_t(head_dim) * sizeof(float));
  w.row_stat_bytes = detail::workspace_align_up(rows * sizeof(float));
  if (p.deterministic) w.semaphore_bytes = detail::workspace_align_up(rows / w.rows.block_m * sizeof(int));
  return w;
}

}  // namespace flashattn::cuda::sm90
