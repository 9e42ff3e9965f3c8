// The device layer (DESIGN.md section 6): Backend -> Device -> Stream (in order) and Event.
//
// The room server/device owns the compute backends: cpu and simulated (host_device.cc), cuda/ and
// level_zero/ (each its own library, linked when its toolchain is found), the choice of backend
// (backend.cc) and DeviceStreams (a device with the step pipeline's three streams). It calls
// server/optim for the math it runs and nothing above it; server/jobs drives it.
//
// Shaped for CUDA streams/events and Level Zero immediate command lists as well as the CPU:
// memory is either host memory (registered = pinned once; on GPU devices registered memory is
// copied by DMA in place, DirectHostCopies) or device memory (DeviceBuffer, owned,
// move-only); a Stream runs copies and kernels in the order they were enqueued; an Event marks a
// point in a stream that the host or another stream can wait for. Every method says whether it
// "enqueues" (returns at once; the work runs later on the stream) or "blocks".
//
// Lifetimes: a source buffer must stay alive and unchanged until an event recorded after its copy
// has completed; the host must not read a destination before that. Devices and streams are
// thread-safe; a stream's operations run in order.
#ifndef MUOND_SERVER_DEVICE_DEVICE_H_
#define MUOND_SERVER_DEVICE_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/job_spec.h"

namespace muond::server::device {

class Device;

// Device memory. Move-only; freed by its destructor (the device must outlive it).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device* device, void* data, size_t size)
      : device_(device), data_(data), size_(size) {}
  // A view of host memory the caller owns, for devices that compute in host memory
  // (Device::ComputesInHostMemory): never freed by the buffer.
  static DeviceBuffer HostView(void* data, size_t size) {
    return DeviceBuffer(nullptr, data, size);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();
  // A device address: dereferenceable by the host only on host-memory devices (cpu, simulated).
  void* data() const { return data_; }
  size_t size() const { return size_; }
  // False for a HostView (and an empty buffer): nothing to free or to keep for reuse.
  bool owned() const { return device_ != nullptr && data_ != nullptr; }

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  size_t size_ = 0;
};

class Event {
 public:
  virtual ~Event() = default;
  // Blocks until the stream reached the event; returns the first error of the work before it.
  virtual absl::Status Wait() = 0;
  // True once reached (does not block).
  virtual bool Done() const = 0;
};

// One matrix of a Muon kernel call, all in device memory (fp32): the whole gradient (overwritten
// with the update) and a momentum buffer (read as M, written with the new momentum M', unless
// momentum_out is set).
struct MuonKernelItem {
  const common::MatrixSpec* spec = nullptr;
  DeviceBuffer* grad_update = nullptr;
  DeviceBuffer* momentum = nullptr;
  // Where M' goes when it must not overwrite M (M then is only read): accepted by the devices
  // that compute in host memory (ComputesInHostMemory), where the step reads the committed
  // momentum in place and writes the new one straight into the store's back buffer. The GPU
  // backends refuse it (INVALID_ARGUMENT): their momentum is a device copy.
  DeviceBuffer* momentum_out = nullptr;
  // Momentum held compressed (JobSpec::state, server/optim/state_codec.h): when held_in is set,
  // `momentum` and `momentum_out` are unused (null) and the kernel decodes the committed momentum
  // from held_in, applies the EMA and encodes the new one into held_out (which may be held_in)
  // block by block, fused (no fp32 copy of the momentum). Accepted by the devices that compute in
  // host memory (ComputesInHostMemory); the GPU backends refuse it (INVALID_ARGUMENT): their
  // momentum is a device copy of its decoding.
  const float* held_in = nullptr;
  float* held_out = nullptr;
  common::StateDType held_dtype = common::StateDType::kFloat32;
};

// The argument checks of Stream's copies and conversions, made once for every backend by the
// Stream functions below, before the backend's Enqueue* runs (as ggml-backend checks a tensor
// copy once, in the generic function, before the backend's). Header-only: the GPU backends are
// libraries of their own that do not link the device room's library.
// OK when [offset, offset + bytes) lies inside `buffer` and, for bytes > 0, both addresses are
// set; OUT_OF_RANGE ("... overruns a N-byte device buffer") or INVALID_ARGUMENT otherwise.
inline absl::Status CheckCopy(const DeviceBuffer& buffer, size_t offset, const void* host,
                              size_t bytes);
// OK when Stream::Convert may convert `elements` values of `from` at src into `to` at dst.
inline absl::Status CheckConvert(const DeviceBuffer& src, common::DType from,
                                 const DeviceBuffer& dst, common::DType to, size_t elements);

class Stream {
 public:
  virtual ~Stream() = default;
  // Enqueues a copy of `bytes` from host `src` to `dst` at `offset` (CheckCopy first).
  absl::Status CopyToDevice(DeviceBuffer& dst, size_t offset, const void* src, size_t bytes) {
    if (absl::Status s = CheckCopy(dst, offset, src, bytes); !s.ok()) return s;
    return EnqueueCopyToDevice(dst, offset, src, bytes);
  }
  // Enqueues a copy of `bytes` from `src` at `offset` to host `dst` (CheckCopy first).
  absl::Status CopyToHost(void* dst, const DeviceBuffer& src, size_t offset, size_t bytes) {
    if (absl::Status s = CheckCopy(src, offset, dst, bytes); !s.ok()) return s;
    return EnqueueCopyToHost(dst, src, offset, bytes);
  }
  // Enqueues dst[i] = src[i] converted from `from` to `to` and multiplied by `scale` for
  // `elements` values, both buffers from element 0: the value is widened to float32 (exact),
  // multiplied in float32 (one rounding, as the host's `g *= scale`; none when scale is 1) and
  // narrowed to `to` rounding to nearest even as common::FromFloat32 does (NaN stays NaN, float16
  // overflow is +-inf); same dtypes with scale 1 copy. The step pipeline widens gradients (apply
  // mode: scaled by the step's divisor and clip coefficient) and narrows updates with it where
  // they are copied straight between the ranks' regions and the device. OUT_OF_RANGE when a
  // buffer is too small; INVALID_ARGUMENT when neither dtype is float32 and they differ, or src
  // and dst are one buffer (CheckConvert, before the backend's EnqueueConvert).
  absl::Status Convert(const DeviceBuffer& src, common::DType from, DeviceBuffer& dst,
                       common::DType to, size_t elements, float scale) {
    if (absl::Status s = CheckConvert(src, from, dst, to, elements); !s.ok()) return s;
    return EnqueueConvert(src, from, dst, to, elements, scale);
  }
  // Enqueues the Muon update (DESIGN.md 3) of each item with `config`.
  virtual absl::Status Muon(const common::MuonConfig& config,
                            std::vector<MuonKernelItem> items) = 0;
  // Enqueues an event at the current end of the stream.
  virtual absl::StatusOr<std::shared_ptr<Event>> Record() = 0;
  // Enqueues a wait: later work on this stream starts after `event` (recorded on any stream of
  // the same device) was reached.
  virtual absl::Status WaitFor(std::shared_ptr<Event> event) = 0;
  // Blocks until everything enqueued so far has run; returns its first error.
  virtual absl::Status Synchronize() = 0;

 protected:
  // The backend's halves of CopyToDevice, CopyToHost and Convert, called with their arguments
  // checked.
  virtual absl::Status EnqueueCopyToDevice(DeviceBuffer& dst, size_t offset, const void* src,
                                           size_t bytes) = 0;
  virtual absl::Status EnqueueCopyToHost(void* dst, const DeviceBuffer& src, size_t offset,
                                         size_t bytes) = 0;
  virtual absl::Status EnqueueConvert(const DeviceBuffer& src, common::DType from,
                                      DeviceBuffer& dst, common::DType to, size_t elements,
                                      float scale) = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  // "cpu", "simulated", "cuda:0", ...
  virtual std::string name() const = 0;
  // Blocks. RESOURCE_EXHAUSTED when the device is out of memory.
  virtual absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) = 0;
  // Registers (pins) host memory once for fast copies; false when the platform refused (the memory
  // still works, unpinned). Blocks.
  virtual bool RegisterHost(void* data, size_t bytes) = 0;
  // Undoes RegisterHost / RegisterHostRegion of exactly that range. Blocks.
  // REQUIRES: no copy of the range is enqueued and unfinished.
  virtual void UnregisterHost(void* data, size_t bytes) = 0;

  // Direct copies (DESIGN.md 5): true on devices with memory of their own (cuda, level_zero),
  // whose DMA engines read and write registered host memory in place. The step pipeline then
  // copies a rank's gradient spans from its shared-memory region to the device and the update
  // spans back into the rank's update region with one asynchronous copy per span, and widens and
  // narrows on the device (Stream::Convert): no fp32 host staging, no bounce buffer. False on the
  // host-memory devices (cpu, simulated; unless SimulatedOptions::direct_host_copies), whose steps
  // assemble on the host as before.
  virtual bool DirectHostCopies() const { return false; }
  // True on the cpu device: its "device memory" is host memory and its kernels may run on host
  // memory the caller owns (DeviceBuffer::HostView). The step pipeline then runs the Muon update
  // in place on the host staging, reading the committed momentum where it is stored and writing
  // the new one into the store's back buffer (MuonKernelItem::momentum_out): no copy in, no copy
  // back. False on the simulated device (its copies are what it models) and on the GPUs.
  virtual bool ComputesInHostMemory() const { return false; }
  // RegisterHost that says why not: OK once [data, data + bytes) is registered (pinned with
  // cudaHostRegister; imported on Level Zero; mlock()ed whole pages on the host devices), else
  // the driver's reason (FAILED_PRECONDITION, RESOURCE_EXHAUSTED, UNIMPLEMENTED where the driver
  // cannot import host memory); the memory then still works, its copies are staged. Blocks.
  virtual absl::Status RegisterHostRegion(void* data, size_t bytes);
  // True when all of [data, data + bytes) is host memory registered with this device for direct
  // copies (always false on devices whose DirectHostCopies() is false). Thread-safe; does not
  // block on the device.
  virtual bool IsHostRegistered(const void* data, size_t bytes) const { return false; }
  virtual absl::StatusOr<std::unique_ptr<Stream>> CreateStream() = 0;
  // The simulated device's clock in seconds (the modelled end of all work so far); 0 elsewhere.
  virtual double SimulatedSeconds() const { return 0; }
  // Cumulative busy seconds by kind of work (wall time; modelled time on the simulated device),
  // for the per-phase step metrics.
  struct BusySeconds {
    double copy_in = 0;    // host to device copies
    double compute = 0;    // kernels
    double writeback = 0;  // device to host copies
  };
  virtual BusySeconds Busy() const { return {}; }
  // Bounds the device memory this device holds at once (buffers in use and those it caches for
  // reuse, including its own scratch space for kernels); Allocate and kernels that need more fail
  // with RESOURCE_EXHAUSTED. 0 restores the device's default. Devices without a pool of their own
  // (cpu, simulated) ignore it.
  virtual void SetMemoryLimit(size_t bytes) {}

 protected:
  friend class DeviceBuffer;
  virtual void Free(void* data, size_t size) = 0;
};

// A range of host memory registered with a device (Device::RegisterHostRegion), unregistered by
// the destructor. Move-only; the device must outlive it, and no copy of the range may be in flight
// when it is destroyed (hold it as long as the memory it registers, e.g. beside a shared region).
class HostRegistration {
 public:
  HostRegistration() = default;
  // Registers [data, data + bytes) with `device`; the error says why not (see RegisterHostRegion).
  static absl::StatusOr<HostRegistration> Register(Device& device, void* data, size_t bytes);
  HostRegistration(HostRegistration&& o) noexcept { *this = std::move(o); }
  HostRegistration& operator=(HostRegistration&& o) noexcept;
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  ~HostRegistration();
  bool registered() const { return device_ != nullptr; }
  size_t size() const { return size_; }

 private:
  HostRegistration(Device* device, void* data, size_t size)
      : device_(device), data_(data), size_(size) {}
  Device* device_ = nullptr;
  void* data_ = nullptr;
  size_t size_ = 0;
};

// Simulated device parameters (--backend simulated).
struct SimulatedOptions {
  double copy_gbps = 16;        // host<->device bandwidth, GB/s
  double copy_latency_us = 10;  // per copy
  double compute_gflops = 200;  // Newton-Schulz rate
  bool sleep = false;           // also spend the modelled time in wall-clock time
  // Test hook: the n-th kernel (1-based) fails with INTERNAL; 0: never.
  int fail_kernel = 0;
  // Test hooks of the direct-copy path (no flag; tests construct the device): model a device with
  // memory of its own, so that DirectHostCopies() is true and IsHostRegistered() answers for the
  // ranges RegisterHostRegion registered, and the step pipeline's direct path runs on the host;
  // `fail_register` makes every RegisterHostRegion fail (FAILED_PRECONDITION), as a driver that
  // cannot pin a region would.
  bool direct_host_copies = false;
  bool fail_register = false;
};

struct BackendChoice {
  std::unique_ptr<Device> device;
  std::string why;  // for the log and job status: which backend and why
};

// Opens the compute device for --backend: "cpu", "simulated", "cuda", "level_zero", or "auto" (the
// first GPU backend compiled in that has a working device, else cpu; `why` says which and why).
// INVALID_ARGUMENT for an unknown name or bad simulated parameters; UNAVAILABLE when a named
// backend is not compiled in or has no working device (the message says which).
absl::StatusOr<BackendChoice> OpenBackend(const std::string& name, int cpu_threads,
                                          const SimulatedOptions& simulated);

// The host-memory devices (host_device.cc): "cpu", or "simulated" when `simulated` is non-null.
std::unique_ptr<Device> NewHostDevice(int cpu_threads, const SimulatedOptions* simulated);

// The GPU backends, each in its own file, built when its toolchain is found (MUOND_HAVE_CUDA,
// MUOND_HAVE_LEVEL_ZERO); OpenBackend does not call them otherwise. Open device `ordinal`;
// UNAVAILABLE with a one-line reason when there is no driver or no device.
absl::StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int ordinal);
absl::StatusOr<std::unique_ptr<Device>> OpenLevelZeroDevice(int ordinal);

// Defined here, inline: see the declarations above Stream.
inline absl::Status CheckCopy(const DeviceBuffer& buffer, size_t offset, const void* host,
                              size_t bytes) {
  if (offset > buffer.size() || bytes > buffer.size() - offset) {
    return absl::OutOfRangeError(absl::StrCat("copy of ", bytes, " bytes at ", offset,
                                              " overruns a ", buffer.size(),
                                              "-byte device buffer"));
  }
  if (bytes > 0 && (host == nullptr || buffer.data() == nullptr)) {
    return absl::InvalidArgumentError("copy with a null host or device address");
  }
  return absl::OkStatus();
}

inline absl::Status CheckConvert(const DeviceBuffer& src, common::DType from,
                                 const DeviceBuffer& dst, common::DType to, size_t elements) {
  if (from != to && from != common::DType::kFloat32 && to != common::DType::kFloat32) {
    return absl::InvalidArgumentError(absl::StrCat("convert ", std::string(common::DTypeName(from)),
                                                   " to ", std::string(common::DTypeName(to)),
                                                   ": one side must be float32"));
  }
  const size_t in_size = common::DTypeSize(from), out_size = common::DTypeSize(to);
  if (elements > std::numeric_limits<size_t>::max() / 4 || elements * in_size > src.size() ||
      elements * out_size > dst.size()) {
    return absl::OutOfRangeError(absl::StrCat("convert of ", elements, " elements overruns a ",
                                              src.size(), "-byte source or a ", dst.size(),
                                              "-byte destination"));
  }
  if (elements > 0 && (src.data() == nullptr || dst.data() == nullptr)) {
    return absl::InvalidArgumentError("convert with a null device address");
  }
  if (elements > 0 && src.data() == dst.data()) {
    return absl::InvalidArgumentError("convert in place (source and destination are one buffer)");
  }
  return absl::OkStatus();
}

}  // namespace muond::server::device

#endif  // MUOND_SERVER_DEVICE_DEVICE_H_
