// KernelQueue: the few operations the Muon kernel driver (muon_kernel_driver.h) needs from a
// device that runs OpenCL C kernels, so that the driver is written once and runs unchanged on
// Level Zero (the production backend, level_zero_device.cc, SPIR-V kernels) and on OpenCL (the
// tests, PoCL on the CPU, the same kernel source): allocate scratch memory, launch a kernel by
// name, read a result back to the host.
//
// A queue is in order: a launch starts after every earlier launch has finished. A queue is used by
// one thread at a time (it is not thread-safe). Buffers are opaque handles (a USM device pointer
// on Level Zero, a cl_mem on OpenCL); kernels address into them with element offsets.
#ifndef MUOND_SERVER_DEVICE_LEVEL_ZERO_KERNEL_QUEUE_H_
#define MUOND_SERVER_DEVICE_LEVEL_ZERO_KERNEL_QUEUE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace muond::server::device::level_zero {

// A device buffer as a kernel argument: the queue implementation's handle, not dereferenceable by
// the host.
struct KernelBufferRef {
  void* handle = nullptr;
};

// Scratch memory owned by the caller; its destructor releases it once the queue's work that uses
// it has finished (the implementation waits or defers as its API requires).
class QueueBuffer {
 public:
  virtual ~QueueBuffer() = default;
  virtual KernelBufferRef ref() const = 0;
};

// One kernel argument, in the order of the kernel's parameter list. The C++ type must match the
// OpenCL C parameter: kBuffer for `global T*`, kInt for `int`, kLong for `long`, kFloat for
// `float`.
struct KernelArg {
  enum class Kind { kBuffer, kInt, kLong, kFloat };
  Kind kind = Kind::kInt;
  void* buffer = nullptr;
  int32_t i32 = 0;
  int64_t i64 = 0;
  float f32 = 0;

  static KernelArg Buffer(KernelBufferRef b) { return {Kind::kBuffer, b.handle, 0, 0, 0}; }
  static KernelArg Int(int32_t v) { return {Kind::kInt, nullptr, v, 0, 0}; }
  static KernelArg Long(int64_t v) { return {Kind::kLong, nullptr, 0, v, 0}; }
  static KernelArg Float(float v) { return {Kind::kFloat, nullptr, 0, 0, v}; }
};

// A 1- to 3-dimensional launch size in work-items.
struct LaunchSize {
  size_t x = 1;
  size_t y = 1;
  size_t z = 1;
};

class KernelQueue {
 public:
  virtual ~KernelQueue() = default;

  // Blocks. RESOURCE_EXHAUSTED when the device is out of memory. Contents are undefined.
  virtual absl::StatusOr<std::unique_ptr<QueueBuffer>> Allocate(size_t bytes) = 0;

  // Enqueues kernel `name` of the muon_kernels.cl program with `args`.
  // REQUIRES: every dimension of `global` is a multiple of the same dimension of `local`.
  // Errors: NOT_FOUND for an unknown kernel, the API's error (naming the call) otherwise; a
  // failure of the kernel itself may instead be reported by the next Read.
  virtual absl::Status Launch(const char* name, const std::vector<KernelArg>& args,
                              LaunchSize global, LaunchSize local) = 0;

  // Blocks until all earlier launches have finished, then copies `bytes` at byte `offset` of
  // `src` to the host.
  virtual absl::Status Read(KernelBufferRef src, size_t offset, void* dst, size_t bytes) = 0;
};

}  // namespace muond::server::device::level_zero

#endif  // MUOND_SERVER_DEVICE_LEVEL_ZERO_KERNEL_QUEUE_H_
