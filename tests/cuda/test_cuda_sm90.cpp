// tests/cuda/test_cuda_sm90.cpp — the Hopper (sm90) kernel family: the ordered family choice
// (cuda/family.h) picks it for the calls it serves on an sm90 GPU and says why where it does not;
// forced (FLASHATTN_CUDA_FAMILY=sm90), its forward matches the fp64 reference by the accuracy rule
// of SPEC §7 over the shape grid (odd lengths, head dims rounded up, d ≠ dv, GQA, causal), windows
// and strided layouts, outputs poisoned. Without an sm90 GPU the tests say they were not run.
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "cuda/device_query.h"
#include "cuda/family.h"
#include "cuda/sm80/sm80_family.h"
#include "cuda/sm90/sm90_fwd.h"
#include "cuda/sm90/sm90_registry.h"
#include "cuda_grid.h"
#include "cuda_test_util.h"
#include "flashattn/error.h"

namespace fa_test::cuda {
namespace {

namespace c = flashattn::common;
namespace fc = flashattn::cuda;
using flashattn::DType;

// Params of a dense MHA call, for the host-side rules (no tensors).
c::AttentionParams host_params(int batch, int heads, int head_dim, int seqlen) {
  c::AttentionParams p;
  p.batch = batch;
  p.heads = p.heads_k = heads;
  p.head_dim = p.head_dim_v = head_dim;
  p.max_seqlen_q = p.max_seqlen_k = seqlen;
  return p;
}

// The validated params of a problem (host pointers: the choice reads shapes and strides only).
c::AttentionParams params_of(const AttnProblem& p, ForwardResult& r) {
  flashattn::ForwardOutputs outs{r.out.tv(), r.lse.tv()};
  return flashattn::detail::validate_forward(p.forward_inputs(), outs, p.opt).params;
}

void expect_sm90_matches(const AttnConfig& cfg) {
  const AttnProblem p = make_problem(cfg);
  SCOPED_TRACE(describe(p.cfg));
  const FamilyOverride family("sm90");
  const ForwardResult r = run_cuda_forward(p);
  EXPECT_TRUE(check_forward(p, r));
}

// --- the family choice --------------------------------------------------------------------------

TEST(CudaFamily, RejectsUnknownFamilyName) {
  // Needs no GPU: the variable is read before anything is asked of the device.
  const FamilyOverride family("sm70");
  AttnConfig cfg = feature_config(DType::bf16, 128, 64, 64);
  const AttnProblem p = make_problem(cfg);
  ForwardResult r = make_forward_outputs(p);
  const c::AttentionParams dp = params_of(p, r);
  try {
    (void)fc::choose_forward_family(dp);
    ADD_FAILURE() << "FLASHATTN_CUDA_FAMILY=sm70 was accepted";
  } catch (const flashattn::Error& e) {
    EXPECT_NE(std::string(e.what()).find("FLASHATTN_CUDA_FAMILY=sm70"), std::string::npos) << e.what();
  }
}

// Needs no GPU: where the sm90 family cannot run (no compute capability 9.0 GPU, or no sm_90a
// kernels in the build), the ordered choice gives a plain call to sm80, and sm90 says why.
TEST(CudaFamily, Sm80ServesWhereSm90CannotRun) {
  std::string why;
  if (sm90_available(&why)) GTEST_SKIP() << "NOT RUN: this GPU and build run the sm90 family (tested below)";
  AttnConfig cfg = feature_config(DType::bf16, 128, 256, 256);
  const AttnProblem p = make_problem(cfg);
  ForwardResult r = make_forward_outputs(p);
  const c::AttentionParams dp = params_of(p, r);
  const fc::FamilyChoice choice = fc::choose_forward_family(dp);
  ASSERT_TRUE(choice.served) << choice.why_not;
  EXPECT_EQ(choice.family, fc::Family::sm80);
  int head_dim = 0;
  const std::string sm90_why = fc::forward_refusal(fc::Family::sm90, dp, &head_dim, true);
  EXPECT_TRUE(sm90_why.find("compute capability 9.0") != std::string::npos ||
              sm90_why.find("no sm90") != std::string::npos)
      << sm90_why;
  const FamilyOverride family("sm90");
  EXPECT_FALSE(fc::choose_forward_family(dp).served);
}

// The sm90 family's host-side decisions (pure functions of the call, no GPU needed).
TEST(CudaSm90Host, FeaturesItDoesNotServeYetAreNamed) {
  AttnConfig cfg = feature_config(DType::bf16, 128, 256, 256);
  const AttnProblem p = make_problem(cfg);
  ForwardResult r = make_forward_outputs(p);
  const c::AttentionParams plain = params_of(p, r);
  EXPECT_EQ(fc::sm90::fwd_unsupported(plain, 128), "");
  const float slopes[4] = {0.5f, 0.25f, 0.125f, 0.0625f};
  c::AttentionParams scored = plain;
  scored.softcap = 30.0f;
  scored.alibi_slopes = slopes;
  scored.dropout_p = 0.1f;
  EXPECT_EQ(fc::sm90::fwd_unsupported(scored, 128), "");  // softcap, ALiBi and dropout are served
  const std::int32_t seqlens[3] = {0, 100, 256};
  const std::pair<std::function<void(c::AttentionParams&)>, const char*> cases[] = {
      {[](c::AttentionParams& q) { q.max_seqlen_k = 0; }, "no keys"},
      {[&](c::AttentionParams& q) {
         q.cu_seqlens_q = q.cu_seqlens_k = seqlens;
         q.total_q = q.total_k = std::int64_t(1) << 31;
       },
       "2^31"},
      {[&](c::AttentionParams& q) {
         q.cache_seqlens = seqlens;
         q.cu_seqlens_q = q.cu_seqlens_k = seqlens;
         q.total_q = q.total_k = 256;
       },
       "varlen queries over a KV cache"},
      {[](c::AttentionParams& q) { q.k.row_stride = 0; }, "k: its strides"},
      {[](c::AttentionParams& q) { q.v.head_stride = std::int64_t(1) << 40; }, "v: its strides"},
  };
  for (const auto& [change, expected] : cases) {
    c::AttentionParams q = plain;
    change(q);
    const std::string why = fc::sm90::fwd_unsupported(q, 128);
    EXPECT_NE(why.find(expected), std::string::npos) << "expected \"" << expected << "\" in: " << why;
  }
  // The 192 instantiation holds dv ≤ 128 (fwd_head_dim_v); the family rounds such calls up to 256.
  c::AttentionParams wide = plain;
  wide.head_dim = wide.head_dim_v = 192;
  EXPECT_NE(fc::sm90::fwd_unsupported(wide, 192).find("exceed the instantiation's 192 / 128"), std::string::npos);
  EXPECT_EQ(fc::sm90::fwd_unsupported(wide, 256), "");
  wide.head_dim_v = 128;
  EXPECT_EQ(fc::sm90::fwd_unsupported(wide, 192), "");
  // A stride of an axis of extent 1 is never used: no reason to decline.
  c::AttentionParams one_batch = plain;
  one_batch.batch = 1;
  one_batch.q.batch_stride = 0;
  EXPECT_EQ(fc::sm90::fwd_unsupported(one_batch, 128), "");
  // Varlen batches and seqused_k are served: the packed rows are one batch of the TMA tensors.
  c::AttentionParams packed = plain;
  packed.batch = 2;
  packed.cu_seqlens_q = packed.cu_seqlens_k = seqlens;
  packed.seqused_k = seqlens + 1;
  packed.total_q = packed.total_k = 256;
  packed.q.batch_stride = packed.k.batch_stride = packed.v.batch_stride = 0;
  EXPECT_EQ(fc::sm90::fwd_unsupported(packed, 128), "");
  // Paged caches: served where built with FLASHATTN_SM90_FWD_PAGED, for page sizes that are
  // multiples of 16 rows (as a TMA view of one page per "batch": its strides checked as any other).
  {
    c::AttentionParams paged = plain;
    paged.block_table = seqlens;
    paged.block_table_batch_stride = 1;
    paged.cache_seqlens = seqlens;
    paged.cache_batches = 40;
    paged.page_size = 16;
    const std::string why = fc::sm90::fwd_unsupported(paged, 128);
    if (fc::sm90::fwd_paged_built()) {
      EXPECT_EQ(why, "");
      for (int page : {8, 24, 0}) {
        paged.page_size = page;
        EXPECT_NE(fc::sm90::fwd_unsupported(paged, 128).find("multiples of 16"), std::string::npos) << page;
      }
      paged.page_size = 32;
      paged.cache_batches = 0;
      EXPECT_NE(fc::sm90::fwd_unsupported(paged, 128).find("pages for a TMA descriptor"), std::string::npos);
      paged.cache_batches = 40;
      paged.k.batch_stride = 0;  // one page per batch: a zero page stride is refused like any other
      EXPECT_NE(fc::sm90::fwd_unsupported(paged, 128).find("k: its strides"), std::string::npos);
      // A varlen call over pages needs no cu_seqlens_k (seqused_k gives the key counts).
      c::AttentionParams prefill = plain;
      prefill.batch = 2;
      prefill.cu_seqlens_q = seqlens;
      prefill.seqused_k = seqlens + 1;
      prefill.total_q = 256;
      prefill.q.batch_stride = 0;
      prefill.block_table = seqlens;
      prefill.block_table_batch_stride = 1;
      prefill.cache_batches = 40;
      prefill.page_size = 64;
      EXPECT_EQ(fc::sm90::fwd_unsupported(prefill, 128), "");
    } else {
      EXPECT_NE(why.find("paged KV caches are not in this family yet"), std::string::npos) << why;
    }
  }
  // KV caches (not paged): cache_seqlens and cache_batch_idx are served.
  c::AttentionParams cached = plain;
  cached.cache_seqlens = seqlens;
  cached.cache_batch_idx = seqlens;
  cached.cache_batches = 5;
  EXPECT_EQ(fc::sm90::fwd_unsupported(cached, 128), "");
  // Built to store O by TMA (by default: d 256, d 192 with softcap, ALiBi or dropout;
  // FLASHATTN_SM90_FWD_TMA_STORE=1: every one): a dense call's out needs TMA's strides and 16-byte
  // alignment; varlen calls keep the thread stores and any out.
  for (int d : {128, 192, 256}) {
    for (bool score_mod : {false, true}) {
      SCOPED_TRACE("d " + std::to_string(d) + (score_mod ? ", softcap" : ""));
      c::AttentionParams base = plain, base_packed = packed;
      if (score_mod) base.softcap = base_packed.softcap = 30.0f;
      c::AttentionParams odd_out = base;
      odd_out.out.row_stride += 1;
      c::AttentionParams odd_packed = base_packed;
      odd_packed.out.row_stride += 1;
      EXPECT_EQ(fc::sm90::fwd_unsupported(odd_packed, d), "");
      if (fc::sm90::fwd_tma_store_built(d, score_mod)) {
        EXPECT_NE(fc::sm90::fwd_unsupported(odd_out, d).find("out: its address and strides"), std::string::npos);
        odd_out = base;
        odd_out.out.head_stride = 0;
        EXPECT_NE(fc::sm90::fwd_unsupported(odd_out, d).find("out: its strides"), std::string::npos);
      } else {
        EXPECT_EQ(fc::sm90::fwd_unsupported(odd_out, d), "");
      }
    }
  }
}

TEST(CudaSm90Host, TilesAndPingPongByHeadDim) {
  for (int d : {64, 96, 128, 192, 256}) {
    const fc::sm90::FwdTileShape t = fc::sm90::fwd_tile(d);
    const int dv = fc::sm90::fwd_head_dim_v(d);
    EXPECT_EQ(t.block_m % 64, 0) << d;  // consumer warpgroups of 64 rows: two, or three at d 64
    EXPECT_LE(t.block_m, d == 64 ? 192 : 128) << d;
    EXPECT_EQ(t.block_n % 16, 0) << d;
    // Q, K and V stages within the 227 KiB of an H100/H200 (the kernel's static_assert says the same).
    EXPECT_LE(2 * (t.block_m * d + t.stages * t.block_n * (d + dv)), 227 * 1024) << d;
  }
  // The 192 instantiation is 192 / 128 (MLA's prefill); a call is rounded up to one that holds d
  // and dv.
  static_assert(fc::sm90::fwd_head_dim_v(192) == 128 && fc::sm90::fwd_head_dim_v(128) == 128);
  static_assert(fc::sm90::fwd_head_dim_need(192, 128) == 192 && fc::sm90::fwd_head_dim_need(160, 96) == 160);
  static_assert(fc::sm90::fwd_head_dim_need(192, 192) == 256 && fc::sm90::fwd_head_dim_need(128, 160) == 256);
  static_assert(fc::sm90::fwd_head_dim_need(96, 128) == 128 && fc::sm90::fwd_head_dim_need(256, 128) == 256);
  // Turns only in the softcap/ALiBi/dropout kernels, and only where there are two 64-row
  // warpgroups (d 128; d 64 with its 128-row tile) and registers for them (not d 256).
  static_assert(fc::sm90::fwd_pingpong(128, true));
  static_assert(fc::sm90::fwd_pingpong(64, true) == (fc::sm90::fwd_tile(64).block_m == 128));
  static_assert(!fc::sm90::fwd_pingpong(256, true) && !fc::sm90::fwd_pingpong(128, false));
  // O rescaled lazily where dv is 256 (the step rescales 128 fp32 a thread over 64 or 80 keys), not
  // at dv 64 or 128, where it measured slower or level.
  static_assert(fc::sm90::fwd_lazy_rescale(256) && !fc::sm90::fwd_lazy_rescale(128) &&
                !fc::sm90::fwd_lazy_rescale(64));
  {
    const EnvOverride unset("FLASHATTN_SM90_FWD_WALK", "");
    EXPECT_TRUE(fc::sm90::fwd_snake_walk());
  }
  {
    const EnvOverride plain("FLASHATTN_SM90_FWD_WALK", "plain");
    EXPECT_FALSE(fc::sm90::fwd_snake_walk());
  }
}

// Split-KV in the sm90 forward (FLASHATTN_SM90_FWD_SPLIT): the count asked for (capped), else the
// heuristic over one CTA per SM; none where the build lacks it.
TEST(CudaSm90Host, SplitsOnlyWhereBuilt) {
  c::AttentionParams p;
  p.batch = 1;
  p.heads = p.heads_k = 8;
  p.head_dim = p.head_dim_v = 128;
  p.max_seqlen_q = 1;
  p.max_seqlen_k = 65536;  // 512 key tiles of 128
  c::AttentionParams forced = p;
  forced.num_splits = 7;
  if (!fc::sm90::fwd_split_built()) {
    EXPECT_EQ(fc::sm90::fwd_num_splits(p, 128, 132), 1);
    EXPECT_EQ(fc::sm90::fwd_num_splits(forced, 128, 132), 1);
    return;
  }
  const int splits = fc::sm90::fwd_num_splits(p, 128, 132);
  EXPECT_GT(splits, 1);
  EXPECT_EQ(splits, fc::num_splits_heuristic(8, 512, 132, fc::kMaxSplits));
  EXPECT_EQ(fc::sm90::fwd_num_splits(forced, 128, 132), 7);
  forced.num_splits = 100000;
  EXPECT_EQ(fc::sm90::fwd_num_splits(forced, 128, 132), fc::kMaxSplits);
  c::AttentionParams full = p;  // 32 row blocks × 16 heads × 4 sequences: several waves
  full.batch = 4;
  full.heads = full.heads_k = 16;
  full.max_seqlen_q = full.max_seqlen_k = 4096;
  EXPECT_EQ(fc::sm90::fwd_num_splits(full, 128, 132), 1);
}

// A per-call tile rule (`choice`) refuses every spoiled copy of p, and p's varlen forms
// (seqused_k, cu_seqlens) too.
using Spoil = std::pair<const char*, std::function<void(c::AttentionParams&)>>;
void expect_refusals(const c::AttentionParams& p, const std::function<bool(const c::AttentionParams&)>& choice,
                     const std::vector<Spoil>& spoils) {
  for (const auto& [name, spoil] : spoils) {
    c::AttentionParams q = p;
    spoil(q);
    EXPECT_FALSE(choice(q)) << name;
  }
  const std::int32_t lengths[2] = {0, p.max_seqlen_k};
  c::AttentionParams kv = p;
  kv.seqused_k = lengths;
  EXPECT_FALSE(choice(kv)) << "seqused_k";
  c::AttentionParams varlen = p;
  varlen.cu_seqlens_q = varlen.cu_seqlens_k = lengths;
  EXPECT_FALSE(choice(varlen)) << "varlen";
}

// The tall d 64 tile (fwd_d64_tall): dense calls without a window or score mods whose queries and
// keys reach FLASHATTN_SM90_FWD_D64_TALL_FROM (8192 by default; 0: never), causal ones
// FLASHATTN_SM90_FWD_D64_TALL_CAUSAL_FROM (likewise); never split, with a window, varlen,
// with seqused_k or a KV cache, paged or with softcap, ALiBi or dropout; never where the build
// leaves it out.
TEST(CudaSm90Host, TallD64TileForLongDenseCalls) {
  const c::AttentionParams p = host_params(1, 32, 64, 8192);
  const EnvOverride unset("FLASHATTN_SM90_FWD_D64_TALL_FROM", "");
  const EnvOverride unset_causal("FLASHATTN_SM90_FWD_D64_TALL_CAUSAL_FROM", "");
  const bool built = fc::sm90::fwd_d64_tall_built();
  EXPECT_EQ(fc::sm90::fwd_d64_tall(p, 1), built);
  EXPECT_FALSE(fc::sm90::fwd_d64_tall(p, 2)) << "split";
  expect_refusals(p, [](const c::AttentionParams& q) { return fc::sm90::fwd_d64_tall(q, 1); },
                  {{"fewer queries", [](c::AttentionParams& q) { q.max_seqlen_q = 8191; }},
                   {"fewer keys", [](c::AttentionParams& q) { q.max_seqlen_k = 4096; }},
                   {"window", [](c::AttentionParams& q) { q.window_left = 100; }},
                   {"softcap", [](c::AttentionParams& q) { q.softcap = 30.0f; }},
                   {"dropout", [](c::AttentionParams& q) { q.dropout_p = 0.1f; }}});
  {
    const EnvOverride never("FLASHATTN_SM90_FWD_D64_TALL_FROM", "0");
    EXPECT_FALSE(fc::sm90::fwd_d64_tall(p, 1));
  }
  const EnvOverride early("FLASHATTN_SM90_FWD_D64_TALL_FROM", "100");
  c::AttentionParams short_call = p;
  short_call.max_seqlen_q = short_call.max_seqlen_k = 100;
  EXPECT_EQ(fc::sm90::fwd_d64_tall(short_call, 1), built);
  // Causal calls: their own threshold (8192 by default, as the unmasked one); windows never.
  c::AttentionParams causal = p;
  causal.causal = true;
  EXPECT_EQ(fc::sm90::fwd_d64_tall(causal, 1), built) << "causal, FLASHATTN_SM90_FWD_D64_TALL_CAUSAL_FROM unset";
  c::AttentionParams causal_4k = causal;
  causal_4k.max_seqlen_q = causal_4k.max_seqlen_k = 4096;
  EXPECT_FALSE(fc::sm90::fwd_d64_tall(causal_4k, 1)) << "causal 4096, FLASHATTN_SM90_FWD_D64_TALL_CAUSAL_FROM unset";
  {
    const EnvOverride never("FLASHATTN_SM90_FWD_D64_TALL_CAUSAL_FROM", "0");
    EXPECT_FALSE(fc::sm90::fwd_d64_tall(causal, 1)) << "causal, FLASHATTN_SM90_FWD_D64_TALL_CAUSAL_FROM=0";
  }
  const EnvOverride causal_from("FLASHATTN_SM90_FWD_D64_TALL_CAUSAL_FROM", "4096");
  EXPECT_EQ(fc::sm90::fwd_d64_tall(causal_4k, 1), built);
  c::AttentionParams window = causal;
  window.window_left = 100;
  EXPECT_FALSE(fc::sm90::fwd_d64_tall(window, 1)) << "causal with a window";
  causal.max_seqlen_k = 4000;
  EXPECT_FALSE(fc::sm90::fwd_d64_tall(causal, 1)) << "causal, fewer keys than the causal threshold";
  causal.max_seqlen_k = 8192;
  causal.softcap = 30.0f;
  EXPECT_FALSE(fc::sm90::fwd_d64_tall(causal, 1)) << "causal with softcap";
}

// The wide d 256 tile (fwd_d256_wide): dense calls without score mods whose keys reach
// FLASHATTN_SM90_FWD_D256_WIDE_FROM (2048 by default; 0: never), masked or not; never split,
// varlen, with seqused_k or a KV cache, paged or with softcap, ALiBi or dropout; never where the
// build leaves it out.
TEST(CudaSm90Host, WideD256TileForDenseCallsWithManyKeys) {
  const c::AttentionParams p = host_params(1, 8, 256, 2048);
  const EnvOverride unset("FLASHATTN_SM90_FWD_D256_WIDE_FROM", "");
  const bool built = fc::sm90::fwd_d256_wide_built();
  EXPECT_EQ(fc::sm90::fwd_d256_wide(p, 1), built);
  EXPECT_FALSE(fc::sm90::fwd_d256_wide(p, 2)) << "split";
  c::AttentionParams causal = p;
  causal.causal = true;
  EXPECT_EQ(fc::sm90::fwd_d256_wide(causal, 1), built) << "causal";
  c::AttentionParams window = p;
  window.window_left = 300;
  EXPECT_EQ(fc::sm90::fwd_d256_wide(window, 1), built) << "window";
  expect_refusals(p, [](const c::AttentionParams& q) { return fc::sm90::fwd_d256_wide(q, 1); },
                  {{"fewer keys", [](c::AttentionParams& q) { q.max_seqlen_k = 2047; }},
                   {"softcap", [](c::AttentionParams& q) { q.softcap = 30.0f; }},
                   {"dropout", [](c::AttentionParams& q) { q.dropout_p = 0.1f; }}});
  {
    const EnvOverride never("FLASHATTN_SM90_FWD_D256_WIDE_FROM", "0");
    EXPECT_FALSE(fc::sm90::fwd_d256_wide(p, 1));
  }
  const EnvOverride early("FLASHATTN_SM90_FWD_D256_WIDE_FROM", "100");
  c::AttentionParams short_call = p;
  short_call.max_seqlen_q = 1;
  short_call.max_seqlen_k = 100;
  EXPECT_EQ(fc::sm90::fwd_d256_wide(short_call, 1), built);
}

// The masked order's sections (fwd_l2_sections): at every length the pairs whose K/V fit in 16 MiB
// where that leaves a section 1.5 rounds of tiles given the SM count, else in 32 MiB; whole groups
// of query heads under GQA, at least one kv head's, alternating directions, and
// FLASHATTN_SM90_FWD_L2_SECTION_MB / _ROWS / _ALT to size them, switch them off (by size or past a
// row-block limit) or keep every section highest first.
// Paged TMA boxes: 64 rows where the page size is a multiple of 64 and 16 otherwise, by default
// (and with FLASHATTN_SM90_FWD_PAGE_BOX=64); 16 everywhere with the knob at 16.
TEST(CudaSm90Host, PagedBoxesOf64RowsWherePagesAllow) {
  for (const char* value : {"", "64"}) {
    const EnvOverride wide("FLASHATTN_SM90_FWD_PAGE_BOX", value);
    for (int page : {64, 128, 192, 256, 1024}) EXPECT_EQ(fc::sm90::fwd_page_box_rows(page), 64) << page << " " << value;
    for (int page : {16, 32, 48, 80, 208}) EXPECT_EQ(fc::sm90::fwd_page_box_rows(page), 16) << page << " " << value;
  }
  const EnvOverride narrow("FLASHATTN_SM90_FWD_PAGE_BOX", "16");
  for (int page : {16, 64, 256}) EXPECT_EQ(fc::sm90::fwd_page_box_rows(page), 16) << page;
}

// The dynamic schedule's counter (fwd_tile_counter): none without FLASHATTN_SM90_FWD_DYNAMIC; in
// such a build one per stream, the same for every call on it, for masked and varlen calls only,
// and none under FLASHATTN_SM90_FWD_SCHEDULE=static.
TEST(CudaSm90Host, DynamicScheduleCounterPerStreamForMaskedCalls) {
  c::AttentionParams p = host_params(2, 4, 128, 512);
  p.causal = true;
  const EnvOverride unset("FLASHATTN_SM90_FWD_SCHEDULE", "");
  if (!fc::sm90::fwd_dynamic_built()) {
    EXPECT_EQ(fc::sm90::fwd_tile_counter(p, nullptr), nullptr);
    return;
  }
  std::string why;
  if (!sm90_available(&why)) GTEST_SKIP() << "NOT RUN: the counters live on an sm90 GPU (" << why << ")";
  int* const counter = fc::sm90::fwd_tile_counter(p, nullptr);
  ASSERT_NE(counter, nullptr);
  EXPECT_EQ(fc::sm90::fwd_tile_counter(p, nullptr), counter);
  cudaStream_t other = nullptr;
  ASSERT_EQ(cudaStreamCreate(&other), cudaSuccess);
  int* const on_other = fc::sm90::fwd_tile_counter(p, other);
  EXPECT_NE(on_other, nullptr);
  EXPECT_NE(on_other, counter);
  cudaStreamDestroy(other);
  {
    const EnvOverride fixed("FLASHATTN_SM90_FWD_SCHEDULE", "static");
    EXPECT_EQ(fc::sm90::fwd_tile_counter(p, nullptr), nullptr);
  }
  p.causal = false;  // every tile alike: the static walk
  EXPECT_EQ(fc::sm90::fwd_tile_counter(p, nullptr), nullptr);
}

// The FastDivmod decode of a tile's index (fwd_fast_divmod: the d 64 kernels) against the division's
// on every index of many orders: masked or not, GQA, odd row counts, whole and partial last
// sections, sections of one pair and of all, alternating or not, split-KV.
TEST(CudaSm90Host, FastDivmodTileDecodeMatchesDivision) {
  int orders = 0;
  for (const auto& [heads, heads_k] : std::vector<std::pair<int, int>>{{16, 16}, {32, 8}, {6, 3}, {5, 1}}) {
    for (int batch : {1, 3, 7}) {
      for (int sq : {1, 127, 128, 129, 1000, 4096}) {
        for (int block_m : {64, 128, 192}) {
          const int pairs = heads * batch;
          for (int section : {1, 3, pairs / 2 + 1, pairs}) {
            for (int splits : {1, 3}) {
              for (bool causal : {false, true}) {
                for (bool alternate : {false, true}) {
                  c::AttentionParams p = host_params(batch, heads, 128, sq);
                  p.heads_k = heads_k;
                  p.causal = causal;
                  ASSERT_EQ(fc::sm90::fwd_fast_divmod_mismatch(p, block_m, section, splits, alternate), -1)
                      << "h " << heads << "/" << heads_k << " b " << batch << " sq " << sq << " block_m " << block_m
                      << " section " << section << " splits " << splits << " causal " << causal << " alternate "
                      << alternate;
                  ++orders;
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(orders, 4 * 3 * 6 * 3 * 4 * 2 * 2 * 2);
}

TEST(CudaSm90Host, MaskedOrderSectionsFitL2AtEveryLength) {
  c::AttentionParams p;
  p.batch = 32;
  p.heads = p.heads_k = 16;
  p.head_dim = p.head_dim_v = 128;
  p.max_seqlen_q = p.max_seqlen_k = 512;  // K/V of a head: 512 · 256 · 2 bytes = 256 KiB
  const EnvOverride unset("FLASHATTN_SM90_FWD_L2_SECTION_MB", "");
  const EnvOverride unset_rows("FLASHATTN_SM90_FWD_L2_SECTION_ROWS", "");
  const EnvOverride unset_alt("FLASHATTN_SM90_FWD_L2_SECTION_ALT", "");
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128).pairs, 64);  // 4 row blocks: 16 MiB / 256 KiB
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 64).pairs, 64);   // 8 row blocks: still sections
  EXPECT_TRUE(fc::sm90::fwd_l2_sections(p, 128).alternate);
  // 132 CTAs: 64 pairs of 4 row blocks are 256 tiles, more than 1.5 rounds (198).
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128, 132).pairs, 64);
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128, 170).pairs, 64);   // 256 tiles: 1.506 rounds of 170
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128, 171).pairs, 128);  // 1.497 rounds: the 32 MiB share
  p.max_seqlen_q = 16 * 128;  // 16 row blocks
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128).pairs, 64);
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128, 132).pairs, 64);  // 1024 tiles
  p.max_seqlen_q = 65 * 128 + 1;  // 66 row blocks: sections still (no row-block limit)
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128, 132).pairs, 64);
  p.max_seqlen_q = p.max_seqlen_k = 16384;  // 128 row blocks; a head's K/V 8 MiB: 2 in 16 MiB
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128, 132).pairs, 2);  // 256 tiles, 1.94 rounds
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 192, 132).pairs, 4);  // 2 pairs: 172 tiles; 32 MiB: 4
  p.head_dim = p.head_dim_v = 256;  // 16 MiB a head: 128 tiles at 16 MiB, 256 at 32
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128, 132).pairs, 2);
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128).pairs, 1);  // no SM count: the 16 MiB share
  p.head_dim = p.head_dim_v = 128;
  {
    const EnvOverride rows("FLASHATTN_SM90_FWD_L2_SECTION_ROWS", "64");  // a limit: 128 row blocks pass it
    EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128, 132).pairs, 32 * 16);
    EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 256, 132).pairs, 4);  // 64 row blocks of 256: sections
  }
  p.max_seqlen_q = p.max_seqlen_k = 512;
  p.heads_k = 2;                                          // GQA 8: a kv head's K/V serves 8 pairs
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128).pairs, 64 * 8);  // 64 kv heads' worth
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128, 132).pairs, 64 * 8);
  p.batch = 200;
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128).pairs, 64 * 8);
  p.heads_k = 16;
  p.max_seqlen_k = 1 << 20;  // one kv head's K/V beyond 32 MiB: one head per section
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128).pairs, 1);
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128, 132).pairs, 1);  // 4 tiles a section at 16 or 32 MiB
  p.heads_k = 2;
  EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128, 132).pairs, 8);  // whole groups of 8
  p.heads_k = 16;
  p.max_seqlen_k = 512;
  {
    const EnvOverride mib("FLASHATTN_SM90_FWD_L2_SECTION_MB", "8");  // as set, whatever the rounds
    EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128).pairs, 32);
    EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128, 132).pairs, 32);
  }
  {
    const EnvOverride off("FLASHATTN_SM90_FWD_L2_SECTION_MB", "0");
    EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 128).pairs, 200 * 16);
  }
  {
    const EnvOverride rows("FLASHATTN_SM90_FWD_L2_SECTION_ROWS", "4");  // sections up to 4 row blocks
    const EnvOverride alt("FLASHATTN_SM90_FWD_L2_SECTION_ALT", "0");
    EXPECT_EQ(fc::sm90::fwd_l2_sections(p, 64).pairs, 200 * 16);  // 8 row blocks
    const fc::sm90::FwdSections s = fc::sm90::fwd_l2_sections(p, 128);
    EXPECT_EQ(s.pairs, 64);
    EXPECT_FALSE(s.alternate);
  }
}

TEST(CudaFamily, Sm90ServesPlainCallsAndSaysWhyNotOthers) {
  FA_SKIP_WITHOUT_SM90();
  if (!both_families_built(128)) return;
  const FamilyOverride ordered("");  // the ordered choice, also when the suite runs with a family forced
  // 16 row blocks × 8 heads × 4 sequences: a grid of several waves, which the sm80 family would
  // not split either.
  AttnConfig cfg = feature_config(DType::bf16, 128, 2048, 2048);
  cfg.batch = 4;
  cfg.heads = cfg.heads_k = 8;
  cfg.opt.causal = true;
  const AttnProblem p = make_problem(cfg);
  ForwardResult r = make_forward_outputs(p);
  c::AttentionParams dp = params_of(p, r);

  fc::FamilyChoice choice = fc::choose_forward_family(dp);
  ASSERT_TRUE(choice.served) << choice.why_not;
  EXPECT_EQ(choice.family, fc::Family::sm90);
  EXPECT_EQ(choice.head_dim, 128);
  {
    const FamilyOverride family("sm80");
    choice = fc::choose_forward_family(dp);
    ASSERT_TRUE(choice.served) << choice.why_not;
    EXPECT_EQ(choice.family, fc::Family::sm80);
  }

  dp.dropout_p = 0.1f;  // served too (the softcap/ALiBi/dropout kernel)
  choice = fc::choose_forward_family(dp);
  EXPECT_EQ(choice.family, fc::Family::sm90) << choice.why_not;
  dp.dropout_p = 0.0f;

  // A call this family does not serve (no keys: an empty k, whose address may be null, which no
  // TMA descriptor can describe): sm80 runs it, and sm90 says why it declined.
  dp.max_seqlen_k = 0;
  choice = fc::choose_forward_family(dp);
  ASSERT_TRUE(choice.served) << choice.why_not;
  EXPECT_EQ(choice.family, fc::Family::sm80);
  int head_dim = 0;
  {
    const FamilyOverride family("sm90");
    choice = fc::choose_forward_family(dp);
    EXPECT_FALSE(choice.served);
    EXPECT_NE(choice.why_not.find("no keys"), std::string::npos) << choice.why_not;
    EXPECT_NE(choice.why_not.find("FLASHATTN_CUDA_FAMILY=sm90"), std::string::npos) << choice.why_not;
  }
  EXPECT_NE(fc::forward_refusal(fc::Family::sm90, dp, &head_dim, true).find("no keys"), std::string::npos);
}

// GQA decoding (one query row, 32 query heads over 8 kv heads, a grid of a full wave, which the
// sm80 family would not split): the ordered choice takes the sm80 family, whose packed kernel
// reads each K/V tile once per group; sm90 still serves it when forced.
TEST(CudaFamily, GqaDecodingPrefersThePackedSm80Kernel) {
  FA_SKIP_WITHOUT_SM90();
  if (!both_families_built(128)) return;
  const FamilyOverride ordered("");
  AttnConfig cfg = feature_config(DType::bf16, 128, 1, 4096);
  cfg.batch = 32;
  cfg.heads = 32;
  cfg.heads_k = 8;
  const AttnProblem p = make_problem(cfg);
  ForwardResult r = make_forward_outputs(p);
  c::AttentionParams dp = params_of(p, r);
  ASSERT_EQ(fc::sm80::forward_num_splits(dp), 1) << "the case is meant to be unsplit";
  ASSERT_EQ(fc::sm80::forward_pack(dp), 4);

  fc::FamilyChoice choice = fc::choose_forward_family(dp);
  ASSERT_TRUE(choice.served) << choice.why_not;
  EXPECT_EQ(choice.family, fc::Family::sm80);
  int head_dim = 0;
  EXPECT_NE(fc::forward_refusal(fc::Family::sm90, dp, &head_dim, true).find("GQA decoding"), std::string::npos);
  EXPECT_EQ(fc::forward_refusal(fc::Family::sm90, dp, &head_dim, false), "");
  {
    const FamilyOverride family("sm90");
    choice = fc::choose_forward_family(dp);
    ASSERT_TRUE(choice.served) << choice.why_not;
    EXPECT_EQ(choice.family, fc::Family::sm90);
  }
  // A long query packs nothing: the prefill of the same heads stays with sm90.
  dp.max_seqlen_q = 2048;
  EXPECT_EQ(fc::sm80::forward_pack(dp), 1);
}

// The Python drop-in's empty-keys case exactly: d 16, k and v without an address.
TEST(CudaFamily, NoKeysWithNullTensorsWritesEmptyRows) {
  FA_SKIP_WITHOUT_GPU();
  AttnConfig cfg = feature_config(DType::f16, 16, 5, 0);
  cfg.heads = cfg.heads_k = 2;
  cfg.batch = 1;
  const AttnProblem p = make_problem(cfg);
  const ForwardResult r = run_cuda_forward(p, [](flashattn::common::AttentionParams& a, DeviceArena&) {
    a.k.data = nullptr;
    a.v.data = nullptr;
  });
  EXPECT_TRUE(check_forward(p, r));
}

// --- the forward, forced onto the sm90 family -------------------------------------------------

class CudaSm90ForwardGrid : public testing::TestWithParam<GridCase> {};

TEST_P(CudaSm90ForwardGrid, MatchesReference) {
  FA_SKIP_WITHOUT_SM90();
  expect_sm90_matches(grid_config(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaSm90ForwardGrid,
                         testing::ValuesIn(grid_cases({{1, 1}, {113, 203}, {239, 1}, {799, 3}, {1023, 1024}})),
                         grid_name);

class CudaSm90Forward : public testing::TestWithParam<DType> {};

TEST_P(CudaSm90Forward, SlidingWindow) {
  FA_SKIP_WITHOUT_SM90();
  for (const AttnConfig& cfg : window_configs(GetParam())) expect_sm90_matches(cfg);
}

TEST_P(CudaSm90Forward, StridedLayouts) {
  FA_SKIP_WITHOUT_SM90();
  for (const AttnConfig& cfg : strided_configs(GetParam())) expect_sm90_matches(cfg);
}

// Several row blocks and key tiles per tile, sq > sk and sq < sk under the bottom-right causal
// mask, and rows that see no key at all.
TEST_P(CudaSm90Forward, LongerSequences) {
  FA_SKIP_WITHOUT_SM90();
  for (int d : {64, 96, 128, 256}) {
    for (auto [sq, sk] : {std::pair{300, 717}, std::pair{717, 300}, std::pair{640, 640}}) {
      for (bool causal : {false, true}) {
        AttnConfig cfg = feature_config(GetParam(), d, sq, sk);
        cfg.opt.causal = causal;
        expect_sm90_matches(cfg);
      }
    }
    AttnConfig cfg = feature_config(GetParam(), d, 300, 100);
    cfg.opt.window_left = 0;
    cfg.opt.window_right = 0;  // rows 0…199 see no key (the first row block none at all): out 0, lse +∞
    expect_sm90_matches(cfg);
  }
}

// The tall d 64 tile (192 rows, three consumer warpgroups) taken at every length
// (FLASHATTN_SM90_FWD_D64_TALL_FROM=1 and _CAUSAL_FROM=1): odd lengths (a partial last row block
// and key tile), more keys than queries and fewer, without a mask and causal (bottom-right), GQA,
// several tiles per CTA, against the reference; the default then keeps the 128-row tile on these
// lengths.
TEST_P(CudaSm90Forward, TallD64Tile) {
  FA_SKIP_WITHOUT_SM90();
  if (!fc::sm90::fwd_d64_tall_built()) GTEST_SKIP() << "NOT RUN: built with -DFLASHATTN_SM90_FWD_D64_TALL=0";
  const EnvOverride always("FLASHATTN_SM90_FWD_D64_TALL_FROM", "1");
  const EnvOverride always_causal("FLASHATTN_SM90_FWD_D64_TALL_CAUSAL_FROM", "1");
  for (auto [sq, sk] : {std::pair{1, 1}, std::pair{193, 129}, std::pair{300, 717}, std::pair{717, 300},
                        std::pair{1000, 1000}}) {
    for (bool causal : {false, true}) {
      AttnConfig cfg = feature_config(GetParam(), 64, sq, sk);
      cfg.opt.causal = causal;
      if (sq == 1000) {
        cfg.heads = 34;  // 6 row blocks × 34 heads × 2 sequences: more tiles than SMs
        cfg.heads_k = 17;
      }
      SCOPED_TRACE(causal ? "causal" : "no mask");
      expect_sm90_matches(cfg);
    }
  }
  AttnConfig gqa = feature_config(GetParam(), 64, 400, 400);
  gqa.heads = 8;
  gqa.heads_k = 1;
  expect_sm90_matches(gqa);
}

// A wide tile's cases against the reference: odd lengths (a partial last row block and key tile:
// `odd` is one past a key tile), more keys than queries and fewer, causal (bottom-right) and a
// sliding window, GQA, several tiles per CTA.
void expect_wide_tile_matches(DType param, int d, int odd) {
  for (auto [sq, sk] : {std::pair{1, 1}, std::pair{odd, odd - 2}, std::pair{300, 717}, std::pair{717, 300},
                        std::pair{1000, 1000}}) {
    for (bool causal : {false, true}) {
      AttnConfig cfg = feature_config(param, d, sq, sk);
      cfg.opt.causal = causal;
      if (sq == 1000) {
        cfg.heads = 34;  // 8 row blocks × 34 heads × 2 sequences: more tiles than SMs
        cfg.heads_k = 17;
      }
      SCOPED_TRACE(causal ? "causal" : "no mask");
      expect_sm90_matches(cfg);
    }
  }
  AttnConfig gqa = feature_config(param, d, 400, 400);
  gqa.heads = 8;
  gqa.heads_k = 1;
  expect_sm90_matches(gqa);
  AttnConfig window = feature_config(param, d, 500, 500);
  window.opt.window_left = 170;
  window.opt.window_right = 30;
  expect_sm90_matches(window);
}

// The wide d 256 tile (128 × 80) taken at every length (FLASHATTN_SM90_FWD_D256_WIDE_FROM=1).
TEST_P(CudaSm90Forward, WideD256Tile) {
  FA_SKIP_WITHOUT_SM90();
  if (!fc::sm90::fwd_d256_wide_built()) GTEST_SKIP() << "NOT RUN: built with -DFLASHATTN_SM90_FWD_D256_WIDE=0";
  const EnvOverride always("FLASHATTN_SM90_FWD_D256_WIDE_FROM", "1");
  expect_wide_tile_matches(GetParam(), 256, 81);  // 80 keys divide none of the lengths
}

TEST_P(CudaSm90Forward, Softcap) {
  FA_SKIP_WITHOUT_SM90();
  for (const AttnConfig& cfg : softcap_configs(GetParam())) expect_sm90_matches(cfg);
}

TEST_P(CudaSm90Forward, Alibi) {
  FA_SKIP_WITHOUT_SM90();
  for (int d : {64, 96, 128, 256}) {
    for (Alibi a : {Alibi::per_head, Alibi::per_batch_head}) {
      for (bool causal : {false, true}) {
        AttnConfig cfg = feature_config(GetParam(), d, 300, 129);
        cfg.alibi = a;
        cfg.opt.causal = causal;
        expect_sm90_matches(cfg);
      }
    }
    // Both at once, with a window, over several key tiles.
    AttnConfig cfg = feature_config(GetParam(), d, 200, 700);
    cfg.alibi = Alibi::per_head;
    cfg.opt.softcap = 5.0f;
    cfg.opt.window_left = 300;
    cfg.opt.window_right = 40;
    expect_sm90_matches(cfg);
  }
}

// More tiles than an H100/H200 has SMs (2 row blocks × 34 heads × 2 sequences = 136 > 132), small
// enough for the sanitizers: some CTAs of the persistent grid walk two tiles, carrying the K/V
// rings' phases and the Q barrier's parity from one tile to the next.
// Both schedules of the consumer warpgroups at d ≤ 128: taking turns (ping-pong) and not (the
// default).
// Both walks of the persistent CTAs under the causal mask: the snake (the default; the second
// round's 4 tiles go to the last CTAs) and the plain one; the plain kernel and the softcap kernel
// (whose warpgroups take turns at d ≤ 128); dense and varlen (the same rows as one packed batch).
TEST_P(CudaSm90Forward, ManyTiles) {
  FA_SKIP_WITHOUT_SM90();
  for (const char* walk : {"snake", "plain"}) {
    for (bool softcap : {false, true}) {
      SCOPED_TRACE(std::string("FLASHATTN_SM90_FWD_WALK=") + walk + (softcap ? ", softcap" : ""));
      const EnvOverride order("FLASHATTN_SM90_FWD_WALK", walk);
      for (int d : {64, 128, 256}) {
        for (bool causal : {false, true}) {
          for (bool varlen : {false, true}) {
            // 136 keys: 2 or 3 key tiles (the last partial) per tile, so that a CTA's second tile
            // wraps the 2-stage rings; fewer than the 200 keys this test had (its fp64 reference
            // ran past the CUDA suite's time limit on the H200 machine's CPU).
            AttnConfig cfg = feature_config(GetParam(), d, 256, 136);
            cfg.heads = 34;
            cfg.heads_k = 17;
            cfg.opt.causal = causal;
            if (softcap) cfg.opt.softcap = 20.0f;
            if (varlen) {
              cfg.varlen_q = {256, 256};
              cfg.varlen_k = {136, 136};
            } else {
              cfg.batch = 2;
            }
            expect_sm90_matches(cfg);
          }
        }
      }
    }
  }
}

// The dynamic tile schedule (FLASHATTN_SM90_FWD_DYNAMIC builds): a tile's result does not depend on
// which CTA computes it, so under the causal mask, a window and varlen the outputs and lse are bit
// for bit those of the static walk (FLASHATTN_SM90_FWD_SCHEDULE=static), in every one of several
// launches in a row (each resets its counter for the next); more tiles than SMs, empty tiles
// among them (varlen rows past a short sequence), and the reference checked once.
TEST_P(CudaSm90Forward, DynamicScheduleMatchesTheStaticWalkBitForBit) {
  FA_SKIP_WITHOUT_SM90();
  if (!fc::sm90::fwd_dynamic_built()) {
    GTEST_SKIP() << "NOT RUN: built without -DFLASHATTN_SM90_FWD_DYNAMIC=1 (the static walk only)";
  }
  for (int d : {64, 128, 256}) {
    for (int shape = 0; shape < 3; ++shape) {
      AttnConfig cfg = feature_config(GetParam(), d, 0, 0);
      cfg.heads = 34;
      cfg.heads_k = 17;
      cfg.opt.causal = true;
      if (shape == 2) {  // varlen: sequences of 1 to 3 row blocks, so tiles of many lengths
        cfg.varlen_q = {300, 7, 129, 260, 40};
        cfg.varlen_k = {300, 513, 129, 260, 300};
      } else {  // 4 · 34 · 3 = 408 tiles: three per SM and more
        cfg.batch = 4;
        cfg.seqlen_q = cfg.seqlen_k = 300;
        if (shape == 1) cfg.opt.window_left = 100;
      }
      const AttnProblem p = make_problem(cfg);
      SCOPED_TRACE(describe(p.cfg));
      const FamilyOverride family("sm90");
      ForwardResult fixed;
      {
        const EnvOverride walk("FLASHATTN_SM90_FWD_SCHEDULE", "static");
        fixed = run_cuda_forward(p);
      }
      const EnvOverride walk("FLASHATTN_SM90_FWD_SCHEDULE", "");
      for (int launch = 0; launch < 3; ++launch) {
        const ForwardResult r = run_cuda_forward(p);
        ASSERT_TRUE(bitwise_equal(r.out, fixed.out)) << "launch " << launch;
        ASSERT_TRUE(bitwise_equal(r.lse, fixed.lse)) << "launch " << launch;
        // The static walk's results are checked by the tests above; one reference check here
        // (the fp64 reference of the larger shapes would take minutes of the machine's CPU).
        if (launch == 0 && d == 64 && shape == 0) EXPECT_TRUE(check_forward(p, r));
      }
    }
  }
}

// The running maximum rising tile after tile (the kernel walks the key tiles from the last to the
// first): q and k get, in their first column, a query factor a_i and a key ramp c_j that grows
// toward the first keys, so that rows with a_i = 8 see their maximum rise by about 12 (log2 units,
// scaled) from each key tile to the next — past the lazy rescale's 8 (d 256; fwd_lazy_rescale), so
// O is rescaled at every step — while rows with a_i = −8 or 0.5 keep their first maximum, mixed
// within warps, and the 16-row slabs with a_i = 0 (warps of their own) never rescale. Dense and varlen kernels, the
// softcap kernel (its cap far above the scores), the default tiles and the tall d 64 / wide
// d 256 ones, causal or not, against the fp64 reference.
TEST_P(CudaSm90Forward, RunningMaxRisesAcrossKeyTiles) {
  FA_SKIP_WITHOUT_SM90();
  for (bool other_tiles : {false, true}) {
    const EnvOverride tall("FLASHATTN_SM90_FWD_D64_TALL_FROM", other_tiles ? "1" : "0");
    const EnvOverride tall_causal("FLASHATTN_SM90_FWD_D64_TALL_CAUSAL_FROM", other_tiles ? "1" : "0");
    const EnvOverride wide("FLASHATTN_SM90_FWD_D256_WIDE_FROM", other_tiles ? "1" : "0");
    for (int d : {64, 128, 256}) {
      for (bool causal : {false, true}) {
        for (int variant = 0; variant < 3; ++variant) {  // dense, varlen, softcap
          if (other_tiles && variant != 0) continue;  // the other tiles serve dense plain calls only
          AttnConfig cfg = feature_config(GetParam(), d, 200, 700);
          cfg.heads = cfg.heads_k = 2;
          cfg.opt.causal = causal;
          if (variant == 1) {
            cfg.varlen_q = {200, 77};
            cfg.varlen_k = {700, 333};
          } else {
            cfg.batch = 1;
          }
          if (variant == 2) cfg.opt.softcap = 1000.0f;
          AttnProblem p = make_problem(cfg);
          const bool varlen = p.is_varlen();
          const double scale_log2 = 1.4426950408889634 / std::sqrt(double(d));
          const double ramp = 12.0 / (8.0 * 128.0 * scale_log2);  // a rise of 12 per 128 keys at a_i = 8
          const std::int64_t rows_q = varlen ? p.q.shape(0) : p.q.shape(1);
          const std::int64_t rows_k = varlen ? p.k.shape(0) : p.k.shape(1);
          for (int h = 0; h < cfg.heads; ++h) {
            for (std::int64_t i = 0; i < rows_q; ++i) {
              const float factors[4] = {8.0f, -8.0f, 0.5f, 8.0f};
              const float a = (i / 16) % 2 == 0 ? 0.0f : factors[i % 4];
              if (varlen) p.q.set({i, h, 0}, a); else p.q.set({0, i, h, 0}, a);
            }
            for (std::int64_t j = 0; j < rows_k; ++j) {
              const float c = float(ramp * double(rows_k - 1 - j));
              if (varlen) p.k.set({j, h, 0}, c); else p.k.set({0, j, h, 0}, c);
            }
          }
          SCOPED_TRACE(describe(p.cfg) + (other_tiles ? ", tall / wide tiles" : ""));
          const FamilyOverride family("sm90");
          const ForwardResult r = run_cuda_forward(p);
          EXPECT_TRUE(check_forward(p, r));
        }
      }
    }
  }
}

// Dropout (the Philox mask of docs/dropout.md on the wgmma accumulator, checked against the
// reference's mask; CudaForward.DropoutMaskIsBitExact compares it bit for bit per family), alone
// and with softcap, ALiBi, the causal mask and a varlen batch (positions from each sequence's
// start), where its counters must follow each sequence.
TEST_P(CudaSm90Forward, Dropout) {
  FA_SKIP_WITHOUT_SM90();
  for (const AttnConfig& cfg : dropout_configs(GetParam())) expect_sm90_matches(cfg);
  for (bool varlen : {false, true}) {
    AttnConfig cfg = feature_config(GetParam(), 128, 300, 411);
    cfg.opt.dropout_p = 0.1f;
    cfg.opt.dropout_seed = 0x0badc0ffee123457ull;
    cfg.opt.dropout_offset = 77;
    cfg.opt.softcap = 10.0f;
    cfg.alibi = Alibi::per_head;
    cfg.opt.causal = true;
    if (varlen) {
      cfg.varlen_q = {300, 17, 129};
      cfg.varlen_k = {411, 300, 129};
    }
    expect_sm90_matches(cfg);
  }
}

// Varlen batches: TMA over the packed rows from each sequence's first row. Empty query and key
// sequences, seqused_k, causal, every head dim (varlen_configs); then GQA, d ≠ dv, a window and
// sequences of several tiles whose tiles straddle the next sequence's rows.
TEST_P(CudaSm90Forward, Varlen) {
  FA_SKIP_WITHOUT_SM90();
  for (const AttnConfig& cfg : varlen_configs(GetParam())) expect_sm90_matches(cfg);
  for (bool causal : {false, true}) {
    AttnConfig cfg = feature_config(GetParam(), 192, 0, 0);
    cfg.head_dim_v = 128;
    cfg.varlen_q = {1000, 7, 300, 129, 1};
    cfg.varlen_k = {1000, 513, 4, 700, 385};
    cfg.seqused_k = {1000, 500, 4, 650, 1};
    cfg.heads = 8;
    cfg.heads_k = 2;
    cfg.opt.causal = causal;
    if (causal) cfg.opt.window_left = 200;
    expect_sm90_matches(cfg);
    cfg.seqused_k.clear();
    cfg.layout = Layout::padded;  // gaps between rows and heads poisoned, and outputs with gaps
    cfg.padded_outputs = true;
    cfg.head_dim_v = 0;
    cfg.head_dim = 64;
    expect_sm90_matches(cfg);
  }
}

// The key tile at a sequence's end also holds rows that are not its keys — those seqused_k leaves
// out, and the next sequence's. Made NaN here, they must stay invisible (P is 0 there, and 0 · NaN
// would be NaN in the products: the kernel zeroes those V rows). Rows seqused_k leaves out are no
// key of any sequence, so the reference holds no NaN.
TEST_P(CudaSm90Forward, VarlenRowsPastTheKeysStayInvisible) {
  FA_SKIP_WITHOUT_SM90();
  for (int d : {64, 128, 256}) {
    AttnConfig cfg = feature_config(GetParam(), d, 0, 0);
    cfg.varlen_q = {70, 200, 33, 130};
    cfg.varlen_k = {70, 200, 33, 300};
    cfg.seqused_k = {50, 130, 33, 260};
    cfg.heads = cfg.heads_k = 2;
    AttnProblem p = make_problem(cfg);
    SCOPED_TRACE(describe(p.cfg));
    int row0 = 0;
    for (std::size_t b = 0; b < cfg.varlen_k.size(); ++b) {
      for (int j = row0 + cfg.seqused_k[b]; j < row0 + cfg.varlen_k[b]; ++j) {
        for (int h = 0; h < cfg.heads_k; ++h) {
          for (int c = 0; c < p.head_dim_v; ++c) {
            p.v.set({j, h, c}, std::numeric_limits<float>::quiet_NaN());
            p.k.set({j, h, c % cfg.head_dim}, std::numeric_limits<float>::quiet_NaN());
          }
        }
      }
      row0 += cfg.varlen_k[b];
    }
    const FamilyOverride family("sm90");
    const ForwardResult r = run_cuda_forward(p);
    EXPECT_TRUE(check_forward(p, r));
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaSm90Forward, testing::Values(DType::f16, DType::bf16),
                         [](const testing::TestParamInfo<DType>& info) { return std::string(dtype_tag(info.param)); });

}  // namespace
}  // namespace fa_test::cuda
