// The fixture of the OpenCL runs of the Level Zero backend's kernels and Muon driver
// (muon_kernels_opencl_test.cc, muon_driver_opencl_test.cc): the kernel source
// (server/device/level_zero/kernels/muon_kernels.cl) built once per suite on the first OpenCL
// device, and device buffers written and read in a storage dtype. Every test skips, with the
// reason, when no OpenCL platform is available or the build has no OpenCL; a source that cannot be
// read or built fails every test.
//
// Not thread-safe: used from the gtest main thread.
#ifndef MUOND_TESTS_UNIT_LEVEL_ZERO_MUON_KERNELS_OPENCL_FIXTURE_H_
#define MUOND_TESTS_UNIT_LEVEL_ZERO_MUON_KERNELS_OPENCL_FIXTURE_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "server/device/level_zero/kernel_queue.h"
#ifdef MUOND_HAVE_OPENCL
#include "tests/unit/level_zero/opencl_kernel_queue.h"
#endif

namespace muond::server::device::level_zero {

// The storage and compute dtypes the kernels take.
inline constexpr common::DType kDTypes[] = {common::DType::kFloat32, common::DType::kBFloat16,
                                            common::DType::kFloat16};

class MuonKernelsOpenClTest : public testing::Test {
 protected:
  static void SetUpTestSuite();
  static void TearDownTestSuite();
  void SetUp() override;

#ifdef MUOND_HAVE_OPENCL
  KernelQueue& queue() { return *queue_; }
  // A device buffer holding `values` stored as `dtype`.
  std::unique_ptr<QueueBuffer> Upload(const std::vector<float>& values, common::DType dtype);
  // The first `n` values of `b`, stored as `dtype`.
  std::vector<float> Download(const QueueBuffer& b, size_t n, common::DType dtype);
  static OpenClKernelQueue* queue_;
#endif
  static std::string skip_reason_;
  static std::string setup_error_;
};

}  // namespace muond::server::device::level_zero

#endif  // MUOND_TESTS_UNIT_LEVEL_ZERO_MUON_KERNELS_OPENCL_FIXTURE_H_
