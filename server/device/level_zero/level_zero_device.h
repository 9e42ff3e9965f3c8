// The Level Zero backend (DESIGN.md 6), internal to server/device/level_zero: the rest of the
// daemon reaches it through OpenLevelZeroDevice (server/device/device.h) and the Device/Stream/
// Event interfaces, and never includes Level Zero headers.
//
// Objects: LevelZeroDevice owns the context, the module built from the embedded SPIR-V
// (muon_kernels.cl) and a pool of host-visible events; each Stream (level_zero_stream.cc) owns an
// immediate command list on the device's compute queue group, its own kernel objects (kernel
// arguments are per kernel object, so streams do not share them) and a worker thread that appends
// to the list in order (immediate command lists are not thread-safe). Device memory is USM device
// memory (zeMemAllocDevice); host staging for reads is USM host memory (zeMemAllocHost).
//
// Thread-safety: LevelZeroDevice and EventPool are thread-safe. The device must outlive its
// streams, events and buffers.
#ifndef MUOND_SERVER_DEVICE_LEVEL_ZERO_LEVEL_ZERO_DEVICE_H_
#define MUOND_SERVER_DEVICE_LEVEL_ZERO_LEVEL_ZERO_DEVICE_H_

#include <level_zero/ze_api.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/device/device.h"
#include "server/device/host_ranges.h"

namespace muond::server::device::level_zero {

// Host-visible events, created in pools of a fixed size as needed and reused.
class EventPool {
 public:
  explicit EventPool(ze_context_handle_t context) : context_(context) {}
  ~EventPool();
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // A reset event (signal and wait scopes: host, so the host sees memory written before it).
  absl::StatusOr<ze_event_handle_t> Acquire();
  // Resets `event` and keeps it for reuse. REQUIRES: no command still signals or waits on it.
  void Release(ze_event_handle_t event);

 private:
  const ze_context_handle_t context_;
  absl::Mutex mu_;
  std::vector<ze_event_pool_handle_t> pools_ ABSL_GUARDED_BY(mu_);
  std::vector<ze_event_handle_t> all_ ABSL_GUARDED_BY(mu_);
  std::vector<ze_event_handle_t> free_ ABSL_GUARDED_BY(mu_);
};

class LevelZeroDevice final : public Device {
 public:
  // Creates the context and builds the module on `device` of `driver`. UNAVAILABLE (naming the
  // failed call, with the build log for the module) when the device cannot be used.
  static absl::StatusOr<std::unique_ptr<LevelZeroDevice>> Open(ze_driver_handle_t driver,
                                                               ze_device_handle_t device,
                                                               int ordinal);
  ~LevelZeroDevice() override;

  std::string name() const override { return name_; }
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override;
  // Core Level Zero cannot pin existing host memory: only memory it allocates itself
  // (zeMemAllocHost) is USM host memory. Where the driver offers Intel's import extension
  // (zexDriverImportExternalPointer, looked up with zeDriverGetExtensionFunctionAddress), a
  // range is imported and the copy engines then read and write it in place; otherwise
  // RegisterHostRegion is UNIMPLEMENTED (logged once by RegisterHost) and copies of the memory
  // still work, staged by the driver. Not run here (no Level Zero driver on the build machine).
  bool RegisterHost(void* data, size_t bytes) override;
  void UnregisterHost(void* data, size_t bytes) override;
  bool DirectHostCopies() const override { return true; }
  absl::Status RegisterHostRegion(void* data, size_t bytes) override;
  bool IsHostRegistered(const void* data, size_t bytes) const override;
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override;
  // compute: wall time of the Muon kernel calls (each ends with a blocking read of its flags);
  // copies are asynchronous on the command lists and are not timed (0).
  BusySeconds Busy() const override;

  // For the streams.
  ze_context_handle_t context() const { return context_; }
  ze_device_handle_t device() const { return device_; }
  ze_module_handle_t module() const { return module_; }
  uint32_t compute_ordinal() const { return compute_ordinal_; }
  EventPool& events() { return *events_; }
  void AddComputeSeconds(double s);
  // Allocates / frees USM memory (device memory, or host memory for staging).
  absl::StatusOr<void*> AllocateDeviceMemory(size_t bytes);
  absl::StatusOr<void*> AllocateHostMemory(size_t bytes);
  // Frees USM memory; with the driver's blocking free policy when it has one, so that memory
  // still used by queued commands is freed only once they finished.
  absl::Status FreeMemory(void* data);

 protected:
  void Free(void* data, size_t size) override;

 private:
  LevelZeroDevice(ze_driver_handle_t driver, ze_device_handle_t device, std::string name)
      : driver_(driver), device_(device), name_(std::move(name)) {}
  absl::Status Init();
  // Looks up the driver's host pointer import (import_pointer_, release_pointer_).
  void LookUpPointerImport();

  const ze_driver_handle_t driver_;
  const ze_device_handle_t device_;
  const std::string name_;
  ze_context_handle_t context_ = nullptr;
  ze_module_handle_t module_ = nullptr;
  uint32_t compute_ordinal_ = 0;
  bool blocking_free_ = false;  // ZE_extension_memory_free_policies
  // Intel's host pointer import (null where the driver has none); set once by Init.
  using ImportPointerFn = ze_result_t (*)(ze_driver_handle_t, void*, size_t);
  using ReleasePointerFn = ze_result_t (*)(ze_driver_handle_t, void*);
  ImportPointerFn import_pointer_ = nullptr;
  ReleasePointerFn release_pointer_ = nullptr;
  std::unique_ptr<EventPool> events_;
  mutable absl::Mutex mu_;
  BusySeconds busy_ ABSL_GUARDED_BY(mu_);
  bool register_host_logged_ ABSL_GUARDED_BY(mu_) = false;
  HostRanges imported_ ABSL_GUARDED_BY(mu_);
};

// A stream of `device` (level_zero_stream.cc).
absl::StatusOr<std::unique_ptr<Stream>> NewLevelZeroStream(LevelZeroDevice* device);

}  // namespace muond::server::device::level_zero

#endif  // MUOND_SERVER_DEVICE_LEVEL_ZERO_LEVEL_ZERO_DEVICE_H_
