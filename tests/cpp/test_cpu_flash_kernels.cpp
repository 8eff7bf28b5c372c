// tests/cpp/test_cpu_flash_kernels.cpp — the building blocks of the CPU flash backend:
//   * tile_gemm (src/cpu/tile_gemm.h) against an fp64 loop, for both A layouts, with and without
//     accumulation, for every row tail of the register block, column strips of one and two
//     vectors, k = 0, and leading dimensions wider than the tile;
//   * parallel_for (src/cpu/parallel.h): every task exactly once, worker ids in range, tasks that
//     wait on lower-numbered tasks finish for any thread count, the first exception is rethrown;
//   * tanh_vec and exp2_vec (src/cpu/flash_common.h) against the fp64 functions.
// The attention results of the backend are checked by test_forward.cpp / test_backward.cpp.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cpu/flash_common.h"
#include "cpu/parallel.h"
#include "cpu/tile_gemm.h"

namespace fa_test {
namespace {

namespace cpu = flashattn::cpu;

std::vector<float> random_floats(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

struct GemmShape {
  int m, n, k;
};

// C (m, n) (+)= A (m, k) · B (k, n) through tile_gemm, compared with fp64 sums of the same
// fp32 inputs. Each fp32 product-sum of k terms is within k · 2^-24 · Σ|a·b| of the exact value.
template <cpu::ALayout kA, bool kAccumulate>
void check_gemm(const GemmShape& s) {
  SCOPED_TRACE(
      testing::Message() << "m=" << s.m << " n=" << s.n << " k=" << s.k
                         << (kA == cpu::ALayout::transposed ? " A transposed" : " A row-major")
                         << (kAccumulate ? " accumulate" : ""));
  constexpr int kExtraColumns = 5;  // leading dimensions wider than the tile
  const int lda = (kA == cpu::ALayout::row_major ? s.k : s.m) + kExtraColumns;
  const int a_rows = kA == cpu::ALayout::row_major ? s.m : s.k;
  const int ldb = s.n + 3 * cpu::kVecWidth;
  const int ldc = s.n + cpu::kVecWidth;
  const std::vector<float> a = random_floats(std::size_t(a_rows) * lda + 1, 1);
  const std::vector<float> b = random_floats(std::size_t(s.k) * ldb + 1, 2);
  const std::vector<float> c0 = random_floats(std::size_t(s.m) * ldc, 3);
  std::vector<float> c = c0;
  cpu::tile_gemm<kA, kAccumulate>(s.m, s.n, s.k, a.data(), lda, b.data(), ldb, c.data(), ldc);

  const auto a_at = [&](int r, int kk) {
    return kA == cpu::ALayout::row_major ? a[std::size_t(r) * lda + kk]
                                         : a[std::size_t(kk) * lda + r];
  };
  constexpr double kUnitRoundoff = 1.0 / (1 << 24);
  for (int r = 0; r < s.m; ++r) {
    for (int col = 0; col < ldc; ++col) {
      const std::size_t e = std::size_t(r) * ldc + col;
      if (col >= s.n) {
        ASSERT_EQ(c[e], c0[e]) << "wrote outside the tile at (" << r << ", " << col << ")";
        continue;
      }
      double exact = kAccumulate ? double(c0[e]) : 0.0;
      double magnitude = std::abs(exact);
      for (int kk = 0; kk < s.k; ++kk) {
        const double prod = double(a_at(r, kk)) * double(b[std::size_t(kk) * ldb + col]);
        exact += prod;
        magnitude += std::abs(prod);
      }
      const double bound = (s.k + 1) * kUnitRoundoff * magnitude;
      ASSERT_LE(std::abs(double(c[e]) - exact), bound) << "at (" << r << ", " << col << ")";
    }
  }
}

const GemmShape kGemmShapes[] = {
    {1, 16, 1},    {7, 16, 3},    {8, 32, 64},   {9, 48, 17},   {13, 80, 128},
    {15, 16, 8},   {16, 64, 64},  {64, 64, 128}, {64, 128, 64}, {3, 256, 5},
    {23, 112, 33}, {64, 16, 256}, {5, 32, 0},
};

TEST(TileGemm, RowMajorAMatchesFp64) {
  for (const GemmShape& s : kGemmShapes) check_gemm<cpu::ALayout::row_major, false>(s);
}
TEST(TileGemm, TransposedAMatchesFp64) {
  for (const GemmShape& s : kGemmShapes) check_gemm<cpu::ALayout::transposed, false>(s);
}
TEST(TileGemm, AccumulatesIntoC) {
  for (const GemmShape& s : kGemmShapes) {
    check_gemm<cpu::ALayout::row_major, true>(s);
    check_gemm<cpu::ALayout::transposed, true>(s);
  }
}

// Products of small integers are exact in fp32, so the result must be exact too.
TEST(TileGemm, ExactOnIntegers) {
  const int m = 11, n = 48, k = 40;
  std::vector<float> a(std::size_t(m) * k), b(std::size_t(k) * n), c(std::size_t(m) * n);
  for (int r = 0; r < m; ++r)
    for (int kk = 0; kk < k; ++kk) a[std::size_t(r) * k + kk] = float((r * 7 + kk * 3) % 9 - 4);
  for (int kk = 0; kk < k; ++kk)
    for (int col = 0; col < n; ++col) b[std::size_t(kk) * n + col] = float((kk * 5 + col) % 7 - 3);
  cpu::tile_gemm<cpu::ALayout::row_major, false>(m, n, k, a.data(), k, b.data(), n, c.data(), n);
  for (int r = 0; r < m; ++r) {
    for (int col = 0; col < n; ++col) {
      float expect = 0;
      for (int kk = 0; kk < k; ++kk)
        expect += a[std::size_t(r) * k + kk] * b[std::size_t(kk) * n + col];
      ASSERT_EQ(c[std::size_t(r) * n + col], expect) << "at (" << r << ", " << col << ")";
    }
  }
}

// --- parallel_for --------------------------------------------------------------------------------

TEST(ParallelFor, WorkerCount) {
  EXPECT_EQ(cpu::parallel_workers(0, 4), 1);
  EXPECT_EQ(cpu::parallel_workers(3, 8), 3);
  EXPECT_EQ(cpu::parallel_workers(100, 2), 2);
  EXPECT_EQ(cpu::parallel_workers(100, 1), 1);
}

TEST(ParallelFor, ThreadsForWork) {
  EXPECT_EQ(cpu::threads_for_work(0.0, 8), 1);
  EXPECT_EQ(cpu::threads_for_work(0.5 * cpu::kMinFlopsPerThread, 8), 1);
  EXPECT_EQ(cpu::threads_for_work(3.5 * cpu::kMinFlopsPerThread, 8), 3);
  EXPECT_EQ(cpu::threads_for_work(1e12, 8), 8);
  EXPECT_EQ(cpu::threads_for_work(1e12, 0), 1);
}

TEST(ParallelFor, RunsEveryTaskOnce) {
  for (int threads : {1, 2, 3, 8}) {
    for (std::int64_t tasks : {0, 1, 2, 5, 1000}) {
      SCOPED_TRACE(testing::Message() << "threads=" << threads << " tasks=" << tasks);
      std::vector<std::atomic<int>> runs(std::size_t(tasks) + 1);
      std::atomic<int> bad_worker{0};
      const int workers = cpu::parallel_workers(tasks, threads);
      cpu::parallel_for(tasks, threads, [&](std::int64_t t, int worker) {
        runs[std::size_t(t)].fetch_add(1);
        if (worker < 0 || worker >= workers) bad_worker.fetch_add(1);
      });
      for (std::int64_t t = 0; t < tasks; ++t)
        ASSERT_EQ(runs[std::size_t(t)].load(), 1) << "task " << t;
      EXPECT_EQ(bad_worker.load(), 0);
    }
  }
}

// The backward pass's dQ ordering makes a task wait for the previous one; tasks are handed out in
// index order, so such chains always finish, also with more threads than cores.
TEST(ParallelFor, TasksMayWaitForEarlierTasks) {
  for (int threads : {1, 2, 4, 16}) {
    SCOPED_TRACE(testing::Message() << "threads=" << threads);
    constexpr std::int64_t kTasks = 200;
    std::vector<std::atomic<int>> done(kTasks);
    cpu::parallel_for(kTasks, threads, [&](std::int64_t t, int) {
      if (t > 0) {
        while (done[std::size_t(t - 1)].load(std::memory_order_acquire) == 0)
          std::this_thread::yield();
      }
      done[std::size_t(t)].store(1, std::memory_order_release);
    });
    for (std::int64_t t = 0; t < kTasks; ++t) ASSERT_EQ(done[std::size_t(t)].load(), 1);
  }
}

TEST(ParallelFor, RethrowsTheFirstException) {
  for (int threads : {1, 3}) {
    std::atomic<int> ran{0};
    EXPECT_THROW(cpu::parallel_for(50, threads,
                                   [&](std::int64_t t, int) {
                                     ran.fetch_add(1);
                                     if (t == 7) throw std::runtime_error("task 7");
                                   }),
                 std::runtime_error);
    EXPECT_GE(ran.load(), 8);
  }
}

// tanh_vec within 3 ulp of the fp64 tanh (rounded to fp32) over both of its ranges and the seam
// between them, ±1 for large |x|, odd, NaN kept.
TEST(VectorMath, TanhMatchesFp64) {
  std::vector<float> xs;
  for (float x = -12.0f; x <= 12.0f; x += 0.000731f) xs.push_back(x);
  for (float x : {0.0f, 1e-30f, 1e-7f, 0.6249999f, 0.625f, 0.6250001f, 40.0f, 90.0f, 1e30f}) {
    xs.push_back(x);
    xs.push_back(-x);
  }
  float worst = 0.0f;
  for (std::size_t i = 0; i < xs.size(); i += cpu::kVecWidth) {
    cpu::VecF x{};
    for (int l = 0; l < cpu::kVecWidth; ++l) x[l] = xs[std::min(i + std::size_t(l), xs.size() - 1)];
    const cpu::VecF t = cpu::flash::tanh_vec(x);
    for (int l = 0; l < cpu::kVecWidth; ++l) {
      const float want = float(std::tanh(double(x[l])));
      const float ulp = std::max(std::nextafter(std::fabs(want), 2.0f) - std::fabs(want), 1e-45f);
      const float err = std::fabs(t[l] - want) / ulp;
      worst = std::max(worst, err);
      ASSERT_LE(err, 3.0f) << "x = " << x[l] << ": " << t[l] << " vs " << want;
      if (want != 0.0f) ASSERT_EQ(std::signbit(t[l]), std::signbit(want)) << "x = " << x[l];
    }
  }
  std::printf("tanh_vec: worst %.2f ulp over %zu points\n", double(worst), xs.size());
  cpu::VecF nan{};
  nan[0] = std::nanf("");
  EXPECT_TRUE(std::isnan(cpu::flash::tanh_vec(nan)[0]));
}

// exp2_vec: ≈ 1 ulp where it is not flushed, 0 below 2^-64 and for −∞.
TEST(VectorMath, Exp2MatchesFp64AndFlushesBelow2ToThe64) {
  for (float x = -80.0f; x <= 10.0f; x += 0.0137f) {
    cpu::VecF v{};
    for (int l = 0; l < cpu::kVecWidth; ++l) v[l] = x + 0.001f * float(l);
    const cpu::VecF r = cpu::flash::exp2_vec(v);
    for (int l = 0; l < cpu::kVecWidth; ++l) {
      if (v[l] < -64.0f) {
        ASSERT_EQ(r[l], 0.0f) << v[l];
      } else {
        const double want = std::exp2(double(v[l]));
        ASSERT_NEAR(r[l], want, 2.5e-7 * want) << v[l];
      }
    }
  }
  cpu::VecF minus_inf{};
  for (int l = 0; l < cpu::kVecWidth; ++l) minus_inf[l] = -INFINITY;
  EXPECT_EQ(cpu::flash::exp2_vec(minus_inf)[0], 0.0f);
}

}  // namespace
}  // namespace fa_test
