// src/cuda/sm90/sm90_fwd_launch.cuh — the launcher of the Hopper forward kernel: TMA descriptors
// of Q, K and V from the call's strides, the grid, the shared-memory opt-in. Included by the
// instantiation files in inst/, one (dtype, head dim) each.
#pragma once

#include <cmath>

#include "cuda/device/element.cuh"
#include "cuda/device/math.cuh"
#include "cuda/device_query.h"
#include "cuda/sm90/sm90_fwd.h"
#include "cuda/sm90/sm90_fwd_kernel.cuh"
#include "cuda/sm90/sm90_tma.cuh"

namespace flashattn::cuda::sm90 {

using device::ElementOf;

// One launch of the kernel of Traits: TMA descriptors, shared memory, the persistent grid.
template <class Traits>
cudaError_t launch_fwd(const common::AttentionParams& p, const SplitKvPartials& split, const std::uint64_t* rng_state,
                       cudaStream_t stream) {
  constexpr int kHeadDim = Traits::kHeadDim;
  using Element = typename Traits::Element;
  // The host's view (fwd_unsupported checks out for the TMA store) agrees with the kernel's.
  static_assert(Traits::kTmaStoreO ==
                (fwd_tma_store(kHeadDim, Traits::kScoreMod) && !Traits::kVarlen && !Traits::kSplit));
  static_assert(Traits::kSeparateO ==
                !fwd_o_in_q(kHeadDim, FwdTileShape{Traits::kBlockM, Traits::kBlockN, Traits::kStages}));
  FwdParams<Traits> params;
  params.p = p;
  if constexpr (Traits::kSplit) params.split = split;
  const int splits = Traits::kSplit ? split.num_splits : 1;
  // Dense: (seqlen, d, heads, batch). Varlen: the packed rows as one batch (FwdTile::q_row0). A
  // KV cache: (capacity, d, heads_k, the cache's batches).
  const bool varlen = p.is_varlen();
  const int rows_q = varlen ? int(p.total_q) : p.max_seqlen_q;
  const int rows_k = varlen ? int(p.total_k) : p.max_seqlen_k;
  const int batch = varlen ? 1 : p.batch;
  const int batch_k = varlen ? 1 : int(p.cache_batches > 0 ? p.cache_batches : p.batch);
  // A paged cache: (page rows, d, heads_k, pages), one page per "batch" (its batch stride).
  const int rows_kv = Traits::kPaged ? p.page_size : rows_k;
  const int batch_kv = Traits::kPaged ? int(p.cache_batches) : batch_k;
  params.shape_q = make_shape(rows_q, p.head_dim, p.heads, batch);
  params.shape_k = make_shape(rows_kv, p.head_dim, p.heads_k, batch_kv);
  params.shape_v = make_shape(rows_kv, p.head_dim_v, p.heads_k, batch_kv);
  params.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gmem_rows<Element>(p.q, rows_q, p.head_dim, p.heads, batch),
                               typename Traits::SmemLayoutQ{}, Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{}, _1{});
  params.tma_k = Traits::make_tma_k(gmem_rows<Element>(p.k, rows_kv, p.head_dim, p.heads_k, batch_kv));
  params.tma_v = Traits::make_tma_v(gmem_rows<Element>(p.v, rows_kv, p.head_dim_v, p.heads_k, batch_kv));
  params.wide_pages = false;
  if constexpr (Traits::kWideChunks) {
    static_assert(Traits::kPageWideRows == 64, "fwd_page_box_rows speaks of 64-row boxes");
    params.wide_pages = fwd_page_box_rows(p.page_size) == Traits::kPageWideRows;
    if (params.wide_pages) {
      params.tma_k_wide = Traits::make_tma_kv_wide(gmem_rows<Element>(p.k, rows_kv, p.head_dim, p.heads_k, batch_kv));
      params.tma_v_wide = Traits::make_tma_kv_wide(gmem_rows<Element>(p.v, rows_kv, p.head_dim_v, p.heads_k, batch_kv));
    }
  }
  if constexpr (Traits::kTmaStoreO) {
    params.shape_o = make_shape(rows_q, p.head_dim_v, p.heads, batch);
    params.tma_o = make_tma_copy(SM90_TMA_STORE{}, gmem_rows<Element>(p.out, rows_q, p.head_dim_v, p.heads, batch),
                                 typename Traits::SmemLayoutO{}, Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDimV>>{},
                                 _1{});
  }
  params.scale_log2 = p.softmax_scale * device::kLog2e;
  params.rng_state = rng_state;
  params.snake = fwd_snake_walk() && p.has_mask();
  const int sms = current_sm_count();
  const FwdSections sections = fwd_l2_sections(p, Traits::kBlockM, sms);
  params.section = sections.pairs;
  params.section_rising = common::MaskedTileOrder::rising_parity_of(p.heads * p.batch, sections.pairs, sections.alternate);
  params.tile_counter = fwd_tile_counter(p, stream);
  if constexpr (Traits::kFastDivmod) params.divisors = FwdTileDivisors::make(p, Traits::kBlockM, sections.pairs, splits);

  auto* kernel = &fwd_kernel<Traits>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid = PersistentTileScheduler<Traits::kBlockM, Traits::kBlockN>::grid(p, sms, splits);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

// The variants of one (dtype, head dim): softcap / ALiBi / dropout compiled in or not (with them,
// the warpgroups take turns at d ≤ 128: fwd_pingpong), dense or varlen (seqused_k included) — the
// dense kernels carry none of the varlen code — and, built with FLASHATTN_SM90_FWD_PAGED, paged.
// V and O have fwd_head_dim_v(kHeadDim) columns. Built with FLASHATTN_SM90_FWD_SPLIT, split-KV
// kernels too (varlen ones, which serve dense calls as well), plain or paged.
template <class Element, int kHeadDim, bool kScoreMod, bool kVarlen, bool kPaged = false, bool kSplit = false>
using FwdTraitsOf = FwdTraits<Element, kHeadDim, fwd_tile(kHeadDim).block_m, fwd_tile(kHeadDim).block_n,
                              fwd_tile(kHeadDim).stages, fwd_pingpong(kHeadDim, kScoreMod), kScoreMod, kVarlen, kPaged,
                              fwd_head_dim_v(kHeadDim), kSplit>;

template <common::Storage kStorage, int kHeadDim>
cudaError_t run_fwd(const common::AttentionParams& p, const SplitKvPartials& split, const std::uint64_t* rng_state,
                    cudaStream_t stream) {
  using Element = typename ElementOf<kStorage>::type;
  const bool score_mod = fwd_score_mod(p);
  const bool varlen = fwd_varlen_kernel(p);
  if constexpr (kFwdSplit) {
    if (split.num_splits > 1) {
      if constexpr (kFwdPaged) {
        if (p.is_paged()) {
          return score_mod
                     ? launch_fwd<FwdTraitsOf<Element, kHeadDim, true, true, true, true>>(p, split, rng_state, stream)
                     : launch_fwd<FwdTraitsOf<Element, kHeadDim, false, true, true, true>>(p, split, rng_state, stream);
        }
      }
      if (p.is_paged()) return cudaErrorNotSupported;  // fwd_unsupported declines such calls
      return score_mod
                 ? launch_fwd<FwdTraitsOf<Element, kHeadDim, true, true, false, true>>(p, split, rng_state, stream)
                 : launch_fwd<FwdTraitsOf<Element, kHeadDim, false, true, false, true>>(p, split, rng_state, stream);
    }
  }
  if constexpr (kFwdPaged) {
    if (p.is_paged()) {
      return score_mod ? launch_fwd<FwdTraitsOf<Element, kHeadDim, true, true, true>>(p, split, rng_state, stream)
                       : launch_fwd<FwdTraitsOf<Element, kHeadDim, false, true, true>>(p, split, rng_state, stream);
    }
  }
  if (p.is_paged()) return cudaErrorNotSupported;  // fwd_unsupported declines such calls
  if constexpr (kHeadDim == 64 && kFwdD64Tall) {
    if (fwd_d64_tall(p, split.num_splits)) {
      constexpr FwdTileShape t = kFwdD64TallTile;
      return launch_fwd<FwdTraits<Element, 64, t.block_m, t.block_n, t.stages, false, false, false>>(p, split,
                                                                                                  rng_state, stream);
    }
  }
  if constexpr (kHeadDim == 256 && kFwdD256Wide) {
    if (fwd_d256_wide(p, split.num_splits)) {
      constexpr FwdTileShape t = kFwdD256WideTile;
      return launch_fwd<FwdTraits<Element, 256, t.block_m, t.block_n, t.stages, false, false, false>>(p, split,
                                                                                                   rng_state, stream);
    }
  }
  if (score_mod) {
    return varlen ? launch_fwd<FwdTraitsOf<Element, kHeadDim, true, true>>(p, split, rng_state, stream)
                  : launch_fwd<FwdTraitsOf<Element, kHeadDim, true, false>>(p, split, rng_state, stream);
  }
  return varlen ? launch_fwd<FwdTraitsOf<Element, kHeadDim, false, true>>(p, split, rng_state, stream)
                : launch_fwd<FwdTraitsOf<Element, kHeadDim, false, false>>(p, split, rng_state, stream);
}

}  // namespace flashattn::cuda::sm90
