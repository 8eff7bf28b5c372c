// src/cuda/sm90/sm90_fwd.h — the Hopper (sm90a) forward family as the dispatcher sees it: its
// tile per head dim, which calls it serves (with the reason when not), and the launchers defined
// in inst/*.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/params.h"
#include "cuda/split_kv.h"

namespace flashattn::cuda::sm90 {

// Tile of one forward CTA: block_m query rows (64 per consumer warpgroup) × block_n keys per
// stage of the K and V rings.
struct FwdTileShape {
  int block_m;
  int block_n;
  int stages;
};
// Tiles per head dim (bf16/fp16), 64 query rows per consumer warpgroup:
//   d 64:  128 × 128, 2 stages — 96 KiB (Q 16 + K 32 + V 32) + a second Q buffer 16, which also
//          stages O. The alternative, 192 × 96 (three consumer warpgroups at 160 registers;
//          -DFLASHATTN_SM90_FWD_D64_ROWS=192), timed in the same GPU call on the H200 (bf16, L2
//          cleared, TFLOP/s 128 × 128 / 192 × 96):
//          s 512 325/272, 1k 392/308, 2k 436/386, 4k 465/365, 8k 480/496, 16k 468/482; causal
//          192/174, 270/241, 340/346, 398/400, 402/425, 435/430 — 128 rows win by up to 27% up to
//          4k keys, 192 rows by 3–6% at 8k–16k. The 192-row tile's key tile: 96
//          (-DFLASHATTN_SM90_FWD_D64_KEYS=128 for 128 keys, FlashAttention-3's under a causal
//          mask; not yet timed). The plain dense kernel also 192 × 128 from 8k queries and keys,
//          with or without a causal mask (kFwdD64TallTile, fwd_d64_tall).
//   d 96:  128 × 128, 2 stages — 120 KiB (Q 24 + K 48 + V 48) + O 24, rows of three 32-column
//          swizzle atoms of 64 bytes (FwdTraits::kAtomCols; built where FLASHATTN_CUDA_HEAD_DIMS
//          lists 96, else d 96 runs the d 128 kernel)
//   d 128: 128 × 128, 2 stages — 160 KiB (Q 32 + K 64 + V 64) + O 32
//   d 192 (dv 128: fwd_head_dim_v): 128 × 128, 2 stages — 208 KiB (Q 48 + K 96 + V 64), O in Q's
//          bytes (FlashAttention-3's tile for 192 / 128)
//   d 256: 128 × 64,  2 stages — 192 KiB (Q 64 + K 64 + V 64), O in Q's bytes; the plain dense
//          kernel also 128 × 80 where a call has many keys (kFwdD256WideTile, fwd_d256_wide)
#ifndef FLASHATTN_SM90_FWD_D64_ROWS
#define FLASHATTN_SM90_FWD_D64_ROWS 128
#endif
#ifndef FLASHATTN_SM90_FWD_D64_KEYS
#define FLASHATTN_SM90_FWD_D64_KEYS 96
#endif
inline constexpr int kD64Rows = FLASHATTN_SM90_FWD_D64_ROWS;
inline constexpr int kD64Keys = FLASHATTN_SM90_FWD_D64_KEYS;
static_assert(kD64Rows == 192 || kD64Rows == 128, "FLASHATTN_SM90_FWD_D64_ROWS is 192 or 128");
static_assert(kD64Keys == 96 || kD64Keys == 128, "FLASHATTN_SM90_FWD_D64_KEYS is 96 or 128");
// The tall d 64 tile: 192 × 128, three consumer warpgroups at 160 registers, compiled beside the
// 128 × 128 one for the plain dense kernel only (FLASHATTN_SM90_FWD_D64_TALL=0 leaves it out), and
// taken per call by fwd_d64_tall. On an H100 (2026-12-05, bf16, L2 cleared, the two taking turns
// call by call in one process, no mask, 16k tokens, 32 heads), 192 ÷ 128 rows: 2k keys 0.95, 4k
// 0.79, 8k 1.12, 16k 1.11 (529 and 515 TFLOP/s); under a causal mask the 192-row tile lost at
// every length (built as the whole d 64 family's tile, -DFLASHATTN_SM90_FWD_D64_ROWS=192).
#ifndef FLASHATTN_SM90_FWD_D64_TALL
#define FLASHATTN_SM90_FWD_D64_TALL 1
#endif
inline constexpr bool kFwdD64Tall = FLASHATTN_SM90_FWD_D64_TALL != 0 && kD64Rows == 128;
inline constexpr FwdTileShape kFwdD64TallTile{192, 128, 2};
// Whether a call at the d 64 instantiation takes the tall tile: a build with it, a dense call (no
// varlen, seqused_k or KV cache, not paged, not split) without a sliding window, softcap, ALiBi or
// dropout, whose queries and keys both number at least FLASHATTN_SM90_FWD_D64_TALL_FROM (read per
// call; default 8192, 0: never) — under a causal mask FLASHATTN_SM90_FWD_D64_TALL_CAUSAL_FROM
// (default 8192). Causal, on an H100 (2026-12-07, bf16, L2 cleared, 16k tokens, 32 heads, the two
// taking turns call by call, two rounds), 192 ÷ 128 rows: 1k keys 0.86, 2k and 4k 1.00, 8k 1.06,
// 16k 1.05 (492 TFLOP/s at 8k; FlashAttention-3 in the same call 553, whose causal d 64 tile is
// 192 × 128 at every length).
bool fwd_d64_tall(const common::AttentionParams& p, int num_splits);
bool fwd_d64_tall_built();

// The wide d 256 tile: 128 × 80, FlashAttention-3's, 224 KiB (Q 64 + K 80 + V 80; O in Q's
// bytes, stored by TMA), compiled beside the 128 × 64 one for the plain dense kernel only
// (FLASHATTN_SM90_FWD_D256_WIDE=0 leaves it out) and taken per call by fwd_d256_wide: a fifth more
// keys per step over the same fixed work of a step (O's 128 fp32 per thread rescaled, the row
// statistics; sm_90a, bf16: 8.8 → 8.0 instructions per key in the steady step, at the price of
// spills: stores 12 → 56 bytes, 8 spill loads a step). On an H100 (2026-12-07, bf16, L2 cleared,
// every d 256 kernel built either way, two rounds each; docs/benchmarks-sm90.md) 80 ÷ 64 keys:
// 2k–16k keys 1.00–1.04 with and without a causal mask, 1k 1.01 (causal 0.97), 512 0.94–0.96.
#ifndef FLASHATTN_SM90_FWD_D256_WIDE
#define FLASHATTN_SM90_FWD_D256_WIDE 1
#endif
inline constexpr bool kFwdD256Wide = FLASHATTN_SM90_FWD_D256_WIDE != 0;
inline constexpr FwdTileShape kFwdD256WideTile{128, 80, 2};
// Whether a call at the d 256 instantiation takes the wide tile: a build with it, a dense call (no
// varlen, seqused_k or KV cache, not paged, not split) without softcap, ALiBi or dropout (masks
// and windows allowed), whose keys number at least FLASHATTN_SM90_FWD_D256_WIDE_FROM (read per
// call; default 2048, 0: never).
bool fwd_d256_wide(const common::AttentionParams& p, int num_splits);
bool fwd_d256_wide_built();

constexpr FwdTileShape fwd_tile(int head_dim) {
  return head_dim <= 64 ? (kD64Rows == 192 ? FwdTileShape{192, kD64Keys, 2}
                                           : FwdTileShape{128, 128, 2})
                        : head_dim <= 128 ? FwdTileShape{128, 128, 2}
                        : (head_dim <= 192 ? FwdTileShape{128, 128, 2}
                                           : FwdTileShape{128, 64, 2});
}

// The columns of V and O in the instantiation of head dim `head_dim` (Q and K have head_dim): the
// 192 instantiation is the 192 / 128 of DeepSeek-style attention (MLA's prefill: 128 + 64 rotary
// dims for Q and K, 128 for V); the others have d = dv. A call's d and dv are rounded up to an
// instantiation that holds both (fwd_head_dim_need).
constexpr int fwd_head_dim_v(int head_dim) { return head_dim == 192 ? 128 : head_dim; }
// The smallest instantiated head dim that can serve a call of head dims d and dv: max(d, dv), but
// past the 192 instantiation where dv exceeds its 128 (such calls take the 256 one).
constexpr int fwd_head_dim_need(int d, int dv) {
  const int need = d > dv ? d : dv;
  return need > 128 && need <= 192 && dv > fwd_head_dim_v(192) ? 256 : need;
}

// Q buffers of the forward's d 64 / d 128 kernels (d 256 has no room and keeps one): with two,
// the producer loads the next tile's Q right after this tile's first K/V stage, not after its last
// Q·Kᵀ, and O is staged in its tile's Q buffer instead of a tile of its own. Two at d 64, one at
// d 128 by default: on the H200 (bf16, L2 cleared, one call; docs/benchmarks-sm90.md, run G) two
// buffers ran d 64 at 1.00–1.07× one (8k keys without a mask 0.98×) and d 128 at 0.98–1.01×.
// -DFLASHATTN_SM90_FWD_Q_STAGES=1 or 2 sets every head dim alike.
#ifndef FLASHATTN_SM90_FWD_Q_STAGES
#define FLASHATTN_SM90_FWD_Q_STAGES 0
#endif
static_assert(FLASHATTN_SM90_FWD_Q_STAGES >= 0 && FLASHATTN_SM90_FWD_Q_STAGES <= 2,
              "FLASHATTN_SM90_FWD_Q_STAGES is 1 or 2 (0: per head dim)");
constexpr int fwd_q_stages(int head_dim) {
  return FLASHATTN_SM90_FWD_Q_STAGES != 0 ? FLASHATTN_SM90_FWD_Q_STAGES : head_dim <= 64 ? 2 : 1;
}

// Whether the dense kernel of this head dim writes O by TMA (its tiles' rows past the sequence are
// past the tensor too; varlen kernels never do): the consumers stage O (in its tile's Q bytes, or
// in O's own tile where there is room) and go on to the next tile; a warp of the producer
// warpgroup stores the tile with one TMA store and gives the buffer back once the store has read
// it. By default at d 256 (where O is always in Q's bytes): on the H200 (bf16, L2 cleared, one
// call; docs/benchmarks-sm90.md, run G) 1.00–1.15× the thread stores (causal 512 keys 1.15×, 16k
// 1.00×), whose consumers spilled. Not at d 64 (0.93–1.01×) nor at
// d 128, where it needs two Q buffers (with them, causal 1.00–1.05× but without a mask
// 0.92–0.99×; from O's own tile, with one Q buffer, not yet timed). At d 192 (dv 128) in the
// softcap/ALiBi/dropout kernel only, by spills (sm_90a, bf16, dense kernels, TMA / thread stores:
// plain 100 / 4 bytes, softcap/ALiBi/dropout 28 / 104). -DFLASHATTN_SM90_FWD_TMA_STORE=0 or 1 sets
// every head dim and variant alike.
#ifndef FLASHATTN_SM90_FWD_TMA_STORE
#define FLASHATTN_SM90_FWD_TMA_STORE -1
#endif
static_assert(FLASHATTN_SM90_FWD_TMA_STORE >= -1 && FLASHATTN_SM90_FWD_TMA_STORE <= 1,
              "FLASHATTN_SM90_FWD_TMA_STORE is 0 or 1 (unset: per head dim)");
constexpr bool fwd_tma_store(int head_dim, bool score_mod) {
  return FLASHATTN_SM90_FWD_TMA_STORE >= 0 ? FLASHATTN_SM90_FWD_TMA_STORE == 1
                                           : head_dim > 192 || (head_dim > 128 && score_mod);
}
// Whether tile t at this (instantiated) head dim has room for a second Q-sized tile beside Q, K
// and V (a second Q buffer, or O's own tile; 16-bit elements), and whether O is staged in Q's
// bytes (FwdTraits::kQStages / kSeparateO decide the same).
constexpr bool fwd_room_for_two_q(FwdTileShape t, int head_dim) {
  const int dv = fwd_head_dim_v(head_dim);
  return 2 * (2 * t.block_m * head_dim + t.stages * t.block_n * (head_dim + dv)) + 1024 <= 227 * 1024;
}
constexpr bool fwd_o_in_q(int head_dim, FwdTileShape t) {
  return fwd_q_stages(head_dim) == 2 || !fwd_room_for_two_q(t, head_dim);
}
// fwd_tma_store(head_dim, score_mod) as the library was compiled (the knobs reach nvcc's
// translation units only).
bool fwd_tma_store_built(int head_dim, bool score_mod);

// Whether a call takes the softcap/ALiBi/dropout kernels (FwdTraits::kScoreMod).
inline bool fwd_score_mod(const common::AttentionParams& p) {
  return p.softcap > 0.0f || p.alibi_slopes != nullptr || p.dropout_p > 0.0f;
}

// Whether the kernels of V head dim head_dim_v rescale O lazily (OnlineSoftmax's kLazy,
// sm90_softmax.cuh: a row's maximum is kept until a key tile passes it by more than 8, scaled, in
// log2 units, and warps whose rows all kept theirs skip O's rescale): by default where dv is 256,
// whose step rescales 128 fp32 per thread over only 64 or 80 keys. On an H100 (2026-12-08, bf16,
// L2 cleared, every kernel built either way, two rounds, the builds alternating;
// docs/benchmarks-sm90.md) lazy ÷ every step, FA grid 512–16k keys, causal or not: d 256
// 1.003–1.040 (geometric mean 1.020), d 128 0.987–1.044 (1.000), d 64 0.939–0.981 (0.957).
// -DFLASHATTN_SM90_FWD_LAZY_RESCALE=0 or 1 sets every head dim alike.
#ifndef FLASHATTN_SM90_FWD_LAZY_RESCALE
#define FLASHATTN_SM90_FWD_LAZY_RESCALE -1
#endif
static_assert(FLASHATTN_SM90_FWD_LAZY_RESCALE >= -1 && FLASHATTN_SM90_FWD_LAZY_RESCALE <= 1,
              "FLASHATTN_SM90_FWD_LAZY_RESCALE is 0 or 1 (unset: per head dim)");
constexpr bool fwd_lazy_rescale(int head_dim_v) {
  return FLASHATTN_SM90_FWD_LAZY_RESCALE >= 0 ? FLASHATTN_SM90_FWD_LAZY_RESCALE == 1 : head_dim_v > 128;
}
// The softcap/ALiBi/dropout kernels' dropout keep bits (FwdMainloop::compute): 1 draws a key
// tile's bits (one Philox call per 16 × 16 block) right after the warpgroup has issued its
// products, under Q·Kᵀ, and keeps them packed until the softmax has run; 0 (the default until
// timed) draws them after the softmax, between the waits for S and for P·V, where the sm_90a SASS
// of the d 128 kernel has all of them (about 600 instructions of the 1657 between the waits).
// The forward with dropout 0.1 ran at 0.45–0.52 of the plain one on the H200 (2026-12-03).
#ifndef FLASHATTN_SM90_FWD_DROPOUT_EARLY
#define FLASHATTN_SM90_FWD_DROPOUT_EARLY 0
#endif
static_assert(FLASHATTN_SM90_FWD_DROPOUT_EARLY == 0 || FLASHATTN_SM90_FWD_DROPOUT_EARLY == 1,
              "FLASHATTN_SM90_FWD_DROPOUT_EARLY is 0 or 1");
// The softcap kernels' exponentials: of every 8 columns of a thread's scores, the first N take
// 2^x from common::exp2_poly (a cubic on the FMA pipe, 11 instructions, relative error 1.03e-4,
// below P's 16-bit rounding) instead of the MUFU, where the step's tanh queues too: 128 MUFU
// operations per thread and 128-key step, 8 cycles each per warp scheduler (16 results per clock
// per SM), against 66 without softcap. 0 (the default until timed): every exponential on the MUFU.
// Calls without softcap (ALiBi, dropout) take the MUFU path either way.
#ifndef FLASHATTN_SM90_FWD_SOFTCAP_POLY_EXP
#define FLASHATTN_SM90_FWD_SOFTCAP_POLY_EXP 0
#endif
static_assert(FLASHATTN_SM90_FWD_SOFTCAP_POLY_EXP >= 0 && FLASHATTN_SM90_FWD_SOFTCAP_POLY_EXP <= 8,
              "FLASHATTN_SM90_FWD_SOFTCAP_POLY_EXP is 0 … 8 (columns of every 8)");
// The paged kernels' block_table entries (FwdMainloop::request_pages): 1 copies each key tile's
// entries into shared memory by cp.async a key tile ahead of its TMA boxes; 0 (the default until
// timed) loads them into the producer thread's registers as the tile's boxes are issued, where
// ptxas serialises them (each moved to a uniform register right after its load). On an H100
// pages of 16 rows (eight 16-row boxes per 128-key tile) ran at 0.56–0.59 of a contiguous cache,
// a step taking about 2.95 µs at d 64 and d 128 alike — in proportion to the entries of a step
// rather than its boxes or bytes (docs/benchmarks-sm90.md).
#ifndef FLASHATTN_SM90_FWD_PAGE_AHEAD
#define FLASHATTN_SM90_FWD_PAGE_AHEAD 0
#endif
static_assert(FLASHATTN_SM90_FWD_PAGE_AHEAD == 0 || FLASHATTN_SM90_FWD_PAGE_AHEAD == 1,
              "FLASHATTN_SM90_FWD_PAGE_AHEAD is 0 or 1");
// Whether the two consumer warpgroups take turns to issue their products (ping-pong): the
// softcap/ALiBi/dropout kernels with two consumer warpgroups (d 128), whose tanh and Philox rounds
// then run under the other warpgroup's products. Not the plain kernel: on the H200 (bf16, d 64/128, s 512…16k) turns
// measured 0.93–1.03× its speed without them, and that variant was removed.
constexpr bool fwd_pingpong(int head_dim, bool score_mod) {
  return score_mod && head_dim <= 128 && fwd_tile(head_dim).block_m == 128;  // turns pair two warpgroups
}

// Whether the kernels of a head dim decode each tile (PersistentTileScheduler::tile: its row
// block, head and batch from its index) by multiply-and-shift constants the host makes once per
// call (FwdTileDivisors, cutlass::FastDivmod) rather than by division by the call's runtime values
// (ten division sequences in the d 128 plain kernel, each an I2F and a MUFU reciprocal; every
// warp that walks the tiles decodes each one at the tile's start). On an H100 (2026-12-07, bf16,
// L2 cleared, three rounds, the two builds alternating; docs/benchmarks-sm90.md) the constants ran
// d 64 at 1.00-1.05x (causal 1k keys 1.05, 2k 1.03) but d 128 at 0.98-1.00x with its step loop
// unchanged in length: taken where a tile is short enough for its start to count, d <= 64.
constexpr bool fwd_fast_divmod(int head_dim) { return head_dim <= 64; }

// The first index of p's tile order (block_m rows, `section` pairs per section, `splits` splits,
// the sections' directions alternating or not) at which that decode differs from the division's,
// or −1 where they agree on every index: a host check of FwdTileDivisors, in any build.
int fwd_fast_divmod_mismatch(const common::AttentionParams& p, int block_m, int section, int splits, bool alternate);

// Whether the persistent CTAs walk the tiles of a masked call (causal or a window) as a snake (the
// default) or plainly (FLASHATTN_SM90_FWD_WALK=plain, read at each call):
// PersistentTileScheduler::index. On the H200, causal s 4k/16k: 1.03–1.15× the plain walk.
// Without a mask every tile costs the same, and the walk is plain.
bool fwd_snake_walk();

// How many (head, batch) pairs one section of a masked call's tile order holds
// (PersistentTileScheduler::tile, common::MaskedTileOrder): as many query heads as share the K/V
// of the kv heads that fit in kFwdL2SectionMiB MiB of L2, at least one kv head's, provided a
// section of them holds at least one and a half rounds of tiles (`sms` tiles a round, one per
// persistent CTA; without `sms`, always); else those of kFwdL2SectionWideMiB MiB. Sections
// alternate their directions (the first rises, the last falls). Knobs, read at each call:
// FLASHATTN_SM90_FWD_L2_SECTION_MB sets the share as it is (0: no sections);
// FLASHATTN_SM90_FWD_L2_SECTION_ROWS=N leaves calls of more than N row blocks one section of every
// pair (unset: no limit); FLASHATTN_SM90_FWD_L2_SECTION_ALT=0 takes every section highest first.
// Why each part (timings in docs/benchmarks-sm90.md, bf16, causal, L2 cleared, one call, the
// settings taking turns call by call):
// - alternating directions: with every section highest first, a section's end put the next
//   section's longest tiles beside its shortest in one round, which the snake walk does not even
//   out over rounds of many row blocks: at 16k keys d 128 sections ran 544 TFLOP/s against 674
//   without (H200, run F); alternating keeps each boundary's tiles of like length together.
// - sections at all: H200 (runs F, G), none / alternating sections, 1k keys d 128 359/413, d 256
//   331/396; 2k d 128 449/529, d 256 498/533; 4k d 64 400/414, d 128 578/621, d 256 598/639.
// - at every length (until 2026-12-07 only up to 64 row blocks, 8k queries at 128 rows): at 16k
//   keys the causal forward without sections read 1.16 GB from DRAM at d 128 and 3.44 GB at d 64
//   (L2 hit rate 77 % / 32 %; Q + K + V are 201 MB), with 32 MiB sections 0.38 / 0.44 GB
//   (92 % / 87 %); FlashAttention-3 reads 0.26 / 0.30 GB (ncu, H100). Time, H100, 3 rounds,
//   16 MiB sections at every length ÷ the former rule: d 64 8k 1.01–1.03, 16k 1.01–1.02; d 128 4k
//   1.01, 8k 1.00–1.02, 16k 1.00–1.02; 2k and d 64 4k level. The H200's faster memory felt
//   less of it (run G: 16k at 1.00).
// - 16 MiB rather than 32: 1k keys d 128 1.07–1.09, d 64 1.02; 2k d 128 1.03, d 64 1.02 (H100,
//   an earlier run, which found 4k and beyond level or lower); in the run above, 16 ÷ 32 MiB at
//   d 128 4k 1.01, 8k 1.00–1.02, d 64 8k 1.01–1.02, 16k level.
// - the 1.5 rounds: a section of about one round put its longest tiles and the next section's in
//   the same CTAs (the snake turns at the round, the directions at the section) and ran the static
//   walk at 0.64–0.69× (d 128 4k keys at 8 MiB, 4 pairs of 32 row blocks; d 256 2k at 16 MiB, 8
//   pairs of 16). So d 256 at 16k keys (a kv head's K/V 16 MiB: 128 tiles in a 16 MiB section)
//   takes 32 MiB sections.
inline constexpr int kFwdL2SectionMiB = 16;
inline constexpr int kFwdL2SectionWideMiB = 32;
struct FwdSections {
  int pairs;       // pairs per section, ≥ 1
  bool alternate;  // directions alternate
};
// sms: the persistent CTAs (0: no least section size).
FwdSections fwd_l2_sections(const common::AttentionParams& p, int block_m, int sms = 0);

// Paged KV caches (block_table) in this family: the producer gathers each key tile of K and V
// from its pages by TMA, in chunks of kFwdPageChunkRows rows × 64 columns (one box each; a chunk
// never crosses a page, so page sizes are multiples of kFwdPageChunkRows, as in the sm80 family),
// into the same swizzled stages the contiguous kernels fill; one block_table read per page of the
// tile. On by default (-DFLASHATTN_SM90_FWD_PAGED=0 leaves paged calls to the sm80 family): on the
// H200, paged prefill at 1.34–1.67× the sm80 paged kernel (docs/benchmarks-sm90.md).
#ifndef FLASHATTN_SM90_FWD_PAGED
#define FLASHATTN_SM90_FWD_PAGED 1
#endif
inline constexpr bool kFwdPaged = FLASHATTN_SM90_FWD_PAGED != 0;
inline constexpr int kFwdPageChunkRows = 16;
// kFwdPaged as the library was compiled (the knob reaches nvcc's translation units only).
bool fwd_paged_built();
// The rows of the paged kernels' TMA boxes for pages of page_size rows: 64 where the page size is
// a multiple of 64 (and the key tile too: the caller checks), else 16; FLASHATTN_SM90_FWD_PAGE_BOX=16
// (read per call) keeps 16 everywhere. On an H100 (docs/benchmarks-sm90.md, 2026-12-05) a paged
// prefill over pages of 64 and 256 rows ran 1.81–1.85× faster with 64-row boxes than with 16-row ones,
// level with the contiguous cache.
int fwd_page_box_rows(int page_size);

// Split-KV in this family: each tile's key tiles spread over `splits` CTAs of the persistent
// grid (the split innermost in the tile order), which write fp32 partials (cuda/split_kv.h) that
// the combine kernel merges, as the sm80 family's split-KV forward does. A compile-time switch
// until it has run on a GPU (-DFLASHATTN_SM90_FWD_SPLIT=1; default 0: this family never splits).
// The ordered family choice still leaves calls that the sm80 family would split to it (decoding);
// a call forced onto this family (FLASHATTN_CUDA_FAMILY=sm90) splits by fwd_num_splits.
#ifndef FLASHATTN_SM90_FWD_SPLIT
#define FLASHATTN_SM90_FWD_SPLIT 0
#endif
inline constexpr bool kFwdSplit = FLASHATTN_SM90_FWD_SPLIT != 0;
bool fwd_split_built();
// The splits of p in this family at the instantiated head dim (1: none): p.num_splits when > 0
// (at most kMaxSplits), else cuda::num_splits_heuristic over `sms` CTA places (one per SM) and the
// key tiles of the widest row block. 1 where built without FLASHATTN_SM90_FWD_SPLIT.
int fwd_num_splits(const common::AttentionParams& p, int head_dim, int sms);

// A dynamic tile schedule for calls whose tiles differ in length (a causal or windowed mask, or
// varlen): each persistent CTA takes its first tile by its index, then the next one of the same
// order (longest first, in L2 sections) from a counter in device memory that every CTA advances
// by one atomic add, so that a CTA whose tiles ran short takes more of them, where the static
// walk (PersistentTileScheduler::index) fixes every CTA's tiles in advance. One thread of the
// producer warp fetches, and hands each index to the consumer warpgroups (and the O storer)
// through a ring of kFwdTileSlots slots in shared memory. The counter returns to 0 at the end of
// every launch (the last fetch of the launch resets it), so it needs no clearing: one counter per
// (device, stream), kFwdTileCounters of them per device, for streams beyond those and for launches
// being captured into a CUDA graph (whose replays may run on other streams side by side) the
// static walk. -DFLASHATTN_SM90_FWD_DYNAMIC=1 builds it (off by default until timed on a GPU); in
// such a build FLASHATTN_SM90_FWD_SCHEDULE=static (read per call) keeps the static walk, for
// timing the two in one process.
#ifndef FLASHATTN_SM90_FWD_DYNAMIC
#define FLASHATTN_SM90_FWD_DYNAMIC 0
#endif
inline constexpr bool kFwdDynamic = FLASHATTN_SM90_FWD_DYNAMIC != 0;
inline constexpr int kFwdTileSlots = 4;
inline constexpr int kFwdTileCounters = 64;
bool fwd_dynamic_built();
// The counter of p's dynamic schedule on `stream` (the current device's), or nullptr for the
// static walk: without FLASHATTN_SM90_FWD_DYNAMIC, for calls whose tiles are alike (no mask, not
// varlen), under FLASHATTN_SM90_FWD_SCHEDULE=static, during stream capture, and past
// kFwdTileCounters streams on the device.
int* fwd_tile_counter(const common::AttentionParams& p, cudaStream_t stream);

// Whether a call takes the varlen kernel (per-sequence rows or key counts: varlen, seqused_k, a
// KV cache) rather than the dense one.
inline bool fwd_varlen_kernel(const common::AttentionParams& p) {
  return p.is_varlen() || p.seqused_k != nullptr || p.cache_seqlens != nullptr || p.cache_batch_idx != nullptr ||
         p.k_leftpad != nullptr;
}

// Why the sm90 forward does not serve p in the instantiated head dim `head_dim` (0: none
// compiled), or "" when it does. Checks the features and layouts only: the device and the
// compiled kernels are the family table's business (cuda/family.h).
std::string fwd_unsupported(const common::AttentionParams& p, int head_dim);

// Why TMA cannot read tensor `name` (rows × heads × batch rows of 16-bit elements) with its strides
// ("" when it can): each stride of an axis longer than 1 positive and below 2^40 bytes.
std::string tma_layout_problem(const char* name, const common::RowHeadTensor& t, std::int64_t rows, int heads,
                               int batch, std::int64_t element_bytes);

// The launcher of one (dtype, head dim), instantiated in inst/sm90_fwd_hdim<d>_<dtype>.cu
// (sm90_fwd_launch.cuh defines it). split: the partials of a split-KV launch (num_splits 1: none;
// more only where built with FLASHATTN_SM90_FWD_SPLIT). rng_state: dropout's (seed, offset) on the
// device, or nullptr.
template <common::Storage kStorage, int kHeadDim>
cudaError_t run_fwd(const common::AttentionParams& p, const SplitKvPartials& split, const std::uint64_t* rng_state,
                    cudaStream_t stream);

}  // namespace flashattn::cuda::sm90
