// The Muon update (DESIGN.md 3) as a sequence of muon_kernels.cl launches on a KernelQueue: the
// host-side driver of the Level Zero backend, written against KernelQueue so that the tests run
// the very same sequence on OpenCL (PoCL on the CPU).
//
// It follows the host math of server/muon (newton_schulz.cc) operation for operation, including
// where values are rounded to the compute dtype: fp32; fp16 with every op's result rounded to fp16
// (fp32 accumulation); bf16 with the host's precision plan (the first two iterations in fp32, the
// m x m polynomial in fp32 for small or wide blocks, the gram method's m x m side in fp32). The
// results are not bit-identical to the host's (different summation order) but meet DESIGN.md 3's
// bounds against it; the momentum is bit-identical (same formula, no contraction).
//
// Calls block: they end by reading the non-finite flags back. Not thread-safe per queue.
#ifndef MUOND_SERVER_DEVICE_LEVEL_ZERO_MUON_KERNEL_DRIVER_H_
#define MUOND_SERVER_DEVICE_LEVEL_ZERO_MUON_KERNEL_DRIVER_H_

#include <vector>

#include "absl/status/status.h"
#include "common/job_spec.h"
#include "server/device/level_zero/kernel_queue.h"
#include "server/optim/muon_math.h"

namespace muond::server::device::level_zero {

// One matrix: its gradient (fp32, spec.numel() elements; overwritten with the update) and its
// momentum (fp32, read as M and written with M'), both device buffers of `queue`.
struct KernelMuonItem {
  const common::MatrixSpec* spec = nullptr;
  KernelBufferRef grad_update;
  KernelBufferRef momentum;
};

// MuonUpdate (server/optim/muon_math.h) of every item, with update aliasing grad. Errors:
// INVALID_ARGUMENT for a spec that is not a Muon matrix or a bad config, or when a gradient holds a
// non-finite value (checked for all items before any momentum is written: then nothing is
// written), or when a result is not finite (momenta and updates then hold the partial step); a
// queue error otherwise. The message names the matrix.
absl::Status RunMuon(KernelQueue& queue, const common::MuonConfig& config,
                     const std::vector<KernelMuonItem>& items);

// ScaledNewtonSchulz of server/muon: orthogonalizes x (fp32, geometry.batch blocks of rows x
// cols) in place and multiplies it by `scale`; does not check the result for non-finite values.
// Blocks only to allocate scratch memory, which is released when the call returns (see
// QueueBuffer). INVALID_ARGUMENT for a bad geometry or ns_steps.
absl::Status RunNewtonSchulz(KernelQueue& queue, const common::MuonConfig& config,
                             MatrixGeometry geometry, double scale, KernelBufferRef x);

}  // namespace muond::server::device::level_zero

#endif  // MUOND_SERVER_DEVICE_LEVEL_ZERO_MUON_KERNEL_DRIVER_H_
