// tests/cuda/test_cuda_sm80_tuning.cpp — the sm80 family's tuning tables (src/cuda/sm80/sm80_tuning.h):
// the entries per head dim that src/cuda/README.md documents, the shared memory of every tile
// against the limits of sm80_smem.h, and the host-side helpers of sm80_fwd.h / sm80_bwd.h agreeing
// with the tables. Host only: runs without a GPU. The expectations are the defaults; a build that
// overrides a table entry (-DFLASHATTN_SM80_..., scripts/gpu-variants) skips them.
#include <gtest/gtest.h>

#include <tuple>

#include "cuda/sm80/sm80_bwd.h"
#include "cuda/sm80/sm80_fwd.h"
#include "cuda/sm80/sm80_tuning.h"
#include "cuda_test_util.h"

namespace {

namespace sm80 = flashattn::cuda::sm80;
using fa_test::cuda::kSmemA100;
using fa_test::cuda::kSmemH100;
using fa_test::cuda::kSmemSm86;

// Whether the build overrides an entry of the tables (then the default entries are not checked).
constexpr bool kOverridden =
#if defined(FLASHATTN_SM80_FWD64_BLOCK_N) || defined(FLASHATTN_SM80_FWD64_WARPS) ||                   \
    defined(FLASHATTN_SM80_FWD256_BLOCK_M) || defined(FLASHATTN_SM80_FWD_PACKED_TILE) ||              \
    defined(FLASHATTN_SM80_FWD64_SHORT_KEYS) || defined(FLASHATTN_SM80_FWD128_SHORT_KEYS) ||          \
    defined(FLASHATTN_SM80_FWD256_SHORT_KEYS) || defined(FLASHATTN_SM80_FWD64_SHORT_BLOCK_N) ||       \
    defined(FLASHATTN_SM80_FWD64_SHORT_MIN_BLOCKS) || defined(FLASHATTN_SM80_FWD128_SHORT_MIN_BLOCKS) || \
    defined(FLASHATTN_SM80_FWD_ROW_CHAINS) || defined(FLASHATTN_SM80_FWD_FIRST_RESCALE) ||            \
    defined(FLASHATTN_SM80_FWD_EARLY_V) || defined(FLASHATTN_SM80_FWD_LAZY_RESCALE) ||                \
    defined(FLASHATTN_SM80_FWD_PLAIN_SCOREMOD) || defined(FLASHATTN_SM80_FWD_PAGED_CHECK_OVERLAP) ||  \
    defined(FLASHATTN_SM80_BWD64_SDP_WARPS_M) ||                                                      \
    defined(FLASHATTN_SM80_BWD64_SPREAD_DQ) || defined(FLASHATTN_SM80_BWD64_LATE_LOAD) ||             \
    defined(FLASHATTN_SM80_BWD128_DKV_WARPS_N) || defined(FLASHATTN_SM80_BWD128_DQ_WARPS_M) ||        \
    defined(FLASHATTN_SM80_BWD128_SPREAD_DQ) || defined(FLASHATTN_SM80_BWD128_LATE_LOAD) ||           \
    defined(FLASHATTN_SM80_BWD_PLAIN_SCOREMOD)
    true;
#else
    false;
#endif

constexpr int kHeadDims[] = {64, 128, 256};

void expect_tile(sm80::FwdTile got, int block_m, int block_n, int warps, const char* what, int d) {
  EXPECT_EQ(got.block_m, block_m) << what << " d " << d;
  EXPECT_EQ(got.block_n, block_n) << what << " d " << d;
  EXPECT_EQ(got.warps, warps) << what << " d " << d;
}
void expect_tile(sm80::BwdTile got, int block_m, int block_n, const char* what, int d) {
  EXPECT_EQ(got.block_m, block_m) << what << " d " << d;
  EXPECT_EQ(got.block_n, block_n) << what << " d " << d;
}
// The tables are constant expressions (the launch headers take template arguments from them).
static_assert(sm80::fwd_tuning(128).plain.block_m > 0 && sm80::bwd_tuning(128).plain_tile.block_n > 0);

// --- forward ------------------------------------------------------------------------------------

// The entries src/cuda/README.md documents ("Tuning knobs"), one row per head dim.
struct FwdRow {
  int d;
  sm80::FwdTile plain, full, packed, short_tile;
  int short_keys, short_min_blocks, row_chains;
  bool first_tile_branch;
};
constexpr FwdRow kFwdRows[] = {
    {64, {128, 128, 4}, {128, 64, 4}, {64, 128, 4}, {64, 64, 4}, 384, 4, 1, false},
    {128, {128, 64, 4}, {128, 32, 4}, {64, 128, 4}, {64, 64, 4}, 384, 3, 4, true},
    {256, {128, 64, 8}, {128, 32, 8}, {64, 64, 4}, {64, 64, 4}, 4096, 1, 1, false},
};

TEST(CudaSm80Tuning, ForwardTableHasTheDocumentedEntries) {
  if (kOverridden) GTEST_SKIP() << "the build overrides a table entry";
  for (const FwdRow& want : kFwdRows) {
    const int d = want.d;
    const sm80::Sm80FwdTuning t = sm80::fwd_tuning(d);
    expect_tile(t.plain, want.plain.block_m, want.plain.block_n, want.plain.warps, "plain", d);
    expect_tile(t.full, want.full.block_m, want.full.block_n, want.full.warps, "full", d);
    expect_tile(t.packed, want.packed.block_m, want.packed.block_n, want.packed.warps, "packed", d);
    expect_tile(t.short_tile, want.short_tile.block_m, want.short_tile.block_n, want.short_tile.warps, "short", d);
    EXPECT_EQ(t.short_keys, want.short_keys) << d;
    EXPECT_EQ(t.short_min_blocks, want.short_min_blocks) << d;
    EXPECT_EQ(t.row_chains, want.row_chains) << d;
    EXPECT_EQ(t.first_tile_branch, want.first_tile_branch) << d;
    EXPECT_TRUE(t.early_v) << d;
    EXPECT_FALSE(t.lazy_rescale) << d;
    EXPECT_FALSE(t.plain_scoremod) << d;
    EXPECT_TRUE(t.paged_check_overlap) << d;
  }
}

// Head dims between the instantiated ones take the bucket above them.
TEST(CudaSm80Tuning, HeadDimsTakeTheBucketAbove) {
  for (int d : {8, 32, 64}) EXPECT_EQ(sm80::fwd_tuning(d).row_chains, sm80::fwd_tuning(64).row_chains) << d;
  for (int d : {72, 96, 128}) {
    EXPECT_EQ(sm80::fwd_tuning(d).short_keys, sm80::fwd_tuning(128).short_keys) << d;
    EXPECT_EQ(sm80::bwd_tuning(d).small_tile.block_n, sm80::bwd_tuning(128).small_tile.block_n) << d;
  }
  for (int d : {136, 192, 256}) {
    EXPECT_EQ(sm80::fwd_tuning(d).plain.warps, sm80::fwd_tuning(256).plain.warps) << d;
    EXPECT_EQ(sm80::bwd_tuning(d).dq_vec_sm90, sm80::bwd_tuning(256).dq_vec_sm90) << d;
  }
}

// Every forward tile is well formed (whole 16-row MMA tiles per warp, whole 16 × 16 dropout
// blocks, chains dividing a thread's columns) and fits its GPUs: the plain, packed and short
// tiles an A100, the full tile the 99 KiB GPUs (where the plain d 256 tile does not fit).
TEST(CudaSm80Tuning, ForwardTilesAreWellFormedAndFitTheirGpus) {
  for (int d : kHeadDims) {
    const sm80::Sm80FwdTuning t = sm80::fwd_tuning(d);
    for (const sm80::FwdTile& tile : {t.plain, t.full, t.packed, t.short_tile}) {
      EXPECT_EQ(tile.block_m % (16 * tile.warps), 0) << d;
      EXPECT_EQ(tile.block_n % 16, 0) << d;
      EXPECT_LE(sm80::fwd_smem_bytes(d, tile), kSmemH100) << d;
      // A thread holds block_n / 4 columns of a row (m16n8 fragments: two per 8-column tile).
      EXPECT_EQ((tile.block_n / 4) % t.row_chains, 0) << d;
    }
    EXPECT_LE(sm80::fwd_smem_bytes(d, t.plain), kSmemA100) << d;
    EXPECT_LE(sm80::fwd_smem_bytes(d, t.packed), kSmemSm86) << d;
    EXPECT_LE(sm80::fwd_smem_bytes(d, t.short_tile), kSmemSm86) << d;
    EXPECT_LE(sm80::fwd_smem_bytes(d, t.full), kSmemSm86) << d;
    EXPECT_GE(t.short_min_blocks, 1) << d;
    EXPECT_GE(t.short_keys, 0) << d;
    EXPECT_TRUE(!t.lazy_rescale || t.first_tile_branch) << d;
  }
  if (kOverridden) return;
  EXPECT_GT(sm80::fwd_smem_bytes(256, sm80::fwd_tuning(256).plain), kSmemSm86);  // 128 KiB: the full tile there
  EXPECT_EQ(sm80::fwd_smem_bytes(64, sm80::fwd_tuning(64).plain), 48 * 1024 + 2 * 9 * 4);
  EXPECT_EQ(sm80::fwd_smem_bytes(128, sm80::fwd_tuning(128).plain), 64 * 1024 + 2 * 5 * 4);
  EXPECT_EQ(sm80::fwd_smem_bytes(256, sm80::fwd_tuning(256).plain), 128 * 1024 + 2 * 5 * 4);
  EXPECT_EQ(sm80::fwd_smem_bytes(256, sm80::fwd_tuning(256).short_tile), 96 * 1024 + 2 * 5 * 4);
}

// fwd_tile, fwd_tile_packed, fwd_short_* and kPlainScoreMod (sm80_fwd.h) read the table.
TEST(CudaSm80Tuning, ForwardHelpersAgreeWithTheTable) {
  for (int d : kHeadDims) {
    const sm80::Sm80FwdTuning t = sm80::fwd_tuning(d);
    expect_tile(sm80::fwd_tile(d, false), t.plain.block_m, t.plain.block_n, t.plain.warps, "fwd_tile plain", d);
    expect_tile(sm80::fwd_tile(d, true), t.full.block_m, t.full.block_n, t.full.warps, "fwd_tile full", d);
    expect_tile(sm80::fwd_tile_packed(d), t.packed.block_m, t.packed.block_n, t.packed.warps, "fwd_tile_packed", d);
    expect_tile(sm80::fwd_short_tile(d), t.short_tile.block_m, t.short_tile.block_n, t.short_tile.warps,
                "fwd_short_tile", d);
    EXPECT_EQ(sm80::fwd_short_keys(d), t.short_keys) << d;
    EXPECT_EQ(sm80::fwd_short_min_blocks(d), t.short_min_blocks) << d;
    EXPECT_EQ(sm80::fwd_has_short_tile(d), t.short_keys > 0) << d;
    EXPECT_EQ(sm80::kPlainScoreMod, t.plain_scoremod) << d;  // family-wide
    EXPECT_EQ(sm80::kPagedCheckOverlap, t.paged_check_overlap) << d;
  }
}

// --- backward -----------------------------------------------------------------------------------

struct BwdRow {
  int d;
  sm80::BwdTile plain_tile, full_tile, small_tile;
  sm80::BwdSchedule plain, full;
  bool plain_one_stage, full_one_stage;
  int dq_vec_sm90;
};
constexpr BwdRow kBwdRows[] = {
    {64, {128, 128}, {64, 128}, {0, 0}, {2, 4, 4, true, false}, {2, 4, 4, false, false}, false, false, 4},
    {128, {64, 128}, {64, 128}, {64, 64}, {2, 4, 2, true, false}, {2, 4, 2, false, false}, false, true, 4},
    // dQ one float per reduction at d 256: the vector runs made the plain kernel spill.
    {256, {64, 64}, {64, 32}, {0, 0}, {4, 2, 2, true, true}, {4, 2, 2, true, true}, true, true, 1},
};

TEST(CudaSm80Tuning, BackwardTableHasTheDocumentedEntries) {
  if (kOverridden) GTEST_SKIP() << "the build overrides a table entry";
  for (const BwdRow& want : kBwdRows) {
    const int d = want.d;
    const sm80::Sm80BwdTuning t = sm80::bwd_tuning(d);
    expect_tile(t.plain_tile, want.plain_tile.block_m, want.plain_tile.block_n, "plain", d);
    expect_tile(t.full_tile, want.full_tile.block_m, want.full_tile.block_n, "full", d);
    expect_tile(t.small_tile, want.small_tile.block_m, want.small_tile.block_n, "small", d);
    for (const auto& [got, w, what] : {std::tuple{t.plain, want.plain, "plain"}, std::tuple{t.full, want.full, "full"}}) {
      EXPECT_EQ(got.sdp_warps_m, w.sdp_warps_m) << what << " d " << d;
      EXPECT_EQ(got.dkv_warps_n, w.dkv_warps_n) << what << " d " << d;
      EXPECT_EQ(got.dq_warps_m, w.dq_warps_m) << what << " d " << d;
      EXPECT_EQ(got.spread_dq, w.spread_dq) << what << " d " << d;
      EXPECT_EQ(got.late_load, w.late_load) << what << " d " << d;
    }
    EXPECT_EQ(t.plain_one_stage, want.plain_one_stage) << d;
    EXPECT_EQ(t.full_one_stage, want.full_one_stage) << d;
    EXPECT_EQ(t.dq_vec_sm90, want.dq_vec_sm90) << d;
    EXPECT_FALSE(t.plain_scoremod) << d;
  }
}

// Every backward tile and arrangement satisfies BwdTraits' constraints (8 warps; whole 16-wide
// MMA tiles per warp in each product; 32-row copy waves), and the shared memory sizes are the ones
// sm80_bwd.h lists.
TEST(CudaSm80Tuning, BackwardTilesAreWellFormed) {
  constexpr int kWarps = 8;
  for (int d : kHeadDims) {
    const sm80::Sm80BwdTuning t = sm80::bwd_tuning(d);
    struct Case {
      sm80::BwdTile tile;
      sm80::BwdSchedule s;
    };
    for (const Case& c : {Case{t.plain_tile, t.plain}, Case{t.full_tile, t.full}, Case{t.small_tile, t.full}}) {
      if (c.tile.block_n == 0) continue;  // no small tile
      EXPECT_EQ(c.tile.block_m % 64, 0) << d;
      EXPECT_EQ(c.tile.block_n % 32, 0) << d;
      EXPECT_EQ(c.tile.block_m % (16 * c.s.sdp_warps_m), 0) << d;
      EXPECT_EQ(c.tile.block_n % (16 * (kWarps / c.s.sdp_warps_m)), 0) << d;
      EXPECT_EQ(c.tile.block_n % (16 * c.s.dkv_warps_n), 0) << d;
      EXPECT_EQ(d % (16 * (kWarps / c.s.dkv_warps_n)), 0) << d;
      EXPECT_EQ(c.tile.block_m % (16 * c.s.dq_warps_m), 0) << d;
      EXPECT_EQ(d % (16 * (kWarps / c.s.dq_warps_m)), 0) << d;
    }
    EXPECT_TRUE(t.dq_vec_sm90 == 1 || t.dq_vec_sm90 == 4) << d;
    // The small tile is a fallback: only where the full tile needs more than the 99 KiB GPUs have.
    if (t.small_tile.block_n > 0) {
      EXPECT_TRUE(t.full_one_stage) << d;
      EXPECT_GT(sm80::bwd_smem_bytes(d, t.full_tile, 1), kSmemSm86) << d;
      EXPECT_LE(sm80::bwd_smem_bytes(d, t.small_tile, 1), kSmemSm86) << d;
    }
  }
  if (kOverridden) return;
  constexpr int KiB = 1024;
  EXPECT_EQ(sm80::bwd_smem_bytes(64, sm80::bwd_tuning(64).plain_tile, 2), 162 * KiB);
  EXPECT_EQ(sm80::bwd_smem_bytes(64, sm80::bwd_tuning(64).full_tile, 2), 97 * KiB);
  EXPECT_EQ(sm80::bwd_smem_bytes(128, sm80::bwd_tuning(128).plain_tile, 2), 161 * KiB);
  EXPECT_EQ(sm80::bwd_smem_bytes(128, sm80::bwd_tuning(128).full_tile, 1), 128 * KiB + KiB / 2);
  EXPECT_EQ(sm80::bwd_smem_bytes(128, sm80::bwd_tuning(128).small_tile, 1), 80 * KiB + KiB / 2);
  EXPECT_EQ(sm80::bwd_smem_bytes(256, sm80::bwd_tuning(256).plain_tile, 2), 209 * KiB);
  EXPECT_EQ(sm80::bwd_smem_bytes(256, sm80::bwd_tuning(256).plain_tile, 1), 144 * KiB + KiB / 2);
  EXPECT_EQ(sm80::bwd_smem_bytes(256, sm80::bwd_tuning(256).full_tile, 2), 169 * KiB);
  EXPECT_EQ(sm80::bwd_smem_bytes(256, sm80::bwd_tuning(256).full_tile, 1), 104 * KiB + KiB / 2);
  // Every plain tile fits an H100 with two stages; the d 256 one an A100 only with one.
  for (int d : kHeadDims) EXPECT_LE(sm80::bwd_smem_bytes(d, sm80::bwd_tuning(d).plain_tile, 2), kSmemH100) << d;
  EXPECT_GT(sm80::bwd_smem_bytes(256, sm80::bwd_tuning(256).plain_tile, 2), kSmemA100);
}

// bwd_tile, bwd_has_small, bwd_has_one_stage, bwd_min_smem_bytes and bwd_choice (sm80_bwd.h) read
// the table: the choice is a configuration the table compiles, and it fits where anything does.
TEST(CudaSm80Tuning, BackwardHelpersAgreeWithTheTable) {
  for (int d : kHeadDims) {
    const sm80::Sm80BwdTuning t = sm80::bwd_tuning(d);
    const sm80::BwdTile plain = sm80::bwd_tile(d, false), full = sm80::bwd_tile(d, true);
    expect_tile(plain, t.plain_tile.block_m, t.plain_tile.block_n, "bwd_tile plain", d);
    expect_tile(full, t.full_tile.block_m, t.full_tile.block_n, "bwd_tile full", d);
    EXPECT_EQ(sm80::bwd_has_small(d), t.small_tile.block_n > 0) << d;
    const sm80::BwdTile small = sm80::bwd_tile(d, true, true);
    const sm80::BwdTile want_small = t.small_tile.block_n > 0 ? t.small_tile : t.full_tile;
    expect_tile(small, want_small.block_m, want_small.block_n, "bwd_tile small", d);
    EXPECT_EQ(sm80::bwd_has_one_stage(d, false), t.plain_one_stage) << d;
    EXPECT_EQ(sm80::bwd_has_one_stage(d, true), t.full_one_stage) << d;
    const int min_bytes = sm80::bwd_smem_bytes(d, t.small_tile.block_n > 0 ? t.small_tile : t.full_tile,
                                               t.full_one_stage ? 1 : 2);
    EXPECT_EQ(sm80::bwd_min_smem_bytes(d), min_bytes) << d;
    for (int limit : {kSmemSm86, kSmemA100, kSmemH100}) {
      for (bool needs_full : {false, true}) {
        const sm80::BwdChoice c = sm80::bwd_choice(d, needs_full, limit);
        EXPECT_TRUE(c.full || !needs_full) << d << " " << limit;
        EXPECT_TRUE(c.stages == 2 || (c.full ? t.full_one_stage : t.plain_one_stage)) << d << " " << limit;
        EXPECT_TRUE(!c.small || (t.small_tile.block_n > 0 && c.full && c.stages == 1)) << d << " " << limit;
        if (min_bytes <= limit) {
          EXPECT_LE(sm80::bwd_smem_bytes(d, sm80::bwd_tile(d, c.full, c.small), c.stages), limit)
              << d << " " << limit;
        }
      }
    }
  }
}

}  // namespace
