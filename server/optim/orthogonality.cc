#include "server/optim/orthogonality.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace muond::server {
namespace {

// Rows of the Gram matrix formed per product: bounds the working buffer to kBlock x r floats.
constexpr int64_t kBlock = 256;

// ||G - I||_F^2 of one block's Gram matrix on its short side, in row blocks of G.
double GramDeviationSquared(const float* x, int64_t rows, int64_t cols, float alpha,
                            std::vector<float>& work) {
  const bool wide = rows <= cols;  // G = X Xᵀ (rows x rows), else Xᵀ X (cols x cols)
  const int64_t r = wide ? rows : cols;
  const int64_t k = wide ? cols : rows;
  double sum = 0;
  for (int64_t i0 = 0; i0 < r; i0 += kBlock) {
    const int64_t b = std::min(kBlock, r - i0);
    if (wide) {
      // G[i0:i0+b, :] = X[i0:i0+b, :] Xᵀ
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(b), static_cast<int>(r),
                  static_cast<int>(k), alpha, x + i0 * cols, static_cast<int>(cols), x,
                  static_cast<int>(cols), 0.0f, work.data(), static_cast<int>(r));
    } else {
      // G[i0:i0+b, :] = (X[:, i0:i0+b])ᵀ X
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(b), static_cast<int>(r),
                  static_cast<int>(k), alpha, x + i0, static_cast<int>(cols), x,
                  static_cast<int>(cols), 0.0f, work.data(), static_cast<int>(r));
    }
    for (int64_t i = 0; i < b; ++i) {
      const float* row = work.data() + i * r;
      for (int64_t j = 0; j < r; ++j) {
        const double d = static_cast<double>(row[j]) - (i0 + i == j ? 1.0 : 0.0);
        sum += d * d;
      }
    }
  }
  return sum;
}

}  // namespace

double OrthogonalityError(const float* x, const MatrixGeometry& geometry, double scale) {
  const int64_t r = std::min(geometry.rows, geometry.cols);
  std::vector<float> work(static_cast<size_t>(std::min(kBlock, r) * r));
  const float alpha = static_cast<float>(1.0 / (scale * scale));
  const int64_t block = geometry.rows * geometry.cols;
  double sum = 0;
  for (int64_t b = 0; b < geometry.batch; ++b) {
    sum += GramDeviationSquared(x + b * block, geometry.rows, geometry.cols, alpha, work);
  }
  return std::sqrt(sum / static_cast<double>(geometry.batch * r));
}

double UpdateOrthogonalityError(const common::MuonConfig& config, const common::MatrixSpec& spec,
                                const float* update) {
  const MatrixGeometry g = GeometryOf(spec);
  return OrthogonalityError(update, g, MuonScale(config.scale_mode, g.rows, g.cols));
}

}  // namespace muond::server
