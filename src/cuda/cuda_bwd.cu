// src/cuda/cuda_bwd.cu — which CUDA kernel family serves a backward call, its workspace, and the
// call.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/cuda_backend.h"
#include "cuda/family.h"
#include "cuda/sinks.h"
#include "flashattn/error.h"

namespace flashattn::cuda {

bool can_serve_backward(const common::AttentionParams& p, std::string* why_not) {
  const FamilyChoice choice = choose_backward_family(p);
  if (!choice.served && why_not) *why_not = choice.why_not;
  return choice.served;
}

std::size_t backward_workspace_size(const common::AttentionParams& p, std::int64_t total_q_rows) {
  const FamilyChoice choice = choose_backward_family(p);
  return choice.served ? family_backward_workspace_size(choice, p, total_q_rows) : 0;
}

std::size_t backward_workspace_bound(const common::AttentionParams& p, std::int64_t total_q_rows) {
  return family_backward_workspace_bound(p, total_q_rows);
}

void backward(const common::AttentionParams& p, std::int64_t total_q_rows, void* workspace, void* stream,
              const std::uint64_t* rng_state) {
  const FamilyChoice choice = choose_backward_family(p);
  if (!choice.served) throw Error("flashattn::backward (CUDA): " + choice.why_not);
  // SPEC §5 special cases: nothing to compute (dk/dv of no rows are zeros only when there are keys).
  if (p.batch == 0 || (p.max_seqlen_q == 0 && p.max_seqlen_k == 0)) {
    sink_gradient(p, static_cast<cudaStream_t>(stream));  // dsinks of no rows: 0
    return;
  }
  family_backward(choice, p, total_q_rows, workspace, static_cast<cudaStream_t>(stream), rng_state);
  // After the family's preprocess has written softmax_d (same stream).
  sink_gradient(p, static_cast<cudaStream_t>(stream));
}

}  // namespace flashattn::cuda
