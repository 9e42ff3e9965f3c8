// Helpers of the CUDA backend tests: the shared device (opened once; tests skip with the reason
// when there is none); random inputs and error measures from tests/common/muon_cases.h.
#ifndef MUOND_TESTS_GPU_CUDA_TEST_UTIL_H_
#define MUOND_TESTS_GPU_CUDA_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/device/device.h"
#include "tests/common/muon_cases.h"

namespace muond::server::device::testing_cuda {

// The CUDA device 0 of this machine, opened on first use and kept for the process (device
// contexts are expensive); its error when there is none.
inline absl::StatusOr<Device*> SharedCudaDevice() {
  static auto* opened = new absl::StatusOr<std::unique_ptr<Device>>(OpenCudaDevice(0));
  if (!opened->ok()) return opened->status();
  return opened->value().get();
}

// Declares `Device* dev`: the shared CUDA device, or skips the test with the reason. ctest reports
// a suite skipped by its message, "CUDA backend unavailable: " (tests/gpu/CMakeLists.txt).
#define MUOND_REQUIRE_CUDA_DEVICE(dev)                                                  \
  Device* dev = nullptr;                                                                \
  do {                                                                                  \
    auto muond_opened_ = ::muond::server::device::testing_cuda::SharedCudaDevice();     \
    if (!muond_opened_.ok()) {                                                          \
      GTEST_SKIP() << "CUDA backend unavailable: " << muond_opened_.status().message(); \
    }                                                                                   \
    dev = *muond_opened_;                                                               \
  } while (0)

// Random inputs and error measures, shared with the other backends' conformance tests.
using test_util::Bound;
using test_util::RandomValues;
using test_util::RelativeError;
using test_util::SameBits;

}  // namespace muond::server::device::testing_cuda

#endif  // MUOND_TESTS_GPU_CUDA_TEST_UTIL_H_
