// src/cuda/sm90/sm90_fwd_kernel.cuh — the Hopper forward kernel (warp-specialised, TMA + wgmma):
// one producer warpgroup, of which one thread issues every TMA load, and kConsumerWarpgroups
// consumer warpgroups of 64 query rows each that compute S, the online softmax and O (with
// FLASHATTN_SM90_FWD_TMA_STORE, one thread of the producer's warp 1 stores each tile's O). The body
// only orchestrates: loads and products in sm90_fwd_mainloop.cuh, softmax in sm90_softmax.cuh,
// the output in sm90_fwd_epilogue.cuh, the tile in sm90_tile_scheduler.cuh.
#pragma once

#include <cute/tensor.hpp>

#include "cuda/sm90/sm90_fwd_epilogue.cuh"
#include "cuda/sm90/sm90_fwd_mainloop.cuh"

namespace flashattn::cuda::sm90 {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1) fwd_kernel(const __grid_constant__ FwdParams<Traits> params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Mainloop = FwdMainloop<Traits>;
  using Pipeline = typename Mainloop::Pipeline;
  using Scheduler = PersistentTileScheduler<Traits::kBlockM, Traits::kBlockN>;
  // The dynamic schedule's readers of each ring slot: every consumer warp, and the O storer.
  constexpr int kRingReaders = 4 * Traits::kConsumerWarpgroups + (Traits::kTmaStoreO ? 1 : 0);
  if (params.p.index_check_failed()) return;  // a bad index value (src/cuda/index_check.h): touch nothing
  extern __shared__ __align__(1024) unsigned char smem_bytes[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_bytes);

  // Warp-uniform indices (the shuffle tells the compiler they are uniform).
  const int warp = __shfl_sync(0xffffffffu, int(threadIdx.x) / 32, 0);
  const int warpgroup = warp / 4;

  if (threadIdx.x == 0) {
    for (int b = 0; b < Traits::kQStages; ++b) {
      cutlass::arch::ClusterTransactionBarrier::init(&ss.q_full[b], 1);
      // With O stored by TMA from Q's bytes, the storing thread alone gives the buffer back.
      cutlass::arch::ClusterBarrier::init(&ss.q_empty[b], Traits::kTmaStoreO && !Traits::kSeparateO
                                                              ? 1 : Traits::kConsumerWarpgroups);
      cutlass::arch::ClusterBarrier::init(&ss.o_full[b], Traits::kConsumerWarpgroups);
    }
    if constexpr (Traits::kTmaStoreO && Traits::kSeparateO) {
      cutlass::arch::ClusterBarrier::init(&ss.o_empty, 1);  // the storer gives O's own tile back
    }
    if constexpr (kFwdDynamic) {
      for (int i = 0; i < kFwdTileSlots; ++i) {
        cutlass::arch::ClusterBarrier::init(&ss.ring.full[i], 1);
        cutlass::arch::ClusterBarrier::init(&ss.ring.empty[i], kRingReaders);
      }
    }
    Pipeline::init(ss.k_full, ss.k_empty, Traits::kConsumerWarpgroups);
    Pipeline::init(ss.v_full, ss.v_empty, Traits::kConsumerWarpgroups);
    cutlass::arch::fence_barrier_init();
  }
  if (warp == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    if constexpr (Traits::kWideChunks) {
      if (params.wide_pages) {
        cute::prefetch_tma_descriptor(params.tma_k_wide.get_tma_descriptor());
        cute::prefetch_tma_descriptor(params.tma_v_wide.get_tma_descriptor());
      }
    }
  }
  __syncthreads();

  const Pipeline k_pipe{ss.k_full, ss.k_empty};
  const Pipeline v_pipe{ss.v_full, ss.v_empty};
  // Split-KV: every tile of the order taken once per split (the split innermost).
  int splits = 1;
  if constexpr (Traits::kSplit) splits = params.split.num_splits;
  const int tiles = Scheduler::tiles(params.p) * splits;
  // Both sides skip tiles without a visible key (no loads, no barriers) and count the others: that
  // count gives a tile its Q buffer and the phase of the buffer's barriers (Traits::q_buffer).
  std::uint32_t loaded = 0;

  // Tile `index` of the order.
  auto tile_of = [&](int index) {
    const FwdTileDivisors* divisors = nullptr;
    if constexpr (Traits::kFastDivmod) divisors = &params.divisors;
    return Scheduler::template tile<Traits::kPaged, Traits::kSplit>(params.p, index, params.section,
                                                                    params.section_rising, splits, divisors);
  };
  // The CTA's tile of round `round`, or of a later round where that one has none or an empty one
  // (round then moves past it); false when no tile is left. The producer's and the O storer's walk.
  auto next_tile = [&](int& round, FwdTile& t) {
    for (; round * int(gridDim.x) < tiles; ++round) {
      const int index = Scheduler::index(round, blockIdx.x, gridDim.x, params.snake);
      if (index >= tiles) continue;
      t = tile_of(index);
      if (!t.empty()) {
        ++round;
        return true;
      }
    }
    return false;
  };

  // The dynamic schedule (kFwdDynamic and a counter for this call, sm90_fwd.h). The CTA's n-th
  // tile index: its own index first, then gridDim.x plus the counter's value (−1 past the order). A
  // launch fetches from the counter `tiles` times in all — each CTA until its first fetch past the
  // order — so the fetch that returns tiles − 1 is its last, and resets the counter for the next
  // launch. Every index goes through the ring in the order fetched, empty tiles' too (their rows
  // still get an output).
  [[maybe_unused]] const bool dynamic = kFwdDynamic && params.tile_counter != nullptr;
  [[maybe_unused]] std::uint32_t ring_n = 0;  // ring slots this thread has written or taken
  [[maybe_unused]] bool fetched_first = false;
  [[maybe_unused]] auto fetch = [&]() {
    int index = int(blockIdx.x);
    if (fetched_first) {
      const int v = atomicAdd(params.tile_counter, 1);
      if (v == tiles - 1) atomicExch(params.tile_counter, 0);
      index = int(gridDim.x) + v;
    }
    fetched_first = true;
    return index < tiles ? index : -1;
  };
  // The producer's write of `index` into the next slot, once every reader has taken the slot's
  // previous index. It may wait for the consumers, so it comes only after the loads of every tile
  // published before it have been issued (a consumer waiting for a load that the producer would
  // issue after its wait would never free a slot).
  [[maybe_unused]] auto publish = [&](int index) {
    if constexpr (kFwdDynamic) {
      const int slot = int(ring_n % kFwdTileSlots);
      cutlass::arch::ClusterBarrier::wait(&ss.ring.empty[slot], ((ring_n / kFwdTileSlots) & 1u) ^ 1u);
      ss.ring.index[slot] = index;
      cutlass::arch::ClusterBarrier::arrive(&ss.ring.full[slot]);
    }
    ++ring_n;
  };
  // A reader's next index from the ring (−1: none left). A warp's lane 0 reads the slot, hands the
  // index to the other lanes and gives the slot back (one arrival per reading warp, or the storer's
  // one thread): the thread that frees the slot is the only one that read it, an order that
  // compute-sanitizer's racecheck follows (a read by every lane, a __syncwarp and lane 0's arrival
  // are ordered just as well, but racecheck reported the other lanes' reads as racing the next
  // write).
  [[maybe_unused]] auto take = [&](bool whole_warp) {
    int index = -1;
    if constexpr (kFwdDynamic) {
      const int slot = int(ring_n % kFwdTileSlots);
      cutlass::arch::ClusterBarrier::wait(&ss.ring.full[slot], (ring_n / kFwdTileSlots) & 1u);
      const bool reader = !whole_warp || threadIdx.x % 32 == 0;
      if (reader) {
        index = ss.ring.index[slot];
        cutlass::arch::ClusterBarrier::arrive(&ss.ring.empty[slot]);
      }
      if (whole_warp) index = __shfl_sync(0xffffffffu, index, 0);
    }
    ++ring_n;
    return index;
  };
  if (warpgroup == 0) {
    // Producer: registers go to the consumers; one elected thread of warp 0 issues the loads.
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (warp == 0 && cute::elect_one_sync()) {
      PipelineState<Traits::kStages> st = Pipeline::producer_start();
      if (dynamic) {
        if constexpr (kFwdDynamic) {
          // Each index published once the loads of the tiles before it are issued; with two Q
          // buffers a non-empty next tile's Q loads during this tile's loads, before its index is
          // published (the consumers find it by the count of non-empty tiles, as in the walk).
          int index = fetch();
          publish(index);
          FwdTile t = index >= 0 ? tile_of(index) : FwdTile{};
          bool q_loaded = false;
          while (index >= 0) {
            if (t.empty()) {
              index = fetch();
              publish(index);
              if (index >= 0) t = tile_of(index);
              continue;
            }
            // The next index is fetched before this tile's loads (the atomic's latency hidden
            // behind them) and published after them.
            const int next_index = fetch();
            const FwdTile next = next_index >= 0 ? tile_of(next_index) : t;
            const bool have_next = Traits::kQStages == 2 && next_index >= 0 && !next.empty();
            Mainloop::load(params, ss, k_pipe, v_pipe, t, loaded++, q_loaded, next, have_next, st);
            publish(next_index);
            q_loaded = have_next;
            index = next_index;
            t = next;
          }
        }
      } else if constexpr (Traits::kQStages == 1) {
        // (Round by round rather than through next_tile: ptxas spills less in the score-mod
        // kernels this way: 64 / 56 bytes at d 128, against 92 / 76.)
        for (int round = 0; round * int(gridDim.x) < tiles; ++round) {
          const int index = Scheduler::index(round, blockIdx.x, gridDim.x, params.snake);
          if (index >= tiles) continue;
          const FwdTile t = tile_of(index);
          if (t.empty()) continue;
          Mainloop::load(params, ss, k_pipe, v_pipe, t, loaded++, false, t, false, st);
        }
      } else {
        // Two Q buffers: each tile's load also gives the next non-empty tile its Q.
        int round = 0;
        FwdTile t, next;
        bool have = next_tile(round, t), q_loaded = false;
        while (have) {
          const bool have_next = next_tile(round, next);
          Mainloop::load(params, ss, k_pipe, v_pipe, t, loaded++, q_loaded, next, have_next, st);
          q_loaded = have_next;
          t = next;
          have = have_next;
        }
      }
    } else if (Traits::kTmaStoreO && warp == kOStoreWarp && cute::elect_one_sync()) {
      // O of each non-empty tile, once staged, by one TMA store (FwdEpilogue::tma_store).
      int round = 0;
      FwdTile t;
      auto next_stored = [&] {
        if constexpr (kFwdDynamic) {
          if (dynamic) {
            for (int index = take(false); index >= 0; index = take(false)) {
              t = tile_of(index);
              if (!t.empty()) return true;
            }
            return false;
          }
        }
        return next_tile(round, t);
      };
      for (std::uint32_t stored = 0; next_stored(); ++stored) FwdEpilogue<Traits>::tma_store(params, ss, t, stored);
      FwdEpilogue<Traits>::tma_store_tail();
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int thread = int(threadIdx.x) - Traits::kWarpgroupThreads;
    const int consumer_wg = warpgroup - 1;
    PipelineState<Traits::kStages> k_st, v_st;
    Mainloop::pingpong_start(consumer_wg);
    for (int round = 0; dynamic || round * int(gridDim.x) < tiles; ++round) {
      // Dynamic: every index the ring holds, empty tiles included (their rows still get an output).
      const int index = dynamic ? take(true) : Scheduler::index(round, blockIdx.x, gridDim.x, params.snake);
      if (dynamic && index < 0) break;
      if (index >= tiles) continue;
      const FwdTile t = tile_of(index);
      typename Traits::TiledMmaPV mma_pv;
      Tensor acc_o = partition_fragment_C(mma_pv, select<0, 1>(typename Traits::TileShapePV{}));  // ((2,2,dv/8), 1, 1)
      OnlineSoftmax<2, Traits::kLazyRescale> softmax(params.scale_log2);
      const std::uint32_t count = loaded;
      if (!t.empty()) {
        Mainloop::compute(params, ss, k_pipe, v_pipe, t, thread, count, k_st, v_st, acc_o, softmax);
        ++loaded;
      }
      FwdEpilogue<Traits>::store(params, ss, t, thread, count, acc_o, softmax);
    }
    Mainloop::pingpong_finish(consumer_wg);
  }
#endif
}

}  // namespace flashattn::cuda::sm90
