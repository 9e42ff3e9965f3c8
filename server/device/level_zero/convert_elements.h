// The widening and narrowing of the Level Zero backend's Stream::Convert (level_zero_stream.cc),
// written against KernelQueue so that the tests run it unchanged on OpenCL (PoCL on the CPU): n
// elements through the convert kernel of muon_kernels.cl (round to nearest even, as the host).
#ifndef MUOND_SERVER_DEVICE_LEVEL_ZERO_CONVERT_ELEMENTS_H_
#define MUOND_SERVER_DEVICE_LEVEL_ZERO_CONVERT_ELEMENTS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "server/device/level_zero/kernel_queue.h"

namespace muond::server::device::level_zero {

// Enqueues dst[i] = convert(src[i]) for i < elements, both from element 0: rows of 1024
// elements, at most `rows_per_launch` rows a launch (small group counts), the remainder as one
// short row.
// Each value is multiplied by `scale` in float32 before it is narrowed (the kernel's factor).
// INVALID_ARGUMENT when from == to with scale 1 (a copy, not a kernel) or src and dst are one
// buffer.
absl::Status ConvertElements(KernelQueue& queue, KernelBufferRef src, common::DType from,
                             KernelBufferRef dst, common::DType to, int64_t elements,
                             float scale = 1.0f, int64_t rows_per_launch = 65536);

}  // namespace muond::server::device::level_zero

#endif  // MUOND_SERVER_DEVICE_LEVEL_ZERO_CONVERT_ELEMENTS_H_
