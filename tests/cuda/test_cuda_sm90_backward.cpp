// tests/cuda/test_cuda_sm90_backward.cpp — the Hopper (sm90) backward family: forced
// (FLASHATTN_CUDA_FAMILY=sm90), its dQ, dK, dV and softmax_d match the fp64 reference by the
// accuracy rule of SPEC §7 (check_backward) over the shape grid (every head dim: up to 128 the
// warpgroups split the keys, above it d — sm90_bwd_traits.cuh; d ≠ dv, GQA, causal), windows,
// strided layouts, several key tiles and row blocks, rows and keys that see nothing; the ordered choice takes it for the calls it serves and says why not for the
// others. Gradients are poisoned and the workspace filled with NaN bytes before each call (see
// run_cuda_backward). Without an sm90 GPU the tests say they were not run.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "cuda/family.h"
#include "cuda/sm90/sm90_bwd.h"
#include "cuda/sm90/sm90_registry.h"
#include "cuda_grid.h"
#include "cuda_test_util.h"

namespace fa_test::cuda {
namespace {

namespace c = flashattn::common;
namespace fc = flashattn::cuda;
using flashattn::DType;

// The CPU forward, then the backward in the sm90 family (forced: a call it declines throws).
void expect_sm90_backward_matches(const AttnConfig& cfg) {
  const AttnProblem p = make_problem(cfg);
  SCOPED_TRACE(describe(p.cfg));
  const ForwardResult fwd = run_forward(p, Backend::cpu);
  const FamilyOverride family("sm90");
  const BackwardResult bwd = run_cuda_backward(p, fwd);
  // A build without this dtype's kernels (FLASHATTN_CUDA_DTYPES) has recorded the call as not run,
  // naming the option.
  if (bwd.not_run) return;
  EXPECT_TRUE(check_backward(p, fwd, bwd));
}

// The validated backward params of a problem (host pointers: the choice reads shapes only).
c::AttentionParams backward_params_of(const AttnProblem& p) {
  const ForwardResult fwd = make_forward_outputs(p);
  BackwardResult r = make_backward_outputs(p);
  const flashattn::BackwardOutputs outs{r.dq.tv(), r.dk.tv(), r.dv.tv(), r.softmax_d.tv()};
  return flashattn::detail::validate_backward(p.backward_inputs(fwd), outs, p.opt).params;
}

// --- host-side decisions (no GPU needed) --------------------------------------------------------

TEST(CudaSm90BackwardHost, ServedFeaturesAndTheReasonsForTheOthers) {
  AttnConfig cfg = feature_config(DType::bf16, 128, 64, 64);
  EXPECT_EQ(fc::sm90::bwd_unsupported(backward_params_of(make_problem(cfg)), 128), "");
  cfg.opt.causal = true;
  cfg.opt.softcap = 30.0f;
  cfg.alibi = Alibi::per_head;
  cfg.opt.deterministic = true;
  cfg.opt.dropout_p = 0.1f;
  EXPECT_EQ(fc::sm90::bwd_unsupported(backward_params_of(make_problem(cfg)), 128), "");
  AttnConfig varlen = feature_config(DType::bf16, 64, 0, 0);
  varlen.varlen_q = {40, 24};
  varlen.varlen_k = {30, 34};
  EXPECT_EQ(fc::sm90::bwd_unsupported(backward_params_of(make_problem(varlen)), 64), "");
  AttnConfig sinks = feature_config(DType::bf16, 128, 64, 64);
  sinks.sinks = true;
  const std::string why = fc::sm90::bwd_unsupported(backward_params_of(make_problem(sinks)), 128);
  EXPECT_NE(why.find("sinks"), std::string::npos) << why;
  AttnConfig wide = feature_config(DType::bf16, 256, 64, 64);  // split d
  wide.opt.causal = true;
  wide.opt.deterministic = true;
  EXPECT_EQ(fc::sm90::bwd_unsupported(backward_params_of(make_problem(wide)), 256), "");
  // The 192 instantiation is 192 / 128 (bwd_head_dim_v): it takes dv ≤ 128 and refuses more.
  static_assert(fc::sm90::bwd_head_dim_v(192) == 128 && fc::sm90::bwd_head_dim_v(96) == 96);
  AttnConfig mla = feature_config(DType::bf16, 192, 64, 64);
  mla.head_dim_v = 128;
  EXPECT_EQ(fc::sm90::bwd_unsupported(backward_params_of(make_problem(mla)), 192), "");
  mla.head_dim_v = 192;
  const std::string wide_v = fc::sm90::bwd_unsupported(backward_params_of(make_problem(mla)), 192);
  EXPECT_NE(wide_v.find("exceed the instantiation's 192 / 128"), std::string::npos) << wide_v;
}

// The launch order (sm90_bwd.h, bwd_tile_major): key tiles slowest only for a masked call whose grid
// fills at most two waves, never for a deterministic one; FLASHATTN_SM90_BWD_TILE_MAJOR forces it.
TEST(CudaSm90BackwardHost, TileMajorOnlyForMaskedGridsOfAtMostTwoWaves) {
  {
    const EnvOverride unset("FLASHATTN_SM90_BWD_TILE_MAJOR", "");
    EXPECT_TRUE(fc::sm90::bwd_tile_major(true, false, 256, 132));   // GQA 8:1 causal 4k, d 128
    EXPECT_TRUE(fc::sm90::bwd_tile_major(true, false, 264, 132));   // two waves exactly
    EXPECT_FALSE(fc::sm90::bwd_tile_major(true, false, 265, 132));
    EXPECT_FALSE(fc::sm90::bwd_tile_major(true, false, 2048, 132));  // MHA causal: 16 waves
    EXPECT_FALSE(fc::sm90::bwd_tile_major(false, false, 256, 132));  // unmasked: equal tiles
    EXPECT_FALSE(fc::sm90::bwd_tile_major(true, true, 256, 132));    // deterministic
    EXPECT_FALSE(fc::sm90::bwd_tile_major(true, false, 8, 0));       // occupancy unknown
  }
  {
    const EnvOverride on("FLASHATTN_SM90_BWD_TILE_MAJOR", "1");
    EXPECT_TRUE(fc::sm90::bwd_tile_major(false, false, 4096, 132));
    EXPECT_FALSE(fc::sm90::bwd_tile_major(true, true, 8, 132));
  }
  {
    const EnvOverride off("FLASHATTN_SM90_BWD_TILE_MAJOR", "0");
    EXPECT_FALSE(fc::sm90::bwd_tile_major(true, false, 8, 132));
  }
}

// Whether the library was built with the heads-inner walk (-DFLASHATTN_SM90_BWD_HEADS_INNER=1):
// then, and only then, a non-deterministic GQA call asked for it takes it.
bool heads_inner_built() {
  const EnvOverride inner("FLASHATTN_SM90_BWD_GQA_WALK", "inner");
  return fc::sm90::bwd_heads_inner(8, false);
}

// Heads inner only in builds with it, only for non-deterministic GQA calls, only when asked for.
TEST(CudaSm90BackwardHost, HeadsInnerOnlyWhereBuiltAndAskedFor) {
  {
    const EnvOverride unset("FLASHATTN_SM90_BWD_GQA_WALK", "");
    EXPECT_FALSE(fc::sm90::bwd_heads_inner(8, false));
  }
  const EnvOverride inner("FLASHATTN_SM90_BWD_GQA_WALK", "inner");
  // Asked for, a GQA call takes it exactly where the library was built with it (the knob reaches
  // nvcc's translation units only, not this one: heads_inner_built asks the library).
  std::printf("FLASHATTN_SM90_BWD_HEADS_INNER is %s in this build\n", heads_inner_built() ? "on" : "off");
  EXPECT_FALSE(fc::sm90::bwd_heads_inner(8, true)) << "deterministic";
  EXPECT_FALSE(fc::sm90::bwd_heads_inner(1, false)) << "MHA: one head per group";
  const EnvOverride outer("FLASHATTN_SM90_BWD_GQA_WALK", "outer");
  EXPECT_FALSE(fc::sm90::bwd_heads_inner(8, false));
}

TEST(CudaSm90BackwardHost, StaggerTilesDefaultsToAQuarterOfTheSms) {
  {
    const EnvOverride unset("FLASHATTN_SM90_BWD_STAGGER_TILES", "");
    EXPECT_EQ(fc::sm90::bwd_stagger_tiles(132), fc::sm90::kBwdStagger ? 33 : 0);
  }
  {
    const EnvOverride set("FLASHATTN_SM90_BWD_STAGGER_TILES", "66");
    EXPECT_EQ(fc::sm90::bwd_stagger_tiles(132), 66);
  }
  {
    const EnvOverride off("FLASHATTN_SM90_BWD_STAGGER_TILES", "0");
    EXPECT_EQ(fc::sm90::bwd_stagger_tiles(132), 0);
  }
  {
    const EnvOverride past("FLASHATTN_SM90_BWD_STAGGER_TILES", "1000");  // more than can be resident
    EXPECT_EQ(fc::sm90::bwd_stagger_tiles(132), 132);
  }
  for (const char* bad : {"-1", "12x", "many"}) {
    const EnvOverride junk("FLASHATTN_SM90_BWD_STAGGER_TILES", bad);
    EXPECT_EQ(fc::sm90::bwd_stagger_tiles(132), fc::sm90::kBwdStagger ? 33 : 0) << bad;
  }
}

TEST(CudaSm90BackwardHost, WideRowsOnlyForPlainUnmaskedD128) {
  AttnConfig cfg = feature_config(DType::bf16, 128, 100, 100);
  const c::AttentionParams plain = backward_params_of(make_problem(cfg));
  const char* knob = std::getenv("FLASHATTN_SM90_BWD_WIDE_ROWS");  // read once per process
  const bool on = fc::sm90::kBwdWideRows && (knob == nullptr || std::string(knob) != "0");
  EXPECT_EQ(fc::sm90::bwd_wide_rows(plain, 128), on);
  EXPECT_FALSE(fc::sm90::bwd_wide_rows(plain, 96));  // d 96 takes d 128's tile of 64 rows
  EXPECT_FALSE(fc::sm90::bwd_wide_rows(plain, 64));
  EXPECT_FALSE(fc::sm90::bwd_wide_rows(plain, 256));
  c::AttentionParams q = plain;
  q.causal = true;
  EXPECT_FALSE(fc::sm90::bwd_wide_rows(q, 128));
  q = plain;
  q.window_left = 16;
  EXPECT_FALSE(fc::sm90::bwd_wide_rows(q, 128));
  q = plain;
  q.softcap = 30.0f;
  EXPECT_FALSE(fc::sm90::bwd_wide_rows(q, 128));
  q = plain;
  q.dropout_p = 0.1f;
  EXPECT_FALSE(fc::sm90::bwd_wide_rows(q, 128));
  q = plain;
  const float slopes[4] = {0.5f, 0.25f, 0.125f, 0.0625f};
  q.alibi_slopes = slopes;
  EXPECT_FALSE(fc::sm90::bwd_wide_rows(q, 128));
  static_assert(fc::sm90::bwd_tile(128, true).block_m == 80 && fc::sm90::bwd_tile(128, true).block_n == 128);
  static_assert(fc::sm90::bwd_tile(96, true).block_m == 64 && fc::sm90::bwd_tile(64, true).block_m == 128);
  // The workspace's row blocks follow the choice.
  EXPECT_EQ(fc::sm90::bwd_rows(plain, 128).block_m, on ? 80 : 64);
  EXPECT_EQ(fc::sm90::bwd_rows(plain, 128).padded_rows, on ? 160 : 128);
}

TEST(CudaSm90BackwardHost, DependentLaunchUnlessSwitchedOff) {
  {
    const EnvOverride off("FLASHATTN_SM90_BWD_PDL", "0");
    EXPECT_FALSE(fc::sm90::bwd_dependent_launch());
  }
  {
    const EnvOverride on("FLASHATTN_SM90_BWD_PDL", "1");
    EXPECT_TRUE(fc::sm90::bwd_dependent_launch());
  }
}

TEST(CudaSm90BackwardHost, WorkspacePadsRowsToTheRowBlock) {
  AttnConfig cfg = feature_config(DType::bf16, 128, 65, 10);  // 65 rows: two row blocks of 64
  cfg.opt.causal = true;  // the tile of 64 rows (unmasked calls may take 80: bwd_wide_rows)
  const c::AttentionParams p = backward_params_of(make_problem(cfg));
  const fc::sm90::BwdWorkspace w = fc::sm90::bwd_workspace(p, 128);
  EXPECT_EQ(w.rows.padded_rows, 128);
  EXPECT_EQ(w.rows.head_stride, 2 * 128);  // b · padded rows
  EXPECT_GE(w.dq_accum_bytes, std::size_t(2 * 4 * 128 * 128 * 4));  // b · h · rows · d fp32
  EXPECT_GE(w.row_stat_bytes, std::size_t(2 * 4 * 128 * 4));
  EXPECT_EQ(fc::sm90::bwd_workspace(p, 64).rows.padded_rows, 128);  // d 64: row blocks of 128
  // Varlen: each sequence starts on a row block and keeps its rounded-up rows, within
  // total + (b + 1) · block_m rows per head.
  AttnConfig v = feature_config(DType::bf16, 128, 0, 0);
  v.opt.causal = true;
  v.varlen_q = {65, 0, 1, 130};
  v.varlen_k = {10, 20, 30, 40};
  const c::AttentionParams vp = backward_params_of(make_problem(v));
  const fc::sm90::BwdRows r = fc::sm90::bwd_rows(vp, 128);
  const std::vector<int> cu = {0, 65, 65, 66, 196};
  c::AttentionParams hp = vp;
  hp.cu_seqlens_q = cu.data();  // bwd_row_start reads cu_seqlens_q (host copy)
  std::int64_t end = 0;
  for (int b = 0; b < 4; ++b) {
    const std::int64_t start = fc::sm90::bwd_row_start(hp, r, b);
    EXPECT_EQ(start % 64, 0) << b;
    EXPECT_GE(start, end) << b;
    end = start + (cu[b + 1] - cu[b] + 63) / 64 * 64;
  }
  EXPECT_LE(end, r.head_stride);
  static_assert(fc::sm90::bwd_tile(64).block_m == 128 && fc::sm90::bwd_tile(128).block_m == 64);
  static_assert(fc::sm90::bwd_tile(256).block_m == 64 && fc::sm90::bwd_tile(256).block_n == 64);
  EXPECT_EQ(fc::sm90::bwd_workspace(p, 256).rows.padded_rows, 128);
  EXPECT_GE(fc::sm90::bwd_workspace(p, 256).dq_accum_bytes, std::size_t(2 * 4 * 128 * 256 * 4));
}

// --- the ordered choice -------------------------------------------------------------------------

TEST(CudaSm90Backward, OrderedChoiceTakesItWhereItServes) {
  FA_SKIP_WITHOUT_SM90();
  if (!both_families_built(128, true)) return;
  const FamilyOverride ordered("");  // the ordered choice, whatever family the run forces
  const c::AttentionParams plain = backward_params_of(make_problem(feature_config(DType::bf16, 128, 100, 100)));
  const fc::FamilyChoice served = fc::choose_backward_family(plain);
  EXPECT_TRUE(served.served);
  EXPECT_EQ(served.family, fc::Family::sm90);
  if (fc::sm90::compiled_head_dim(fc::sm90::Family::bwd, c::Storage::bf16, 256) == 256) {
    const fc::FamilyChoice wide = fc::choose_backward_family(
        backward_params_of(make_problem(feature_config(DType::bf16, 256, 100, 100))));
    EXPECT_TRUE(wide.served);
    EXPECT_EQ(wide.family, fc::Family::sm90);
    // d 192: the 192 / 128 kernel where built and dv allows, else the 256 one; the workspace
    // bound (sized before the choice) covers the kernel chosen.
    for (int dv : {128, 192}) {
      AttnConfig mla = feature_config(DType::bf16, 192, 100, 100);
      mla.head_dim_v = dv;
      const c::AttentionParams mp = backward_params_of(make_problem(mla));
      const fc::FamilyChoice choice = fc::choose_backward_family(mp);
      EXPECT_TRUE(choice.served);
      EXPECT_EQ(choice.family, fc::Family::sm90);
      const bool native = dv == 128 && fc::sm90::compiled_head_dim(fc::sm90::Family::bwd, c::Storage::bf16, 192) == 192;
      EXPECT_EQ(choice.head_dim, native ? 192 : 256) << "dv " << dv;
      const std::int64_t rows = std::int64_t(mla.batch) * mla.seqlen_q;
      EXPECT_GE(fc::family_backward_workspace_bound(mp, rows), fc::family_backward_workspace_size(choice, mp, rows));
    }
  }
  AttnConfig sinks = feature_config(DType::bf16, 128, 100, 100);  // sinks: sm80's
  sinks.sinks = true;
  if (!kernel_built(fc::sm80::Family::bwd, c::Storage::bf16, 128, 128)) return;
  const fc::FamilyChoice other = fc::choose_backward_family(backward_params_of(make_problem(sinks)));
  EXPECT_TRUE(other.served);
  EXPECT_EQ(other.family, fc::Family::sm80);
  const FamilyOverride family("sm90");
  const fc::FamilyChoice refused = fc::choose_backward_family(backward_params_of(make_problem(sinks)));
  EXPECT_FALSE(refused.served);
  EXPECT_NE(refused.why_not.find("sinks"), std::string::npos) << refused.why_not;
}

// The (d, dv) pairs of the feature tests: every instantiated head dim (where a build leaves one out,
// its calls run the next larger kernel) and DeepSeek's 192 / 128.
constexpr std::pair<int, int> kFeatureDims[] = {{64, 64}, {96, 96}, {128, 128}, {192, 128}, {256, 256}};

AttnConfig feature_config_dv(DType dtype, std::pair<int, int> dims, int sq, int sk) {
  AttnConfig cfg = feature_config(dtype, dims.first, sq, sk);
  cfg.head_dim_v = dims.second;
  return cfg;
}

// --- the shape grid -----------------------------------------------------------------------------

std::vector<GridCase> sm90_backward_cases() {
  return grid_cases({{1, 1}, {113, 203}, {239, 1}, {3, 799}, {517, 517}});
}

class CudaSm90BackwardGrid : public testing::TestWithParam<GridCase> {};

TEST_P(CudaSm90BackwardGrid, MatchesReference) {
  FA_SKIP_WITHOUT_SM90();
  expect_sm90_backward_matches(grid_config(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaSm90BackwardGrid, testing::ValuesIn(sm90_backward_cases()), grid_name);

// --- features, per dtype ------------------------------------------------------------------------

class CudaSm90BackwardFeatures : public testing::TestWithParam<DType> {};

TEST_P(CudaSm90BackwardFeatures, SlidingWindow) {
  FA_SKIP_WITHOUT_SM90();
  for (const AttnConfig& cfg : window_configs(GetParam())) {
    expect_sm90_backward_matches(cfg);
  }
}

TEST_P(CudaSm90BackwardFeatures, StridedLayouts) {
  FA_SKIP_WITHOUT_SM90();
  for (const AttnConfig& cfg : strided_configs(GetParam())) expect_sm90_backward_matches(cfg);
}

// Several key tiles and row blocks, sq > sk and sq < sk under the bottom-right causal mask, GQA
// 4:1 and MQA (the CTA walks every query head of its kv head), keys no row sees (zero dK, dV) and
// rows that see no key (zero dQ).
TEST_P(CudaSm90BackwardFeatures, LongerSequences) {
  FA_SKIP_WITHOUT_SM90();
  for (auto d : kFeatureDims) {
    for (auto [sq, sk] : {std::pair{300, 717}, std::pair{717, 300}, std::pair{640, 640}}) {
      for (bool causal : {false, true}) {
        AttnConfig cfg = feature_config_dv(GetParam(), d, sq, sk);
        cfg.opt.causal = causal;
        expect_sm90_backward_matches(cfg);
      }
    }
    AttnConfig mqa = feature_config_dv(GetParam(), d, 333, 333);
    mqa.heads = 8;
    mqa.heads_k = 1;
    mqa.opt.causal = true;
    expect_sm90_backward_matches(mqa);
    AttnConfig cfg = feature_config_dv(GetParam(), d, 300, 100);
    cfg.opt.window_left = 0;
    cfg.opt.window_right = 0;  // rows 0…199 see no key
    expect_sm90_backward_matches(cfg);
  }
}

// The 80-row tile of d 128 (bwd_wide_rows: no mask, softcap, ALiBi or dropout; dQ computed
// transposed): row counts on either side of its row blocks (1, 79, 81, 161, 400), keys short of a
// key tile, MQA and GQA 2:1, strided layouts (packed qkv, bhsd, padded rows).
TEST_P(CudaSm90BackwardFeatures, WideRowTile) {
  FA_SKIP_WITHOUT_SM90();
  AttnConfig plain = feature_config(GetParam(), 128, 161, 161);
  if (!fc::sm90::bwd_wide_rows(backward_params_of(make_problem(plain)), 128)) {
    std::printf("note: the 80-row tile is off in this process (FLASHATTN_SM90_BWD_WIDE_ROWS=0 or a build "
                "without it): the cases below run the 64-row tile\n");
  }
  for (auto [sq, sk] : {std::pair{1, 129}, std::pair{79, 300}, std::pair{81, 81}, std::pair{161, 40}, std::pair{400, 1000}}) {
    AttnConfig cfg = feature_config(GetParam(), 128, sq, sk);
    expect_sm90_backward_matches(cfg);
    cfg.heads = 8;
    cfg.heads_k = 1;
    expect_sm90_backward_matches(cfg);
  }
  for (AttnConfig cfg : strided_configs(GetParam())) {
    cfg.opt.causal = false;
    expect_sm90_backward_matches(cfg);
  }
}

// The cases of the tests that change how the kernels are launched: d 64/128/256, several key
// tiles, row blocks and (kv head, batch) pairs, GQA 4:1 and MQA, causal or not, each also
// deterministic (turns and all), and a causal varlen batch (the sequences' own key tiles).
std::vector<AttnConfig> launch_cases(DType dtype) {
  std::vector<AttnConfig> cases;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      AttnConfig cfg = feature_config(dtype, d, 333, 517);
      cfg.batch = 3;
      cfg.heads = 8;
      cfg.heads_k = causal ? 2 : 1;
      cfg.opt.causal = causal;
      cases.push_back(cfg);
      cfg.opt.deterministic = true;
      cases.push_back(cfg);
    }
    AttnConfig varlen = feature_config(dtype, d, 0, 0);
    varlen.varlen_q = {200, 1, 333};
    varlen.varlen_k = {517, 64, 333};
    varlen.opt.causal = true;
    cases.push_back(varlen);
  }
  return cases;
}

// The three kernels launched one after another (FLASHATTN_SM90_BWD_PDL=0) instead of each as the
// programmatic dependent of the one before (the default, bwd_dependent_launch): both ways match.
TEST_P(CudaSm90BackwardFeatures, SeparateLaunches) {
  FA_SKIP_WITHOUT_SM90();
  const EnvOverride separate("FLASHATTN_SM90_BWD_PDL", "0");
  for (const AttnConfig& cfg : launch_cases(GetParam())) expect_sm90_backward_matches(cfg);
}

// The tile-major launch order forced everywhere (FLASHATTN_SM90_BWD_TILE_MAJOR=1: one-dimensional
// grid, key tiles slowest; by default only masked grids of at most two waves take it): every block
// must still find its (key tile, kv head, batch); a deterministic call keeps the default order
// (and its turns) and still matches.
TEST_P(CudaSm90BackwardFeatures, TileMajorLaunchOrder) {
  FA_SKIP_WITHOUT_SM90();
  const EnvOverride order("FLASHATTN_SM90_BWD_TILE_MAJOR", "1");
  for (const AttnConfig& cfg : launch_cases(GetParam())) expect_sm90_backward_matches(cfg);
}

// GQA walks with the heads inner (builds with FLASHATTN_SM90_BWD_HEADS_INNER=1, asked for by
// FLASHATTN_SM90_BWD_GQA_WALK=inner): causal and not, a window, groups of 2 and 8, a varlen batch,
// ALiBi (the step's head picks the slope) and dropout (and its Philox stream), both launch orders.
TEST_P(CudaSm90BackwardFeatures, HeadsInnerWalk) {
  FA_SKIP_WITHOUT_SM90();
  if (!heads_inner_built()) GTEST_SKIP() << "built without FLASHATTN_SM90_BWD_HEADS_INNER=1: no such walk to test";
  const EnvOverride walk("FLASHATTN_SM90_BWD_GQA_WALK", "inner");
  for (int d : {64, 128, 256}) {
    for (int variant = 0; variant < 4; ++variant) {
      AttnConfig cfg = feature_config(GetParam(), d, 333, 517);
      cfg.batch = 2;
      cfg.heads = 8;
      cfg.heads_k = variant == 3 ? 4 : 1;
      cfg.opt.causal = variant == 0 || variant == 3;
      if (variant == 2) {
        cfg.opt.window_left = 100;
        cfg.opt.window_right = 20;
      }
      if (variant == 3) {
        cfg.alibi = Alibi::per_head;
        cfg.opt.dropout_p = 0.15f;
        cfg.opt.dropout_seed = 21;
      }
      expect_sm90_backward_matches(cfg);
      const EnvOverride order("FLASHATTN_SM90_BWD_TILE_MAJOR", "1");
      expect_sm90_backward_matches(cfg);
    }
    AttnConfig varlen = feature_config(GetParam(), d, 0, 0);
    varlen.heads = 4;
    varlen.heads_k = 2;
    varlen.varlen_q = {200, 1, 333};
    varlen.varlen_k = {517, 64, 333};
    varlen.opt.causal = true;
    expect_sm90_backward_matches(varlen);
  }
}

// Softcap 1.5 with scores well past it (the derivative 1 − tanh² far from 1), ALiBi per head and
// per (batch, head), both together, causal or not, GQA (the slope is the query head's).
TEST_P(CudaSm90BackwardFeatures, SoftcapAndAlibi) {
  FA_SKIP_WITHOUT_SM90();
  for (const AttnConfig& cfg : softcap_configs(GetParam())) {
    expect_sm90_backward_matches(cfg);
  }
  for (auto d : kFeatureDims) {
    for (Alibi a : {Alibi::per_head, Alibi::per_batch_head}) {
      for (bool causal : {false, true}) {
        AttnConfig cfg = feature_config_dv(GetParam(), d, 200, 333);
        cfg.alibi = a;
        cfg.opt.causal = causal;
        expect_sm90_backward_matches(cfg);
        cfg.opt.softcap = 5.0f;
        expect_sm90_backward_matches(cfg);
      }
    }
  }
}

// Dropout: the forward's Philox mask drawn in the transposed layout of Sᵀ (two of the forward's
// lanes per thread and block), dense and varlen (positions within each sequence), alone (the
// dropout-only variant where it is built: FLASHATTN_SM90_BWD_LEAN_DROPOUT), with softcap or with
// ALiBi (the variant with all three), GQA and deterministic.
TEST_P(CudaSm90BackwardFeatures, Dropout) {
  FA_SKIP_WITHOUT_SM90();
  for (const AttnConfig& cfg : dropout_configs(GetParam())) {
    expect_sm90_backward_matches(cfg);
  }
  for (auto d : kFeatureDims) {
    for (bool softcap : {false, true}) {
      AttnConfig cfg = feature_config_dv(GetParam(), d, 0, 0);
      cfg.varlen_q = {130, 0, 47};
      cfg.varlen_k = {100, 30, 260};
      cfg.opt.dropout_p = 0.25f;
      cfg.opt.dropout_seed = 99;
      cfg.opt.dropout_offset = 3;
      cfg.opt.causal = true;
      if (softcap) cfg.opt.softcap = 10.0f;
      expect_sm90_backward_matches(cfg);
    }
    AttnConfig alibi = feature_config_dv(GetParam(), d, 150, 333);
    alibi.alibi = Alibi::per_head;
    alibi.opt.dropout_p = 0.1f;
    alibi.opt.dropout_seed = 7;
    expect_sm90_backward_matches(alibi);
    AttnConfig gqa = feature_config_dv(GetParam(), d, 200, 257);
    gqa.heads = 8;
    gqa.heads_k = 2;
    gqa.opt.dropout_p = 0.3f;
    gqa.opt.dropout_seed = 0xfeedull;
    gqa.opt.dropout_offset = 11;
    gqa.opt.deterministic = true;
    expect_sm90_backward_matches(gqa);
  }
}

// Varlen batches: empty sequences (no rows, no keys), lengths that end inside row blocks and key
// tiles (the next sequence's rows zeroed in shared memory), causal and windows, GQA, seqused_k
// (the unused keys' dK/dV zero), deterministic: with a window (descending turns) and without a
// mask (staggered walks in the sequences with no more key tiles than row blocks, descending turns
// in the others).
TEST_P(CudaSm90BackwardFeatures, Varlen) {
  FA_SKIP_WITHOUT_SM90();
  for (int d : {64, 128, 256}) {
    for (int variant = 0; variant < 5; ++variant) {
      AttnConfig cfg = feature_config(GetParam(), d, 0, 0);
      cfg.varlen_q = {300, 0, 129, 1, 77};
      cfg.varlen_k = {257, 64, 400, 0, 200};
      if (variant == 1) cfg.opt.causal = true;
      if (variant == 2) {
        cfg.opt.window_left = 70;
        cfg.opt.window_right = 30;
        cfg.opt.deterministic = true;
      }
      if (variant == 3) {
        cfg.seqused_k = {200, 10, 399, 0, 150};
        cfg.opt.causal = true;
      }
      if (variant == 4) cfg.opt.deterministic = true;
      expect_sm90_backward_matches(cfg);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaSm90BackwardFeatures, testing::Values(DType::f16, DType::bf16),
                         [](const testing::TestParamInfo<DType>& info) {
                           return std::string(info.param == DType::f16 ? "f16" : "bf16");
                         });

}  // namespace
}  // namespace fa_test::cuda
