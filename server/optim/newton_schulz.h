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

// NewtonSchulz of muon_math.h followed by `x *= scale` (fused into the write-back of the result,
// so the caller's buffer is not swept twice). REQUIRES: geometry dims >= 1, x holds
// batch*rows*cols floats. INVALID_ARGUMENT if the result is not finite; INTERNAL naming the
// LibTorch op that failed.
absl::Status ScaledNewtonSchulz(const common::MuonConfig& config, MatrixGeometry geometry,
                                double scale, float* x);

}  // namespace muond::server::internal

#endif  // MUOND_SERVER_OPTIM_NEWTON_SCHULZ_H_
