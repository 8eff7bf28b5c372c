// src/cuda/sm90/sm90_fwd_traits.cuh — the compile-time shape of one Hopper forward kernel: tile,
// warpgroups, shared-memory layouts (GMMA swizzles, which the TMA boxes write and wgmma reads),
// the two tiled MMAs (S = Q·Kᵀ from shared memory, O += P·V with P in registers), the TMA copy
// types and the shared storage with its barriers.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/numeric_types.h>

#include <cstdint>
#include <type_traits>

#include "cuda/sm90/sm90_fwd.h"
#include "cuda/sm90/sm90_pipeline.cuh"

namespace flashattn::cuda::sm90 {

using namespace cute;

// Element: cutlass::half_t or cutlass::bfloat16_t. kHeadDim: the instantiated head dim of Q and K,
// kHeadDimV of V and O (fwd_head_dim_v: equal, but for the 192 instantiation's 128).
// kBlockM query rows per CTA, 64 per consumer warpgroup; kBlockN keys per pipeline stage.
// kPingPong: the consumer warpgroups take turns to issue their products (FwdMainloop::turn_begin).
// kScoreMod: softcap, ALiBi and dropout compiled in (device::TileScoreMod on each score tile, the
// Philox mask on each probability tile), each taken when the call asks for it.
// kVarlen: varlen batches, seqused_k or a KV cache (tiles offset by cu_seqlens or in the cache's
// batch cache_batch_idx[b]; V rows past the keys zeroed).
// kPaged: K and V through a page table (block_table; a varlen kernel): each key tile is gathered
// in chunks of kPageChunkRows rows × 64 columns, one TMA box each (FwdMainloop::load_paged_tile).
// kSplit: split-KV (FLASHATTN_SM90_FWD_SPLIT): a tile is a share of one row block's key tiles, and
// its O and lse leave as fp32 partials from registers (FwdEpilogue::store_partials).
template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kPingPong_, bool kScoreMod_,
          bool kVarlen_, bool kPaged_ = false, int kHeadDimV_ = kHeadDim_, bool kSplit_ = false>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kPingPong = kPingPong_;
  static constexpr bool kScoreMod = kScoreMod_;
  static constexpr bool kVarlen = kVarlen_;
  static constexpr bool kPaged = kPaged_;
  static constexpr bool kSplit = kSplit_;
  static_assert(!kPaged || kVarlen, "a paged kernel is a varlen kernel (per-sequence key counts, V rows zeroed)");

  static constexpr int kRowsPerWarpgroup = 64;  // the M of one wgmma
  static constexpr int kConsumerWarpgroups = kBlockM / kRowsPerWarpgroup;
  static constexpr int kWarpgroupThreads = 128;
  static constexpr int kConsumerThreads = kConsumerWarpgroups * kWarpgroupThreads;
  static constexpr int kThreads = kConsumerThreads + kWarpgroupThreads;  // + the producer warpgroup
  static_assert(kBlockM % kRowsPerWarpgroup == 0, "each consumer warpgroup owns 64 whole rows");
  static_assert(!kPingPong || kConsumerWarpgroups == 2, "ping-pong pairs two consumer warpgroups");
  // Shared memory: rows of d elements in swizzled atoms of 8 rows × kAtomCols elements, the layout
  // both the TMA boxes and the wgmma descriptors use: 128-byte rows (64 elements) where d and dv
  // are multiples of 64, else 64-byte rows (32 elements: d 96).
  static constexpr int kAtomCols = kHeadDim % 64 == 0 && kHeadDimV % 64 == 0 ? 64 : 32;
  static_assert(kHeadDim % kAtomCols == 0 && kHeadDimV % kAtomCols == 0,
                "head dims are instantiated in multiples of 32 (one 64-byte swizzle row)");
  static_assert(kHeadDimV <= kHeadDim, "O is staged in Q's bytes where there is no room beside");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "a key tile is one wgmma N (multiple of 16, at most 256)");
  static_assert(sizeof(Element) == 2, "16-bit inputs: the S accumulator's layout is the P·V A-operand layout");

  using TileShapeQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // (M, N, K) of S = Q·Kᵀ
  using TileShapePV = Shape<Int<kBlockM>, Int<kHeadDimV>, Int<kBlockN>>;  // (M, N, K) of O = P·V
  // The warpgroups stack along M: each owns 64 rows of S and O, so a score row never leaves its
  // warpgroup (and never its quad of threads).
  using AtomLayout = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(ss_op<Element, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(), AtomLayout{}));
  // V is stored as K is, (kBlockN, d) with d contiguous: for P·V it is the B operand (N = d,
  // K = keys) with N contiguous, "MN-major", which wgmma reads transposed from shared memory.
  using TiledMmaPV = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<Element, Element, float, TileShapePV, GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayout{}));

  using SmemAtom = std::conditional_t<kAtomCols == 64, GMMA::Layout_K_SW128_Atom<Element>,
                                      GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));  // (M, d)
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));  // (N, d, stage)
  using SmemLayoutV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDimV>, Int<kStages>>{}));  // (N, dv, stage)
  // V seen as Vᵀ (dv, N, stage): the same bytes with the first two coordinates swapped.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{},
      make_ordered_layout(Shape<Int<kHeadDimV>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  // Q buffers (fwd_q_stages): with two, the producer loads the next tile's Q while this tile's
  // first key tiles are computed, and each tile's O is staged in its own Q's bytes. With one, O is
  // staged in its own tile where shared memory allows (the next tile's Q then loads while this
  // one's O is written out), else in Q's bytes (d 256: Q, K and V take 192 of the 227 KiB).
  using SmemLayoutO = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDimV>>{}));  // (M, dv)
  static constexpr bool kRoomForTwoQ = fwd_room_for_two_q(FwdTileShape{kBlockM, kBlockN, kStages}, kHeadDim);
  static constexpr int kQStages = fwd_q_stages(kHeadDim) == 2 && kRoomForTwoQ ? 2 : 1;
  static constexpr bool kSeparateO = kQStages == 1 && kRoomForTwoQ;
  // O leaves by TMA (fwd_tma_store), stored by the producer warpgroup's warp kOStoreWarp from
  // Q's bytes or from O's own tile.
  static constexpr bool kTmaStoreO = fwd_tma_store(kHeadDim, kScoreMod) && !kVarlen && !kSplit;
  // O rescaled lazily (fwd_lazy_rescale; OnlineSoftmax's kLazy).
  static constexpr bool kLazyRescale = fwd_lazy_rescale(kHeadDimV);
  // Dropout's keep bits drawn before the wait for S (FLASHATTN_SM90_FWD_DROPOUT_EARLY; the score-mod kernels).
  static constexpr bool kDropoutEarly = kScoreMod && FLASHATTN_SM90_FWD_DROPOUT_EARLY == 1;
  // Softcap calls: exponentials per 8 columns on the FMA pipe (FLASHATTN_SM90_FWD_SOFTCAP_POLY_EXP).
  static constexpr int kSoftcapPolyCols = kScoreMod ? FLASHATTN_SM90_FWD_SOFTCAP_POLY_EXP : 0;
  // Tiles decoded by the host's FastDivmod constants (FwdParams::divisors) or by division.
  static constexpr bool kFastDivmod = fwd_fast_divmod(kHeadDim);

  // Registers per thread after setmaxnreg: the producer gives most of its share to the consumers,
  // which hold S (kBlockN / 2 fp32), P (kBlockN / 4) and O (kHeadDimV / 2) per thread. The sums
  // stay within the CTA's registers (setmaxnreg_pool: 63K of 384 threads, 64K of 512):
  // 128 · kProducerRegs + kConsumerThreads · kConsumerRegs. With O stored by TMA the producer
  // warpgroup walks the tiles twice (loads, stores): 32, and the two consumer warpgroups 232.
  // FLASHATTN_SM90_FWD_PAGED_PRODUCER_REGS (A/B builds): the paged kernels' producer share, whose
  // thread reads the page table and issues a TMA box per page chunk; their consumers take what the
  // pool leaves, in steps of 8, at most the default.
  static constexpr int kDefaultProducerRegs = kConsumerWarpgroups == 2 && !kTmaStoreO ? 24 : 32;
  static constexpr int kDefaultConsumerRegs = kConsumerWarpgroups == 2 ? (kTmaStoreO ? 232 : 240) : 160;
#ifdef FLASHATTN_SM90_FWD_PAGED_PRODUCER_REGS
  static constexpr int kProducerRegs = kPaged ? FLASHATTN_SM90_FWD_PAGED_PRODUCER_REGS : kDefaultProducerRegs;
  static constexpr int kPoolConsumerRegs =
      (setmaxnreg_pool(kThreads) - kWarpgroupThreads * kProducerRegs) / kConsumerThreads / 8 * 8;
  static constexpr int kConsumerRegs =
      kPoolConsumerRegs < kDefaultConsumerRegs ? kPoolConsumerRegs : kDefaultConsumerRegs;
#else
  static constexpr int kProducerRegs = kDefaultProducerRegs;
  static constexpr int kConsumerRegs = kDefaultConsumerRegs;
#endif
  static_assert(kWarpgroupThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <= setmaxnreg_pool(kThreads),
                "the register split exceeds the CTA's registers: setmaxnreg would wait for ever");

  // Global views given to TMA: (rows, d, heads, batch) with the caller's strides.
  using ShapeRows = Shape<std::int32_t, std::int32_t, std::int32_t, std::int32_t>;
  using StrideRows = Stride<std::int64_t, _1, std::int64_t, std::int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), ShapeRows{},
                                          StrideRows{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  // Paged: K/V as (page rows, d, heads_k, pages) and one box per chunk of kPageChunkRows rows and
  // kAtomCols columns. In SmemLayoutK and SmemLayoutV (8-row swizzle atoms stacked along the rows,
  // then along the columns) such a chunk is contiguous and starts on a swizzle period, so the box
  // lands in the stage's own layout (chunk_offset).
  static constexpr int kPageChunkRows = kFwdPageChunkRows;
  static constexpr int kChunksPerTile = kBlockN / kPageChunkRows;
  static constexpr int kColumnBlocksK = kHeadDim / kAtomCols;
  static constexpr int kColumnBlocksV = kHeadDimV / kAtomCols;
  using BoxCols = Int<kAtomCols>;
  static_assert(!kPaged || kBlockN % kPageChunkRows == 0, "a key tile is whole chunks");
  using SmemLayoutKVChunk = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kPageChunkRows>, BoxCols>{}));
  using TmaKVChunk = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKVChunk{},
                                            Shape<Int<kPageChunkRows>, BoxCols>{}, _1{}));
  using TmaK = std::conditional_t<kPaged, TmaKVChunk,
                                  decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutK{}),
                                                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}))>;
  using TmaV = std::conditional_t<kPaged, TmaKVChunk,
                                  decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutV{}),
                                                         Shape<Int<kBlockN>, Int<kHeadDimV>>{}, _1{}))>;
  // The TMA copies of K and V over gmem (a view like GmemTensor).
  template <class Gmem>
  static TmaK make_tma_k(const Gmem& gmem) {
    if constexpr (kPaged) {
      return make_tma_copy(SM90_TMA_LOAD{}, gmem, SmemLayoutKVChunk{}, Shape<Int<kPageChunkRows>, BoxCols>{}, _1{});
    } else {
      return make_tma_copy(SM90_TMA_LOAD{}, gmem, take<0, 2>(SmemLayoutK{}), Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
    }
  }
  template <class Gmem>
  static TmaV make_tma_v(const Gmem& gmem) {
    if constexpr (kPaged) {
      return make_tma_copy(SM90_TMA_LOAD{}, gmem, SmemLayoutKVChunk{}, Shape<Int<kPageChunkRows>, BoxCols>{}, _1{});
    } else {
      return make_tma_copy(SM90_TMA_LOAD{}, gmem, take<0, 2>(SmemLayoutV{}), Shape<Int<kBlockN>, Int<kHeadDimV>>{},
                           _1{});
    }
  }
  // Pages that are multiples of kPageWideRows rows (where the key tile is too): one box per 64
  // rows instead of four of 16 (FwdMainloop::load_paged, FwdParams::wide_pages), a quarter of the
  // TMA issues and block_table reads of the producer's one thread.
  static constexpr int kPageWideRows = 64;
  static constexpr bool kWideChunks = kPaged && kBlockN % kPageWideRows == 0;
  using SmemLayoutKVWide = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kPageWideRows>, BoxCols>{}));
  struct NoTmaWide {};
  using TmaKVWide = std::conditional_t<kWideChunks,
                                       decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutKVWide{},
                                                              Shape<Int<kPageWideRows>, BoxCols>{}, _1{})),
                                       NoTmaWide>;
  template <class Gmem>
  static TmaKVWide make_tma_kv_wide(const Gmem& gmem) {
    if constexpr (kWideChunks) {
      return make_tma_copy(SM90_TMA_LOAD{}, gmem, SmemLayoutKVWide{}, Shape<Int<kPageWideRows>, BoxCols>{}, _1{});
    } else {
      return {};
    }
  }
  // The shared layout of one box of kRows rows (kPageChunkRows or kPageWideRows).
  template <int kRows>
  using SmemLayoutKVBox = std::conditional_t<kRows == kPageWideRows, SmemLayoutKVWide, SmemLayoutKVChunk>;

  // Element offsets in K's and V's shared tiles: of stage `stage` (its columns `cols`: kHeadDim for
  // K, kHeadDimV for V), and of box `chunk` of `rows` rows, columns [kAtomCols·block, kAtomCols·
  // (block + 1)) inside a stage.
  __host__ __device__ static constexpr int stage_offset(int stage, int cols) { return stage * kBlockN * cols; }
  __host__ __device__ static constexpr int chunk_offset(int chunk, int block, int rows = kPageChunkRows) {
    return chunk * rows * kAtomCols + block * kBlockN * kAtomCols;
  }
  // Whether the elements of every box of kRows rows (SmemLayoutKVBox from stage_offset +
  // chunk_offset) are where `layout` (SmemLayoutK or SmemLayoutV, of `cols` columns) keeps them:
  // evaluated by the compiler for the paged kernels, on every row and three columns of each 16-byte
  // swizzle group apart (the compiler's budget for constant evaluation does not reach every element).
  template <int kRows, class Layout>
  static constexpr bool chunks_match_stage(Layout layout, int cols) {
    for (int stage = 0; stage < kStages; ++stage) {
      for (int chunk = 0; chunk < kBlockN / kRows; ++chunk) {
        for (int block = 0; block < cols / kAtomCols; ++block) {
          for (int r = 0; r < kRows; ++r) {
            for (int c : {0, 9, kAtomCols - 1}) {
              if (int(layout(chunk * kRows + r, block * kAtomCols + c, stage)) !=
                  stage_offset(stage, cols) + chunk_offset(chunk, block, kRows) + int(SmemLayoutKVBox<kRows>{}(r, c))) {
                return false;
              }
            }
          }
        }
      }
    }
    return true;
  }
  static_assert(!kPaged || chunks_match_stage<kPageChunkRows>(SmemLayoutK{}, kHeadDim),
                "a chunk box does not land in K's stage layout");
  static_assert(!kPaged || chunks_match_stage<kPageChunkRows>(SmemLayoutV{}, kHeadDimV),
                "a chunk box does not land in V's stage layout");
  static_assert(!kWideChunks || chunks_match_stage<kPageWideRows>(SmemLayoutK{}, kHeadDim),
                "a wide box does not land in K's stage layout");
  static_assert(!kWideChunks || chunks_match_stage<kPageWideRows>(SmemLayoutV{}, kHeadDimV),
                "a wide box does not land in V's stage layout");

  struct NoTmaO {};
  using TmaO = std::conditional_t<kTmaStoreO,
                                  decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensor{}, SmemLayoutO{},
                                                         Shape<Int<kBlockM>, Int<kHeadDimV>>{}, _1{})),
                                  NoTmaO>;

  static constexpr std::uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr std::uint32_t kTmaBytesK = kBlockN * kHeadDim * sizeof(Element);
  static constexpr std::uint32_t kTmaBytesV = kBlockN * kHeadDimV * sizeof(Element);
  // One box row range of a paged key tile (kRows rows), every column block.
  template <int kRows>
  static constexpr std::uint32_t kTmaBytesBoxK = kRows * kHeadDim * sizeof(Element);
  template <int kRows>
  static constexpr std::uint32_t kTmaBytesBoxV = kRows * kHeadDimV * sizeof(Element);

  struct NoStorage {};
  // The dynamic schedule's ring (sm90_fwd.h, kFwdDynamic): slot i holds a fetched tile index (−1:
  // none left); full[i] says the producer wrote it, empty[i] that every reader took it — each
  // consumer warp and, with the TMA store, the O storer.
  struct TileRing {
    int index[kFwdTileSlots];
    alignas(8) std::uint64_t full[kFwdTileSlots];
    std::uint64_t empty[kFwdTileSlots];
  };
  using TileRingStorage = std::conditional_t<kFwdDynamic, TileRing, NoStorage>;
  // The paged kernels' block_table entries of a key tile's boxes a tile ahead (FwdMainloop::
  // request_pages): two slots, the tile being loaded and the next one.
  static constexpr bool kPageAhead = kPaged && FLASHATTN_SM90_FWD_PAGE_AHEAD == 1;
  struct PageSlots {
    alignas(16) int entry[2][kBlockN / kPageChunkRows];
  };
  using PageStorage = std::conditional_t<kPageAhead, PageSlots, NoStorage>;
  using OStorage = std::conditional_t<kSeparateO, cute::array_aligned<Element, cosize_v<SmemLayoutO>, 1024>, NoStorage>;

  struct SharedStorage {
    // 1024-byte alignment: the 128-byte swizzle repeats every 8 rows of 128 bytes, and TMA and
    // wgmma both assume a tile starts on that period.
    cute::array_aligned<Element, kQStages * cosize_v<SmemLayoutQ>, 1024> q;  // also O unless kSeparateO
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    OStorage o;
    alignas(16) std::uint64_t q_full[kQStages];  // transaction barrier of a tile's Q load
    std::uint64_t q_empty[kQStages];             // every consumer warpgroup is done with Q (and O, if it is Q's)
    std::uint64_t o_full[kQStages];              // kTmaStoreO: every consumer warpgroup has staged its O rows
    std::uint64_t o_empty;                       // kTmaStoreO and kSeparateO: O's tile has been stored
    std::uint64_t k_full[kStages];     // a K stage has landed (TMA transaction)
    std::uint64_t k_empty[kStages];    // every consumer warpgroup is done with a K stage
    std::uint64_t v_full[kStages];
    std::uint64_t v_empty[kStages];
    TileRingStorage ring;  // kFwdDynamic: the tile indices the producer fetched
    PageStorage pages;     // kPageAhead: block_table entries of the producer's next key tiles
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  // The Q buffer of the CTA's `count`-th non-empty tile, and the parity of that buffer's barriers
  // for it (the buffer's use count, mod 2).
  __host__ __device__ static constexpr int q_buffer(std::uint32_t count) { return int(count % kQStages); }
  __host__ __device__ static constexpr std::uint32_t q_parity(std::uint32_t count) { return (count / kQStages) & 1u; }
  __device__ static Element* q_smem(SharedStorage& ss, std::uint32_t count) {
    return ss.q.data() + q_buffer(count) * cosize_v<SmemLayoutQ>;
  }
  // Where the CTA's `count`-th non-empty tile stages its O: O's own tile, or that tile's Q buffer.
  __device__ static Element* o_smem(SharedStorage& ss, std::uint32_t count) {
    if constexpr (kSeparateO) {
      return ss.o.data();
    } else {
      return q_smem(ss, count);
    }
  }
  static_assert(kSmemBytes <= 227 * 1024, "the tile exceeds the 227 KiB of shared memory per block of sm90");
};

}  // namespace flashattn::cuda::sm90
