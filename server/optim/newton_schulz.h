// Internal to server/muon: the LibTorch side of the Muon math (newton_schulz.cc is the only file
// of the module that includes LibTorch headers). Use muon_math.h from outside the module.
//
// Thread-safe: no shared state beyond LibTorch's thread pool; calls block until done.
#ifndef MUOND_SERVER_OPTIM_NEWTON_SCHULZ_H_
#define MUOND_SERVER_OPTIM_NEWTON_SCHULZ_H_

#include "absl/status/status.h"
#include "common/job_spec.h"
#include "server/optim/muon_math.h"

namespace muond::server::internal {

// The most scratch one ScaledNewtonSchulzGroups call holds (a matrix that needs more is computed
// alone): the calling thread keeps its scratch between calls (ns_batched_math.h), so this, not the
// batch, bounds it. 64 MiB: one 2048 x 2048 matrix in fp32, or 64 of 256 x 256.
inline constexpr uint64_t kNewtonSchulzScratchBytes = uint64_t{64} << 20;

// Scratch one matrix of `geometry` needs at most (fp32 storage): X and the next X ([b, m, n]),
// and A and P ([b, m, m]).
uint64_t ScratchPerMatrix(const MatrixGeometry& geometry);

// Bytes of Newton-Schulz scratch the compute threads keep between calls (each thread its largest
// batch so far, all jobs together; ns_batched_math.h's ScratchTensor).
uint64_t NewtonSchulzScratchBytes();

// NewtonSchulz of muon_math.h followed by `x *= scale` (fused into the write-back of the result,
// so the caller's buffer is not swept twice). REQUIRES: geometry dims >= 1, x holds
// batch*rows*cols floats. INVALID_ARGUMENT if the result is not finite; INTERNAL naming the
// LibTorch op that failed.
absl::Status ScaledNewtonSchulz(const common::MuonConfig& config, MatrixGeometry geometry,
                                double scale, float* x);

// The same on `count` separate buffers xs[k] of one geometry, as one batch of count *
// geometry.batch blocks (no copy of them into one buffer; each block's bits are those of a call
// on it alone). A non-finite result is reported for the whole batch; the caller names the matrix.
absl::Status ScaledNewtonSchulzMany(const common::MuonConfig& config, MatrixGeometry geometry,
                                    size_t count, double scale, float* const* xs);

// One same-shape batch of ScaledNewtonSchulzGroups: `count` buffers xs[k] of `geometry`.
struct NsGroup {
  MatrixGeometry geometry;
  size_t count = 0;
  double scale = 1.0;
  float* const* xs = nullptr;
};

// ScaledNewtonSchulzMany of each group, with the same bits. When every iteration is a plain bf16
// one (compute bf16, no fp32 iterations, not gram) the groups iterate in step: each phase of an
// iteration is one pool of the tasks of all groups (ns_tasks.h), so a step of many shapes pays
// three barriers per iteration, not three per shape, and the team stays busy across shapes; their
// scratch is held at once. On error *failed is the group it concerns, or kNoGroup when the error is
// not one group's (a product failed).
inline constexpr size_t kNoGroup = ~size_t{0};
absl::Status ScaledNewtonSchulzGroups(const common::MuonConfig& config, const NsGroup* groups,
                                      size_t count, size_t* failed);

}  // namespace muond::server::internal

#endif  // MUOND_SERVER_OPTIM_NEWTON_SCHULZ_H_
