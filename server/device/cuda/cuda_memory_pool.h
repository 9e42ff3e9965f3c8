// A caching pool of device memory with a bounded total (internal to server/device/cuda).
//
// cudaMalloc/cudaFree are slow and cudaFree synchronizes the whole device, while the step pipeline
// allocates and frees the same sizes every step; so freed blocks are kept and reused. A block is
// released together with CUDA events recorded on every stream of the device after the work that
// may still use it; it is reused only once they completed (stream-ordered reuse without
// synchronizing anything). Everything the pool holds (in use, cached, pending) counts against its
// limit; above it, cached blocks are returned to the driver first, then pending ones are waited
// for, then Allocate fails with RESOURCE_EXHAUSTED.
//
// Thread-safe. REQUIRES: the device is current (cudaSetDevice) on the calling thread.
#ifndef MUOND_SERVER_DEVICE_CUDA_CUDA_MEMORY_POOL_H_
#define MUOND_SERVER_DEVICE_CUDA_CUDA_MEMORY_POOL_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <deque>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace muond::server::device::cuda {

class CudaMemoryPool {
 public:
  CudaMemoryPool(std::string device_name, size_t limit_bytes);
  // Frees every block. REQUIRES: no block in use, the device idle.
  ~CudaMemoryPool();

  // A block of at least `bytes` (256-byte aligned). Blocks. RESOURCE_EXHAUSTED over the limit or
  // when the driver is out of memory, naming the sizes.
  absl::StatusOr<void*> Allocate(size_t bytes);
  // Gives `data` (from Allocate) back; reusable once every event in `ready` completed. Takes the
  // events (destroys them). Does not block.
  void Release(void* data, std::vector<cudaEvent_t> ready);

  // Bounds everything the pool holds; returns cached blocks above it at once. 0: no bound.
  void SetLimit(size_t bytes);

  struct Stats {
    size_t limit = 0;     // 0: none
    size_t reserved = 0;  // held from the driver: in use + cached + pending
    size_t in_use = 0;
  };
  Stats stats() const;

 private:
  struct Pending {
    void* data;
    size_t size;
    std::vector<cudaEvent_t> ready;
  };
  // Moves pending blocks whose events completed to the cache (wait: block on the oldest first).
  void Reclaim(bool wait) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // cudaFree of every cached block.
  void ReleaseCached() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool OverLimit(size_t extra) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return limit_ != 0 && reserved_ + extra > limit_;
  }

  const std::string device_name_;
  mutable absl::Mutex mu_;
  size_t limit_ ABSL_GUARDED_BY(mu_);
  size_t reserved_ ABSL_GUARDED_BY(mu_) = 0;
  size_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  std::multimap<size_t, void*> cached_ ABSL_GUARDED_BY(mu_);    // size -> block
  std::unordered_map<void*, size_t> live_ ABSL_GUARDED_BY(mu_);  // block -> size
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);             // in release order
};

// Sizes the pool hands out: 512-byte steps below 1 MiB, 2 MiB steps above.
size_t PoolBlockSize(size_t bytes);

}  // namespace muond::server::device::cuda

#endif  // MUOND_SERVER_DEVICE_CUDA_CUDA_MEMORY_POOL_H_
