// src/cuda/sm80/sm80_bwd.h — the compiled sm80 backward kernels as the dispatcher sees them: one
// launcher per (storage type, instantiated head dim), defined in inst/*.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"

namespace flashattn::cuda::sm80 {

// The head dims the backward is instantiated for; a call runs in the smallest one that holds
// max(d, dv).
inline constexpr int kBwdHeadDims[] = {64, 128, 256};
// Rows per row block of every backward configuration (deterministic counters are per row block).
inline constexpr int kBwdRowBlock = 64;

// Where the backward's scratch lives (device memory from the caller's workspace).
struct BwdScratch {
  float* dq_accum = nullptr;  // (total_q_rows, heads, dq_accum_ld) fp32
  int dq_accum_ld = 0;        // head_dim rounded up to 8
  int* counters = nullptr;    // (batch, heads, m_blocks) int32; nullptr unless deterministic
  int m_blocks = 0;           // ⌈max_seqlen_q / kBwdRowBlock⌉
};

// Launches preprocess, main kernel and postprocess on stream. Returns the first launch error.
template <common::Storage kStorage, int kHeadDim>
cudaError_t run_bwd(const common::AttentionParams& p, const BwdScratch& scratch, const std::uint64_t* rng_state,
                    cudaStream_t stream);

}  // namespace flashattn::cuda::sm80
