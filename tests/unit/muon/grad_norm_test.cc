// server/optim/grad_norm: the float64 sum of squares against a float64 LibTorch reference, its one
// summation order, and the clip coefficient of DESIGN.md 4b.
#include "server/optim/grad_norm.h"

#include <torch/torch.h>

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace muond::server {
namespace {

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> g(n);
  for (float& x : g) x = normal(rng);
  return g;
}

TEST(GradNormTest, SumOfSquaresMatchesFloat64Reference) {
  for (size_t n : {size_t{1}, size_t{7}, size_t{8}, size_t{9}, kNormBlock - 1, kNormBlock + 3,
                   size_t{1000003}}) {
    const std::vector<float> g = Random(n, static_cast<uint32_t>(n));
    const double want =
        torch::from_blob(const_cast<float*>(g.data()), {static_cast<int64_t>(n)}, torch::kFloat32)
            .to(torch::kFloat64)
            .square()
            .sum()
            .item<double>();
    EXPECT_NEAR(SumOfSquares(g.data(), n), want, 1e-12 * want) << n << " elements";
  }
}

TEST(GradNormTest, OneOrderWhateverTheSplitAtBlockBoundaries) {
  const size_t n = 5 * kNormBlock + 123;
  const std::vector<float> g = Random(n, 3);
  const double whole = SumOfSquares(g.data(), n);
  // Whole blocks summed separately and added in block order give the same bits.
  double parts = 0;
  for (size_t b = 0; b < n; b += kNormBlock) {
    parts += SumOfSquares(g.data() + b, std::min(kNormBlock, n - b));
  }
  EXPECT_EQ(whole, parts);
  EXPECT_EQ(SumOfSquares(g.data(), n), whole);  // and again
}

TEST(GradNormTest, ClipCoefficient) {
  EXPECT_EQ(ClipCoefficient(1e12, 0.0), 1.0f);  // no clipping asked
  EXPECT_EQ(ClipCoefficient(0.25, 1.0), 1.0f);  // norm 0.5 is within 1
  EXPECT_EQ(ClipCoefficient(0.0, 1.0), 1.0f);
  // norm 10, max 1: 1 / (10 + 1e-6), rounded to float once.
  EXPECT_EQ(ClipCoefficient(100.0, 1.0), static_cast<float>(1.0 / (10.0 + 1e-6)));
  // As torch.nn.utils.clip_grad_norm_ scales (it computes in the gradient dtype; within float).
  const std::vector<float> g = Random(4096, 9);
  torch::Tensor t = torch::from_blob(const_cast<float*>(g.data()), {4096}, torch::kFloat32).clone();
  t.set_requires_grad(true);
  t.mutable_grad() = t.detach().clone();
  torch::nn::utils::clip_grad_norm_(std::vector<torch::Tensor>{t}, 2.0);
  const float coef = ClipCoefficient(SumOfSquares(g.data(), g.size()), 2.0);
  const torch::Tensor ours =
      torch::from_blob(const_cast<float*>(g.data()), {4096}, torch::kFloat32) * coef;
  EXPECT_LT((ours - t.grad()).abs().max().item<float>(), 1e-6f);
}

}  // namespace
}  // namespace muond::server
