// QK-Clip's factors and row scaling (server/optim/qk_clip.h) against DESIGN.md 4e worked by hand.
#include "server/optim/qk_clip.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace muond::server {
namespace {

TEST(QkClipTest, GroupedQueryFactors) {
  common::QkClip clip;
  clip.threshold = 8;
  clip.alpha = 0.5;
  const common::QkClipPair pair{"q", "k", 6, 2, 3};  // query heads 0-2 read key head 0, 3-5 head 1
  const float s[] = {2, 16, 8, -4, 7.99f, 32};       // 16: gamma 1/2; 8: at tau; 32: gamma 1/4
  const QkClipFactors f = ComputeQkClipFactors(clip, pair, s);
  EXPECT_EQ(f.heads_clipped, 2);
  const std::vector<double> q = {1, std::sqrt(0.5), 1, 1, 1, 0.5};
  const std::vector<double> k = {std::sqrt(0.5), 0.5};  // (min gamma)^(1 - alpha)
  ASSERT_EQ(f.q.size(), q.size());
  ASSERT_EQ(f.k.size(), k.size());
  for (size_t h = 0; h < q.size(); ++h) EXPECT_DOUBLE_EQ(f.q[h], q[h]) << h;
  for (size_t g = 0; g < k.size(); ++g) EXPECT_DOUBLE_EQ(f.k[g], k[g]) << g;
  // alpha 1: only the queries; alpha 0: only the keys.
  clip.alpha = 1;
  const QkClipFactors queries = ComputeQkClipFactors(clip, pair, s);
  EXPECT_DOUBLE_EQ(queries.q[1], 0.5);
  EXPECT_DOUBLE_EQ(queries.k[0], 1.0);
  clip.alpha = 0;
  const QkClipFactors keys = ComputeQkClipFactors(clip, pair, s);
  EXPECT_DOUBLE_EQ(keys.q[5], 1.0);
  EXPECT_DOUBLE_EQ(keys.k[1], 0.25);
}

TEST(QkClipTest, ScalesOnlyTheHeadsWhoseFactorIsNotOne) {
  // 3 heads of 2 rows x 2 columns; head 1 scaled by 0.1 (float64 product, rounded once).
  std::vector<float> w = {1, 2, 3, 4, 0.3f, 0.7f, 1e-3f, -5, 9, 10, 11, 12};
  const std::vector<float> before = w;
  ScaleHeadRows(w.data(), 2, 2, {1.0, 0.1, 1.0});
  for (size_t i = 0; i < w.size(); ++i) {
    const bool scaled = i >= 4 && i < 8;
    const float want =
        scaled ? static_cast<float>(static_cast<double>(before[i]) * 0.1) : before[i];
    EXPECT_EQ(w[i], want) << i;
  }
}

}  // namespace
}  // namespace muond::server
