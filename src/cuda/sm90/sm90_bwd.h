// src/cuda/sm90/sm90_bwd.h — the Hopper (sm90a) backward family as the dispatcher sees it: its
// tile per head dim, which calls it serves (with the reason when not), its workspace and the
// launchers defined in inst/*.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/macros.h"
#include "common/params.h"
#include "cuda/sm90/sm90_fwd.h"

namespace flashattn::cuda::sm90 {

// Tile of one backward CTA: block_n keys (64 per consumer warpgroup) against block_m query rows
// per step of the Q/dO ring (stages deep). Each CTA owns one key tile of one (kv head, batch) and
// walks every query row block of every query head of the group, so dK and dV are summed in
// registers (GQA needs no fp32 dK/dV buffers) and written once.
//   d 64:  128 keys × 128 rows, 2 stages — K 16 + V 16 + Q 32 + dO 32 + dS 2 × 32 KiB
//   d 128: 128 keys × 64 rows,  2 stages — K 32 + V 32 + Q 32 + dO 32 + dS 2 × 16 KiB; without
//          a mask, softcap, ALiBi or dropout (bwd_wide_rows) 80 rows — K 32 + V 32 + Q 40 + dO 40 +
//          dS 2 × 20 + the dQ slices 40 KiB, dQ computed transposed (FlashAttention-3's tile there)
//   d 256: 64 keys × 64 rows,   1 stage  — K 32 + V 32 + Q 32 + dO 32 + dS and Pᵀ 2 × 8 each +
//          the dQ staging 64 KiB: the warpgroups split the rows of Sᵀ and d of the updates
//          (sm90_bwd_traits.cuh, split d); FlashAttention-3 also keeps one Q/dO stage there
// Deterministic mode, unmasked: staggered walks (BwdTile::of_block, common::StaggeredWalk; 1, the
// default) or descending turns from row block 0 (-DFLASHATTN_SM90_BWD_STAGGER=0).
#ifdef FLASHATTN_SM90_BWD_STAGGER
inline constexpr bool kBwdStagger = FLASHATTN_SM90_BWD_STAGGER != 0;
#else
inline constexpr bool kBwdStagger = true;
#endif
// The order of the last two products at d ≤ 128 (-DFLASHATTN_SM90_BWD_STAGE_UNDER_DK, 1 by default):
// dQ = dS·K issued before dK += dSᵀ·Q, so that dO is given back once dV and dQ have landed and dQ is
// staged for the writer warp while dK still runs (FlashAttention-3's order); H200, bf16: d 128
// ×1.00–1.04, d 64 ×0.99–1.01. 0: dK first, issued before the warpgroups meet over dSᵀ, then dQ,
// both waited for before dQ is staged. Split d (d 256) keeps dK, then dQ: the other order ran it at
// ×0.76–0.89 (src/cuda/README.md, tuning knobs).
#ifdef FLASHATTN_SM90_BWD_STAGE_UNDER_DK
inline constexpr bool kBwdStageUnderDk = FLASHATTN_SM90_BWD_STAGE_UNDER_DK != 0;
#else
inline constexpr bool kBwdStageUnderDk = true;
#endif
// The order of the last products of a step at d ≤ 128 (-DFLASHATTN_SM90_BWD_DV_LATE): dV += Pᵀ·dO
// issued once dSᵀ has been converted and stored for dQ (not before), and dK += dSᵀ·Q once dV has
// landed, as FlashAttention-3 does, so that Pᵀ's registers are free before dK's product and dQ's
// accumulator are in flight together; the d 64 kernels then fit with softmax_scale left out of dS
// (BwdTraits::kScaleInDs; sm_90a, bf16, plain dense d 64 spill stores 76 → 24 bytes). Unset: at
// d 64 only (H100, bf16: d 64 ×1.05–1.11; the d 128 tile of 64 rows ×0.94–1.02, measured together
// with the preprocess's clearing); 1 every tile but split d; 0 none. The 80-row tile
// (bwd_wide_rows) always takes it: in the other order ptxas serializes every wgmma of it (C7512).
#ifdef FLASHATTN_SM90_BWD_DV_LATE
inline constexpr int kBwdDvLate = FLASHATTN_SM90_BWD_DV_LATE != 0 ? 1 : 0;
#else
inline constexpr int kBwdDvLate = -1;
#endif
// Dropout alone (FLASHATTN_SM90_BWD_LEAN_DROPOUT, 1 by default; 0 sends dropout-only calls to the
// variant with all three; on the H200, d 128, dropout 0.1: 1.02–1.05× that variant):
// a kernel variant with dropout and neither softcap nor ALiBi compiled in, as softcap alone and
// ALiBi alone have (sm_90a, bf16, d 64 dense: 356 → 72 bytes of spill stores against the variant
// with all three). Its steps draw their keep bits right after issuing Sᵀ and dPᵀ
// (-DFLASHATTN_SM90_BWD_EARLY_DROPOUT, 1 by default; 0 draws them after the exponentials, as the
// variant with all three does), so that the Philox multiplies run under the tensor cores' work.
#ifdef FLASHATTN_SM90_BWD_LEAN_DROPOUT
inline constexpr bool kBwdLeanDropout = FLASHATTN_SM90_BWD_LEAN_DROPOUT != 0;
#else
inline constexpr bool kBwdLeanDropout = true;
#endif
#ifdef FLASHATTN_SM90_BWD_EARLY_DROPOUT
inline constexpr bool kBwdEarlyDropout = FLASHATTN_SM90_BWD_EARLY_DROPOUT != 0;
#else
inline constexpr bool kBwdEarlyDropout = true;
#endif
// A diagnostic (-DFLASHATTN_SM90_BWD_TURN_WATCHDOG=1, off by default): a dQ writer that has waited
// for its deterministic turn through 2^24 polls (seconds) prints where it is — tile, step, row
// block, its turn and the turn the block is at — and traps, so that a hang ends in an error that
// says which turn never came (BwdMainloop::write_dq).
#ifdef FLASHATTN_SM90_BWD_TURN_WATCHDOG
inline constexpr bool kBwdTurnWatchdog = FLASHATTN_SM90_BWD_TURN_WATCHDOG != 0;
#else
inline constexpr bool kBwdTurnWatchdog = false;
#endif

// The main kernel's launch order (BwdTile::of_block). False: key tiles fastest — each (kv head,
// batch) launches all its key tiles before the next pair starts, and they share its Q and dO in L2.
// True: key tiles slowest — every pair's first key tile launches before any second one. Under a
// causal mask or a window the tiles are unequal (with causal, the first are the longest: every row
// sees them); where the grid fills at most two waves (`ctas` blocks, `resident` of them at once on
// the device), key tiles fastest starts the later pairs' longest tiles a wave late, and taking
// them first is the better schedule (GQA 8:1, d 128, causal, 4k keys: ×1.34; 16k: ×1.00); with
// more waves the tail is a small part of the call while the lost L2 sharing is not (MHA causal,
// d 128, 1k keys, 16 waves: ×0.79), and unmasked tiles are equal (docs/benchmarks-sm90.md, "Lean
// feature variants and the tile-major order"). A deterministic call always keeps key tiles
// fastest: its dQ turns and staggered walks rely on it. FLASHATTN_SM90_BWD_TILE_MAJOR=1 or 0 (a
// runtime knob read per call) forces either order on the other calls, for tests and comparisons.
bool bwd_tile_major(bool masked, bool deterministic, long long ctas, long long resident);

// The most key tiles per (kv head, batch) at which a deterministic, unmasked call staggers its
// walks (BwdTile::of_block): a staggered tile may wait for one of its pair launched after it, so
// all of a pair's tiles must fit on the device beside other pairs and kernels in flight. The
// default is a quarter of the SMs (`sm_count`; 4k keys at 128 keys per tile on an H200), 0 when
// built with FLASHATTN_SM90_BWD_STAGGER=0. FLASHATTN_SM90_BWD_STAGGER_TILES=N (a runtime knob read
// per call; 0 … sm_count, larger values are taken as sm_count, anything else as unset) sets it,
// to time longer staggered spans against the descending turns.
int bwd_stagger_tiles(int sm_count);

// The order of a GQA tile's walk (BwdTile::heads_inner). Heads outer (the default): each query
// head of the group in turn, its row blocks ascending. Heads inner: the row blocks from the last
// down, the group's heads at each (from head n_block mod group on). Under a causal mask the tiles
// of a (kv head, batch) walk unequal lengths per head, so with heads outer they drift apart across
// the group's heads, and the Q and dO rows read at one time span all of them: at 16k rows, GQA 8:1
// and d 128 that is 8 heads · 16k rows · 512 bytes = 64 MiB per kv head, more than the H200's
// 50 MiB of L2 (the causal GQA row at 16k keys runs at 0.92 of the MHA row, at 4k at 1.05). Heads
// inner, the tiles of a pair read the same few row blocks at once; the dQ additions to a (head,
// row block) then come together from up to n_tiles / group CTAs.
// -DFLASHATTN_SM90_BWD_HEADS_INNER=1 builds the choice in (0, the default, until timed on a GPU;
// the runtime branch alone changes the kernels: sm_90a, bf16, plain dense spill stores d 64 112 →
// 52 bytes, d 128 32 → 36, d 256 96 → 8); in such a build FLASHATTN_SM90_BWD_GQA_WALK=inner (a runtime knob read
// per call) takes it for non-deterministic GQA calls (deterministic turns assume each head's rows
// in order), anything else keeps heads outer.
#ifdef FLASHATTN_SM90_BWD_HEADS_INNER
inline constexpr bool kBwdHeadsInner = FLASHATTN_SM90_BWD_HEADS_INNER != 0;
#else
inline constexpr bool kBwdHeadsInner = false;
#endif
bool bwd_heads_inner(int group, bool deterministic);

// Split d (d > 128) without softcap or dropout: Sᵀ and dPᵀ of the step's 64 rows computed whole,
// Sᵀ by the first consumer warpgroup and dPᵀ by the second (wgmma N = 64: K and V are read once
// per product instead of once per half), the first handing Pᵀ to the second through the shared
// tile dV reads it from, the second computing dSᵀ from it (Pᵀ in 16 bits) and storing it; both
// then take their halves of d in dV, dK and dQ as before. -DFLASHATTN_SM90_BWD_SDP_SPLIT=1 builds
// it (0, the default, until timed on a GPU).
#ifdef FLASHATTN_SM90_BWD_SDP_SPLIT
inline constexpr bool kBwdSdpSplit = FLASHATTN_SM90_BWD_SDP_SPLIT != 0;
#else
inline constexpr bool kBwdSdpSplit = false;
#endif

// Whether the main kernel is launched as the preprocess's programmatic dependent and the
// postprocess as the main kernel's (src/cuda/dependent_launch.h): each may begin once every block
// of the kernel before it has begun, so that its launch and prologue (the main kernel's barriers,
// descriptors and K/V loads) run under that kernel's tail instead of after it; each waits
// (griddepcontrol.wait) for the end of the one before before reading what it wrote (the row
// statistics and the cleared accumulator; the accumulator's sums). FLASHATTN_SM90_BWD_PDL=0 (a
// runtime knob read per call) launches them one after another as before; on by default.
bool bwd_dependent_launch();

struct BwdTileShape {
  int block_m;
  int block_n;
  int stages;
};
// d 96 (where built) takes d 128's tile; BwdTraits picks each operand's swizzle so that every
// warpgroup's slice of it starts on an atom (K in 32-byte rows there: dQ's two 48-column halves of
// Kᵀ). d 192 (dv 128, bwd_head_dim_v; where built) splits d as d 256 does, with two Q/dO stages:
// K 24 + V 16 + Q 2 · 24 + dO 2 · 16 + dSᵀ and Pᵀ 2 · 16 + the dQ slices 48 KiB.
// wide: the 80-row tile of d 128 (bwd_wide_rows).
constexpr BwdTileShape bwd_tile(int head_dim, bool wide = false) {
  return head_dim <= 64    ? BwdTileShape{128, 128, 2}
         : head_dim <= 128 ? BwdTileShape{wide && head_dim == 128 ? 80 : 64, 128, 2}
         : head_dim <= 192 ? BwdTileShape{64, 64, 2}
                           : BwdTileShape{64, 64, 1};
}
// Whether a call of the instantiated head dim `head_dim` takes bwd_tile's wide tile: d 128 without
// a causal mask or window, softcap, ALiBi or dropout, unless built with
// -DFLASHATTN_SM90_BWD_WIDE_ROWS=0 (then never) or FLASHATTN_SM90_BWD_WIDE_ROWS=0 is set (a runtime
// knob read once per process, for tests and comparisons: a workspace sized under one setting must
// be laid out under the same). The workspace's row blocks (bwd_rows) follow the
// choice and the launcher reads it back from them.
#ifdef FLASHATTN_SM90_BWD_WIDE_ROWS
inline constexpr bool kBwdWideRows = FLASHATTN_SM90_BWD_WIDE_ROWS != 0;
#else
inline constexpr bool kBwdWideRows = true;
#endif
bool bwd_wide_rows(const common::AttentionParams& p, int head_dim);

// The dv of an instantiation: the forward's pairing (sm90_fwd.h), 192 / 128 and d = dv elsewhere.
constexpr int bwd_head_dim_v(int head_dim) { return fwd_head_dim_v(head_dim); }

// The rows of the backward's scratch: per query head `head_stride` rows, in which sequence b's
// rows start at bwd_row_start (a multiple of block_m) and take its query rows rounded up to a
// row block. Dense: b · padded_rows (padded_rows: max_seqlen_q rounded up). Varlen: sequence b
// starts at ⌊(cu_seqlens_q[b] + b · block_m) / block_m⌋ · block_m, which leaves each sequence its
// rounded-up rows, all within total_q + (batch + 1) · block_m.
struct BwdRows {
  int block_m = 0;
  int padded_rows = 0;          // dense: max_seqlen_q rounded up to block_m
  std::int64_t head_stride = 0;  // rows per query head
};
FA_HOST_DEVICE std::int64_t bwd_row_start(const common::AttentionParams& p, const BwdRows& r, int b) {
  if (p.is_varlen()) return (std::int64_t(p.cu_seqlens_q[b]) + std::int64_t(b) * r.block_m) / r.block_m * r.block_m;
  return std::int64_t(b) * r.padded_rows;
}
BwdRows bwd_rows(const common::AttentionParams& p, int head_dim);

// The scratch in the caller's workspace, over heads · head_stride rows: the fp32 dQ accumulator
// (rows × the instantiated head dim), lse · log2 e and softmax_d (one float per row; +∞ and 0 on
// the padding rows, so that a row block is read whole); deterministic calls add one int32 per row
// block: how many key tiles have added their dQ to it, so that they add it in key-tile order
// (BwdMainloop::write_dq).
struct BwdWorkspace {
  BwdRows rows;
  std::size_t dq_accum_bytes = 0;
  std::size_t row_stat_bytes = 0;   // each of lse_log2 and dpsum
  std::size_t semaphore_bytes = 0;  // deterministic only
  std::size_t total_bytes() const { return dq_accum_bytes + 2 * row_stat_bytes + semaphore_bytes; }
};
BwdWorkspace bwd_workspace(const common::AttentionParams& p, int head_dim);

// Where the scratch lives, for the launcher.
struct BwdScratch {
  float* dq_accum = nullptr;
  float* lse_log2 = nullptr;
  float* dpsum = nullptr;
  int* dq_semaphores = nullptr;  // one per row block, or nullptr
  BwdRows rows;
  std::size_t dq_accum_bytes = 0;
  std::size_t semaphore_bytes = 0;
};

// Why the sm90 backward does not serve p in the instantiated head dim `head_dim`, or "" when it
// does (features and layouts only; the device and compiled kernels are the family table's).
std::string bwd_unsupported(const common::AttentionParams& p, int head_dim);

// The launcher of one (dtype, head dim), instantiated in inst/sm90_bwd_hdim<d>_<dtype>.cu
// (sm90_bwd_launch.cuh defines it): preprocess, main kernel, postprocess on `stream`.
template <common::Storage kStorage, int kHeadDim>
cudaError_t run_bwd(const common::AttentionParams& p, const BwdScratch& scratch, const std::uint64_t* rng_state,
                    cudaStream_t stream);

}  // namespace flashattn::cuda::sm90
