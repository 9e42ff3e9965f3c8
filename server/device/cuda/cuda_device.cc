// The CUDA device: open and probe, the memory pool's glue, host registration, busy time (see
// cuda_device.h).
#include "server/device/cuda/cuda_device.h"

#include <cublas_v2.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "server/device/cuda/cuda_kernels.h"
#include "server/device/cuda/cuda_status.h"

namespace muond::server::device {
namespace cuda {
namespace {

constexpr int kFlagSlotsPerPage = 1024;
// Reserved for the CUDA context, cuBLAS workspaces and other processes: the default pool limit
// is the memory free at open minus this fraction of the total.
constexpr double kReservedFraction = 0.10;
constexpr int kProbeValue = 0x6d756f6e;
// Busy runs kept before their events are collected without a Busy() call.
constexpr size_t kMaxBusyRuns = 256;

absl::Status Unavailable(const std::string& what, const absl::Status& why) {
  return absl::UnavailableError(absl::StrCat(what, ": ", why.message()));
}

// Runs a kernel and cuBLAS on the device once: a driver or build that cannot serve this GPU
// (no kernel image for its architecture, cuBLAS not initializable) is refused at open, not at
// the first step.
absl::Status Probe() {
  cudaStream_t stream = nullptr;
  MUOND_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int* value = nullptr;
  absl::Status s =
      CudaStatus(cudaMalloc(reinterpret_cast<void**>(&value), sizeof(int)), "cudaMalloc");
  int got = 0;
  if (s.ok()) s = CudaStatus(LaunchProbe(value, kProbeValue, stream), "probe kernel launch");
  if (s.ok()) {
    s = CudaStatus(cudaMemcpyAsync(&got, value, sizeof(int), cudaMemcpyDeviceToHost, stream),
                   "cudaMemcpyAsync");
  }
  if (s.ok()) s = CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  if (s.ok() && got != kProbeValue) {
    s = absl::InternalError(absl::StrCat("probe kernel wrote ", got, ", not ", kProbeValue));
  }
  if (value != nullptr) (void)CudaStatus(cudaFree(value), "cudaFree");
  (void)CudaStatus(cudaStreamDestroy(stream), "cudaStreamDestroy");
  if (!s.ok()) return s;
  cublasHandle_t handle = nullptr;
  MUOND_CUBLAS_RETURN_IF_ERROR(cublasCreate(&handle));
  MUOND_CUBLAS_RETURN_IF_ERROR(cublasDestroy(handle));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::Open(int ordinal) {
  int count = 0;
  if (absl::Status s = CudaStatus(cudaGetDeviceCount(&count), "cudaGetDeviceCount"); !s.ok()) {
    return Unavailable("no CUDA device", s);
  }
  if (count == 0) return absl::UnavailableError("no CUDA device: cudaGetDeviceCount found none");
  if (ordinal < 0 || ordinal >= count) {
    return absl::UnavailableError(
        absl::StrCat("no CUDA device ", ordinal, " (", count, " present)"));
  }
  const std::string name = absl::StrCat("cuda:", ordinal);
  if (absl::Status s = CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice"); !s.ok()) {
    return Unavailable(name, s);
  }
  cudaDeviceProp prop{};
  if (absl::Status s =
          CudaStatus(cudaGetDeviceProperties(&prop, ordinal), "cudaGetDeviceProperties");
      !s.ok()) {
    return Unavailable(name, s);
  }
  const std::string described = absl::StrCat(name, " (", prop.name, ", compute capability ",
                                             prop.major, ".", prop.minor, ")");
  if (prop.major * 10 + prop.minor < 75) {
    return absl::UnavailableError(
        absl::StrCat(described, ": this muond's kernels need compute capability 7.5 or newer"));
  }
  if (absl::Status s = Probe(); !s.ok()) return Unavailable(described, s);
  size_t free_bytes = 0, total_bytes = 0;
  if (absl::Status s = CudaStatus(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
      !s.ok()) {
    return Unavailable(described, s);
  }
  const size_t reserve = static_cast<size_t>(kReservedFraction * static_cast<double>(total_bytes));
  const size_t limit = free_bytes > 2 * reserve ? free_bytes - reserve : free_bytes / 2;
  MUOND_LOG(INFO) << described << ": " << (total_bytes >> 20) << " MiB, " << (free_bytes >> 20)
                  << " MiB free; device memory pool limit " << (limit >> 20) << " MiB";
  return std::unique_ptr<CudaDevice>(new CudaDevice(ordinal, prop, limit));
}

CudaDevice::CudaDevice(int ordinal, const cudaDeviceProp& properties, size_t default_limit)
    : ordinal_(ordinal),
      name_(absl::StrCat("cuda:", ordinal)),
      properties_(properties),
      default_limit_(default_limit),
      pool_(name_, default_limit) {}

CudaDevice::~CudaDevice() {
  (void)Activate();
  (void)CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  absl::MutexLock lock(&mu_);
  for (const BusyRun& r : busy_runs_) {
    (void)CudaStatus(cudaEventDestroy(r.start), "cudaEventDestroy");
    (void)CudaStatus(cudaEventDestroy(r.end), "cudaEventDestroy");
  }
  for (const auto& [start, bytes] : registered_) {
    (void)CudaStatus(cudaHostUnregister(const_cast<char*>(start)), "cudaHostUnregister");
  }
  for (int* page : flag_pages_) (void)CudaStatus(cudaFreeHost(page), "cudaFreeHost");
  // pool_ is destroyed after this body: the device is idle.
}

absl::Status CudaDevice::Activate() const {
  return CudaStatus(cudaSetDevice(ordinal_), "cudaSetDevice");
}

absl::StatusOr<DeviceBuffer> CudaDevice::Allocate(size_t bytes) {
  if (absl::Status s = Activate(); !s.ok()) return s;
  auto data = pool_.Allocate(bytes);
  if (!data.ok()) return data.status();
  return DeviceBuffer(this, *data, bytes);
}

void CudaDevice::Free(void* data, size_t size) {
  // Reusable once every stream passed the work enqueued so far (which includes everything that
  // may still use the buffer: nothing can be enqueued on it after its DeviceBuffer died).
  std::vector<cudaEvent_t> ready;
  absl::Status s = Activate();
  {
    absl::MutexLock lock(&mu_);
    for (cudaStream_t stream : streams_) {
      if (!s.ok()) break;
      cudaEvent_t e = nullptr;
      s = CudaStatus(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
      if (!s.ok()) break;
      ready.push_back(e);
      s = CudaStatus(cudaEventRecord(e, stream), "cudaEventRecord");
    }
  }
  if (!s.ok()) {
    // Without events the only safe order is the whole device's.
    MUOND_LOG(WARNING) << name_ << ": freeing a buffer: " << s.message()
                       << "; synchronizing the device";
    (void)CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  pool_.Release(data, std::move(ready));
}

void CudaDevice::SetMemoryLimit(size_t bytes) {
  pool_.SetLimit(bytes == 0 ? default_limit_ : bytes);
}

size_t CudaDevice::WorkspaceCap() const {
  const size_t limit = pool_.stats().limit;
  return std::clamp<size_t>(limit / 4, size_t{64} << 20, size_t{2} << 30);
}

bool CudaDevice::RegisterHost(void* data, size_t bytes) {
  const absl::Status s = RegisterHostRegion(data, bytes);
  if (!s.ok()) {
    MUOND_LOG(WARNING) << s.message() << "; copies of it go through a bounce buffer";
  }
  return s.ok();
}

absl::Status CudaDevice::RegisterHostRegion(void* data, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (data == nullptr) return absl::InvalidArgumentError("cudaHostRegister of a null pointer");
  if (absl::Status s = Activate(); !s.ok()) return s;
  char* base = static_cast<char*>(data);
  absl::MutexLock lock(&mu_);
  for (size_t off = 0; off < bytes; off += kMaxRegisterChunk) {
    const size_t len = std::min(kMaxRegisterChunk, bytes - off);
    const absl::Status s =
        CudaStatus(cudaHostRegister(base + off, len, cudaHostRegisterDefault), "cudaHostRegister");
    if (!s.ok()) {
      for (size_t done = 0; done < off; done += kMaxRegisterChunk) {
        (void)CudaStatus(cudaHostUnregister(base + done), "cudaHostUnregister");
        registered_.erase(base + done);
      }
      return absl::Status(s.code(), absl::StrCat(name_, ": pinning ", bytes,
                                                 " bytes of host memory: ", s.message()));
    }
    registered_[base + off] = len;
  }
  return absl::OkStatus();
}

bool CudaDevice::IsHostRegistered(const void* data, size_t bytes) const {
  if (data == nullptr || bytes == 0) return false;
  for (const HostPiece& piece : SplitHostRange(data, bytes)) {
    if (!piece.pinned) return false;
  }
  return true;
}

void CudaDevice::UnregisterHost(void* data, size_t bytes) {
  if (bytes == 0 || data == nullptr || !Activate().ok()) return;
  const char* begin = static_cast<const char*>(data);
  absl::MutexLock lock(&mu_);
  auto it = registered_.lower_bound(begin);
  while (it != registered_.end() && it->first < begin + bytes) {
    const absl::Status s =
        CudaStatus(cudaHostUnregister(const_cast<char*>(it->first)), "cudaHostUnregister");
    if (!s.ok()) MUOND_LOG(WARNING) << name_ << ": " << s.message();
    it = registered_.erase(it);
  }
}

std::vector<CudaDevice::HostPiece> CudaDevice::SplitHostRange(const void* data,
                                                              size_t bytes) const {
  std::vector<HostPiece> pieces;
  const char* begin = static_cast<const char*>(data);
  absl::MutexLock lock(&mu_);
  size_t at = 0;
  while (at < bytes) {
    const char* p = begin + at;
    auto next = registered_.upper_bound(p);  // first chunk starting after p
    size_t len = bytes - at;
    bool pinned = false;
    if (next != registered_.begin()) {
      auto prev = std::prev(next);
      if (p < prev->first + prev->second) {
        pinned = true;
        len = std::min<size_t>(len, prev->first + prev->second - p);
      }
    }
    if (!pinned && next != registered_.end()) len = std::min<size_t>(len, next->first - p);
    pieces.push_back({at, len, pinned});
    at += len;
  }
  return pieces;
}

absl::StatusOr<std::unique_ptr<Stream>> CudaDevice::CreateStream() {
  if (absl::Status s = Activate(); !s.ok()) return s;
  return NewCudaStream(this);
}

void CudaDevice::AddStream(cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  streams_.push_back(stream);
}

void CudaDevice::RemoveStream(cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  streams_.erase(std::remove(streams_.begin(), streams_.end(), stream), streams_.end());
}

int* CudaDevice::AcquireFlagSlot() {
  absl::MutexLock lock(&mu_);
  if (free_slots_.empty()) {
    void* page = nullptr;
    const absl::Status s =
        CudaStatus(cudaHostAlloc(&page, kFlagSlotsPerPage * sizeof(int), cudaHostAllocDefault),
                   "cudaHostAlloc");
    if (!s.ok()) {
      MUOND_LOG(WARNING) << name_ << ": " << s.message();
      return nullptr;
    }
    flag_pages_.push_back(static_cast<int*>(page));
    for (int i = 0; i < kFlagSlotsPerPage; ++i) free_slots_.push_back(static_cast<int*>(page) + i);
  }
  int* slot = free_slots_.back();
  free_slots_.pop_back();
  *slot = 0;
  return slot;
}

void CudaDevice::ReleaseFlagSlot(int* slot) {
  if (slot == nullptr) return;
  absl::MutexLock lock(&mu_);
  free_slots_.push_back(slot);
}

void CudaDevice::AddBusyRun(cudaEvent_t start, cudaEvent_t end, int kind) {
  absl::MutexLock lock(&mu_);
  busy_runs_.push_back({start, end, kind});
  if (busy_runs_.size() > kMaxBusyRuns) CollectBusy();
}

void CudaDevice::CollectBusy() const {
  size_t kept = 0;
  for (const BusyRun& r : busy_runs_) {
    const cudaError_t q = cudaEventQuery(r.end);
    if (q == cudaErrorNotReady) {
      busy_runs_[kept++] = r;
      continue;
    }
    float ms = 0;
    if (q == cudaSuccess &&
        CudaStatus(cudaEventElapsedTime(&ms, r.start, r.end), "cudaEventElapsedTime").ok()) {
      double& total = r.kind == 0 ? busy_.copy_in : r.kind == 1 ? busy_.compute : busy_.writeback;
      total += ms * 1e-3;
    } else if (q != cudaSuccess) {
      (void)CudaStatus(q, "cudaEventQuery");
    }
    (void)CudaStatus(cudaEventDestroy(r.start), "cudaEventDestroy");
    (void)CudaStatus(cudaEventDestroy(r.end), "cudaEventDestroy");
  }
  busy_runs_.resize(kept);
}

Device::BusySeconds CudaDevice::Busy() const {
  (void)Activate();
  absl::MutexLock lock(&mu_);
  CollectBusy();
  return busy_;
}

}  // namespace cuda

absl::StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int ordinal) {
  auto device = cuda::CudaDevice::Open(ordinal);
  if (!device.ok()) return device.status();
  return std::unique_ptr<Device>(*std::move(device));
}

}  // namespace muond::server::device
