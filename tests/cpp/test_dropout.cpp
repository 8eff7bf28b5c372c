// tests/cpp/test_dropout.cpp — the dropout randomness of SPEC §3 and docs/dropout.md:
//   * Philox-4x32-10 against the published known-answer vectors;
//   * the documented counter layout against values computed outside this library;
//   * the keep rate within statistical bounds;
//   * the mask as a pure function of (seed, offset, batch, head, i, j): reproducible, different
//     for different seeds/offsets/batches/heads, independent of the shape of the call, the thread
//     count and the backend (masks recovered through the public API with one-hot values).
// That the backward uses the forward's mask is checked by the accuracy grid (test_backward.cpp,
// dropout cases): the oracle's gradient is the gradient of the masked function.
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "common/philox.h"
#include "test_util.h"

namespace fa_test {
namespace {

namespace c = flashattn::common;

// --- Philox-4x32-10 ----------------------------------------------------------------------------

// Random123's known-answer vectors (kat_vectors, philox4x32_10). They were also reproduced
// independently of this library with randomgen 2.3.0's Philox(number=4, width=32).
TEST(Philox, KnownAnswerVectors) {
  struct Kat {
    c::Philox4 ctr;
    std::uint32_t k0, k1;
    c::Philox4 expect;
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, 0, 0, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
       0xffffffffu,
       0xffffffffu,
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
       0xa4093822u,
       0x299f31d0u,
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& k : kats) {
    const c::Philox4 r = c::philox4x32_10(k.ctr, k.k0, k.k1);
    EXPECT_EQ(r.x, k.expect.x);
    EXPECT_EQ(r.y, k.expect.y);
    EXPECT_EQ(r.z, k.expect.z);
    EXPECT_EQ(r.w, k.expect.w);
  }
}

// The documented layout (docs/dropout.md) evaluated outside this library (Python, randomgen's
// Philox4x32): the 16-bit uniform u of element (i, j) of stream `offset + stream` under `seed`.
// keep_ij = u < keep_threshold, so a threshold of u drops the element and u + 1 keeps it.
TEST(DropoutMask, MatchesDocumentedCounterLayout) {
  struct Known {
    std::uint64_t seed, offset, stream;
    int i, j;
    std::uint32_t u;
  };
  const Known known[] = {
      {0x0ull, 0x0ull, 0, 0, 0, 59605},
      {0x123456789abcdef0ull, 0x7ull, 3, 5, 9, 28867},
      {0x2aull, 0x200000000ull, 17, 100, 37, 47594},
      {0xffffffffffffffffull, 0xfffffffffffffff0ull, 31, 31, 31, 28457},  // offset wraps
      {0x1ull, 0x0ull, 0, 15, 8, 64576},
      {0x1ull, 0x0ull, 0, 8, 15, 3529},
      {0x63ull, 0x5ull, 2, 1000, 1023, 42639},
      {0xdeadbeefull, 0xffffffffull, 3, 16, 17, 25966},  // stream carries into the high word
      {0x7ull, 0x0ull, 0, 23, 30, 50527},
      {0x100000000ull, 0x2ull, 1, 7, 6, 56138},  // seed only in the high key word
  };
  for (const Known& k : known) {
    c::DropoutParams dp;
    dp.seed = k.seed;
    dp.offset = k.offset;
    dp.keep_threshold = k.u;
    EXPECT_FALSE(c::dropout_keep(dp, k.stream, k.i, k.j)) << "i=" << k.i << " j=" << k.j;
    dp.keep_threshold = k.u + 1;
    EXPECT_TRUE(c::dropout_keep(dp, k.stream, k.i, k.j)) << "i=" << k.i << " j=" << k.j;
  }
}

// keep_threshold = ⌊(1 − p) · 65536 + 0.5⌋ (docs/dropout.md).
TEST(DropoutMask, KeepThreshold) {
  EXPECT_EQ(c::dropout_keep_threshold(0.0f), 65536u);
  EXPECT_EQ(c::dropout_keep_threshold(0.5f), 32768u);
  EXPECT_EQ(c::dropout_keep_threshold(0.1f), 58982u);   // 58982.4
  EXPECT_EQ(c::dropout_keep_threshold(0.17f), 54395u);  // 54394.88
  EXPECT_EQ(c::dropout_keep_threshold(0.9999f), 7u);    // 6.5536
  for (float p : {0.0f, 0.01f, 0.1f, 0.25f, 0.5f, 0.75f, 0.99f}) {
    EXPECT_LE(std::abs(double(c::dropout_keep_threshold(p)) / 65536.0 - (1.0 - p)), 1.0 / 65536)
        << p;
  }
}

// The rate of kept elements of the element function, on 16·2^20 elements: within 5σ of 1 − p.
TEST(DropoutMask, KeepRateWithinFiveSigma) {
  for (float p : {0.1f, 0.5f}) {
    c::DropoutParams dp;
    dp.seed = test_seed(std::uint64_t(p * 100));
    dp.offset = 1000;
    dp.keep_threshold = c::dropout_keep_threshold(p);
    // Whole 16×16 blocks through dropout_keep_bits (the fast path), 8 elements per lane.
    std::int64_t kept = 0, n = 0;
    for (std::uint64_t stream = 0; stream < 4; ++stream)
      for (int bi = 0; bi < 64; ++bi)
        for (int bj = 0; bj < 64; ++bj)
          for (int lane = 0; lane < 32; ++lane) {
            kept += __builtin_popcount(c::dropout_keep_bits(dp, stream, bi, bj, lane));
            n += 8;
          }
    const double q = dp.keep_threshold / 65536.0;
    const double sigma = std::sqrt(n * q * (1 - q));
    EXPECT_LE(std::abs(double(kept) - n * q), 5 * sigma) << "p=" << p << " kept=" << kept << "/" << n;
  }
}

// dropout_keep (per element) agrees with dropout_keep_bits (per lane) on every element.
TEST(DropoutMask, ElementAndLaneViewsAgree) {
  c::DropoutParams dp;
  dp.seed = test_seed();
  dp.offset = 9;
  dp.keep_threshold = c::dropout_keep_threshold(0.3f);
  std::vector<int> seen(48 * 48, 0);
  for (int bi = 0; bi < 3; ++bi)
    for (int bj = 0; bj < 3; ++bj)
      for (int lane = 0; lane < 32; ++lane) {
        const std::uint32_t bits = c::dropout_keep_bits(dp, 5, bi, bj, lane);
        const int g = lane / 4, t = lane % 4;
        for (int a = 0; a < 2; ++a)
          for (int b = 0; b < 2; ++b)
            for (int cc = 0; cc < 2; ++cc) {
              const int i = 16 * bi + g + 8 * a, j = 16 * bj + 2 * t + b + 8 * cc;
              const int e = 4 * cc + 2 * a + b;
              ++seen[std::size_t(i) * 48 + j];
              EXPECT_EQ(bool((bits >> e) & 1u), c::dropout_keep(dp, 5, i, j)) << i << "," << j;
              EXPECT_EQ(c::dropout_lane(i, j), lane);
              EXPECT_EQ(c::dropout_element(i, j), e);
            }
      }
  for (int s : seen) EXPECT_EQ(s, 1);  // the lanes partition each block
}

// The backward's transposed fragment (Sᵀ: keys × rows) takes each element's bit from the forward
// lane dropout_transposed_source names: simulated for a warp's 32 lanes, each drawing its own
// lane's bits, every element of the block gets the reference's keep, and each exactly once.
TEST(DropoutMask, TransposedFragmentTakesTheForwardLanesBits) {
  c::DropoutParams dp;
  dp.seed = test_seed();
  dp.offset = 3;
  dp.keep_threshold = c::dropout_keep_threshold(0.4f);
  for (int bi : {0, 5})
    for (int bj : {0, 2, 77}) {
      std::uint32_t own[32];
      for (int lane = 0; lane < 32; ++lane) own[lane] = c::dropout_keep_bits(dp, 11, bi, bj, lane);
      std::vector<int> seen(16 * 16, 0);
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        for (int a = 0; a < 2; ++a)
          for (int b = 0; b < 2; ++b)
            for (int cc = 0; cc < 2; ++cc) {
              const int i = 16 * bi + 2 * t + b + 8 * cc, j = 16 * bj + g + 8 * a;
              const c::DropoutSource src = c::dropout_transposed_source(lane, a, b, cc);
              // Two source lanes per thread: the element's a and c only pick the bit.
              EXPECT_EQ(src.lane, c::dropout_transposed_source(lane, 0, b, 0).lane);
              EXPECT_EQ(src.lane, c::dropout_lane(i, j));
              EXPECT_EQ(src.element, c::dropout_element(i, j));
              EXPECT_EQ(bool((own[src.lane] >> src.element) & 1u), c::dropout_keep(dp, 11, i, j))
                  << "block (" << bi << ", " << bj << ") lane " << lane << " (" << i << ", " << j << ")";
              ++seen[std::size_t(i % 16) * 16 + j % 16];
            }
      }
      for (int n : seen) EXPECT_EQ(n, 1);
    }
}

// The kernels take an element's number from its offset to its lane's first element
// (dropout_element_at), a constant where the offsets are: the same number as its coordinates give,
// for every lane of blocks anywhere in the matrix.
TEST(DropoutMask, ElementNumberFromTheOffsetToTheLanesFirstElement) {
  for (int bi : {0, 1, 7, 1000})
    for (int bj : {0, 3, 64, 4095})
      for (int lane = 0; lane < 32; ++lane) {
        const int i0 = 16 * bi + lane / 4, j0 = 16 * bj + 2 * (lane % 4);
        for (int di : {0, 8})
          for (int dj : {0, 1, 8, 9}) {
            EXPECT_EQ(c::dropout_element_at(di, dj), c::dropout_element(i0 + di, j0 + dj))
                << "block (" << bi << ", " << bj << ") lane " << lane << " offset (" << di << ", " << dj << ")";
            EXPECT_EQ(c::dropout_lane(i0 + di, j0 + dj), lane);
          }
      }
  static_assert(c::dropout_element_at(8, 9) == 7 && c::dropout_element_at(0, 1) == 1);
}

// --- the mask through the public API -----------------------------------------------------------

// With v one-hot (v_j = e_j, sk == dv) and small scores, out_ij = keep_ij · p_ij / (1 − p) with
// p_ij > 0, so keep_ij = (out_ij != 0). Returns mask[((b·h + hh)·sq + i)·sk + j].
struct MaskCall {
  int batch = 2, heads = 2, seqlen_q = 40, seqlen_k = 64;
  float p = 0.5f;
  std::uint64_t seed = 1, offset = 0;
  bool use_rng_state = false;
  bool causal = false;
  Backend backend = Backend::cpu;
  int num_threads = 2;
  std::int64_t row_offset = 0, col_offset = 0;  // Options::dropout_row_offset / dropout_col_offset
};

std::vector<std::uint8_t> recover_mask(const MaskCall& m, ForwardResult* result = nullptr) {
  AttnConfig cfg;
  cfg.dtype = DType::f32;
  cfg.batch = m.batch;
  cfg.heads = cfg.heads_k = m.heads;
  cfg.seqlen_q = m.seqlen_q;
  cfg.seqlen_k = m.seqlen_k;
  cfg.head_dim = 16;
  cfg.head_dim_v = m.seqlen_k;
  cfg.qk_amplitude = 0.25f;  // |s| < 1: every p_ij is far from underflow
  cfg.opt.dropout_p = m.p;
  cfg.opt.causal = m.causal;
  cfg.opt.dropout_row_offset = m.row_offset;
  cfg.opt.dropout_col_offset = m.col_offset;
  std::uint64_t rng_state[2] = {m.seed, m.offset};
  if (m.use_rng_state) {
    cfg.opt.dropout_seed = ~m.seed;  // must be ignored
    cfg.opt.dropout_offset = m.offset + 12345;
    cfg.opt.dropout_rng_state = rng_state;
  } else {
    cfg.opt.dropout_seed = m.seed;
    cfg.opt.dropout_offset = m.offset;
  }
  cfg.seed = test_seed(4242);  // the same q, k for every call of a test: only dropout varies
  AttnProblem p = make_problem(cfg);
  p.v.for_each_index([&](const Index& idx) { p.v.set(idx, idx[1] == idx[3] ? 1.0f : 0.0f); });
  const ForwardResult r = run_forward(p, m.backend, m.num_threads);
  std::vector<std::uint8_t> mask(std::size_t(m.batch) * m.heads * m.seqlen_q * m.seqlen_k);
  for (int b = 0; b < m.batch; ++b)
    for (int hh = 0; hh < m.heads; ++hh)
      for (int i = 0; i < m.seqlen_q; ++i)
        for (int j = 0; j < m.seqlen_k; ++j) {
          const float o = r.out.get({b, i, hh, j});
          mask[((std::size_t(b) * m.heads + hh) * m.seqlen_q + i) * m.seqlen_k + j] = o != 0.0f;
        }
  if (result) *result = r;
  return mask;
}

// The mask predicted by the element function of src/common/philox.h.
std::vector<std::uint8_t> predicted_mask(const MaskCall& m) {
  c::DropoutParams dp;
  dp.seed = m.seed;
  dp.offset = m.offset;
  dp.keep_threshold = c::dropout_keep_threshold(m.p);
  std::vector<std::uint8_t> mask(std::size_t(m.batch) * m.heads * m.seqlen_q * m.seqlen_k);
  for (int b = 0; b < m.batch; ++b)
    for (int hh = 0; hh < m.heads; ++hh)
      for (int i = 0; i < m.seqlen_q; ++i)
        for (int j = 0; j < m.seqlen_k; ++j) {
          const bool visible = !m.causal || j <= i + m.seqlen_k - m.seqlen_q;
          mask[((std::size_t(b) * m.heads + hh) * m.seqlen_q + i) * m.seqlen_k + j] =
              visible && c::dropout_keep(dp, std::uint64_t(b) * m.heads + hh, i, j);
        }
  return mask;
}

std::int64_t count_diff(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
  std::int64_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

class DropoutApi : public testing::TestWithParam<Backend> {};

// Position offsets: a call over rows [16, 40) and keys [32, 64) of a sequence, told where it sits,
// draws exactly that part of the whole call's mask (and without the offsets, another one).
TEST_P(DropoutApi, PositionOffsetsDrawThatPartOfTheLongerSequencesMask) {
  MaskCall whole;
  whole.backend = GetParam();
  whole.seqlen_q = 40;
  whole.seqlen_k = 64;
  whole.p = 0.4f;
  whole.seed = 31;
  whole.offset = 6;
  const std::vector<std::uint8_t> full = recover_mask(whole);
  MaskCall part = whole;
  part.seqlen_q = 24;
  part.seqlen_k = 32;
  part.row_offset = 16;
  part.col_offset = 32;
  const std::vector<std::uint8_t> got = recover_mask(part);
  std::int64_t diff = 0;
  for (int b = 0; b < part.batch; ++b)
    for (int hh = 0; hh < part.heads; ++hh)
      for (int i = 0; i < part.seqlen_q; ++i)
        for (int j = 0; j < part.seqlen_k; ++j) {
          const std::size_t at = ((std::size_t(b) * part.heads + hh) * part.seqlen_q + i) * part.seqlen_k + j;
          const std::size_t whole_at =
              ((std::size_t(b) * whole.heads + hh) * whole.seqlen_q + 16 + i) * whole.seqlen_k + 32 + j;
          diff += got[at] != full[whole_at];
        }
  EXPECT_EQ(diff, 0);
  part.row_offset = part.col_offset = 0;
  EXPECT_GT(count_diff(recover_mask(part), got), 0);  // the offsets did something
}

TEST(DropoutApiErrors, PositionOffsetsAreWholeBlocks) {
  using Case = std::tuple<std::int64_t, std::int64_t, const char*>;
  for (auto [row, col, name] : {Case{8, 0, "dropout_row_offset"}, Case{0, -16, "dropout_col_offset"},
                                Case{std::int64_t(1) << 31, 0, "dropout_row_offset"}}) {
    MaskCall m;
    m.row_offset = row;
    m.col_offset = col;
    try {
      (void)recover_mask(m);
      ADD_FAILURE() << name << " " << row << "," << col << " was accepted";
    } catch (const flashattn::Error& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
}

// The API's mask is the documented element function, bit for bit (both backends), including
// across 16×16 block edges (sq, sk not multiples of 16) and with a causal mask.
TEST_P(DropoutApi, MaskIsTheDocumentedFunction) {
  for (bool causal : {false, true}) {
    MaskCall m;
    m.backend = GetParam();
    m.seqlen_q = 45;
    m.seqlen_k = 72;
    m.causal = causal;
    m.p = 0.3f;
    m.seed = test_seed(causal);
    m.offset = 7;
    EXPECT_EQ(count_diff(recover_mask(m), predicted_mask(m)), 0) << "causal=" << causal;
  }
}

// The keep rate of the API's mask over ~1M elements, within 5σ.
TEST_P(DropoutApi, LargeKeepRateWithinFiveSigma) {
  for (float p : {0.1f, 0.5f}) {
    MaskCall m;
    m.backend = GetParam();
    m.batch = 2;
    m.heads = 4;
    m.seqlen_q = 500;
    m.seqlen_k = 256;
    m.p = p;
    m.seed = test_seed(std::uint64_t(p * 10));
    const auto mask = recover_mask(m);
    std::int64_t kept = 0;
    for (auto k : mask) kept += k;
    const double n = double(mask.size()), q = 1.0 - p;
    EXPECT_LE(std::abs(kept - n * q), 5 * std::sqrt(n * q * (1 - q))) << "p=" << p << " kept=" << kept;
  }
}

// Same (seed, offset) → bitwise the same output; a different seed, offset, batch or head → a
// different mask (about 2p(1−p) of the elements differ; 1/4 for p = 0.5).
TEST_P(DropoutApi, ReproducibleAndDistinctStreams) {
  MaskCall m;
  m.backend = GetParam();
  m.seed = test_seed();
  m.offset = 100;
  ForwardResult r1, r2;
  const auto a = recover_mask(m, &r1);
  const auto b = recover_mask(m, &r2);
  EXPECT_TRUE(bitwise_equal(r1.out, r2.out));
  EXPECT_TRUE(bitwise_equal(r1.lse, r2.lse));
  EXPECT_EQ(count_diff(a, b), 0);

  const std::int64_t n = std::int64_t(a.size()), min_diff = n / 8;  // expected n / 4
  MaskCall s = m;
  s.seed = m.seed + 1;
  EXPECT_GT(count_diff(a, recover_mask(s)), min_diff) << "seed";
  MaskCall hi = m;
  hi.seed = m.seed ^ (std::uint64_t(1) << 40);  // the high key word matters
  EXPECT_GT(count_diff(a, recover_mask(hi)), min_diff) << "seed high word";
  MaskCall o = m;
  o.offset = m.offset + std::uint64_t(m.batch) * m.heads;  // the next call's streams
  EXPECT_GT(count_diff(a, recover_mask(o)), min_diff) << "offset";

  // Within one call, every (batch, head) has its own stream.
  const std::size_t per = std::size_t(m.seqlen_q) * m.seqlen_k;
  for (int x = 0; x < m.batch * m.heads; ++x)
    for (int y = x + 1; y < m.batch * m.heads; ++y) {
      std::int64_t d = 0;
      for (std::size_t e = 0; e < per; ++e) d += a[x * per + e] != a[y * per + e];
      EXPECT_GT(d, std::int64_t(per) / 8) << "streams " << x << " and " << y;
    }

  // The stream of (batch b, head h) is offset + b·heads + h: offset + 1 shifts by one head.
  MaskCall shifted = m;
  shifted.offset = m.offset + 1;
  const auto c = recover_mask(shifted);
  for (std::size_t e = 0; e < per * (m.batch * m.heads - 1); ++e) {
    ASSERT_EQ(c[e], a[e + per]) << "element " << e;
  }
}

// The mask of element (b, h, i, j) does not depend on the shape of the call (tiles, lengths).
TEST_P(DropoutApi, MaskIndependentOfShape) {
  MaskCall big;
  big.backend = GetParam();
  big.seed = test_seed();
  big.seqlen_q = 97;
  big.seqlen_k = 200;
  big.p = 0.4f;
  MaskCall small = big;
  small.seqlen_q = 19;
  small.seqlen_k = 40;
  const auto a = recover_mask(big), b = recover_mask(small);
  std::int64_t diff = 0;
  for (int bh = 0; bh < big.batch * big.heads; ++bh)
    for (int i = 0; i < small.seqlen_q; ++i)
      for (int j = 0; j < small.seqlen_k; ++j)
        diff += a[(std::size_t(bh) * big.seqlen_q + i) * big.seqlen_k + j] !=
                b[(std::size_t(bh) * small.seqlen_q + i) * small.seqlen_k + j];
  EXPECT_EQ(diff, 0);
}

// Options::dropout_rng_state = {seed, offset} overrides dropout_seed / dropout_offset.
TEST_P(DropoutApi, RngStateFromMemory) {
  MaskCall m;
  m.backend = GetParam();
  m.seed = test_seed();
  m.offset = 31;
  MaskCall r = m;
  r.use_rng_state = true;
  ForwardResult a, b;
  recover_mask(m, &a);
  recover_mask(r, &b);
  EXPECT_TRUE(bitwise_equal(a.out, b.out));
}

INSTANTIATE_TEST_SUITE_P(Backends, DropoutApi,
                         testing::Values(Backend::cpu, Backend::cpu_reference),
                         [](const testing::TestParamInfo<Backend>& info) {
                           return std::string(info.param == Backend::cpu ? "cpu" : "cpuref");
                         });

// Independent of the thread count: bitwise identical out and lse for 1, 2 and 3 threads.
TEST(DropoutThreads, BitwiseIdenticalAcrossThreadCounts) {
  MaskCall m;
  m.seed = test_seed();
  m.seqlen_q = 150;
  m.seqlen_k = 128;
  m.p = 0.2f;
  std::vector<ForwardResult> results(3);
  for (int t = 1; t <= 3; ++t) {
    m.num_threads = t;
    recover_mask(m, &results[std::size_t(t - 1)]);
  }
  for (int t = 1; t < 3; ++t) {
    EXPECT_TRUE(bitwise_equal(results[0].out, results[std::size_t(t)].out)) << t + 1 << " threads";
    EXPECT_TRUE(bitwise_equal(results[0].lse, results[std::size_t(t)].lse)) << t + 1 << " threads";
  }
}

// The two backends drop the same elements, and their outputs agree elementwise within the
// accuracy rule (fa_test::check_forward runs for both in test_forward.cpp's dropout cases).
TEST(DropoutBackends, SameMaskOnBothBackends) {
  MaskCall m;
  m.seed = test_seed();
  m.seqlen_q = 77;
  m.seqlen_k = 96;
  m.p = 0.35f;
  m.causal = true;
  m.backend = Backend::cpu;
  const auto a = recover_mask(m);
  m.backend = Backend::cpu_reference;
  const auto b = recover_mask(m);
  EXPECT_EQ(count_diff(a, b), 0);
}

}  // namespace
}  // namespace fa_test
