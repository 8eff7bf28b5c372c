// src/cuda/sm80/sm80_fwd_kernel.cuh — the portable forward kernel (FlashAttention-2 algorithm) on
// CuTe: mma.sync m16n8k16, ldmatrix, cp.async. Runs on sm80 … sm90.
//
// One CTA computes a kBlockM × dv block of the output of one (batch, query head) — or, GQA-packed,
// of the query heads of one kv head, its rows being (query row, head) pairs: it keeps its Q
// tile in shared memory, streams K/V tiles of kBlockN keys through shared memory, and keeps the
// running row max, row sum and output accumulator in registers (online softmax). The score
// semantics (mask, softcap, ALiBi, dropout) come from src/common (softcap and ALiBi evaluated per
// tile by TileScoreMod, the same formula in fewer instructions); the batch layout (dense,
// varlen, paged, cache_batch_idx) is read through AttentionParams' per-sequence accessors, one
// row address at a time, so a K/V tile may span pages.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <cstdint>
#include <cstring>

#include "common/params.h"
#include "common/sink.h"
#include "cuda/device/cp_async.cuh"
#include "cuda/device/math.cuh"
#include "cuda/index_check.cuh"
#include "cuda/device/score_mod.cuh"
#include "cuda/sm80/sm80_fwd.h"

namespace flashattn::cuda::sm80 {

using namespace cute;

// --- constants of the numerics, exp2 on the MUFU, softcap and ALiBi per tile (src/cuda/device) ---
using device::exp2_ftz;
using device::kInf;
using device::kLn2;
using device::kLog2e;
using device::TileScoreMod;

// --- compile-time shape of one kernel -----------------------------------------------------------
// Element: cutlass::half_t or cutlass::bfloat16_t. kHeadDim: the instantiated head dim (d and dv
// both ≤ it; smaller multiples of 8 run with predicated loads and stores).
// kMinBlocks: CTAs per SM that __launch_bounds__ caps the registers for (1: no cap).
template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kMinBlocks_ = 1>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kMinBlocks = kMinBlocks_;

  static_assert(kHeadDim % 64 == 0, "head dims are instantiated in multiples of 64 (one swizzle atom)");
  static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns whole 16-row MMA tiles");
  static_assert(kBlockN % 16 == 0, "dropout works on whole 16×16 blocks of the score tile");

  // Warps are stacked along M only, so a score row never leaves its warp and the row max / row sum
  // need nothing but shuffles inside a quad. The 16-wide N permutation makes one thread hold two
  // adjacent 8-column MMA tiles: a whole 16×16 block, as the dropout counter layout expects.
  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                     MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                                     MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;
  using TiledMma = TiledMMA<MmaAtom, Layout<Shape<Int<kNWarps>, _1, _1>>, Tile<Int<16 * kNWarps>, _16, _16>>;

  // Shared memory: rows of 64 elements (128 bytes) with an XOR swizzle on 16-byte chunks, so that
  // both the row-wise cp.async stores and the ldmatrix reads (8 rows × 16 bytes) are conflict-free.
  static constexpr int kSmemRowElems = 64;
  using SmemLayoutAtom = decltype(composition(
      Swizzle<3, 3, 3>{}, Layout<Shape<_8, Int<kSmemRowElems>>, Stride<Int<kSmemRowElems>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));   // (kBlockM, D)
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // (kBlockN, D)
  // V seen as Vᵀ (D, kBlockN) for the P·V product: same bytes, transposed coordinates.
  using SmemLayoutVt = decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;            // ldmatrix.x4
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;  // ldmatrix.x4.trans

  // Global ↔ shared: each thread moves 16 bytes (8 elements) per access; 8 threads cover one
  // 64-element shared-memory row, so a warp reads 4 rows × 128 contiguous bytes.
  static constexpr int kElemsPerAccess = 16 / int(sizeof(Element));
  static constexpr int kThreadsPerRow = kSmemRowElems / kElemsPerAccess;
  using GmemThreadLayout = Layout<Shape<Int<kNThreads / kThreadsPerRow>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>;
  using GmemTiledCopy = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Element>{}, GmemThreadLayout{},
                                                 Layout<Shape<_1, Int<kElemsPerAccess>>>{}));
  static_assert(kBlockM % (kNThreads / kThreadsPerRow) == 0 && kBlockN % (kNThreads / kThreadsPerRow) == 0,
                "every thread copies the same number of rows");

  static constexpr int kSmemBytesQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemBytesKV = kBlockN * kHeadDim * int(sizeof(Element));
  // Page-table entries of two key tiles (paged kernels): a tile of kBlockN rows spans at most
  // kBlockN / 16 + 1 pages of 16 rows or more (of any size), and at most kBlockN smaller ones:
  // their entries take kSmemBytesPagesSmall more bytes, added at the launch of a call with pages
  // of fewer than 16 rows (launch_fwd_grid), so that the other calls keep their occupancy.
  static constexpr int kPageSlots = kBlockN / 16 + 1;
  static constexpr int kPageSlotsSmall = kBlockN;
  static constexpr int kSmemBytesPagesSmall = 2 * (kPageSlotsSmall - kPageSlots) * int(sizeof(std::int32_t));
  static constexpr int kSmemBytesPages = 2 * kPageSlots * int(sizeof(std::int32_t));
  static constexpr int kSmemBytes = kSmemBytesQ + 2 * kSmemBytesKV + kSmemBytesPages;  // Q (reused for O), K, V
};

// --- small device helpers -----------------------------------------------------------------------

// Schedule flags of the forward per head dim (fwd_tuning, sm80_tuning.h):
// kEarlyFirstV: the V load of a block's first key tile issued in the prologue, beside Q and K,
// instead of after the first barrier — its latency then overlaps theirs rather than following
// them, which matters where a block has few key tiles (short sequences, the low row blocks of a
// causal mask).
template <int kHeadDim>
constexpr bool kEarlyFirstV = fwd_tuning(kHeadDim).early_v;
// kLazyRescale: O rescaled after a key tile only where the tile raised the max of some row of the
// warp (a vote; the branch is warp-uniform). A row whose max stayed put has correction
// exp2(0) = 1, which this takes exactly instead of from the MUFU, so the result is the same
// algorithm; on long sequences the max of most rows settles within a few tiles, and the
// kRows × dv / 4 multiplies per thread and tile, which stand between the softmax and the P·V
// product, are then skipped.
template <int kHeadDim>
constexpr bool kLazyRescale = fwd_tuning(kHeadDim).lazy_rescale;
// kBranchRescale: where O is rescaled after a key tile in the plain variant. true skips it after a
// block's first key tile (O is still zero there) by a uniform branch after the row loop; false
// rescales row by row inside the loop on every tile (after the first tile the correction is
// exp2(−∞) = 0 and O stays zero), where ptxas interleaves the multiplies with the row's MUFU
// exponentials. kLazyRescale implies the branch, and the full variant (dropout, softcap, ALiBi)
// always takes it: in the loop its paged d 64 kernel spilled 492 bytes instead of 88.
template <int kHeadDim>
constexpr bool kBranchRescale = fwd_tuning(kHeadDim).first_tile_branch;

// x, hidden from the optimiser: a value it cannot move out of a loop. Per-element coordinates
// built on it stay "base + constant" inside the key loop instead of being hoisted out as one
// loop-invariant register per accumulator element (which spills).
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

using device::cp_async_4;  // cuda/device/cp_async.cuh

// 16-byte cp.async global → shared; when !valid nothing is read and the 16 bytes are zero-filled
// (out-of-range rows and columns must be zeros: a stale NaN times P = 0 would still be NaN).
__device__ __forceinline__ void cp_async_16_zfill(void* smem, const void* gmem, bool valid) {
  const std::uint32_t dst = cast_smem_ptr_to_uint(smem);
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}

// Accumulator layout ((2,2), MMA_M, MMA_N) viewed as (rows, cols) = ((2, MMA_M), (2, MMA_N)):
// value mode (col pair, row + 8) of an m16n8 C fragment split into its row and column parts.
template <class L>
__device__ __forceinline__ auto rowcol_layout(L acc) {
  static_assert(decltype(rank(acc))::value == 3 && decltype(rank<0>(acc))::value == 2,
                "expects an m16n8k16 accumulator layout ((2,2), MMA_M, MMA_N)");
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)), make_layout(get<0, 0>(acc), get<2>(acc)));
}

// Accumulator layout ((2,2), MMA_M, MMA_N) as an A-operand layout ((2,2,2), MMA_M, MMA_N/2): the
// C fragments of two adjacent n8 tiles are exactly the A fragment of one k16 slice, so P feeds the
// P·V product straight from registers.
template <class L>
__device__ __forceinline__ auto acc_as_a_operand_layout(L acc) {
  auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // ((2,2), MMA_M, (2, MMA_N/2))
  return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

// acc += A · Bᵀ with both operands in shared memory, the register copy of slice k+1 overlapping
// the MMAs of slice k; after_step(k) is called once the MMAs of slice k are issued (the backward
// places its dQ atomics there, so that they overlap the tensor-core work of this product).
template <class TiledMma, class Acc, class FragA, class FragB, class SrcA, class SrcB, class CopyA, class CopyB,
          class ThrCopyA, class ThrCopyB, class AfterStep>
__device__ __forceinline__ void gemm_ss_steps(const TiledMma& mma, Acc& acc, FragA& rA, FragB& rB, const SrcA& sA,
                                              const SrcB& sB, const CopyA& copy_a, const CopyB& copy_b,
                                              const ThrCopyA& thr_a, const ThrCopyB& thr_b, AfterStep&& after_step) {
  Tensor rA_view = thr_a.retile_D(rA);
  Tensor rB_view = thr_b.retile_D(rB);
  copy(copy_a, sA(_, _, _0{}), rA_view(_, _, _0{}));
  copy(copy_b, sB(_, _, _0{}), rB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) {
      copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
      copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
    after_step(k);
  }
}
template <class TiledMma, class Acc, class FragA, class FragB, class SrcA, class SrcB, class CopyA, class CopyB,
          class ThrCopyA, class ThrCopyB>
__device__ __forceinline__ void gemm_ss(const TiledMma& mma, Acc& acc, FragA& rA, FragB& rB, const SrcA& sA,
                                        const SrcB& sB, const CopyA& copy_a, const CopyB& copy_b,
                                        const ThrCopyA& thr_a, const ThrCopyB& thr_b) {
  gemm_ss_steps(mma, acc, rA, rB, sA, sB, copy_a, copy_b, thr_a, thr_b, [](int) {});
}

// acc += A · Bᵀ with A already in registers and B in shared memory.
template <class TiledMma, class Acc, class FragA, class FragB, class SrcB, class CopyB, class ThrCopyB>
__device__ __forceinline__ void gemm_rs(const TiledMma& mma, Acc& acc, const FragA& rA, FragB& rB, const SrcB& sB,
                                        const CopyB& copy_b, const ThrCopyB& thr_b) {
  Tensor rB_view = thr_b.retile_D(rB);
  copy(copy_b, sB(_, _, _0{}), rB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// Max / sum over the 4 threads of a quad: they hold the same rows of an m16n8 fragment.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Loads rows [row0, row0 + kRows) of a (rows, D) tile into swizzled shared memory with cp.async.
// row_offset(r) is the element offset of tile row r in global memory (it hides dense, varlen and
// paged layouts); rows ≥ valid_rows and columns ≥ valid_cols are zero-filled. kMayBeShort as for
// load_strided_tile: a tile whole in rows and columns takes a path without checks.
template <class Traits, int kRows, bool kMayBeShort = true, class SmemTensor, class RowOffset>
__device__ __forceinline__ void load_tile(const typename Traits::Element* base, SmemTensor& s_tile, int valid_rows,
                                          int valid_cols, RowOffset&& row_offset, int tid) {
  using Element = typename Traits::Element;
  typename Traits::GmemTiledCopy tiled_copy;
  auto thr_copy = tiled_copy.get_thread_slice(tid);
  Tensor t_s = thr_copy.partition_D(s_tile);  // (CPY, CPY_ROWS, CPY_COLS)
  Tensor t_c = thr_copy.partition_D(make_identity_tensor(make_shape(Int<kRows>{}, Int<Traits::kHeadDim>{})));
  // The thread's first row, opaque: row offsets are recomputed per tile rather than hoisted out
  // of the key loop (one 64-bit register pair per row).
  const int row0 = opaque(get<0>(t_c(0, 0, 0)));
  if ((!kMayBeShort || valid_rows >= kRows) && valid_cols >= Traits::kHeadDim) {
    CUTE_UNROLL
    for (int m = 0; m < size<1>(t_s); ++m) {
      const Element* src_row = base + row_offset(row0 + (get<0>(t_c(0, m, 0)) - get<0>(t_c(0, 0, 0))));
      CUTE_UNROLL
      for (int k = 0; k < size<2>(t_s); ++k) cp_async_16_zfill(&t_s(0, m, k), src_row + get<1>(t_c(0, m, k)), true);
    }
    return;
  }
  // The checked path as a loop the compiler keeps (as in load_strided_tile): unrolled, it doubles
  // the key loop's code beside the path above.
#pragma unroll 1
  for (int m = 0; m < size<1>(t_s); ++m) {
    const int row = row0 + (get<0>(t_c(0, m, 0)) - get<0>(t_c(0, 0, 0)));
    const bool row_ok = row < valid_rows;
    // Rows past the end are never read: their offset is not computed (it may leave the page table).
    const Element* src_row = row_ok ? base + row_offset(row) : base;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(t_s); ++k) {
      const int col = get<1>(t_c(0, m, k));
      const bool ok = row_ok && col < valid_cols;
      cp_async_16_zfill(&t_s(0, m, k), ok ? src_row + col : base, ok);
    }
  }
}

// Loads a (kRows, D) tile whose rows are evenly spaced in global memory — row r at
// tile + r · row_stride (dense and varlen K/V) — into swizzled shared memory with cp.async; rows
// ≥ valid_rows and columns ≥ valid_cols are zero-filled. A whole tile (the common case: every
// key tile but the last, at the instantiated head dim) takes a path without any predicate: one
// address add per 16-byte access, instead of the row and column checks, the zero-fill selects
// and the per-row 64-bit address arithmetic of load_tile. (The checked path is not load_tile with
// a stride lambda: its per-row address arithmetic made the key loop ~200 SASS instructions longer.)
// kMayBeShort: whether valid_rows < kRows is possible here (false: the caller knows the tile is
// whole in rows, and only the column count is checked). The checked path is a loop the compiler
// does not unroll: unrolled, it was if-converted, so that every tile issued both paths'
// instructions (predicated off, still one issue slot each).
template <class Traits, int kRows, bool kMayBeShort = true, class SmemTensor>
__device__ __forceinline__ void load_strided_tile(const typename Traits::Element* tile, std::int64_t row_stride,
                                                  SmemTensor& s_tile, int valid_rows, int valid_cols, int tid) {
  typename Traits::GmemTiledCopy tiled_copy;
  auto thr_copy = tiled_copy.get_thread_slice(tid);
  Tensor t_s = thr_copy.partition_D(s_tile);  // (CPY, CPY_ROWS, CPY_COLS)
  Tensor t_c = thr_copy.partition_D(make_identity_tensor(make_shape(Int<kRows>{}, Int<Traits::kHeadDim>{})));
  // The thread's first row and column, opaque: recomputed per tile rather than hoisted.
  const int row0 = opaque(get<0>(t_c(0, 0, 0)));
  const int col0 = get<1>(t_c(0, 0, 0));
  constexpr int kRowStep = decltype(size<0>(typename Traits::GmemThreadLayout{}))::value;  // rows between passes
  const auto* src0 = tile + std::int64_t(row0) * row_stride + col0;
  const std::int64_t pass_stride = std::int64_t(kRowStep) * row_stride;
  if ((!kMayBeShort || valid_rows >= kRows) && valid_cols >= Traits::kHeadDim) {
    const auto* src = src0;
    CUTE_UNROLL
    for (int m = 0; m < size<1>(t_s); ++m, src += pass_stride) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(t_s); ++k) {
        const int dcol = get<1>(t_c(0, m, k)) - get<1>(t_c(0, 0, 0));  // compile-time
        cp_async_16_zfill(&t_s(0, m, k), src + dcol, true);
      }
    }
  } else {
    const auto* src = src0;
#pragma unroll 1
    for (int m = 0; m < size<1>(t_s); ++m, src += pass_stride) {
      const bool row_ok = row0 + m * kRowStep < valid_rows;
      CUTE_UNROLL
      for (int k = 0; k < size<2>(t_s); ++k) {
        const int dcol = get<1>(t_c(0, m, k)) - get<1>(t_c(0, 0, 0));
        const bool ok = row_ok && col0 + dcol < valid_cols;
        // Nothing is read when !ok; the address stays the tile's first (a valid row).
        cp_async_16_zfill(&t_s(0, m, k), ok ? src + dcol : tile, ok);
      }
    }
  }
}

// The flag of the index check that a kernel runs beside as its programmatic dependent: waits for
// the check kernel to finish and its writes to be visible (griddepcontrol.wait, sm_90), then reads it.
__device__ __forceinline__ int read_index_gate(const int* gate) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  return *reinterpret_cast<const volatile int*>(gate);
}

// --- the kernel ---------------------------------------------------------------------------------
//
// Grid: (⌈max_seqlen_q · pack / kBlockM⌉, heads / pack, batch). rng_state: optional device {seed,
// offset}.
// pack: GQA packing, 1 or p.group_size(). With pack = g a CTA serves one kv head and its rows are
// (query row, head of the group) pairs — packed row r is query row r / g of query head
// kv_head · g + r % g — so that g heads of a short query (decoding: sq = 1) fill one row block and
// read their K/V tiles once instead of g times. Only the plain variant packs (softcap, ALiBi and
// dropout depend on the head per element); the full variant takes pack = 1.
// kScoreModAndDropout: whether softcap, ALiBi and dropout are compiled in. The plain variant
// leaves them out so that their registers do not weigh on the common case (the flags are still
// read at run time in the full variant).
// kPaged: K/V through the page table (p.block_table); the dense kernel carries none of it.
// kScoreMod: softcap and ALiBi compiled into the plain variant (kPlainScoreMod, sm80_fwd.h).
// kPacked: the kernel of pack > 1 (pack_arg); the unpacked kernel (pack = 1) carries none of the
// per-row (query row, head) arithmetic, and loads Q and stores out and lse as evenly spaced rows.
// kSplit: split-KV. Grid.x is ⌈max_seqlen_q / kBlockM⌉ · split.num_splits: CTA (m, s) walks the
// s-th of num_splits equal shares of the key tiles that row block m sees and writes, instead of
// out and lse, its normalised fp32 partial O and its lse into `split` (a share with no visible key
// for a row gives that row lse = +∞, which the combine skips). Unused when !kSplit.
// index_gate (kPagedCheckOverlap builds, paged kernels that do not fold the check; else null): the
// index check's flag, set by the check kernel that this one runs beside as its programmatic
// dependent — waited for (griddepcontrol.wait) and read as the last key tile starts, no store
// made when it is set; until then the key count is clamped into the block_table row.
template <class Traits, bool kScoreModAndDropout, bool kSplit, bool kPaged, bool kPacked, bool kScoreMod = false>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kMinBlocks)
    fwd_kernel(const __grid_constant__ common::AttentionParams p, const __grid_constant__ SplitKvPartials split,
               const std::uint64_t* rng_state, int pack_arg, const int* index_gate) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  if constexpr (kSplit) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // The combine after this kernel, where launched as its programmatic dependent
    // (the default on sm_90), may be scheduled from now on: it waits for this grid to finish
    // before it reads anything the grid writes. (No effect on a combine launched the usual way.)
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  }
  // An index tensor failed the device-side check (src/cuda/index_check.h): read and write nothing.
  // Where the call's check is folded in here (AttentionParams::index_fold) it runs first: a split
  // kernel's block checks the one sequence it reads (blockIdx.z), beside that flag — it writes
  // only the partials, and the combine after it reads the flag before it writes the output; any
  // other block checks every sequence (a block barrier), so that no block writes its rows of the
  // output unless all passed. A paged cache's packed split kernel (GQA decoding): each block checks
  // the sequence's other rules here and its block_table entries where it reads them, clamping each
  // page number into the cache (index_check_paged_sequence_passes, load_kv below). The other paged
  // kernels leave the code out (at d 128 it took the unpacked split kernel's spills from 52 to 180
  // bytes, inlined or called): launch_fwd_grid launches the check kernel ahead of them.
  constexpr bool kFoldsPaged = kPaged && kSplit && kPacked;
  constexpr bool kGated = kPaged && !kFoldsPaged && kPagedCheckOverlap;
  bool folded = false;
  if constexpr (!kPaged || kFoldsPaged) folded = p.index_fold.active();
  if (folded) {
    if constexpr (kFoldsPaged) {
      if (!index_check_paged_sequence_passes(p.index_fold, int(blockIdx.z), p.index_error)) return;
    } else if constexpr (kSplit) {
      if (!index_check_sequence_passes(p.index_fold, int(blockIdx.z), p.index_error)) return;
    } else if constexpr (!kPaged) {
      if (!index_check_passes_call(p.index_fold) || p.index_check_failed()) return;
    }
  } else if (p.index_check_failed()) {
    return;
  }

  // Highest row blocks first: under a causal mask they see the most keys, and starting the long
  // CTAs early shortens the tail of the grid. The splits of one row block are neighbours in the
  // grid, so they read its Q tile from L2 at about the same time.
  const int m_block = kSplit ? gridDim.x / split.num_splits - 1 - blockIdx.x / split.num_splits
                             : gridDim.x - 1 - blockIdx.x;
  const int split_idx = kSplit ? blockIdx.x % split.num_splits : 0;
  static_assert(!(kPacked && (kScoreModAndDropout || kScoreMod)), "only the plain variant packs, without score mods");
  const int pack = kPacked ? pack_arg : 1;
  const int batch = blockIdx.z;
  const int tid = threadIdx.x;
  // Unpacked: blockIdx.y is the query head. Packed: the kv head; row_head() gives each row's.
  const int kv_head = pack > 1 ? blockIdx.y : blockIdx.y / p.group_size();
  const int head = blockIdx.y;  // the query head when pack = 1 (the only case that reads it as one)

  // The sequence's lengths and first rows, read once (varlen and KV caches: global loads that the
  // offsets below would otherwise each repeat, dependent loads before the first tile's copies).
  const int seqlen_q = p.seqlen_q(batch);
  int seqlen_k = p.seqlen_k(batch);
  if constexpr (kGated) {
    // Not yet checked (a KV-cache call: its key count is its only index here): kept inside the
    // block_table row, whose entries are clamped into the cache where they are read.
    if (index_gate != nullptr) {
      seqlen_k = int(min(max(std::int64_t(seqlen_k), std::int64_t(0)), p.index_fold.bounds.capacity));
    }
  }
  const std::int64_t q_row0 = p.q_row0(batch);
  const int m_start = m_block * kBlockM;
  if (m_start >= seqlen_q * pack) {  // varlen: this sequence is shorter than the grid
    if constexpr (kFoldsPaged) {
      // No row block reads the entries then: the first one's first split checks them all.
      if (folded && m_block == 0 && split_idx == 0) {
        index_check_entries(p.index_fold, batch, 0, common::block_table_pages(p.index_fold.bounds, seqlen_k));
      }
    }
    return;
  }
  const int rows_here = min(kBlockM, seqlen_q * pack - m_start);
  // Packed row r of the grid (r = m_start + tile row) as (query row, query head). r / pack as a
  // multiply-high by ⌈2³² / pack⌉, exact for r < 2³² / pack (the host packs short queries only):
  // the masked tiles divide once per row, and a hardware-less integer division costs ~20
  // instructions there.
  const std::uint32_t pack_magic = pack > 1 ? 0xffffffffu / std::uint32_t(pack) + 1u : 0u;
  auto row_query = [&](int r) { return pack > 1 ? int(__umulhi(std::uint32_t(r), pack_magic)) : r; };
  auto row_head = [&](int r) { return pack > 1 ? kv_head * pack + (r - row_query(r) * pack) : head; };
  // The query rows this block touches: [q_begin, q_end).
  const int q_begin = row_query(m_start);
  const int q_end = row_query(m_start + rows_here - 1) + 1;

  const common::Mask mask = p.mask_for(seqlen_q, seqlen_k);
  // Key tiles that hold a key visible to some row of this block (the union of the row ranges);
  // split-KV: this CTA's share of them, ⌈tiles / num_splits⌉ each (the last ones may be short or
  // empty).
  const int n_block_visible_min = mask.block_col_begin(q_begin) / kBlockN;
  const int n_block_visible_max = (mask.block_col_end(q_end) + kBlockN - 1) / kBlockN;
  const int n_blocks_per_split =
      kSplit ? (max(n_block_visible_max - n_block_visible_min, 0) + split.num_splits - 1) / split.num_splits : 0;
  const int n_block_min = kSplit ? n_block_visible_min + split_idx * n_blocks_per_split : n_block_visible_min;
  const int n_block_max = kSplit ? min(n_block_visible_max, n_block_min + n_blocks_per_split) : n_block_visible_max;

  extern __shared__ __align__(128) char smem[];
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});  // (kBlockM, D)
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Traits::kSmemBytesQ)),
                          typename Traits::SmemLayoutKV{});  // (kBlockN, D)
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});  // (kBlockN, D)
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});           // (D, kBlockN)
  Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Traits::SmemLayoutVtNoSwizzle{});

  const auto* q_base = static_cast<const Element*>(p.q.data);
  const auto* k_base = static_cast<const Element*>(p.k.data);
  const auto* v_base = static_cast<const Element*>(p.v.data);

  // K/V tile loads. Paged caches (kPaged) look every row up in the page table (a tile may span
  // pages); dense and varlen rows are evenly spaced — row j at k_offset(row 0) + j · row_stride —
  // so that path is load_strided_tile. The two are separate kernels: with both in one, the
  // compiler if-converts the paged path into predicated instructions that every tile executes.
  //
  // Paged: the page-table entries of a key tile are copied into shared memory (s_pages, one
  // buffer per tile parity) by cp.async one step ahead — together with the V load of the tile
  // before it, so they have landed at the barrier that precedes the tile's K load — and each row
  // then reads its page there: no global load and no integer division on the path to the K/V
  // copies (FastDiv: a multiply and a shift; whole tiles skip the row and column checks). Pages of
  // fewer than 16 rows (SGLang's caches have pages of one row) take up to kPageSlotsSmall entries
  // per tile instead of kPageSlots: the two buffers interleave (entry i of buffer b at 2·i + b), so
  // that no index depends on how many entries there are.
  auto* s_pages = reinterpret_cast<std::int32_t*>(smem + Traits::kSmemBytesQ + 2 * Traits::kSmemBytesKV);
  const int page_size = kPaged ? p.page_size : 1;
  const FastDiv page_div(page_size);
  static_assert(!kPaged || Traits::kNThreads >= Traits::kPageSlotsSmall, "a thread per page-table entry of a tile");
  auto page_of = [&](int j) { return page_div.div(j); };
  bool entry_bad = false;  // kFoldsPaged: a block_table entry this thread read left the cache
  // The entries of tile n_block into buffer n_block & 1 (pages holding no row below seqlen_k are
  // not read: the table need not have them).
  auto prefetch_pages = [&](int n_block) {
    if constexpr (kPaged) {
      const int first = page_of(n_block * kBlockN);
      const int last = page_of(min((n_block + 1) * kBlockN, seqlen_k) - 1);
      if (tid <= last - first) {
        cp_async_4(s_pages + 2 * tid + (n_block & 1),
                   p.block_table + (std::int64_t(batch) * p.block_table_batch_stride + first + tid));
      }
    }
  };
  const std::int64_t k_row0 = kPaged ? 0 : p.k_row0(batch);
  const int kv_batch = kPaged ? 0 : p.kv_batch(batch);
  const std::int64_t k_row0_offset = kPaged ? 0 : p.k_offset_at(p.k, kv_batch, k_row0, 0, kv_head);
  const std::int64_t v_row0_offset = kPaged ? 0 : p.k_offset_at(p.v, kv_batch, k_row0, 0, kv_head);
  // kMayBeShort (a std::bool_constant): whether the tile can end past seqlen_k — only the last
  // tile can, and it is never wholly visible, so only the prologue's K load and the masked tile
  // step's V load need the row check.
  auto load_kv = [&](const Element* base, const common::RowHeadTensor& t, std::int64_t row0_offset, int valid_cols,
                     auto& s_tile, int n_block, auto kMayBeShort) {
    const int n_start = n_block * kBlockN;
    if constexpr (kPaged) {
      const std::int32_t* pages = s_pages + (n_block & 1);
      const int first = page_of(n_start);
      const std::int64_t head_offset = std::int64_t(kv_head) * t.head_stride;
      load_tile<Traits, kBlockN, decltype(kMayBeShort)::value>(base, s_tile, seqlen_k - n_start, valid_cols,
                                 [&](int r) {
                                   const int j = n_start + r;
                                   const int page = page_of(j);
                                   // Clamped into the cache: a bad entry must not lead outside
                                   // it; under a folded check it is recorded after the main loop.
                                   const std::uint32_t entry = std::uint32_t(pages[2 * (page - first)]);
                                   if constexpr (kFoldsPaged) entry_bad |= entry >= std::uint32_t(p.cache_batches);
                                   const std::uint32_t cache_page = min(entry, std::uint32_t(p.cache_batches - 1));
                                   return std::int64_t(cache_page) * t.batch_stride +
                                          std::int64_t(j - page * page_size) * t.row_stride + head_offset;
                                 }, tid);
    } else {
      load_strided_tile<Traits, kBlockN, decltype(kMayBeShort)::value>(
          base + row0_offset + std::int64_t(n_start) * t.row_stride, t.row_stride, s_tile, seqlen_k - n_start,
          valid_cols, tid);
    }
  };

  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // ((2,2), MMA_M, MMA_D)
  clear(acc_o);
  Tensor acc_o_rc = make_tensor(acc_o.data(), rowcol_layout(acc_o.layout()));  // (rows, cols)
  constexpr int kRows = decltype(size<0>(acc_o_rc))::value;  // score rows this thread holds (2·MMA_M)

  // Coordinates (row, col) inside the tile of every accumulator element this thread holds.
  Tensor cS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS_rc = make_tensor(cS.data(), rowcol_layout(cS.layout()));  // (rows, cols) → (row, col)

  float row_max[kRows];     // running max of the scores of each row, in score units
  float row_sum[kRows];     // this thread's part of Σ exp, relative to row_max
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    row_max[r] = -kInf;
    row_sum[r] = 0.0f;
  }

  // Scores reach exp2 through one multiplier: the plain path keeps raw q·k and folds
  // softmax_scale · log2(e) into it; with softcap or ALiBi the ScoreMod of src/common produces
  // natural-log scores first, and only log2(e) is left.
  const TileScoreMod mod(p.score_mod_for<float>(batch, head, seqlen_q, seqlen_k), kScoreModAndDropout || kScoreMod);
  const float score_to_log2 = mod.out_scale * kLog2e;

  int gate_flag = 0;  // index_gate's flag (kGated), read with the last key tile
  if (n_block_min < n_block_max) {
    Tensor tSrQ = thr_mma.partition_fragment_A(sQ);            // (MMA, MMA_M, MMA_K)
    Tensor tSrK = thr_mma.partition_fragment_B(sK);            // (MMA, MMA_N, MMA_K)
    Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);  // (MMA, MMA_D, MMA_N)

    auto copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
    auto thr_copy_q = copy_q.get_thread_slice(tid);
    Tensor tSsQ = thr_copy_q.partition_S(sQ);
    auto copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
    auto thr_copy_k = copy_k.get_thread_slice(tid);
    Tensor tSsK = thr_copy_k.partition_S(sK);
    auto copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
    auto thr_copy_v = copy_v.get_thread_slice(tid);
    Tensor tOsVt = thr_copy_v.partition_S(sVt);

    const bool use_dropout = kScoreModAndDropout && p.dropout_p > 0.0f;
    common::DropoutParams dropout = p.dropout;
    if (use_dropout && rng_state != nullptr) {
      dropout.seed = rng_state[0];
      dropout.offset = rng_state[1];
    }
    const std::uint64_t dropout_stream = p.dropout_stream(batch, head);

    // Paged: the first tile's page-table entries, in a group of their own that the wait below
    // completes without waiting for Q (cp_async_wait<0> is wait_all, which would).
    if constexpr (kPaged) {
      prefetch_pages(n_block_max - 1);
      cp_async_fence();
    }
    // Q tile, once; its cp.async group completes together with the first K tile's. (A block
    // with no key to read loads nothing: sQ then only stages O.)
    // Unpacked, the block's rows are evenly spaced (dense and varlen): one offset for the tile;
    // packed rows each take their (query row, head) offset.
    if constexpr (!kPacked) {
      load_strided_tile<Traits, kBlockM>(q_base + p.q_offset_at(p.q, batch, q_row0, m_start, head), p.q.row_stride, sQ,
                                         rows_here, p.head_dim, tid);
    } else {
      load_tile<Traits, kBlockM>(
          q_base, sQ, rows_here, p.head_dim,
          [&](int r) { return p.q_offset_at(p.q, batch, q_row0, row_query(m_start + r), row_head(m_start + r)); }, tid);
    }
    if constexpr (kPaged) {
      cp_async_fence();    // Q, a group of its own
      cp_async_wait<1>();  // all but the newest group: the page entries have landed, Q may not have
      __syncthreads();
    }
    // Later tiles first: with a causal mask the partly masked diagonal tile comes first and the
    // rest need no per-element masking.
    load_kv(k_base, p.k, k_row0_offset, p.head_dim, sK, n_block_max - 1, std::true_type{});
    cp_async_fence();
    // kEarlyFirstV: the first tile's V in flight with Q and K (sV is free until then), in a group
    // of its own with the next tile's page entries; the first key tile then waits for all but it.
    if constexpr (kEarlyFirstV<kHeadDim>) {
      load_kv(v_base, p.v, v_row0_offset, p.head_dim_v, sV, n_block_max - 1, std::true_type{});
      if (n_block_max - 1 > n_block_min) prefetch_pages(n_block_max - 2);
      cp_async_fence();
    }

    // One key tile. kMasked (a std::bool_constant) compiles the per-element mask in or out: the
    // loop below calls the masked copy only for tiles that are not wholly visible, so the common
    // tile carries no mask instructions at all (a run-time branch around them gets if-converted
    // into predicated instructions that still cost issue slots on every tile).
    auto key_tile = [&](int n_block, auto kMasked) {
      const int n_start = n_block * kBlockN;
      const bool first = n_block == n_block_max - 1;  // uniform: the block's first key tile
      Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});  // ((2,2), MMA_M, MMA_N)
      clear(acc_s);

      if (kEarlyFirstV<kHeadDim> && first) {
        cp_async_wait<1>();  // Q and K(n) have landed; V(n) (the prologue's last group) may not have
        __syncthreads();
      } else {
        // K(n) has landed, and every warp has finished reading V(n+1): V(n) may overwrite it.
        cp_async_wait<0>();
        __syncthreads();
        load_kv(v_base, p.v, v_row0_offset, p.head_dim_v, sV, n_block, kMasked);
        // The next tile's page entries land with V(n), before the barrier that precedes K(n−1).
        if (n_block > n_block_min) prefetch_pages(n_block - 1);
        cp_async_fence();
      }

      gemm_ss(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, copy_q, copy_k, thr_copy_q, thr_copy_k);

      Tensor s = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));  // (rows, cols)
      // Sequence coordinates of element (mi, ni): (row0 + Δrow, col0 + Δcol), Δ compile-time.
      const int row0 = opaque(m_start + get<0>(cS_rc(0, 0)));
      const int col0 = opaque(n_start + get<1>(cS_rc(0, 0)));
      auto seq_row = [&](int mi, int ni) { return row0 + (get<0>(cS_rc(mi, ni)) - get<0>(cS_rc(0, 0))); };
      auto seq_col = [&](int mi, int ni) { return col0 + (get<1>(cS_rc(mi, ni)) - get<1>(cS_rc(0, 0))); };
      // V(n) has landed, and every warp has finished reading K(n): K(n−1) may overwrite it.
      cp_async_wait<0>();
      __syncthreads();
      if (n_block > n_block_min) {
        load_kv(k_base, p.k, k_row0_offset, p.head_dim, sK, n_block - 1, std::false_type{});
        cp_async_fence();
      }

      // Softcap and ALiBi (TileScoreMod), each a uniform branch around a whole pass over the tile,
      // after the K(n−1) load is issued (as the mask below, for the same reason).
      if (mod.softcap) {
        CUTE_UNROLL
        for (int e = 0; e < size(s); ++e) s(e) = TileScoreMod::tanh(s(e) * mod.k);
      }
      if (mod.alibi) {
        CUTE_UNROLL
        for (int mi = 0; mi < size<0>(s); ++mi) {
          const float base = mod.alibi_base(seq_row(mi, 0), col0);
          CUTE_UNROLL
          for (int ni = 0; ni < size<1>(s); ++ni) {
            s(mi, ni) = mod.add_alibi(s(mi, ni), base, get<1>(cS_rc(mi, ni)) - get<1>(cS_rc(0, 0)));
          }
        }
      }
      // Per-element masking only where the tile is not wholly visible (diagonal, window edges,
      // the ragged last tile). Row i sees exactly the keys [col_begin(i), col_end(i)) (col_end ≤
      // seqlen_k), bounds taken per row and per tile: per-element bounds would be loop-invariant,
      // and hoisting one per accumulator element out of the key loop spills registers. A thread's
      // columns in a row are its first column + (ni mod 2) + 8 · ⌊ni / 2⌋ (two per m16n8 tile,
      // tiles side by side), so its visible ones are a contiguous run of ni: the row's bounds
      // become one bit mask (columns below col_end, less those below col_begin) and each element
      // reads its bit, 7 bits going into predicates per instruction (R2P) — instead of two
      // comparisons against its own column, a loop-invariant register per column (32 at kBlockN =
      // 128) that spilled scores. Masking after the K(n−1) load is issued keeps that load's
      // address arithmetic and the masked scores from being live together across its branch.
      if constexpr (decltype(kMasked)::value) {
        static_assert(decltype(size<1>(s))::value <= 32, "one bit per column of a row");
        const int col_shift = n_start + get<1>(cS_rc(0, 0));
        // Columns of the thread's row below x (relative to its first column), for x clamped to
        // the tile.
        auto cols_below = [](int x) {
          constexpr int kSpan = 8 * (decltype(size<1>(s))::value / 2);
          x = min(max(x, 0), kSpan);
          return 2 * (x >> 3) + min(x & 7, 2);
        };
        auto bits_below = [](int c) { return c >= 32 ? 0xffffffffu : (1u << c) - 1u; };
        CUTE_UNROLL
        for (int mi = 0; mi < size<0>(s); ++mi) {
          const int i = row_query(m_start + get<0>(cS_rc(mi, 0)));
          const std::uint32_t bits = bits_below(cols_below(mask.col_end(i) - col_shift)) &
                                     ~bits_below(cols_below(mask.col_begin(i) - col_shift));
          CUTE_UNROLL
          for (int ni = 0; ni < size<1>(s); ++ni) {
            if (!((bits >> ni) & 1u)) s(mi, ni) = -kInf;
          }
        }
      }

      // Online softmax: new row max, rescale what was accumulated, exponentiate this tile. The
      // row's max and sum run as kRowChains interleaved partial chains (a shorter dependency
      // chain; the max is exact in any order, the sum differs in its last bits).
      constexpr int kRowChains = fwd_tuning(Traits::kHeadDim).row_chains;
      static_assert(kRowChains >= 1 && decltype(size<1>(s))::value % kRowChains == 0, "chains divide the row");
      float correction[kRows];  // exp2(old max − new max) of each row, for O
      // O rescaled after the row loop, skipping the block's first tile; otherwise inside it
      constexpr bool kRescaleAfterLoop = kBranchRescale<Traits::kHeadDim> || kScoreModAndDropout;
      [[maybe_unused]] bool any_max_grew = false;  // kLazyRescale: whether one of this thread's rows got a new max
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(s); ++mi) {
        float max_part[kRowChains];
        CUTE_UNROLL
        for (int c = 0; c < kRowChains; ++c) max_part[c] = row_max[mi];
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(s); ++ni) max_part[ni % kRowChains] = fmaxf(max_part[ni % kRowChains], s(mi, ni));
        float tile_max = max_part[0];
        CUTE_UNROLL
        for (int c = 1; c < kRowChains; ++c) tile_max = fmaxf(tile_max, max_part[c]);
        tile_max = quad_max(tile_max);
        // A row that has seen no visible key keeps max −∞; subtracting 0 instead keeps
        // exp2(−∞ − (−∞)) = NaN out and gives p = 0.
        const float max_scaled = tile_max == -kInf ? 0.0f : tile_max * score_to_log2;
        const float old_scaled = row_max[mi] == -kInf ? -kInf : row_max[mi] * score_to_log2;
        correction[mi] = exp2_ftz(old_scaled - max_scaled);
        if constexpr (kLazyRescale<kHeadDim>) {
          // (−∞ staying −∞: O and the sum are still zero, and 1 keeps them so)
          const bool grew = tile_max > row_max[mi];
          any_max_grew |= grew;
          if (!grew) correction[mi] = 1.0f;
        }
        row_max[mi] = tile_max;
        row_sum[mi] *= correction[mi];
        if constexpr (!kRescaleAfterLoop) {
          CUTE_UNROLL
          for (int ni = 0; ni < size<1>(acc_o_rc); ++ni) acc_o_rc(mi, ni) *= correction[mi];
        }
        float sum_part[kRowChains];
        CUTE_UNROLL
        for (int c = 0; c < kRowChains; ++c) sum_part[c] = 0.0f;
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(s); ++ni) {
          // One FFMA per element: x · (scale · log2 e) − max · (scale · log2 e).
          s(mi, ni) = exp2_ftz(fmaf(s(mi, ni), score_to_log2, -max_scaled));
          sum_part[ni % kRowChains] += s(mi, ni);
        }
        float sum = sum_part[0];
        CUTE_UNROLL
        for (int c = 1; c < kRowChains; ++c) sum += sum_part[c];
        row_sum[mi] += sum;
      }
      // kRescaleAfterLoop: O is still zero after the block's first tile (FA2 skips this for it
      // too): a uniform branch around kRows × dv / 4 multiplies per thread, which weigh most
      // where a block has few key tiles.
      bool rescale = kRescaleAfterLoop && !first;
      if constexpr (kLazyRescale<kHeadDim>) rescale = rescale && __any_sync(0xffffffffu, any_max_grew);
      if (rescale) {
        CUTE_UNROLL
        for (int mi = 0; mi < size<0>(acc_o_rc); ++mi) {
          CUTE_UNROLL
          for (int ni = 0; ni < size<1>(acc_o_rc); ++ni) acc_o_rc(mi, ni) *= correction[mi];
        }
      }

      // Dropout after the row sums (lse excludes it); 1 / (1 − p) is applied with the final
      // normalisation. One Philox call per 16×16 block feeds the 8 elements this lane holds.
      if (use_dropout) {
        constexpr int kMmaM = decltype(size<1>(acc_s))::value;
        constexpr int kMmaN = decltype(size<2>(acc_s))::value;
        CUTE_UNROLL
        for (int m = 0; m < kMmaM; ++m) {
          CUTE_UNROLL
          for (int nb = 0; nb < kMmaN / 2; ++nb) {
            const int i0 = seq_row(2 * m, 4 * nb);
            const int j0 = seq_col(2 * m, 4 * nb);
            const std::uint32_t bits = common::dropout_keep_bits(dropout, dropout_stream, i0 >> 4, j0 >> 4,
                                                                 common::dropout_lane(i0, j0));
            CUTE_UNROLL
            for (int h = 0; h < 2; ++h) {
              CUTE_UNROLL
              for (int c = 0; c < 4; ++c) {
                const int mi = 2 * m + h, ni = 4 * nb + c;
                const int e = common::dropout_element_at(seq_row(mi, ni) - i0, seq_col(mi, ni) - j0);
                if (!((bits >> e) & 1u)) s(mi, ni) = 0.0f;
              }
            }
          }
        }
      }

      // P in the input dtype (SPEC §2: rounded before the P·V product), straight into A registers.
      Tensor rP = make_tensor_like<Element>(acc_s);
      CUTE_UNROLL
      for (int e = 0; e < size(acc_s); ++e) rP(e) = static_cast<Element>(acc_s(e));
      Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand_layout(rP.layout()));  // ((2,2,2), MMA_M, MMA_N/2)
      gemm_rs(tiled_mma, acc_o, tOrP, tOrVt, tOsVt, copy_v, thr_copy_v);
    };

    for (int n_block = n_block_max - 1; n_block >= n_block_min; --n_block) {
      const int n_start = n_block * kBlockN;
      if constexpr (kGated) {
        // The gate's flag, read as the last key tile starts, so that its load is in flight during
        // the tile's products (read at the first store it added a load's latency to every CTA).
        if (index_gate != nullptr && n_block == n_block_min) gate_flag = read_index_gate(index_gate);
      }
      if (mask.block_fully_visible(q_begin, q_end, n_start, n_start + kBlockN)) {
        key_tile(n_block, std::false_type{});
      } else {
        key_tile(n_block, std::true_type{});
      }
    }
    if constexpr (kFoldsPaged) {
      // The sequence's first bad entry, at or before the last this block read.
      if (folded && entry_bad) {
        record_first_bad_entry(p.index_fold, batch, page_of(min(n_block_max * kBlockN, seqlen_k) - 1));
      }
    }
  }
  if constexpr (kFoldsPaged) {
    // The entries of pages outside the visible keys of this row block, which none of its splits
    // reads: its first split checks them.
    if (folded && split_idx == 0) {
      const long long pages = common::block_table_pages(p.index_fold.bounds, seqlen_k);
      const bool any = n_block_visible_min < n_block_visible_max;
      const long long read_begin = any ? page_of(n_block_visible_min * kBlockN) : pages;
      const long long read_end = any ? page_of(min(n_block_visible_max * kBlockN, seqlen_k) - 1) + 1 : pages;
      index_check_entries(p.index_fold, batch, 0, read_begin);
      index_check_entries(p.index_fold, batch, read_end, pages);
    }
  }

  // --- epilogue: normalise, lse, O through shared memory -------------------------------------
  const float keep_scale = kScoreModAndDropout && p.dropout_p > 0.0f ? p.dropout.keep_scale : 1.0f;
  Tensor cO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor cO_rc = make_tensor(cO.data(), rowcol_layout(cO.layout()));
  float lse[kRows];
  // Attention sinks (common/sink.h) join the denominator here, once, with the final row max —
  // except in split-KV, where each split's partial stays sink-free and the combine adds the sink.
  const bool fold_sinks = !kSplit && p.sinks != nullptr;
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    float sum = quad_sum(row_sum[mi]);
    // No visible key: out = 0, lse = the sink, +∞ without one (SPEC §2.5). A NaN sum (a NaN score
    // the row sees) is not empty: it stays NaN in out and lse.
    const bool empty = sum == 0.0f;
    // Rounded on its own (no FMA with the log2 below), so that every variant — the split-KV one
    // compiles the sink fold out — rounds lse alike: one share's partial is the unsplit lse.
    float max_log2 = __fmul_rn(row_max[mi], score_to_log2);
    float rescale = 1.0f;
    // (The row's query head: the CTA's, or per row when GQA-packed.)
    const float sink = fold_sinks ? p.sinks[row_head(m_start + get<0>(cO_rc(mi, 0)))] : -kInf;
    if (fold_sinks && !empty) {
      const common::SinkFold<float> f =
          common::fold_sink(max_log2, sum, sink * kLog2e, [](float x) { return exp2_ftz(x); });
      max_log2 = f.max_log2;
      sum = f.sum;
      rescale = f.rescale;
    }
    // sum ≥ 1 (the larger of the row's max and the sink contributes exp2(0)): the approximate
    // reciprocal and log2 (MUFU, 2 ulp and 2^-22 absolute) are far inside fp32 accuracy here, where
    // IEEE division and log2f took some 40 instructions per row, a slow-path call included.
    const float inv = empty ? 0.0f : __fdividef(keep_scale * rescale, sum);
    lse[mi] = empty ? common::empty_row_lse(sink) : (max_log2 + __log2f(sum)) * kLn2;
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(acc_o_rc); ++ni) acc_o_rc(mi, ni) *= inv;
  }

  if constexpr (kGated) {
    // The first store: the index check this kernel ran beside must have passed (its flag read in
    // the last key tile, or here by a block without one).
    if (index_gate != nullptr) {
      if (n_block_min >= n_block_max) gate_flag = read_index_gate(index_gate);
      if (gate_flag != 0) return;
    }
  }

  if constexpr (kSplit) {
    // Partials in fp32, straight from registers: a quad's float2 stores cover one 32-byte sector
    // of a row, so no staging through shared memory is needed (which could not hold fp32 O of
    // the halved-key-tile configurations anyway). The lse is always written: the combine needs it.
    // The thread's first row and column, opaque: per-element bounds checks would otherwise be
    // hoisted above the key loop as loop invariants and held (spilled) through it.
    const int row0 = opaque(get<0>(cO_rc(0, 0)));
    const int col0 = opaque(get<1>(cO_rc(0, 0)));
    auto tile_row = [&](int mi) { return row0 + (get<0>(cO_rc(mi, 0)) - get<0>(cO_rc(0, 0))); };
    auto tile_col = [&](int ni) { return col0 + (get<1>(cO_rc(0, ni)) - get<1>(cO_rc(0, 0))); };
    if ((tid & 3) == 0) {
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        const int row = tile_row(mi);
        if (row < rows_here) {
          const int r = m_start + row;
          split.lse_partial[split.lse_offset(p, split_idx, batch, row_head(r), row_query(r))] = lse[mi];
        }
      }
    }
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(acc_o_rc); ++mi) {
      const int row = tile_row(mi);
      if (row >= rows_here) continue;
      const int r = m_start + row;
      float* dst_row = split.out_partial + split.out_offset(p, split_idx, batch, row_query(r), row_head(r));
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(acc_o_rc); ni += 2) {
        // Elements ni, ni+1 are columns c, c+1 of one row; dv is a multiple of 8, so c < dv
        // implies c + 1 < dv, and the row starts 8-byte aligned.
        const int col = tile_col(ni);
        if (col < p.head_dim_v) {
          *reinterpret_cast<float2*>(dst_row + col) = make_float2(acc_o_rc(mi, ni), acc_o_rc(mi, ni + 1));
        }
      }
    }
    return;
  }

  // Unpacked, the rows of out and lse are evenly spaced: offsets from the block's first row, once,
  // instead of the per-row offset arithmetic (which in varlen mode also re-reads cu_seqlens_q per
  // row: the stores may alias it as far as the compiler knows).
  if (p.lse != nullptr && (tid & 3) == 0) {
    if constexpr (!kPacked) {
      float* const lse_rows = p.lse + p.lse_index_at(batch, q_row0, head, m_start);
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        const int row = get<0>(cO_rc(mi, 0));
        if (row < rows_here) lse_rows[row] = lse[mi];
      }
    } else {
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        const int row = get<0>(cO_rc(mi, 0));
        if (row < rows_here) {
          p.lse[p.lse_index_at(batch, q_row0, row_head(m_start + row), row_query(m_start + row))] = lse[mi];
        }
      }
    }
  }

  // sQ becomes the O staging tile: every warp finished reading it (the last QKᵀ product) before
  // the barrier that followed that product in the key loop (a block without key tiles never
  // loaded it).
  Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutQ{});  // (kBlockM, D)
  {
    // The staging stores address sO directly: the layout's swizzle XORs a row's r mod 8 into bits
    // 3–5 of its offset, and every element of this thread has the row r0 + Δr (Δr ∈ 8ℤ) and the
    // column c0 + 8k (the pair's first; c0 = 2 · (lane mod 4) < 8), so that term is the thread's
    // constant g = r0 mod 8:
    //   offset(r0 + Δr, c0 + 8k) = (base ⊕ 8 · (k mod 8)) + 512 · Δr / 8 + kBlockM · 64 · ⌊k / 8⌋,
    //   base = 64g + c0 + 512 · ⌊r0 / 8⌋ + 8g,
    // one XOR per column chunk instead of the swizzle and the atom arithmetic per element.
    // (Checked on the host against CuTe's layout for every thread of every forward tile shape.)
    static_assert(std::is_same_v<typename Traits::SmemLayoutAtom,
                                 decltype(composition(Swizzle<3, 3, 3>{}, Layout<Shape<_8, _64>, Stride<_64, _1>>{}))>,
                  "the addressing below is that of this atom");
    const int r0 = get<0>(cO_rc(0, 0));
    const int c0 = get<1>(cO_rc(0, 0));
    const int g = r0 & 7;
    const int base = g * 64 + c0 + (r0 >> 3) * 512 + (g << 3);
    Element* const o_smem = reinterpret_cast<Element*>(smem);  // sQ's bytes
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(acc_o_rc); ++mi) {
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(acc_o_rc); ni += 2) {
        // Elements ni, ni+1 are columns c, c+1 of one row: one 32-bit shared store.
        const Element pair[2] = {static_cast<Element>(acc_o_rc(mi, ni)), static_cast<Element>(acc_o_rc(mi, ni + 1))};
        std::uint32_t packed;
        std::memcpy(&packed, pair, sizeof packed);
        const int dr = get<0>(cO_rc(mi, ni)) - r0;  // compile-time, a multiple of 8
        const int k = (get<1>(cO_rc(mi, ni)) - c0) >> 3;  // compile-time
        const int offset = (base ^ ((k & 7) << 3)) + (dr >> 3) * 512 + (k >> 3) * (kBlockM * 64);
        *reinterpret_cast<std::uint32_t*>(o_smem + offset) = packed;
      }
    }
  }
  __syncthreads();

  typename Traits::GmemTiledCopy gmem_copy;
  auto thr_gmem = gmem_copy.get_thread_slice(tid);
  Tensor tOsO = thr_gmem.partition_S(sO);  // (CPY, CPY_ROWS, CPY_COLS)
  Tensor tOcO = thr_gmem.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  auto* out_base = static_cast<Element*>(p.out.data);
  auto store_rows = [&](auto&& row_ptr) {
    CUTE_UNROLL
    for (int m = 0; m < size<1>(tOsO); ++m) {
      const int row = get<0>(tOcO(0, m, 0));
      if (row >= rows_here) continue;  // rows past the sequence are not written
      Element* dst_row = row_ptr(row);
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tOsO); ++k) {
        const int col = get<1>(tOcO(0, m, k));
        if (col < p.head_dim_v) {
          *reinterpret_cast<uint4*>(dst_row + col) = *reinterpret_cast<const uint4*>(&tOsO(0, m, k));
        }
      }
    }
  };
  if constexpr (!kPacked) {
    Element* const out_rows = out_base + p.q_offset_at(p.out, batch, q_row0, m_start, head);
    const std::int64_t row_stride = p.out.row_stride;
    store_rows([&](int row) { return out_rows + row * row_stride; });
  } else {
    store_rows([&](int row) {
      return out_base + p.q_offset_at(p.out, batch, q_row0, row_query(m_start + row), row_head(m_start + row));
    });
  }
}

}  // namespace flashattn::cuda::sm80
