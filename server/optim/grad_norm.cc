#include "server/optim/grad_norm.h"

#include <algorithm>
#include <cmath>

namespace muond::server {
namespace {

// One block: 8 lanes, then ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)). The lanes are independent, so
// the compiler may vectorize the loop without changing a bit.
double BlockSum(const float* g, size_t n) {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      const double x = g[i + j];
      lane[j] += x * x;
    }
  }
  for (int j = 0; i < n; ++i, ++j) {
    const double x = g[i];
    lane[j] += x * x;
  }
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

}  // namespace

double SumOfSquares(const float* g, size_t n) {
  double sum = 0;
  for (size_t b = 0; b < n; b += kNormBlock) sum += BlockSum(g + b, std::min(kNormBlock, n - b));
  return sum;
}

float ClipCoefficient(double sum_sq, double max_norm) {
  if (max_norm <= 0) return 1.0f;
  const double coef = max_norm / (std::sqrt(sum_sq) + 1e-6);
  return coef >= 1.0 ? 1.0f : static_cast<float>(coef);
}

}  // namespace muond::server
