// The Muon update of DESIGN.md section 3 on host (CPU) memory, computed with LibTorch.
//
// The room server/optim owns the optimizer math: matrix geometry and scales, the momentum EMA
// (ApplyMomentum, the one rounding every backend must match), the Newton-Schulz schedules
// (ns_schedule.h) and their host implementation (newton_schulz.h), and for apply mode the fused
// AdamW (adamw.h) and the global clipping norm (grad_norm.h). Pure functions over memory the
// caller owns; it calls only common/ and LibTorch (inside newton_schulz.cc alone). The devices
// (server/device) run the same schedules; jobs (server/jobs) call ApplyMomentum at commit.
//
// This header is free of LibTorch types so that the daemon's other files do not pay for its
// headers. All functions are thread-safe (they share no state beyond LibTorch's thread pool);
// they block until the result is written.
#ifndef MUOND_SERVER_OPTIM_MUON_MATH_H_
#define MUOND_SERVER_OPTIM_MUON_MATH_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "common/job_spec.h"

namespace muond::server {

// How a matrix is orthogonalized: `batch` independent blocks of rows x cols.
// 2-D [r, c] with H heads: batch H, rows r/H, cols c. 3-D [E, r, c]: batch E*H.
// 4-D [o, i, kh, kw]: viewed as [o, i*kh*kw]. Heads are contiguous row blocks.
struct MatrixGeometry {
  int64_t batch = 1;
  int64_t rows = 0;
  int64_t cols = 0;
};

// REQUIRES: spec passed common::ValidateJobSpec.
MatrixGeometry GeometryOf(const common::MatrixSpec& spec);

// Newton-Schulz FLOPs of one matrix as modelled for cost (per iteration 4 m^2 n + 2 m^3 per block,
// m <= n): the simulated device's clock and the attribution of device time to matrices.
double NewtonSchulzFlops(const common::MuonConfig& config, const common::MatrixSpec& spec);

// The scale s of DESIGN.md 3 step 4 for one block of rows x cols.
double MuonScale(common::ScaleMode mode, int64_t rows, int64_t cols);

// Orthogonalizes `x` in place: `geometry.batch` blocks of rows x cols fp32, row-major, contiguous.
// Computes in config.compute_dtype with config.ns_method and config.ns_steps; the result is fp32.
// Does not scale. INVALID_ARGUMENT if the result is not finite; INTERNAL if LibTorch fails.
absl::Status NewtonSchulz(const common::MuonConfig& config, MatrixGeometry geometry, float* x);

// One Muon step for one matrix (DESIGN.md 3 steps 1-4):
//   momentum <- lerp(momentum, grad, 1 - beta)
//   update   <- nesterov ? lerp(grad, momentum, beta) : momentum
//   update   <- NS(update) * scale
// grad, momentum and update are fp32 arrays of spec.numel() elements; momentum is updated in
// place, update is written. `update` may alias `grad`. On error momentum may have been written:
// callers that need atomicity pass a staged copy.
absl::Status MuonUpdate(const common::MuonConfig& config, const common::MatrixSpec& spec,
                        const float* grad, float* momentum, float* update);

// MuonUpdate of `count` matrices of one shape (equal shape and num_heads; INVALID_ARGUMENT
// otherwise) at once: one batched Newton-Schulz over the blocks of all of them. Bit-identical to
// MuonUpdate of each alone (every block is computed independently of the batch it is in).
// specs[k], grads[k], momenta[k], updates[k] as in MuonUpdate; updates[k] may alias grads[k].
// Every gradient is checked before any momentum is written; errors name the matrix.
absl::Status MuonUpdateSameShape(const common::MuonConfig& config, size_t count,
                                 const common::MatrixSpec* const* specs, const float* const* grads,
                                 float* const* momenta, float* const* updates);

// `count` same-shape matrices of MuonUpdateSameShape.
struct MuonGroup {
  size_t count = 0;
  const common::MatrixSpec* const* specs = nullptr;
  const float* const* grads = nullptr;
  float* const* momenta = nullptr;
  float* const* updates = nullptr;
  // When set, momenta_in[k] is the momentum read (it is never written) and momenta[k] receives
  // the new one; they may be the same buffer. Null: momenta[k] is updated in place.
  const float* const* momenta_in = nullptr;
  // Momentum held compressed (state_codec.h): when set, momenta and momenta_in are unused and
  // matrix k's committed momentum is held_in[k] (as held_dtype holds it), decoded block by block,
  // stepped, and the new one encoded into held_out[k] (which may be held_in[k]): fused, no fp32
  // copy of the momentum. Bit-identical to decoding the whole momentum, MuonUpdate, and encoding.
  const float* const* held_in = nullptr;
  float* const* held_out = nullptr;
  common::StateDType held_dtype = common::StateDType::kFloat32;
};

// MuonUpdateSameShape of every group, with the same bits, in one call: every gradient of every
// group is checked before any momentum is written, and the groups' Newton-Schulz runs as one
// (newton_schulz.h ScaledNewtonSchulzGroups: a step of many shapes shares the compute threads'
// barriers). Errors name the matrix.
absl::Status MuonUpdateGroups(const common::MuonConfig& config, const MuonGroup* groups,
                              size_t count);

// Step 1 alone: momentum[i] <- lerp(momentum[i], grad[i], 1 - beta) for n elements. Bit-identical
// to the momentum MuonUpdate writes for the same inputs (same formula, same rounding), so a step
// can compute its updates from a temporary momentum and commit the store later from the gradients.
void ApplyMomentum(const common::MuonConfig& config, const float* grad, float* momentum, size_t n);

// Sets LibTorch's intra-op thread count (the CPU backend's compute threads). n >= 1.
void SetMathThreads(int n);
int MathThreads();

}  // namespace muond::server

#endif  // MUOND_SERVER_OPTIM_MUON_MATH_H_
