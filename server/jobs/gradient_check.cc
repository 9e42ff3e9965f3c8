#include "server/jobs/gradient_check.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/dtype.h"
#include "common/parallel_for.h"
#include "server/engine/step_state.h"

namespace muond::server {
namespace {

constexpr char kNonFinitePayload[] = "type.muond/nonfinite-gradient";

absl::Status NonFinite(const std::string& where, const common::MatrixSpec& ms, uint64_t element) {
  absl::Status s = absl::InvalidArgumentError(
      absl::StrCat(where, ": matrix '", ms.name, "' has a non-finite gradient value at element ",
                   element, "; the step is refused for every rank and the momentum is unchanged"));
  s.SetPayload(kNonFinitePayload, absl::Cord("1"));
  return s;
}

}  // namespace

bool IsNonFiniteGradient(const absl::Status& status) {
  return status.GetPayload(kNonFinitePayload).has_value();
}

absl::Status CheckOutsideSumSq(const std::string& where, double sum_sq) {
  if (std::isnan(sum_sq) || std::isinf(sum_sq)) {
    // The trainer's own tensors hold a non-finite gradient: the step's norm is not finite, the
    // non-finite rule's case ("nonfinite": "skip" skips the step).
    absl::Status s = absl::InvalidArgumentError(absl::StrCat(
        where, ": the sum of squares of the rank's gradients outside the job (the tensors the "
               "trainer updates itself, max_grad_norm's share) is ",
        sum_sq, ", a non-finite gradient; the step is refused for every rank and the momentum "
                "is unchanged"));
    s.SetPayload(kNonFinitePayload, absl::Cord("1"));
    return s;
  }
  if (sum_sq < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": the sum of squares of the rank's gradients outside the job is ", sum_sq,
        "; a sum of squares is >= 0 (the step is refused for every rank, nothing changed)"));
  }
  return absl::OkStatus();
}

absl::Status CheckFiniteChunk(const std::string& where, const common::MatrixSpec& ms,
                              uint64_t first, const char* data, uint64_t count) {
  const int64_t at = common::FindNonFiniteRaw(ms.dtype, data, count);
  if (at < 0) return absl::OkStatus();
  return NonFinite(where, ms, first + static_cast<uint64_t>(at));
}

absl::Status CheckFiniteSpans(const std::string& where, const common::JobSpec& spec,
                              const std::vector<common::ShardSpan>& spans,
                              const std::vector<const char*>& in) {
  // Slices of 1M elements over the CPUs, then the first bad element reported.
  struct Slice {
    size_t span;
    uint64_t first;
    uint64_t count;
  };
  constexpr uint64_t kSlice = uint64_t{1} << 20;
  std::vector<Slice> slices;
  size_t total = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    for (uint64_t at = 0; at < spans[i].length; at += kSlice) {
      slices.push_back({i, at, std::min(kSlice, spans[i].length - at)});
    }
    total += spans[i].length * common::DTypeSize(spec.matrices[spans[i].matrix].dtype);
  }
  std::vector<int64_t> found(slices.size(), -1);
  common::ParallelFor(slices.size(), total, [&](size_t k) {
    const Slice& sl = slices[k];
    const common::DType dtype = spec.matrices[spans[sl.span].matrix].dtype;
    found[k] = common::FindNonFiniteRaw(dtype, in[sl.span] + sl.first * common::DTypeSize(dtype),
                                        sl.count);
  });
  for (size_t k = 0; k < slices.size(); ++k) {
    if (found[k] < 0) continue;
    const common::ShardSpan& span = spans[slices[k].span];
    return NonFinite(where, spec.matrices[span.matrix],
                     span.offset + slices[k].first + static_cast<uint64_t>(found[k]));
  }
  return absl::OkStatus();
}

absl::Status CheckGradientChunk(const std::string& where, const common::JobSpec& spec,
                                const JobLayout& layout, int rank, uint32_t matrix, uint64_t offset,
                                std::string_view data, uint32_t crc32c, size_t* span,
                                uint64_t* count_out) {
  if (matrix >= spec.matrices.size()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": matrix index ", matrix,
                                                   " out of range (the job has ",
                                                   spec.matrices.size(), " matrices)"));
  }
  const common::MatrixSpec& ms = spec.matrices[matrix];
  const size_t esize = common::DTypeSize(ms.dtype);
  const uint64_t count = data.size() / esize;
  if (data.empty() || data.size() > kMaxChunkBytes || data.size() % esize != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": matrix '", ms.name, "' chunk at element ", offset, " has ",
                     data.size(), " bytes; expected a non-empty multiple of ", esize, " (",
                     std::string(common::DTypeName(ms.dtype)), ") of at most ", kMaxChunkBytes,
                     " (truncated chunk?)"));
  }
  if (common::Crc32c(data.data(), data.size()) != crc32c) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": matrix '", ms.name, "' chunk at element ", offset,
                     ": CRC32C mismatch (corrupt or truncated chunk)"));
  }
  const std::optional<size_t> found = layout.FindSpan(rank, matrix, offset, count);
  if (!found) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": matrix '", ms.name, "' elements [", offset, ", ", offset + count,
                     ") are outside the rank's shard of the matrix (", ms.numel(), " elements)"));
  }
  *span = *found;
  *count_out = count;
  return CheckFiniteChunk(where, ms, offset, data.data(), count);
}

}  // namespace muond::server
