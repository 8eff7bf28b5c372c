// tests/cpp/test_combine.cpp — flashattn::combine merges partial (out, lse) computed over disjoint
// key sets. The keys are split into 1..4 chunks (some empty), each chunk's attention is computed by
// the cpu backend in fp32 straight into a slice of the (splits, b, sq, h, dv) buffer, and the
// combined result must equal the unsplit attention by the SPEC §7 rule (fa_test::check_forward on
// the whole problem). Empty splits (lse = +inf) carry no weight; a row empty in every split gives
// out 0 and lse +inf.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "test_util.h"

namespace fa_test {
namespace {

const float kInf = std::numeric_limits<float>::infinity();

AttnConfig combine_config(int b, int sq, int sk, int h, int hk, int d, int dv) {
  return dense_config(DType::f32, b, sq, sk, h, hk, d, dv);
}

struct Partials {
  Tensor out;  // (splits, b, sq, h, dv) f32
  Tensor lse;  // (splits, b, h, sq) f32
};

// Runs the forward of each key chunk [bounds[s], bounds[s+1]) into slice s of the partials.
Partials split_forward(const AttnProblem& p, const std::vector<int>& bounds, bool padded) {
  const int splits = int(bounds.size()) - 1;
  const std::int64_t b = p.cfg.batch, sq = p.cfg.seqlen_q, h = p.cfg.heads, dv = p.head_dim_v;
  Partials r;
  if (padded) {  // gaps between heads and rows of out_partial: only the last dim is contiguous
    const std::int64_t hs = dv + 4, rs = h * hs + 8, bs = sq * rs + 16, ss = b * bs + 32;
    r.out = Tensor::with_strides(DType::f32, {splits, b, sq, h, dv}, {ss, bs, rs, hs, 1});
  } else {
    r.out = Tensor(DType::f32, {splits, b, sq, h, dv});
  }
  r.lse = Tensor(DType::f32, {splits, b, h, sq});
  for (int s = 0; s < splits; ++s) {
    const int k0 = bounds[std::size_t(s)], n = bounds[std::size_t(s) + 1] - k0;
    // (k0 may be sk for an empty last chunk, so the offset is computed from the stride.)
    const Tensor k = p.k.view(k0 * p.k.stride()[1], {b, n, p.cfg.heads_k, p.cfg.head_dim}, p.k.stride());
    const Tensor v = p.v.view(k0 * p.v.stride()[1], {b, n, p.cfg.heads_k, dv}, p.v.stride());
    const Tensor out = r.out.view(r.out.offset({s, 0, 0, 0, 0}), {b, sq, h, dv},
                                  {r.out.stride()[1], r.out.stride()[2], r.out.stride()[3], 1});
    const Tensor lse = r.lse.view(r.lse.offset({s, 0, 0, 0}), {b, h, sq}, {h * sq, sq, 1});
    flashattn::Options opt = p.opt;
    opt.backend = Backend::cpu;
    opt.num_threads = 2;
    flashattn::forward({p.q.tv(), k.tv(), v.tv()}, {out.tv(), lse.tv()}, opt);
  }
  return r;
}

ForwardResult combine(const AttnProblem& p, const Partials& parts, DType out_dtype, bool with_lse = true) {
  ForwardResult r;
  r.out = Tensor(out_dtype, {p.cfg.batch, p.cfg.seqlen_q, p.cfg.heads, p.head_dim_v});
  r.lse = Tensor(DType::f32, {p.cfg.batch, p.cfg.heads, p.cfg.seqlen_q});
  flashattn::combine({parts.out.tv(), parts.lse.tv()},
                     {r.out.tv(), with_lse ? r.lse.tv() : flashattn::TensorView{}});
  return r;
}

struct SplitCase {
  std::string name;
  std::vector<int> bounds;  // over sk = 100
  bool padded = false;
};

class Combine : public testing::TestWithParam<SplitCase> {};

TEST_P(Combine, EqualsUnsplitForward) {
  const SplitCase& sc = GetParam();
  const AttnProblem p = make_problem(combine_config(2, 37, 100, 4, 2, 32, 48));
  const Partials parts = split_forward(p, sc.bounds, sc.padded);
  const ForwardResult r = combine(p, parts, DType::f32);
  EXPECT_TRUE(check_forward(p, r));
  EXPECT_EQ(r.out.count_written_outside_view(), 0);
  if (sc.bounds.size() == 2) {  // one split: combine is the identity
    const Tensor first = parts.out.view(0, r.out.shape(), {parts.out.stride()[1], parts.out.stride()[2],
                                                           parts.out.stride()[3], 1});
    EXPECT_TRUE(bitwise_equal(r.out, first));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Splits, Combine,
    testing::Values(SplitCase{"one", {0, 100}}, SplitCase{"two", {0, 37, 100}},
                    SplitCase{"three_first_empty", {0, 0, 60, 100}},
                    SplitCase{"four_with_empty", {0, 10, 10, 55, 100}},
                    SplitCase{"four_last_empty", {0, 1, 50, 100, 100}},
                    SplitCase{"three_padded", {0, 33, 66, 100}, true}),
    [](const testing::TestParamInfo<SplitCase>& info) { return info.param.name; });

// Splits with ALiBi and dropout would change meaning per chunk (positions, streams), but
// softcap and GQA do not: the combined result still equals the unsplit forward.
TEST(CombineFeatures, SoftcapAndGqa) {
  AttnConfig c = combine_config(1, 50, 90, 8, 1, 64, 64);
  c.opt.softcap = 2.0f;
  c.qk_amplitude = 2.0f;
  const AttnProblem p = make_problem(c);
  const ForwardResult r = combine(p, split_forward(p, {0, 20, 21, 90}, false), DType::f32);
  EXPECT_TRUE(check_forward(p, r));
}

// Rows empty in some splits ignore those splits' out_partial, whatever it holds; a row empty in
// every split gives out = 0 and lse = +inf, never NaN.
TEST(CombineFeatures, EmptySplitsCarryNoWeight) {
  const AttnProblem p = make_problem(combine_config(2, 9, 40, 2, 2, 16, 16));
  Partials parts = split_forward(p, {0, 15, 40}, false);
  const ForwardResult whole = combine(p, parts, DType::f32);
  // Row (b=1, i=4, head 1): empty in split 0 (garbage out), real in split 1.
  // Row (b=0, i=2, head 0): empty in both splits.
  for (int c = 0; c < 16; ++c) {
    parts.out.set({0, 1, 4, 1, c}, 1000.0f + float(c));
    parts.out.set({0, 0, 2, 0, c}, -7.0f);
    parts.out.set({1, 0, 2, 0, c}, 3.0f);
  }
  parts.lse.set({0, 1, 1, 4}, kInf);
  parts.lse.set({0, 0, 0, 2}, kInf);
  parts.lse.set({1, 0, 0, 2}, kInf);
  const ForwardResult r = combine(p, parts, DType::f32);
  EXPECT_EQ(r.lse.get({0, 0, 2}), kInf);
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(r.out.get({0, 2, 0, c}), 0.0f) << c;
    EXPECT_EQ(r.out.get({1, 4, 1, c}), parts.out.get({1, 1, 4, 1, c})) << c;
  }
  EXPECT_EQ(r.lse.get({1, 1, 4}), parts.lse.get({1, 1, 1, 4}));
  // Every other row is unchanged from the unmodified combine.
  r.out.for_each_index([&](const Index& idx) {
    const bool modified = (idx[0] == 0 && idx[1] == 2 && idx[2] == 0) || (idx[0] == 1 && idx[1] == 4 && idx[2] == 1);
    if (!modified) ASSERT_EQ(r.out.get(idx), whole.out.get(idx));
  });
}

// Splits whose keys are all masked: a causal forward of a chunk with sq > chunk length leaves
// rows empty (lse = +inf) — combined with a split that sees everything, they carry no weight.
TEST(CombineFeatures, FullyMaskedRowsFromForward) {
  AttnConfig c = combine_config(1, 30, 10, 2, 2, 16, 16);
  c.opt.causal = true;  // rows 0..19 see nothing
  const AttnProblem p = make_problem(c);
  const Partials masked = split_forward(p, {0, 10}, false);
  for (int i = 0; i < 20; ++i) ASSERT_EQ(masked.lse.get({0, 0, 0, i}), kInf) << i;
  // Two copies of the same split: combine must give back the same out and lse + log 2.
  Partials twice;
  twice.out = Tensor(DType::f32, {2, 1, 30, 2, 16});
  twice.lse = Tensor(DType::f32, {2, 1, 2, 30});
  twice.out.for_each_index([&](const Index& idx) {
    twice.out.set(idx, masked.out.get({0, idx[1], idx[2], idx[3], idx[4]}));
  });
  twice.lse.for_each_index([&](const Index& idx) {
    twice.lse.set(idx, masked.lse.get({0, idx[1], idx[2], idx[3]}));
  });
  const ForwardResult r = combine(p, twice, DType::f32);
  for (int hh = 0; hh < 2; ++hh)
    for (int i = 0; i < 30; ++i) {
      const float l = masked.lse.get({0, 0, hh, i});
      if (i < 20) {
        EXPECT_EQ(r.lse.get({0, hh, i}), kInf);
        for (int cc = 0; cc < 16; ++cc) EXPECT_EQ(r.out.get({0, i, hh, cc}), 0.0f);
      } else {
        EXPECT_NEAR(r.lse.get({0, hh, i}), l + std::log(2.0), 1e-5);
        for (int cc = 0; cc < 16; ++cc)
          EXPECT_NEAR(r.out.get({0, i, hh, cc}), masked.out.get({0, 0, i, hh, cc}), 1e-6);
      }
    }
  EXPECT_TRUE(check_forward(p, combine(p, masked, DType::f32)));
}

// Output in f16 / bf16 is the f32 combination rounded once; lse may be omitted.
TEST(CombineFeatures, LowPrecisionOutputAndNoLse) {
  const AttnProblem p = make_problem(combine_config(1, 21, 64, 2, 2, 32, 32));
  const Partials parts = split_forward(p, {0, 30, 64}, false);
  const ForwardResult ref = combine(p, parts, DType::f32);
  for (DType dt : {DType::f16, DType::bf16}) {
    const ForwardResult r = combine(p, parts, dt, /*with_lse=*/false);
    const double u = unit_roundoff(dt);
    r.out.for_each_index([&](const Index& idx) {
      const double want = ref.out.get(idx), got = r.out.get(idx);
      // One rounding of the fp32 value (≤ u·|x|), plus the few fp32 ulps by which two
      // evaluations of the same sum may differ.
      ASSERT_LE(std::abs(got - want), u * std::abs(want) + 1e-6) << flashattn::dtype_name(dt);
    });
  }
}

}  // namespace
}  // namespace fa_test
