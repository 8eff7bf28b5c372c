// src/cuda/cuda_bwd.cu — which CUDA backward kernel serves a call, its workspace, and the call.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/cuda_backend.h"
#include "flashattn/error.h"

namespace flashattn::cuda {

bool can_serve_backward(const common::AttentionParams& p, std::string* why_not) {
  (void)p;
  if (why_not) *why_not = "the CUDA backend has no backward kernel yet";
  return false;
}

std::size_t backward_workspace_size(const common::AttentionParams& p, std::int64_t total_q_rows) {
  (void)p;
  (void)total_q_rows;
  return 0;
}

void backward(const common::AttentionParams& p, std::int64_t total_q_rows, void* workspace, void* stream,
              const std::uint64_t* rng_state) {
  (void)total_q_rows;
  (void)workspace;
  (void)stream;
  (void)rng_state;
  std::string why;
  if (!can_serve_backward(p, &why)) throw Error("flashattn::backward (CUDA): " + why);
}

}  // namespace flashattn::cuda
