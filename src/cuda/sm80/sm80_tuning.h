// src/cuda/sm80/sm80_tuning.h — the tuning tables of the sm80 family: per head dim, the tile shapes,
// warp arrangements and schedule flags of the forward (fwd_tuning) and of the backward
// (bwd_tuning), chosen by pure constexpr functions that the launch headers (sm80_fwd_launch.cuh,
// sm80_bwd_launch.cuh), the kernels and the host-side helpers (sm80_fwd.h, sm80_bwd.h) all read.
// tests/cuda/test_cuda_sm80_tuning.cpp checks the entries; src/cuda/README.md ("Tuning knobs") has
// the measurements behind them.
//
// A head dim runs in the bucket of the instantiated head dim above it: ≤ 64, ≤ 128, ≤ 256.
//
// The entries are the measured-best defaults. For A/B timing (scripts/gpu-variants), compile
// definitions FLASHATTN_SM80_<knob> override single entries here, and only here (the list at each
// function's end); a build without them is the default.
#pragma once

#include "common/macros.h"

namespace flashattn::cuda::sm80 {

// Tile of one forward CTA: block_m query rows × block_n keys per step, `warps` warps.
struct FwdTile {
  int block_m;
  int block_n;
  int warps;
};

// The forward of one head-dim bucket.
struct Sm80FwdTuning {
  // plain: the common kernel (no softcap / ALiBi / dropout compiled in). full: with them compiled
  // in, the key tile halved for the Philox state and the per-element coordinates. packed: the
  // GQA-packed kernel (decoding: a few packed rows against a long cache), 64 packed rows and
  // 128-key tiles at d ≤ 128 so that each CTA has twice the K/V bytes in flight per step and
  // computes half the idle query rows. short_tile: the plain kernel's tile where each row sees at
  // most short_keys keys (0: no short tile), its registers capped for short_min_blocks CTAs per SM
  // (1: no cap).
  FwdTile plain;
  FwdTile full;
  FwdTile packed;
  FwdTile short_tile;
  int short_keys;
  int short_min_blocks;
  // Interleaved partial chains of each row's max and sum over a key tile (1: left to right).
  int row_chains;
  // The plain variant rescales O after the row loop, skipping a block's first key tile (O is
  // still zero there), instead of row by row inside the loop. The full variant always does.
  bool first_tile_branch;
  // The V load of a block's first key tile issued in the prologue beside Q and K.
  bool early_v;
  // O rescaled only where the tile raised some row's max in the warp (implies first_tile_branch).
  bool lazy_rescale;
  // Softcap and ALiBi compiled into the plain variant (only dropout takes the full variant).
  // Family-wide: the same in every bucket.
  bool plain_scoremod;
  // A paged KV-cache call whose index check runs as a kernel of its own (every paged kernel but
  // the packed split one, which folds it): on sm_90 the forward is launched as its programmatic
  // dependent, running beside the check with its key count clamped into the block_table row and
  // its page numbers into the cache, and waits for the check (griddepcontrol.wait) and reads its
  // flag as its last key tile starts (no store when it is set). Family-wide.
  bool paged_check_overlap;
};

FA_HOST_DEVICE constexpr Sm80FwdTuning fwd_tuning(int head_dim) {
  // d 64:  128 × 128, 4 warps —  48 KiB shared (Q 16 + K 16 + V 16)
  // d 128: 128 × 64,  4 warps —  64 KiB: 32 rows per warp keeps the 128 fp32 of O in registers
  // d 256: 128 × 64,  8 warps — 128 KiB: 16 rows per warp, as the O accumulator doubles
  // All plain tiles fit the 163 KiB of an A100 and the 227 KiB of an H100/H200; where one does not
  // fit (d 256 on 99 KiB GPUs), fwd_runs_full takes the full variant's (96 KiB).
  // Short tiles: d 256 64 × 64 (96 KiB, two CTAs per SM on an H100/H200) up to 4096 keys per row;
  // d 64 / d 128 64 × 64 (24 / 48 KiB), capped for 4 / 3 CTAs per SM (sm_90a: 128 / 168
  // registers, no spills), up to 384 keys per row.
  Sm80FwdTuning t = head_dim <= 64
                        ? Sm80FwdTuning{{128, 128, 4}, {128, 64, 4}, {64, 128, 4}, {64, 64, 4}, 384, 4, 1, false,
                                        true, false, false, true}
                    : head_dim <= 128
                        ? Sm80FwdTuning{{128, 64, 4}, {128, 32, 4}, {64, 128, 4}, {64, 64, 4}, 384, 3, 4, true,
                                        true, false, false, true}
                        : Sm80FwdTuning{{128, 64, 8}, {128, 32, 8}, {64, 64, 4}, {64, 64, 4}, 4096, 1, 1, false,
                                        true, false, false, true};
  // --- overrides for A/B timing (scripts/gpu-variants) ---
#ifdef FLASHATTN_SM80_FWD64_BLOCK_N
  if (head_dim <= 64) t.plain.block_n = FLASHATTN_SM80_FWD64_BLOCK_N;
#endif
#ifdef FLASHATTN_SM80_FWD64_WARPS
  if (head_dim <= 64) t.plain.warps = FLASHATTN_SM80_FWD64_WARPS;
#endif
#ifdef FLASHATTN_SM80_FWD256_BLOCK_M  // 128 (8 warps) or 64 (4 warps: two CTAs per SM on an H100)
  if (head_dim > 128) t.plain = FwdTile{FLASHATTN_SM80_FWD256_BLOCK_M, 64, FLASHATTN_SM80_FWD256_BLOCK_M / 16};
#endif
#ifdef FLASHATTN_SM80_FWD_PACKED_TILE  // 0: the packed kernel takes the plain tile
  if (FLASHATTN_SM80_FWD_PACKED_TILE == 0) t.packed = t.plain;
#endif
#ifdef FLASHATTN_SM80_FWD64_SHORT_KEYS
  if (head_dim <= 64) t.short_keys = FLASHATTN_SM80_FWD64_SHORT_KEYS;
#endif
#ifdef FLASHATTN_SM80_FWD128_SHORT_KEYS
  if (head_dim > 64 && head_dim <= 128) t.short_keys = FLASHATTN_SM80_FWD128_SHORT_KEYS;
#endif
#ifdef FLASHATTN_SM80_FWD256_SHORT_KEYS
  if (head_dim > 128) t.short_keys = FLASHATTN_SM80_FWD256_SHORT_KEYS;
#endif
#ifdef FLASHATTN_SM80_FWD64_SHORT_BLOCK_N
  if (head_dim <= 64) t.short_tile.block_n = FLASHATTN_SM80_FWD64_SHORT_BLOCK_N;
#endif
#ifdef FLASHATTN_SM80_FWD64_SHORT_MIN_BLOCKS
  if (head_dim <= 64) t.short_min_blocks = FLASHATTN_SM80_FWD64_SHORT_MIN_BLOCKS;
#endif
#ifdef FLASHATTN_SM80_FWD128_SHORT_MIN_BLOCKS
  if (head_dim > 64 && head_dim <= 128) t.short_min_blocks = FLASHATTN_SM80_FWD128_SHORT_MIN_BLOCKS;
#endif
#ifdef FLASHATTN_SM80_FWD_ROW_CHAINS  // > 0: this many chains at every head dim
  if (FLASHATTN_SM80_FWD_ROW_CHAINS > 0) t.row_chains = FLASHATTN_SM80_FWD_ROW_CHAINS;
#endif
#ifdef FLASHATTN_SM80_FWD_FIRST_RESCALE  // 0 / 1 at every head dim (< 0: the table's)
  if (FLASHATTN_SM80_FWD_FIRST_RESCALE >= 0) t.first_tile_branch = FLASHATTN_SM80_FWD_FIRST_RESCALE != 0;
#endif
#ifdef FLASHATTN_SM80_FWD_EARLY_V
  t.early_v = FLASHATTN_SM80_FWD_EARLY_V != 0;
#endif
#ifdef FLASHATTN_SM80_FWD_LAZY_RESCALE
  t.lazy_rescale = FLASHATTN_SM80_FWD_LAZY_RESCALE != 0;
#endif
#ifdef FLASHATTN_SM80_FWD_PLAIN_SCOREMOD
  t.plain_scoremod = FLASHATTN_SM80_FWD_PLAIN_SCOREMOD != 0;
#endif
#ifdef FLASHATTN_SM80_FWD_PAGED_CHECK_OVERLAP
  t.paged_check_overlap = FLASHATTN_SM80_FWD_PAGED_CHECK_OVERLAP != 0;
#endif
  if (t.lazy_rescale) t.first_tile_branch = true;
  return t;
}

// Tile of one backward CTA: block_m query rows × block_n keys (8 warps).
struct BwdTile {
  int block_m;
  int block_n;
};

// Warp arrangement and schedule of one backward kernel: warps of the S/dP products along rows (the
// rest along keys), of dK/dV along keys (the rest along D), of dQ along rows (the rest along D).
// spread_dq: dQ computed right after the P/dS barrier, its atomics issued in slices between the
// k-steps of the dV and dK products. late_load (two stages): the next row block's Q/dO copies
// issued after the S/dP products.
struct BwdSchedule {
  int sdp_warps_m;
  int dkv_warps_n;
  int dq_warps_m;
  bool spread_dq;
  bool late_load;
};

// The backward of one head-dim bucket.
struct Sm80BwdTuning {
  // plain: the common kernel; full: softcap / ALiBi / dropout compiled in (its S/dP MMA tiles
  // paired so that one Philox call serves a 16 × 16 dropout block). small: a one-stage full tile
  // for GPUs whose shared memory no other full tile fits ({0, 0}: none).
  BwdTile plain_tile;
  BwdTile full_tile;
  BwdTile small_tile;
  BwdSchedule plain;
  BwdSchedule full;  // also the small tile's
  // One-stage configurations compiled beside the two-stage ones (for GPUs with less shared memory).
  bool plain_one_stage;
  bool full_one_stage;
  // Floats per dQ reduction instruction on sm_90 and newer (red.global.add.v4.f32 at 4); sm_80 has
  // no vector reduction and always takes 1.
  int dq_vec_sm90;
  // Softcap and ALiBi compiled into the plain variant (only dropout takes the full one).
  // Family-wide: the same in every bucket.
  bool plain_scoremod;
};

FA_HOST_DEVICE constexpr Sm80BwdTuning bwd_tuning(int head_dim) {
  //          tile      S/dP  dK/dV  dQ    shared memory (2 stages / 1 stage)
  // d 64:  128 × 128   2×4   4×2   4×2   162 KiB;  full 64 × 128: 97 KiB
  // d 128:  64 × 128   2×4   4×2   2×4   161 KiB;  full 64 × 128: 161 / 128.5 KiB; small 64 × 64: 80.5
  // d 256:  64 × 64    4×2   2×4   2×4   209 / 144.5 KiB;  full 64 × 32: 169 / 104.5 KiB
  // d 256 spreads its dQ atomics and loads late in both variants; d 64 and d 128 spread them in
  // the plain variant only. dQ reductions of four floats at d ≤ 128 (at d 256 they made the plain
  // kernel spill).
  Sm80BwdTuning t = head_dim <= 64 ? Sm80BwdTuning{{128, 128}, {64, 128}, {0, 0}, {2, 4, 4, true, false},
                                                   {2, 4, 4, false, false}, false, false, 4, false}
                    : head_dim <= 128
                        ? Sm80BwdTuning{{64, 128}, {64, 128}, {64, 64}, {2, 4, 2, true, false},
                                        {2, 4, 2, false, false}, false, true, 4, false}
                        : Sm80BwdTuning{{64, 64}, {64, 32}, {0, 0}, {4, 2, 2, true, true},
                                        {4, 2, 2, true, true}, true, true, 1, false};
  // --- overrides for A/B timing (scripts/gpu-variants) ---
#ifdef FLASHATTN_SM80_BWD64_SDP_WARPS_M  // 2 (2 × 4) or 4 (4 × 2)
  if (head_dim <= 64) t.plain.sdp_warps_m = FLASHATTN_SM80_BWD64_SDP_WARPS_M;
#endif
#ifdef FLASHATTN_SM80_BWD64_SPREAD_DQ
  if (head_dim <= 64) t.plain.spread_dq = FLASHATTN_SM80_BWD64_SPREAD_DQ != 0;
#endif
#ifdef FLASHATTN_SM80_BWD64_LATE_LOAD
  if (head_dim <= 64) t.plain.late_load = FLASHATTN_SM80_BWD64_LATE_LOAD != 0;
#endif
#ifdef FLASHATTN_SM80_BWD128_DKV_WARPS_N  // 4 (4 × 2) or 2 (2 × 4)
  if (head_dim > 64 && head_dim <= 128) t.plain.dkv_warps_n = FLASHATTN_SM80_BWD128_DKV_WARPS_N;
#endif
#ifdef FLASHATTN_SM80_BWD128_DQ_WARPS_M  // 2 (2 × 4) or 4 (4 × 2)
  if (head_dim > 64 && head_dim <= 128) t.plain.dq_warps_m = FLASHATTN_SM80_BWD128_DQ_WARPS_M;
#endif
#ifdef FLASHATTN_SM80_BWD128_SPREAD_DQ
  if (head_dim > 64 && head_dim <= 128) t.plain.spread_dq = FLASHATTN_SM80_BWD128_SPREAD_DQ != 0;
#endif
#ifdef FLASHATTN_SM80_BWD128_LATE_LOAD
  if (head_dim > 64 && head_dim <= 128) t.plain.late_load = FLASHATTN_SM80_BWD128_LATE_LOAD != 0;
#endif
#ifdef FLASHATTN_SM80_BWD_PLAIN_SCOREMOD
  t.plain_scoremod = FLASHATTN_SM80_BWD_PLAIN_SCOREMOD != 0;
#endif
  return t;
}

}  // namespace flashattn::cuda::sm80
