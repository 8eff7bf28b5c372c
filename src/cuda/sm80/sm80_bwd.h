// src/cuda/sm80/sm80_bwd.h — the compiled sm80 backward kernels as the dispatcher sees them: one
// launcher per (storage type, instantiated head dim), defined in inst/*.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/params.h"

namespace flashattn::cuda::sm80 {

// Rows per preprocess block and the unit of the deterministic counters (per (batch, head, row block)).
inline constexpr int kBwdRowBlock = 64;
// Sequences start on a multiple of this many rows in the dQ accumulator (sm80_bwd_kernel.cuh).
inline constexpr int kBwdTileRowsHost = 128;

// Where the backward's scratch lives (device memory from the caller's workspace).
struct BwdScratch {
  float* dq_accum = nullptr;  // fp32 tiles of kBlockM rows × the instantiated head dim, per head
  std::size_t dq_accum_bytes = 0;
  int* counters = nullptr;    // (batch, heads, m_blocks) int32; nullptr unless deterministic
  std::size_t counter_bytes = 0;
  int m_blocks = 0;           // ⌈max_seqlen_q / kBwdRowBlock⌉
};

// Launches preprocess, main kernel and postprocess on stream. Returns the first launch error.
template <common::Storage kStorage, int kHeadDim>
cudaError_t run_bwd(const common::AttentionParams& p, const BwdScratch& scratch, const std::uint64_t* rng_state,
                    cudaStream_t stream);

}  // namespace flashattn::cuda::sm80
