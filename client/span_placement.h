// Where a caller's spans lie in a rank's shared-memory buffers (internal to client/): the checks
// of span matrix indices and the placement of a span in the gradient layout (byte_offset, the
// gradient dtype) or, in apply mode, the parameter layout (param_byte_offset, the param_dtype).
// Pure functions; thread-safe.
#ifndef MUOND_CLIENT_SPAN_PLACEMENT_H_
#define MUOND_CLIENT_SPAN_PLACEMENT_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/shm_channel.h"
#include "common/dtype.h"
#include "common/job_spec.h"

namespace muond::client {

// Bulk data on gRPC travels in chunks of at most this many bytes (DESIGN.md 5).
inline constexpr size_t kChunkBytes = size_t{4} << 20;

// INVALID_ARGUMENT when a span names a matrix the job does not have (`what`: "gradient",
// "update", "parameter"); checked before any span is used as an index.
template <typename Span>
absl::Status CheckMatrixIndices(const std::vector<Span>& spans, const common::JobSpec& spec,
                                const char* what) {
  for (const Span& s : spans) {
    if (s.matrix >= spec.matrices.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " span: matrix index ", s.matrix, " out of range"));
    }
  }
  return absl::OkStatus();
}

// Which layout of the buffers a span is placed in.
enum class BufferLayout {
  kGradients,   // ShmSpan::byte_offset, the tensor's gradient dtype
  kParameters,  // ShmSpan::param_byte_offset, the tensor's param_dtype (apply mode)
};

// Where a caller's span lies in the rank's shared-memory buffer.
struct BufferPlace {
  size_t region = 0;       // index into ShmChannel::spans()
  size_t byte_offset = 0;  // of the span's first element
  size_t bytes = 0;
};

// The place of elements [offset, offset + length) of `matrix` in the rank's buffer, or
// INVALID_ARGUMENT naming the span (`what`: "gradient", "update", "parameter") when no region
// holds it whole. REQUIRES: matrix < spec.matrices.size().
inline absl::StatusOr<BufferPlace> PlaceInBuffer(const std::vector<ShmSpan>& regions,
                                                 const common::JobSpec& spec, uint32_t matrix,
                                                 uint64_t offset, uint64_t length, const char* what,
                                                 BufferLayout layout) {
  const common::MatrixSpec& ms = spec.matrices[matrix];
  const bool params = layout == BufferLayout::kParameters;
  const size_t esize = common::DTypeSize(params ? ms.param_dtype : ms.dtype);
  for (size_t i = 0; i < regions.size(); ++i) {
    const ShmSpan& r = regions[i];
    if (r.matrix == matrix && offset >= r.offset && offset - r.offset <= r.length &&
        length <= r.length - (offset - r.offset)) {
      const uint64_t start = params ? r.param_byte_offset : r.byte_offset;
      return BufferPlace{i, start + (offset - r.offset) * esize, length * esize};
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(what, " span of matrix ", matrix, " elements [",
                                                 offset, ", ", offset + length,
                                                 ") is outside the rank's shard"));
}

// The dtype a step returns for tensor `ms`: its param_dtype in apply mode (the new parameters),
// else its gradient dtype (the update).
inline common::DType OutputDType(const common::JobSpec& spec, const common::MatrixSpec& ms) {
  return spec.mode == common::JobMode::kApply ? ms.param_dtype : ms.dtype;
}

}  // namespace muond::client

#endif  // MUOND_CLIENT_SPAN_PLACEMENT_H_
