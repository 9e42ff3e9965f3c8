// Typed launchers of the kernels in kernels/muon_kernels.cl: one function per kernel that checks
// its shapes, builds the argument list in the kernel's order and picks the launch size. The Muon
// driver (muon_kernel_driver.cc) and the kernel tests call these, so both exercise the same
// argument lists. Each function enqueues on `queue` and returns at once (KernelQueue::Launch).
#ifndef MUOND_SERVER_DEVICE_LEVEL_ZERO_MUON_KERNELS_H_
#define MUOND_SERVER_DEVICE_LEVEL_ZERO_MUON_KERNELS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "server/device/level_zero/kernel_queue.h"

namespace muond::server::device::level_zero {

// The storage dtype codes of the kernels (DTYPE_* in muon_kernels.cl).
int32_t KernelDType(common::DType dtype);
// Bytes per element of a storage dtype.
int64_t DTypeBytes(common::DType dtype);

// A batch of `batch` row-major rows x cols matrices, contiguous, at element `offset` of `buffer`.
struct MatrixBatch {
  KernelBufferRef buffer;
  int64_t offset = 0;
  common::DType dtype = common::DType::kFloat32;
  int64_t batch = 1;
  int64_t rows = 0;
  int64_t cols = 0;
};

// out = alpha * op(a) op(b) + beta * c + diag * I for each matrix of the batch, fp32
// accumulation, rounded once to out.dtype; op(x) = x^T when *_trans. `c` is read only when
// beta != 0 and may then be null. INVALID_ARGUMENT when the shapes do not match or out aliases
// an input buffer.
absl::Status Gemm(KernelQueue& queue, const MatrixBatch& a, bool a_trans, const MatrixBatch& b,
                  bool b_trans, const MatrixBatch* c, float alpha, float beta, float diag,
                  const MatrixBatch& out);

// out = f(src) or f(src^T) per matrix (transpose: src is cols x rows of out), cast to out.dtype,
// f(v) = (denom ? v / denom[z] : v) * factor, with denom an fp32 array of out.batch values.
absl::Status Convert(KernelQueue& queue, const MatrixBatch& src, bool transpose,
                     const KernelBufferRef* denom, float factor, const MatrixBatch& out);

// Partial sums needed by FrobeniusDenominator for blocks of `block_len` elements.
int32_t NormParts(int64_t block_len);

// denom[z] = ||x[z]||_F * k + eps for each matrix (DESIGN.md 3's normalization), through
// `partial` (scratch of batch * NormParts(rows * cols) floats).
absl::Status FrobeniusDenominator(KernelQueue& queue, const MatrixBatch& x, float k, float eps,
                                  KernelBufferRef partial, KernelBufferRef denom);

// flags[flag] |= 1 when any of the n fp32 values at element `offset` of `x` is not finite.
absl::Status FlagNonFinite(KernelQueue& queue, KernelBufferRef x, int64_t offset, int64_t n,
                           KernelBufferRef flags, int32_t flag);

// p[0 .. n) = value (int32).
absl::Status FillInt(KernelQueue& queue, KernelBufferRef p, int64_t n, int32_t value);

// DESIGN.md 3 steps 1-2 on n fp32 elements: momentum <- lerp(momentum, grad, 1 - beta); grad is
// overwritten with the update (nesterov ? lerp(grad, momentum', beta) : momentum'). The weights
// are passed as the host computes them (float(1 - beta), float(beta)).
absl::Status MuonMomentum(KernelQueue& queue, KernelBufferRef grad_update, KernelBufferRef momentum,
                          int64_t n, float one_minus_beta, float beta, bool nesterov);

}  // namespace muond::server::device::level_zero

#endif  // MUOND_SERVER_DEVICE_LEVEL_ZERO_MUON_KERNELS_H_
