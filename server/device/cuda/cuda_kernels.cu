// The backend's own kernels (see cuda_kernels.h). Memory-bound elementwise work next to the
// GEMMs: grid-stride loops over int64 indices, 256 threads per block, and a shared-memory tile for
// the transposing copies so that reads and writes are both coalesced.
//
// Rounding: no fast-math; the momentum uses __fadd_rn/__fmul_rn/__fsub_rn (never contracted into
// an FMA) so that it is bit-identical to the host's ApplyMomentum (muon_math.cc, built with
// -ffp-contract=off); divisions are __fdiv_rn, as the host's IEEE division.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "server/device/cuda/cuda_kernels.h"

namespace muond::server::device::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 32;
constexpr int kTileRows = 8;
constexpr int64_t kMaxBlocks = 65535;

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}

__device__ __forceinline__ void SetFlag(int* flag, int code) {
  if (flag != nullptr) atomicCAS(flag, 0, code);
}

// torch.lerp's formula as muon_math.cc evaluates it, operation by operation.
__device__ __forceinline__ float Lerp(float start, float end, float weight) {
  return fabsf(weight) < 0.5f ? __fadd_rn(start, __fmul_rn(weight, __fsub_rn(end, start)))
                              : __fsub_rn(end, __fmul_rn(__fsub_rn(end, start),
                                                         __fsub_rn(1.0f, weight)));
}

unsigned GridFor(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 4 * kMaxBlocks ? 4 * kMaxBlocks : blocks));
}

__global__ void MomentumKernel(const float* grad, float* momentum, float* update, int64_t n,
                               float one_minus_beta, float beta, bool nesterov) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = grad[i];
    const float m = Lerp(momentum[i], g, one_minus_beta);
    momentum[i] = m;
    update[i] = nesterov ? Lerp(g, m, beta) : m;
  }
}

__global__ void NormPartialsKernel(const float* x, int64_t batch, int64_t block_elems, int chunks,
                                   double* partials) {
  __shared__ double sums[kThreads];
  const int64_t per_chunk = (block_elems + chunks - 1) / chunks;
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    const float* block = x + b * block_elems;
    const int64_t begin = blockIdx.x * per_chunk;
    const int64_t end = begin + per_chunk < block_elems ? begin + per_chunk : block_elems;
    double acc = 0;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const double v = block[i];
      acc += v * v;
    }
    sums[threadIdx.x] = acc;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s /= 2) {
      if (threadIdx.x < s) sums[threadIdx.x] += sums[threadIdx.x + s];
      __syncthreads();
    }
    if (threadIdx.x == 0) partials[b * chunks + blockIdx.x] = sums[0];
    __syncthreads();
  }
}

__global__ void NormFinalizeKernel(const double* partials, int64_t batch, int chunks, float k,
                                   float eps, float* denom, int* flag, int flag_code) {
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < batch;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double sum = 0;
    for (int c = 0; c < chunks; ++c) sum += partials[b * chunks + c];
    if (!isfinite(sum)) SetFlag(flag, flag_code);
    const float norm = static_cast<float>(sqrt(sum));
    denom[b] = __fadd_rn(__fmul_rn(norm, k), eps);
  }
}

template <typename In>
__device__ __forceinline__ float Transformed(In v, const float* divisor, int64_t b, float scale) {
  float f = ToFloat(v);
  if (divisor != nullptr) f = __fdiv_rn(f, divisor[b]);
  if (scale != 1.0f) f = __fmul_rn(f, scale);
  return f;
}

template <typename In, typename Out>
__global__ void TransformKernel(const In* src, Out* dst, int64_t batch, int64_t block_elems,
                                const float* divisor, float scale, int* flag, int flag_code) {
  const int64_t n = batch * block_elems;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float f = Transformed(src[i], divisor, i / block_elems, scale);
    if (flag != nullptr && !isfinite(f)) SetFlag(flag, flag_code);
    dst[i] = FromFloat<Out>(f);
  }
}

// Block [rows, cols] of src -> block [cols, rows] of dst, through a padded 32 x 33 tile.
template <typename In, typename Out>
__global__ void TransposeKernel(const In* src, Out* dst, int64_t batch, int64_t rows, int64_t cols,
                                const float* divisor, float scale, int* flag, int flag_code) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t tiles_y = (rows + kTile - 1) / kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    const In* from = src + b * rows * cols;
    Out* to = dst + b * rows * cols;
    for (int64_t ty = blockIdx.y; ty < tiles_y; ty += gridDim.y) {
      const int64_t r0 = ty * kTile;
      for (int j = threadIdx.y; j < kTile; j += kTileRows) {
        const int64_t r = r0 + j;
        const int64_t c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[j][threadIdx.x] = Transformed(from[r * cols + c], divisor, b, scale);
      }
      __syncthreads();
      for (int j = threadIdx.y; j < kTile; j += kTileRows) {
        const int64_t c = c0 + j;              // row of dst
        const int64_t r = r0 + threadIdx.x;    // column of dst
        if (r < rows && c < cols) {
          const float f = tile[threadIdx.x][j];
          if (flag != nullptr && !isfinite(f)) SetFlag(flag, flag_code);
          to[c * rows + r] = FromFloat<Out>(f);
        }
      }
      __syncthreads();
    }
  }
}

template <typename In, typename Out>
cudaError_t Transform(const void* src, void* dst, int64_t batch, int64_t rows, int64_t cols,
                      bool transpose, const float* divisor, float scale, int* flag, int flag_code,
                      cudaStream_t stream) {
  const In* from = static_cast<const In*>(src);
  Out* to = static_cast<Out*>(dst);
  if (!transpose) {
    TransformKernel<In, Out><<<GridFor(batch * rows * cols), kThreads, 0, stream>>>(
        from, to, batch, rows * cols, divisor, scale, flag, flag_code);
  } else {
    const int64_t tiles_x = (cols + kTile - 1) / kTile;
    const int64_t tiles_y = (rows + kTile - 1) / kTile;
    if (tiles_x > 0x7fffffff) return cudaErrorInvalidValue;
    const dim3 grid(static_cast<unsigned>(tiles_x),
                    static_cast<unsigned>(tiles_y < kMaxBlocks ? tiles_y : kMaxBlocks),
                    static_cast<unsigned>(batch < kMaxBlocks ? batch : kMaxBlocks));
    TransposeKernel<In, Out><<<grid, dim3(kTile, kTileRows), 0, stream>>>(
        from, to, batch, rows, cols, divisor, scale, flag, flag_code);
  }
  return cudaGetLastError();
}

template <typename In, typename Out>
__global__ void ConvertKernel(const In* src, Out* dst, int64_t n, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = FromFloat<Out>(__fmul_rn(ToFloat(src[i]), scale));
  }
}

template <typename In, typename Out>
cudaError_t Convert(const void* src, void* dst, int64_t n, float scale, cudaStream_t stream) {
  ConvertKernel<In, Out><<<GridFor(n), kThreads, 0, stream>>>(static_cast<const In*>(src),
                                                               static_cast<Out*>(dst), n, scale);
  return cudaGetLastError();
}

__global__ void AddDiagonalKernel(float* p, int64_t batch, int64_t m, float a) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < batch * m;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / m;
    const int64_t d = i % m;
    float* at = p + b * m * m + d * m + d;
    *at = __fadd_rn(*at, a);
  }
}

__global__ void ProbeKernel(int* out, int value) { *out = value; }

}  // namespace

cudaError_t LaunchMomentum(const float* grad, float* momentum, float* update, int64_t n,
                           float one_minus_beta, float beta, bool nesterov, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  MomentumKernel<<<GridFor(n), kThreads, 0, stream>>>(grad, momentum, update, n, one_minus_beta,
                                                      beta, nesterov);
  return cudaGetLastError();
}

int NormChunks(int64_t block_elems) {
  const int64_t chunks = block_elems / (kThreads * 16);
  return static_cast<int>(chunks < 1 ? 1 : (chunks > kMaxNormChunks ? kMaxNormChunks : chunks));
}

cudaError_t LaunchNormPartials(const float* x, int64_t batch, int64_t block_elems, int chunks,
                               double* partials, cudaStream_t stream) {
  if (chunks < 1 || chunks > kMaxNormChunks || batch < 1) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(chunks),
                  static_cast<unsigned>(batch < kMaxBlocks ? batch : kMaxBlocks));
  NormPartialsKernel<<<grid, kThreads, 0, stream>>>(x, batch, block_elems, chunks, partials);
  return cudaGetLastError();
}

cudaError_t LaunchNormFinalize(const double* partials, int64_t batch, int chunks, float k,
                               float eps, float* denom, int* flag, int flag_code,
                               cudaStream_t stream) {
  NormFinalizeKernel<<<GridFor(batch), kThreads, 0, stream>>>(partials, batch, chunks, k, eps,
                                                              denom, flag, flag_code);
  return cudaGetLastError();
}

cudaError_t LaunchTransform(Elem in, const void* src, Elem out, void* dst, int64_t batch,
                            int64_t rows, int64_t cols, bool transpose, const float* divisor,
                            float scale, int* flag, int flag_code, cudaStream_t stream) {
  if (batch < 1 || rows < 1 || cols < 1) return cudaErrorInvalidValue;
#define MUOND_TRANSFORM(I, O) \
  Transform<I, O>(src, dst, batch, rows, cols, transpose, divisor, scale, flag, flag_code, stream)
  if (in == Elem::kF32) {
    switch (out) {
      case Elem::kF32:
        return MUOND_TRANSFORM(float, float);
      case Elem::kBf16:
        return MUOND_TRANSFORM(float, __nv_bfloat16);
      case Elem::kF16:
        return MUOND_TRANSFORM(float, __half);
    }
  } else if (out == Elem::kF32) {
    return in == Elem::kBf16 ? MUOND_TRANSFORM(__nv_bfloat16, float)
                             : MUOND_TRANSFORM(__half, float);
  }
#undef MUOND_TRANSFORM
  return cudaErrorInvalidValue;  // 16-bit to 16-bit is not used
}

cudaError_t LaunchConvert(Elem in, const void* src, Elem out, void* dst, int64_t n, float scale,
                          cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (in == Elem::kF32) {
    switch (out) {
      case Elem::kF32:
        if (scale == 1.0f) {
          return cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, stream);
        }
        return Convert<float, float>(src, dst, n, scale, stream);
      case Elem::kBf16:
        return Convert<float, __nv_bfloat16>(src, dst, n, scale, stream);
      case Elem::kF16:
        return Convert<float, __half>(src, dst, n, scale, stream);
    }
  } else if (out == Elem::kF32) {
    return in == Elem::kBf16 ? Convert<__nv_bfloat16, float>(src, dst, n, scale, stream)
                             : Convert<__half, float>(src, dst, n, scale, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchAddDiagonal(float* p, int64_t batch, int64_t m, float a, cudaStream_t stream) {
  AddDiagonalKernel<<<GridFor(batch * m), kThreads, 0, stream>>>(p, batch, m, a);
  return cudaGetLastError();
}

cudaError_t LaunchProbe(int* out, int value, cudaStream_t stream) {
  ProbeKernel<<<1, 1, 0, stream>>>(out, value);
  return cudaGetLastError();
}

}  // namespace muond::server::device::cuda
