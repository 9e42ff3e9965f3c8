// CUDA and cuBLAS return codes as absl::Status (internal to server/device/cuda).
//
// Every cudart and cuBLAS call of the backend goes through MUOND_CUDA_RETURN_IF_ERROR /
// MUOND_CUBLAS_RETURN_IF_ERROR (or CudaStatus/CublasStatus), so that a failure becomes a Status that
// names the call ("cudaMemcpyAsync: an illegal memory access was encountered"), never an abort.
// Out-of-memory codes map to RESOURCE_EXHAUSTED, everything else to INTERNAL. Thread-safe.
#ifndef MUOND_SERVER_DEVICE_CUDA_CUDA_STATUS_H_
#define MUOND_SERVER_DEVICE_CUDA_CUDA_STATUS_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"

namespace muond::server::device::cuda {

// OK for cudaSuccess; otherwise a Status naming `call` (an expression: the text before its first
// '(' is used). Clears the runtime's last-error slot for non-sticky errors.
absl::Status CudaStatus(cudaError_t error, const char* call);
absl::Status CublasStatus(cublasStatus_t status, const char* call);

// The name of a cuBLAS status ("CUBLAS_STATUS_NOT_INITIALIZED").
const char* CublasStatusName(cublasStatus_t status);

}  // namespace muond::server::device::cuda

#define MUOND_CUDA_RETURN_IF_ERROR(call)                                                  \
  do {                                                                                    \
    absl::Status muond_cuda_status_ = ::muond::server::device::cuda::CudaStatus(call, #call); \
    if (!muond_cuda_status_.ok()) return muond_cuda_status_;                              \
  } while (0)

#define MUOND_CUBLAS_RETURN_IF_ERROR(call)                                                    \
  do {                                                                                        \
    absl::Status muond_cublas_status_ = ::muond::server::device::cuda::CublasStatus(call, #call); \
    if (!muond_cublas_status_.ok()) return muond_cublas_status_;                              \
  } while (0)

#endif  // MUOND_SERVER_DEVICE_CUDA_CUDA_STATUS_H_
