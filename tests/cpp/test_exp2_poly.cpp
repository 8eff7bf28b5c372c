// tests/cpp/test_exp2_poly.cpp — common::exp2_poly, the exponential that the sm90 forward's softcap
// kernels evaluate on the FMA pipe for part of a tile (FLASHATTN_SM90_FWD_SOFTCAP_POLY_EXP): its
// relative error against std::exp2 over the softmax's whole range, and its edges (powers of two,
// the flush to zero below 2^-126, −∞, NaN). The kernels run the same arithmetic (the header is
// shared); their outputs are checked against the reference by the CUDA softcap tests.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "common/exp2_poly.h"

namespace fa_test {
namespace {

namespace c = flashattn::common;

TEST(Exp2Poly, RelativeErrorBelowTwoToMinus13) {
  // Every 1/4096 of [−126, 8] (8: the largest exponent the lazily rescaled softmax takes) and
  // random points between.
  double worst = 0.0;
  float worst_x = 0.0f;
  auto check = [&](float x) {
    const double ref = std::exp2(double(x));
    const double rel = std::fabs(double(c::exp2_poly(x)) - ref) / ref;
    if (rel > worst) {
      worst = rel;
      worst_x = x;
    }
  };
  for (int i = -126 * 4096; i <= 8 * 4096; ++i) check(float(i) / 4096.0f);
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> u(-126.0f, 8.0f);
  for (int i = 0; i < 200000; ++i) check(u(rng));
  EXPECT_LT(worst, 1.1e-4) << "at x = " << worst_x;
  EXPECT_GT(worst, 5e-5) << "the cubic's error is about 1e-4: a smaller one means the test misses it";
}

TEST(Exp2Poly, PowersOfTwoAndOne) {
  for (int n = -126; n <= 8; ++n) {
    EXPECT_FLOAT_EQ(c::exp2_poly(float(n)), std::ldexp(1.0f, n)) << "n = " << n;
  }
  EXPECT_EQ(c::exp2_poly(0.0f), 1.0f);
}

TEST(Exp2Poly, FlushesBelowTwoToMinus126AndKeepsNaN) {
  EXPECT_EQ(c::exp2_poly(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(c::exp2_poly(-127.0f), 0.0f);
  EXPECT_EQ(c::exp2_poly(-126.5f), 0.0f);
  EXPECT_EQ(c::exp2_poly(-1000.0f), 0.0f);
  EXPECT_GT(c::exp2_poly(-126.0f), 0.0f);
  EXPECT_TRUE(std::isnan(c::exp2_poly(std::numeric_limits<float>::quiet_NaN())));
}

TEST(Exp2Poly, MonotoneAcrossEachBinade) {
  // P must not step down where the cubic hands over to the next power of two.
  for (int n = -20; n <= 8; ++n) {
    const float below = std::nextafter(float(n), -1000.0f);
    EXPECT_LE(c::exp2_poly(below), c::exp2_poly(float(n))) << "n = " << n;
  }
}

}  // namespace
}  // namespace fa_test
