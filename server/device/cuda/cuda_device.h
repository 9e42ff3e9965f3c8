// The CUDA device (internal to server/device/cuda; the rest of muond sees device.h's Device from
// OpenCudaDevice). One CudaDevice per GPU ordinal:
//  - device memory from a bounded caching pool (cuda_memory_pool.h), freed stream-ordered: a freed
//    buffer is reused only after an event recorded on every stream of the device has completed;
//  - host memory pinned with cudaHostRegister in chunks of at most 64 GiB; copies of registered
//    memory are one cudaMemcpyAsync per chunk, straight by DMA (the ranks' shared-memory regions
//    are registered at attach, so a step copies gradients and updates in place: DirectHostCopies);
//    copies from or to memory that is not registered go through a pinned bounce buffer of the
//    stream, so that every copy is asynchronous as the Stream contract says;
//  - streams (cuda_stream.cc) on cudaStreamNonBlocking streams, each with its own cuBLAS handle.
//
// Thread-safe. The device must outlive its buffers, streams and events.
#ifndef MUOND_SERVER_DEVICE_CUDA_CUDA_DEVICE_H_
#define MUOND_SERVER_DEVICE_CUDA_CUDA_DEVICE_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/device/cuda/cuda_memory_pool.h"
#include "server/device/device.h"

namespace muond::server::device::cuda {

// cudaHostRegister is asked for at most this much at once.
constexpr size_t kMaxRegisterChunk = size_t{64} << 30;

class CudaDevice final : public Device {
 public:
  // Opens GPU `ordinal`: UNAVAILABLE with a one-line reason when there is no driver, no such
  // device, or the device cannot run this build's kernels or cuBLAS.
  static absl::StatusOr<std::unique_ptr<CudaDevice>> Open(int ordinal);
  ~CudaDevice() override;

  std::string name() const override { return name_; }
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override;
  bool RegisterHost(void* data, size_t bytes) override;
  void UnregisterHost(void* data, size_t bytes) override;
  bool DirectHostCopies() const override { return true; }
  // cudaHostRegister (cudaHostRegisterDefault) chunk by chunk; on a failure the chunks done are
  // unregistered again and the Status names the call and the driver's reason.
  absl::Status RegisterHostRegion(void* data, size_t bytes) override;
  bool IsHostRegistered(const void* data, size_t bytes) const override;
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override;
  BusySeconds Busy() const override;
  void SetMemoryLimit(size_t bytes) override;

  // For streams and events.
  // Makes this device current on the calling thread (cudaSetDevice).
  absl::Status Activate() const;
  void AddStream(cudaStream_t stream);
  void RemoveStream(cudaStream_t stream);
  // A part of a host range for a copy: registered (pinned) or not.
  struct HostPiece {
    size_t offset;
    size_t bytes;
    bool pinned;
  };
  std::vector<HostPiece> SplitHostRange(const void* data, size_t bytes) const;
  // A pinned int for an event's copy of a stream's error flag (0 when handed out); nullptr when
  // pinned memory cannot be had.
  int* AcquireFlagSlot();
  void ReleaseFlagSlot(int* slot);
  // A finished run of one kind of work on a stream (0 copy in, 1 kernels, 2 writeback), between
  // two timing events; Busy() adds their elapsed time once both completed. Takes the events.
  void AddBusyRun(cudaEvent_t start, cudaEvent_t end, int kind);
  // Scratch bytes above which a Muon call splits same-shape matrices into several GEMM batches.
  size_t WorkspaceCap() const;
  const cudaDeviceProp& properties() const { return properties_; }

 protected:
  void Free(void* data, size_t size) override;

 private:
  CudaDevice(int ordinal, const cudaDeviceProp& properties, size_t default_limit);
  void CollectBusy() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int ordinal_;
  const std::string name_;
  const cudaDeviceProp properties_;
  const size_t default_limit_;
  CudaMemoryPool pool_;

  mutable absl::Mutex mu_;
  std::vector<cudaStream_t> streams_ ABSL_GUARDED_BY(mu_);
  std::map<const char*, size_t> registered_ ABSL_GUARDED_BY(mu_);  // chunk start -> bytes
  std::vector<int*> flag_pages_ ABSL_GUARDED_BY(mu_);
  std::vector<int*> free_slots_ ABSL_GUARDED_BY(mu_);
  struct BusyRun {
    cudaEvent_t start, end;
    int kind;
  };
  mutable std::vector<BusyRun> busy_runs_ ABSL_GUARDED_BY(mu_);
  mutable BusySeconds busy_ ABSL_GUARDED_BY(mu_);
};

// A stream of `device` (cuda_stream.cc).
absl::StatusOr<std::unique_ptr<Stream>> NewCudaStream(CudaDevice* device);

}  // namespace muond::server::device::cuda

#endif  // MUOND_SERVER_DEVICE_CUDA_CUDA_DEVICE_H_
