// The memory passes around Newton-Schulz (server/optim/ns_layout.h) against plain loops: the
// normalization and the write-back in both layouts and both dtypes, on shapes that are not
// multiples of the 64 x 64 tile; bits independent of the thread count; the non-finite report and
// the parallel ranges.
#include "server/optim/ns_layout.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace muond::server::internal {
namespace {

uint16_t Bf16(float f) {  // nearest even (common/dtype.h's rule), for finite f
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

float Widen(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

std::vector<std::vector<float>> Buffers(size_t count, int64_t elements, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> out(count, std::vector<float>(static_cast<size_t>(elements)));
  for (auto& b : out) {
    for (float& v : b) v = normal(rng);
  }
  return out;
}

std::vector<const float*> Pointers(const std::vector<std::vector<float>>& buffers) {
  std::vector<const float*> p;
  for (const auto& b : buffers) p.push_back(b.data());
  return p;
}

// Element (i, j) of the iteration's block [m, n] from the caller's block [rows, cols].
float Caller(const BlockLayout& l, const float* block, int64_t i, int64_t j) {
  return l.transposed() ? block[j * l.cols + i] : block[i * l.cols + j];
}

struct Shape {
  int64_t batch, rows, cols;
};

class NsLayoutTest : public ::testing::TestWithParam<Shape> {};

TEST_P(NsLayoutTest, NormalizeDividesEachBlockByItsNormInTheIterationLayout) {
  const Shape s = GetParam();
  const BlockLayout l{3, s.batch, s.rows, s.cols};
  const auto buffers = Buffers(l.count, s.batch * s.rows * s.cols, 7);
  const std::vector<const float*> src = Pointers(buffers);
  const int64_t m = std::min(s.rows, s.cols), n = std::max(s.rows, s.cols);
  const int64_t total = static_cast<int64_t>(l.count) * s.batch * m * n;
  std::vector<float> f32(static_cast<size_t>(total));
  std::vector<uint16_t> bf16(static_cast<size_t>(total));
  NormalizeBlocksInto(l, src.data(), 1.5, 1e-7f, GemmType::kFloat32, f32.data(), 2);
  NormalizeBlocksInto(l, src.data(), 1.5, 1e-7f, GemmType::kBFloat16, bf16.data(), 2);
  for (int64_t b = 0; b < static_cast<int64_t>(l.count) * s.batch; ++b) {
    const float* block = src[static_cast<size_t>(b / s.batch)] + (b % s.batch) * s.rows * s.cols;
    double sum = 0;
    for (int64_t e = 0; e < s.rows * s.cols; ++e) sum += double{block[e]} * block[e];
    const float denom = static_cast<float>(std::sqrt(sum)) * 1.5f + 1e-7f;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        const size_t at = static_cast<size_t>((b * m + i) * n + j);
        const float want = Caller(l, block, i, j) / denom;
        // The norm's float64 sum in another order may differ in its last fp32 bit.
        ASSERT_NEAR(f32[at], want, 2e-6f * std::abs(want) + 1e-12f) << b << " " << i << " " << j;
        ASSERT_EQ(bf16[at], Bf16(f32[at])) << "bf16 is the fp32 quotient rounded once";
      }
    }
  }
}

TEST_P(NsLayoutTest, BitsDoNotDependOnTheThreadCount) {
  const Shape s = GetParam();
  const BlockLayout l{2, s.batch, s.rows, s.cols};
  const auto buffers = Buffers(l.count, s.batch * s.rows * s.cols, 11);
  const std::vector<const float*> src = Pointers(buffers);
  const size_t total = buffers.size() * buffers[0].size();
  std::vector<float> one(total), three(total);
  NormalizeBlocksInto(l, src.data(), 1.0, 1e-7f, GemmType::kFloat32, one.data(), 1);
  NormalizeBlocksInto(l, src.data(), 1.0, 1e-7f, GemmType::kFloat32, three.data(), 3);
  EXPECT_EQ(std::memcmp(one.data(), three.data(), total * sizeof(float)), 0);

  // Each block's bits are those of the block alone (same-shape batching).
  const BlockLayout alone{1, s.batch, s.rows, s.cols};
  std::vector<float> single(buffers[1].size());
  NormalizeBlocksInto(alone, &src[1], 1.0, 1e-7f, GemmType::kFloat32, single.data(), 2);
  EXPECT_EQ(std::memcmp(single.data(), one.data() + buffers[0].size(), single.size() * 4), 0);
}

TEST_P(NsLayoutTest, WriteBackWidensScalesAndTransposesBack) {
  const Shape s = GetParam();
  const BlockLayout l{2, s.batch, s.rows, s.cols};
  const int64_t m = std::min(s.rows, s.cols), n = std::max(s.rows, s.cols);
  const auto results = Buffers(1, static_cast<int64_t>(l.count) * s.batch * m * n, 13);
  const std::vector<float>& r32 = results[0];
  std::vector<uint16_t> r16(r32.size());
  for (size_t e = 0; e < r32.size(); ++e) r16[e] = Bf16(r32[e]);
  for (GemmType type : {GemmType::kFloat32, GemmType::kBFloat16}) {
    auto out = Buffers(l.count, s.batch * s.rows * s.cols, 17);
    std::vector<float*> dst;
    for (auto& b : out) dst.push_back(b.data());
    const void* result = type == GemmType::kFloat32 ? static_cast<const void*>(r32.data())
                                                    : static_cast<const void*>(r16.data());
    ASSERT_EQ(WriteBackBlocks(l, result, type, 1.7320508, dst.data(), 2), -1);
    for (int64_t b = 0; b < static_cast<int64_t>(l.count) * s.batch; ++b) {
      const float* block = dst[static_cast<size_t>(b / s.batch)] + (b % s.batch) * s.rows * s.cols;
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          const size_t at = static_cast<size_t>((b * m + i) * n + j);
          const float v = type == GemmType::kFloat32 ? r32[at] : Widen(r16[at]);
          ASSERT_EQ(Caller(l, block, i, j), v * 1.7320508f) << b << " " << i << " " << j;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, NsLayoutTest,
                         ::testing::Values(Shape{1, 1, 1}, Shape{2, 70, 130}, Shape{1, 130, 70},
                                           Shape{3, 64, 64}, Shape{1, 200, 129}, Shape{2, 300, 65}),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return std::to_string(info.param.batch) + "x" +
                                  std::to_string(info.param.rows) + "x" +
                                  std::to_string(info.param.cols);
                         });

TEST(NsLayoutWriteBack, ReportsTheFirstBufferHoldingANonFiniteValue) {
  const BlockLayout l{3, 1, 90, 40};  // transposed
  const auto results = Buffers(1, 3 * 90 * 40, 19);
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> r = results[0];
    r[2 * 3600 + 17] = bad;    // buffer 2
    r[1 * 3600 + 3599] = bad;  // buffer 1, its last element
    auto out = Buffers(3, 3600, 23);
    std::vector<float*> dst{out[0].data(), out[1].data(), out[2].data()};
    EXPECT_EQ(WriteBackBlocks(l, r.data(), GemmType::kFloat32, 1.0, dst.data(), 2), 1);
  }
  // A finite result that overflows when scaled is not finite either.
  std::vector<float> r(3600, 1.0f);
  r[5] = 3e38f;
  std::vector<float> out(3600);
  float* dst = out.data();
  EXPECT_EQ(WriteBackBlocks(BlockLayout{1, 1, 60, 60}, r.data(), GemmType::kFloat32, 2.0, &dst, 2),
            0);
}

TEST(NsLayoutRanges, FindNonFiniteParallelFindsTheFirstAcrossRanges) {
  const int64_t n = 3 * kRangeElements + 11;
  std::vector<float> v(static_cast<size_t>(n), 1.0f);
  EXPECT_EQ(FindNonFiniteParallel(v.data(), n, 2), -1);
  v[static_cast<size_t>(2 * kRangeElements + 5)] = std::numeric_limits<float>::infinity();
  v[static_cast<size_t>(kRangeElements + 1)] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(FindNonFiniteParallel(v.data(), n, 2), kRangeElements + 1);
  EXPECT_EQ(FindNonFiniteParallel(v.data(), n, 1), kRangeElements + 1);
  EXPECT_EQ(FindNonFiniteParallel(v.data(), 7, 2), -1);
}

TEST(NsLayoutRanges, ParallelRangesCoverEveryElementOnce) {
  for (int64_t n : {int64_t{0}, int64_t{1}, kRangeElements, 2 * kRangeElements + 5}) {
    std::vector<int> hits(static_cast<size_t>(n), 0);
    ParallelRanges(n, 3, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) ++hits[static_cast<size_t>(i)];
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)], 1) << n << " " << i;
  }
}

}  // namespace
}  // namespace muond::server::internal
