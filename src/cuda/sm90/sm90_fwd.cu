// src/cuda/sm90/sm90_fwd.cu — which calls the Hopper forward family serves (host code).
#include "cuda/sm90/sm90_fwd.h"

#include <cstdint>
#include <cstdlib>
#include <string>
#include <tuple>
#include <utility>

namespace flashattn::cuda::sm90 {
namespace {

// A TMA descriptor takes strides below 2^40 bytes; a zero stride (a broadcast view) is left to
// the sm80 kernels.
constexpr std::int64_t kTmaStrideLimitBytes = std::int64_t(1) << 40;

std::string tma_layout_problem(const char* name, const common::RowHeadTensor& t, int rows, int heads, int batch,
                               std::int64_t element_bytes) {
  const std::pair<std::int64_t, int> strides[] = {{t.row_stride, rows}, {t.head_stride, heads}, {t.batch_stride, batch}};
  for (const auto& [stride, extent] : strides) {
    if (extent > 1 && (stride <= 0 || stride * element_bytes >= kTmaStrideLimitBytes)) {
      return std::string(name) + ": its strides must be positive and below 2^40 bytes for the TMA loads";
    }
  }
  return "";
}

}  // namespace

std::string fwd_unsupported(const common::AttentionParams& p, int head_dim) {
  (void)head_dim;
  if (p.is_varlen() || p.seqused_k != nullptr) return "varlen batches are not in this family yet";
  if (p.cache_seqlens != nullptr || p.cache_batch_idx != nullptr || p.is_paged()) {
    return "KV caches (cache_seqlens, cache_batch_idx, paged K/V) are not in this family yet";
  }
  if (p.dropout_p > 0.0f) return "dropout is not in this family yet";
  if (p.sinks != nullptr) return "attention sinks are not in this family yet";
  // A TMA descriptor needs every extent ≥ 1 (and an empty tensor may have no address at all).
  if (p.max_seqlen_k == 0) return "no keys: nothing for the TMA loads (the rows are written empty elsewhere)";
  const std::int64_t element_bytes = 2;
  for (const auto& [name, t, rows, heads] :
       {std::tuple<const char*, const common::RowHeadTensor*, int, int>{"q", &p.q, p.max_seqlen_q, p.heads},
        {"k", &p.k, p.max_seqlen_k, p.heads_k},
        {"v", &p.v, p.max_seqlen_k, p.heads_k}}) {
    const std::string problem = tma_layout_problem(name, *t, rows, heads, p.batch, element_bytes);
    if (!problem.empty()) return problem;
  }
  return "";
}

bool fwd_pingpong(int head_dim) {
  const bool compiled = head_dim <= 128;
  const char* env = std::getenv("FLASHATTN_SM90_FWD_PINGPONG");
  return compiled && env != nullptr && std::string(env) == "1";
}

}  // namespace flashattn::cuda::sm90
