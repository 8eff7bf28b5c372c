// src/cuda/sm80/sm80_bwd.h — the compiled sm80 backward kernels as the dispatcher sees them: one
// launcher per (storage type, instantiated head dim), defined in inst/*.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/params.h"
#include "cuda/sm80/sm80_tuning.h"

namespace flashattn::cuda::sm80 {

// Rows per preprocess block and the unit of the deterministic counters (per (batch, head, row block)).
inline constexpr int kBwdRowBlock = 64;
// Sequences start on a multiple of this many rows in the dQ accumulator (sm80_bwd_kernel.cuh).
inline constexpr int kBwdTileRowsHost = 128;

// Tiles per head dim: bwd_tuning (sm80_tuning.h). The plain variant's are FA2's for 8 warps; with
// softcap / ALiBi / dropout compiled in (full) they shrink, for the per-element dscore and the
// Philox state: d 64 to 64 × 128, d 128 stays 64 × 128, d 256 to 64 × 32. small: the d 128 full
// variant's one-stage fallback (64 × 64) for GPUs whose shared memory its 128-key tile exceeds
// (bwd_has_small, bwd_choice); elsewhere the full tile.
constexpr bool bwd_has_small(int head_dim) { return bwd_tuning(head_dim).small_tile.block_n > 0; }
constexpr BwdTile bwd_tile(int head_dim, bool full, bool small = false) {
  return !full                                 ? bwd_tuning(head_dim).plain_tile
         : small && bwd_has_small(head_dim) ? bwd_tuning(head_dim).small_tile
                                            : bwd_tuning(head_dim).full_tile;
}

// Shared memory of a backward tile, in bytes (BwdTraits::kSmemBytes, checked there): `stages`
// buffers of the Q and dO tiles and their row statistics (lse, softmax_d), the K and V tiles, and
// the P and dS tiles.
constexpr int bwd_smem_bytes(int head_dim, BwdTile t, int stages) {
  return stages * (2 * t.block_m * head_dim * 2 + 2 * t.block_m * 4) + 2 * t.block_n * head_dim * 2 +
         2 * t.block_m * t.block_n * 2;
}

// The launcher takes the first configuration that fits a block's shared memory on the device
// (sm80_smem.h): the plain variant with 2 stages, then with 1 stage (d 256), then the full variant
// (whose softcap, ALiBi and dropout are off at run time when p has none) with 2 stages, then with
// 1 (d ≥ 128), then (d 128, bwd_has_small) a 64 × 64 full tile with 1 stage. Per block: d 64 162 /
// 97 KiB (plain / full, 2 stages); d 128 161 / 161 / 128.5 (full 1 stage) / 80.5 (the small tile);
// d 256 209 / 144.5 (plain 1 stage) / 169 / 104.5 — so an H100 runs every plain tile, an A100
// (163 KiB) all but d 256's second stage, and the 99 KiB GPUs (sm86/sm89) d 64, d 128 through the
// small tile and no d 256 backward.
constexpr bool bwd_has_one_stage(int head_dim, bool full) {
  return full ? bwd_tuning(head_dim).full_one_stage : bwd_tuning(head_dim).plain_one_stage;
}
constexpr int bwd_min_smem_bytes(int head_dim) {
  return bwd_smem_bytes(head_dim, bwd_tile(head_dim, true, bwd_has_small(head_dim)),
                        bwd_has_one_stage(head_dim, true) ? 1 : 2);
}

// The configuration the launcher runs: the first of that order that fits `smem_limit` bytes
// (needs_full: p has softcap, ALiBi or dropout and must run the full variant). Where nothing fits
// (bwd_min_smem_bytes > smem_limit) it names the smallest; can_serve_backward refuses those calls.
struct BwdChoice {
  bool full;
  int stages;
  bool small = false;  // bwd_tile's small fallback (one stage)
};
constexpr BwdChoice bwd_choice(int head_dim, bool needs_full, int smem_limit) {
  if (!needs_full) {
    if (bwd_smem_bytes(head_dim, bwd_tile(head_dim, false), 2) <= smem_limit) return {false, 2};
    if (bwd_has_one_stage(head_dim, false) && bwd_smem_bytes(head_dim, bwd_tile(head_dim, false), 1) <= smem_limit) {
      return {false, 1};
    }
  }
  if (!bwd_has_one_stage(head_dim, true) || bwd_smem_bytes(head_dim, bwd_tile(head_dim, true), 2) <= smem_limit) {
    return {true, 2};
  }
  if (bwd_has_small(head_dim) && bwd_smem_bytes(head_dim, bwd_tile(head_dim, true), 1) > smem_limit) {
    return {true, 1, true};
  }
  return {true, 1};
}

// Where the backward's scratch lives (device memory from the caller's workspace).
struct BwdScratch {
  float* dq_accum = nullptr;  // fp32 tiles of kBlockM rows × the instantiated head dim, per head
  std::size_t dq_accum_bytes = 0;
  int* counters = nullptr;    // (batch, heads, m_blocks) int32; nullptr unless deterministic
  std::size_t counter_bytes = 0;
  int m_blocks = 0;           // ⌈max_seqlen_q / kBwdRowBlock⌉
};

// Launches preprocess, main kernel and postprocess on stream. Returns the first launch error.
template <common::Storage kStorage, int kHeadDim>
cudaError_t run_bwd(const common::AttentionParams& p, const BwdScratch& scratch, const std::uint64_t* rng_state,
                    cudaStream_t stream);

}  // namespace flashattn::cuda::sm80
