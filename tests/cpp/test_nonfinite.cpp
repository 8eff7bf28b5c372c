// tests/cpp/test_nonfinite.cpp — NaN and ±∞ in the inputs, and the packed rows of a varlen batch
// that no sequence covers (issue: "never outside the caller's buffers").
//
// Non-finite inputs: the tiled CPU backend must put NaN exactly where the fp64 reference does
// (docs/errors.md, "Non-finite inputs"): a NaN or ∞ in q_i or k_j reaches row i iff key j is
// visible to query i, and combine propagates a split whose lse is NaN. Both backends run in fp32
// so the finite elements can be compared tightly too.
//
// Uncovered rows: cu_seqlens may end before the packed tensors do. Those rows get out = 0,
// lse = +∞ in the forward and zero dq, dk, dv, softmax_d in the backward, on both CPU backends.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "test_util.h"

namespace fa_test {
namespace {

namespace fa = flashattn;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
// fp32 CPU flash vs fp32-stored fp64 reference on O(1) inputs of these small shapes.
constexpr float kFp32Tolerance = 1e-4f;

// Elementwise: NaN in the same places, finite values within tol, infinities equal.
testing::AssertionResult same_nan_pattern(const Tensor& got, const Tensor& ref, const char* what) {
  const std::vector<float> a = got.to_vector(), b = ref.to_vector();
  int nan_count = 0;
  for (std::size_t e = 0; e < a.size(); ++e) {
    if (std::isnan(a[e]) != std::isnan(b[e])) {
      return testing::AssertionFailure() << what << "[" << e << "]: got " << a[e] << ", reference " << b[e];
    }
    if (std::isnan(a[e])) {
      ++nan_count;
      continue;
    }
    if (std::isinf(b[e]) ? a[e] != b[e] : !(std::fabs(a[e] - b[e]) <= kFp32Tolerance)) {
      return testing::AssertionFailure() << what << "[" << e << "]: got " << a[e] << ", reference " << b[e];
    }
  }
  return testing::AssertionSuccess() << what << ": " << nan_count << " NaN";
}

// Rows [0, n) of an (b=1, s, h, d) tensor that hold at least one NaN.
std::vector<int> nan_rows(const Tensor& t) {
  std::vector<int> rows;
  for (std::int64_t i = 0; i < t.shape(1); ++i) {
    bool any = false;
    for (std::int64_t hh = 0; hh < t.shape(2); ++hh) {
      for (std::int64_t e = 0; e < t.shape(3); ++e) any = any || std::isnan(t.get({0, i, hh, e}));
    }
    if (any) rows.push_back(int(i));
  }
  return rows;
}

std::vector<int> range(int begin, int end) {
  std::vector<int> r;
  for (int i = begin; i < end; ++i) r.push_back(i);
  return r;
}

struct NonFiniteCase {
  std::string name;
  char tensor;  // 'q', 'k' or 'v'
  int row;      // the token that gets the value
  float value;
  bool causal;
  std::vector<int> expected_nan_rows;  // of out, for sq = sk = kLen
};

// gtest prints a failing parameter by its name.
void PrintTo(const NonFiniteCase& c, std::ostream* os) { *os << c.name; }

constexpr int kLen = 70;  // two key tiles of the CPU backend (64 keys each)

std::vector<NonFiniteCase> nonfinite_cases() {
  return {
      {"nan_in_q", 'q', 5, kNaN, false, {5}},
      {"inf_in_q", 'q', 5, kInf, false, {5}},  // an infinite score: ∞ − ∞ in the softmax
      {"nan_in_k_seen_by_all", 'k', 3, kNaN, false, range(0, kLen)},
      // Causal: key 66 is masked for the queries before it, whose rows stay finite.
      {"nan_in_k_masked_for_early_rows", 'k', 66, kNaN, true, range(66, kLen)},
      {"nan_in_v", 'v', 66, kNaN, false, range(0, kLen)},
      {"neg_inf_in_k_causal", 'k', 66, -kInf, true, range(66, kLen)},
  };
}

class NonFinite : public testing::TestWithParam<NonFiniteCase> {};

TEST_P(NonFinite, ForwardPropagatesLikeTheReference) {
  const NonFiniteCase& c = GetParam();
  AttnConfig cfg = dense_config(DType::f32, 1, kLen, kLen, 2, 1, 32);
  cfg.opt.causal = c.causal;
  AttnProblem p = make_problem(cfg);
  Tensor& t = c.tensor == 'q' ? p.q : c.tensor == 'k' ? p.k : p.v;
  t.set({0, c.row, 0, 7}, c.value);
  const ForwardResult flash = run_forward(p, Backend::cpu, 2);
  const ForwardResult ref = run_forward(p, Backend::cpu_reference);
  EXPECT_TRUE(same_nan_pattern(flash.out, ref.out, "out"));
  EXPECT_TRUE(same_nan_pattern(flash.lse, ref.lse, "lse"));
  EXPECT_EQ(nan_rows(ref.out), c.expected_nan_rows) << "the reference's own NaN rows";
}

INSTANTIATE_TEST_SUITE_P(Cpu, NonFinite, testing::ValuesIn(nonfinite_cases()),
                         [](const testing::TestParamInfo<NonFiniteCase>& i) { return i.param.name; });

// A NaN in v reaches the rows that see its key. A row for which that key is masked but which
// multiplies the key's tile (P = 0 there) may get it too on the tiled backends (0 · NaN = NaN):
// docs/errors.md leaves that unspecified, so rows of other key tiles must stay finite.
TEST(NonFiniteV, MaskedKeysNanStaysWithinItsKeyTile) {
  AttnConfig cfg = dense_config(DType::f32, 1, kLen, kLen, 2, 1, 32);
  cfg.opt.causal = true;
  AttnProblem p = make_problem(cfg);
  p.v.set({0, 66, 0, 7}, kNaN);
  const ForwardResult flash = run_forward(p, Backend::cpu, 2);
  const ForwardResult ref = run_forward(p, Backend::cpu_reference);
  EXPECT_EQ(nan_rows(ref.out), range(66, kLen));
  const std::vector<int> got = nan_rows(flash.out);
  constexpr int kKeyTile = 64;  // the CPU backend's key tile: keys 64..69 share one
  ASSERT_FALSE(got.empty());
  EXPECT_GE(got.front(), kKeyTile);
  EXPECT_EQ(got.back(), kLen - 1);
  for (int i = 66; i < kLen; ++i) EXPECT_NE(std::find(got.begin(), got.end(), i), got.end()) << i;
}

// The backward of visible pairs: with no mask every pair is visible. (Where a pair is masked, the
// tiled backward's products with P = 0 may carry a NaN the reference never forms: unspecified.)
TEST(NonFiniteBackward, PropagatesLikeTheReference) {
  for (const NonFiniteCase& c : nonfinite_cases()) {
    if (c.causal) continue;
    SCOPED_TRACE(c.name);
    AttnProblem p = make_problem(dense_config(DType::f32, 1, kLen, kLen, 2, 1, 32));
    Tensor& t = c.tensor == 'q' ? p.q : c.tensor == 'k' ? p.k : p.v;
    t.set({0, c.row, 0, 7}, c.value);
    const ForwardResult fwd = run_forward(p, Backend::cpu_reference);
    const BackwardResult flash = run_backward(p, fwd, Backend::cpu, 2);
    const BackwardResult ref = run_backward(p, fwd, Backend::cpu_reference);
    EXPECT_TRUE(same_nan_pattern(flash.dq, ref.dq, "dq"));
    EXPECT_TRUE(same_nan_pattern(flash.dk, ref.dk, "dk"));
    EXPECT_TRUE(same_nan_pattern(flash.dv, ref.dv, "dv"));
    EXPECT_TRUE(same_nan_pattern(flash.softmax_d, ref.softmax_d, "softmax_d"));
  }
}

// --- combine ------------------------------------------------------------------------------------

struct CombineFixture {
  static constexpr std::int64_t kSplits = 3, kB = 1, kSq = 4, kH = 2, kDv = 16;
  Tensor out_partial{DType::f32, {kSplits, kB, kSq, kH, kDv}};
  Tensor lse_partial{DType::f32, {kSplits, kB, kH, kSq}};
  Tensor out{DType::f32, {kB, kSq, kH, kDv}};
  Tensor lse{DType::f32, {kB, kH, kSq}};
  CombineFixture() {
    out_partial.fill_random(test_seed(1));
    lse_partial.fill_random(test_seed(2), -2.0f, 2.0f);
  }
  void run() { fa::combine({out_partial.tv(), lse_partial.tv()}, {out.tv(), lse.tv()}); }
};

TEST(NonFiniteCombine, SplitWithNanLsePropagates) {
  CombineFixture f;
  f.lse_partial.set({1, 0, 1, 2}, kNaN);  // split 1, head 1, row 2
  f.run();
  for (std::int64_t i = 0; i < f.kSq; ++i) {
    for (std::int64_t hh = 0; hh < f.kH; ++hh) {
      const bool poisoned = i == 2 && hh == 1;
      EXPECT_EQ(std::isnan(f.lse.get({0, hh, i})), poisoned) << "lse row " << i << " head " << hh;
      for (std::int64_t e = 0; e < f.kDv; ++e) {
        ASSERT_EQ(std::isnan(f.out.get({0, i, hh, e})), poisoned) << "out row " << i << " head " << hh;
      }
    }
  }
}

TEST(NonFiniteCombine, NanOutOfAContributingSplitPropagates) {
  CombineFixture f;
  f.out_partial.set({0, 0, 3, 0, 5}, kNaN);
  f.run();
  EXPECT_TRUE(std::isnan(f.out.get({0, 3, 0, 5})));
  EXPECT_FALSE(std::isnan(f.out.get({0, 3, 0, 4})));
  EXPECT_TRUE(std::isfinite(f.lse.get({0, 0, 3})));
}

TEST(NonFiniteCombine, EmptySplitIsSkippedWhateverItsOut) {
  for (float empty : {kInf, -kInf}) {
    CombineFixture f;
    f.lse_partial.set({2, 0, 0, 1}, empty);
    for (std::int64_t e = 0; e < f.kDv; ++e) f.out_partial.set({2, 0, 1, 0, e}, kNaN);
    f.run();
    for (std::int64_t e = 0; e < f.kDv; ++e) EXPECT_TRUE(std::isfinite(f.out.get({0, 1, 0, e})));
    EXPECT_TRUE(std::isfinite(f.lse.get({0, 0, 1})));
  }
}

// --- rows that no varlen sequence covers --------------------------------------------------------

struct UncoveredProblem {
  static constexpr std::int64_t kH = 2, kHk = 1, kD = 16;
  std::int64_t total_q, total_k;
  Tensor q, k, v, dout, cu_q, cu_k;
  fa::Varlen varlen;
  UncoveredProblem(std::vector<std::int32_t> cq, std::vector<std::int32_t> ck, std::int64_t extra_q,
                   std::int64_t extra_k)
      : total_q(cq.back() + extra_q),
        total_k(ck.back() + extra_k),
        q(DType::f32, {total_q, kH, kD}),
        k(DType::f32, {total_k, kHk, kD}),
        v(DType::f32, {total_k, kHk, kD}),
        dout(DType::f32, {total_q, kH, kD}),
        cu_q(Tensor::from_i32(cq)),
        cu_k(Tensor::from_i32(ck)) {
    q.fill_random(test_seed(1));
    k.fill_random(test_seed(2));
    v.fill_random(test_seed(3));
    dout.fill_random(test_seed(4));
    varlen.cu_seqlens_q = cu_q.tv();
    varlen.cu_seqlens_k = cu_k.tv();
    for (std::size_t b = 0; b + 1 < cq.size(); ++b) {
      varlen.max_seqlen_q = std::max(varlen.max_seqlen_q, cq[b + 1] - cq[b]);
      varlen.max_seqlen_k = std::max(varlen.max_seqlen_k, ck[b + 1] - ck[b]);
    }
  }
};

class Uncovered : public testing::TestWithParam<Backend> {};

TEST_P(Uncovered, RowsPastCuSeqlensGetZeroOutputsAndGradients) {
  UncoveredProblem u({0, 5, 12}, {0, 9, 20}, 6, 7);
  fa::Options opt;
  opt.backend = GetParam();
  opt.num_threads = 2;
  opt.causal = true;
  Tensor out(DType::f32, {u.total_q, u.kH, u.kD}), lse(DType::f32, {u.kH, u.total_q});
  fa::forward({u.q.tv(), u.k.tv(), u.v.tv(), u.varlen}, {out.tv(), lse.tv()}, opt);
  Tensor dq = Tensor::empty_like(u.q), dk = Tensor::empty_like(u.k), dv = Tensor::empty_like(u.v);
  Tensor softmax_d(DType::f32, {u.kH, u.total_q});
  fa::backward({u.dout.tv(), u.q.tv(), u.k.tv(), u.v.tv(), out.tv(), lse.tv(), u.varlen},
               {dq.tv(), dk.tv(), dv.tv(), softmax_d.tv()}, opt);
  const std::int64_t q_end = 12, k_end = 20;
  for (std::int64_t r = 0; r < u.total_q; ++r) {
    for (std::int64_t hh = 0; hh < u.kH; ++hh) {
      const bool covered = r < q_end;
      SCOPED_TRACE("query row " + std::to_string(r) + " head " + std::to_string(hh));
      if (covered) {
        EXPECT_TRUE(std::isfinite(lse.get({hh, r})));
        EXPECT_TRUE(std::isfinite(softmax_d.get({hh, r})));
      } else {
        EXPECT_EQ(lse.get({hh, r}), kInf);
        EXPECT_EQ(softmax_d.get({hh, r}), 0.0f);
      }
      for (std::int64_t e = 0; e < u.kD; ++e) {
        if (covered) {
          ASSERT_TRUE(std::isfinite(out.get({r, hh, e})) && std::isfinite(dq.get({r, hh, e})));
        } else {
          ASSERT_EQ(out.get({r, hh, e}), 0.0f);
          ASSERT_EQ(dq.get({r, hh, e}), 0.0f);
        }
      }
    }
  }
  for (std::int64_t r = 0; r < u.total_k; ++r) {
    SCOPED_TRACE("key row " + std::to_string(r));
    for (std::int64_t e = 0; e < u.kD; ++e) {
      if (r < k_end) {
        ASSERT_TRUE(std::isfinite(dk.get({r, 0, e})) && std::isfinite(dv.get({r, 0, e})));
      } else {
        ASSERT_EQ(dk.get({r, 0, e}), 0.0f);
        ASSERT_EQ(dv.get({r, 0, e}), 0.0f);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, Uncovered, testing::Values(Backend::cpu, Backend::cpu_reference),
                         [](const testing::TestParamInfo<Backend>& i) {
                           return std::string(fa::backend_name(i.param));
                         });

}  // namespace
}  // namespace fa_test
