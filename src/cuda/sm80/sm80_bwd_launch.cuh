// src/cuda/sm80/sm80_bwd_launch.cuh — tile configuration per head dim and the launcher of the sm80
// backward. Included by the instantiation files in inst/, one (dtype, head dim) each.
#pragma once

#include "cuda/sm80/sm80_bwd.h"
#include "cuda/sm80/sm80_bwd_kernel.cuh"
#include "cuda/sm80/sm80_fwd_launch.cuh"

namespace flashattn::cuda::sm80 {

static_assert(kBwdRowBlock == kBwdBlockM, "the dispatcher's row block is the kernels' row block");

// Tiles per head dim: kBlockM = 64 rows × kBlockN keys, 8 warps, and their shared memory
// (Q + dO + K + V + P + dS):
//   d 64:  64 × 128 —  80 KB
//   d 128: 64 × 128 — 128 KB (dK and dV: 64 + 64 fp32 registers per thread)
//   d 256: 64 × 64  — 144 KB
// With softcap / ALiBi / dropout compiled in (kFull) the key tile halves for d ≥ 128: the per-element
// dscore/ddot and the Philox state need registers. All fit an A100's 163 KB.
template <class Element, int kHeadDim, bool kFull>
struct BwdConfig;
template <class Element, bool kFull>
struct BwdConfig<Element, 64, kFull> {
  using Traits = BwdTraits<Element, 64, 128, 2, 4>;
};
template <class Element, bool kFull>
struct BwdConfig<Element, 128, kFull> {
  using Traits = BwdTraits<Element, 128, kFull ? 64 : 128, 2, 4>;
};
template <class Element>
struct BwdConfig<Element, 256, false> {
  using Traits = BwdTraits<Element, 256, 64, 2, 4>;
};
template <class Element>
struct BwdConfig<Element, 256, true> {
  using Traits = BwdTraits<Element, 256, 32, 4, 2>;
};

template <class Traits, bool kFull>
cudaError_t launch_bwd_main(const common::AttentionParams& p, const BwdScratch& ws, const std::uint64_t* rng_state,
                            cudaStream_t stream) {
  constexpr int kDefaultSmemLimit = 48 * 1024;
  auto* kernel = &bwd_kernel<Traits, kFull>;
  if constexpr (Traits::kSmemBytes > kDefaultSmemLimit) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid((p.max_seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, p.heads_k, p.batch);
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(p, ws.dq_accum, ws.dq_accum_ld, ws.counters,
                                                                  ws.m_blocks, rng_state);
  return cudaGetLastError();
}

template <common::Storage kStorage, int kHeadDim>
cudaError_t run_bwd(const common::AttentionParams& p, const BwdScratch& ws, const std::uint64_t* rng_state,
                    cudaStream_t stream) {
  using Element = typename ElementOf<kStorage>::type;
  // No query rows (sq = 0): no softmax_d or dQ to produce, but dK = dV = 0 still to write.
  const bool has_rows = ws.m_blocks > 0;
  const dim3 row_grid(ws.m_blocks, p.heads, p.batch);
  cudaError_t err = cudaSuccess;
  if (has_rows) {
    bwd_preprocess_kernel<Element><<<row_grid, kBwdThreads, 0, stream>>>(p, ws.dq_accum, ws.dq_accum_ld, ws.counters,
                                                                          ws.m_blocks);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (p.max_seqlen_k > 0) {
    const bool full = p.softcap > 0.0f || p.alibi_slopes != nullptr || p.dropout_p > 0.0f;
    err = full ? launch_bwd_main<typename BwdConfig<Element, kHeadDim, true>::Traits, true>(p, ws, rng_state, stream)
               : launch_bwd_main<typename BwdConfig<Element, kHeadDim, false>::Traits, false>(p, ws, rng_state, stream);
    if (err != cudaSuccess) return err;
  }
  if (has_rows) bwd_postprocess_kernel<Element><<<row_grid, kBwdThreads, 0, stream>>>(p, ws.dq_accum, ws.dq_accum_ld);
  return cudaGetLastError();
}

}  // namespace flashattn::cuda::sm80
