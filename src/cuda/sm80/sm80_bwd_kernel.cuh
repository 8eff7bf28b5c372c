// src/cuda/sm80/sm80_bwd_kernel.cuh — the portable backward kernels (FlashAttention-2 algorithm) on
// CuTe: mma.sync m16n8k16, ldmatrix (plain and transposed), cp.async. Runs on sm80 … sm90.
//
// Three kernels, launched in order on one stream (sm80_bwd_launch.cuh):
//   bwd_preprocess_kernel   softmax_d = rowsum(dO ∘ O) in fp32. (The fp32 dQ accumulator and the
//                           deterministic counters, in the workspace, are cleared by a memset.)
//   bwd_kernel              one CTA per (key block, kv head, batch): K and V of its kBlockN keys
//                           stay in shared memory, dK and dV in registers, while it walks every
//                           query head of its GQA group and every row block that sees one of its
//                           keys (Mask::block_row_*). dK/dV are therefore summed over the group in
//                           fp32 without an expanded (b, sk, h, d) buffer. dQ goes to the fp32
//                           accumulator by atomics.
//   bwd_postprocess_kernel  dQ = the accumulator, rounded to the input dtype.
//
// The dQ accumulator is kept in the order the MMA fragments hold it: the kBlockM × kHeadDim tile of
// one (row block, head) is a run of floats where element e of thread t sits at
// (e / V) · V · kNThreads + V · t + e mod V (dq_index; V = dq_vec, 4 on sm_90 at d ≤ 128, else 1).
// A warp's reductions then cover 32 · V consecutive floats (whole 128-byte lines) instead of 8
// rows' pieces, and the postprocess, which has the same fragment layout, reads it back coalesced.
// The additions are reductions without a return value (red.global.add, REDG in SASS), V floats
// per instruction.
//
// Per row block (kBlockM rows of one query head), with P and dS staged in shared memory so the
// transposed products can read them back through ldmatrix.trans (warp arrangements per head dim in
// sm80_bwd_launch.cuh):
//   S = Q Kᵀ, dP' = dO Vᵀ                    (kBlockM × kBlockN)
//   P = exp(score − lse)                     (score: src/common's ScoreMod, as TileScoreMod; masked: P = 0)
//   Z = P ∘ keep / (1 − p),  dP = dP' ∘ keep / (1 − p)       (dropout: the forward's mask)
//   dS = P ∘ (dP − softmax_d) ∘ dscore/ddot  (dscore/ddot includes softmax_scale and the softcap)
//   dV += Zᵀ dO,  dK += dSᵀ Q                (kBlockN × D)
//   dQ_acc += dS K                           (kBlockM × D; fp32 atomics)
// Z and dS are rounded to the input dtype before their products, as SPEC §2 says for P.
// With kStages = 2, Q, dO and the row statistics of the next (head, row block) are copied into the
// other buffer while this one computes.
//
// Deterministic mode: the key blocks that meet a row block m form a contiguous range [n_lo, n_hi)
// (Mask::block_col_* — the transpose of the row walk, tests/cpp/test_mask.cpp). Key block n adds
// its dQ part of row block m only after the counter of (batch, head, m) reaches n − n_lo, then
// increments it: the additions happen in key order on every run. CTAs are dispatched in grid order
// with the key block fastest, so the CTAs a block waits for are already resident or finished. The
// turn is taken by an acquire load and passed by a release reduction (thread 0, after a barrier of
// the CTA), not by __threadfence: with a fence after them, ptxas keeps every atomicAdd of the tile
// as an ATOMG that waits for its old value (measured on sm_90a: 210 of them at d 128).
#pragma once

#include "cuda/device/bwd_prepost.cuh"
#include "cuda/sm80/sm80_fwd_kernel.cuh"
#include "cuda/sm80/sm80_tuning.h"

namespace flashattn::cuda::sm80 {

// Rows per block of the pre- and postprocess kernels and the unit of the deterministic counters'
// layout; the main kernel's kBlockM is a multiple of it.
constexpr int kBwdBlockM = 64;
constexpr int kBwdThreads = 256;

// kWarpsMSdP: warps along the rows of S/dP (the rest along its keys); kWarpsNdKV: warps along the
// keys of dK/dV (the rest along D); kWarpsMdQ: warps along the rows of dQ (the rest along D).
// kStages: buffers of Q / dO / row statistics (2: the next row block loads during this one).
// kSpreadDq: dQ is computed right after the P/dS barrier and its atomics are issued in slices
// between the k-steps of the dV and dK products, instead of in one burst at the end of the row
// block. kLateLoad (with two stages): the next row block's Q/dO copies are issued after the S/dP
// products instead of before them. Both move global-memory traffic out of the S/dP phase, whose
// ldmatrix reads keep the shared-memory pipe busy, into the tensor-bound dK/dV phase (the
// atomics and ldmatrix share the load/store unit's queue; the cp.async writes share the shared-memory
// bandwidth). bwd_tuning (sm80_tuning.h) says where they are on.
template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarpsMSdP, int kWarpsNdKV, int kWarpsMdQ,
          int kStages_, bool kSpreadDq_ = false, bool kLateLoad_ = false, bool kPairedN_ = false>
struct BwdTraits {
  using Element = Element_;
  // kPairedN: the S/dP product's N permutation gives each warp two adjacent 8-column MMA tiles (a
  // whole 16 × 16 block, columns 16w … 16w + 15 of each 16·warps-wide tile) instead of the default
  // interleaving (warp w: columns 8w … 8w + 7 and 8·warps + 8w …), so that one Philox call serves
  // the 8 dropout elements a thread holds of a block (docs/dropout.md) instead of two calls using 4
  // bits each. Every other use of the S/dP fragments goes by their coordinates.
  static constexpr bool kPairedN = kPairedN_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kBwdThreads / 32;
  static constexpr int kNThreads = kBwdThreads;
  static constexpr int kStages = kStages_;
  static constexpr bool kSpreadDq = kSpreadDq_;
  static constexpr bool kLateLoad = kLateLoad_ && kStages_ == 2;
  static_assert(kBlockM % kBwdBlockM == 0, "row blocks are whole counter units");
  static_assert(kStages == 1 || kStages == 2);

  static_assert(kHeadDim % 64 == 0, "head dims are instantiated in multiples of 64 (one swizzle atom)");
  static_assert(kBlockN % 32 == 0, "key tiles are whole 32-row copy waves and 32-element swizzle atoms");

  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                     MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                                     MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;
  // Each warp's tile is 16 wide along N (two 8-column MMA tiles, interleaved with the other
  // warps' unless paired), so B operands load with ldmatrix.x4.
  template <int kWarpsM, bool kPaired = false>
  using Mma = TiledMMA<MmaAtom, Layout<Shape<Int<kWarpsM>, Int<kNWarps / kWarpsM>, _1>>,
                       Tile<Int<16 * kWarpsM>,
                            std::conditional_t<kPaired,
                                               Layout<Shape<_8, Int<kNWarps / kWarpsM>, _2>, Stride<_1, _16, _8>>,
                                               Int<16 * (kNWarps / kWarpsM)>>,
                            _16>>;
  using TiledMmaSdP = Mma<kWarpsMSdP, kPairedN>;  // (kBlockM, kBlockN) += (kBlockM, D) · (kBlockN, D)ᵀ
  using TiledMmadKV = Mma<kWarpsNdKV>;  // (kBlockN, D) += (kBlockN, kBlockM) · (D, kBlockM)ᵀ
  using TiledMmadQ = Mma<kWarpsMdQ>;    // (kBlockM, D) += (kBlockM, kBlockN) · (D, kBlockN)ᵀ
  static_assert(kBlockM % (16 * kWarpsMSdP) == 0 && kBlockN % (16 * (kNWarps / kWarpsMSdP)) == 0);
  static_assert(kBlockN % (16 * kWarpsNdKV) == 0 && kHeadDim % (16 * (kNWarps / kWarpsNdKV)) == 0);
  static_assert(kBlockM % (16 * kWarpsMdQ) == 0 && kHeadDim % (16 * (kNWarps / kWarpsMdQ)) == 0);

  // Shared memory: (rows, D) tiles in 64-element swizzled rows as in the forward; P and dS in rows
  // of kBlockN (64- or 32-element atoms). Transposed views read the same bytes as (cols, rows).
  static constexpr int kSmemRowElems = 64;
  using SmemLayoutAtom = decltype(composition(
      Swizzle<3, 3, 3>{}, Layout<Shape<_8, Int<kSmemRowElems>>, Stride<Int<kSmemRowElems>, _1>>{}));
  static constexpr int kPRowElems = kBlockN % 64 == 0 ? 64 : 32;
  using SmemLayoutAtomP = decltype(composition(
      Swizzle<kPRowElems == 64 ? 3 : 2, 3, 3>{}, Layout<Shape<_8, Int<kPRowElems>>, Stride<Int<kPRowElems>, _1>>{}));

  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));   // Q, dO
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // K, V
  using SmemLayoutP = decltype(tile_to_shape(SmemLayoutAtomP{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));   // P, dS
  using SmemLayoutQt = decltype(composition(SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutKt = decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutPt = decltype(composition(SmemLayoutP{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutQtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutQt{}));
  using SmemLayoutKtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutKt{}));
  using SmemLayoutPtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutPt{}));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;

  // Global ↔ shared: 16 bytes per thread and access, 8 threads per 64-element row (load_tile).
  static constexpr int kElemsPerAccess = 16 / int(sizeof(Element));
  static constexpr int kThreadsPerRow = kSmemRowElems / kElemsPerAccess;
  using GmemThreadLayout = Layout<Shape<Int<kNThreads / kThreadsPerRow>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>;
  using GmemTiledCopy = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Element>{}, GmemThreadLayout{},
                                                 Layout<Shape<_1, Int<kElemsPerAccess>>>{}));
  static_assert(kBlockM % (kNThreads / kThreadsPerRow) == 0 && kBlockN % (kNThreads / kThreadsPerRow) == 0);

  static constexpr int kSmemBytesQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemBytesKV = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemBytesP = kBlockM * kBlockN * int(sizeof(Element));
  static constexpr int kSmemBytesRowStats = 2 * kBlockM * int(sizeof(float));  // lse, softmax_d
  // Q and dO per stage, K, V, P, dS, row statistics per stage.
  static constexpr int kSmemBytes =
      kStages * (2 * kSmemBytesQ + kSmemBytesRowStats) + 2 * kSmemBytesKV + 2 * kSmemBytesP;
};

// Stores a fp32 accumulator fragment, rounded to Element, into a (rows, cols) shared tile: elements
// (mi, ni) and (mi, ni + 1) of the row/column view are adjacent columns of one row, so each pair is
// one 32-bit store (a swizzle never separates an even/odd column pair).
// The thread's rows are its first one plus multiples of 8 (m16n8 fragments), and the tiles are
// 8-row swizzle atoms stacked along the rows: a step of 8·j rows adds the same offset to every
// element and leaves the swizzled bits (which come from the row within an atom) unchanged. So
// only one address per column pair is computed, the row steps being constant offsets — instead of
// one address per element, which the compiler would keep in registers across the loop.
template <class Element, class AccRC, class CoordRC, class SmemTensor>
__device__ __forceinline__ void store_pairs(const AccRC& acc_rc, const CoordRC& coord_rc, SmemTensor& s) {
  const int row0 = get<0>(coord_rc(0, 0));
  CUTE_UNROLL
  for (int ni = 0; ni < size<1>(acc_rc); ni += 2) {
    Element* col_base = &s(row0, get<1>(coord_rc(0, ni)));
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(acc_rc); ++mi) {
      const int row_step = get<0>(coord_rc(mi, ni)) - row0;  // a multiple of 8, known at compile time
      const Element pair[2] = {static_cast<Element>(acc_rc(mi, ni)), static_cast<Element>(acc_rc(mi, ni + 1))};
      std::uint32_t packed;
      std::memcpy(&packed, pair, sizeof packed);
      *reinterpret_cast<std::uint32_t*>(col_base + int(s.layout()(row_step, 0))) = packed;
    }
  }
}

// Writes the rows [0, valid_rows) and columns [0, valid_cols) of a shared (kRows, D) tile to global
// memory with 16-byte stores; row_ptr(r) is the destination of tile row r.
template <class Traits, int kRows, class SmemTensor, class RowPtr>
__device__ __forceinline__ void write_tile(const SmemTensor& s_tile, int valid_rows, int valid_cols, RowPtr&& row_ptr,
                                           int tid) {
  typename Traits::GmemTiledCopy gmem_copy;
  auto thr = gmem_copy.get_thread_slice(tid);
  Tensor t_s = thr.partition_S(s_tile);
  Tensor t_c = thr.partition_S(make_identity_tensor(Shape<Int<kRows>, Int<Traits::kHeadDim>>{}));
  CUTE_UNROLL
  for (int m = 0; m < size<1>(t_s); ++m) {
    const int row = get<0>(t_c(0, m, 0));
    if (row >= valid_rows) continue;
    auto* dst = row_ptr(row);
    CUTE_UNROLL
    for (int k = 0; k < size<2>(t_s); ++k) {
      const int col = get<1>(t_c(0, m, k));
      if (col < valid_cols) *reinterpret_cast<uint4*>(dst + col) = *reinterpret_cast<const uint4*>(&t_s(0, m, k));
    }
  }
}

// Rows of the dQ accumulator are grouped in tiles of kBlockM rows per (row block, head); sequence b's
// tiles start at a multiple of kBwdTileRows: b · ⌈max_seqlen_q⌉ for dense batches, and
// ⌊(cu_seqlens_q[b] + b · kBwdTileRows) / kBwdTileRows⌋ · kBwdTileRows for varlen ones (each sequence
// then starts on its own tile, and all fit in total_q + (b + 1) · kBwdTileRows rows).
constexpr int kBwdTileRows = 128;

__device__ __forceinline__ std::int64_t dq_tile_row0(const common::AttentionParams& p, int b) {
  if (p.is_varlen()) {
    return (std::int64_t(p.cu_seqlens_q[b]) + std::int64_t(b) * kBwdTileRows) / kBwdTileRows * kBwdTileRows;
  }
  return std::int64_t(b) * ((p.max_seqlen_q + kBwdTileRows - 1) / kBwdTileRows * kBwdTileRows);
}

// The first float of the accumulator tile of rows [m_start, m_start + kBlockM) of (b, head), where
// tile_row0 = dq_tile_row0(p, b).
template <int kBlockM, int kHeadDim>
__device__ __forceinline__ float* dq_tile(const common::AttentionParams& p, float* dq_accum, std::int64_t tile_row0,
                                          int head, int m_start) {
  const std::int64_t row = tile_row0 + m_start;  // a multiple of kBlockM
  return dq_accum + (row * p.heads + std::int64_t(head) * kBlockM) * kHeadDim;
}

// Floats per dQ reduction instruction (see the top of the file). Device code only: the main kernel
// and the postprocess are compiled for the same architecture, so they agree on the layout.
template <int kHeadDim>
__device__ constexpr int dq_vec() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return bwd_tuning(kHeadDim).dq_vec_sm90;
#else
  return 1;
#endif
}

// Where element e of thread tid's dQ fragment sits in its tile.
template <int kNThreads, int kVec>
__device__ __forceinline__ int dq_index(int e, int tid) {
  return (e / kVec) * (kVec * kNThreads) + kVec * tid + e % kVec;
}

// dst[0, kVec) += v[0, kVec), relaxed, no value returned (REDG).
template <int kVec>
__device__ __forceinline__ void dq_reduce(float* dst, const float* v) {
  if constexpr (kVec == 4) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(v[0]), "f"(v[1]), "f"(v[2]),
                 "f"(v[3]));
  } else {
    static_assert(kVec == 1);
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(dst), "f"(v[0]));
  }
}

// The deterministic turns (see the top of the file): an acquire load and a release increment at
// GPU scope.
__device__ __forceinline__ int load_acquire(const int* counter) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(counter) : "memory");
  return value;
}
__device__ __forceinline__ void increment_release(int* counter) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}

// --- preprocess -----------------------------------------------------------------------------------
// Grid (⌈max_seqlen_q / kBwdBlockM⌉, heads, batch), kBwdThreads threads: groups of kHeadDim / 8
// lanes (at most a warp) take a row each, 8 consecutive columns of dO and O per lane, all of a
// thread's rows loaded at once (device::SoftmaxDRows).
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kBwdThreads)
    bwd_preprocess_kernel(const __grid_constant__ common::AttentionParams p) {
  if (p.index_check_failed()) return;  // a bad index value (src/cuda/index_check.h): touch nothing
  const int head = blockIdx.y, batch = blockIdx.z;
  const int seqlen_q = p.seqlen_q(batch);
  const device::SoftmaxDRows<Element, kHeadDim, kBwdThreads, kBwdBlockM> rows(p, batch, head,
                                                                            blockIdx.x * kBwdBlockM, seqlen_q);
  if (!rows.writer()) return;
  CUTE_UNROLL
  for (int r = 0; r < rows.kPasses; ++r) {
    if (rows.row(r) < seqlen_q) p.softmax_d[p.lse_index(batch, head, rows.row(r))] = rows.dot[r];
  }
}

// --- postprocess ----------------------------------------------------------------------------------
// Grid (⌈max_seqlen_q / kBlockM⌉, heads, batch), the main kernel's threads: thread t reads its
// fragment of the tile (coalesced) and the block writes it through shared memory
// (device::StagedDq).
template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads)
    bwd_postprocess_kernel(const __grid_constant__ common::AttentionParams p, float* dq_accum) {
  if (p.index_check_failed()) return;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  using Staged = device::StagedDq<Element, kBlockM, kHeadDim, Traits::kNThreads>;
  __shared__ alignas(16) std::uint16_t staged_tile[Staged::kElems];
  const Staged staged{staged_tile};
  const int head = blockIdx.y, batch = blockIdx.z, tid = threadIdx.x;
  const int m_start = blockIdx.x * kBlockM;
  const int seqlen_q = p.seqlen_q(batch);
  if (m_start >= seqlen_q) return;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor cdQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor cdQ_rc = make_tensor(cdQ.data(), rowcol_layout(cdQ.layout()));
  Tensor acc = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  const float* tile = dq_tile<kBlockM, kHeadDim>(p, dq_accum, dq_tile_row0(p, batch), head, m_start);
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) acc(e) = tile[dq_index<Traits::kNThreads, dq_vec<kHeadDim>()>(e, tid)];
  Tensor acc_rc = make_tensor(acc.data(), rowcol_layout(acc.layout()));
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(acc_rc); ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(acc_rc); ni += 2) {
      staged.put(get<0>(cdQ_rc(mi, ni)), get<1>(cdQ_rc(mi, ni)), acc_rc(mi, ni), acc_rc(mi, ni + 1));
    }
  }
  staged.write(p, batch, head, m_start, seqlen_q);
}

// --- the main kernel ------------------------------------------------------------------------------
//
// Grid (⌈max_seqlen_k / kBlockN⌉, heads_k, batch), key block fastest (deterministic ordering, see
// the top of the file). counters: nullptr unless deterministic. rng_state: optional device
// {seed, offset}. kScoreModAndDropout as in the forward; kScoreMod: softcap and ALiBi compiled into
// the plain variant (bwd_tuning's plain_scoremod).
template <class Traits, bool kScoreModAndDropout, bool kScoreMod = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    bwd_kernel(const __grid_constant__ common::AttentionParams p, float* dq_accum, int* counters, int m_blocks,
               const std::uint64_t* rng_state) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  if (p.index_check_failed()) return;
  static_assert(Traits::kPairedN || !kScoreModAndDropout, "dropout runs on paired S/dP tiles");

  const int n_block = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const int tid = threadIdx.x;

  const int seqlen_q = p.seqlen_q(batch);
  const int seqlen_k = p.seqlen_k(batch);
  const int n_start = n_block * kBlockN;
  if (n_start >= seqlen_k) return;  // varlen: this sequence is shorter than the grid
  const int keys_here = min(kBlockN, seqlen_k - n_start);

  const common::Mask mask = p.mask(batch);
  // Row blocks with a row that sees one of this block's keys.
  const int row_begin = mask.block_row_begin(n_start);
  const int row_end = mask.block_row_end(n_start + keys_here);
  const int m_block_min = row_begin / kBlockM;
  const int m_block_max = row_begin < row_end ? (row_end + kBlockM - 1) / kBlockM : m_block_min;

  extern __shared__ __align__(128) char smem[];
  char* smem_at = smem;
  auto carve = [&](int bytes) {
    char* ptr = smem_at;
    smem_at += bytes;
    return ptr;
  };
  // Stage s of Q / dO sits kStageElems elements after stage 0 (a whole number of swizzle periods,
  // so the swizzled layouts hold unchanged); the tensors below are stage 0.
  constexpr int kStageElems = Traits::kSmemBytesQ / int(sizeof(Element));
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(carve(Traits::kStages * Traits::kSmemBytesQ))),
                          typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(carve(Traits::kStages * Traits::kSmemBytesQ))),
                           typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(carve(Traits::kSmemBytesKV))), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(carve(Traits::kSmemBytesKV))), typename Traits::SmemLayoutKV{});
  Tensor sP = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(carve(Traits::kSmemBytesP))), typename Traits::SmemLayoutP{});
  Tensor sdS = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(carve(Traits::kSmemBytesP))), typename Traits::SmemLayoutP{});
  float* s_lse = reinterpret_cast<float*>(carve(Traits::kStages * kBlockM * int(sizeof(float))));  // lse
  float* s_d = reinterpret_cast<float*>(carve(Traits::kStages * kBlockM * int(sizeof(float))));    // softmax_d
  Tensor sQt = make_tensor(sQ.data(), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(sdO.data(), typename Traits::SmemLayoutQt{});
  Tensor sKt = make_tensor(sK.data(), typename Traits::SmemLayoutKt{});
  Tensor sPt = make_tensor(sP.data(), typename Traits::SmemLayoutPt{});
  Tensor sdSt = make_tensor(sdS.data(), typename Traits::SmemLayoutPt{});
  Tensor sQtNoSwizzle = make_tensor(make_smem_ptr(sQ.data().get()), typename Traits::SmemLayoutQtNoSwizzle{});
  Tensor sdOtNoSwizzle = make_tensor(make_smem_ptr(sdO.data().get()), typename Traits::SmemLayoutQtNoSwizzle{});
  Tensor sKtNoSwizzle = make_tensor(make_smem_ptr(sK.data().get()), typename Traits::SmemLayoutKtNoSwizzle{});
  Tensor sPtNoSwizzle = make_tensor(make_smem_ptr(sP.data().get()), typename Traits::SmemLayoutPtNoSwizzle{});
  Tensor sdStNoSwizzle = make_tensor(make_smem_ptr(sdS.data().get()), typename Traits::SmemLayoutPtNoSwizzle{});

  // K and V of this key block, once (dense and varlen: evenly spaced rows; no paging in backward).
  {
    const std::int64_t k0 = p.k_offset(p.k, batch, n_start, kv_head);
    const std::int64_t v0 = p.k_offset(p.v, batch, n_start, kv_head);
    const std::int64_t k_stride = p.k.row_stride, v_stride = p.v.row_stride;
    load_strided_tile<Traits, kBlockN>(static_cast<const Element*>(p.k.data) + k0, k_stride, sK, keys_here, p.head_dim,
                                       tid);
    load_strided_tile<Traits, kBlockN>(static_cast<const Element*>(p.v.data) + v0, v_stride, sV, keys_here,
                                       p.head_dim_v, tid);
    cp_async_fence();
  }

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);

  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  // Operand fragments and shared-memory views of every product.
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  auto copy_sdp_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_sdp);
  auto copy_sdp_b = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma_sdp);
  auto thr_copy_sdp_a = copy_sdp_a.get_thread_slice(tid);
  auto thr_copy_sdp_b = copy_sdp_b.get_thread_slice(tid);
  Tensor tSsQ = thr_copy_sdp_a.partition_S(sQ);
  Tensor tdPsdO = thr_copy_sdp_a.partition_S(sdO);
  Tensor tSsK = thr_copy_sdp_b.partition_S(sK);
  Tensor tdPsV = thr_copy_sdp_b.partition_S(sV);

  Tensor tdVrPt = thr_dkv.partition_fragment_A(sPtNoSwizzle);
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOtNoSwizzle);
  Tensor tdKrdSt = thr_dkv.partition_fragment_A(sdStNoSwizzle);
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQtNoSwizzle);
  auto copy_dkv_a = make_tiled_copy_A(typename Traits::SmemCopyAtomTransposed{}, mma_dkv);
  auto copy_dkv_b = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_dkv);
  auto thr_copy_dkv_a = copy_dkv_a.get_thread_slice(tid);
  auto thr_copy_dkv_b = copy_dkv_b.get_thread_slice(tid);
  Tensor tdVsPt = thr_copy_dkv_a.partition_S(sPt);
  Tensor tdKsdSt = thr_copy_dkv_a.partition_S(sdSt);
  Tensor tdVsdOt = thr_copy_dkv_b.partition_S(sdOt);
  Tensor tdKsQt = thr_copy_dkv_b.partition_S(sQt);

  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKtNoSwizzle);
  auto copy_dq_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_dq);
  auto copy_dq_b = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_dq);
  auto thr_copy_dq_a = copy_dq_a.get_thread_slice(tid);
  auto thr_copy_dq_b = copy_dq_b.get_thread_slice(tid);
  Tensor tdQsdS = thr_copy_dq_a.partition_S(sdS);
  Tensor tdQsKt = thr_copy_dq_b.partition_S(sKt);

  // Tile coordinates of the accumulator elements this thread holds.
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS_rc = make_tensor(cS.data(), rowcol_layout(cS.layout()));
  Tensor cdKV = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

  const bool use_dropout = kScoreModAndDropout && p.dropout_p > 0.0f;
  common::DropoutParams dropout = p.dropout;
  if (use_dropout && rng_state != nullptr) {
    dropout.seed = rng_state[0];
    dropout.offset = rng_state[1];
  }
  const int group = p.group_size();

  // The CTA's work: every (query head of the group, row block) pair, head-major; iteration `it`
  // uses buffer it % kStages. The pair steps forward by one per iteration (advance).
  const int iterations = group * (m_block_max - m_block_min);
  auto advance = [&](int& head, int& m_block) {
    if (++m_block == m_block_max) {
      m_block = m_block_min;
      ++head;
    }
  };

  // Where the rows of this sequence start, read once: in varlen mode these come from cu_seqlens_q
  // in global memory, which would otherwise be re-read on every iteration (the loop's stores and
  // atomics may alias it as far as the compiler knows). The offsets below are exactly those of
  // AttentionParams::q_offset, lse_index and dq_tile_row0.
  const std::int64_t q_row0 = p.q_row0(batch);
  const std::int64_t dq_row0 = dq_tile_row0(p, batch);
  auto row0_of = [&](const common::RowHeadTensor& t) {
    const std::int64_t batch_offset = p.is_varlen() ? 0 : std::int64_t(batch) * t.batch_stride;
    return static_cast<const Element*>(t.data) + (batch_offset + q_row0 * t.row_stride);
  };
  const Element* q_row0_ptr = row0_of(p.q);
  const Element* do_row0_ptr = row0_of(p.dout);
  const std::int64_t lse_row0 = p.is_varlen() ? q_row0 : std::int64_t(batch) * p.lse_batch_stride;
  const float* lse_row0_ptr = p.lse + lse_row0;
  const float* d_row0_ptr = p.softmax_d + lse_row0;

  // Q, dO and the row statistics of (head, m_block) into buffer `stage`: one cp.async group.
  static_assert(2 * kBlockM <= Traits::kNThreads, "one thread per row statistic");
  auto load_rows = [&](int head, int m_block, int stage) {
    const int m_start = m_block * kBlockM;
    const int rows_here = min(kBlockM, seqlen_q - m_start);
    Tensor sQ_s = make_tensor(sQ.data() + stage * kStageElems, typename Traits::SmemLayoutQ{});
    Tensor sdO_s = make_tensor(sdO.data() + stage * kStageElems, typename Traits::SmemLayoutQ{});
    // Rows of one head are evenly spaced (dense and varlen): row r at row m_start + r · row_stride.
    load_strided_tile<Traits, kBlockM>(
        q_row0_ptr + (std::int64_t(m_start) * p.q.row_stride + std::int64_t(head) * p.q.head_stride), p.q.row_stride,
        sQ_s, rows_here, p.head_dim, tid);
    load_strided_tile<Traits, kBlockM>(
        do_row0_ptr + (std::int64_t(m_start) * p.dout.row_stride + std::int64_t(head) * p.dout.head_stride),
        p.dout.row_stride, sdO_s, rows_here, p.head_dim_v, tid);
    // Threads [0, kBlockM) copy lse, threads [kBlockM, 2 · kBlockM) softmax_d (whole warps each).
    // Rows past the sequence get lse = +∞, which makes P = 0 there (their Q and dO rows are
    // zeros), and softmax_d = 0, by plain shared stores: the next barrier publishes them.
    if (tid < 2 * kBlockM) {
      const bool is_lse = tid < kBlockM;
      const int r = is_lse ? tid : tid - kBlockM;
      float* dst = (is_lse ? s_lse : s_d) + stage * kBlockM + r;
      if (r < rows_here) {
        const float* src = is_lse ? lse_row0_ptr : d_row0_ptr;
        cp_async_4(dst, src + (std::int64_t(head) * p.lse_head_stride + (m_start + r)));
      } else {
        *dst = is_lse ? kInf : 0.0f;
      }
    }
    cp_async_fence();
  };

  // One (head, row block) from buffer `stage`. kMasked (std::bool_constant): whether per-element
  // masking is compiled in. after_sdp: called once the S and dP products are issued (kLateLoad:
  // the next row block's copies).
  auto row_block = [&](int head, int m_block, int stage, auto kMasked, auto&& after_sdp) __attribute__((always_inline)) {
    const int m_start = m_block * kBlockM;
    const TileScoreMod mod(p.score_mod<float>(batch, head), kScoreModAndDropout || kScoreMod);
    const float score_to_log2 = mod.out_scale * kLog2e;
    const std::uint64_t dropout_stream = p.dropout_stream(batch, head);
    const int q_shift = stage * kStageElems;
    const float* lse_rows = s_lse + stage * kBlockM;
    const float* d_rows = s_d + stage * kBlockM;
    Tensor tSsQ_s = make_tensor(tSsQ.data() + q_shift, tSsQ.layout());
    Tensor tdPsdO_s = make_tensor(tdPsdO.data() + q_shift, tdPsdO.layout());
    Tensor tdVsdOt_s = make_tensor(tdVsdOt.data() + q_shift, tdVsdOt.layout());
    Tensor tdKsQt_s = make_tensor(tdKsQt.data() + q_shift, tdKsQt.layout());

    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    clear(acc_dp);
    gemm_ss(mma_sdp, acc_s, tSrQ, tSrK, tSsQ_s, tSsK, copy_sdp_a, copy_sdp_b, thr_copy_sdp_a, thr_copy_sdp_b);

    Tensor s = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));    // (rows, cols): scores, then Z
    Tensor dp = make_tensor(acc_dp.data(), rowcol_layout(acc_dp.layout()));  // (rows, cols): dP, then dS
    gemm_ss(mma_sdp, acc_dp, tdPrdO, tdPrV, tdPsdO_s, tdPsV, copy_sdp_a, copy_sdp_b, thr_copy_sdp_a, thr_copy_sdp_b);
    after_sdp();
    constexpr int kMmaM = decltype(size<1>(acc_s))::value;
    constexpr int kMmaN = decltype(size<2>(acc_s))::value;
    // Softcap (TileScoreMod): s becomes t = tanh(k · dot), a uniform branch around the whole tile;
    // ALiBi is added per element below, and dscore/ddot = scale · (1 − t²).
    if (mod.softcap) {
      CUTE_UNROLL
      for (int e = 0; e < size(s); ++e) s(e) = TileScoreMod::tanh(s(e) * mod.k);
    }
    // Element (mi, ni) of the row/column view is (2·m + a, 2·n + c) for MMA tile (m, n), row half
    // a and column c: the four elements of one m16n8 tile share a dropout lane.
    CUTE_UNROLL
    for (int m = 0; m < kMmaM; ++m) {
      float lse2[2], dsum[2], alibi_base[2];
      int lo[2], hi[2];
      CUTE_UNROLL
      for (int a = 0; a < 2; ++a) {
        const int row = get<0>(cS_rc(2 * m + a, 0));
        alibi_base[a] = mod.alibi_base(m_start + row, n_start + get<1>(cS_rc(0, 0)));
        lse2[a] = __fmul_rn(lse_rows[row], kLog2e);  // not contracted into the FFMA below
        dsum[a] = d_rows[row];
        lo[a] = mask.col_begin(m_start + row) - n_start;
        hi[a] = mask.col_end(m_start + row) - n_start;
      }
      static_assert(!Traits::kPairedN || kMmaN % 2 == 0, "paired MMA tiles come in pairs");
      std::uint32_t keep_bits = 0xffu;
      CUTE_UNROLL
      for (int n = 0; n < kMmaN; ++n) {
        // Paired (Traits::kPairedN): MMA tiles 2k and 2k + 1 are the two halves of one 16 × 16
        // block, the same Philox call.
        if (use_dropout && (!Traits::kPairedN || n % 2 == 0)) {
          const int i0 = m_start + get<0>(cS_rc(2 * m, 2 * n));
          const int j0 = n_start + get<1>(cS_rc(2 * m, 2 * n));
          keep_bits = common::dropout_keep_bits(dropout, dropout_stream, i0 >> 4, j0 >> 4,
                                                common::dropout_lane(i0, j0));
        }
        CUTE_UNROLL
        for (int a = 0; a < 2; ++a) {
          CUTE_UNROLL
          for (int c = 0; c < 2; ++c) {
            const int mi = 2 * m + a, ni = 2 * n + c;
            const int row = get<0>(cS_rc(mi, ni)), col = get<1>(cS_rc(mi, ni));
            float x = s(mi, ni);
            const float dscore = mod.softcap ? p.softmax_scale * (1.0f - x * x) : p.softmax_scale;
            if (mod.alibi) x = mod.add_alibi(x, alibi_base[a], col - get<1>(cS_rc(0, 0)));
            float prob = exp2_ftz(x * score_to_log2 - lse2[a]);
            if constexpr (decltype(kMasked)::value) {
              if (col < lo[a] || col >= hi[a]) prob = 0.0f;
            }
            float dprob = dp(mi, ni);
            float z = prob;
            if (use_dropout) {
              // (By coordinates: the offsets to the lane's first element would do, as in the
              // forward, but compiled to 40 more instructions here on sm_90a.)
              const bool keep = (keep_bits >> common::dropout_element(m_start + row, n_start + col)) & 1u;
              z = keep ? prob * dropout.keep_scale : 0.0f;
              dprob = keep ? dprob * dropout.keep_scale : 0.0f;
            }
            s(mi, ni) = z;
            dp(mi, ni) = prob * (dprob - dsum[a]) * dscore;
          }
        }
      }
    }
    store_pairs<Element>(s, cS_rc, sP);
    store_pairs<Element>(dp, cS_rc, sdS);
    __syncthreads();

    Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    int* counter = nullptr;
    // Deterministic mode: wait for the key blocks before this one (in key order) that meet this
    // row block.
    auto wait_turn = [&]() {
      if (counters == nullptr) return;
      counter = counters + (std::int64_t(batch) * p.heads + head) * m_blocks + m_block;
      const int rank = n_block - mask.block_col_begin(m_start) / kBlockN;
      if (tid == 0) {
        while (load_acquire(counter) != rank) __nanosleep(64);
      }
      __syncthreads();
    };
    auto pass_turn = [&]() {
      if (counter == nullptr) return;
      __syncthreads();
      if (tid == 0) increment_release(counter);
    };
    // Rows past the sequence and columns past d hold zeros (zero dS rows, zero-filled K columns):
    // the whole fragment is added, a warp's reduction instruction covering whole 128-byte lines.
    // Slices [e_begin, e_end) are whole runs of kDqVec.
    constexpr int kDqVec = dq_vec<kHeadDim>();
    auto add_dq = [&](float* tile, int e_begin, int e_end) __attribute__((always_inline)) {
      CUTE_UNROLL
      for (int e = e_begin; e < e_end; e += kDqVec) {
        float v[kDqVec];
        CUTE_UNROLL
        for (int i = 0; i < kDqVec; ++i) v[i] = acc_dq(e + i);
        dq_reduce<kDqVec>(tile + dq_index<Traits::kNThreads, kDqVec>(e, tid), v);
      }
    };
    constexpr int kDqElems = decltype(size(acc_dq))::value;
    static_assert(kDqElems % kDqVec == 0);
    // Elements per slice when the additions are spread over kSlices k-steps: whole runs.
    auto per_slice = [](int slices) { return (kDqElems / kDqVec + slices - 1) / slices * kDqVec; };

    if constexpr (Traits::kSpreadDq) {
      // dQ first; its atomics go out a slice after each k-step of the dV and dK products. The
      // __syncwarp before a slice keeps it there: without it the atomics (global) and the
      // ldmatrix reads (shared) do not alias, and all of them are scheduled in one burst right
      // after the dQ product, which stalls every warp until the burst is accepted.
      clear(acc_dq);
      gemm_ss(mma_dq, acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, copy_dq_a, copy_dq_b, thr_copy_dq_a, thr_copy_dq_b);
      wait_turn();
      float* tile = dq_tile<kBlockM, kHeadDim>(p, dq_accum, dq_row0, head, m_start);
      constexpr int kStepsV = decltype(size<2>(tdVrPt))::value;
      constexpr int kSteps = kStepsV + decltype(size<2>(tdKrdSt))::value;
      constexpr int kPerStep = per_slice(kSteps);
      gemm_ss_steps(mma_dkv, acc_dv, tdVrPt, tdVrdOt, tdVsPt, tdVsdOt_s, copy_dkv_a, copy_dkv_b, thr_copy_dkv_a,
                    thr_copy_dkv_b, [&](int k) __attribute__((always_inline)) {
                      __syncwarp();
                      add_dq(tile, min(k * kPerStep, kDqElems), min((k + 1) * kPerStep, kDqElems));
                    });
      gemm_ss_steps(mma_dkv, acc_dk, tdKrdSt, tdKrQt, tdKsdSt, tdKsQt_s, copy_dkv_a, copy_dkv_b, thr_copy_dkv_a,
                    thr_copy_dkv_b, [&](int k) __attribute__((always_inline)) {
                      __syncwarp();
                      add_dq(tile, min((kStepsV + k) * kPerStep, kDqElems), min((kStepsV + k + 1) * kPerStep, kDqElems));
                    });
      pass_turn();
    } else {
      gemm_ss(mma_dkv, acc_dv, tdVrPt, tdVrdOt, tdVsPt, tdVsdOt_s, copy_dkv_a, copy_dkv_b, thr_copy_dkv_a,
              thr_copy_dkv_b);
      gemm_ss(mma_dkv, acc_dk, tdKrdSt, tdKrQt, tdKsdSt, tdKsQt_s, copy_dkv_a, copy_dkv_b, thr_copy_dkv_a,
              thr_copy_dkv_b);
      clear(acc_dq);
      gemm_ss(mma_dq, acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, copy_dq_a, copy_dq_b, thr_copy_dq_a, thr_copy_dq_b);
      wait_turn();
      add_dq(dq_tile<kBlockM, kHeadDim>(p, dq_accum, dq_row0, head, m_start), 0, kDqElems);
      pass_turn();
    }
  };

  int head = kv_head * group, m_block = m_block_min;  // the pair of iteration `it`
  if (iterations > 0) load_rows(head, m_block, 0);
  for (int it = 0; it < iterations; ++it) {
    const int stage = Traits::kStages == 2 ? (it & 1) : 0;
    if (Traits::kStages == 1 && it > 0) {
      __syncthreads();  // every warp is done with the buffer
      load_rows(head, m_block, 0);
    }
    cp_async_wait<0>();
    __syncthreads();  // this buffer has landed everywhere; every warp is done with the other one
    auto load_next = [&]() __attribute__((always_inline)) {
      if (Traits::kStages == 2 && it + 1 < iterations) {
        int next_head = head, next_m_block = m_block;
        advance(next_head, next_m_block);
        load_rows(next_head, next_m_block, stage ^ 1);
      }
    };
    if constexpr (!Traits::kLateLoad) load_next();
    auto after_sdp = [&]() __attribute__((always_inline)) {
      if constexpr (Traits::kLateLoad) load_next();
    };
    const int m_start = m_block * kBlockM;
    const int m_end = min(m_start + kBlockM, seqlen_q);
    if (mask.block_fully_visible(m_start, m_end, n_start, n_start + kBlockN)) {
      row_block(head, m_block, stage, std::false_type{}, after_sdp);
    } else {
      row_block(head, m_block, stage, std::true_type{}, after_sdp);
    }
    advance(head, m_block);
  }

  // --- epilogue: dK and dV through shared memory (sK and sV are free now) -------------------------
  cp_async_wait<0>();  // a CTA with no row block still has its K/V copies in flight
  __syncthreads();
  Tensor sdK = make_tensor(sK.data(), typename Traits::SmemLayoutKV{});
  Tensor sdV = make_tensor(sV.data(), typename Traits::SmemLayoutKV{});
  Tensor cdKV_rc = make_tensor(cdKV.data(), rowcol_layout(cdKV.layout()));
  Tensor dk_rc = make_tensor(acc_dk.data(), rowcol_layout(acc_dk.layout()));
  Tensor dv_rc = make_tensor(acc_dv.data(), rowcol_layout(acc_dv.layout()));
  store_pairs<Element>(dk_rc, cdKV_rc, sdK);
  store_pairs<Element>(dv_rc, cdKV_rc, sdV);
  __syncthreads();
  auto* dk = static_cast<Element*>(p.dk.data);
  auto* dv = static_cast<Element*>(p.dv.data);
  write_tile<Traits, kBlockN>(sdK, keys_here, p.head_dim,
                              [&](int r) { return dk + p.k_offset(p.dk, batch, n_start + r, kv_head); }, tid);
  write_tile<Traits, kBlockN>(sdV, keys_here, p.head_dim_v,
                              [&](int r) { return dv + p.k_offset(p.dv, batch, n_start + r, kv_head); }, tid);
}

}  // namespace flashattn::cuda::sm80
