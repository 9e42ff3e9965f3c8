// The BLAS symmetric products of one Newton-Schulz iteration (server/optim/symmetric_products.h)
// against the same products in float64, on square, wide and odd shapes (tile edges of the mirror).
#include "server/optim/symmetric_products.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace muond::server::internal {
namespace {

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.1f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

// max |got - want| / max |want| over the listed entries.
double RelError(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return err / scale;
}

struct Shape {
  int64_t m;
  int64_t n;
};

class SymmetricProductsTest : public ::testing::TestWithParam<Shape> {};

TEST_P(SymmetricProductsTest, OneIterationMatchesFloat64) {
  const auto [m, n] = GetParam();
  const float a = 3.4445f, b = -4.7750f, c = 2.0315f;
  const std::vector<float> x = Random(m * n, static_cast<uint32_t>(m * 1000 + n));
  // NaN-filled outputs: every result entry must be written (SYRK's beta = 0 must not read them).
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> gram(m * m, nan), poly(m * m, nan), next(m * n, nan);
  SymmetricGram(x.data(), m, n, gram.data());
  SymmetricPolynomial(gram.data(), m, b, c, poly.data());
  SymmetricApply(poly.data(), x.data(), m, n, a, next.data());

  std::vector<double> g64(m * m), p64(m * m), n64(m * n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < m; ++j) {
      double s = 0;
      for (int64_t k = 0; k < n; ++k) s += double{x[i * n + k]} * x[j * n + k];
      g64[i * m + j] = s;
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < m; ++j) {
      double s = 0;
      for (int64_t k = 0; k < m; ++k) s += double{gram[i * m + k]} * gram[k * m + j];
      p64[i * m + j] = b * double{gram[i * m + j]} + c * s;
    }
  }
  // P's upper triangle is the result; the apply uses it mirrored.
  std::vector<float> upper_poly(m * m);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < m; ++j)
      upper_poly[i * m + j] = poly[std::min(i, j) * m + std::max(i, j)];
  }
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = a * double{x[i * n + j]};
      for (int64_t k = 0; k < m; ++k) s += double{upper_poly[i * m + k]} * x[k * n + j];
      n64[i * n + j] = s;
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < m; ++j) {
      ASSERT_EQ(gram[i * m + j], gram[j * m + i])
          << "X X^T not exactly symmetric at " << i << "," << j;
    }
  }
  EXPECT_LT(RelError(gram, g64), 1e-5);
  EXPECT_LT(RelError(upper_poly, p64), 1e-5);
  EXPECT_LT(RelError(next, n64), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Shapes, SymmetricProductsTest,
                         ::testing::Values(Shape{1, 1}, Shape{1, 7}, Shape{5, 5}, Shape{63, 64},
                                           Shape{65, 130}, Shape{128, 128}, Shape{130, 300}),
                         [](const auto& info) {
                           return std::to_string(info.param.m) + "x" + std::to_string(info.param.n);
                         });

TEST(MirrorUpperTest, CopiesUpperOntoLowerOnly) {
  const int64_t m = 150;  // crosses two 64-wide tiles and a partial one
  std::vector<float> a(m * m);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < m; ++j) a[i * m + j] = j >= i ? static_cast<float>(i * m + j) : -1.0f;
  }
  MirrorUpper(a.data(), m);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < m; ++j) {
      const int64_t r = std::min(i, j), c = std::max(i, j);
      ASSERT_EQ(a[i * m + j], static_cast<float>(r * m + c)) << i << "," << j;
    }
  }
}

}  // namespace
}  // namespace muond::server::internal
