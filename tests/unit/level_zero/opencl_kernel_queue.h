// A KernelQueue on OpenCL (through the ICD loader), for the tests: runs the Level Zero backend's
// kernel source (muon_kernels.cl, built from source with clBuildProgram) and its kernel driver on
// whatever OpenCL platform is installed, here PoCL on the CPU. One in-order command queue; not
// thread-safe.
#ifndef MUOND_TESTS_UNIT_LEVEL_ZERO_OPENCL_KERNEL_QUEUE_H_
#define MUOND_TESTS_UNIT_LEVEL_ZERO_OPENCL_KERNEL_QUEUE_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/device/level_zero/kernel_queue.h"

namespace muond::server::device::level_zero {

class OpenClKernelQueue final : public KernelQueue {
 public:
  // Builds `source` on the first device of the first platform that has one. UNAVAILABLE (with the
  // reason) when there is no platform or device; INTERNAL with the build log when the program does
  // not build.
  static absl::StatusOr<std::unique_ptr<OpenClKernelQueue>> Create(const std::string& source);
  ~OpenClKernelQueue() override;

  absl::StatusOr<std::unique_ptr<QueueBuffer>> Allocate(size_t bytes) override;
  absl::Status Launch(const char* name, const std::vector<KernelArg>& args, LaunchSize global,
                      LaunchSize local) override;
  absl::Status Read(KernelBufferRef src, size_t offset, void* dst, size_t bytes) override;

  // Blocks until `bytes` from `src` are written at `offset` of `dst`.
  absl::Status Write(KernelBufferRef dst, size_t offset, const void* src, size_t bytes);
  // "<platform> / <device>".
  const std::string& description() const { return description_; }

 private:
  struct Impl;
  explicit OpenClKernelQueue(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::string description_;
};

}  // namespace muond::server::device::level_zero

#endif  // MUOND_TESTS_UNIT_LEVEL_ZERO_OPENCL_KERNEL_QUEUE_H_
