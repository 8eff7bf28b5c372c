// src/cuda/sm80/sm80_fwd.h — the compiled sm80 forward kernels as the dispatcher sees them: one
// launcher per (storage type, instantiated head dim), defined in inst/*.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"

namespace flashattn::cuda::sm80 {

// The head dims the forward kernel is instantiated for; a call runs in the smallest one that
// holds max(d, dv).
inline constexpr int kFwdHeadDims[] = {64, 128, 256};

// Launches the forward kernel for p (device pointers) on stream. Returns the launch status.
template <common::Storage kStorage, int kHeadDim>
cudaError_t run_fwd(const common::AttentionParams& p, const std::uint64_t* rng_state, cudaStream_t stream);

}  // namespace flashattn::cuda::sm80
