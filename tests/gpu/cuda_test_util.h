// Helpers of the CUDA backend tests: the shared device (opened once; tests skip with the reason
// when there is none), random inputs and error measures.
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

namespace muond::server::device::testing_cuda {

// The CUDA device 0 of this machine, opened on first use and kept for the process (device
// contexts are expensive); its error when there is none.
inline absl::StatusOr<Device*> SharedCudaDevice() {
  static auto* opened = new absl::StatusOr<std::unique_ptr<Device>>(OpenCudaDevice(0));
  if (!opened->ok()) return opened->status();
  return opened->value().get();
}

#define MUOND_REQUIRE_CUDA_DEVICE(dev)                                                   \
  Device* dev = nullptr;                                                                \
  do {                                                                                  \
    auto muond_opened_ = ::muond::server::device::testing_cuda::SharedCudaDevice();     \
    if (!muond_opened_.ok()) {                                                          \
      GTEST_SKIP() << "CUDA backend unavailable: " << muond_opened_.status().message();           \
    }                                                                                   \
    dev = *muond_opened_;                                                               \
  } while (0)

inline std::vector<float> RandomValues(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

template <typename T>
double RelativeError(const std::vector<float>& got, const std::vector<T>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - static_cast<double>(want[i]);
    diff += d * d;
    norm += static_cast<double>(want[i]) * static_cast<double>(want[i]);
  }
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

inline bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace muond::server::device::testing_cuda

#endif  // MUOND_TESTS_GPU_CUDA_TEST_UTIL_H_
