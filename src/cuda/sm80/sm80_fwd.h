// src/cuda/sm80/sm80_fwd.h — the compiled sm80 forward kernels as the dispatcher sees them: one
// launcher per (storage type, instantiated head dim), defined in inst/*.cu.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/params.h"
#include "cuda/split_kv.h"
#include "cuda/sm80/sm80_tuning.h"

namespace flashattn::cuda::sm80 {

// Tiles and flags per head dim: fwd_tuning (sm80_tuning.h). The host needs the tiles to count
// CTAs and key tiles (split-KV heuristic); sm80_fwd_launch.cuh builds the kernels from them.
// full: softcap / ALiBi / dropout compiled in (half the key tile, for registers).
constexpr FwdTile fwd_tile(int head_dim, bool full) {
  return full ? fwd_tuning(head_dim).full : fwd_tuning(head_dim).plain;
}

// The forward's tiles for short sequences (fwd_tuning's short_tile): 64 rows with 4 warps where
// each row sees at most fwd_short_keys(head_dim) keys (fwd_keys_per_row), the plain tile beyond;
// 0: never (one tile for all lengths). With few key tiles per CTA its prologue and epilogue weigh
// more, and more CTAs per SM hide them; with many, the bigger tile reads K/V half as often.
// Unpacked, unpaged, not split-KV only. Measurements: src/cuda/README.md, "Tuning knobs".
constexpr int fwd_short_keys(int head_dim) { return fwd_tuning(head_dim).short_keys; }
constexpr FwdTile fwd_short_tile(int head_dim) { return fwd_tuning(head_dim).short_tile; }
// CTAs per SM that the short tile's registers are capped for (the d 256 one is held to two by its
// shared memory anyway).
constexpr int fwd_short_min_blocks(int head_dim) { return fwd_tuning(head_dim).short_min_blocks; }
constexpr bool fwd_has_short_tile(int head_dim) { return fwd_short_keys(head_dim) > 0; }

// The tile of the GQA-packed kernel (decoding: a few packed rows against a long cache).
constexpr FwdTile fwd_tile_packed(int head_dim) { return fwd_tuning(head_dim).packed; }

// Softcap and ALiBi compiled into the plain (unpacked) forward kernel, so that only dropout takes
// the full variant and its halved key tile; false sends all three to the full variant.
// (Family-wide; fwd_tuning has the same value at every head dim.)
constexpr bool kPlainScoreMod = fwd_tuning(128).plain_scoremod;
// The forward of a paged call launched beside its index check kernel (fwd_tuning's
// paged_check_overlap; family-wide).
constexpr bool kPagedCheckOverlap = fwd_tuning(128).paged_check_overlap;

// Whether p uses softcap, ALiBi or dropout (each depends on the head of every element).
inline bool has_score_mod_or_dropout(const common::AttentionParams& p) {
  return p.softcap > 0.0f || p.alibi_slopes != nullptr || p.dropout_p > 0.0f;
}

// Whether p runs in the forward's full variant (dropout compiled in; softcap and ALiBi too, which
// the plain variant has as well when kPlainScoreMod).
inline bool needs_full_variant(const common::AttentionParams& p) {
  return kPlainScoreMod ? p.dropout_p > 0.0f : has_score_mod_or_dropout(p);
}

// GQA packing of the forward (fwd_kernel's `pack`): 1, or the group size g when the g query heads
// of one kv head are served by one CTA whose rows are (query row, head) pairs. Packing is chosen
// when it needs fewer row blocks than g separate heads would — a short query (decoding, sq ≤ half
// a row block) — so that each K/V tile is read once per group instead of g times. Only the plain
// variant packs: softcap, ALiBi and dropout depend on the head of every element.
// block_m: the row block of the kernel (FwdTile::block_m).
inline int fwd_pack(const common::AttentionParams& p, int block_m) {
  const int g = p.heads_k > 0 ? p.group_size() : 1;
  // (The kernel's packed row index, max_seqlen_q · g, must stay below 2³² / g.)
  if (g <= 1 || has_score_mod_or_dropout(p) || p.max_seqlen_q <= 0 ||
      std::int64_t(p.max_seqlen_q) * g * g >= (std::int64_t(1) << 31)) {
    return 1;
  }
  const std::int64_t packed_blocks = (std::int64_t(p.max_seqlen_q) * g + block_m - 1) / block_m;
  const std::int64_t separate_blocks = std::int64_t(g) * ((p.max_seqlen_q + block_m - 1) / block_m);
  return packed_blocks < separate_blocks ? g : 1;
}

// Whether the plain, unpacked, unpaged forward of p at head_dim takes fwd_short_tile: the keys a
// row sees (fwd_keys_per_row: the whole sequence; causal on average; a window its width) are at
// most fwd_short_keys(head_dim). The caller has ruled out the full variant and packing.
inline std::int64_t fwd_keys_per_row(const common::AttentionParams& p) {
  std::int64_t keys = p.max_seqlen_k;
  // Causal, bottom-right aligned: row i of sq sees sk − sq + 1 + i keys, on average sk − (sq − 1) / 2.
  if (p.causal) keys -= (std::min(p.max_seqlen_q, p.max_seqlen_k) - 1) / 2;
  if (p.window_left >= 0) {
    keys = std::min<std::int64_t>(keys, std::int64_t(p.window_left) + 1 + std::max(p.window_right, 0));
  }
  return keys;
}
inline bool fwd_runs_short(const common::AttentionParams& p, int head_dim) {
  return fwd_has_short_tile(head_dim) && !p.is_paged() && fwd_keys_per_row(p) <= fwd_short_keys(head_dim);
}

// Shared memory of a forward tile, in bytes (FwdTraits::kSmemBytes, checked there): the Q tile,
// the K and V tiles, and two buffers of a key tile's page-table entries (kBlockN / 16 + 1 each).
constexpr int fwd_smem_bytes(int head_dim, FwdTile t) {
  return (t.block_m + 2 * t.block_n) * head_dim * 2 + 2 * (t.block_n / 16 + 1) * 4;
}

// Whether the forward of p runs the full variant on a device whose blocks may use `smem_limit`
// bytes of shared memory: when p needs it (needs_full_variant), and when the plain tile the call
// would take (GQA-packed or not) does not fit — the full variant's halved key tile does on GPUs of
// 99 KiB per block (d 256: 128 KiB plain, 96 KiB full); its softcap, ALiBi and dropout are off at
// run time when p has none.
inline bool fwd_runs_full(const common::AttentionParams& p, int head_dim, int smem_limit) {
  if (needs_full_variant(p)) return true;
  const FwdTile plain = fwd_tile(head_dim, false);
  const FwdTile tile = fwd_pack(p, plain.block_m) > 1 ? fwd_tile_packed(head_dim) : plain;
  return fwd_smem_bytes(head_dim, tile) > smem_limit;
}

// Division of dividends in [0, 2³¹) by a divisor d ≥ 1 known only at run time, as a multiply and a
// shift (Granlund and Montgomery): with l = ⌈log₂ d⌉ and m = ⌊2³² · (2^l − d) / d⌋ + 1,
// n / d = (⌊m · n / 2³²⌋ + n) >> l. Set up once (one 64-bit division); each quotient then costs a
// high multiply, an add and a shift, and a power of two (m = 1) a shift — one code path for both.
// The paged forward finds a key row's page with it.
struct FastDiv {
  std::uint32_t mul = 1;
  int shift = 0;
  FA_HOST_DEVICE explicit FastDiv(int d = 1) {
    while ((std::int64_t(1) << shift) < d) ++shift;
    mul = std::uint32_t((std::uint64_t((std::int64_t(1) << shift) - d) << 32) / std::uint64_t(d) + 1);
  }
  FA_HOST_DEVICE int div(int n) const {
#ifdef __CUDA_ARCH__
    const std::uint32_t high = __umulhi(mul, std::uint32_t(n));
#else
    const std::uint32_t high = std::uint32_t((std::uint64_t(mul) * std::uint32_t(n)) >> 32);
#endif
    return int((high + std::uint32_t(n)) >> shift);
  }
};

// The partials of a split-KV launch (cuda/split_kv.h, shared with the sm90 family).
using cuda::SplitKvPartials;

// Launches the forward kernel for p (device pointers) on stream. Returns the launch status.
template <common::Storage kStorage, int kHeadDim>
cudaError_t run_fwd(const common::AttentionParams& p, const std::uint64_t* rng_state, cudaStream_t stream);

// The split-KV forward: split.num_splits CTAs per (row block, head, batch), each over an equal
// share of the key tiles that block sees; writes only the partials (the combine kernel then
// writes p.out and p.lse). Defined in inst/sm80_fwd_split_*.cu.
template <common::Storage kStorage, int kHeadDim>
cudaError_t run_fwd_split(const common::AttentionParams& p, const SplitKvPartials& split,
                          const std::uint64_t* rng_state, cudaStream_t stream);

}  // namespace flashattn::cuda::sm80
