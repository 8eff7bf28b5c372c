// src/cuda/sm90/sm90_bwd_kernel.cuh — the Hopper backward's three kernels:
//   bwd_preprocess_kernel  softmax_d = rowsum(dO ∘ O) (the caller's output), the scratch's
//                          padded copies of lse · log2 e and softmax_d that the main kernel bulk-loads,
//                          and the dQ accumulator cleared
//   bwd_kernel             warp-specialised: one producer warpgroup (one thread issues the TMA
//                          loads) and two consumer warpgroups (sm90_bwd_mainloop.cuh)
//   bwd_postprocess_kernel dQ: the fp32 accumulator (in the consumers' fragment order) in the
//                          caller's element type
#pragma once

#include <cute/tensor.hpp>

#include "cuda/device/bwd_prepost.cuh"
#include "cuda/sm90/sm90_bwd_mainloop.cuh"

namespace flashattn::cuda::sm90 {

inline constexpr int kBwdPrepostThreads = 256;
inline constexpr int kBwdPreRows = 64;  // rows of sequence `batch` per preprocess block

// Grid (⌈rows.padded_rows / kBwdPreRows⌉, heads, batch): kHeadDim is dv here (the rows of dO and O),
// kDqDim the backward's instantiated d (the dQ accumulator's row). Besides the statistics, the
// block clears its rows of the dQ accumulator (below the row-block padding: every row the main
// kernel adds to), in 16-byte stores, instead of a memset of the whole accumulator before it. For
// the statistics, groups of device::row_dot_lanes(kHeadDim) lanes take a row each, 8 consecutive
// columns of dO and O per lane (device::SoftmaxDRows), all of a thread's rows loaded at once; the
// rows past sq up to the row-block padding get lse +∞ and softmax_d 0.
template <class Element, int kHeadDim, int kDqDim>
__global__ void __launch_bounds__(kBwdPrepostThreads)
    bwd_preprocess_kernel(const __grid_constant__ common::AttentionParams p, float* lse_log2, float* dpsum,
                          float* dq_accum, const BwdRows rows) {
  // The main kernel may launch once every block of this one has begun (bwd_dependent_launch): its
  // prologue and K/V loads then run under this kernel's tail; it waits for the end before reading
  // what this kernel writes.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  if (p.index_check_failed()) return;  // a bad index value (src/cuda/index_check.h): touch nothing
  const int head = blockIdx.y, batch = blockIdx.z;
  const int seqlen_q = p.seqlen_q(batch);
  const int padded = (seqlen_q + rows.block_m - 1) / rows.block_m * rows.block_m;
  const std::int64_t stats = std::int64_t(head) * rows.head_stride + bwd_row_start(p, rows, batch);
  {  // this block's rows of the dQ accumulator, below the padding, cleared
    const int row0 = blockIdx.x * kBwdPreRows;
    const int clear_rows = min(kBwdPreRows, padded - row0);
    if (clear_rows > 0) {
      float4* const dst = reinterpret_cast<float4*>(dq_accum + (stats + row0) * kDqDim);
      const int n = clear_rows * (kDqDim / 4);
      for (int i = int(threadIdx.x); i < n; i += kBwdPrepostThreads) dst[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
  const device::SoftmaxDRows<Element, kHeadDim, kBwdPrepostThreads, kBwdPreRows> dots(p, batch, head,
                                                                                     blockIdx.x * kBwdPreRows, seqlen_q);
  if (!dots.writer()) return;
  CUTE_UNROLL
  for (int r = 0; r < dots.kPasses; ++r) {
    const int i = dots.row(r);
    if (i >= padded) break;
    if (i >= seqlen_q) {  // padding: P = 0 there
      lse_log2[stats + i] = device::kInf;
      dpsum[stats + i] = 0.0f;
      continue;
    }
    const std::int64_t at = p.lse_index(batch, head, i);
    p.softmax_d[at] = dots.dot[r];
    dpsum[stats + i] = dots.dot[r];
    lse_log2[stats + i] = p.lse[at] * device::kLog2e;
  }
}

// Grid (rows.padded_rows / block_m, heads, batch), the consumer warpgroups' threads: thread t reads
// its dQ fragment of the row block from the accumulator (float4 v of the warpgroup's slice at
// (v · 128 + lane) · 4, as BwdMainloop::compute staged it; coalesced) and the block writes it
// through shared memory (device::StagedDq).
template <class Traits>
__global__ void __launch_bounds__(Traits::kConsumerThreads)
    bwd_postprocess_kernel(const __grid_constant__ common::AttentionParams p, const float* dq_accum, const BwdRows rows) {
  // Launched as the main kernel's dependent (bwd_dependent_launch): the accumulator is read once
  // that kernel has finished.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (p.index_check_failed()) return;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  using Staged = device::StagedDq<Element, kBlockM, kHeadDim, Traits::kConsumerThreads>;
  __shared__ alignas(16) std::uint16_t staged_tile[Staged::kElems];
  const Staged staged{staged_tile};
  const int head = blockIdx.y, batch = blockIdx.z, thread = threadIdx.x;
  const int m_start = blockIdx.x * kBlockM;
  const int seqlen_q = p.seqlen_q(batch);
  if (m_start >= seqlen_q) return;
  const int wg = thread / Traits::kWarpgroupThreads, lane = thread % Traits::kWarpgroupThreads;
  const float4* const slice = reinterpret_cast<const float4*>(
      dq_accum + (std::int64_t(head) * rows.head_stride + bwd_row_start(p, rows, batch) + m_start) * kHeadDim +
      wg * Traits::kDqFloatsPerWarpgroup);
  typename Traits::TiledMmadQ mma_dq;
  // (row, column) of each fragment element, or (column, row) where dQ was computed transposed.
  Tensor c_dq = mma_dq.get_thread_slice(thread).partition_C(
      make_identity_tensor(select<0, 1>(typename Traits::TileShapedQ{})));
  const float scale = Traits::kScaleInDs ? 1.0f : p.softmax_scale;  // dS's factor, unless dS has it
  float4 x[Traits::kDqFloatsPerThread / 4];
  CUTE_UNROLL
  for (int v = 0; v < Traits::kDqFloatsPerThread / 4; ++v) x[v] = slice[v * Traits::kWarpgroupThreads + lane];
  CUTE_UNROLL
  for (int v = 0; v < Traits::kDqFloatsPerThread / 4; ++v) {
    if constexpr (Traits::kDqTransposed) {  // element pairs are neighbouring rows of one column
      const float f[4] = {x[v].x, x[v].y, x[v].z, x[v].w};
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) staged.put_one(get<1>(c_dq(4 * v + e)), get<0>(c_dq(4 * v + e)), f[e] * scale);
    } else {
      staged.put(get<0>(c_dq(4 * v)), get<1>(c_dq(4 * v)), x[v].x * scale, x[v].y * scale);
      staged.put(get<0>(c_dq(4 * v + 2)), get<1>(c_dq(4 * v + 2)), x[v].z * scale, x[v].w * scale);
    }
  }
  staged.write(p, batch, head, m_start, seqlen_q);
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1) bwd_kernel(const __grid_constant__ BwdParams<Traits> params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Mainloop = BwdMainloop<Traits>;
  using Pipeline = typename Mainloop::Pipeline;
  // The postprocess may launch once every block of this kernel has begun (bwd_dependent_launch),
  // and waits for its end before it reads the accumulator.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  if (params.p.index_check_failed()) return;
  extern __shared__ __align__(1024) unsigned char smem_bytes[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_bytes);

  const int warp = __shfl_sync(0xffffffffu, int(threadIdx.x) / 32, 0);
  const int warpgroup = warp / 4;
  if (threadIdx.x == 0) {
    cutlass::arch::ClusterTransactionBarrier::init(&ss.kv_full, 1);
    // Every consumer thread gives a Q/dO stage back itself: besides the products, its threads
    // read the stage's lse and softmax_d with ordinary loads.
    Pipeline::init(ss.q_full, ss.q_empty, Traits::kConsumerThreads);
    Pipeline::init(ss.do_full, ss.do_empty, Traits::kConsumerThreads);
    cutlass::arch::fence_barrier_init();
  }
  if (warp == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
  }
  __syncthreads();

  const Pipeline q_pipe{ss.q_full, ss.q_empty};
  const Pipeline do_pipe{ss.do_full, ss.do_empty};
  const BwdTile t =
      BwdTile::of_block<Traits::kBlockM, Traits::kBlockN>(params.p, params.rows, params.dq_semaphores != nullptr,
                                                          params.stagger_tiles, params.tile_major, params.heads_inner);
  if (t.empty(Traits::kBlockN)) return;  // a varlen sequence with fewer keys: nothing here

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (warp == 0 && cute::elect_one_sync()) {
      Mainloop::load(params, ss, q_pipe, do_pipe, t);
    } else if (warp == kDqWriterWarp) {
      Mainloop::write_dq(params, ss, t, int(threadIdx.x) % 32);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int thread = int(threadIdx.x) - Traits::kWarpgroupThreads;
    Tensor acc_dk = partition_fragment_C(typename Traits::TiledMmadK{}, select<0, 1>(typename Traits::TileShapedK{}));
    Tensor acc_dv = partition_fragment_C(typename Traits::TiledMmadV{}, select<0, 1>(typename Traits::TileShapedV{}));
    clear(acc_dk);
    clear(acc_dv);
    Mainloop::compute(params, ss, q_pipe, do_pipe, t, thread, acc_dk, acc_dv);
    if constexpr (!Traits::kScaleInDs) {  // dS's factor, left out of the steps
      const float scale = params.p.softmax_scale;
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= scale;
    }
    Mainloop::store(params, ss, t, thread, acc_dk, acc_dv);
  }
#endif
}

}  // namespace flashattn::cuda::sm90
