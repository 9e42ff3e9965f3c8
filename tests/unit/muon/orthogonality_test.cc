// OrthogonalityError (server/optim/orthogonality.h) against constructions whose answer is known in
// closed form, and against a float64 Gram matrix computed here.
#include "server/optim/orthogonality.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace muond::server {
namespace {

// r x n (r <= n) with orthonormal rows: the first r rows of the identity, turned by Givens
// rotations in random planes.
std::vector<float> OrthonormalRows(int64_t r, int64_t n, uint32_t seed) {
  std::vector<double> x(static_cast<size_t>(r * n), 0.0);
  for (int64_t i = 0; i < r; ++i) x[i * n + i] = 1.0;
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int64_t> col(0, n - 1);
  std::uniform_real_distribution<double> angle(0, 6.283185307179586);
  for (int k = 0; k < 8 * static_cast<int>(n); ++k) {
    const int64_t a = col(gen), b = col(gen);
    if (a == b) continue;
    const double t = angle(gen), c = std::cos(t), s = std::sin(t);
    for (int64_t i = 0; i < r; ++i) {
      const double xa = x[i * n + a], xb = x[i * n + b];
      x[i * n + a] = c * xa - s * xb;
      x[i * n + b] = s * xa + c * xb;
    }
  }
  return std::vector<float>(x.begin(), x.end());
}

std::vector<float> Transposed(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> t(x.size());
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) t[j * rows + i] = x[i * cols + j];
  }
  return t;
}

// The definition, in float64, written out.
double Reference(const std::vector<float>& x, int64_t rows, int64_t cols, double scale) {
  const bool wide = rows <= cols;
  const int64_t r = wide ? rows : cols, k = wide ? cols : rows;
  auto at = [&](int64_t i, int64_t l) {  // element (i, l) of the short-side-first view
    return static_cast<double>(wide ? x[i * cols + l] : x[l * cols + i]) / scale;
  };
  double sum = 0;
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t j = 0; j < r; ++j) {
      double g = 0;
      for (int64_t l = 0; l < k; ++l) g += at(i, l) * at(j, l);
      const double d = g - (i == j ? 1.0 : 0.0);
      sum += d * d;
    }
  }
  return std::sqrt(sum / static_cast<double>(r));
}

TEST(OrthogonalityTest, OrthonormalRowsAndColumnsMeasureZero) {
  const std::vector<float> q = OrthonormalRows(48, 80, 1);
  EXPECT_LT(OrthogonalityError(q.data(), {1, 48, 80}, 1.0), 1e-5);
  // Tall: the columns are orthonormal, and the Gram matrix is taken on the short side.
  const std::vector<float> t = Transposed(q, 48, 80);
  EXPECT_LT(OrthogonalityError(t.data(), {1, 80, 48}, 1.0), 1e-5);
}

TEST(OrthogonalityTest, AScaledOrthogonalMatrixMeasuresTheScale) {
  // c Q: G = c^2 I, so ||G - I||_F / sqrt(r) = |c^2 - 1|.
  std::vector<float> q = OrthonormalRows(32, 64, 2);
  for (float& v : q) v *= 1.1f;
  EXPECT_NEAR(OrthogonalityError(q.data(), {1, 32, 64}, 1.0), 0.21, 1e-5);
  // Divided by its scale first, it is orthogonal again.
  EXPECT_LT(OrthogonalityError(q.data(), {1, 32, 64}, 1.1), 1e-5);
}

TEST(OrthogonalityTest, BlocksCombineAsTheRootMeanSquare) {
  // Two heads: 0.9 Q1 above 1.2 Q2.
  std::vector<float> x = OrthonormalRows(16, 40, 3);
  const std::vector<float> q2 = OrthonormalRows(16, 40, 4);
  for (float& v : x) v *= 0.9f;
  for (float v : q2) x.push_back(1.2f * v);
  const double a = 1 - 0.81, b = 1.44 - 1;
  EXPECT_NEAR(OrthogonalityError(x.data(), {2, 16, 40}, 1.0), std::sqrt((a * a + b * b) / 2), 1e-5);
}

TEST(OrthogonalityTest, MatchesAFloat64GramMatrixPastOneRowBlock) {
  // r = 300 > 256: the Gram matrix is formed in two row blocks.
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0, 0.05f);
  std::vector<float> x(300 * 420);
  for (float& v : x) v = normal(gen);
  const double want = Reference(x, 300, 420, 1.5);
  EXPECT_NEAR(OrthogonalityError(x.data(), {1, 300, 420}, 1.5), want, 1e-5 * want);
  const std::vector<float> t = Transposed(x, 300, 420);
  EXPECT_NEAR(OrthogonalityError(t.data(), {1, 420, 300}, 1.5), want, 1e-5 * want);
}

TEST(OrthogonalityTest, ANonFiniteValueMeasuresNaN) {
  std::vector<float> q = OrthonormalRows(8, 8, 6);
  q[5] = std::nanf("");
  EXPECT_TRUE(std::isnan(OrthogonalityError(q.data(), {1, 8, 8}, 1.0)));
}

TEST(OrthogonalityTest, AMuonUpdateIsNearOrthogonalAfterItsScaleIsTakenOut) {
  // A real update (fp32 Newton-Schulz, original scale: sqrt(rows / cols) for a tall matrix): the
  // quintic iteration leaves the singular values in a band around 1, not at 1.
  common::MuonConfig config;
  common::MatrixSpec spec;
  spec.name = "w";
  spec.shape = {96, 64};
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> grad(96 * 64), momentum(grad.size(), 0), update(grad.size());
  for (float& v : grad) v = normal(gen);
  ASSERT_TRUE(MuonUpdate(config, spec, grad.data(), momentum.data(), update.data()).ok());
  const double e = UpdateOrthogonalityError(config, spec, update.data());
  EXPECT_GT(e, 0.01);
  EXPECT_LT(e, 0.5);
  // Measured without taking the scale out, the update is far from orthogonal (s^2 = 1.5).
  EXPECT_GT(OrthogonalityError(update.data(), {1, 96, 64}, 1.0), 0.3);
}

}  // namespace
}  // namespace muond::server
