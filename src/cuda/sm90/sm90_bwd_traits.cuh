// src/cuda/sm90/sm90_bwd_traits.cuh — the compile-time shape of one Hopper backward kernel: the
// tile, the warpgroups, the shared-memory layouts (GMMA swizzles, written by TMA and read by
// wgmma, plain and transposed), the five tiled MMAs and the shared storage with its barriers.
// Q and K have kHeadDim columns (d), V and dO kHeadDimV (dv: 128 in the 192 instantiation, else d).
//
// Each consumer warpgroup owns 64 keys of the CTA's key tile and computes, per query row block m:
//   Sᵀ  = K·Qᵀ      (64 keys × block_m rows, both operands in shared memory)
//   dPᵀ = V·dOᵀ     (the same shape)
//   Pᵀ  = exp2(Sᵀ·scale·log2 e − lse·log2 e),  dSᵀ = Pᵀ ∘ (dPᵀ − softmax_d)
//   (softmax_scale, the last factor of dS, is applied once to dK's sum and by the postprocess to dQ;
//   in dSᵀ itself only at d 64 built without the late-dV order: kScaleInDs)
//   dV += Pᵀ·dO     (Pᵀ from registers: the Sᵀ accumulator is the A operand's layout)
//   dK += dSᵀ·Q     (dSᵀ from registers)
// and, with both warpgroups' dSᵀ in shared memory, its half of dQ = dS·K (block_m × d, summed over
// the 128 keys), staged in shared memory and added to the fp32 accumulator in global memory by the
// producer warpgroup's warp 1 (a bulk reduce-add).
//
// Above d 128 the accumulators of 64 keys' dK and dV (d fp32 per thread) do not fit a thread's
// registers, so the tile splits the other way ("split d"): the CTA owns 64 keys, each warpgroup
// computes Sᵀ and dPᵀ for half of the block's rows (64 keys × block_m / 2), both write Pᵀ and dSᵀ
// to shared memory, and each then takes half of d in all three updates:
//   dV[:, half] += Pᵀ·dO[:, half],  dK[:, half] += dSᵀ·Q[:, half],  dQ[:, half] = dS·K[:, half]
// (all operands in shared memory), so that a thread keeps 64 · (d + dv) / 2 / 128 fp32 of dK and dV.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/numeric_types.h>

#include <cstdint>
#include <type_traits>

#include "cuda/sm90/sm90_bwd.h"
#include "cuda/sm90/sm90_pipeline.cuh"

namespace flashattn::cuda::sm90 {

using namespace cute;

struct NoPTile {};  // the SharedStorage of a tile that keeps Pᵀ in registers

inline constexpr int kBwdModSoftcap = 1, kBwdModAlibi = 2, kBwdModDropout = 4;
inline constexpr int kBwdModsAll = kBwdModSoftcap | kBwdModAlibi | kBwdModDropout;
// Not a feature but a promise of the call: no causal mask or window (every row sees every key
// below seqlen_k), so that the steps compare keys with seqlen_k only (bwd_tile's wide tile).
inline constexpr int kBwdModNoMask = 8;

// kMods: which of softcap (kBwdModSoftcap), ALiBi (kBwdModAlibi) and dropout (kBwdModDropout) are
// compiled in (device::TileScoreMod on each Sᵀ tile, softcap's derivative 1 − tanh² in dSᵀ, the
// forward's Philox mask), each taken when the call asks for it. The launcher instantiates none,
// softcap alone, ALiBi alone, all three and, where built with FLASHATTN_SM90_BWD_LEAN_DROPOUT=1,
// dropout alone: a call with one of these pays neither the registers nor the code of the others
// (sm90_bwd_launch.cuh).
// kVarlen: varlen batches (seqused_k included): tiles offset by cu_seqlens, rows past a sequence
// zeroed in shared memory.
template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, int kMods_, bool kVarlen_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;                  // of Q and K
  static constexpr int kHeadDimV = bwd_head_dim_v(kHeadDim_);  // of V and dO (192: 128)
  static constexpr int kBlockM = kBlockM_;  // query rows per step
  static constexpr int kBlockN = kBlockN_;  // keys of the CTA
  static constexpr int kStages = kStages_;  // Q/dO ring
  static constexpr int kMods = kMods_;
  static constexpr bool kSoftcap = (kMods & kBwdModSoftcap) != 0;
  static constexpr bool kAlibi = (kMods & kBwdModAlibi) != 0;
  static constexpr bool kDropout = (kMods & kBwdModDropout) != 0;
  static constexpr bool kScoreMod = kSoftcap || kAlibi;  // device::TileScoreMod's scores
  static constexpr bool kNoMask = (kMods & kBwdModNoMask) != 0;
  static constexpr bool kVarlen = kVarlen_;

  static constexpr int kKeysPerWarpgroup = 64;  // the M of one wgmma
  // Split d (bwd_tile's choice above d 128, see the header): a CTA of one wgmma's M of keys, the
  // two warpgroups splitting the rows of Sᵀ and dPᵀ and the columns of dK, dV and dQ.
  static constexpr bool kSplitD = kBlockN == kKeysPerWarpgroup;
  // The order of a step's last products (sm90_bwd.h, kBwdDvLate): dV += Pᵀ·dO issued once dSᵀ is
  // in shared memory and dK += dSᵀ·Q once dV has landed (FlashAttention-3's order) — always in the
  // 80-row tile, elsewhere (split d aside) at d 64 or as FLASHATTN_SM90_BWD_DV_LATE says.
  static constexpr bool kDvLate =
      !kSplitD && (kBlockM % kKeysPerWarpgroup != 0 || (kBwdDvLate < 0 ? kHeadDim <= 64 : kBwdDvLate == 1));
  // softmax_scale, dS's last factor: left out of the steps and applied once to dK's sum (and by the
  // postprocess to dQ), but at d 64 in the other order, where the kernels are at the edge of their
  // registers and ptxas, given dS without it, serializes every wgmma for want of registers (C7512).
  static constexpr bool kScaleInDs = kHeadDim <= 64 && !kDvLate;
  // Split d, Sᵀ by the first warpgroup and dPᵀ by the second, each over all the step's rows
  // (kBwdSdpSplit, sm90_bwd.h): not with softcap (its derivative comes from Sᵀ) or dropout (its
  // keep bits from Sᵀ's positions in both).
  static constexpr bool kSdpByWarpgroup = kSplitD && kBwdSdpSplit && !kSoftcap && !kDropout && kHeadDim == kHeadDimV;
  static constexpr int kConsumerWarpgroups = kSplitD ? 2 : kBlockN / kKeysPerWarpgroup;
  static constexpr int kWarpgroupThreads = 128;
  static constexpr int kConsumerThreads = kConsumerWarpgroups * kWarpgroupThreads;
  static constexpr int kThreads = kConsumerThreads + kWarpgroupThreads;  // + the producer warpgroup
  // Per consumer thread: dK and dV (2 · d / 2 fp32), Sᵀ and dPᵀ (2 · block_m / 2), Pᵀ and dSᵀ in
  // 16 bits. The producer keeps the minimum, 24, but at d 64 and 96, where its dQ writer warp
  // spills at 24: 40 there (consumers 232 at d 64) ran 1–3% faster on an H100 (src/cuda/README.md)
  // — not with softcap, whose derivative takes registers the 232 do not leave: ptxas then
  // serialised every wgmma of the d 64 softcap kernels (C7512; their loops waited for each
  // product as soon as it was issued), which 24 / 240 avoids.
  // FLASHATTN_SM90_BWD_PRODUCER_REGS sets it for every head dim in A/B builds; the consumers take
  // what the CTA's pool leaves, in steps of 8, 240 at most.
#ifdef FLASHATTN_SM90_BWD_PRODUCER_REGS
  static constexpr int kProducerRegs = FLASHATTN_SM90_BWD_PRODUCER_REGS;
#else
  static constexpr int kProducerRegs = kHeadDim <= 96 && !kSoftcap ? 40 : 24;
#endif
  static constexpr int kConsumerRegs =
      (setmaxnreg_pool(kThreads) - kWarpgroupThreads * kProducerRegs) / kConsumerThreads / 8 * 8 > 240
          ? 240
          : (setmaxnreg_pool(kThreads) - kWarpgroupThreads * kProducerRegs) / kConsumerThreads / 8 * 8;
  static_assert(kConsumerWarpgroups == 2, "two consumer warpgroups: the register split assumes it");
  static_assert(kWarpgroupThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <= setmaxnreg_pool(kThreads),
                "the register split exceeds the CTA's registers: setmaxnreg would wait for ever");
  static_assert(kHeadDim % 16 == 0 && kHeadDimV % 16 == 0 && kBlockM % 16 == 0,
                "whole swizzle rows (32 bytes of d, dv and rows at least)");

  // (M, N, K) of each product.
  using TileShapeSdP = Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>;  // Sᵀ (K = d), dPᵀ (K = dv)
  using TileShapedK = Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>;   // dK
  using TileShapedV = Shape<Int<kBlockN>, Int<kHeadDimV>, Int<kBlockM>>;  // dV
  // dQ (block_m × d): the warpgroups split its rows when there are 128 of them, else its columns.
  // A row block that is not a multiple of one wgmma's M (80 rows, bwd_tile's wide tile) computes
  // it transposed, dQᵀ = Kᵀ·dSᵀ (d × block_m, M = d split across the warpgroups, N = block_m), as
  // FlashAttention-3 does for its 80-row tile: kDqTransposed. The accumulator keeps that
  // fragment's order as well (the postprocess reads it with the same tiled MMA).
  static constexpr bool kDqTransposed = kBlockM % kKeysPerWarpgroup != 0;
  static_assert(!kDqTransposed || !kSplitD, "split d computes dQ as dS·K");
  static constexpr int kdQWarpgroupsM = kBlockM >= 128 ? 2 : 1;
  static constexpr int kdQWarpgroupsN = kConsumerWarpgroups / kdQWarpgroupsM;
  static constexpr int kdQColsPerWarpgroup = kDqTransposed ? kHeadDim / kConsumerWarpgroups : kHeadDim / kdQWarpgroupsN;
  // (M, N) of dQ as computed: (rows, d), or transposed (d, rows).
  using TileShapedQ = std::conditional_t<kDqTransposed, Shape<Int<kHeadDim>, Int<kBlockM>, Int<kBlockN>>,
                                         Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>>;
  using TileShapedQAtom =
      std::conditional_t<kDqTransposed, Shape<Int<kdQColsPerWarpgroup>, Int<kBlockM>, Int<kBlockN>>,
                         Shape<Int<kBlockM / kdQWarpgroupsM>, Int<kdQColsPerWarpgroup>, Int<kBlockN>>>;

  // Warpgroups along the keys, or (split d) along the second coordinate: the rows of Sᵀ and dPᵀ,
  // the columns of dK and dV.
  using AtomLayoutWgs = std::conditional_t<kSplitD, Layout<Shape<_1, Int<kConsumerWarpgroups>, _1>>,
                                           Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>>;
  static constexpr int kSdPRowsPerWarpgroup = kSplitD && !kSdpByWarpgroup ? kBlockM / kConsumerWarpgroups : kBlockM;
  // kSdpByWarpgroup: each warpgroup's Sᵀ or dPᵀ product is a tiled MMA of its own (its threads
  // 0 … 127), all the step's rows.
  using AtomLayoutSdP = std::conditional_t<kSdpByWarpgroup, Layout<Shape<_1, _1, _1>>, AtomLayoutWgs>;
  static constexpr int kdKColsPerWarpgroup = kSplitD ? kHeadDim / kConsumerWarpgroups : kHeadDim;
  static constexpr int kdVColsPerWarpgroup = kSplitD ? kHeadDimV / kConsumerWarpgroups : kHeadDimV;
  // (The K extent of an op's shape does not enter its choice: Sᵀ and dPᵀ share the tiled MMA.)
  using TiledMmaSdP = decltype(make_tiled_mma(
      ss_op<Element, Shape<Int<kKeysPerWarpgroup>, Int<kSdPRowsPerWarpgroup>, Int<kHeadDim>>>(),
      AtomLayoutSdP{}));
  // dV += Pᵀ·dO: A from registers (split d: Pᵀ from shared memory, both warpgroups' rows); B = dO
  // read as (dv, rows), dv contiguous ("MN-major"). dK += dSᵀ·Q the same way over d.
  template <int kCols>
  using TiledMmaKeysBy = decltype(make_tiled_mma(
      std::conditional_t<
          kSplitD,
          decltype(SM90::GMMA::ss_op_selector<Element, Element, float,
                                              Shape<Int<kKeysPerWarpgroup>, Int<kCols>, Int<kBlockM>>, GMMA::Major::K,
                                              GMMA::Major::MN>()),
          decltype(SM90::GMMA::rs_op_selector<Element, Element, float,
                                              Shape<Int<kKeysPerWarpgroup>, Int<kCols>, Int<kBlockM>>, GMMA::Major::K,
                                              GMMA::Major::MN>())>{},
      AtomLayoutWgs{}));
  using TiledMmadK = TiledMmaKeysBy<kdKColsPerWarpgroup>;
  using TiledMmadV = TiledMmaKeysBy<kdVColsPerWarpgroup>;
  // dQ = dS·K: A = dS stored as dSᵀ (keys, rows) with rows contiguous; B = K read as (d, keys).
  // Transposed, dQᵀ = Kᵀ·dSᵀ: A = Kᵀ (d, keys), d contiguous; B = dS (rows, keys), rows contiguous.
  using TiledMmadQ = decltype(make_tiled_mma(
      ss_op<Element, TileShapedQAtom, GMMA::Major::MN, GMMA::Major::MN>(),
      std::conditional_t<kDqTransposed, Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>,
                         Layout<Shape<Int<kdQWarpgroupsM>, Int<kdQWarpgroupsN>, _1>>>{}));

  // Shared-memory tiles in 8-row GMMA atoms, each tile with the widest swizzle (128, 64 or 32
  // bytes: 64, 32 or 16 elements per row) whose atom columns divide the narrowest slice a
  // warpgroup's product takes of it: a wgmma descriptor starts on an atom, and one that starts
  // inside it reads the wrong elements (the compiler accepts it). Q: dK's Qᵀ (d, or d / 2 split
  // d); dO: dV's dOᵀ; K: dQ's Kᵀ (d / kdQWarpgroupsN; d 96: 48, hence 32-byte rows); V: dPᵀ's
  // whole dv. dSᵀ and Pᵀ (keys × rows): 128-byte rows, 32-byte at 80 rows.
  template <int kCols>
  using AtomFor = std::conditional_t<
      kCols % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
      std::conditional_t<kCols % 32 == 0, GMMA::Layout_K_SW64_Atom<Element>, GMMA::Layout_K_SW32_Atom<Element>>>;
  using SmemAtomdS = AtomFor<kBlockM>;
  using SmemAtomQ = AtomFor<kdKColsPerWarpgroup>;
  using SmemAtomdO = AtomFor<kdVColsPerWarpgroup>;
  using SmemAtomK = AtomFor<kdQColsPerWarpgroup>;
  using SmemAtomV = AtomFor<kHeadDimV>;
  static_assert(kdQColsPerWarpgroup % size<1>(SmemAtomK{}) == 0, "each dQ warpgroup's K^T columns start on a swizzle atom");
  static_assert(kdKColsPerWarpgroup % size<1>(SmemAtomQ{}) == 0, "each dK warpgroup's Q^T columns start on a swizzle atom");
  static_assert(kdVColsPerWarpgroup % size<1>(SmemAtomdO{}) == 0, "each dV warpgroup's dO^T columns start on a swizzle atom");
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));   // (keys, d)
  using SmemLayoutV = decltype(tile_to_shape(SmemAtomV{}, Shape<Int<kBlockN>, Int<kHeadDimV>>{}));  // (keys, dv)
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));  // (rows, d, stage)
  using SmemLayoutdO = decltype(tile_to_shape(SmemAtomdO{}, Shape<Int<kBlockM>, Int<kHeadDimV>, Int<kStages>>{}));
  using SmemLayoutdS = decltype(tile_to_shape(SmemAtomdS{}, Shape<Int<kBlockN>, Int<kBlockM>, _2>{}));  // (keys, rows, buffer)
  // The same bytes with the first two coordinates swapped: Qᵀ and dOᵀ (d or dv, rows, stage) for
  // dK/dV, dS (rows, keys, buffer) and Kᵀ (d, keys) for dQ.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutdOt = decltype(composition(
      SmemLayoutdO{}, make_ordered_layout(Shape<Int<kHeadDimV>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_ordered_layout(Shape<Int<kBlockM>, Int<kBlockN>, _2>{}, Step<_2, _1, _3>{})));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));

  // Global views given to TMA: (rows, d, heads, batch) with the caller's strides.
  using ShapeRows = Shape<std::int32_t, std::int32_t, std::int32_t, std::int32_t>;
  using StrideRows = Stride<std::int64_t, _1, std::int64_t, std::int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), ShapeRows{},
                                          StrideRows{}));
  // One tensor's TMA load: its descriptor type and, on the host, the descriptor of a global view.
  template <class SmemLayout, int kRows, int kCols>
  struct TmaOf {
    using Type =
        decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayout{}, Shape<Int<kRows>, Int<kCols>>{}, _1{}));
    static Type make(const GmemTensor& g) {
      return make_tma_copy(SM90_TMA_LOAD{}, g, SmemLayout{}, Shape<Int<kRows>, Int<kCols>>{}, _1{});
    }
  };
  static_assert(!kSdpByWarpgroup ||
                    (std::is_same_v<SmemLayoutK, SmemLayoutV> && std::is_same_v<SmemLayoutQ, SmemLayoutdO>),
                "kSdpByWarpgroup reads K or V, Q or dO through one layout");
  using TmaQ = TmaOf<decltype(take<0, 2>(SmemLayoutQ{})), kBlockM, kHeadDim>;
  using TmadO = TmaOf<decltype(take<0, 2>(SmemLayoutdO{})), kBlockM, kHeadDimV>;
  using TmaK = TmaOf<SmemLayoutK, kBlockN, kHeadDim>;
  using TmaV = TmaOf<SmemLayoutV, kBlockN, kHeadDimV>;

  static constexpr std::uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr std::uint32_t kTmaBytesdO = kBlockM * kHeadDimV * sizeof(Element);
  static constexpr std::uint32_t kTmaBytesKV = kBlockN * (kHeadDim + kHeadDimV) * sizeof(Element);
  static constexpr std::uint32_t kStatBytes = kBlockM * sizeof(float);  // one row block of lse or softmax_d

  // dQ of a row block leaves each consumer warpgroup through shared memory: its fp32 fragment in
  // fragment order (16-byte stores, thread-contiguous), added to the accumulator in global memory
  // (the same order per row block) by a bulk reduce-add of the producer warpgroup's warp 1.
  static constexpr int kDqFloatsPerWarpgroup = kBlockM * kHeadDim / kConsumerWarpgroups;
  static constexpr int kDqFloatsPerThread = kDqFloatsPerWarpgroup / kWarpgroupThreads;
  static_assert(kDqFloatsPerThread % 4 == 0, "whole float4 per thread");

  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutdO>, 1024> dout;
    cute::array_aligned<Element, cosize_v<SmemLayoutdS>, 1024> ds;
    alignas(128) float dq[kConsumerWarpgroups][kDqFloatsPerWarpgroup];
    alignas(16) float lse_log2[kStages][kBlockM];
    alignas(16) float dpsum[kStages][kBlockM];
    alignas(16) std::uint64_t kv_full;  // K and V have landed (one transaction)
    std::uint64_t q_full[kStages];      // a Q stage and its lse
    std::uint64_t q_empty[kStages];
    std::uint64_t do_full[kStages];     // a dO stage and its softmax_d
    std::uint64_t do_empty[kStages];
    // Split d only: Pᵀ, laid out as dSᵀ (last, so that the other tiles' offsets do not depend on it).
    std::conditional_t<kSplitD, cute::array_aligned<Element, cosize_v<SmemLayoutdS>, 1024>, NoPTile> p;
    // Where Pᵀ is (split d); elsewhere dSᵀ's address, never read as Pᵀ.
    __device__ Element* p_tile() {
      if constexpr (kSplitD) {
        return p.data();
      } else {
        return ds.data();
      }
    }
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "the tile exceeds the 227 KiB of shared memory per block of sm90");
};

}  // namespace flashattn::cuda::sm90
