// src/cuda/family.cu — the ordered choice of a kernel family per call (family.h).
#include "cuda/family.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>

#include "cuda/cuda_backend.h"
#include "cuda/cuda_common.h"
#include "cuda/device_query.h"
#include "cuda/sm80/sm80_family.h"
#include "cuda/sm80/sm80_registry.h"
#include "cuda/sm90/sm90_bwd.h"
#include "cuda/sm90/sm90_fwd.h"
#include "cuda/sm90/sm90_registry.h"
#include "flashattn/error.h"

namespace flashattn::cuda {
namespace {

constexpr Family kPreference[] = {Family::sm90, Family::sm80};
constexpr int kHopper = 90;  // the compute capability sm_90a code runs on (H100, H200, H20, …)
// Paged calls with fewer query rows than this (decoding) stay with the sm80 family under the
// ordered choice (sm90_forward_refusal).
constexpr int kPagedDecodeRows = 64;

// The device and compiled-kernel rules of the sm90 family, for `kind` (*head_dim: the
// instantiated head dim that would run p); "" when they hold.
std::string sm90_kernel_refusal(sm90::Family kind, const common::AttentionParams& p, int* head_dim,
                                std::initializer_list<std::pair<const char*, const common::RowHeadTensor*>> tensors) {
  // The 192 instantiations have dv 128 (sm90::fwd_head_dim_v, bwd_head_dim_v).
  const int need = sm90::fwd_head_dim_need(p.head_dim, p.head_dim_v);
  if (p.storage == common::Storage::f16 || p.storage == common::Storage::bf16) {
    *head_dim = sm90::compiled_head_dim(kind, p.storage, need);
    if (*head_dim == 0) return sm90::missing_kernel_reason(kind, p.storage, need);
  }
  std::string why;
  if (!detail::can_serve_layout(p, tensors, &why)) return why;
  const int cc = current_compute_capability();
  if (cc != kHopper) {
    return "its kernels are compiled for sm_90a, which runs on compute capability 9.0 only (this GPU: " +
           std::to_string(cc / 10) + "." + std::to_string(cc % 10) + ")";
  }
  return "";
}

std::string sm90_forward_refusal(const common::AttentionParams& p, int* head_dim, bool preferring) {
  std::string why = sm90_kernel_refusal(sm90::Family::fwd, p, head_dim, {{"q", &p.q}, {"k", &p.k}, {"v", &p.v}, {"out", &p.out}});
  if (!why.empty()) return why;
  why = sm90::fwd_unsupported(p, *head_dim);
  if (!why.empty()) return why;
  // A preference, not a limit (a forced choice runs such calls here, unsplit): where the sm80
  // family would split the key tiles over more CTAs, its split-KV path fills the GPU better.
  if (preferring && sm80::forward_num_splits(p) > 1) {
    return "the grid is short of one wave (decoding): the split-KV forward is not in this family yet";
  }
  // Decoding with GQA: the sm80 family packs a group's query heads into one row block and reads
  // each K/V tile once per group; this family reads it once per query head (on the H200, d 128,
  // GQA 32/8, batch 32, 32k keys: 1.3 TB/s here against 4.6 TB/s there).
  if (preferring && sm80::forward_pack(p) > 1) {
    return "GQA decoding: the sm80 family packs the query heads of a group into one row block; this family does not";
  }
  // Paged decoding (a few query rows per sequence): timed in this family only where the sm80
  // kernel packs (above), and gathered there in 16-row TMA boxes by one thread; its prefill over
  // pages is what measured faster (docs/benchmarks-sm90.md).
  if (preferring && p.is_paged() && p.max_seqlen_q < kPagedDecodeRows) {
    return "paged decoding (fewer than 64 query rows): the sm80 family's paged kernel serves it";
  }
  return "";
}

std::string sm90_backward_refusal(const common::AttentionParams& p, int* head_dim) {
  const std::string why = sm90_kernel_refusal(sm90::Family::bwd, p, head_dim,
                                              {{"q", &p.q}, {"k", &p.k}, {"v", &p.v}, {"out", &p.out},
                                               {"dout", &p.dout}, {"dq", &p.dq}, {"dk", &p.dk}, {"dv", &p.dv}});
  return why.empty() ? sm90::bwd_unsupported(p, *head_dim) : why;
}

}  // namespace

const char* family_name(Family family) { return family == Family::sm90 ? "sm90" : "sm80"; }

bool forced_family(Family* family) {
  // Read on every call (a process may set it between calls), three times per forward call: the
  // variable is compared where it lies, without a copy.
  const char* value = std::getenv("FLASHATTN_CUDA_FAMILY");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) return false;
  for (Family f : kPreference) {
    if (std::strcmp(value, family_name(f)) == 0) {
      *family = f;
      return true;
    }
  }
  throw Error(std::string("FLASHATTN_CUDA_FAMILY=") + value + ": expected sm80, sm90 or auto");
}

std::string forward_refusal(Family family, const common::AttentionParams& p, int* head_dim, bool preferring) {
  *head_dim = 0;
  return family == Family::sm90 ? sm90_forward_refusal(p, head_dim, preferring) : sm80::forward_refusal(p, head_dim);
}

FamilyChoice choose_forward_family(const common::AttentionParams& p) {
  FamilyChoice choice;
  Family forced;
  const bool only_one = forced_family(&forced);
  for (Family f : kPreference) {
    if (only_one && f != forced) continue;
    const std::string why = forward_refusal(f, p, &choice.head_dim, !only_one);
    if (why.empty()) {
      choice.served = true;
      choice.family = f;
      choice.why_not.clear();
      return choice;
    }
    // The reason of the last family asked stands for the call: the most portable one's, whose
    // refusals (dtype, alignment, a kernel missing from the build) hold for every family.
    choice.why_not = why;
  }
  if (only_one) choice.why_not += std::string(" (FLASHATTN_CUDA_FAMILY=") + family_name(forced) + ")";
  return choice;
}

int family_num_splits(const FamilyChoice& choice, const common::AttentionParams& p) {
  return choice.family == Family::sm80 ? sm80::forward_num_splits(p)
                                       : sm90::fwd_num_splits(p, choice.head_dim, current_sm_count());
}

void family_forward(const FamilyChoice& choice, const common::AttentionParams& p, const std::uint64_t* rng_state,
                    void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  if (choice.family == Family::sm80) {
    sm80::forward(p, choice.head_dim, rng_state, workspace, workspace_bytes, stream);
    return;
  }
  // Split-KV (FLASHATTN_SM90_FWD_SPLIT) where the workspace holds the partials (a misaligned
  // workspace is used from its first aligned byte on), as in the sm80 family.
  const int splits = workspace != nullptr && workspace_bytes > 0 ? family_num_splits(choice, p) : 1;
  const SplitKvPartials partials = carve_split_partials(p, splits, workspace, workspace_bytes);
  const cudaError_t err = sm90::dispatch_fwd(p.storage, choice.head_dim, p, partials, rng_state, stream);
  if (err != cudaSuccess) {
    throw Error(std::string("flashattn::forward (CUDA): kernel launch failed: ") + cudaGetErrorString(err));
  }
  if (partials.num_splits > 1) {
    combine_split_partials(p, partials.out_partial, partials.lse_partial, partials.num_splits, stream);
  }
}

FamilyChoice choose_backward_family(const common::AttentionParams& p) {
  FamilyChoice choice;
  Family forced;
  const bool only_one = forced_family(&forced);
  for (Family f : kPreference) {
    if (only_one && f != forced) continue;
    choice.head_dim = 0;
    const std::string why = f == Family::sm90 ? sm90_backward_refusal(p, &choice.head_dim) : sm80::backward_refusal(p);
    if (why.empty()) {
      choice.served = true;
      choice.family = f;
      choice.why_not.clear();
      return choice;
    }
    choice.why_not = why;  // the most portable family's reason stands for the call (as forward)
  }
  if (only_one) choice.why_not += std::string(" (FLASHATTN_CUDA_FAMILY=") + family_name(forced) + ")";
  return choice;
}

std::size_t family_backward_workspace_size(const FamilyChoice& choice, const common::AttentionParams& p,
                                           std::int64_t total_q_rows) {
  if (choice.family == Family::sm80) return sm80::backward_workspace_size(p, total_q_rows);
  return sm90::bwd_workspace(p, choice.head_dim).total_bytes();
}

std::size_t family_backward_workspace_bound(const common::AttentionParams& p, std::int64_t total_q_rows) {
  Family forced;
  const bool only_one = forced_family(&forced);
  std::size_t bound = 0;
  for (Family f : kPreference) {
    if (only_one && f != forced) continue;
    FamilyChoice choice;
    choice.family = f;
    // The head dim each family's choice would take (choose_backward_family's rules).
    choice.head_dim =
        f == Family::sm90
            ? sm90::compiled_head_dim(sm90::Family::bwd, p.storage, sm90::fwd_head_dim_need(p.head_dim, p.head_dim_v))
            : sm80::compiled_head_dim(sm80::Family::bwd, p.storage, std::max(p.head_dim, p.head_dim_v));
    if (choice.head_dim != 0) bound = std::max(bound, family_backward_workspace_size(choice, p, total_q_rows));
  }
  return bound;
}

void family_backward(const FamilyChoice& choice, const common::AttentionParams& p, std::int64_t total_q_rows,
                     void* workspace, cudaStream_t stream, const std::uint64_t* rng_state) {
  if (choice.family == Family::sm80) {
    sm80::backward(p, total_q_rows, workspace, stream, rng_state);
    return;
  }
  const sm90::BwdWorkspace w = sm90::bwd_workspace(p, choice.head_dim);
  sm90::BwdScratch ws;
  char* const base = static_cast<char*>(workspace);
  ws.dq_accum = reinterpret_cast<float*>(base);
  ws.lse_log2 = reinterpret_cast<float*>(base + w.dq_accum_bytes);
  ws.dpsum = reinterpret_cast<float*>(base + w.dq_accum_bytes + w.row_stat_bytes);
  if (p.deterministic) {
    ws.dq_semaphores = reinterpret_cast<int*>(base + w.dq_accum_bytes + 2 * w.row_stat_bytes);
    ws.semaphore_bytes = w.semaphore_bytes;
  }
  ws.rows = w.rows;
  ws.dq_accum_bytes = w.dq_accum_bytes;
  const cudaError_t err = sm90::dispatch_bwd(p.storage, choice.head_dim, p, ws, rng_state, stream);
  if (err != cudaSuccess) {
    throw Error(std::string("flashattn::backward (CUDA): kernel launch failed: ") + cudaGetErrorString(err));
  }
}

std::string compiled_kernels_of_families() {
  std::string list = sm80::compiled_kernels();
  for (const auto& [kind, name] : {std::pair{sm90::Family::fwd, "fwd"}, std::pair{sm90::Family::bwd, "bwd"}}) {
    list += std::string("; sm90 ") + name + ": f16 d " + sm90::compiled_head_dims(kind, common::Storage::f16) +
            ", bf16 d " + sm90::compiled_head_dims(kind, common::Storage::bf16);
  }
  return list;
}

}  // namespace flashattn::cuda
