// src/cuda/sm90/sm90_fwd_epilogue.cuh — the Hopper forward's epilogue: O normalised in registers,
// lse from the row statistics, O staged through shared memory (stmatrix into a swizzled tile: O's
// own, or the one that held Q) and written with 16-byte stores of whole rows, skipping rows past the
// sequence, or by one TMA store per tile from the producer warpgroup (Traits::kTmaStoreO).
#pragma once

#include <cute/tensor.hpp>

#include "cuda/sm90/sm90_fwd_mainloop.cuh"

namespace flashattn::cuda::sm90 {

// The warp of the producer warpgroup that stores O by TMA (Traits::kTmaStoreO); warp 0 loads.
inline constexpr int kOStoreWarp = 1;

template <class Traits>
struct FwdEpilogue {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDimV = Traits::kHeadDimV;  // O's columns
  static constexpr int kRowsPerWg = Traits::kRowsPerWarpgroup;
  static constexpr int kWgThreads = Traits::kWarpgroupThreads;

  // acc_o: this thread's fp32 O fragment; thread: index among the consumer threads. Each
  // warpgroup stages and stores its own 64 rows, so the warpgroups never wait for each other.
  // Staged apart from Q, O waits only for the warpgroup's reads of the previous tile's O; staged
  // in Q's bytes, the rows it overwrites are the warpgroup's own, read by its last Q·Kᵀ, which has
  // completed, and Q is given back once the rows are written out.
  // count: the tile's place among the CTA's non-empty tiles (its Q buffer: Traits::q_buffer).
  template <class AccO, class Softmax>
  __device__ static void store(const FwdParams<Traits>& params, typename Traits::SharedStorage& ss,
                               const FwdTile& t, int thread, std::uint32_t count, AccO& acc_o, Softmax& softmax) {
    if constexpr (Traits::kSplit) {
      store_partials(params, ss, t, thread, count, acc_o, softmax);
      return;
    }
    const common::AttentionParams& p = params.p;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_pv = mma_pv.get_thread_slice(thread);
    Tensor acc_o_rc = make_tensor(acc_o.data(), rowcol_layout(acc_o.layout()));  // (rows, cols)
    constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
    float lse[kRows];
    softmax.finalize(acc_o_rc, lse, Traits::kScoreMod && p.dropout_p > 0.0f ? p.dropout.keep_scale : 1.0f);

    const int m_start = t.m_block * kBlockM;
    Tensor c_o = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
    Tensor c_rc = make_tensor(c_o.data(), rowcol_layout(c_o.layout()));
    if (p.lse != nullptr && thread % 4 == 0) {
      float* const lse_rows = p.lse + p.lse_index_at(t.batch, Traits::kVarlen ? t.q_row0 : 0, t.head, m_start);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = get<0>(c_rc(r, 0));
        if (m_start + row < t.seqlen_q) lse_rows[row] = lse[r];
      }
    }

    // Shared memory → global: 16 bytes (8 elements) per thread and access, kChunks threads per
    // row, consecutive rows for consecutive thread groups. Where kChunks does not divide the
    // warpgroup (dv 96: 12), the last kWgThreads % kChunks threads idle and the last pass is short.
    constexpr int kChunk = 16 / int(sizeof(Element));
    constexpr int kChunks = kHeadDimV / kChunk;
    constexpr int kRowsPerPass = kWgThreads / kChunks;
    constexpr bool kEven = kWgThreads % kChunks == 0 && kRowsPerWg % kRowsPerPass == 0;
    constexpr int kPasses = (kRowsPerWg + kRowsPerPass - 1) / kRowsPerPass;
    static_assert(kRowsPerPass > 0, "a row is at most one warpgroup's accesses");
    const int wg = thread / kWgThreads;
    const int lane = thread % kWgThreads;
    const int col = (lane % kChunks) * kChunk;
    Element* const out_rows = static_cast<Element*>(p.out.data) + p.q_offset_at(p.out, t.batch, Traits::kVarlen ? t.q_row0 : 0, m_start, t.head);
    auto for_each_row = [&](auto&& store_row) {
      CUTE_UNROLL
      for (int pass = 0; pass < kPasses; ++pass) {
        if constexpr (!kEven) {
          if (lane >= kRowsPerPass * kChunks || pass * kRowsPerPass + lane / kChunks >= kRowsPerWg) continue;
        }
        const int row = wg * kRowsPerWg + pass * kRowsPerPass + lane / kChunks;
        if (m_start + row < t.seqlen_q && col < p.head_dim_v) {
          store_row(row, reinterpret_cast<uint4*>(out_rows + std::int64_t(row) * p.out.row_stride + col));
        }
      }
    };
    if (t.empty()) {
      // No visible key in the whole tile: zeros straight to global memory (shared memory may be
      // receiving the next tile's Q).
      for_each_row([](int, uint4* dst) { *dst = make_uint4(0, 0, 0, 0); });
      return;
    }

    // Registers → shared memory: O in 16 bits, stmatrix (8 × 8 blocks of 16-bit values per
    // instruction) into the GMMA-swizzled layout — conflict-free.
    const int barrier = int(FwdBarrier::kEpilogueWg0) + wg;
    Element* const o_smem = Traits::o_smem(ss, count);
    if constexpr (Traits::kSeparateO && Traits::kTmaStoreO) {
      // The previous tile's O has been read by its TMA store (the first use passes at once).
      cutlass::arch::ClusterBarrier::wait(&ss.o_empty, (count & 1u) ^ 1u);
    } else if constexpr (Traits::kSeparateO) {
      named_barrier_sync(barrier, kWgThreads);  // the previous tile's O has been read
    }
    Tensor acc_o_16 = make_tensor<Element>(acc_o.layout());
    convert_fragment<Element>(acc_o, acc_o_16);
    Tensor sO = make_tensor(make_smem_ptr(o_smem), typename Traits::SmemLayoutO{});  // (M, dv)
    auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_pv);
    auto thr_r2s = r2s.get_thread_slice(thread);
    Tensor tr_src = thr_r2s.retile_S(acc_o_16);
    Tensor tr_dst = thr_r2s.partition_D(sO);
    copy(r2s, tr_src, tr_dst);
    if constexpr (Traits::kTmaStoreO) {
      // The TMA store reads the rows (async proxy) once every warpgroup has staged its own.
      cutlass::arch::fence_view_async_shared();
      named_barrier_sync(barrier, kWgThreads);
      if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&ss.o_full[Traits::q_buffer(count)]);
      return;
    }
    named_barrier_sync(barrier, kWgThreads);
    for_each_row([&](int row, uint4* dst) { *dst = *reinterpret_cast<const uint4*>(&sO(row, col)); });
    if constexpr (!Traits::kSeparateO) {
      named_barrier_sync(barrier, kWgThreads);  // every thread has read its rows of O
      if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&ss.q_empty[Traits::q_buffer(count)]);
    }
  }

  // Split-KV (Traits::kSplit): this split's O, normalised over its own keys, and lse in fp32 straight
  // from registers into the partials (cuda/split_kv.h; a quad's float2 stores cover 32 bytes of a
  // row) — rows past the sequence skipped; a share without keys (an empty tile, or rows that see
  // none of its keys) gives O = 0 and lse = +∞, which the combine weighs 0. Then Q's buffer goes
  // back to the producer where O would have been staged in it.
  template <class AccO, class Softmax>
  __device__ static void store_partials(const FwdParams<Traits>& params, typename Traits::SharedStorage& ss,
                                        const FwdTile& t, int thread, std::uint32_t count, AccO& acc_o,
                                        Softmax& softmax) {
    if constexpr (Traits::kSplit) {
      const common::AttentionParams& p = params.p;
      const SplitKvPartials& split = params.split;
      typename Traits::TiledMmaPV mma_pv;
      auto thr_pv = mma_pv.get_thread_slice(thread);
      Tensor acc_o_rc = make_tensor(acc_o.data(), rowcol_layout(acc_o.layout()));  // (rows, cols)
      constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
      float lse[kRows];
      const bool empty = t.empty();
      if (empty) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) lse[r] = device::kInf;
      } else {
        softmax.finalize(acc_o_rc, lse, Traits::kScoreMod && p.dropout_p > 0.0f ? p.dropout.keep_scale : 1.0f);
      }
      const int m_start = t.m_block * kBlockM;
      Tensor c_o = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
      Tensor c_rc = make_tensor(c_o.data(), rowcol_layout(c_o.layout()));
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = m_start + get<0>(c_rc(r, 0));
        if (row >= t.seqlen_q) continue;
        if (thread % 4 == 0) split.lse_partial[split.lse_offset(p, t.split, t.batch, t.head, row)] = lse[r];
        float* const dst = split.out_partial + split.out_offset(p, t.split, t.batch, row, t.head);
        CUTE_UNROLL
        for (int c = 0; c < size<1>(acc_o_rc); c += 2) {
          // Columns c, c + 1 of a row; dv is a multiple of 8, so both lie below it or neither.
          const int col = get<1>(c_rc(0, c));
          if (col < p.head_dim_v) {
            *reinterpret_cast<float2*>(dst + col) =
                empty ? make_float2(0.0f, 0.0f) : make_float2(acc_o_rc(r, c), acc_o_rc(r, c + 1));
          }
        }
      }
      // Q's buffer back where the epilogue gives it (O staged in Q's bytes elsewhere); an empty tile
      // loaded nothing. The warpgroup's products have completed (compute waited for them).
      if constexpr (!Traits::kSeparateO) {
        if (!empty) {
          const int wg = thread / kWgThreads;
          named_barrier_sync(int(FwdBarrier::kEpilogueWg0) + wg, kWgThreads);
          if (thread % kWgThreads == 0) cutlass::arch::ClusterBarrier::arrive(&ss.q_empty[Traits::q_buffer(count)]);
        }
      }
    }
  }

  // kTmaStoreO, one thread of warp kOStoreWarp: tile t (the CTA's `count`-th non-empty one) once
  // its O is staged (in its Q buffer, or in O's own tile where kSeparateO) — one TMA store of the
  // whole tile (rows and columns past the tensor, i.e. past seqlen_q and dv, are not written), and
  // the buffer given back (to the producer, or to the consumers' next O) once the store has read it.
  __device__ static void tma_store(const FwdParams<Traits>& params, typename Traits::SharedStorage& ss,
                                   const FwdTile& t, std::uint32_t count) {
    if constexpr (Traits::kTmaStoreO) {
      const int buffer = Traits::q_buffer(count);
      cutlass::arch::ClusterBarrier::wait(&ss.o_full[buffer], Traits::q_parity(count));
      Tensor mO = params.tma_o.get_tma_tensor(params.shape_o);  // (sq, dv, h, b)
      Tensor gO = local_tile(mO(_, _, t.head, t.batch), Shape<Int<kBlockM>, Int<kHeadDimV>>{},
                             make_coord(t.m_block, _0{}));  // (M, dv)
      Tensor sO = make_tensor(make_smem_ptr(Traits::o_smem(ss, count)), typename Traits::SmemLayoutO{});
      auto tma_o = params.tma_o.get_slice(_0{});
      copy(params.tma_o, tma_o.partition_S(sO), tma_o.partition_D(gO));
      cute::tma_store_arrive();
      cute::tma_store_wait<0>();  // read out of shared memory (not yet landed)
      // The buffer back: O's own tile to the consumers' next O, or Q's bytes to the producer.
      cutlass::arch::ClusterBarrier::arrive(Traits::kSeparateO ? &ss.o_empty : &ss.q_empty[buffer]);
    }
  }
  // The stores land before the thread exits.
  __device__ static void tma_store_tail() {
    if constexpr (Traits::kTmaStoreO) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
};

}  // namespace flashattn::cuda::sm90
