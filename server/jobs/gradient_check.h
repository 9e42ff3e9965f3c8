// The one rule for gradient values (DESIGN.md 4): a non-finite value refuses the step for every
// rank (or, with "nonfinite": "skip", skips it: IsNonFiniteGradient), and the error names the
// job, step, rank, matrix and element. Every data path checks
// through here: gRPC chunks (CheckGradientChunk, then CheckFiniteChunk) and shared-memory
// submissions (CheckFiniteSpans, over the CPUs). The device checks what it computes from again
// (a value a peer changed after its check never passes); the commit reads no gradient.
#ifndef MUOND_SERVER_JOBS_GRADIENT_CHECK_H_
#define MUOND_SERVER_JOBS_GRADIENT_CHECK_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "server/engine/job_layout.h"

namespace muond::server {

// `where` names the job, step and rank ("job 'x' step 3 rank 1").
// `count` elements of `ms`'s dtype at `data`, the first being element `first` of the matrix.
absl::Status CheckFiniteChunk(const std::string& where, const common::MatrixSpec& ms,
                              uint64_t first, const char* data, uint64_t count);
// A rank's whole submission: in[i] holds spans[i] (the matrix dtype). Scanned in slices over the
// CPUs; the error names the first bad element in span order.
absl::Status CheckFiniteSpans(const std::string& where, const common::JobSpec& spec,
                              const std::vector<common::ShardSpan>& spans,
                              const std::vector<const char*>& in);
// The checks of one gRPC gradient chunk of `rank` that need no lock (the job's spec and layout
// are immutable): the matrix index, a non-empty whole number of elements of at most
// kMaxChunkBytes, the CRC32C, one of the rank's spans holding it whole, and finite values. On OK
// *span is the index of that span in layout.spans(rank) and *count the chunk's elements.
// INVALID_ARGUMENT naming the job, step, rank, matrix and element otherwise.
absl::Status CheckGradientChunk(const std::string& where, const common::JobSpec& spec,
                                const JobLayout& layout, int rank, uint32_t matrix, uint64_t offset,
                                std::string_view data, uint32_t crc32c, size_t* span,
                                uint64_t* count);
// True for the error of the checks above about a non-finite gradient value (the others: malformed
// input), which a job with "nonfinite": "skip" turns into a skipped step.
bool IsNonFiniteGradient(const absl::Status& status);
// Update mode with max_grad_norm: a rank's sum of squares of its gradients outside the job (the
// tensors the trainer updates in-process), which the step's norm adds to the job's. Non-finite:
// refused as a non-finite gradient (IsNonFiniteGradient; "skip" skips the step); negative:
// INVALID_ARGUMENT. `where` names the job, step and rank.
absl::Status CheckOutsideSumSq(const std::string& where, double sum_sq);

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_GRADIENT_CHECK_H_
