#include "server/device/level_zero/convert_elements.h"

#include <algorithm>

#include "server/device/level_zero/muon_kernels.h"

namespace muond::server::device::level_zero {

absl::Status ConvertElements(KernelQueue& queue, KernelBufferRef src, common::DType from,
                             KernelBufferRef dst, common::DType to, int64_t elements, float scale,
                             int64_t rows_per_launch) {
  if (from == to && scale == 1.0f) {
    return absl::InvalidArgumentError("convert: the dtypes are the same and nothing is scaled");
  }
  if (rows_per_launch < 1) return absl::InvalidArgumentError("convert: rows_per_launch < 1");
  constexpr int64_t kCols = 1024;
  for (int64_t at = 0; at < elements;) {
    int64_t rows = std::min<int64_t>((elements - at) / kCols, rows_per_launch);
    int64_t cols = kCols;
    if (rows == 0) {
      rows = 1;
      cols = elements - at;
    }
    const MatrixBatch in{src, at, from, 1, rows, cols};
    const MatrixBatch out{dst, at, to, 1, rows, cols};
    if (absl::Status s = Convert(queue, in, /*transpose=*/false, nullptr, scale, out); !s.ok()) {
      return s;
    }
    at += rows * cols;
  }
  return absl::OkStatus();
}

}  // namespace muond::server::device::level_zero
