// src/cuda/sm80/sm80_fwd_launch.cuh — tile configuration per head dim and the launcher of the
// sm80 forward kernel. Included by the instantiation files in inst/, one (dtype, head dim) each.
#pragma once

#include "cuda/sm80/sm80_fwd.h"
#include "cuda/sm80/sm80_fwd_kernel.cuh"

namespace flashattn::cuda::sm80 {

template <common::Storage kStorage>
struct ElementOf;
template <>
struct ElementOf<common::Storage::f16> {
  using type = cutlass::half_t;
};
template <>
struct ElementOf<common::Storage::bf16> {
  using type = cutlass::bfloat16_t;
};

// Tiles per head dim (kBlockM × kBlockN, warps) and their shared memory, for the plain variant:
//   d 64:  128 × 128, 4 warps —  48 KB (Q 16 + K 16 + V 16)
//   d 128: 128 × 64,  4 warps —  64 KB: 32 rows per warp keeps the 128 fp32 of O in registers
//   d 256: 128 × 64,  8 warps — 128 KB: 16 rows per warp, as the O accumulator doubles
// With softcap / ALiBi / dropout compiled in (kFull), the key tile is halved: the Philox state and
// per-element coordinates need the registers that half of the score tile gave back.
// All fit the 163 KB of an A100 and the 227 KB of an H100/H200.
template <class Element, int kHeadDim, bool kFull>
struct FwdConfig;
template <class Element, bool kFull>
struct FwdConfig<Element, 64, kFull> {
  using Traits = FwdTraits<Element, 64, 128, kFull ? 64 : 128, 4>;
};
template <class Element, bool kFull>
struct FwdConfig<Element, 128, kFull> {
  using Traits = FwdTraits<Element, 128, 128, kFull ? 32 : 64, 4>;
};
template <class Element, bool kFull>
struct FwdConfig<Element, 256, kFull> {
  using Traits = FwdTraits<Element, 256, 128, kFull ? 32 : 64, 8>;
};

template <class Traits, bool kFull>
cudaError_t launch_fwd(const common::AttentionParams& p, const std::uint64_t* rng_state, cudaStream_t stream) {
  constexpr int kDefaultSmemLimit = 48 * 1024;  // above this a kernel must opt in
  auto* kernel = &fwd_kernel<Traits, kFull>;
  if constexpr (Traits::kSmemBytes > kDefaultSmemLimit) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid((p.max_seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p.heads, p.batch);
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(p, rng_state);
  return cudaGetLastError();
}

template <common::Storage kStorage, int kHeadDim>
cudaError_t run_fwd(const common::AttentionParams& p, const std::uint64_t* rng_state, cudaStream_t stream) {
  using Element = typename ElementOf<kStorage>::type;
  const bool full = p.softcap > 0.0f || p.alibi_slopes != nullptr || p.dropout_p > 0.0f;
  return full ? launch_fwd<typename FwdConfig<Element, kHeadDim, true>::Traits, true>(p, rng_state, stream)
              : launch_fwd<typename FwdConfig<Element, kHeadDim, false>::Traits, false>(p, rng_state, stream);
}

}  // namespace flashattn::cuda::sm80
