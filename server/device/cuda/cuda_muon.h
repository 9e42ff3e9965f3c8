// The Muon update (DESIGN.md 3) enqueued on a CUDA stream: momentum and Nesterov in one kernel,
// Newton-Schulz with cuBLAS GEMMs (strided-batched over the blocks of a matrix and over the
// same-shape matrices of one call) and the kernels of cuda_kernels.h. Internal to
// server/device/cuda; called by CudaStream::Muon with the stream's lock held.
//
// The math follows the host's newton_schulz.cc step by step, including its bf16 precision plan
// (iterations 0-1 in fp32, the m x m polynomial in fp32 for small or wide blocks, gram's fp32
// m x m side and restart) and fp16 with fp32 accumulation and one rounding per op, so that the
// device meets the same accuracy bounds against float64 and stays close to the cpu backend.
#ifndef MUOND_SERVER_DEVICE_CUDA_CUDA_MUON_H_
#define MUOND_SERVER_DEVICE_CUDA_CUDA_MUON_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "server/device/device.h"

namespace muond::server::device::cuda {

// Codes a kernel writes into a stream's error flag: the item's sequence number since the stream's
// last event (which names the matrix) and the kind of failure.
enum FlagKind : int { kInputNotFinite = 1, kResultNotFinite = 2 };
inline int FlagCode(size_t seq, FlagKind kind) { return static_cast<int>((seq + 1) << 2) | kind; }
inline size_t FlagSeq(int code) { return static_cast<size_t>(code >> 2) - 1; }
inline FlagKind FlagKindOf(int code) { return static_cast<FlagKind>(code & 3); }

struct MuonLaunch {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;  // bound to `stream`
  int* flag = nullptr;            // device int: the stream's error flag
  size_t first_seq = 0;           // sequence number of items[0] (FlagCode)
  // Workspace from the device's pool; freed (stream-ordered) when the returned buffer dies.
  std::function<absl::StatusOr<DeviceBuffer>(size_t bytes)> allocate;
  // Workspace bytes above which the blocks of one shape are split into several GEMM batches.
  size_t workspace_cap = size_t{1} << 30;
};

// INVALID_ARGUMENT naming the matrix when an item is not a Muon matrix (GeometryOf) or its
// buffers are missing or smaller than numel() floats; or when config.ns_steps < 1.
absl::Status ValidateMuonItems(const common::MuonConfig& config,
                               const std::vector<MuonKernelItem>& items);

// Enqueues the update of every item. Returns the first CUDA/cuBLAS error of the enqueue (the
// work enqueued before it stays enqueued). Non-finite inputs or results are reported through the
// flag. REQUIRES: ValidateMuonItems passed.
absl::Status EnqueueMuon(const MuonLaunch& launch, const common::MuonConfig& config,
                         const std::vector<MuonKernelItem>& items);

}  // namespace muond::server::device::cuda

#endif  // MUOND_SERVER_DEVICE_CUDA_CUDA_MUON_H_
