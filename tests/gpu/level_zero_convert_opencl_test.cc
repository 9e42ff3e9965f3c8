// The Level Zero backend's widening and narrowing for the direct path (ConvertElements,
// server/device/level_zero/convert_elements.h), run through the OpenCL queue of the Level Zero
// tests on whatever OpenCL platform is installed (PoCL on the CPU here), from the same
// muon_kernels.cl source the backend compiles to SPIR-V: bfloat16 and float16, one launch and many
// (rows per launch forced small) plus a short remainder row, against common::FromFloat32 /
// ToFloat32 bit for bit; the elements past the end are left alone. Skips, with the reason, where
// there is no OpenCL device.
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "server/device/level_zero/convert_elements.h"
#include "tests/unit/level_zero/opencl_kernel_queue.h"

namespace muond::server::device::level_zero {
namespace {

std::vector<float> Values(size_t n) {
  std::vector<float> v(n);
  uint32_t x = 12345;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = (static_cast<float>(x >> 8) / 16777216.0f - 0.5f) * (i % 3 == 0 ? 1e5f : 3.0f);
  }
  const float special[] = {0.0f, -0.0f, 1.00390625f, 65520.0f, 1e-40f, -1e30f, 3.0e-8f};
  for (size_t i = 0; i < n; i += 11) v[i] = special[(i / 11) % 7];
  return v;
}

TEST(LevelZeroConvertOpenClTest, WidensAndNarrowsAsTheHost) {
  std::ifstream file(MUOND_MUON_KERNELS_CL);
  ASSERT_TRUE(file.good()) << MUOND_MUON_KERNELS_CL;
  std::stringstream source;
  source << file.rdbuf();
  auto queue = OpenClKernelQueue::Create(source.str());
  if (!queue.ok()) GTEST_SKIP() << "no OpenCL device: " << queue.status().message();
  constexpr size_t kTail = 64;  // guard elements past the end
  for (const int64_t rows_per_launch : {int64_t{65536}, int64_t{2}}) {
    for (const size_t n : {size_t{77}, size_t{5 * 1024 + 333}}) {
      for (common::DType dtype : {common::DType::kBFloat16, common::DType::kFloat16}) {
        const std::vector<float> values = Values(n);
        std::vector<char> want(n * 2);
        common::FromFloat32(values.data(), n, dtype, want.data());
        std::vector<float> widened_want(n);
        common::ToFloat32(dtype, want.data(), n, widened_want.data());
        auto f32 = (*queue)->Allocate((n + kTail) * 4);
        auto raw = (*queue)->Allocate((n + kTail) * 2);
        ASSERT_TRUE(f32.ok() && raw.ok());
        const std::vector<char> guard((n + kTail) * 4, 0x5a);
        ASSERT_TRUE((*queue)->Write((*raw)->ref(), 0, guard.data(), (n + kTail) * 2).ok());
        ASSERT_TRUE((*queue)->Write((*f32)->ref(), 0, values.data(), n * 4).ok());
        ASSERT_TRUE((*queue)->Write((*f32)->ref(), n * 4, guard.data(), kTail * 4).ok());
        absl::Status s =
            ConvertElements(**queue, (*f32)->ref(), common::DType::kFloat32, (*raw)->ref(), dtype,
                            static_cast<int64_t>(n), 1.0f, rows_per_launch);
        ASSERT_TRUE(s.ok()) << s;
        std::vector<char> got((n + kTail) * 2);
        ASSERT_TRUE((*queue)->Read((*raw)->ref(), 0, got.data(), got.size()).ok());
        EXPECT_EQ(std::memcmp(got.data(), want.data(), n * 2), 0)
            << common::DTypeName(dtype) << " n " << n << " narrowing differs from the host";
        EXPECT_EQ(std::memcmp(got.data() + n * 2, guard.data(), kTail * 2), 0);
        // Widened as is, and widened and scaled (apply mode's divisor and clip coefficient):
        // the product rounds once in float32, as the host's g *= scale.
        for (const float scale : {1.0f, 0.3f}) {
          s = ConvertElements(**queue, (*raw)->ref(), dtype, (*f32)->ref(), common::DType::kFloat32,
                              static_cast<int64_t>(n), scale, rows_per_launch);
          ASSERT_TRUE(s.ok()) << s;
          std::vector<float> widened(n + kTail);
          ASSERT_TRUE((*queue)->Read((*f32)->ref(), 0, widened.data(), widened.size() * 4).ok());
          std::vector<float> scaled_want = widened_want;
          for (float& v : scaled_want) v *= scale;
          EXPECT_EQ(std::memcmp(widened.data(), scaled_want.data(), n * 4), 0)
              << common::DTypeName(dtype) << " n " << n << " scale " << scale
              << ": widening differs from the host";
          EXPECT_EQ(std::memcmp(widened.data() + n, guard.data(), kTail * 4), 0);
        }
      }
    }
  }
  EXPECT_EQ(
      ConvertElements(**queue, {}, common::DType::kFloat32, {}, common::DType::kFloat32, 4).code(),
      absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace muond::server::device::level_zero
