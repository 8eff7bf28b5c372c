// src/cuda/sm90/sm90_fwd_mainloop.cuh — the Hopper forward's main loop: the producer's TMA loads
// of Q and of the K/V tiles into their stage rings, and the consumer warpgroups' products and
// online softmax over the key tiles, right to left.
//
// Consumer step for key tile n, with P(n+1) already in registers (intra-warpgroup overlap):
//   wait K(n) → issue S = Q·K(n)ᵀ → wait V(n+1) → issue O += P(n+1)·V(n+1)
//   → wait for S → release K(n) → mask, softmax of S (under the P·V product)
//   → wait for O → release V(n+1) → rescale O → P(n) = S in 16 bits.
// The softmax of tile n thus runs while the tensor cores compute the P·V of tile n+1.
#pragma once

#include <cute/tensor.hpp>

#include "common/philox.h"
#include "cuda/device/cp_async.cuh"
#include "cuda/device/score_mod.cuh"
#include "cuda/sm90/sm90_fwd_traits.cuh"
#include "cuda/sm90/sm90_pipeline.cuh"
#include "cuda/sm90/sm90_softmax.cuh"
#include "cuda/sm90/sm90_tile_scheduler.cuh"

namespace flashattn::cuda::sm90 {

// The kernel's arguments: the call and the TMA descriptors of Q, K and V (built on the host; they
// must live in parameter space, hence __grid_constant__).
template <class Traits>
struct FwdParams {
  common::AttentionParams p;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaK tma_k;
  typename Traits::TmaV tma_v;
  // Traits::kWideChunks: K and V in boxes of 64 rows, used where wide_pages (the page size a
  // multiple of 64 rows).
  typename Traits::TmaKVWide tma_k_wide;
  typename Traits::TmaKVWide tma_v_wide;
  bool wide_pages;
  typename Traits::ShapeRows shape_q;  // (max_seqlen_q, d, heads, batch)
  typename Traits::ShapeRows shape_k;  // (max_seqlen_k, d, heads_k, batch)
  typename Traits::ShapeRows shape_v;  // (max_seqlen_k, dv, heads_k, batch)
  typename Traits::TmaO tma_o;         // kTmaStoreO only
  typename Traits::ShapeRows shape_o;  // (max_seqlen_q, dv, heads, batch), kTmaStoreO only
  float scale_log2;                    // softmax_scale · log2(e)
  const std::uint64_t* rng_state;      // dropout's (seed, offset) read at run time, or nullptr
  bool snake;                          // the tile walk (PersistentTileScheduler::index)
  int section;                         // (head, batch) pairs per section of a masked order (≥ 1)
  int section_rising;                  // sections that go up (MaskedTileOrder::rising_parity)
  int* tile_counter;                   // the dynamic schedule's counter (kFwdDynamic), or nullptr
  struct NoDivisors {};
  std::conditional_t<Traits::kFastDivmod, FwdTileDivisors, NoDivisors> divisors;  // Traits::kFastDivmod
  struct NoSplit {};
  // kSplit kernels: where the partials go, and how many splits each row block's key tiles take.
  std::conditional_t<Traits::kSplit, SplitKvPartials, NoSplit> split;
};

template <class Traits>
struct FwdMainloop {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kStages = Traits::kStages;
  using SharedStorage = typename Traits::SharedStorage;
  using Pipeline = TmaPipeline<kStages>;

  // --- producer: one thread -------------------------------------------------------------------
  // The Q of tile t, the CTA's `count`-th non-empty one, into its buffer once the consumers are
  // done with the buffer's previous tile (the first use of a buffer passes at once).
  __device__ static void load_q(const FwdParams<Traits>& params, SharedStorage& ss, const FwdTile& t,
                                std::uint32_t count) {
    Tensor mQ = params.tma_q.get_tma_tensor(params.shape_q);  // (sq, d, h, b)
    // The sequence's rows, from its first one (a varlen batch: rows of the next sequence follow,
    // read but masked or never written; past the tensor TMA reads zeros).
    const int q_row0 = Traits::kVarlen ? t.q_row0 : 0;
    const int q_batch = Traits::kVarlen ? t.q_tma_batch : t.batch;
    Tensor gQ = local_tile(domain_offset(make_coord(q_row0, _0{}), mQ(_, _, t.head, q_batch)),
                           Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(t.m_block, _0{}));  // (M, d)
    Tensor sQ = make_tensor(make_smem_ptr(Traits::q_smem(ss, count)), typename Traits::SmemLayoutQ{});  // (M, d)
    auto tma_q = params.tma_q.get_slice(_0{});
    const int buffer = Traits::q_buffer(count);
    cutlass::arch::ClusterBarrier::wait(&ss.q_empty[buffer], Traits::q_parity(count) ^ 1u);
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.q_full[buffer], Traits::kTmaBytesQ);
    copy(params.tma_q.with(ss.q_full[buffer]), tma_q.partition_S(gQ), tma_q.partition_D(sQ));
  }

  // Paged caches: key tile n of tile t of K or V (mKV: (page rows, cols, heads_k, pages) as TMA
  // reads it) into `stage`, completing on `full`, from the pages of sequence t.batch, in boxes of
  // kRows rows (Traits::kPageChunkRows, or kPageWideRows where the pages allow it) × kAtomCols
  // columns.
  // Box c holds keys j = n·kBlockN + c·kRows …: page box_page[c] (block_table[t.batch][j / page_size]:
  // tile_pages' registers, or the shared-memory slot of request_pages), from row j % page_size (a
  // page holds whole boxes). Boxes past the sequence's keys are not loaded (the block_table entries
  // there may be anything): their K rows are masked and their V rows zeroed (compute), as are the
  // rows past the keys inside the last box.
  // kColumnBlocks: the tensor's tile in blocks of Traits::kAtomCols columns (K: d, V: dv).
  template <int kRows, int kColumnBlocks, class Tma, class MKV, class Pages>
  __device__ static void load_paged_tile(const Tma& tma, const MKV& mKV, Element* stage, std::uint64_t& full,
                                         const Pages& box_page, int page_size, const FwdTile& t, int n) {
    constexpr auto kKeep = TMA::CacheHintSm90::EVICT_LAST;
    auto slice = tma.get_slice(_0{});
    const int j0 = n * kBlockN;
    const int rows = min(kBlockN, t.seqlen_k - j0);
    // kPageAhead: the box's row in its page stepped box by box from one division a tile (the
    // producer's one thread does the tile's boxes alone, one division per box otherwise).
    [[maybe_unused]] int next_in_page = Traits::kPageAhead ? j0 % page_size : 0;
    CUTE_UNROLL
    for (int c = 0; c < kBlockN / kRows; ++c) {
      if (c * kRows >= rows) break;
      int in_page;
      if constexpr (Traits::kPageAhead) {
        in_page = next_in_page;
        next_in_page = in_page + kRows == page_size ? 0 : in_page + kRows;
      } else {
        in_page = (j0 + c * kRows) % page_size;
      }
      Tensor gPage = mKV(_, _, t.kv_head, box_page[c]);  // (page rows, cols)
      CUTE_UNROLL
      for (int block = 0; block < kColumnBlocks; ++block) {
        Tensor g = local_tile(gPage, Shape<Int<kRows>, typename Traits::BoxCols>{},
                              make_coord(in_page / kRows, block));
        Tensor sBox = make_tensor(make_smem_ptr(stage + Traits::chunk_offset(c, block, kRows)),
                                  typename Traits::template SmemLayoutKVBox<kRows>{});
        copy(tma.with(full, 0, kKeep), slice.partition_S(g), slice.partition_D(sBox));
      }
    }
  }
  // The page of every box of kRows rows of paged key tile n of t that holds a key (0 for the
  // others, whose block_table entries are not read), for K and V alike. The loads are issued
  // together, before the producer waits for a free stage, so their latency overlaps that wait
  // instead of stalling each box's TMA issue in turn (pages of 16 rows: a new entry every box).
  template <int kRows>
  __device__ __forceinline__ static void tile_pages(const std::int32_t* pages, int page_size, const FwdTile& t, int n,
                                                    int (&box_page)[Traits::kChunksPerTile]) {
    const int j0 = n * kBlockN;
    const int rows = min(kBlockN, t.seqlen_k - j0);
    CUTE_UNROLL
    for (int c = 0; c < kBlockN / kRows; ++c) {
      const int j = j0 + c * kRows;
      box_page[c] = j < j0 + rows ? __ldg(pages + j / page_size) : 0;
    }
  }
  // Traits::kPageAhead: the block_table entry of every box of kRows rows of paged key tile n of t
  // that holds a key, copied into `slot` (shared memory) by 4-byte cp.async — one group, which the
  // caller closes — a key tile ahead of the loads that read it. The copies are in flight together;
  // loaded into registers (tile_pages), each entry is moved to a uniform register for the TMA
  // coordinates right after its load (sm_90a SASS of the d 128 paged kernel, whose producer keeps
  // 24 registers), so a tile's entries arrive one L2 round trip after another.
  template <int kRows>
  __device__ __forceinline__ static void request_pages(const std::int32_t* pages, int page_size, const FwdTile& t,
                                                       int n, int* slot) {
    constexpr int kBoxes = kBlockN / kRows;
    const std::uint32_t boxes = paged_tile_boxes<kRows>(t, n);
    const int boxes_per_page = page_size / kRows;  // fwd_page_box_rows: pages of whole boxes
    const int box0 = n * kBoxes;                   // the tile's first box, from the sequence's first key
    int page = box0 / boxes_per_page;
    int in_page = box0 - page * boxes_per_page;
    CUTE_UNROLL
    for (int c = 0; c < kBoxes; ++c) {
      if (std::uint32_t(c) >= boxes) break;
      device::cp_async_4(slot + c, pages + page);
      if (++in_page == boxes_per_page) {
        in_page = 0;
        ++page;
      }
    }
  }
  // The boxes of kRows rows of paged key tile n of t that hold a key (each loaded with every column
  // block).
  template <int kRows>
  __device__ __forceinline__ static std::uint32_t paged_tile_boxes(const FwdTile& t, int n) {
    const int rows = min(kBlockN, t.seqlen_k - n * kBlockN);
    return std::uint32_t((rows + kRows - 1) / kRows);
  }

  // Tile t (the CTA's `count`-th non-empty one): its Q unless an earlier call loaded it
  // (q_loaded), then K(n), V(n) for n from the last key tile to the first, each into the next free
  // stage of its ring (st: the rings' position, carried from tile to tile). With two Q buffers,
  // the next non-empty tile's Q (next, if has_next) goes right after the first K/V stage. K/V stay
  // in L2 for the other row blocks of the head (EVICT_LAST).
  __device__ static void load(const FwdParams<Traits>& params, SharedStorage& ss, const Pipeline& k_pipe,
                              const Pipeline& v_pipe, const FwdTile& t, std::uint32_t count, bool q_loaded,
                              const FwdTile& next, bool has_next, PipelineState<kStages>& st) {
    if constexpr (Traits::kPaged) {
      if (!q_loaded) load_q(params, ss, t, count);
      load_paged(params, ss, k_pipe, v_pipe, t, count, next, has_next, st);
    } else {
      Tensor mK = params.tma_k.get_tma_tensor(params.shape_k);  // (sk, d, hk, b)
      Tensor mV = params.tma_v.get_tma_tensor(params.shape_v);  // (sk, dv, hk, b)
      const int k_row0 = Traits::kVarlen ? t.k_row0 : 0;
      const int k_batch = Traits::kVarlen ? t.k_tma_batch : t.batch;
      Tensor gK = local_tile(domain_offset(make_coord(k_row0, _0{}), mK(_, _, t.kv_head, k_batch)),
                             Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));  // (N, d, n)
      Tensor gV = local_tile(domain_offset(make_coord(k_row0, _0{}), mV(_, _, t.kv_head, k_batch)),
                             Shape<Int<kBlockN>, Int<Traits::kHeadDimV>>{}, make_coord(_, _0{}));  // (N, dv, n)
      Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});  // (N, d, stage)
      Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutV{});  // (N, dv, stage)
      auto tma_k = params.tma_k.get_slice(_0{});
      auto tma_v = params.tma_v.get_slice(_0{});
      Tensor tKgK = group_modes<0, 3>(tma_k.partition_S(gK));  // (TMA, n)
      Tensor tKsK = group_modes<0, 3>(tma_k.partition_D(sK));  // (TMA, stage)
      Tensor tVgV = group_modes<0, 3>(tma_v.partition_S(gV));  // (TMA, n)
      Tensor tVsV = group_modes<0, 3>(tma_v.partition_D(sV));  // (TMA, stage)

      constexpr auto kKeep = TMA::CacheHintSm90::EVICT_LAST;
      if (!q_loaded) load_q(params, ss, t, count);
      for (int n = t.n_block_max - 1; n >= t.n_block_min; --n) {
        copy(params.tma_k.with(k_pipe.producer_acquire(st, Traits::kTmaBytesK), 0, kKeep), tKgK(_, n),
             tKsK(_, st.index));
        copy(params.tma_v.with(v_pipe.producer_acquire(st, Traits::kTmaBytesV), 0, kKeep), tVgV(_, n),
             tVsV(_, st.index));
        st.advance();
        if (Traits::kQStages == 2 && has_next && n == t.n_block_max - 1) load_q(params, ss, next, count + 1);
      }
    }
  }

  // load's key tiles for a paged cache (Traits::kPaged): K(n) and V(n) gathered box by box, in
  // 64-row boxes where the pages are multiples of 64 rows (params.wide_pages), else 16-row ones.
  __device__ static void load_paged(const FwdParams<Traits>& params, SharedStorage& ss, const Pipeline& k_pipe,
                                    const Pipeline& v_pipe, const FwdTile& t, std::uint32_t count, const FwdTile& next,
                                    bool has_next, PipelineState<kStages>& st) {
    if constexpr (Traits::kWideChunks) {
      if (params.wide_pages) {
        load_paged_boxes<Traits::kPageWideRows>(params, params.tma_k_wide, params.tma_v_wide, ss, k_pipe, v_pipe, t,
                                                count, next, has_next, st);
        return;
      }
    }
    load_paged_boxes<Traits::kPageChunkRows>(params, params.tma_k, params.tma_v, ss, k_pipe, v_pipe, t, count, next,
                                             has_next, st);
  }
  template <int kRows, class TmaK, class TmaV>
  __device__ static void load_paged_boxes(const FwdParams<Traits>& params, const TmaK& tma_k, const TmaV& tma_v,
                                          SharedStorage& ss, const Pipeline& k_pipe, const Pipeline& v_pipe,
                                          const FwdTile& t, std::uint32_t count, const FwdTile& next, bool has_next,
                                          PipelineState<kStages>& st) {
    Tensor mK = tma_k.get_tma_tensor(params.shape_k);  // (page rows, d, hk, pages)
    Tensor mV = tma_v.get_tma_tensor(params.shape_v);  // (page rows, dv, hk, pages)
    const std::int32_t* pages = params.p.block_table + std::int64_t(t.batch) * params.p.block_table_batch_stride;
    const int page_size = params.p.page_size;
    // kPageAhead: the entries of key tile n wait in slot n mod 2 of ss.pages, those of the next one
    // requested before this one's boxes (a cp.async group per key tile, the last one empty).
    [[maybe_unused]] auto slot = [&](int n) -> int* {
      if constexpr (Traits::kPageAhead) {
        return ss.pages.entry[n & 1];
      } else {
        return nullptr;
      }
    };
    if constexpr (Traits::kPageAhead) {
      request_pages<kRows>(pages, page_size, t, t.n_block_max - 1, slot(t.n_block_max - 1));
      cute::cp_async_fence();
    }
    for (int n = t.n_block_max - 1; n >= t.n_block_min; --n) {
      const std::uint32_t boxes = paged_tile_boxes<kRows>(t, n);
      if constexpr (Traits::kPageAhead) {
        if (n > t.n_block_min) request_pages<kRows>(pages, page_size, t, n - 1, slot(n - 1));
        cute::cp_async_fence();
        cute::cp_async_wait<1>();  // key tile n's entries have landed
        const int* box_page = slot(n);
        load_paged_step<kRows>(params, tma_k, tma_v, mK, mV, ss, k_pipe, v_pipe, box_page, t, n, boxes, st);
      } else {
        int box_page[Traits::kChunksPerTile];
        tile_pages<kRows>(pages, page_size, t, n, box_page);
        load_paged_step<kRows>(params, tma_k, tma_v, mK, mV, ss, k_pipe, v_pipe, box_page, t, n, boxes, st);
      }
      st.advance();
      if (Traits::kQStages == 2 && has_next && n == t.n_block_max - 1) load_q(params, ss, next, count + 1);
    }
  }
  // K(n) and V(n) of a paged tile into the stage st, the page of box c at box_page[c].
  template <int kRows, class TmaK, class TmaV, class MK, class MV, class Pages>
  __device__ __forceinline__ static void load_paged_step(const FwdParams<Traits>& params, const TmaK& tma_k,
                                                         const TmaV& tma_v, const MK& mK, const MV& mV,
                                                         SharedStorage& ss, const Pipeline& k_pipe,
                                                         const Pipeline& v_pipe, const Pages& box_page,
                                                         const FwdTile& t, int n, std::uint32_t boxes,
                                                         const PipelineState<kStages>& st) {
    const int page_size = params.p.page_size;
    load_paged_tile<kRows, Traits::kColumnBlocksK>(
        tma_k, mK, ss.k.data() + Traits::stage_offset(st.index, kHeadDim),
        k_pipe.producer_acquire(st, boxes * Traits::template kTmaBytesBoxK<kRows>), box_page, page_size, t, n);
    load_paged_tile<kRows, Traits::kColumnBlocksV>(
        tma_v, mV, ss.v.data() + Traits::stage_offset(st.index, Traits::kHeadDimV),
        v_pipe.producer_acquire(st, boxes * Traits::template kTmaBytesBoxV<kRows>), box_page, page_size, t, n);
  }

  // --- consumers: kConsumerWarpgroups warpgroups ----------------------------------------------
  // Ping-pong (Traits::kPingPong): the two consumer warpgroups take turns to issue their products,
  // so that the tensor cores run one warpgroup's while the other computes its softmax. A turn is
  // a named barrier per warpgroup that its own 128 threads sync on and the other warpgroup's 128
  // arrive at once its products are issued. Both warpgroups issue the same number of turns per
  // tile (n_blocks + 1: they walk the same key tiles), so the turns stay paired across tiles;
  // pingpong_start gives the first turn to warpgroup 0 and pingpong_finish takes back the
  // arrival left over after the last one.
  __device__ __forceinline__ static void turn_begin(int wg) {
    if constexpr (Traits::kPingPong) named_barrier_sync(int(FwdBarrier::kSchedulerWg0) + wg, Traits::kConsumerThreads);
  }
  __device__ __forceinline__ static void turn_end(int wg) {
    if constexpr (Traits::kPingPong) named_barrier_arrive(int(FwdBarrier::kSchedulerWg0) + 1 - wg, Traits::kConsumerThreads);
  }
  __device__ __forceinline__ static void pingpong_start(int wg) {
    if constexpr (Traits::kPingPong) {
      if (wg == 1) named_barrier_arrive(int(FwdBarrier::kSchedulerWg0), Traits::kConsumerThreads);
    }
  }
  __device__ __forceinline__ static void pingpong_finish(int wg) {
    if constexpr (Traits::kPingPong) {
      if (wg == 0) named_barrier_sync(int(FwdBarrier::kSchedulerWg0), Traits::kConsumerThreads);
    }
  }

  // Rows [from, kBlockN) of V's stage `stage` set to zero by the consumer threads together, made
  // visible to the tensor cores' reads (async proxy) before any warpgroup goes on.
  __device__ static void zero_v_rows_from(SharedStorage& ss, int stage, int from, int thread) {
    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutV{});  // (N, dv, stage)
    constexpr int kCols = decltype(size<1>(sV))::value;
    for (int i = from * kCols + thread; i < kBlockN * kCols; i += Traits::kConsumerThreads) {
      sV(i / kCols, i % kCols, stage) = Element(0);
    }
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync(int(FwdBarrier::kVTail), Traits::kConsumerThreads);
  }

  // thread: index among the consumer threads (0 … kConsumerThreads − 1). Leaves O (fp32, not yet
  // normalised) in acc_o and the running max/sum in softmax. count as for load; k_st / v_st:
  // the rings' position, carried from tile to tile. With O staged apart from Q, Q is given back as
  // soon as the last Q·Kᵀ has completed.
  template <class AccO, class Softmax>
  __device__ static void compute(const FwdParams<Traits>& params, SharedStorage& ss, const Pipeline& k_pipe,
                                 const Pipeline& v_pipe, const FwdTile& t, int thread, std::uint32_t count,
                                 PipelineState<kStages>& k_st, PipelineState<kStages>& v_st, AccO& acc_o,
                                 Softmax& softmax) {
    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(thread);
    auto thr_pv = mma_pv.get_thread_slice(thread);
    const bool leader = thread % Traits::kWarpgroupThreads == 0;

    Tensor sQ = make_tensor(make_smem_ptr(Traits::q_smem(ss, count)), typename Traits::SmemLayoutQ{});  // (M, d)
    Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});    // (N, d, stage)
    Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutVt{});  // (dv, N, stage)
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K) descriptors
    Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stage)
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)

    Tensor acc_s = partition_fragment_C(mma_qk, select<0, 1>(typename Traits::TileShapeQK{}));  // ((2,2,N/8), 1, 1)
    Tensor s_rc = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));                     // (rows, cols)
    Tensor acc_o_rc = make_tensor(acc_o.data(), rowcol_layout(acc_o.layout()));
    Tensor p_frag = make_tensor<Element>(acc_as_a_operand_layout(acc_s.layout()));  // (MMA, MMA_M, MMA_K)
    Tensor p_flat = make_tensor(p_frag.data(), acc_s.layout());

    // (row, col) inside the tile of each score this thread holds.
    Tensor c_s = thr_qk.partition_C(make_identity_tensor(select<0, 1>(typename Traits::TileShapeQK{})));
    Tensor c_rc = make_tensor(c_s.data(), rowcol_layout(c_s.layout()));
    constexpr int kRows = decltype(size<0>(s_rc))::value;

    // Which key tiles need per-element masking for this warpgroup's 64 rows: those that end past
    // seqlen_k, and those some of whose (row, key) pairs the mask hides.
    const int wg_row_begin = t.m_block * kBlockM + (thread / Traits::kWarpgroupThreads) * Traits::kRowsPerWarpgroup;
    const int wg_row_end = min(wg_row_begin + Traits::kRowsPerWarpgroup, t.seqlen_q);
    auto needs_mask = [&](int n) {
      const int col_b = n * kBlockN;
      const int col_e = col_b + kBlockN;
      return wg_row_begin >= wg_row_end || col_e > t.seqlen_k ||
             !t.mask.block_fully_visible(wg_row_begin, wg_row_end, col_b, col_e);
    };
    // At d 64 and 128, keys are counted from this thread's first one (col0 of the tile), so that
    // each column's distance from it is a constant of the unrolled loop (an immediate, not a
    // register per column); without a left window the lower bound is 0 or below and only the upper
    // one is tested. On an H100 that ran d 64 and 128 causal 1.01–1.03× (d 128 without a mask
    // 1.00–1.02×), but d 256 0.99× with or without a mask (docs/benchmarks-sm90.md, 2026-12-07):
    // the other head dims keep the tile's columns and both comparisons.
    auto mask_rows = [&](int n, auto left) {
      const int col0 = n * kBlockN + get<1>(c_rc(0, 0));
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = t.m_block * kBlockM + get<0>(c_rc(r, 0));
        const int lo = t.mask.col_begin(row) - col0;
        const int hi = t.mask.col_end(row) - col0;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s_rc); ++c) {
          const int dc = get<1>(c_rc(0, c)) - get<1>(c_rc(0, 0));
          if (dc >= hi || (decltype(left)::value && dc < lo)) s_rc(r, c) = -device::kInf;
        }
      }
    };
    auto apply_mask = [&](int n) {
      if constexpr (kHeadDim != 64 && kHeadDim != 128) {  // the head dims it was timed at
        const int col_b = n * kBlockN;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const int row = t.m_block * kBlockM + get<0>(c_rc(r, 0));
          const int lo = t.mask.col_begin(row) - col_b;
          const int hi = t.mask.col_end(row) - col_b;
          CUTE_UNROLL
          for (int c = 0; c < size<1>(s_rc); ++c) {
            const int col = get<1>(c_rc(0, c));
            if (col < lo || col >= hi) s_rc(r, c) = -device::kInf;
          }
        }
      } else if (t.mask.window_left >= 0) {
        mask_rows(n, cute::true_type{});
      } else {
        mask_rows(n, cute::false_type{});
      }
    };
    auto to_p = [&] { convert_fragment<Element>(acc_s, p_flat); };

    // Softcap and ALiBi (kScoreMod): raw scores in the units of device::TileScoreMod, whose
    // out_scale · log2 e becomes the softmax's exp2 multiplier.
    [[maybe_unused]] const device::TileScoreMod mod(
        params.p.template score_mod_for<float>(t.batch, t.head, t.seqlen_q, t.seqlen_k), Traits::kScoreMod);
    if constexpr (Traits::kScoreMod) softmax.scale_log2 = mod.out_scale * device::kLog2e;
    // Dropout (kScoreMod kernels; SPEC §3, docs/dropout.md): after the row sums, which lse
    // excludes, and before P is rounded; 1 / (1 − p) comes with the final normalisation. One
    // Philox call per 16 × 16 block of the tile feeds the 8 probabilities this thread holds of it
    // (rows g, g + 8; columns 2t, 2t + 1, 2t + 8, 2t + 9 of the block: the wgmma accumulator
    // layout, which the counter layout follows).
    [[maybe_unused]] common::DropoutParams dropout = params.p.dropout;
    [[maybe_unused]] const bool use_dropout = Traits::kScoreMod && params.p.dropout_p > 0.0f;
    if constexpr (Traits::kScoreMod) {
      if (use_dropout && params.rng_state != nullptr) {
        dropout.seed = params.rng_state[0];
        dropout.offset = params.rng_state[1];
      }
    }
    [[maybe_unused]] const std::uint64_t dropout_stream = params.p.dropout_stream(t.batch, t.head);
    // The keep bits of block jb of key tile n (this thread's 8 of the 16 × 16 block), i0 the
    // thread's first row.
    constexpr int kDropBlocks = decltype(size<1>(s_rc))::value / 4;
    auto keep_bits = [&](int i0, int n, int jb) {
      const int j0 = n * kBlockN + get<1>(c_rc(0, 4 * jb));
      return common::dropout_keep_bits(dropout, dropout_stream, i0 >> 4, j0 >> 4, common::dropout_lane(i0, j0));
    };
    // Traits::kDropoutEarly: key tile n's keep bits drawn as soon as the warpgroup has issued its
    // products — their Philox rounds (about 600 of a d 128 step's instructions) run while Q·Kᵀ is
    // computed instead of after it, between the wait for S and the wait for P·V — and kept 4
    // blocks to a register until apply_dropout.
    [[maybe_unused]] std::uint32_t early_bits[(kDropBlocks + 3) / 4];
    auto draw_dropout = [&](int n) {
      if constexpr (Traits::kDropoutEarly) {
        if (!use_dropout) return;
        const int i0 = t.m_block * kBlockM + get<0>(c_rc(0, 0));
        CUTE_UNROLL
        for (int w = 0; w < (kDropBlocks + 3) / 4; ++w) early_bits[w] = 0;
        CUTE_UNROLL
        for (int jb = 0; jb < kDropBlocks; ++jb) early_bits[jb / 4] |= keep_bits(i0, n, jb) << (8 * (jb % 4));
      }
    };
    auto apply_dropout = [&](int n) {
      if constexpr (Traits::kScoreMod) {
        if (!use_dropout) return;
        const int i0 = t.m_block * kBlockM + get<0>(c_rc(0, 0));
        CUTE_UNROLL
        for (int jb = 0; jb < kDropBlocks; ++jb) {
          std::uint32_t bits;
          if constexpr (Traits::kDropoutEarly) {
            bits = early_bits[jb / 4] >> (8 * (jb % 4));
          } else {
            bits = keep_bits(i0, n, jb);
          }
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) {
            CUTE_UNROLL
            for (int c = 0; c < 4; ++c) {
              const int e = common::dropout_element_at(get<0>(c_rc(r, 0)) - get<0>(c_rc(0, 0)),
                                                       get<1>(c_rc(0, 4 * jb + c)) - get<1>(c_rc(0, 4 * jb)));
              if (!((bits >> e) & 1u)) s_rc(r, 4 * jb + c) = 0.0f;
            }
          }
        }
      }
    };
    auto apply_score_mod = [&](int n) {
      if constexpr (Traits::kScoreMod) {
        if (mod.softcap) {
          CUTE_UNROLL
          for (int e = 0; e < size(acc_s); ++e) acc_s(e) = device::TileScoreMod::tanh(acc_s(e) * mod.k);
        }
        if (mod.alibi) {
          const int col0 = n * kBlockN + get<1>(c_rc(0, 0));
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) {
            const float base = mod.alibi_base(t.m_block * kBlockM + get<0>(c_rc(r, 0)), col0);
            CUTE_UNROLL
            for (int c = 0; c < size<1>(s_rc); ++c) {
              s_rc(r, c) = mod.add_alibi(s_rc(r, c), base, get<1>(c_rc(0, c)) - get<1>(c_rc(0, 0)));
            }
          }
        }
      }
    };

    float correction[kRows];
    const int wg = thread / Traits::kWarpgroupThreads;
    cutlass::arch::ClusterBarrier::wait(&ss.q_full[Traits::q_buffer(count)], Traits::q_parity(count));

    // The last key tile: S, softmax, P — nothing accumulated yet.
    int n = t.n_block_max - 1;
    k_pipe.consumer_wait(k_st);
    turn_begin(wg);
    wgmma<true>(mma_qk, tSrQ, tSrK(_, _, _, k_st.index), acc_s);
    turn_end(wg);
    draw_dropout(n);
    cute::warpgroup_wait<0>();
    k_pipe.consumer_release(k_st, leader);
    k_st.advance();
    apply_score_mod(n);
    if (needs_mask(n)) apply_mask(n);
    softmax.template step_poly_if<true, Traits::kSoftcapPolyCols>(mod.softcap, s_rc, correction);
    apply_dropout(n);
    to_p();
    mma_pv.accumulate_ = GMMA::ScaleOut::Zero;  // the first P·V overwrites acc_o
    // Rows of this key tile past seqlen_k hold the next sequence's V (varlen) or unused rows
    // (seqused_k, a KV cache past cache_seqlens). Their P is 0, but 0 · Inf or NaN is NaN: they
    // are zeroed before the first P·V reads them. Dense calls read zeros there (past the
    // tensor's extent).
    if constexpr (Traits::kVarlen) {
      const int kv_valid = t.seqlen_k - n * kBlockN;
      if (kv_valid < kBlockN) {
        v_pipe.consumer_wait(v_st);
        zero_v_rows_from(ss, v_st.index, kv_valid, thread);
      }
    }

    for (--n; n >= t.n_block_min; --n) {
      k_pipe.consumer_wait(k_st);
      turn_begin(wg);
      wgmma<true>(mma_qk, tSrQ, tSrK(_, _, _, k_st.index), acc_s);
      v_pipe.consumer_wait(v_st);
      wgmma<false>(mma_pv, p_frag, tOrV(_, _, _, v_st.index), acc_o);
      turn_end(wg);
      draw_dropout(n);
      cute::warpgroup_wait<1>();  // S has landed; P·V still runs
      k_pipe.consumer_release(k_st, leader);
      k_st.advance();
      apply_score_mod(n);
      if (needs_mask(n)) apply_mask(n);
      softmax.template step_poly_if<false, Traits::kSoftcapPolyCols>(mod.softcap, s_rc, correction);
      apply_dropout(n);
      cute::warpgroup_wait<0>();
      v_pipe.consumer_release(v_st, leader);
      v_st.advance();
      Softmax::rescale(acc_o_rc, correction);
      to_p();
    }

    if constexpr (Traits::kSeparateO) {
      if (leader) cutlass::arch::ClusterBarrier::arrive(&ss.q_empty[0]);  // every Q·Kᵀ has completed
    }

    // P of the first key tile times its V.
    v_pipe.consumer_wait(v_st);
    turn_begin(wg);
    wgmma<false>(mma_pv, p_frag, tOrV(_, _, _, v_st.index), acc_o);
    turn_end(wg);
    cute::warpgroup_wait<0>();
    v_pipe.consumer_release(v_st, leader);
    v_st.advance();
  }
};

}  // namespace flashattn::cuda::sm90
