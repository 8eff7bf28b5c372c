// src/cuda/sm80/sm80_fwd_launch.cuh — the kernel configuration per head dim (tiles from
// sm80_tuning.h) and the launchers of the sm80 forward kernel, plain and split-KV. Included by the
// instantiation files in inst/, one (dtype, head dim, plain or split) each.
#pragma once

#include "cuda/dependent_launch.h"
#include "cuda/device/element.cuh"
#include "cuda/device_query.h"
#include "cuda/index_check.h"
#include "cuda/sm80/sm80_fwd.h"
#include "cuda/sm80/sm80_fwd_kernel.cuh"
#include "cuda/sm80/sm80_smem.h"
#include "cuda/smem_opt_in.h"

namespace flashattn::cuda::sm80 {

using device::ElementOf;

// The kernel of one (dtype, head dim, variant), its tiles from the head dim's tuning table
// (fwd_tuning, sm80_tuning.h, through fwd_tile, fwd_tile_packed and fwd_short_* of sm80_fwd.h).
// With softcap / ALiBi / dropout compiled in (kFull), the key tile is halved: the Philox state and
// per-element coordinates need the registers that half of the score tile gave back.
template <class Element, int kHeadDim, bool kFull>
struct FwdConfig {
  static constexpr FwdTile kTile = fwd_tile(kHeadDim, kFull);
  using Traits = FwdTraits<Element, kHeadDim, kTile.block_m, kTile.block_n, kTile.warps>;
  static constexpr FwdTile kPackedTile = fwd_tile_packed(kHeadDim);
  using PackedTraits = FwdTraits<Element, kHeadDim, kPackedTile.block_m, kPackedTile.block_n, kPackedTile.warps>;
  // Short sequences (fwd_runs_short; instantiated only where fwd_has_short_tile).
  static constexpr FwdTile kShortTile = fwd_short_tile(kHeadDim);
  using ShortTraits = FwdTraits<Element, kHeadDim, kShortTile.block_m, kShortTile.block_n, kShortTile.warps,
                                fwd_short_min_blocks(kHeadDim)>;
  static_assert(Traits::kSmemBytes == fwd_smem_bytes(kHeadDim, kTile) &&
                    PackedTraits::kSmemBytes == fwd_smem_bytes(kHeadDim, kPackedTile),
                "fwd_smem_bytes (host side) agrees with the kernel's shared memory");
};

// Whether a paged call's forward may run beside its index check kernel (kPagedCheckOverlap): a
// KV-cache call, whose only index the kernel reads before the check is done is its key count
// (clamped there), on a GPU with programmatic dependent launches (sm_90).
inline bool paged_check_overlaps(const common::IndexBounds& ib) {
  return ib.cu_seqlens_q == nullptr && ib.cu_seqlens_k == nullptr && ib.seqused_k == nullptr &&
         ib.cache_batch_idx == nullptr && ib.cache_leftpad == nullptr && ib.cache_seqlens != nullptr &&
         current_compute_capability() >= 90;
}

// One launch of fwd_kernel<KTraits, …>: grid (row blocks [× splits], heads / pack, batch).
template <class KTraits, bool kFull, bool kSplit, bool kPaged, bool kPacked>
cudaError_t launch_fwd_grid(const common::AttentionParams& p, const SplitKvPartials& split,
                            const std::uint64_t* rng_state, int pack, cudaStream_t stream) {
  constexpr int kDefaultSmemLimit = 48 * 1024;  // above this a kernel must opt in
  auto* kernel = &fwd_kernel<KTraits, kFull, kSplit, kPaged, kPacked, !kFull && !kPacked && kPlainScoreMod>;
  // Pages of fewer than 16 rows: more page-table entries per tile (FwdTraits::kPageSlotsSmall).
  const bool small_pages = kPaged && p.page_size < 16;
  const int smem = KTraits::kSmemBytes + (small_pages ? KTraits::kSmemBytesPagesSmall : 0);
  if (smem > kDefaultSmemLimit) {
    static SmemOptInFlags opted_in, opted_in_small;  // this instantiation's kernel, per device and size
    const cudaError_t err = opt_in_dynamic_smem(kernel, smem, small_pages ? opted_in_small : opted_in);
    if (err != cudaSuccess) return err;
  }
  const int m_blocks = (p.max_seqlen_q * pack + KTraits::kBlockM - 1) / KTraits::kBlockM;
  const dim3 grid(kSplit ? m_blocks * split.num_splits : m_blocks, p.heads / pack, p.batch);
  // A paged call's folded index check: only the packed split kernel checks it (fwd_kernel); ahead
  // of the other paged kernels it runs as a kernel of its own.
  if constexpr (kPaged && !(kSplit && kPacked)) {
    if (p.index_fold.active()) {
      common::AttentionParams unfolded = p;
      unfolded.index_fold = {};
      check_indices(p.index_fold.bounds, stream);
      if constexpr (kPagedCheckOverlap) {
        if (paged_check_overlaps(p.index_fold.bounds)) {
          // Beside the check (its programmatic dependent, sm_90): the bounds stay for the key
          // count's clamp, the fold inactive; the kernel waits for the check (as its last key
          // tile starts) before it stores anything.
          unfolded.index_fold.bounds = p.index_fold.bounds;
          return launch_as_dependent(kernel, grid, dim3(KTraits::kNThreads), std::size_t(smem), stream, unfolded,
                                     split, rng_state, pack, index_error_flag());
        }
      }
      kernel<<<grid, KTraits::kNThreads, smem, stream>>>(unfolded, split, rng_state, pack, nullptr);
      return cudaGetLastError();
    }
  }
  kernel<<<grid, KTraits::kNThreads, smem, stream>>>(p, split, rng_state, pack, nullptr);
  return cudaGetLastError();
}

// kSplit: the split-KV variant (grid.x = row blocks × splits, partials into `split`).
// GQA-packed launches (pack > 1, plain variant only) take the kPacked kernel and its tile.
template <class Config, bool kFull, bool kSplit, bool kPaged>
cudaError_t launch_fwd_kernel(const common::AttentionParams& p, const SplitKvPartials& split,
                              const std::uint64_t* rng_state, cudaStream_t stream) {
  const int pack = kFull ? 1 : fwd_pack(p, Config::Traits::kBlockM);
  if constexpr (!kFull) {
    if (pack > 1) {
      return launch_fwd_grid<typename Config::PackedTraits, false, kSplit, kPaged, true>(p, split, rng_state, pack,
                                                                                         stream);
    }
    if constexpr (!kSplit && !kPaged && fwd_has_short_tile(Config::Traits::kHeadDim)) {
      static_assert(Config::ShortTraits::kSmemBytes == fwd_smem_bytes(Config::Traits::kHeadDim, Config::kShortTile));
      if (fwd_runs_short(p, Config::Traits::kHeadDim)) {
        return launch_fwd_grid<typename Config::ShortTraits, false, false, false, false>(p, split, rng_state, 1,
                                                                                          stream);
      }
    }
  }
  return launch_fwd_grid<typename Config::Traits, kFull, kSplit, kPaged, false>(p, split, rng_state, 1, stream);
}

// The paged (block_table) and the dense/varlen kernels are separate instantiations.
template <class Config, bool kFull, bool kSplit>
cudaError_t launch_fwd(const common::AttentionParams& p, const SplitKvPartials& split, const std::uint64_t* rng_state,
                       cudaStream_t stream) {
  return p.is_paged() ? launch_fwd_kernel<Config, kFull, kSplit, true>(p, split, rng_state, stream)
                      : launch_fwd_kernel<Config, kFull, kSplit, false>(p, split, rng_state, stream);
}

template <common::Storage kStorage, int kHeadDim>
cudaError_t run_fwd(const common::AttentionParams& p, const std::uint64_t* rng_state, cudaStream_t stream) {
  using Element = typename ElementOf<kStorage>::type;
  const bool full = fwd_runs_full(p, kHeadDim, smem_per_block_limit());
  return full ? launch_fwd<FwdConfig<Element, kHeadDim, true>, true, false>(p, {}, rng_state, stream)
              : launch_fwd<FwdConfig<Element, kHeadDim, false>, false, false>(p, {}, rng_state, stream);
}

template <common::Storage kStorage, int kHeadDim>
cudaError_t run_fwd_split(const common::AttentionParams& p, const SplitKvPartials& split,
                          const std::uint64_t* rng_state, cudaStream_t stream) {
  using Element = typename ElementOf<kStorage>::type;
  const bool full = fwd_runs_full(p, kHeadDim, smem_per_block_limit());
  return full ? launch_fwd<FwdConfig<Element, kHeadDim, true>, true, true>(p, split, rng_state, stream)
              : launch_fwd<FwdConfig<Element, kHeadDim, false>, false, true>(p, split, rng_state,
                                                                                             stream);
}

}  // namespace flashattn::cuda::sm80
