// src/cuda/sm80/sm80_bwd_launch.cuh — tile configuration per head dim and the launcher of the sm80
// backward. Included by the instantiation files in inst/, one (dtype, head dim) each.
#pragma once

#include "cuda/sm80/sm80_bwd.h"
#include "cuda/sm80/sm80_smem.h"
#include "cuda/sm80/sm80_bwd_kernel.cuh"
#include "cuda/sm80/sm80_fwd_launch.cuh"

namespace flashattn::cuda::sm80 {

static_assert(kBwdRowBlock == kBwdBlockM && kBwdTileRowsHost == kBwdTileRows, "host and device agree on the layout");

// Tiles, warp arrangements and schedules per head dim: bwd_tuning (sm80_tuning.h; warps of S/dP
// along rows × keys, of dK/dV along keys × D, of dQ along rows × D). Where a device has less shared
// memory per block, launch_bwd_variant takes one stage or the full variant's smaller tiles
// (sm80_bwd.h lists the order and the sizes).
// The arrangements keep each warp's ldmatrix traffic low for its MMAs: at d 256, dK/dV warps split
// the keys in two and D in four, as the D-wide operands (Qᵀ, dOᵀ) dominate the shared reads.
// At d 256 dQ (64 × 256 fp32, 64 atomics per thread and row block) is computed first and its
// atomics are spread over the k-steps of dV and dK (spread_dq), and the next row block's copies are
// issued after S/dP (late_load): the S/dP phase is bound by ldmatrix traffic, dV/dK by the tensor
// cores, so the global traffic goes where the shared-memory pipe has room. d 128 (plain variant)
// spreads its dQ atomics too: in the plain order its main loop reloaded 12 spilled values per
// iteration (6 spread; 5 with late_load as well, but a 9% longer loop), and Nsight Compute showed
// its warps stalled on the load/store queue (lg_throttle 0.34 per instruction against FA2's 0.01)
// behind the burst of 32 atomics per thread. d 64 spreads them as well, with its S/dP warps as
// 2 × 4 (4 bytes of spills instead of 100): +4.7% on the H200 over the plain order with 4 × 2.
// With softcap / ALiBi / dropout compiled in (kFull) the tiles shrink (the per-element dscore/ddot
// and the Philox state need registers), and the S/dP product's MMA tiles are paired (kPairedN: one
// Philox call per 16 × 16 dropout block).
template <class Element, int kHeadDim, bool kFull, int kStages, bool kSmall = false>
struct BwdConfig {
  static constexpr BwdTile kTile = bwd_tile(kHeadDim, kFull, kSmall);
  static constexpr BwdSchedule kSchedule = kFull ? bwd_tuning(kHeadDim).full : bwd_tuning(kHeadDim).plain;
  using Traits = BwdTraits<Element, kHeadDim, kTile.block_m, kTile.block_n, kSchedule.sdp_warps_m,
                           kSchedule.dkv_warps_n, kSchedule.dq_warps_m, kStages, kSchedule.spread_dq,
                           kSchedule.late_load, kFull>;
};

template <class Traits, bool kFull>
cudaError_t launch_bwd_main(const common::AttentionParams& p, const BwdScratch& ws, const std::uint64_t* rng_state,
                            cudaStream_t stream) {
  constexpr int kDefaultSmemLimit = 48 * 1024;
  auto* kernel = &bwd_kernel<Traits, kFull, !kFull && bwd_tuning(Traits::kHeadDim).plain_scoremod>;
  if constexpr (Traits::kSmemBytes > kDefaultSmemLimit) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid((p.max_seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN, p.heads_k, p.batch);
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(p, ws.dq_accum, ws.counters, ws.m_blocks,
                                                                  rng_state);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.max_seqlen_q == 0) return err;
  const dim3 row_grid((p.max_seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p.heads, p.batch);
  bwd_postprocess_kernel<Traits><<<row_grid, Traits::kNThreads, 0, stream>>>(p, ws.dq_accum);
  return cudaGetLastError();
}

// The configuration of (Element, kHeadDim, kFull, kStages), its shared memory checked against the
// host's bwd_smem_bytes.
template <class Element, int kHeadDim, bool kFull, int kStages, bool kSmall = false>
using BwdTraitsOf = typename BwdConfig<Element, kHeadDim, kFull, kStages, kSmall>::Traits;
template <class Traits, int kHeadDim, bool kFull, bool kSmall = false>
constexpr bool kBwdSmemAgrees =
    Traits::kSmemBytes == bwd_smem_bytes(kHeadDim, bwd_tile(kHeadDim, kFull, kSmall), Traits::kStages);

// The configuration bwd_choice (sm80_bwd.h) picks for p on this device.
template <class Element, int kHeadDim>
cudaError_t launch_bwd_variant(const common::AttentionParams& p, const BwdScratch& ws, const std::uint64_t* rng_state,
                               cudaStream_t stream) {
  const bool needs_full = bwd_tuning(kHeadDim).plain_scoremod
                              ? p.dropout_p > 0.0f
                              : p.softcap > 0.0f || p.alibi_slopes != nullptr || p.dropout_p > 0.0f;
  const BwdChoice choice = bwd_choice(kHeadDim, needs_full, smem_per_block_limit());
  using Plain2 = BwdTraitsOf<Element, kHeadDim, false, 2>;
  using Full2 = BwdTraitsOf<Element, kHeadDim, true, 2>;
  static_assert(kBwdSmemAgrees<Plain2, kHeadDim, false> && kBwdSmemAgrees<Full2, kHeadDim, true>,
                "bwd_smem_bytes (host side) agrees with the kernel's shared memory");
  if (!choice.full) {
    if constexpr (bwd_has_one_stage(kHeadDim, false)) {
      using Plain1 = BwdTraitsOf<Element, kHeadDim, false, 1>;
      static_assert(kBwdSmemAgrees<Plain1, kHeadDim, false>, "bwd_smem_bytes agrees with the kernel");
      if (choice.stages == 1) return launch_bwd_main<Plain1, false>(p, ws, rng_state, stream);
    }
    return launch_bwd_main<Plain2, false>(p, ws, rng_state, stream);
  }
  if constexpr (bwd_has_small(kHeadDim)) {
    using Small1 = BwdTraitsOf<Element, kHeadDim, true, 1, true>;
    static_assert(kBwdSmemAgrees<Small1, kHeadDim, true, true>, "bwd_smem_bytes agrees with the kernel");
    if (choice.small) return launch_bwd_main<Small1, true>(p, ws, rng_state, stream);
  }
  if constexpr (bwd_has_one_stage(kHeadDim, true)) {
    using Full1 = BwdTraitsOf<Element, kHeadDim, true, 1>;
    static_assert(kBwdSmemAgrees<Full1, kHeadDim, true>, "bwd_smem_bytes agrees with the kernel");
    if (choice.stages == 1) return launch_bwd_main<Full1, true>(p, ws, rng_state, stream);
  }
  return launch_bwd_main<Full2, true>(p, ws, rng_state, stream);
}

template <common::Storage kStorage, int kHeadDim>
cudaError_t run_bwd(const common::AttentionParams& p, const BwdScratch& ws, const std::uint64_t* rng_state,
                    cudaStream_t stream) {
  using Element = typename ElementOf<kStorage>::type;
  // The accumulator and the counters start at zero; no query rows (sq = 0): no softmax_d or dQ to
  // produce, but dK = dV = 0 still to write.
  cudaError_t err = cudaMemsetAsync(ws.dq_accum, 0, ws.dq_accum_bytes, stream);
  if (err == cudaSuccess && ws.counters != nullptr) err = cudaMemsetAsync(ws.counters, 0, ws.counter_bytes, stream);
  if (err != cudaSuccess) return err;
  if (ws.m_blocks > 0) {
    bwd_preprocess_kernel<Element, kHeadDim><<<dim3(ws.m_blocks, p.heads, p.batch), kBwdThreads, 0, stream>>>(p);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (p.max_seqlen_k > 0) return launch_bwd_variant<Element, kHeadDim>(p, ws, rng_state, stream);
  // No keys: dQ = 0 (the cleared accumulator, converted).
  if (ws.m_blocks == 0) return cudaSuccess;
  using Traits = typename BwdConfig<Element, kHeadDim, false, 2>::Traits;
  bwd_postprocess_kernel<Traits><<<dim3((p.max_seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p.heads, p.batch),
                                   Traits::kNThreads, 0, stream>>>(p, ws.dq_accum);
  return cudaGetLastError();
}

}  // namespace flashattn::cuda::sm80
