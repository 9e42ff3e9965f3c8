#include "server/device/cuda/cuda_memory_pool.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "server/device/cuda/cuda_status.h"

namespace muond::server::device::cuda {
namespace {

constexpr size_t kSmallStep = 512;
constexpr size_t kLargeStep = size_t{2} << 20;
constexpr size_t kLargeFrom = size_t{1} << 20;

}  // namespace

size_t PoolBlockSize(size_t bytes) {
  const size_t step = bytes < kLargeFrom ? kSmallStep : kLargeStep;
  const size_t rounded = (bytes + step - 1) / step * step;
  return rounded == 0 ? kSmallStep : rounded;
}

CudaMemoryPool::CudaMemoryPool(std::string device_name, size_t limit_bytes)
    : device_name_(std::move(device_name)), limit_(limit_bytes) {}

CudaMemoryPool::~CudaMemoryPool() {
  absl::MutexLock lock(&mu_);
  for (Pending& p : pending_) {
    for (cudaEvent_t e : p.ready) (void)CudaStatus(cudaEventDestroy(e), "cudaEventDestroy");
    cached_.emplace(p.size, p.data);
  }
  pending_.clear();
  ReleaseCached();
  if (!live_.empty()) {
    MUOND_LOG(WARNING) << device_name_ << ": " << live_.size()
                       << " device buffers outlived their device (leaked)";
  }
}

void CudaMemoryPool::Reclaim(bool wait) {
  while (!pending_.empty()) {
    Pending& p = pending_.front();
    bool done = true;
    for (cudaEvent_t e : p.ready) {
      const cudaError_t q = wait ? cudaEventSynchronize(e) : cudaEventQuery(e);
      if (q == cudaErrorNotReady) {
        done = false;
        break;
      }
      // Another error means the context is broken: nothing will use the block any more.
      if (q != cudaSuccess) (void)CudaStatus(q, "cudaEventQuery");
    }
    // In release order: a later block's events were recorded after this one's, so stopping at
    // the first incomplete block loses little.
    if (!done) return;
    for (cudaEvent_t e : p.ready) (void)CudaStatus(cudaEventDestroy(e), "cudaEventDestroy");
    cached_.emplace(p.size, p.data);
    pending_.pop_front();
  }
}

void CudaMemoryPool::ReleaseCached() {
  for (const auto& [size, data] : cached_) {
    const absl::Status s = CudaStatus(cudaFree(data), "cudaFree");
    if (!s.ok()) MUOND_LOG(WARNING) << device_name_ << ": " << s.message();
    reserved_ -= size;
  }
  cached_.clear();
}

absl::StatusOr<void*> CudaMemoryPool::Allocate(size_t bytes) {
  const size_t size = PoolBlockSize(bytes);
  absl::MutexLock lock(&mu_);
  Reclaim(/*wait=*/false);
  while (true) {
    // A cached block of the size, or up to a quarter larger.
    auto it = cached_.lower_bound(size);
    if (it != cached_.end() && it->first <= size + size / 4) {
      void* data = it->second;
      live_[data] = it->first;
      in_use_ += it->first;
      cached_.erase(it);
      return data;
    }
    if (!OverLimit(size)) break;
    if (!cached_.empty()) {
      ReleaseCached();
    } else if (!pending_.empty()) {
      Reclaim(/*wait=*/true);
    } else {
      return absl::ResourceExhaustedError(absl::StrCat(
          device_name_, ": cannot allocate ", bytes, " bytes of device memory: ", in_use_,
          " of the pool's limit of ", limit_, " bytes are in use"));
    }
  }
  void* data = nullptr;
  absl::Status s = CudaStatus(cudaMalloc(&data, size), "cudaMalloc");
  if (!s.ok() && (!cached_.empty() || !pending_.empty())) {
    // The driver is short, not the pool: give the cache back and try once more.
    Reclaim(/*wait=*/true);
    ReleaseCached();
    s = CudaStatus(cudaMalloc(&data, size), "cudaMalloc");
  }
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat(device_name_, ": cannot allocate ", bytes,
                                               " bytes of device memory: ", s.message()));
  }
  reserved_ += size;
  in_use_ += size;
  live_[data] = size;
  return data;
}

void CudaMemoryPool::Release(void* data, std::vector<cudaEvent_t> ready) {
  absl::MutexLock lock(&mu_);
  auto it = live_.find(data);
  if (it == live_.end()) {
    MUOND_LOG(ERROR) << device_name_ << ": release of an unknown device buffer ignored";
    for (cudaEvent_t e : ready) (void)CudaStatus(cudaEventDestroy(e), "cudaEventDestroy");
    return;
  }
  in_use_ -= it->second;
  pending_.push_back(Pending{data, it->second, std::move(ready)});
  live_.erase(it);
  Reclaim(/*wait=*/false);
  if (OverLimit(0)) ReleaseCached();
}

void CudaMemoryPool::SetLimit(size_t bytes) {
  absl::MutexLock lock(&mu_);
  limit_ = bytes;
  if (OverLimit(0)) ReleaseCached();
}

CudaMemoryPool::Stats CudaMemoryPool::stats() const {
  absl::MutexLock lock(&mu_);
  return Stats{limit_, reserved_, in_use_};
}

}  // namespace muond::server::device::cuda
