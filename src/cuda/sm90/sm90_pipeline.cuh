// src/cuda/sm90/sm90_pipeline.cuh — the synchronisation of the Hopper kernels: a ring of shared-
// memory stages on mbarriers (one producer thread issuing TMA loads, consumer warpgroups
// releasing stages), named barriers between warpgroups, and the wgmma issue/wait wrappers.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
// The wgmma shapes whose N is not a multiple of 32 (ss_op), which the headers above include only
// under CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED.
#include <cute/arch/mma_sm90_gmma_ext.hpp>
#include <cute/atom/mma_traits_sm90_gmma_ext.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cstdint>
#include <type_traits>

namespace flashattn::cuda::sm90 {

using namespace cute;

// The SS wgmma of a warpgroup's (M, N, K) tile: CuTe's selector, but for N = 80 (the backward's
// 80-row tile, the forward's 80-key d 256 tile), which the selector offers only where
// CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED is defined before its header (else it takes N = 16: five
// times as many instructions): that atom by name.
template <class Element, class Shape, GMMA::Major kMajorA = GMMA::Major::K, GMMA::Major kMajorB = GMMA::Major::K>
constexpr auto ss_op() {
  if constexpr (decltype(size<1>(Shape{}))::value == 80) {
    if constexpr (std::is_same_v<Element, cutlass::half_t>) {
      return SM90::GMMA::MMA_64x80x16_F32F16F16_SS<kMajorA, kMajorB>{};
    } else {
      static_assert(std::is_same_v<Element, cutlass::bfloat16_t>, "fp16 or bf16");
      return SM90::GMMA::MMA_64x80x16_F32BF16BF16_SS<kMajorA, kMajorB>{};
    }
  } else {
    return SM90::GMMA::ss_op_selector<Element, Element, float, Shape, kMajorA, kMajorB>();
  }
}

// Position in a ring of kStages stages: the stage index and the phase parity of its barriers,
// which flips each time the index wraps.
template <int kStages>
struct PipelineState {
  int index = 0;
  std::uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1u;
    }
  }
};

// A ring of kStages buffers filled by TMA and drained by kConsumers warpgroups. full[s] completes
// when the bytes of stage s have landed (one arrival with the expected transaction bytes, then the
// TMA unit's completions); empty[s] when every consumer warpgroup has released it (one arrival per
// warpgroup, by its first thread, after the warpgroup's wgmma reading the stage has completed).
//
// The producer starts at phase 1: waiting on parity 1 of a fresh barrier returns at once (the
// "previous" phase counts as complete), so the first kStages acquires do not wait.
template <int kStages>
struct TmaPipeline {
  std::uint64_t* full;
  std::uint64_t* empty;

  // One thread, before any use; a fence and a CTA barrier must follow.
  __device__ static void init(std::uint64_t* full, std::uint64_t* empty, int consumers) {
    for (int s = 0; s < kStages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&full[s], 1);
      cutlass::arch::ClusterBarrier::init(&empty[s], consumers);
    }
  }
  static __device__ __forceinline__ PipelineState<kStages> producer_start() { return {0, 1u}; }

  // Producer: wait until the stage is free, then announce `bytes` of TMA traffic on its full
  // barrier. Returns the barrier the TMA copies complete on.
  __device__ __forceinline__ std::uint64_t& producer_acquire(PipelineState<kStages> st, std::uint32_t bytes) const {
    cutlass::arch::ClusterBarrier::wait(&empty[st.index], st.phase);
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&full[st.index], bytes);
    return full[st.index];
  }
  // Consumer: wait until the stage's bytes have landed.
  __device__ __forceinline__ void consumer_wait(PipelineState<kStages> st) const {
    cutlass::arch::ClusterBarrier::wait(&full[st.index], st.phase);
  }
  // Consumer warpgroup: give the stage back (call with every thread of the warpgroup, after the
  // wgmma that read it has been waited for; one thread arrives).
  __device__ __forceinline__ void consumer_release(PipelineState<kStages> st, bool warpgroup_leader) const {
    if (warpgroup_leader) cutlass::arch::ClusterBarrier::arrive(&empty[st.index]);
  }
};

// The registers a CTA of `threads` threads holds at launch (one CTA per SM): each thread gets the
// 64K-register file's share rounded down to the allocation unit of 8. setmaxnreg moves registers
// between warpgroups inside that pool only: a warpgroup whose increase the pool cannot cover
// waits in setmaxnreg for ever (a producer at 32 registers beside two consumer warpgroups at 240
// asks 64K of a 384-thread CTA's 63K, and hung).
constexpr int setmaxnreg_pool(int threads) { return threads * (64 * 1024 / threads / 8 * 8); }

// Named barriers (ids 1…15; 0 is __syncthreads). `threads` must be the exact number of threads
// that meet there, a multiple of 32.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// The named barrier ids of the forward kernel.
enum class FwdBarrier : int {
  kEpilogueWg0 = 1,  // + warpgroup index: a consumer warpgroup's O staging in shared memory
  kSchedulerWg0 = 4,  // + warpgroup index: ping-pong turns of the consumer warpgroups
  kVTail = 6,         // all consumers: a V tile's rows past the sequence zeroed
};

// acc (+)= A · B on the tensor cores, issued by the whole warpgroup. tA: register fragment (RS)
// or shared-memory descriptors (SS); tB: descriptors. kZeroInit: acc is overwritten. The product
// is committed as one group but not waited for: the caller waits with warpgroup_wait<N>().
template <bool kZeroInit, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma(TiledMma& tiled_mma, const TA& tA, const TB& tB, TC& acc) {
  // SS: tA holds shared-memory descriptors; RS: 16-bit values in registers.
  constexpr bool kRegisterA = !std::is_same_v<std::remove_cv_t<typename TA::value_type>, GMMA::DescriptorIterator::value_type>;
  if constexpr (kRegisterA) cute::warpgroup_fence_operand(const_cast<TA&>(tA));
  cute::warpgroup_fence_operand(acc);
  // wgmma.fence: registers written by ordinary instructions (the accumulator, an RS operand) are
  // visible to the wgmma that follows.
  cute::warpgroup_arrive();
  if constexpr (kZeroInit) tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tA); ++k) {
    cute::gemm(tiled_mma, tA(_, _, k), tB(_, _, k), acc);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_fence_operand(acc);
  if constexpr (kRegisterA) cute::warpgroup_fence_operand(const_cast<TA&>(tA));
}

}  // namespace flashattn::cuda::sm90
