// CUDA streams and events (see cuda_device.h and device.h).
//
// Errors, as on the host streams: the first error of a stream sticks until the next recorded
// event, which reports it (then the stream is usable again); operations enqueued while an error
// sticks are skipped. Two kinds:
//  - a CUDA or cuBLAS call that fails while enqueueing (the Status names the call);
//  - a failure found by the kernels (a non-finite input or result): they write a code into the
//    stream's device-side error flag; Record copies the flag into a pinned slot of the event and
//    clears it, so the event reports it (naming the matrix) once reached. Work after a device-side
//    failure still runs (the device cannot skip it); its event reports the failure.
// A stream that waits for another stream's event takes on that event's errors: its next event
// reports them too (the writeback stream's event reports a failed Newton-Schulz).
// A sticky CUDA error (an illegal address, a lost device) breaks the whole context: every later
// call fails with its Status; the daemon keeps running and fails the steps.
#include <cublas_v2.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "server/device/cuda/cuda_device.h"
#include "server/device/cuda/cuda_kernels.h"
#include "server/device/cuda/cuda_muon.h"
#include "server/device/cuda/cuda_status.h"

namespace muond::server::device::cuda {
namespace {

Elem ElemOf(common::DType dtype) {
  switch (dtype) {
    case common::DType::kFloat32:
      return Elem::kF32;
    case common::DType::kBFloat16:
      return Elem::kBf16;
    case common::DType::kFloat16:
      return Elem::kF16;
  }
  return Elem::kF32;
}

// Per-stream pinned buffer for copies of host memory that is not registered.
constexpr size_t kBounceBytes = size_t{16} << 20;

struct ItemName {
  std::string matrix;
  common::DType compute;
};

class CudaEvent final : public Event {
 public:
  CudaEvent(CudaDevice* device, cudaEvent_t event, int* slot)
      : device_(device), event_(event), slot_(slot) {}
  ~CudaEvent() override {
    (void)CudaStatus(cudaEventDestroy(event_), "cudaEventDestroy");
    device_->ReleaseFlagSlot(slot_);
  }

  absl::Status Wait() override {
    absl::MutexLock lock(&mu_);
    if (resolved_) return status_;
    absl::Status status = host_error_;
    const absl::Status synced = CudaStatus(cudaEventSynchronize(event_), "cudaEventSynchronize");
    if (status.ok()) status = synced;
    if (status.ok() && slot_ != nullptr && *slot_ != 0) status = FlagError(*slot_);
    for (const std::shared_ptr<CudaEvent>& up : upstream_) {
      const absl::Status s = up->Wait();
      if (status.ok() && !s.ok()) status = s;
    }
    upstream_.clear();
    resolved_ = true;
    status_ = status;
    return status_;
  }

  bool Done() const override {
    const cudaError_t q = cudaEventQuery(event_);
    if (q != cudaSuccess && q != cudaErrorNotReady) (void)cudaGetLastError();
    return q != cudaErrorNotReady;
  }

  cudaEvent_t event() const { return event_; }
  int* slot() const { return slot_; }
  // Errors of these events (reached before this one) are this event's errors too.
  void AddUpstream(std::shared_ptr<CudaEvent> up) {
    absl::MutexLock lock(&mu_);
    upstream_.push_back(std::move(up));
  }
  CudaDevice* device() const { return device_; }
  // Set once, before the event is shared.
  absl::Status host_error_;
  std::vector<ItemName> names_;

 private:
  absl::Status FlagError(int code) const {
    const size_t seq = FlagSeq(code);
    const std::string matrix = seq < names_.size() ? names_[seq].matrix : std::string("?");
    if (FlagKindOf(code) == kInputNotFinite) {
      return absl::InvalidArgumentError(
          absl::StrCat("matrix '", matrix,
                       "': the Muon input (gradient or momentum) holds a non-finite value "
                       "(found by the Frobenius norm on ",
                       device_->name(), ")"));
    }
    const std::string dtype =
        seq < names_.size() ? std::string(common::DTypeName(names_[seq].compute)) : "?";
    return absl::InvalidArgumentError(absl::StrCat(
        "matrix '", matrix, "': Newton-Schulz result is not finite on ", device_->name(),
        "; the input holds a non-finite value or overflowed in ", dtype));
  }

  CudaDevice* const device_;
  const cudaEvent_t event_;
  int* const slot_;
  absl::Mutex mu_;
  std::vector<std::shared_ptr<CudaEvent>> upstream_ ABSL_GUARDED_BY(mu_);
  bool resolved_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

struct HostCopy {
  void* dst;
  const void* src;
  size_t bytes;
};

void CUDART_CB RunHostCopy(void* user) {
  auto* c = static_cast<HostCopy*>(user);
  std::memcpy(c->dst, c->src, c->bytes);
  delete c;
}

class CudaStream final : public Stream {
 public:
  CudaStream(CudaDevice* device, cudaStream_t stream, cublasHandle_t blas, int* flag)
      : device_(device), stream_(stream), blas_(blas), flag_(flag) {
    device_->AddStream(stream_);
  }

  ~CudaStream() override {
    (void)device_->Activate();
    (void)CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    {
      absl::MutexLock lock(&mu_);
      EndRun();
    }
    device_->RemoveStream(stream_);
    (void)CublasStatus(cublasDestroy(blas_), "cublasDestroy");
    (void)CudaStatus(cudaFree(flag_), "cudaFree");
    if (bounce_ != nullptr) (void)CudaStatus(cudaFreeHost(bounce_), "cudaFreeHost");
    (void)CudaStatus(cudaStreamDestroy(stream_), "cudaStreamDestroy");
  }

  // Stream's halves (device.h checked the arguments).
  absl::Status EnqueueCopyToDevice(DeviceBuffer& dst, size_t offset, const void* src,
                                   size_t bytes) override {
    RETURN_IF_ERROR(device_->Activate());
    absl::MutexLock lock(&mu_);
    if (!error_.ok() || bytes == 0) return absl::OkStatus();
    BeginRun(0);
    Fail(EnqueueCopy(/*to_device=*/true, static_cast<char*>(dst.data()) + offset,
                     const_cast<void*>(src), bytes));
    return absl::OkStatus();
  }

  absl::Status EnqueueCopyToHost(void* dst, const DeviceBuffer& src, size_t offset,
                                 size_t bytes) override {
    RETURN_IF_ERROR(device_->Activate());
    absl::MutexLock lock(&mu_);
    if (!error_.ok() || bytes == 0) return absl::OkStatus();
    BeginRun(2);
    Fail(EnqueueCopy(/*to_device=*/false, static_cast<char*>(src.data()) + offset, dst, bytes));
    return absl::OkStatus();
  }

  // The widening of gradients and narrowing of updates of the direct path (device.h): the
  // ConvertKernel of cuda_kernels.cu (round to nearest even, as the host), timed as kernels.
  // Not run here (no GPU on the build machine): covered by tests/gpu/device_direct_copy_test.cc.
  absl::Status EnqueueConvert(const DeviceBuffer& src, common::DType from, DeviceBuffer& dst,
                              common::DType to, size_t elements, float scale) override {
    RETURN_IF_ERROR(device_->Activate());
    absl::MutexLock lock(&mu_);
    if (!error_.ok() || elements == 0) return absl::OkStatus();
    BeginRun(1);
    if (from == to && scale == 1.0f) {
      Fail(CudaStatus(cudaMemcpyAsync(dst.data(), src.data(), elements * common::DTypeSize(from),
                                      cudaMemcpyDeviceToDevice, stream_),
                      "cudaMemcpyAsync(device to device)"));
    } else {
      Fail(CudaStatus(LaunchConvert(ElemOf(from), src.data(), ElemOf(to), dst.data(),
                                    static_cast<int64_t>(elements), scale, stream_),
                      "LaunchConvert"));
    }
    return absl::OkStatus();
  }

  absl::Status Muon(const common::MuonConfig& config, std::vector<MuonKernelItem> items) override {
    RETURN_IF_ERROR(ValidateMuonItems(config, items));
    RETURN_IF_ERROR(device_->Activate());
    absl::MutexLock lock(&mu_);
    if (!error_.ok() || items.empty()) return absl::OkStatus();
    BeginRun(1);
    MuonLaunch launch;
    launch.stream = stream_;
    launch.blas = blas_;
    launch.flag = flag_;
    launch.first_seq = names_.size();
    launch.allocate = [this](size_t bytes) { return device_->Allocate(bytes); };
    launch.workspace_cap = device_->WorkspaceCap();
    for (const MuonKernelItem& it : items) {
      names_.push_back({it.spec->name, config.compute_dtype});
    }
    const absl::Status s = EnqueueMuon(launch, config, items);
    if (!s.ok()) {
      Fail(absl::Status(s.code(), absl::StrCat("Muon on ", device_->name(), ": ", s.message())));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::shared_ptr<Event>> Record() override {
    RETURN_IF_ERROR(device_->Activate());
    absl::MutexLock lock(&mu_);
    EndRun();
    cudaEvent_t e = nullptr;
    MUOND_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    auto event = std::make_shared<CudaEvent>(device_, e, device_->AcquireFlagSlot());
    // The kernels' error flag travels with the event: copied into its slot, then cleared, in
    // stream order; the event reads the slot once it is reached.
    RETURN_IF_ERROR(CopyFlagInto(*event));
    MUOND_CUDA_RETURN_IF_ERROR(cudaEventRecord(e, stream_));
    event->host_error_ = std::move(error_);
    error_ = absl::OkStatus();
    event->names_ = std::move(names_);
    names_.clear();
    std::vector<std::shared_ptr<CudaEvent>> upstream = std::move(upstream_);
    upstream_.clear();
    for (std::shared_ptr<CudaEvent>& up : upstream) {
      // Completed ones are resolved now, so that chains of events do not grow.
      if (up->Done()) {
        const absl::Status s = up->Wait();
        if (event->host_error_.ok() && !s.ok()) event->host_error_ = s;
      } else {
        event->AddUpstream(std::move(up));
      }
    }
    return std::shared_ptr<Event>(std::move(event));
  }

  absl::Status WaitFor(std::shared_ptr<Event> event) override {
    auto cuda_event = std::dynamic_pointer_cast<CudaEvent>(event);
    if (cuda_event == nullptr || cuda_event->device() != device_) {
      return absl::InvalidArgumentError("event of another device");
    }
    RETURN_IF_ERROR(device_->Activate());
    absl::MutexLock lock(&mu_);
    // The event's enqueue-time error is known now: later work here is skipped, as on the host.
    if (!cuda_event->host_error_.ok()) Fail(cuda_event->host_error_);
    Fail(CudaStatus(cudaStreamWaitEvent(stream_, cuda_event->event(), 0), "cudaStreamWaitEvent"));
    upstream_.push_back(std::move(cuda_event));
    return absl::OkStatus();
  }

  absl::Status Synchronize() override {
    auto event = Record();
    if (!event.ok()) return event.status();
    return (*event)->Wait();
  }

 private:
  void Fail(absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (error_.ok() && !s.ok()) error_ = std::move(s);
  }

  absl::Status CopyFlagInto(CudaEvent& event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status EnqueueCopy(bool to_device, char* device_ptr, void* host, size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void BeginRun(int kind) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndRun() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  CudaDevice* const device_;
  const cudaStream_t stream_;
  const cublasHandle_t blas_;
  int* const flag_;  // device memory
  absl::Mutex mu_;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::vector<ItemName> names_ ABSL_GUARDED_BY(mu_);  // items since the last event (flag codes)
  std::vector<std::shared_ptr<CudaEvent>> upstream_ ABSL_GUARDED_BY(mu_);
  void* bounce_ ABSL_GUARDED_BY(mu_) = nullptr;
  int run_kind_ ABSL_GUARDED_BY(mu_) = -1;
  cudaEvent_t run_start_ ABSL_GUARDED_BY(mu_) = nullptr;
};

absl::Status CudaStream::CopyFlagInto(CudaEvent& event) {
  if (event.slot() != nullptr) {
    Fail(CudaStatus(
        cudaMemcpyAsync(event.slot(), flag_, sizeof(int), cudaMemcpyDeviceToHost, stream_),
        "cudaMemcpyAsync(error flag)"));
  } else {
    Fail(absl::ResourceExhaustedError(
        absl::StrCat(device_->name(), ": no pinned memory for an event's error flag")));
  }
  MUOND_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flag_, 0, sizeof(int), stream_));
  return absl::OkStatus();
}

// Pinned pieces are copied directly; the others through the bounce buffer, a piece at a time: a
// host function copies between the caller's memory and the bounce buffer, in stream order with
// the DMA, so the call returns at once and the bounce buffer is reused only after its last copy.
absl::Status CudaStream::EnqueueCopy(bool to_device, char* device_ptr, void* host, size_t bytes) {
  char* host_bytes = static_cast<char*>(host);
  for (const CudaDevice::HostPiece& piece : device_->SplitHostRange(host, bytes)) {
    char* h = host_bytes + piece.offset;
    char* d = device_ptr + piece.offset;
    if (piece.pinned) {
      MUOND_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          to_device ? static_cast<void*>(d) : h, to_device ? static_cast<void*>(h) : d, piece.bytes,
          to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, stream_));
      continue;
    }
    if (bounce_ == nullptr) {
      MUOND_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&bounce_, kBounceBytes, cudaHostAllocDefault));
    }
    for (size_t at = 0; at < piece.bytes; at += kBounceBytes) {
      const size_t n = std::min(kBounceBytes, piece.bytes - at);
      if (to_device) {
        auto* copy = new HostCopy{bounce_, h + at, n};
        const cudaError_t e = cudaLaunchHostFunc(stream_, RunHostCopy, copy);
        if (e != cudaSuccess) delete copy;
        MUOND_CUDA_RETURN_IF_ERROR(e);
        MUOND_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(d + at, bounce_, n, cudaMemcpyHostToDevice, stream_));
      } else {
        MUOND_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(bounce_, d + at, n, cudaMemcpyDeviceToHost, stream_));
        auto* copy = new HostCopy{h + at, bounce_, n};
        const cudaError_t e = cudaLaunchHostFunc(stream_, RunHostCopy, copy);
        if (e != cudaSuccess) delete copy;
        MUOND_CUDA_RETURN_IF_ERROR(e);
      }
    }
  }
  return absl::OkStatus();
}

// Busy time: a run of one kind of work is timed between two events; the device adds it up.
void CudaStream::BeginRun(int kind) {
  if (run_kind_ == kind) return;
  EndRun();
  cudaEvent_t start = nullptr;
  if (!CudaStatus(cudaEventCreate(&start), "cudaEventCreate").ok()) return;
  if (!CudaStatus(cudaEventRecord(start, stream_), "cudaEventRecord").ok()) {
    (void)CudaStatus(cudaEventDestroy(start), "cudaEventDestroy");
    return;
  }
  run_kind_ = kind;
  run_start_ = start;
}

void CudaStream::EndRun() {
  if (run_kind_ < 0) return;
  cudaEvent_t end = nullptr;
  absl::Status s = CudaStatus(cudaEventCreate(&end), "cudaEventCreate");
  if (s.ok()) s = CudaStatus(cudaEventRecord(end, stream_), "cudaEventRecord");
  if (s.ok()) {
    device_->AddBusyRun(run_start_, end, run_kind_);
  } else {
    (void)CudaStatus(cudaEventDestroy(run_start_), "cudaEventDestroy");
    if (end != nullptr) (void)CudaStatus(cudaEventDestroy(end), "cudaEventDestroy");
  }
  run_kind_ = -1;
  run_start_ = nullptr;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Stream>> NewCudaStream(CudaDevice* device) {
  cudaStream_t stream = nullptr;
  MUOND_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t blas = nullptr;
  int* flag = nullptr;
  absl::Status s = CublasStatus(cublasCreate(&blas), "cublasCreate");
  if (s.ok()) s = CublasStatus(cublasSetStream(blas, stream), "cublasSetStream");
  // fp32 stays fp32 (no TF32), and fp16/bf16 GEMMs accumulate in fp32 throughout.
  if (s.ok()) {
    s = CublasStatus(cublasSetMathMode(blas, static_cast<cublasMath_t>(
                                                 CUBLAS_DEFAULT_MATH |
                                                 CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
                     "cublasSetMathMode");
  }
  if (s.ok())
    s = CudaStatus(cudaMalloc(reinterpret_cast<void**>(&flag), sizeof(int)), "cudaMalloc");
  if (s.ok()) s = CudaStatus(cudaMemsetAsync(flag, 0, sizeof(int), stream), "cudaMemsetAsync");
  if (s.ok()) s = CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  if (!s.ok()) {
    if (flag != nullptr) (void)CudaStatus(cudaFree(flag), "cudaFree");
    if (blas != nullptr) (void)CublasStatus(cublasDestroy(blas), "cublasDestroy");
    (void)CudaStatus(cudaStreamDestroy(stream), "cudaStreamDestroy");
    return absl::Status(s.code(),
                        absl::StrCat(device->name(), ": creating a stream: ", s.message()));
  }
  return std::unique_ptr<Stream>(new CudaStream(device, stream, blas, flag));
}

}  // namespace muond::server::device::cuda
