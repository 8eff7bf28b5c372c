// src/cuda/sm90/sm90_bwd_launch.cuh — the launcher of the Hopper backward: preprocess, the main
// kernel with its TMA descriptors and shared-memory opt-in, postprocess. Included by the
// instantiation files in inst/, one (dtype, head dim) each.
#pragma once

#include "cuda/device/element.cuh"
#include "cuda/device/math.cuh"
#include "cuda/dependent_launch.h"
#include "cuda/device_query.h"
#include "cuda/sm90/sm90_bwd.h"
#include "cuda/sm90/sm90_bwd_kernel.cuh"
#include "cuda/sm90/sm90_tma.cuh"

namespace flashattn::cuda::sm90 {

template <class Traits>
cudaError_t launch_bwd(const common::AttentionParams& p, const BwdScratch& ws, const std::uint64_t* rng_state,
                       cudaStream_t stream) {
  using Element = typename Traits::Element;
  BwdParams<Traits> params;
  params.p = p;
  // Dense: (seqlen, d, heads, batch). Varlen: the packed rows as one batch (BwdTile::q_row0).
  const bool varlen = p.is_varlen();
  const int rows_q = varlen ? int(p.total_q) : p.max_seqlen_q;
  const int rows_k = varlen ? int(p.total_k) : p.max_seqlen_k;
  const int batch = varlen ? 1 : p.batch;
  params.shape_q = make_shape(rows_q, p.head_dim, p.heads, batch);
  params.shape_do = make_shape(rows_q, p.head_dim_v, p.heads, batch);
  params.shape_k = make_shape(rows_k, p.head_dim, p.heads_k, batch);
  params.shape_v = make_shape(rows_k, p.head_dim_v, p.heads_k, batch);
  params.tma_q = Traits::TmaQ::make(gmem_rows<Element>(p.q, rows_q, p.head_dim, p.heads, batch));
  params.tma_do = Traits::TmadO::make(gmem_rows<Element>(p.dout, rows_q, p.head_dim_v, p.heads, batch));
  params.tma_k = Traits::TmaK::make(gmem_rows<Element>(p.k, rows_k, p.head_dim, p.heads_k, batch));
  params.tma_v = Traits::TmaV::make(gmem_rows<Element>(p.v, rows_k, p.head_dim_v, p.heads_k, batch));
  params.dq_accum = ws.dq_accum;
  params.lse_log2 = ws.lse_log2;
  params.dpsum = ws.dpsum;
  params.dq_semaphores = ws.dq_semaphores;
  const bool deterministic = ws.dq_semaphores != nullptr;  // only deterministic calls have dQ turns
  // A staggered tile may wait for one of its (kv head, batch) launched after it: bwd_stagger_tiles.
  params.stagger_tiles = deterministic ? bwd_stagger_tiles(current_sm_count()) : 0;
  params.rows = ws.rows;
  params.scale_log2 = p.softmax_scale * device::kLog2e;
  params.rng_state = rng_state;

  auto* kernel = &bwd_kernel<Traits>;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  // Key tiles fastest: under a causal mask the first (the longest: every row sees them) go first,
  // except in the deterministic order, last first; or (tile_major) key tiles slowest, every
  // (kv head, batch)'s first tile before any second one (BwdTile::of_block).
  const int n_tiles = (p.max_seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  // Blocks of this kernel resident per SM, asked once per variant (after the shared-memory opt-in).
  static const int per_sm = [&] {
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, Traits::kThreads, Traits::kSmemBytes) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return blocks;
  }();
  params.heads_inner = bwd_heads_inner(p.group_size(), deterministic);
  params.tile_major = bwd_tile_major(p.has_mask(), deterministic,
                                     (long long)n_tiles * p.heads_k * p.batch, (long long)per_sm * current_sm_count());
  const dim3 grid = params.tile_major ? dim3(unsigned(n_tiles) * unsigned(p.heads_k) * unsigned(p.batch), 1, 1)
                                      : dim3(n_tiles, p.heads_k, p.batch);
  if (bwd_dependent_launch()) return launch_as_dependent(kernel, grid, dim3(Traits::kThreads), Traits::kSmemBytes, stream, params);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

// The variants of one (dtype, head dim): which of softcap, ALiBi and dropout are compiled in
// (kMods: none, softcap alone, ALiBi alone, dropout alone where built with
// FLASHATTN_SM90_BWD_LEAN_DROPOUT=1, or all three), dense or varlen.
// kWide: bwd_tile's wide tile (plain d 128 calls without a mask, bwd_wide_rows; kBwdModNoMask).
template <class Element, int kHeadDim, int kMods, bool kVarlen, bool kWide = false>
using BwdTraitsOf = BwdTraits<Element, kHeadDim, bwd_tile(kHeadDim, kWide).block_m, bwd_tile(kHeadDim, kWide).block_n,
                              bwd_tile(kHeadDim, kWide).stages, kMods | (kWide ? kBwdModNoMask : 0), kVarlen>;

template <class Element, int kHeadDim, int kMods, bool kWide = false>
cudaError_t launch_bwd_variant(const common::AttentionParams& p, const BwdScratch& ws, const std::uint64_t* rng_state,
                               cudaStream_t stream) {
  return p.is_varlen() ? launch_bwd<BwdTraitsOf<Element, kHeadDim, kMods, true, kWide>>(p, ws, rng_state, stream)
                       : launch_bwd<BwdTraitsOf<Element, kHeadDim, kMods, false, kWide>>(p, ws, rng_state, stream);
}

// The dQ postprocess of the tile the call ran (the variants of a tile share the dQ layout).
template <class Element, int kHeadDim, bool kWide>
cudaError_t launch_bwd_postprocess(const common::AttentionParams& p, const BwdScratch& ws, cudaStream_t stream) {
  using Traits = BwdTraitsOf<Element, kHeadDim, 0, false, kWide>;
  const dim3 grid(ws.rows.padded_rows / Traits::kBlockM, p.heads, p.batch);
  if (bwd_dependent_launch()) {
    return launch_as_dependent(&bwd_postprocess_kernel<Traits>, grid, dim3(Traits::kConsumerThreads), 0, stream, p,
                               static_cast<const float*>(ws.dq_accum), ws.rows);
  }
  bwd_postprocess_kernel<Traits><<<grid, Traits::kConsumerThreads, 0, stream>>>(p, ws.dq_accum, ws.rows);
  return cudaGetLastError();
}

// The variant that serves dropout alone: its own where built with FLASHATTN_SM90_BWD_LEAN_DROPOUT=1
// (sm90_bwd.h), else the one with all three.
inline constexpr int kBwdDropoutOnly = kBwdLeanDropout ? kBwdModDropout : kBwdModsAll;

template <common::Storage kStorage, int kHeadDim>
cudaError_t run_bwd(const common::AttentionParams& p, const BwdScratch& ws, const std::uint64_t* rng_state,
                    cudaStream_t stream) {
  using Element = typename device::ElementOf<kStorage>::type;
  // The dQ accumulator is cleared by the preprocess (each block its rows), the deterministic turns'
  // semaphores here.
  cudaError_t err = cudaSuccess;
  if (ws.dq_semaphores != nullptr) err = cudaMemsetAsync(ws.dq_semaphores, 0, ws.semaphore_bytes, stream);
  if (err != cudaSuccess) return err;
  const int row_blocks = (ws.rows.padded_rows + kBwdPreRows - 1) / kBwdPreRows;
  // The workspace's row blocks say which tile bwd_wide_rows chose for the call.
  // (Not instantiated where built with FLASHATTN_SM90_BWD_WIDE_ROWS=0.)
  constexpr bool kHasWide = kBwdWideRows && bwd_tile(kHeadDim, true).block_m != bwd_tile(kHeadDim).block_m;
  const bool wide = kHasWide && ws.rows.block_m == bwd_tile(kHeadDim, true).block_m;
  if (row_blocks > 0) {
    bwd_preprocess_kernel<Element, bwd_head_dim_v(kHeadDim), kHeadDim>
        <<<dim3(row_blocks, p.heads, p.batch), kBwdPrepostThreads, 0, stream>>>(p, ws.lse_log2, ws.dpsum, ws.dq_accum,
                                                                               ws.rows);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (p.max_seqlen_k > 0) {
    const int mods = (p.softcap > 0.0f ? kBwdModSoftcap : 0) | (p.alibi_slopes != nullptr ? kBwdModAlibi : 0) |
                     (p.dropout_p > 0.0f ? kBwdModDropout : 0);
    err = wide                     ? launch_bwd_variant<Element, kHeadDim, 0, kHasWide>(p, ws, rng_state, stream)
          : mods == 0              ? launch_bwd_variant<Element, kHeadDim, 0>(p, ws, rng_state, stream)
          : mods == kBwdModSoftcap ? launch_bwd_variant<Element, kHeadDim, kBwdModSoftcap>(p, ws, rng_state, stream)
          : mods == kBwdModAlibi   ? launch_bwd_variant<Element, kHeadDim, kBwdModAlibi>(p, ws, rng_state, stream)
          : mods == kBwdModDropout ? launch_bwd_variant<Element, kHeadDim, kBwdDropoutOnly>(p, ws, rng_state, stream)
                                   : launch_bwd_variant<Element, kHeadDim, kBwdModsAll>(p, ws, rng_state, stream);
    if (err != cudaSuccess) return err;
  }
  if (row_blocks > 0) {
    err = wide ? launch_bwd_postprocess<Element, kHeadDim, kHasWide>(p, ws, stream)
               : launch_bwd_postprocess<Element, kHeadDim, false>(p, ws, stream);
  }
  return err;
}

}  // namespace flashattn::cuda::sm90
