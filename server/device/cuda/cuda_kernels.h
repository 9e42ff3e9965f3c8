// The backend's own kernels (cuda_kernels.cu): everything of the Muon update that is not a GEMM.
// Internal to server/device/cuda; plain C++ types only, so that the .cc files need no nvcc.
//
// Every function enqueues on `stream` and returns the launch error (cudaGetLastError), which the
// caller turns into a Status. Sizes are in elements; matrices are row-major and contiguous.
// Non-finite checks write `flag_code` into `*flag` (device memory) unless a code is already there.
#ifndef MUOND_SERVER_DEVICE_CUDA_CUDA_KERNELS_H_
#define MUOND_SERVER_DEVICE_CUDA_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "server/device/cuda/cuda_ns_plan.h"  // Elem, kMaxNormChunks

namespace muond::server::device::cuda {

// Muon steps 1 and 2 (DESIGN.md 3) for n elements, with the host's Lerp and rounding (no FMA):
//   m = lerp(momentum, grad, one_minus_beta); momentum = m; update = nesterov ? lerp(grad, m, beta)
//   : m
// `update` may alias `grad`.
cudaError_t LaunchMomentum(const float* grad, float* momentum, float* update, int64_t n,
                           float one_minus_beta, float beta, bool nesterov, cudaStream_t stream);

// Frobenius norms of `batch` blocks of `block_elems` fp32 values at x, in two passes: partial sums
// of squares (double) into partials[batch][chunks], then
//   denom[b] = float(sqrt(sum)) * k + eps   (fp32 arithmetic, as the host computes it).
// A non-finite sum (a NaN or Inf in the block) sets the flag. chunks in [1, kMaxNormChunks].
int NormChunks(int64_t block_elems);
cudaError_t LaunchNormPartials(const float* x, int64_t batch, int64_t block_elems, int chunks,
                               double* partials, cudaStream_t stream);
cudaError_t LaunchNormFinalize(const double* partials, int64_t batch, int chunks, float k,
                               float eps, float* denom, int* flag, int flag_code,
                               cudaStream_t stream);

// dst = convert(src[b] / divisor[b] * scale) for `batch` blocks of rows x cols, written as
// [cols, rows] blocks when `transpose`. divisor may be null (no division); the multiplication is
// skipped when scale == 1 (exact anyway). With a flag, a non-finite value (after scaling)
// sets it. fp32 -> bf16/fp16 rounds to nearest even (overflow to inf).
cudaError_t LaunchTransform(Elem in, const void* src, Elem out, void* dst, int64_t batch,
                            int64_t rows, int64_t cols, bool transpose, const float* divisor,
                            float scale, int* flag, int flag_code, cudaStream_t stream);

// dst[i] = convert(src[i] * scale) for n elements (also Stream::Convert: the direct path's
// widening of gradients, scaled in apply mode, and narrowing of updates, cuda_stream.cc). The
// product is one float32 rounding (none when scale is 1), as the host's.
cudaError_t LaunchConvert(Elem in, const void* src, Elem out, void* dst, int64_t n, float scale,
                          cudaStream_t stream);

// p[b][i][i] += a for `batch` m x m fp32 blocks (P = a I + B, the polynomial's constant term).
cudaError_t LaunchAddDiagonal(float* p, int64_t batch, int64_t m, float a, cudaStream_t stream);

// *out = value (the device probe at open).
cudaError_t LaunchProbe(int* out, int value, cudaStream_t stream);

}  // namespace muond::server::device::cuda

#endif  // MUOND_SERVER_DEVICE_CUDA_CUDA_KERNELS_H_
