// src/cuda/sm90/sm90_bwd_mainloop.cuh — the Hopper backward's main loop: the producer's TMA loads
// (K and V of the CTA's key tile once, then Q and dO with their row statistics per query row
// block, through two rings of stages), the consumer warpgroups' five products per row block, the
// dQ accumulation and the dK/dV epilogue. The product schedule is in sm90_bwd_traits.cuh.
#pragma once

#include <cuda_fp16.h>

#include <cute/tensor.hpp>

#include "common/dq_order.h"
#include "common/philox.h"
#include "cuda/device/math.cuh"
#include "cuda/device/score_mod.cuh"
#include "cuda/sm90/sm90_bwd_traits.cuh"
#include "cuda/sm90/sm90_pipeline.cuh"
#include "cuda/sm90/sm90_softmax.cuh"

namespace flashattn::cuda::sm90 {

// The kernel's arguments: the call, the TMA descriptors (built on the host; in parameter space,
// hence __grid_constant__) and the scratch (sm90_bwd.h).
template <class Traits>
struct BwdParams {
  common::AttentionParams p;
  typename Traits::TmaQ::Type tma_q;
  typename Traits::TmadO::Type tma_do;
  typename Traits::TmaK::Type tma_k;
  typename Traits::TmaV::Type tma_v;
  typename Traits::ShapeRows shape_q;   // (sq, d, h, b); varlen (total_q, d, h, 1)
  typename Traits::ShapeRows shape_do;  // (sq, dv, h, b)
  typename Traits::ShapeRows shape_k;   // (sk, d, hk, b); varlen (total_k, d, hk, 1)
  typename Traits::ShapeRows shape_v;   // (sk, dv, hk, b)
  float* dq_accum;                      // (h, rows.head_stride, kHeadDim) fp32 (sm90_bwd.h: BwdRows)
  const float* lse_log2;                // (h, rows.head_stride)
  const float* dpsum;                   // (h, rows.head_stride)
  int* dq_semaphores;                   // deterministic: one per row block, else nullptr
  int stagger_tiles;  // deterministic: staggered walks where the grid has at most this many key tiles
  bool tile_major;    // grid order: key tile slowest, (kv head, batch) fastest (bwd_tile_major)
  bool heads_inner;   // GQA walks: row blocks outer (descending), the group's heads inner (bwd_heads_inner)
  BwdRows rows;
  float scale_log2;                // softmax_scale · log2 e
  const std::uint64_t* rng_state;  // dropout's (seed, offset) read at run time, or nullptr
};

// The named barrier ids of the backward kernel.
enum class BwdBarrier : int {
  kDsWritten = 1,   // all consumers: both halves of a row block's dSᵀ are in shared memory
  kDqFullWg0 = 2,   // + warpgroup: its dQ slice is staged (the warpgroup and the dQ writer warp)
  kDqEmptyWg0 = 4,  // + warpgroup: the writer has read its dQ slice out
  kTailZeroed = 6,  // all consumers (varlen): rows past a sequence zeroed in shared memory
  kEpilogue = 7,    // all consumers: K and V read for the last time / dK and dV staged there
  kPWritten = 8,    // all consumers (kSdpByWarpgroup): the first warpgroup's Pᵀ is in shared memory
};
inline constexpr int kDqWriterWarp = 1;  // of the producer warpgroup

// Deterministic dQ turns (BwdMainloop::write_dq): an acquiring load and a releasing increment at
// GPU scope.
__device__ __forceinline__ int load_acquire(const int* p) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(p) : "memory");
  return value;
}
__device__ __forceinline__ void release_increment(int* p) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(p) : "memory");
}

// The work of one CTA: key tile n_block of (kv_head, batch), and the query row blocks
// [m_block_min, m_block_max) whose rows see one of its keys (the same for every head of the group).
// Varlen: the sequence's rows start at q_row0 / k_row0 of the packed tensors (cu_seqlens), its
// keys are seqused_k's where given; a key tile past them has no work (empty()).
struct BwdTile {
  int n_block;
  int kv_head;
  int batch;
  int seqlen_q;
  int seqlen_k;
  int q_row0;
  int k_row0;
  std::int64_t stat_row0;  // the sequence's first row in the scratch (bwd_row_start)
  int m_block_min;
  int m_block_max;
  common::Mask mask;
  // Deterministic, unmasked, no more key tiles than row blocks: the walks are staggered
  // (common::StaggeredWalk; m_block_min is 0 then), else every tile walks its blocks in order.
  bool staggered;
  common::StaggeredWalk walk;
  // Heads inner (not deterministic, GQA): the walk takes the row blocks from the last down, and at
  // each the group's heads, from head n_block mod group on, so that the tiles of a (kv head, batch)
  // read the same rows at the same time; else each head's row blocks in turn.
  bool heads_inner;
  int head_shift;  // heads inner: the first head of the walk, n_block mod group

  // reversed: the key tiles of a (kv head, batch) launch last first (the deterministic order,
  // see BwdMainloop::write_dq), else first first (under a causal mask the longest go first).
  // stagger_tiles: with reversed, the walks may be staggered where the grid has at most this many
  // key tiles per (kv head, batch), few enough that all of them are resident at once: a staggered
  // tile, past its walk's wrap, may wait for one launched after it.
  // tile_major (never with reversed): a one-dimensional grid whose blocks take the key tiles
  // slowest, so that every (kv head, batch)'s first tile launches before any second one; else the
  // grid is (key tiles, kv heads, batch).
  template <int kBlockM, int kBlockN>
  __device__ static BwdTile of_block(const common::AttentionParams& p, const BwdRows& rows, bool reversed,
                                     int stagger_tiles, bool tile_major, bool heads_inner) {
    BwdTile t;
    const int n_tiles = (p.max_seqlen_k + kBlockN - 1) / kBlockN;
    if (tile_major) {
      const int pairs = p.heads_k * p.batch;
      const int pair = int(blockIdx.x) % pairs;
      t.n_block = int(blockIdx.x) / pairs;
      t.kv_head = pair % p.heads_k;
      t.batch = pair / p.heads_k;
    } else {
      t.n_block = reversed ? n_tiles - 1 - int(blockIdx.x) : int(blockIdx.x);
      t.kv_head = int(blockIdx.y);
      t.batch = int(blockIdx.z);
    }
    t.seqlen_q = p.seqlen_q(t.batch);
    t.seqlen_k = p.seqlen_k(t.batch);  // seqused_k where given
    t.q_row0 = int(p.q_row0(t.batch));
    t.k_row0 = p.is_varlen() ? p.cu_seqlens_k[t.batch] : 0;
    t.stat_row0 = bwd_row_start(p, rows, t.batch);
    t.mask = p.mask_for(t.seqlen_q, t.seqlen_k);
    const int col_b = t.n_block * kBlockN;
    const int col_e = min(col_b + kBlockN, t.seqlen_k);
    t.m_block_min = t.m_block_max = 0;
    t.walk = {(t.seqlen_k + kBlockN - 1) / kBlockN, (t.seqlen_q + kBlockM - 1) / kBlockM};
    t.staggered = reversed && !tile_major && n_tiles <= stagger_tiles && t.mask.window_left < 0 && t.mask.window_right < 0 &&
                  t.walk.n_tiles <= t.walk.m_blocks;
    t.heads_inner = kBwdHeadsInner && heads_inner && !reversed && p.group_size() > 1;
    t.head_shift = t.heads_inner ? t.n_block % p.group_size() : 0;
    if (col_b >= col_e || t.seqlen_q == 0) return t;
    const int row_b = t.mask.block_row_begin(col_b);
    const int row_e = t.mask.block_row_end(col_e);
    t.m_block_min = row_b / kBlockM;
    t.m_block_max = row_e > row_b ? (row_e + kBlockM - 1) / kBlockM : t.m_block_min;
    return t;
  }
  // The steps of the walk over the heads of the group (each walking [m_block_min, m_block_max)),
  // counted by a cursor rather than divided out of the step's index. Heads inner: inner = s mod
  // group and outer = ⌊s / group⌋ (the row blocks from the last down, at each the heads from
  // n_block mod group on); else inner = the step within its head's walk, outer = the head.
  __device__ __forceinline__ common::StepCursor first_step(int group) const {
    return common::StepCursor{heads_inner ? group : m_block_max - m_block_min};
  }
  // The row block of the cursor's step.
  __device__ __forceinline__ int block_at(const common::StepCursor& c) const {
    if (heads_inner) return m_block_max - 1 - c.outer;
    return staggered ? walk.block_at(n_block, c.inner) : m_block_min + c.inner;
  }
  // The query head of the cursor's step within the group.
  __device__ __forceinline__ int head_at(const common::StepCursor& c) const {
    return heads_inner ? c.rotated(head_shift) : c.outer;
  }
  // This tile's deterministic turn at row block m: staggered, by arrival; else descending from the
  // last tile that reaches m.
  template <int kBlockM, int kBlockN>
  __device__ __forceinline__ int turn_at(int m) const {
    return staggered ? walk.turn(n_block, m) : last_tile_of<kBlockM, kBlockN>(m) - n_block;
  }
  // No key of the sequence in this tile: nothing to compute or store.
  __device__ __forceinline__ bool empty(int kBlockN) const { return n_block * kBlockN >= seqlen_k; }
  // The last key tile whose walk reaches row block m: the tile of the block's last visible key
  // (the tiles that reach m are consecutive and end there; tests/cpp/test_mask.cpp).
  template <int kBlockM, int kBlockN>
  __device__ __forceinline__ int last_tile_of(int m) const {
    return (mask.block_col_end(min((m + 1) * kBlockM, seqlen_q)) - 1) / kBlockN;
  }
  __device__ __forceinline__ int steps(int group) const { return (m_block_max - m_block_min) * group; }
};

template <class Traits>
struct BwdMainloop {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kHeadDimV = Traits::kHeadDimV;
  static constexpr int kStages = Traits::kStages;
  using SharedStorage = typename Traits::SharedStorage;
  using Pipeline = TmaPipeline<kStages>;

  // Row statistics of (batch, head, row block m) in the scratch.
  __device__ static std::int64_t stat_offset(const BwdParams<Traits>& params, const BwdTile& t, int head, int m) {
    return std::int64_t(head) * params.rows.head_stride + t.stat_row0 + std::int64_t(m) * kBlockM;
  }

  // Rows [from, rows) of a shared-memory tile (rows, cols) set to zero by the consumer threads
  // together. The caller fences and meets the other warpgroup (BwdBarrier::kTailZeroed) before the
  // tensor cores read the tile.
  template <class Tile>
  __device__ static void zero_rows_from(Tile tile, int from, int thread) {
    constexpr int kRowsOf = decltype(size<0>(tile))::value;
    constexpr int kCols = decltype(size<1>(tile))::value;
    for (int i = from * kCols + thread; i < kRowsOf * kCols; i += Traits::kConsumerThreads) {
      tile(i / kCols, i % kCols) = Element(0);
    }
  }
  __device__ static void tail_zeroed() {
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync(int(BwdBarrier::kTailZeroed), Traits::kConsumerThreads);
  }

  // --- producer: one thread -------------------------------------------------------------------
  // K and V once, then for step s (head s / row blocks of the group, row block s % row blocks) Q
  // with lse·log2 e and dO with softmax_d, each into the next free stage of its ring. Q and dO stay
  // in L2 for the CTAs of the other key tiles (EVICT_LAST).
  __device__ static void load(const BwdParams<Traits>& params, SharedStorage& ss, const Pipeline& q_pipe,
                              const Pipeline& do_pipe, const BwdTile& t) {
    Tensor mQ = params.tma_q.get_tma_tensor(params.shape_q);
    Tensor mdO = params.tma_do.get_tma_tensor(params.shape_do);
    Tensor mK = params.tma_k.get_tma_tensor(params.shape_k);
    Tensor mV = params.tma_v.get_tma_tensor(params.shape_v);
    Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutdO{});
    Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutV{});
    auto tma_q = params.tma_q.get_slice(_0{});
    auto tma_do = params.tma_do.get_slice(_0{});
    auto tma_k = params.tma_k.get_slice(_0{});
    auto tma_v = params.tma_v.get_slice(_0{});

    // Varlen: one packed batch, the sequence's tiles offset by its first row (the rows of the next
    // sequence that a tile reaches are zeroed by the consumers; past the tensor TMA reads zeros).
    const int batch = Traits::kVarlen ? 0 : t.batch;
    const int q_row0 = Traits::kVarlen ? t.q_row0 : 0, k_row0 = Traits::kVarlen ? t.k_row0 : 0;
    Tensor gK = local_tile(domain_offset(make_coord(k_row0, _0{}), mK(_, _, t.kv_head, batch)),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(t.n_block, _0{}));
    Tensor gV = local_tile(domain_offset(make_coord(k_row0, _0{}), mV(_, _, t.kv_head, batch)),
                           Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(t.n_block, _0{}));
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.kv_full, Traits::kTmaBytesKV);
    copy(params.tma_k.with(ss.kv_full), tma_k.partition_S(gK), tma_k.partition_D(sK));
    copy(params.tma_v.with(ss.kv_full), tma_v.partition_S(gV), tma_v.partition_D(sV));
    // Launched as the preprocess's dependent (bwd_dependent_launch): the row statistics it writes
    // are read from here on, once it has finished (K and V, the caller's, are already on their way).
    asm volatile("griddepcontrol.wait;\n" ::: "memory");

    constexpr auto kKeep = TMA::CacheHintSm90::EVICT_LAST;
    const int group = params.p.group_size();
    PipelineState<kStages> st = Pipeline::producer_start();
    common::StepCursor cursor = t.first_step(group);
    for (int s = 0; s < t.steps(group); ++s, cursor.advance()) {
      const int head = t.kv_head * group + t.head_at(cursor);
      const int m = t.block_at(cursor);
      Tensor gQ = local_tile(domain_offset(make_coord(q_row0, _0{}), mQ(_, _, head, batch)),
                             Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m, _0{}));
      Tensor gdO = local_tile(domain_offset(make_coord(q_row0, _0{}), mdO(_, _, head, batch)),
                              Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(m, _0{}));
      const std::int64_t stats = stat_offset(params, t, head, m);
      {
        std::uint64_t& full = q_pipe.producer_acquire(st, Traits::kTmaBytesQ + Traits::kStatBytes);
        copy(params.tma_q.with(full, 0, kKeep), tma_q.partition_S(gQ), tma_q.partition_D(sQ(_, _, st.index)));
        SM90_BULK_COPY_G2S::copy(params.lse_log2 + stats, &full, ss.lse_log2[st.index], Traits::kStatBytes);
      }
      {
        std::uint64_t& full = do_pipe.producer_acquire(st, Traits::kTmaBytesdO + Traits::kStatBytes);
        copy(params.tma_do.with(full, 0, kKeep), tma_do.partition_S(gdO), tma_do.partition_D(sdO(_, _, st.index)));
        SM90_BULK_COPY_G2S::copy(params.dpsum + stats, &full, ss.dpsum[st.index], Traits::kStatBytes);
      }
      st.advance();
    }
  }

  // --- the dQ writer: warp kDqWriterWarp of the producer warpgroup ----------------------------
  // Per step, each consumer warpgroup's staged slice is added to the accumulator's row block by
  // one bulk reduce-add (fp32, the fragment order of both sides); once both have been read out of
  // shared memory the warpgroups may stage the next step's (not after the last step: every
  // arrival on a named barrier is matched).
  __device__ static void write_dq(const BwdParams<Traits>& params, SharedStorage& ss, const BwdTile& t, int lane) {
    constexpr int kWgs = Traits::kConsumerWarpgroups;
    constexpr int kThreads = Traits::kWarpgroupThreads + 32;
    constexpr std::uint32_t kBytes = Traits::kDqFloatsPerWarpgroup * sizeof(float);
    const int group = params.p.group_size();
    const int steps = t.steps(group);
    // The accumulator is cleared by the preprocess, which this kernel may start beside
    // (bwd_dependent_launch): the first addition waits for its end.
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    common::StepCursor cursor = t.first_step(group);
    for (int s = 0; s < steps; ++s, cursor.advance()) {
      const int head = t.kv_head * group + t.head_at(cursor);
      const int m = t.block_at(cursor);
      float* const rows = params.dq_accum + stat_offset(params, t, head, m) * kHeadDim;
      // Deterministic: the key tiles that reach row block m add their dQ in descending key-tile
      // order, from the last tile that reaches m down, each once its predecessors' additions have
      // landed. The tiles launch in that order (BwdTile::of_block, reversed), so a waiting CTA's
      // predecessors are running or done. Descending, a CTA's turn at its j-th row block follows
      // its successor's (j − 1)-th or earlier under causal and sliding-window masks (whose walks
      // start later for later tiles): the CTAs run side by side instead of each a step behind
      // the previous one, as an ascending order makes them (a wavefront over the key tiles).
      // Unmasked walks are staggered instead where they can be (BwdTile::staggered; not when
      // built with FLASHATTN_SM90_BWD_STAGGER=0): a descending chain there makes each tile wait
      // for the one before it at every row block.
      int* const semaphore = params.dq_semaphores == nullptr
                                 ? nullptr
                                 : params.dq_semaphores + stat_offset(params, t, head, m) / kBlockM;
      if (semaphore != nullptr && lane == 0) {
        const int turn = t.template turn_at<kBlockM, kBlockN>(m);
        for (std::uint32_t polls = 1; load_acquire(semaphore) != turn; ++polls) {
          if constexpr (kBwdTurnWatchdog) {
            if (polls == (1u << 24)) {
              printf("flashattn sm90 backward: dQ turn stalled: batch %d, kv head %d, key tile %d (of %d), step %d of "
                     "%d, head %d, row block %d (of %d): turn %d, the block at %d, staggered %d\n",
                     t.batch, t.kv_head, t.n_block, t.walk.n_tiles, s, steps, head, m, t.walk.m_blocks, turn,
                     load_acquire(semaphore), int(t.staggered));
              __trap();
            }
          }
        }
        asm volatile("fence.proxy.async.global;" ::: "memory");  // the bulk additions come after
      }
      // bar.sync is aligned: the whole warp executes it together, so the warp reconverges after
      // lane 0's own work (the turn's wait, the bulk issue) before each named barrier.
      __syncwarp();
      for (int wg = 0; wg < kWgs; ++wg) {
        named_barrier_sync(int(BwdBarrier::kDqFullWg0) + wg, kThreads);
        if (lane == 0) {
          const std::uint32_t src = cute::cast_smem_ptr_to_uint(ss.dq[wg]);
          asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(
                           rows + wg * Traits::kDqFloatsPerWarpgroup),
                       "r"(src), "r"(kBytes)
                       : "memory");
          cute::tma_store_arrive();  // commit the bulk group
        }
        __syncwarp();
      }
      if (semaphore != nullptr && lane == 0) {
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // landed, not only read
        asm volatile("fence.proxy.async.global;" ::: "memory");
        release_increment(semaphore);
      }
      if (s + 1 == steps) break;
      if (lane == 0) cute::tma_store_wait<0>();  // the slices have been read (not yet added)
      __syncwarp();
      for (int wg = 0; wg < kWgs; ++wg) named_barrier_arrive(int(BwdBarrier::kDqEmptyWg0) + wg, kThreads);
    }
    // The last additions complete (not only their reads) before the thread exits.
    if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }

  // --- consumers: two warpgroups of 64 keys each (split d: of half the rows, then half of d) ----
  // thread: index among the consumer threads. Leaves dK and dV in acc_dk / acc_dv (fp32; dK from
  // dS without softmax_scale, which the kernel applies once to the sum, as the postprocess does to
  // dQ: one multiply per score less in the step; with it where Traits::kScaleInDs).
  template <class AccK, class AccV>
  __device__ static void compute(const BwdParams<Traits>& params, SharedStorage& ss, const Pipeline& q_pipe,
                                 const Pipeline& do_pipe, const BwdTile& t, int thread, AccK& acc_dk,
                                 AccV& acc_dv) {
    const common::AttentionParams& p = params.p;
    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmadK mma_dk;
    typename Traits::TiledMmadV mma_dv;
    typename Traits::TiledMmadQ mma_dq;
    // kSdpByWarpgroup: Sᵀ and dPᵀ are each one warpgroup's tiled MMA, indexed by its own threads.
    constexpr bool kSdpByWg = Traits::kSdpByWarpgroup;
    const int sdp_thread = kSdpByWg ? thread % Traits::kWarpgroupThreads : thread;
    auto thr_sdp = mma_sdp.get_thread_slice(sdp_thread);
    auto thr_dk = mma_dk.get_thread_slice(thread);
    auto thr_dv = mma_dv.get_thread_slice(thread);
    auto thr_dq = mma_dq.get_thread_slice(thread);
    const int wg = thread / Traits::kWarpgroupThreads;

    Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutV{});
    Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutdO{});
    Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutdOt{});
    Tensor sdS = make_tensor(make_smem_ptr(ss.ds.data()), typename Traits::SmemLayoutdS{});
    Tensor sdSt = make_tensor(make_smem_ptr(ss.ds.data()), typename Traits::SmemLayoutdSt{});
    Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKt{});
    Tensor sP = make_tensor(make_smem_ptr(ss.p_tile()), typename Traits::SmemLayoutdS{});  // split d only

    Tensor tSrK = thr_sdp.partition_fragment_A(sK);     // descriptors
    Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);     // (MMA, MMA_N, MMA_K, stage)
    Tensor tPrV = thr_sdp.partition_fragment_A(sV);
    Tensor tPrdO = thr_sdp.partition_fragment_B(sdO);
    // kSdpByWarpgroup: K and Qᵀ for the first warpgroup, V and dOᵀ for the second, in one pair of
    // tensors (the layouts are the same: d = dv there).
    Tensor tSdpA = thr_sdp.partition_fragment_A(
        make_tensor(make_smem_ptr(kSdpByWg && wg == 1 ? ss.v.data() : ss.k.data()), typename Traits::SmemLayoutK{}));
    Tensor tSdpB = thr_sdp.partition_fragment_B(
        make_tensor(make_smem_ptr(kSdpByWg && wg == 1 ? ss.dout.data() : ss.q.data()), typename Traits::SmemLayoutQ{}));
    Tensor tVrdOt = thr_dv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, stage)
    Tensor tKrQt = thr_dk.partition_fragment_B(sQt);
    // dQ's operands: dS (MMA, MMA_M, MMA_K, buffer) and Kᵀ, or (transposed) Kᵀ and dS as B.
    auto tQrdS = [&] {
      if constexpr (Traits::kDqTransposed) {
        return thr_dq.partition_fragment_B(sdSt);
      } else {
        return thr_dq.partition_fragment_A(sdSt);
      }
    }();
    auto tQrKt = [&] {
      if constexpr (Traits::kDqTransposed) {
        return thr_dq.partition_fragment_A(sKt);
      } else {
        return thr_dq.partition_fragment_B(sKt);
      }
    }();
    // Split d: Pᵀ and dSᵀ of both warpgroups' rows as the A operands of dV and dK.
    Tensor tVrP = thr_dv.partition_fragment_A(sP);      // (MMA, MMA_M, MMA_K, buffer)
    Tensor tKrdS = thr_dk.partition_fragment_A(sdS);

    constexpr auto kShapeSdP = select<0, 1>(typename Traits::TileShapeSdP{});
    Tensor acc_s = partition_fragment_C(mma_sdp, kShapeSdP);
    // kSdpByWarpgroup: one accumulator, Sᵀ in the first warpgroup and dPᵀ in the second.
    Tensor acc_dp_own = partition_fragment_C(mma_sdp, kShapeSdP);
    Tensor acc_dp = make_tensor(kSdpByWg ? acc_s.data() : acc_dp_own.data(), acc_s.layout());
    Tensor s_rc = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));    // (keys, rows)
    Tensor dp_rc = make_tensor(acc_dp.data(), rowcol_layout(acc_dp.layout()));
    Tensor p_frag = make_tensor<Element>(acc_as_a_operand_layout(acc_s.layout()));
    Tensor ds_frag = make_tensor<Element>(acc_as_a_operand_layout(acc_s.layout()));
    Tensor p_flat = make_tensor(p_frag.data(), acc_s.layout());
    Tensor p16_rc = make_tensor(p_frag.data(), rowcol_layout(acc_s.layout()));  // Pᵀ in 16 bits, (keys, rows)
    Tensor ds_flat = make_tensor(ds_frag.data(), acc_s.layout());
    Tensor acc_dq = partition_fragment_C(mma_dq, select<0, 1>(typename Traits::TileShapedQ{}));
    // One step's dQ = dS·K from row block buffer `buffer` (or its transpose, kDqTransposed).
    auto dq_product = [&](int buffer) {
      if constexpr (Traits::kDqTransposed) {
        wgmma<true>(mma_dq, tQrKt, tQrdS(_, _, _, buffer), acc_dq);
      } else {
        wgmma<true>(mma_dq, tQrdS(_, _, _, buffer), tQrKt, acc_dq);
      }
    };
    auto r2s_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto thr_r2s_ds = r2s_ds.get_thread_slice(sdp_thread);
    Tensor r2s_ds_src = thr_r2s_ds.retile_S(ds_flat);  // dSᵀ in 16 bits, the accumulator layout
    Tensor r2s_ds_dst = thr_r2s_ds.partition_D(sdS);   // (CPY, CPY_M, CPY_N, buffer)
    Tensor r2s_p_src = thr_r2s_ds.retile_S(p_flat);    // split d: Pᵀ the same way
    Tensor r2s_p_dst = thr_r2s_ds.partition_D(sP);
    // kSdpByWarpgroup: the second warpgroup reads the first's Pᵀ back by ldmatrix, in the
    // accumulator's layout (the two warpgroups' fragments cover the same elements).
    auto s2r_p = make_tiled_copy_C(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, mma_sdp);
    auto thr_s2r_p = s2r_p.get_thread_slice(sdp_thread);
    Tensor s2r_p_src = thr_s2r_p.partition_S(sP);     // (CPY, CPY_M, CPY_N, buffer)
    Tensor s2r_p_dst = thr_s2r_p.retile_D(p_flat);

    Tensor c_s = thr_sdp.partition_C(make_identity_tensor(kShapeSdP));
    Tensor c_rc = make_tensor(c_s.data(), rowcol_layout(c_s.layout()));  // (key, row) of each element
    constexpr int kKeys = decltype(size<0>(s_rc))::value;
    constexpr int kRows = decltype(size<1>(s_rc))::value;

    const int key0 = t.n_block * kBlockN;
    // The keys of this warpgroup's Sᵀ: its 64 of the tile, or (split d) all of them.
    const int wg_key_b = key0 + (Traits::kSplitD ? 0 : wg * Traits::kKeysPerWarpgroup);
    const int wg_key_e = wg_key_b + Traits::kKeysPerWarpgroup;
    const int group = p.group_size();

    cutlass::arch::ClusterBarrier::wait(&ss.kv_full, 0);
    // Varlen: K/V rows past the sequence's keys (the next sequence's, or seqused_k's unused ones)
    // are zeroed, so that no Inf/NaN there reaches dP, dS or dQ through a masked score.
    if constexpr (Traits::kVarlen) {
      const int kv_valid = t.seqlen_k - key0;
      if (kv_valid < kBlockN) {
        zero_rows_from(sK, kv_valid, thread);
        zero_rows_from(sV, kv_valid, thread);
        tail_zeroed();
      }
    }
    PipelineState<kStages> st;
    // The mask's bounds in offsets from the diagonal, and which of the thread's keys are in the
    // sequence (the same for every step of the tile).
    const int offset_min = t.mask.offset_min();
    const int offset_max = t.mask.offset_max();
    bool key_in[kKeys];
    CUTE_UNROLL
    for (int r = 0; r < kKeys; ++r) key_in[r] = key0 + get<0>(c_rc(r, 0)) < t.seqlen_k;
    // Dropout (kDropout kernels; SPEC §3, docs/dropout.md): the forward's mask, bit for bit. The
    // Sᵀ fragment is the transpose of the forward's accumulator, so a thread's 8 scores of a
    // 16 × 16 block belong to two of the forward's lanes: each thread draws its own lane's 8 bits
    // (one Philox call per block) and takes the two it needs from their lanes by shuffles.
    [[maybe_unused]] common::DropoutParams dropout = p.dropout;
    [[maybe_unused]] const bool use_dropout = Traits::kDropout && p.dropout_p > 0.0f;
    if constexpr (Traits::kDropout) {
      if (use_dropout && params.rng_state != nullptr) {
        dropout.seed = params.rng_state[0];
        dropout.offset = params.rng_state[1];
      }
    }
    static_assert(kKeys == 2 && kRows % 4 == 0, "a thread's keys are g and g + 8 of its warp's 16");
    // The dropout-only kernels draw a step's keep bits right after issuing Sᵀ and dPᵀ, the Philox
    // multiplies under the tensor cores' work instead of between the products (sm90_bwd.h).
    constexpr bool kEarlyDraw = Traits::kMods == kBwdModDropout && kBwdEarlyDropout;
    [[maybe_unused]] std::uint32_t keep[Traits::kDropout ? (2 * kRows + 31) / 32 : 1];  // bit 2·col + key
    // Softcap's derivative per score (kSoftcap kernels only), as fp16 pairs: it multiplies dSᵀ,
    // which is rounded to 16 bits itself, and 1 − tanh² ∈ [0, 1] keeps 11 bits there (fp32 took
    // 32 more registers, spilled).
    [[maybe_unused]] __half2 dtanh[Traits::kSoftcap ? kKeys * kRows / 2 : 1];
    // The keep bits of step s's tile (row block row0): one Philox call per 16 × 16 block.
    [[maybe_unused]] auto draw_keep = [&](int row0, int head_in_group) {
      if constexpr (Traits::kDropout) {
        const int lane = thread % 32;
        const int key_block = (key0 + get<0>(c_rc(0, 0))) >> 4;  // the warp's 16 keys
        const std::uint64_t stream = p.dropout_stream(t.batch, t.kv_head * group + head_in_group);
        // The 16-row block of the thread's first row: its warpgroup's first (split d: 0 or
        // block_m / 2) + 2 · (lane % 4).
        const int row_block = Traits::kSplitD ? (row0 + get<1>(c_rc(0, 0))) >> 4 : row0 >> 4;
        CUTE_UNROLL
        for (int w = 0; w < (2 * kRows + 31) / 32; ++w) keep[w] = 0;
        CUTE_UNROLL
        for (int q = 0; q < kRows / 4; ++q) {  // 16 query rows: columns 4q … 4q + 3 of s_rc
          const std::uint32_t own = common::dropout_keep_bits(dropout, stream, row_block + q, key_block, lane);
          const std::uint32_t lanes[2] = {
              __shfl_sync(0xffffffffu, own, common::dropout_transposed_source(lane, 0, 0, 0).lane),
              __shfl_sync(0xffffffffu, own, common::dropout_transposed_source(lane, 0, 1, 0).lane)};
          CUTE_UNROLL
          for (int b = 0; b < 2; ++b) {      // row 2t + b (+ 8c) of the block
            CUTE_UNROLL
            for (int c = 0; c < 2; ++c) {
              CUTE_UNROLL
              for (int a = 0; a < 2; ++a) {  // key g + 8a
                const int col = 4 * q + 2 * c + b;  // s_rc's column: (pair b, 8-column group 2q + c)
                const std::uint32_t bit = (lanes[b] >> common::dropout_transposed_source(lane, a, b, c).element) & 1u;
                const int at = 2 * col + a;
                keep[at / 32] |= bit << (at % 32);
              }
            }
          }
        }
      }
    };
    common::StepCursor cursor = t.first_step(group);
    for (int s = 0; s < t.steps(group); ++s, cursor.advance()) {
      const int m = t.block_at(cursor);
      const int head_in_group = t.head_at(cursor);
      const int buffer = s & 1;
      const int row0 = m * kBlockM;
      // Softcap and ALiBi (kSoftcap, kAlibi): raw scores in device::TileScoreMod's units, whose
      // out_scale · log2 e is the exponent's multiplier; ALiBi's slope is the head's.
      [[maybe_unused]] const device::TileScoreMod mod(
          p.template score_mod_for<float>(t.batch, t.kv_head * group + head_in_group, t.seqlen_q, t.seqlen_k),
          Traits::kScoreMod);
      const float exp_scale = Traits::kScoreMod ? mod.out_scale * device::kLog2e : params.scale_log2;

      q_pipe.consumer_wait(st);
      if constexpr (Traits::kVarlen) {
        // Q and dO rows past the sequence (the next one's) are zeroed: their lse is +∞ and
        // softmax_d 0 (the padding), so they add nothing to dK, dV.
        do_pipe.consumer_wait(st);
        const int q_valid = t.seqlen_q - row0;
        if (q_valid < kBlockM) {
          zero_rows_from(sQ(_, _, st.index), q_valid, thread);
          zero_rows_from(sdO(_, _, st.index), q_valid, thread);
          tail_zeroed();
        }
      }
      // kSdpByWarpgroup: the first warpgroup computes Sᵀ, the second dPᵀ (each on its own from
      // here to the barrier over dSᵀ).
      const bool s_side = !kSdpByWg || wg == 0;
      const bool dp_side = !kSdpByWg || wg == 1;
      if constexpr (kSdpByWg) {  // one call site, each warpgroup's own operands (K·Qᵀ or V·dOᵀ)
        if constexpr (!Traits::kVarlen) do_pipe.consumer_wait(st);
        wgmma<true>(mma_sdp, tSdpA, tSdpB(_, _, _, st.index), acc_s);
      } else {
        wgmma<true>(mma_sdp, tSrK, tSrQ(_, _, _, st.index), acc_s);
        if constexpr (!Traits::kVarlen) do_pipe.consumer_wait(st);
        wgmma<true>(mma_sdp, tPrV, tPrdO(_, _, _, st.index), acc_dp);
      }
      // The keep bits depend on positions only: drawn while both products run (kEarlyDraw).
      if constexpr (kEarlyDraw) {
        if (use_dropout) draw_keep(row0, head_in_group);
      }
      // The row statistics are read from shared memory where they are used (registers are short).
      const float* const lse_log2 = ss.lse_log2[st.index];
      const float* const dpsum = ss.dpsum[st.index];
      if constexpr (kSdpByWg) {
        cute::warpgroup_wait<0>();  // this warpgroup's one product has landed
      } else {
        cute::warpgroup_wait<1>();  // Sᵀ has landed; dPᵀ still runs
      }
      if (s_side) {
        if constexpr (Traits::kSoftcap) {
          if (mod.softcap) {
            CUTE_UNROLL
            for (int e = 0; e < size(acc_s); e += 2) {
              acc_s(e) = device::TileScoreMod::tanh(acc_s(e) * mod.k);
              acc_s(e + 1) = device::TileScoreMod::tanh(acc_s(e + 1) * mod.k);
              dtanh[e / 2] =
                  __floats2half2_rn(fmaf(-acc_s(e), acc_s(e), 1.0f), fmaf(-acc_s(e + 1), acc_s(e + 1), 1.0f));
            }
          }
        }
        if constexpr (Traits::kAlibi) {
          if (mod.alibi) {  // distance |i + sk − sq − j| of row i and key j
            const int key_first = key0 + get<0>(c_rc(0, 0));
            CUTE_UNROLL
            for (int c = 0; c < kRows; ++c) {
              const float base = mod.alibi_base(row0 + get<1>(c_rc(0, c)), key_first);
              CUTE_UNROLL
              for (int r = 0; r < kKeys; ++r) {
                s_rc(r, c) = mod.add_alibi(s_rc(r, c), base, get<0>(c_rc(r, 0)) - get<0>(c_rc(0, 0)));
              }
            }
          }
        }
        // Pᵀ, with the keys a row does not see (and keys past the sequence) at 0. Rows past the
        // sequence have lse = +∞ and Q = 0: their P is 0 too.
        // The mask in offsets from the diagonal (common::Mask::offset), 32-bit: the block's smallest
        // and largest offsets decide whether it needs per-element masking, and an element's offset is
        // the thread's first one plus constants of the fragment's layout.
        const int row_e = min(row0 + kBlockM, t.seqlen_q);
        // (Mask::offset's sum, with the block's corners: its smallest offset at (row_e − 1, wg_key_b),
        // its largest at (row0, wg_key_e − 1).)
        const int diag_shift = t.seqlen_q - t.seqlen_k;
        const bool masked = wg_key_e > t.seqlen_k ||
                            (!Traits::kNoMask && (wg_key_b - (row_e - 1) + diag_shift < offset_min ||
                                                  wg_key_e - 1 - row0 + diag_shift > offset_max));
        if (masked) {
          const int first = t.mask.offset(row0 + get<1>(c_rc(0, 0)), key0 + get<0>(c_rc(0, 0)));
          CUTE_UNROLL
          for (int c = 0; c < kRows; ++c) {
            CUTE_UNROLL
            for (int r = 0; r < kKeys; ++r) {
              const int off =
                  first + (get<0>(c_rc(r, 0)) - get<0>(c_rc(0, 0))) - (get<1>(c_rc(0, c)) - get<1>(c_rc(0, 0)));
              if (!key_in[r] || (!Traits::kNoMask && (off < offset_min || off > offset_max))) {
                s_rc(r, c) = -device::kInf;
              }
            }
          }
        }
        CUTE_UNROLL
        for (int c = 0; c < kRows; ++c) {
          const float lse = lse_log2[get<1>(c_rc(0, c))];
          CUTE_UNROLL
          for (int r = 0; r < kKeys; ++r) s_rc(r, c) = device::exp2_ftz(fmaf(s_rc(r, c), exp_scale, -lse));
        }
      }  // s_side
      if constexpr (Traits::kDropout && !kEarlyDraw) {
        if (use_dropout) draw_keep(row0, head_in_group);
      }
      auto kept = [&](int r, int c) { return ((keep[(2 * c + r) / 32] >> ((2 * c + r) % 32)) & 1u) != 0; };
      // Pᵀ in 16 bits for dV += Pᵀ·dO, and that product issued (after dSᵀ, below); split d: Pᵀ
      // to shared memory, the product issued once both warpgroups' rows are there.
      auto issue_dv = [&] {
        if constexpr (Traits::kDropout) {
          if (use_dropout) {  // dV takes the dropped P, scaled by 1 / (1 − p)
            Tensor p_rc = make_tensor(p_frag.data(), rowcol_layout(acc_s.layout()));
            CUTE_UNROLL
            for (int c = 0; c < kRows; ++c) {
              CUTE_UNROLL
              for (int r = 0; r < kKeys; ++r) {
                p_rc(r, c) = Element(kept(r, c) ? s_rc(r, c) * dropout.keep_scale : 0.0f);
              }
            }
          } else {
            convert_fragment<Element>(acc_s, p_flat);
          }
        } else {
          convert_fragment<Element>(acc_s, p_flat);
        }
        if constexpr (Traits::kSplitD) {
          copy(r2s_ds, r2s_p_src, r2s_p_dst(_, _, _, buffer));
        } else {
          wgmma<false>(mma_dv, p_frag, tVrdOt(_, _, _, st.index), acc_dv);
        }
      };
      if constexpr (kSdpByWg) {
        // Pᵀ from the first warpgroup to the second, through its tile for dV.
        if (wg == 0) {
          issue_dv();
          cutlass::arch::fence_view_async_shared();
          named_barrier_arrive(int(BwdBarrier::kPWritten), Traits::kConsumerThreads);
        } else {
          named_barrier_sync(int(BwdBarrier::kPWritten), Traits::kConsumerThreads);
          copy(s2r_p, s2r_p_src(_, _, _, buffer), s2r_p_dst);
        }
      } else {
        cute::warpgroup_wait<0>();  // dPᵀ has landed
      }
      if (dp_side) {
        CUTE_UNROLL
        for (int c = 0; c < kRows; ++c) {
          const float d = dpsum[get<1>(c_rc(0, c))];
          CUTE_UNROLL
          for (int r = 0; r < kKeys; ++r) {
            float dp = dp_rc(r, c);
            if constexpr (Traits::kDropout) {
              if (use_dropout) dp = kept(r, c) ? dp * dropout.keep_scale : 0.0f;  // dP of the dropped P
            }
            // (kSdpByWarpgroup: Pᵀ as the first warpgroup stored it, in 16 bits.)
            const float pr = kSdpByWg ? float(p16_rc(r, c)) : s_rc(r, c);
            dp_rc(r, c) = Traits::kScaleInDs ? pr * (dp - d) * p.softmax_scale : pr * (dp - d);
          }
        }
        if constexpr (Traits::kSoftcap) {  // d(c · tanh(k · dot)) / d dot = scale · (1 − tanh²)
          if (mod.softcap) {
            CUTE_UNROLL
            for (int e = 0; e < size(acc_dp); e += 2) {
              const float2 f = __half22float2(dtanh[e / 2]);
              acc_dp(e) *= f.x;
              acc_dp(e + 1) *= f.y;
            }
          }
        }
        // dV after dSᵀ (FlashAttention-3's order): Sᵀ's fp32 values die with dSᵀ, so P's 16 bits
        // never live beside both accumulators. Issued before it, to run under it, the product kept
        // them live together: 8–12 % slower at d 64 (ptxas serialized every wgmma there for want
        // of registers) and no faster at d 128 (src/cuda/README.md, removed knobs). kDvLate
        // issues it once dSᵀ is in shared memory, as FlashAttention-3 does (the 80-row tile
        // always: issued before the conversion, ptxas serializes every wgmma of it, C7512).
        if constexpr (!Traits::kDvLate && !kSdpByWg) issue_dv();
        convert_fragment<Element>(acc_dp, ds_flat);

        // dSᵀ into this row block's buffer for the dQ product, which needs both warpgroups' keys:
        // stmatrix, 8 × 8 blocks of 16-bit values per instruction, conflict-free in the swizzle.
        copy(r2s_ds, r2s_ds_src, r2s_ds_dst(_, _, _, buffer));
        if constexpr (Traits::kDvLate) issue_dv();
        cutlass::arch::fence_view_async_shared();
      }  // dp_side

      // dQ of this row block to the writer warp, through this warpgroup's slice (float4 v of
      // thread l at (v · 128 + l) · 4: conflict-free, and the order the accumulator keeps).
      auto stage_dq = [&] {
        constexpr int kDqThreads = Traits::kWarpgroupThreads + 32;
        if (s > 0) named_barrier_sync(int(BwdBarrier::kDqEmptyWg0) + wg, kDqThreads);
        float4* const slice = reinterpret_cast<float4*>(ss.dq[wg]);
        const int lane = thread % Traits::kWarpgroupThreads;
        CUTE_UNROLL
        for (int v = 0; v < Traits::kDqFloatsPerThread / 4; ++v) {
          slice[v * Traits::kWarpgroupThreads + lane] =
              make_float4(acc_dq(4 * v), acc_dq(4 * v + 1), acc_dq(4 * v + 2), acc_dq(4 * v + 3));
        }
        cutlass::arch::fence_view_async_shared();
        named_barrier_arrive(int(BwdBarrier::kDqFullWg0) + wg, kDqThreads);
      };
      // dK += dSᵀ·Q: dSᵀ from registers, or (split d) both warpgroups' from shared memory.
      auto issue_dk = [&] {
        if constexpr (Traits::kSplitD) {
          wgmma<false>(mma_dk, tKrdS(_, _, _, buffer), tKrQt(_, _, _, st.index), acc_dk);
        } else {
          wgmma<false>(mma_dk, ds_frag, tKrQt(_, _, _, st.index), acc_dk);
        }
      };
      if constexpr (!kBwdStageUnderDk && !Traits::kSplitD) issue_dk();  // under the barrier's wait
      named_barrier_sync(int(BwdBarrier::kDsWritten), Traits::kConsumerThreads);
      if constexpr (Traits::kSplitD) {  // this warpgroup's half of d, every row and key of the tile
        wgmma<false>(mma_dv, tVrP(_, _, _, buffer), tVrdOt(_, _, _, st.index), acc_dv);
      }
      if constexpr (kBwdStageUnderDk && !Traits::kSplitD) {
        // dQ before dK (FlashAttention-3's order): once dV and dQ have landed (groups retire in
        // order) dO is given back and dQ staged while dK, the last product, still runs. Split d
        // keeps dK, then dQ: there this order ran at 0.76–0.89 of it (sm90_bwd.h).
        // kDvLate waits for dV before issuing dK, as FlashAttention-3 does: Pᵀ's registers are
        // free before dK's product is in flight beside dQ's accumulator.
        dq_product(buffer);
        if constexpr (Traits::kDvLate) {
          cute::warpgroup_wait<1>();
          do_pipe.consumer_release(st, true);
          issue_dk();
          cute::warpgroup_wait<1>();
        } else {
          issue_dk();
          cute::warpgroup_wait<1>();
          do_pipe.consumer_release(st, true);  // every thread (each read softmax_d)
        }
        stage_dq();
        cute::warpgroup_wait<0>();
        q_pipe.consumer_release(st, true);
        st.advance();
      } else {
        if constexpr (Traits::kSplitD) issue_dk();
        dq_product(buffer);
        cute::warpgroup_wait<0>();
        q_pipe.consumer_release(st, true);  // every thread (the row statistics are read by each)
        do_pipe.consumer_release(st, true);
        st.advance();
        stage_dq();
      }
    }
  }

  // dK and dV of the tile's keys below seqlen_k (zeros where no row sees a key), in the outputs'
  // element type, columns below d and dv: staged by stmatrix in K's and V's shared-memory tiles
  // (free once both warpgroups' last products are done: each dQ product reads every key of K),
  // then 16-byte row pieces to global memory.
  template <class AccK, class AccV>
  __device__ static void store(const BwdParams<Traits>& params, SharedStorage& ss, const BwdTile& t, int thread,
                               const AccK& acc_dk, const AccV& acc_dv) {
    const common::AttentionParams& p = params.p;
    Tensor sdK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
    Tensor sdV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutV{});
    auto r2s_dk = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, typename Traits::TiledMmadK{});
    auto r2s_dv = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, typename Traits::TiledMmadV{});
    auto thr_r2s_dk = r2s_dk.get_thread_slice(thread);
    auto thr_r2s_dv = r2s_dv.get_thread_slice(thread);
    Tensor dk16 = make_tensor<Element>(acc_dk.layout());
    Tensor dv16 = make_tensor<Element>(acc_dv.layout());
    convert_fragment<Element>(acc_dk, dk16);
    convert_fragment<Element>(acc_dv, dv16);
    named_barrier_sync(int(BwdBarrier::kEpilogue), Traits::kConsumerThreads);
    copy(r2s_dk, thr_r2s_dk.retile_S(dk16), thr_r2s_dk.partition_D(sdK));
    copy(r2s_dv, thr_r2s_dv.retile_S(dv16), thr_r2s_dv.partition_D(sdV));
    named_barrier_sync(int(BwdBarrier::kEpilogue), Traits::kConsumerThreads);

    const int key0 = t.n_block * kBlockN;
    Element* const dk = static_cast<Element*>(p.dk.data) + p.k_offset_at(p.dk, t.batch, t.k_row0, key0, t.kv_head);
    Element* const dv = static_cast<Element*>(p.dv.data) + p.k_offset_at(p.dv, t.batch, t.k_row0, key0, t.kv_head);
    store_rows<kHeadDim>(sdK, dk, p.dk.row_stride, p.head_dim, t.seqlen_k - key0, thread);
    store_rows<kHeadDimV>(sdV, dv, p.dv.row_stride, p.head_dim_v, t.seqlen_k - key0, thread);
  }

  // The tile's first `keys` rows of a staged (keys, kCols) tile, columns below `cols`, to `dst`
  // (rows `row_stride` apart), in 16-byte pieces: kCols / 8 consumer threads per row. Where those
  // do not divide the threads (d 96: 12), the last threads idle and the last pass is short.
  template <int kCols, class Tile>
  __device__ static void store_rows(const Tile& tile, Element* dst, std::int64_t row_stride, int cols, int keys,
                                    int thread) {
    constexpr int kChunk = 16 / int(sizeof(Element));  // elements per 16-byte access
    constexpr int kChunks = kCols / kChunk;             // threads per key row
    constexpr int kRowsPerPass = Traits::kConsumerThreads / kChunks;
    constexpr bool kEven = Traits::kConsumerThreads % kChunks == 0 && kBlockN % kRowsPerPass == 0;
    constexpr int kPasses = (kBlockN + kRowsPerPass - 1) / kRowsPerPass;
    const int col = (thread % kChunks) * kChunk;
    CUTE_UNROLL
    for (int pass = 0; pass < kPasses; ++pass) {
      if constexpr (!kEven) {
        if (thread >= kRowsPerPass * kChunks || pass * kRowsPerPass + thread / kChunks >= kBlockN) continue;
      }
      const int key = pass * kRowsPerPass + thread / kChunks;
      if (key < keys && col < cols) {
        *reinterpret_cast<uint4*>(dst + std::int64_t(key) * row_stride + col) =
            *reinterpret_cast<const uint4*>(&tile(key, col));
      }
    }
  }
};

}  // namespace flashattn::cuda::sm90
