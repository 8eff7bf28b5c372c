// tests/cuda/test_cuda_splitkv.cpp — split-KV in the CUDA forward and the CUDA combine kernel.
// Decoding shapes (1 or 4 query rows, GQA, long and odd context lengths; dense, paged and varlen
// K/V; causal and sliding-window masks) run with the split count forced through
// AttentionParams::num_splits and checked against the fp64 reference (SPEC §7, check_forward);
// the combine kernel is compared with the CPU combine (bit for bit where one split contributes,
// within a few fp32 ulps where expf / logf may differ from the host's); the public combine and
// forward take CUDA tensors. The heuristic and the workspace size are checked on the host.
// Without a GPU the device tests skip and say they were not run.
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "cuda/sm90/sm90_fwd.h"
#include "cuda_test_util.h"

namespace fa_test::cuda {
namespace {

namespace c = flashattn::common;
using flashattn::DType;

constexpr float kInf = std::numeric_limits<float>::infinity();

const char* dtype_tag(DType t) { return t == DType::f16 ? "f16" : t == DType::bf16 ? "bf16" : "f32"; }

ParamsHook force_splits(int num_splits) {
  return [num_splits](c::AttentionParams& dp, DeviceArena&) { dp.num_splits = num_splits; };
}

ParamsHook then(ParamsHook first, ParamsHook second) {
  return [first, second](c::AttentionParams& dp, DeviceArena& dev) {
    first(dp, dev);
    second(dp, dev);
  };
}

// A decoding problem: b sequences of sq query rows against sk keys, h = 8 query heads on 2 KV heads.
AttnConfig decode_config(DType dtype, int d, int sq, int sk) {
  AttnConfig cfg;
  cfg.dtype = dtype;
  cfg.head_dim = d;
  cfg.batch = 2;
  cfg.seqlen_q = sq;
  cfg.seqlen_k = sk;
  cfg.heads = 8;
  cfg.heads_k = 2;
  return cfg;
}

// The family settings a split runs under: the ordered choice, and the sm90 family forced where this
// GPU runs it and the build has its split-KV kernels (-DFLASHATTN_SM90_FWD_SPLIT=1; said once where
// not).
std::vector<const char*> split_families() {
  std::string why;
  if (sm90_available(&why) && flashattn::cuda::sm90::fwd_split_built()) return {"", "sm90"};
  static bool said = false;
  if (!said) {
    std::printf("NOT RUN: split-KV on the sm90 family (%s)\n",
                why.empty() ? "built without -DFLASHATTN_SM90_FWD_SPLIT=1" : why.c_str());
    said = true;
  }
  return {""};
}

void expect_split_matches(const AttnConfig& cfg, int num_splits, const ParamsHook& extra = {}) {
  const AttnProblem p = make_problem(cfg);
  SCOPED_TRACE(describe(p.cfg) + " splits " + std::to_string(num_splits));
  const ParamsHook hook = extra ? then(force_splits(num_splits), extra) : force_splits(num_splits);
  for (const char* family : split_families()) {
    SCOPED_TRACE(std::string("FLASHATTN_CUDA_FAMILY=") + family);
    const FamilyOverride forced(family);
    ForwardResult r;
    try {
      r = run_cuda_forward(p, hook, nullptr, /*with_workspace=*/true);
    } catch (const flashattn::Error& e) {
      // A forced family that does not serve the call (the sm90 family and a call without keys)
      // refuses it, naming the setting; the ordered choice above ran it.
      const std::string why = e.what();
      if (*family == '\0' || why.find(std::string("FLASHATTN_CUDA_FAMILY=") + family) == std::string::npos) throw;
      std::printf("NOT RUN on the %s family (it does not serve this call): %s\n", family, why.c_str());
      continue;
    }
    EXPECT_TRUE(check_forward(p, r));
  }
}

// --- the decoding grid --------------------------------------------------------------------------

enum class MaskKind { none, causal, window };

struct DecodeCase {
  DType dtype;
  int d;
  int sq, sk;
  MaskKind mask;
  int splits;
};

std::vector<DecodeCase> decode_cases() {
  const std::pair<int, int> shapes[] = {{1, 8192}, {4, 3000}};
  std::vector<DecodeCase> cases;
  for (DType dt : {DType::f16, DType::bf16})
    for (int d : {64, 128, 256})
      for (auto [sq, sk] : shapes)
        for (MaskKind m : {MaskKind::none, MaskKind::causal, MaskKind::window})
          // 128 splits of at most 128 key tiles: most shares are short, many empty.
          for (int splits : {5, 128}) cases.push_back({dt, d, sq, sk, m, splits});
  return cases;
}

std::string decode_label(const DecodeCase& c) {
  const char* mask = c.mask == MaskKind::none ? "full" : c.mask == MaskKind::causal ? "causal" : "window";
  return std::string(dtype_tag(c.dtype)) + "_d" + std::to_string(c.d) + "_" + std::to_string(c.sq) + "x" +
         std::to_string(c.sk) + "_" + mask + "_splits" + std::to_string(c.splits);
}
std::string decode_name(const testing::TestParamInfo<DecodeCase>& info) { return decode_label(info.param); }
void PrintTo(const DecodeCase& c, std::ostream* os) { *os << decode_label(c); }

class CudaSplitKvDecode : public testing::TestWithParam<DecodeCase> {};

TEST_P(CudaSplitKvDecode, MatchesReference) {
  FA_SKIP_WITHOUT_GPU();
  const DecodeCase& dc = GetParam();
  AttnConfig cfg = decode_config(dc.dtype, dc.d, dc.sq, dc.sk);
  if (dc.mask == MaskKind::causal) cfg.opt.causal = true;
  if (dc.mask == MaskKind::window) {
    cfg.opt.window_left = 1000;  // a band of ~1000 keys ending at the diagonal
    cfg.opt.window_right = 0;
  }
  expect_split_matches(cfg, dc.splits);
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaSplitKvDecode, testing::ValuesIn(decode_cases()), decode_name);

// --- features, per dtype ------------------------------------------------------------------------

class CudaSplitKv : public testing::TestWithParam<DType> {};

// Paged caches: each sequence's pages shuffled over the pool (with a spare, poisoned page); key
// tiles and split shares cross page boundaries, the last page is partly filled.
ParamsHook paged_hook(const AttnProblem& p, int page) {
  const int b = p.cfg.batch, sk = p.cfg.seqlen_k, hk = p.cfg.heads_k;
  const int pages_per_seq = (sk + page - 1) / page;
  std::vector<std::int32_t> order(std::size_t(b) * pages_per_seq + 1);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(test_seed(std::uint64_t(page) + 17)));
  order.pop_back();  // the page left out stays poisoned
  auto to_pages = [&](const Tensor& dense) {
    const int width = int(dense.shape(3));
    Tensor pool(dense.dtype(), {std::int64_t(order.size()) + 1, page, hk, width});
    dense.for_each_index([&](const Index& ix) {
      const std::int32_t pg = order[std::size_t(ix[0]) * pages_per_seq + std::size_t(ix[1]) / page];
      pool.set({pg, ix[1] % page, ix[2], ix[3]}, dense.get(ix));
    });
    return pool;
  };
  const std::vector<Tensor> keep = {to_pages(p.k), to_pages(p.v)};
  return [keep, order, page, pages_per_seq](c::AttentionParams& dp, DeviceArena& dev) {
    c::RowHeadTensor* views[] = {&dp.k, &dp.v};
    for (int t = 0; t < 2; ++t) {
      views[t]->data = dev.mirror(keep[std::size_t(t)]);
      views[t]->batch_stride = keep[std::size_t(t)].stride()[0];
      views[t]->row_stride = keep[std::size_t(t)].stride()[1];
      views[t]->head_stride = keep[std::size_t(t)].stride()[2];
    }
    dp.block_table = dev.upload_vector(order);
    dp.block_table_batch_stride = pages_per_seq;
    dp.page_size = page;
  };
}

TEST_P(CudaSplitKv, PagedKV) {
  FA_SKIP_WITHOUT_GPU();
  for (int page : {16, 256}) {
    for (int d : {64, 128, 256}) {
      for (bool causal : {false, true}) {
        AttnConfig cfg = decode_config(GetParam(), d, causal ? 4 : 1, 3000);
        cfg.opt.causal = causal;
        const AttnProblem p = make_problem(cfg);
        SCOPED_TRACE(describe(cfg) + " page " + std::to_string(page));
        const ForwardResult r = run_cuda_forward(p, then(force_splits(7), paged_hook(p, page)), nullptr, true);
        EXPECT_TRUE(check_forward(p, r));
      }
    }
  }
}

// The combine launched as the split kernel's programmatic dependent (FLASHATTN_COMBINE_PDL, the
// default on sm_90; other GPUs launch it the usual way), in its kVec layout (the default there) or
// not, and launched the usual way: the same results — dense, causal over a paged cache, and shares
// of which most are empty (128 splits).
TEST_P(CudaSplitKv, CombineAsProgrammaticDependent) {
  FA_SKIP_WITHOUT_GPU();
  struct Setting {
    const char* pdl;
    const char* vec;
  };
  for (const Setting& setting : {Setting{"1", ""}, Setting{"1", "0"}, Setting{"0", ""}}) {
    SCOPED_TRACE(std::string("FLASHATTN_COMBINE_PDL=") + setting.pdl + " FLASHATTN_COMBINE_VEC=" + setting.vec);
    const EnvOverride pdl("FLASHATTN_COMBINE_PDL", setting.pdl);
    const EnvOverride vec("FLASHATTN_COMBINE_VEC", setting.vec);
    for (int d : {64, 128, 256}) {
      for (int splits : {5, 128}) expect_split_matches(decode_config(GetParam(), d, 1, 8192), splits);
      AttnConfig cfg = decode_config(GetParam(), d, 4, 3000);
      cfg.opt.causal = true;
      const AttnProblem p = make_problem(cfg);
      SCOPED_TRACE(describe(cfg) + " page 16");
      const ForwardResult r = run_cuda_forward(p, then(force_splits(7), paged_hook(p, 16)), nullptr, true);
      EXPECT_TRUE(check_forward(p, r));
    }
  }
}

// Varlen batches with seqused_k: sequences of different lengths (one without keys, one without
// rows) share the grid, so their split shares differ in size; the combine writes packed rows.
TEST_P(CudaSplitKv, VarlenWithSequsedK) {
  FA_SKIP_WITHOUT_GPU();
  for (int d : {64, 128, 256}) {
    for (MaskKind m : {MaskKind::none, MaskKind::causal, MaskKind::window}) {
      AttnConfig cfg = decode_config(GetParam(), d, 0, 0);
      cfg.varlen_q = {1, 4, 0, 3, 2};
      cfg.varlen_k = {3000, 5000, 77, 0, 1200};
      cfg.seqused_k = {2999, 4100, 77, 0, 1};
      cfg.opt.causal = m == MaskKind::causal;
      if (m == MaskKind::window) cfg.opt.window_left = 500;
      expect_split_matches(cfg, 9);
    }
  }
}

// Softcap, ALiBi and dropout run in the other kernel variant (half the key tile); each split
// applies them at the global key positions, so the merged result is the unsplit function.
TEST_P(CudaSplitKv, ScoreModsAndDropout) {
  FA_SKIP_WITHOUT_GPU();
  for (int d : {64, 128, 256}) {
    AttnConfig cfg = decode_config(GetParam(), d, 4, 3000);
    cfg.qk_amplitude = 3.0f;
    cfg.opt.softcap = 2.0f;
    cfg.opt.causal = true;
    expect_split_matches(cfg, 6);

    cfg = decode_config(GetParam(), d, 1, 2500);
    cfg.alibi = Alibi::per_batch_head;
    expect_split_matches(cfg, 11);

    cfg = decode_config(GetParam(), d, 4, 2000);
    cfg.opt.dropout_p = 0.2f;
    cfg.opt.dropout_seed = 0x0123456789abcdefull;
    cfg.opt.dropout_offset = 3;
    expect_split_matches(cfg, 4);
  }
}

TEST_P(CudaSplitKv, SpecialCases) {
  FA_SKIP_WITHOUT_GPU();
  {  // no keys at all: every share is empty, out 0 and lse +inf
    expect_split_matches(decode_config(GetParam(), 64, 4, 0), 3);
  }
  {  // more query rows than keys, causal: the first rows see no key in any share
    AttnConfig cfg = decode_config(GetParam(), 128, 300, 200);
    cfg.opt.causal = true;
    expect_split_matches(cfg, 4);
  }
  {  // lse not asked for: the partials still carry it, the combine does not write it
    AttnConfig cfg = decode_config(GetParam(), 128, 1, 4000);
    cfg.opt.return_lse = false;
    expect_split_matches(cfg, 8);
  }
  {  // d != dv and predicated head dims, a peaky softmax across shares
    AttnConfig cfg = decode_config(GetParam(), 192, 4, 3001);
    cfg.head_dim_v = 128;
    cfg.qk_amplitude = 5.0f;
    expect_split_matches(cfg, 13);
    cfg.head_dim = 40;
    cfg.head_dim_v = 200;
    expect_split_matches(cfg, 2);
  }
  {  // more splits than key tiles: the extra shares are empty
    expect_split_matches(decode_config(GetParam(), 256, 1, 130), 128);
  }
  {  // several row blocks, each split on its own
    AttnConfig cfg = decode_config(GetParam(), 64, 300, 2000);
    cfg.opt.window_left = 300;
    cfg.opt.window_right = 40;
    expect_split_matches(cfg, 3);
  }
}

// All keys in one share (one key tile, the other shares empty): the partial is the unsplit
// kernel's fp32 result, and the combine (weight exp 0 = 1) rounds it the same way — bit for bit.
// With many tiles the shares' sums are ordered differently, so the bits differ somewhere (which
// also shows that the split path ran); the accuracy is checked by the reference.
TEST_P(CudaSplitKv, OneShareIsBitExactAndManyAreNot) {
  FA_SKIP_WITHOUT_GPU();
  // Bitwise against the unsplit path of the same family: the sm80 family's, which splits (the
  // ordered choice may give an unsplit call to sm90 on a Hopper GPU).
  const FamilyOverride family("sm80");
  for (int d : {64, 128, 256}) {
    const AttnProblem small = make_problem(decode_config(GetParam(), d, 4, 30));
    SCOPED_TRACE(describe(small.cfg));
    const ForwardResult plain = run_cuda_forward(small);
    if (plain.not_run) continue;  // a restricted build (skip recorded)
    const ForwardResult split = run_cuda_forward(small, force_splits(4), nullptr, true);
    EXPECT_TRUE(bitwise_equal(plain.out, split.out));
    EXPECT_TRUE(bitwise_equal(plain.lse, split.lse));

    const AttnProblem big = make_problem(decode_config(GetParam(), d, 4, 8192));
    const ForwardResult big_plain = run_cuda_forward(big);
    const ForwardResult big_split = run_cuda_forward(big, force_splits(16), nullptr, true);
    EXPECT_TRUE(check_forward(big, big_split));
    EXPECT_FALSE(bitwise_equal(big_plain.lse, big_split.lse)) << "the split path did not run";
  }
}

// The non-split path: no workspace, or num_splits = 1 with one, runs unsplit and still passes.
TEST_P(CudaSplitKv, UnsplitPathsStillPass) {
  FA_SKIP_WITHOUT_GPU();
  // Bitwise against the unsplit path of the same family: the sm80 family's, which splits (the
  // ordered choice may give an unsplit call to sm90 on a Hopper GPU).
  const FamilyOverride family("sm80");
  for (int d : {64, 128, 256}) {
    const AttnProblem p = make_problem(decode_config(GetParam(), d, 4, 3000));
    SCOPED_TRACE(describe(p.cfg));
    const ForwardResult plain = run_cuda_forward(p);
    EXPECT_TRUE(check_forward(p, plain));
    if (plain.not_run) continue;  // a restricted build (skip recorded)
    const ForwardResult one = run_cuda_forward(p, force_splits(1), nullptr, true);
    EXPECT_TRUE(bitwise_equal(plain.out, one.out));
    EXPECT_TRUE(bitwise_equal(plain.lse, one.lse));
  }
}

// The heuristic (num_splits = 0) with its workspace: decoding with few heads splits on any GPU.
TEST_P(CudaSplitKv, HeuristicChoice) {
  FA_SKIP_WITHOUT_GPU();
  AttnConfig cfg = decode_config(GetParam(), 128, 1, 8192);
  cfg.batch = 1;
  const AttnProblem p = make_problem(cfg);
  SCOPED_TRACE(describe(p.cfg));
  int chosen = 0;
  const ForwardResult r = run_cuda_forward(
      p, [&](c::AttentionParams& dp, DeviceArena&) { chosen = flashattn::cuda::forward_num_splits(dp); }, nullptr,
      true);
  if (r.not_run) return;  // a restricted build (skip recorded)
  EXPECT_GT(chosen, 1);
  EXPECT_LE(chosen, flashattn::cuda::kMaxSplits);
  EXPECT_TRUE(check_forward(p, r));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaSplitKv, testing::Values(DType::f16, DType::bf16),
                         [](const testing::TestParamInfo<DType>& info) { return std::string(dtype_tag(info.param)); });

// --- the combine kernel against the CPU combine -------------------------------------------------

flashattn::TensorView device_view(const Tensor& t, void* data) {
  flashattn::TensorView v = t.tv();
  v.data = data;
  v.device = {flashattn::DeviceType::cuda, 0};
  return v;
}

struct CombineCase {
  int splits;
  int dv;
  DType out_dtype;
  bool padded;  // gaps between heads / rows / batches of out_partial and out
};

std::string combine_label(const CombineCase& cc) {
  return "splits" + std::to_string(cc.splits) + "_dv" + std::to_string(cc.dv) + "_" + dtype_tag(cc.out_dtype) +
         (cc.padded ? "_padded" : "");
}
std::string combine_name(const testing::TestParamInfo<CombineCase>& info) { return combine_label(info.param); }
void PrintTo(const CombineCase& cc, std::ostream* os) { *os << combine_label(cc); }

class CudaCombine : public testing::TestWithParam<CombineCase> {};

// Random partials with every kind of split: finite lse of either sign and wide range, +inf (no
// key, this library's convention), −inf (other producers); out_partial of a non-finite split is
// NaN and must be skipped. Some rows have one finite split, some none.
void expect_combine_matches_cpu(const CombineCase& cc) {
  const std::int64_t s = cc.splits, b = 2, sq = 5, h = 3, dv = cc.dv;
  auto rows_tensor = [&](DType dt, Shape shape) {
    if (!cc.padded) return Tensor(dt, shape);
    // Gaps after each head, row and batch (poisoned); the last dim stays contiguous.
    Strides st(shape.size());
    std::int64_t stride = 1;
    for (int i = int(shape.size()) - 1; i >= 0; --i) {
      st[std::size_t(i)] = stride;
      stride = stride * shape[std::size_t(i)] + (i == int(shape.size()) - 1 ? 0 : 8);
    }
    return Tensor::with_strides(dt, shape, st);
  };
  Tensor out_partial = rows_tensor(DType::f32, {s, b, sq, h, dv});
  Tensor lse_partial(DType::f32, {s, b, h, sq});
  out_partial.fill_random(test_seed(1), -2.0f, 2.0f);
  lse_partial.fill_random(test_seed(2), -30.0f, 30.0f);
  std::mt19937_64 rng(test_seed(3));
  for (std::int64_t bi = 0; bi < b; ++bi) {
    for (std::int64_t i = 0; i < sq; ++i) {
      for (std::int64_t hh = 0; hh < h; ++hh) {
        const std::uint64_t kind = rng() % 4;  // 0: none finite, 1: one finite, else: a random mix
        const std::int64_t keep = std::int64_t(rng() % std::uint64_t(s));
        for (std::int64_t si = 0; si < s; ++si) {
          bool finite = kind >= 2 ? rng() % 3 != 0 : (kind == 1 && si == keep);
          if (s == 1 && kind >= 2) finite = true;
          if (finite) continue;
          lse_partial.set({si, bi, hh, i}, rng() % 2 ? kInf : -kInf);
          for (std::int64_t x = 0; x < dv; ++x) out_partial.set({si, bi, i, hh, x}, std::nanf(""));
        }
      }
    }
  }

  Tensor cpu_out = rows_tensor(cc.out_dtype, {b, sq, h, dv});
  Tensor cpu_lse(DType::f32, {b, h, sq});
  flashattn::combine({out_partial.tv(), lse_partial.tv()}, {cpu_out.tv(), cpu_lse.tv()});

  Tensor gpu_out = Tensor::empty_like(cpu_out);
  Tensor gpu_lse = Tensor::empty_like(cpu_lse);
  DeviceArena dev;
  void* d_out = dev.mirror(gpu_out);
  void* d_lse = dev.mirror(gpu_lse);
  flashattn::combine({device_view(out_partial, dev.mirror(out_partial)), device_view(lse_partial, dev.mirror(lse_partial))},
                     {device_view(gpu_out, d_out), device_view(gpu_lse, d_lse)});
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  DeviceArena::download(gpu_out, d_out);
  DeviceArena::download(gpu_lse, d_lse);

  // Rows with at most one finite split: bit for bit. Others: expf / logf of the device may differ
  // from the host's by an ulp or two, which moves the fp32 sums by a few ulps of the result (and
  // may flip one rounding of a f16 / bf16 output).
  const double u_out = cc.out_dtype == DType::f32 ? 0.0 : unit_roundoff(cc.out_dtype);
  std::int64_t mismatches = 0, exact_rows = 0;
  for (std::int64_t bi = 0; bi < b; ++bi) {
    for (std::int64_t i = 0; i < sq; ++i) {
      for (std::int64_t hh = 0; hh < h; ++hh) {
        int finite = 0;
        for (std::int64_t si = 0; si < s; ++si) finite += std::isfinite(lse_partial.get({si, bi, hh, i}));
        const bool exact = finite <= 1;
        exact_rows += exact;
        auto close = [&](float got, float want, double u) {
          if (std::isnan(got) || std::isnan(want)) return false;
          if (exact || std::isinf(want)) return got == want && std::signbit(got) == std::signbit(want);
          return std::fabs(double(got) - want) <= 1e-5 * (1.0 + std::fabs(want)) + 2.0 * u * std::fabs(want);
        };
        const float gl = gpu_lse.get({bi, hh, i}), cl = cpu_lse.get({bi, hh, i});
        if (!close(gl, cl, 0.0)) {
          ++mismatches;
          ADD_FAILURE() << "lse (" << bi << ", " << hh << ", " << i << "): cuda " << gl << ", cpu " << cl;
        }
        for (std::int64_t x = 0; x < dv; ++x) {
          const float go = gpu_out.get({bi, i, hh, x}), co = cpu_out.get({bi, i, hh, x});
          if (!close(go, co, u_out) && ++mismatches <= 10) {
            ADD_FAILURE() << "out (" << bi << ", " << i << ", " << hh << ", " << x << "): cuda " << go << ", cpu "
                          << co << (exact ? " (bit for bit expected)" : "");
          }
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(exact_rows, 0);
  EXPECT_EQ(gpu_out.count_written_outside_view(), 0);
}

// The kernel's two layouts: a lane's columns strided by the warp (the default), and adjacent with
// 16-byte loads and the first splits' rows loaded beside the lse (FLASHATTN_COMBINE_VEC=1, the
// default only after the split kernel; every case here allows it: dv a multiple of 4, the gaps of
// 8 elements).
TEST_P(CudaCombine, MatchesCpuCombine) {
  FA_SKIP_WITHOUT_GPU();
  for (const char* vec : {"0", "1"}) {
    SCOPED_TRACE(std::string("FLASHATTN_COMBINE_VEC=") + vec);
    const EnvOverride layout("FLASHATTN_COMBINE_VEC", vec);
    expect_combine_matches_cpu(GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CudaCombine,
    testing::Values(CombineCase{1, 64, DType::f16, false}, CombineCase{3, 64, DType::bf16, false},
                    CombineCase{17, 128, DType::f16, true}, CombineCase{128, 128, DType::bf16, false},
                    CombineCase{9, 40, DType::f32, true}, CombineCase{5, 320, DType::f32, false},
                    CombineCase{2, 256, DType::f16, false}),
    combine_name);

// The public forward on CUDA tensors with the workspace forward_workspace_size asks for: a
// decoding shape splits, and the result passes the accuracy rule. One byte less runs unsplit, as
// does no workspace (bit for bit the same). Host tensors need no workspace.
TEST(CudaSplitKvPublicApi, ForwardWithWorkspace) {
  FA_SKIP_WITHOUT_GPU();
  AttnConfig cfg = decode_config(DType::bf16, 128, 1, 6000);
  cfg.batch = 1;
  cfg.opt.causal = true;
  const AttnProblem p = make_problem(cfg);
  SCOPED_TRACE(describe(p.cfg));
  EXPECT_EQ(flashattn::forward_workspace_size(p.forward_inputs(), p.opt), 0u);
  if (!kernel_built(flashattn::cuda::sm80::Family::fwd_split, c::Storage::bf16, 128, 128)) return;  // skip recorded

  DeviceArena dev;
  flashattn::ForwardInputs in;
  in.q = device_view(p.q, dev.mirror(p.q));
  in.k = device_view(p.k, dev.mirror(p.k));
  in.v = device_view(p.v, dev.mirror(p.v));
  const std::size_t bytes = flashattn::forward_workspace_size(in, p.opt);
  EXPECT_GT(bytes, 0u);
  const std::vector<std::uint8_t> poison(bytes, 0xff);
  void* d_ws = dev.upload(poison.data(), bytes);
  auto run = [&](flashattn::Workspace ws) {
    ForwardResult r = make_forward_outputs(p);
    void* d_out = dev.mirror(r.out);
    void* d_lse = dev.mirror(r.lse);
    flashattn::forward(in, {device_view(r.out, d_out), device_view(r.lse, d_lse)}, p.opt, ws);
    FA_CUDA_CHECK(cudaDeviceSynchronize());
    DeviceArena::download(r.out, d_out);
    DeviceArena::download(r.lse, d_lse);
    return r;
  };
  const ForwardResult split = run({d_ws, bytes});
  EXPECT_TRUE(check_forward(p, split));
  const ForwardResult plain = run({});
  EXPECT_TRUE(check_forward(p, plain));
  const ForwardResult short_ws = run({d_ws, bytes - 1});
  EXPECT_TRUE(bitwise_equal(plain.out, short_ws.out));
  EXPECT_TRUE(bitwise_equal(plain.lse, short_ws.lse));
  EXPECT_FALSE(bitwise_equal(plain.lse, split.lse)) << "the split path did not run";

  // Workspace::grow instead of the size query: asked once for the partials of the splits the call
  // takes (here what the query counts), the same result bit for bit; not asked when the
  // workspace holds them; a short answer refused with the outputs untouched.
  GrowRecorder grower;
  grower.give = {d_ws, bytes};
  const ForwardResult grown = run(grower.on({}));
  EXPECT_EQ(grower.asked, std::vector<std::size_t>({bytes}));
  EXPECT_TRUE(bitwise_equal(split.out, grown.out) && bitwise_equal(split.lse, grown.lse));
  grower.asked.clear();
  run(grower.on({d_ws, bytes}));
  EXPECT_TRUE(grower.asked.empty());
  grower.give = {d_ws, bytes - 1};
  ForwardResult refused = make_forward_outputs(p);
  const ForwardResult poisoned = make_forward_outputs(p);
  void* d_out = dev.mirror(refused.out);
  EXPECT_THROW(flashattn::forward(in, {device_view(refused.out, d_out), {}}, p.opt, grower.on({d_ws, 256})),
               flashattn::Error);
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  DeviceArena::download(refused.out, d_out);
  EXPECT_TRUE(bitwise_equal(refused.out, poisoned.out)) << "a call whose grow answered short wrote out";
}

// The public combine on CUDA tensors equals the CPU combine on the same partials (one split per
// row contributes, so bit for bit), writes no lse when none is given.
TEST(CudaSplitKvPublicApi, CombineWithoutLse) {
  FA_SKIP_WITHOUT_GPU();
  const std::int64_t s = 4, b = 1, sq = 3, h = 2, dv = 16;
  Tensor out_partial(DType::f32, {s, b, sq, h, dv});
  Tensor lse_partial(DType::f32, {s, b, h, sq});
  out_partial.fill_random(test_seed(1));
  lse_partial.fill(kInf);
  lse_partial.for_each_index([&](const Index& ix) {
    if (ix[0] == (ix[2] + ix[3]) % s) lse_partial.set(ix, 0.5f * float(ix[3]));
  });
  Tensor cpu_out(DType::f16, {b, sq, h, dv});
  flashattn::combine({out_partial.tv(), lse_partial.tv()}, {cpu_out.tv(), {}});
  Tensor gpu_out = Tensor::empty_like(cpu_out);
  DeviceArena dev;
  void* d_out = dev.mirror(gpu_out);
  flashattn::combine({device_view(out_partial, dev.mirror(out_partial)), device_view(lse_partial, dev.mirror(lse_partial))},
                     {device_view(gpu_out, d_out), {}});
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  DeviceArena::download(gpu_out, d_out);
  EXPECT_TRUE(bitwise_equal(cpu_out, gpu_out));
}

// --- host only (no GPU needed) ------------------------------------------------------------------

TEST(CudaSplitKvHeuristic, WorkedExampleAndLimits) {
  using flashattn::cuda::num_splits_heuristic;
  // The example of cuda_backend.h: 32 CTAs of 128 key tiles on 264 slots.
  EXPECT_EQ(num_splits_heuristic(32, 128, 264, 128), 7);
  // A grid of ≥ 80 % of a wave is not split, nor is a single key tile.
  EXPECT_EQ(num_splits_heuristic(212, 128, 264, 128), 1);
  EXPECT_EQ(num_splits_heuristic(5000, 128, 264, 128), 1);
  EXPECT_EQ(num_splits_heuristic(4, 1, 264, 128), 1);
  EXPECT_EQ(num_splits_heuristic(0, 100, 264, 128), 1);
  EXPECT_EQ(num_splits_heuristic(4, 100, 0, 128), 1);
  // Never more splits than key tiles, slots or the cap.
  for (int n_blocks : {2, 3, 7, 50, 1000}) {
    for (int ctas : {1, 2, 3, 16, 100}) {
      const int s = num_splits_heuristic(ctas, n_blocks, 264, 128);
      EXPECT_GE(s, 1);
      EXPECT_LE(s, std::min(n_blocks, 128));
    }
  }
  EXPECT_LE(num_splits_heuristic(1, 100000, 1000, 128), 128);
  EXPECT_LE(num_splits_heuristic(1, 100000, 40, 128), 40);
  // One CTA on many slots spreads wide.
  EXPECT_GE(num_splits_heuristic(1, 256, 264, 128), 64);
}

TEST(CudaSplitKvWorkspace, SizeOfForcedSplits) {
  DType dtype;
  if (!built_dtype(flashattn::cuda::sm80::Family::fwd_split, 64, &dtype)) return;
  c::AttentionParams p;
  p.storage = storage_of(dtype);
  p.batch = 2;
  p.heads = 4;
  p.heads_k = 2;
  p.head_dim = p.head_dim_v = 64;
  p.max_seqlen_q = 3;
  p.max_seqlen_k = 1000;
  auto align = [](std::size_t n) { return (n + 255) / 256 * 256; };
  p.num_splits = 1;
  EXPECT_EQ(flashattn::cuda::forward_workspace_size(p), 0u);
  p.num_splits = 5;
  EXPECT_EQ(flashattn::cuda::forward_num_splits(p), 5);
  EXPECT_EQ(flashattn::cuda::forward_workspace_size(p), align(5 * 2 * 3 * 4 * 64 * 4) + align(5 * 2 * 4 * 3 * 4));
  p.num_splits = 1000;  // capped
  EXPECT_EQ(flashattn::cuda::forward_num_splits(p), flashattn::cuda::kMaxSplits);
}

}  // namespace
}  // namespace fa_test::cuda
