// Level Zero discovery (OpenLevelZeroDevice), the device (context, module, memory) and the event
// pool. Streams are in level_zero_stream.cc.
#include "server/device/level_zero/level_zero_device.h"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/device/level_zero/muon_kernels_spirv.h"
#include "server/device/level_zero/ze_status.h"

namespace muond::server::device {

namespace level_zero {
namespace {

constexpr uint32_t kEventsPerPool = 64;
constexpr size_t kAlignment = 256;

// Calls fn and, on error, logs it (for destructors and Free, which cannot return a Status).
#define ZE_LOG_IF_ERROR(fn, ...)                                                       \
  do {                                                                                 \
    const ze_result_t muond_ze_result_ = fn(__VA_ARGS__);                              \
    if (muond_ze_result_ != ZE_RESULT_SUCCESS) {                                       \
      MUOND_LOG(ERROR) << "level_zero: " << ZeStatus(#fn, muond_ze_result_).message(); \
    }                                                                                  \
  } while (0)

// The module's build log ("" when there is none).
std::string BuildLog(ze_module_build_log_handle_t log) {
  if (log == nullptr) return "";
  size_t size = 0;
  std::string text;
  if (zeModuleBuildLogGetString(log, &size, nullptr) == ZE_RESULT_SUCCESS && size > 0) {
    text.resize(size);
    if (zeModuleBuildLogGetString(log, &size, text.data()) != ZE_RESULT_SUCCESS) text.clear();
    while (!text.empty() && (text.back() == '\0' || text.back() == '\n')) text.pop_back();
  }
  ZE_LOG_IF_ERROR(zeModuleBuildLogDestroy, log);
  return text;
}

}  // namespace

EventPool::~EventPool() {
  absl::MutexLock lock(&mu_);
  for (ze_event_handle_t e : all_) ZE_LOG_IF_ERROR(zeEventDestroy, e);
  for (ze_event_pool_handle_t p : pools_) ZE_LOG_IF_ERROR(zeEventPoolDestroy, p);
}

absl::StatusOr<ze_event_handle_t> EventPool::Acquire() {
  absl::MutexLock lock(&mu_);
  if (free_.empty()) {
    ze_event_pool_desc_t pool_desc = {};
    pool_desc.stype = ZE_STRUCTURE_TYPE_EVENT_POOL_DESC;
    pool_desc.flags = ZE_EVENT_POOL_FLAG_HOST_VISIBLE;
    pool_desc.count = kEventsPerPool;
    ze_event_pool_handle_t pool = nullptr;
    ZE_RETURN_IF_ERROR(zeEventPoolCreate, context_, &pool_desc, 0, nullptr, &pool);
    pools_.push_back(pool);
    for (uint32_t i = 0; i < kEventsPerPool; ++i) {
      ze_event_desc_t desc = {};
      desc.stype = ZE_STRUCTURE_TYPE_EVENT_DESC;
      desc.index = i;
      desc.signal = ZE_EVENT_SCOPE_FLAG_HOST;
      desc.wait = ZE_EVENT_SCOPE_FLAG_HOST;
      ze_event_handle_t event = nullptr;
      ZE_RETURN_IF_ERROR(zeEventCreate, pool, &desc, &event);
      all_.push_back(event);
      free_.push_back(event);
    }
  }
  ze_event_handle_t event = free_.back();
  free_.pop_back();
  return event;
}

void EventPool::Release(ze_event_handle_t event) {
  ZE_LOG_IF_ERROR(zeEventHostReset, event);
  absl::MutexLock lock(&mu_);
  free_.push_back(event);
}

absl::StatusOr<std::unique_ptr<LevelZeroDevice>> LevelZeroDevice::Open(ze_driver_handle_t driver,
                                                                       ze_device_handle_t device,
                                                                       int ordinal) {
  std::unique_ptr<LevelZeroDevice> dev(
      new LevelZeroDevice(driver, device, absl::StrCat("level_zero:", ordinal)));
  const absl::Status s = dev->Init();
  if (!s.ok()) return absl::UnavailableError(absl::StrCat(dev->name_, ": ", s.message()));
  return dev;
}

absl::Status LevelZeroDevice::Init() {
  // The compute queue group (it also takes copies).
  uint32_t groups = 0;
  ZE_RETURN_IF_ERROR(zeDeviceGetCommandQueueGroupProperties, device_, &groups, nullptr);
  std::vector<ze_command_queue_group_properties_t> props(groups);
  for (auto& p : props) {
    p = {};
    p.stype = ZE_STRUCTURE_TYPE_COMMAND_QUEUE_GROUP_PROPERTIES;
  }
  ZE_RETURN_IF_ERROR(zeDeviceGetCommandQueueGroupProperties, device_, &groups, props.data());
  bool found = false;
  for (uint32_t i = 0; i < groups && !found; ++i) {
    if ((props[i].flags & ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COMPUTE) != 0) {
      compute_ordinal_ = i;
      found = true;
    }
  }
  if (!found) return absl::UnavailableError("the device has no compute queue group");

  uint32_t extensions = 0;
  ZE_RETURN_IF_ERROR(zeDriverGetExtensionProperties, driver_, &extensions, nullptr);
  std::vector<ze_driver_extension_properties_t> ext(extensions);
  ZE_RETURN_IF_ERROR(zeDriverGetExtensionProperties, driver_, &extensions, ext.data());
  for (const auto& e : ext) {
    if (std::strcmp(e.name, ZE_MEMORY_FREE_POLICIES_EXT_NAME) == 0) blocking_free_ = true;
  }
  LookUpPointerImport();

  ze_context_desc_t context_desc = {};
  context_desc.stype = ZE_STRUCTURE_TYPE_CONTEXT_DESC;
  ZE_RETURN_IF_ERROR(zeContextCreate, driver_, &context_desc, &context_);
  events_ = std::make_unique<EventPool>(context_);

  ze_module_desc_t module_desc = {};
  module_desc.stype = ZE_STRUCTURE_TYPE_MODULE_DESC;
  module_desc.format = ZE_MODULE_FORMAT_IL_SPIRV;
  module_desc.inputSize = kMuonKernelsSpirvSize;
  module_desc.pInputModule = kMuonKernelsSpirv;
  module_desc.pBuildFlags = "";
  ze_module_build_log_handle_t log = nullptr;
  const ze_result_t r = zeModuleCreate(context_, device_, &module_desc, &module_, &log);
  const std::string build_log = BuildLog(log);
  if (r != ZE_RESULT_SUCCESS) {
    module_ = nullptr;
    return absl::Status(ZeStatus("zeModuleCreate", r).code(),
                        absl::StrCat("zeModuleCreate (muon_kernels.cl): ", ZeResultName(r),
                                     build_log.empty() ? "" : "; build log: ", build_log));
  }
  return absl::OkStatus();
}

LevelZeroDevice::~LevelZeroDevice() {
  std::vector<const void*> imported;
  {
    absl::MutexLock lock(&mu_);
    imported = imported_.Starts();
  }
  for (const void* p : imported) UnregisterHost(const_cast<void*>(p), 1);
  if (module_ != nullptr) ZE_LOG_IF_ERROR(zeModuleDestroy, module_);
  events_.reset();
  if (context_ != nullptr) ZE_LOG_IF_ERROR(zeContextDestroy, context_);
}

absl::StatusOr<void*> LevelZeroDevice::AllocateDeviceMemory(size_t bytes) {
  ze_device_mem_alloc_desc_t desc = {};
  desc.stype = ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC;
  void* p = nullptr;
  ZE_RETURN_IF_ERROR(zeMemAllocDevice, context_, &desc, bytes == 0 ? 1 : bytes, kAlignment, device_,
                     &p);
  return p;
}

absl::StatusOr<void*> LevelZeroDevice::AllocateHostMemory(size_t bytes) {
  ze_host_mem_alloc_desc_t desc = {};
  desc.stype = ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC;
  void* p = nullptr;
  ZE_RETURN_IF_ERROR(zeMemAllocHost, context_, &desc, bytes == 0 ? 1 : bytes, kAlignment, &p);
  return p;
}

absl::Status LevelZeroDevice::FreeMemory(void* data) {
  if (blocking_free_) {
    ze_memory_free_ext_desc_t desc = {};
    desc.stype = ZE_STRUCTURE_TYPE_MEMORY_FREE_EXT_DESC;
    desc.freePolicy = ZE_DRIVER_MEMORY_FREE_POLICY_EXT_FLAG_BLOCKING_FREE;
    ZE_RETURN_IF_ERROR(zeMemFreeExt, context_, &desc, data);
    return absl::OkStatus();
  }
  ZE_RETURN_IF_ERROR(zeMemFree, context_, data);
  return absl::OkStatus();
}

absl::StatusOr<DeviceBuffer> LevelZeroDevice::Allocate(size_t bytes) {
  absl::StatusOr<void*> p = AllocateDeviceMemory(bytes);
  if (!p.ok()) {
    return absl::Status(p.status().code(), absl::StrCat(name_, ": cannot allocate ", bytes,
                                                        " bytes: ", p.status().message()));
  }
  return DeviceBuffer(this, *p, bytes);
}

void LevelZeroDevice::Free(void* data, size_t) {
  const absl::Status s = FreeMemory(data);
  if (!s.ok()) MUOND_LOG(ERROR) << name_ << ": " << s.message();
}

void LevelZeroDevice::LookUpPointerImport() {
  void* import_fn = nullptr;
  void* release_fn = nullptr;
  // Both or neither: an imported pointer must be released before its memory goes.
  if (zeDriverGetExtensionFunctionAddress(driver_, "zexDriverImportExternalPointer", &import_fn) ==
          ZE_RESULT_SUCCESS &&
      zeDriverGetExtensionFunctionAddress(driver_, "zexDriverReleaseImportedPointer",
                                          &release_fn) == ZE_RESULT_SUCCESS &&
      import_fn != nullptr && release_fn != nullptr) {
    import_pointer_ = reinterpret_cast<ImportPointerFn>(import_fn);
    release_pointer_ = reinterpret_cast<ReleasePointerFn>(release_fn);
  }
}

bool LevelZeroDevice::RegisterHost(void* data, size_t bytes) {
  const absl::Status s = RegisterHostRegion(data, bytes);
  if (s.ok()) return true;
  absl::MutexLock lock(&mu_);
  if (!register_host_logged_) {
    register_host_logged_ = true;
    MUOND_LOG(INFO) << s.message() << "; copies of such memory are staged by the driver";
  }
  return false;
}

absl::Status LevelZeroDevice::RegisterHostRegion(void* data, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (data == nullptr) return absl::InvalidArgumentError("import of a null host pointer");
  if (import_pointer_ == nullptr) {
    return absl::UnimplementedError(absl::StrCat(
        name_,
        ": host memory is not pinned (the driver has no zexDriverImportExternalPointer; "
        "core Level Zero cannot register existing host memory)"));
  }
  const ze_result_t r = import_pointer_(driver_, data, bytes);
  if (r != ZE_RESULT_SUCCESS) {
    const absl::Status s = ZeStatus("zexDriverImportExternalPointer", r);
    return absl::Status(s.code(), absl::StrCat(name_, ": importing ", bytes,
                                               " bytes of host memory: ", s.message()));
  }
  absl::MutexLock lock(&mu_);
  imported_.Add(data, bytes);
  return absl::OkStatus();
}

void LevelZeroDevice::UnregisterHost(void* data, size_t bytes) {
  if (data == nullptr || bytes == 0 || release_pointer_ == nullptr) return;
  {
    absl::MutexLock lock(&mu_);
    if (!imported_.Remove(data)) return;
  }
  const ze_result_t r = release_pointer_(driver_, data);
  if (r != ZE_RESULT_SUCCESS) {
    MUOND_LOG(WARNING) << name_ << ": " << ZeStatus("zexDriverReleaseImportedPointer", r);
  }
}

bool LevelZeroDevice::IsHostRegistered(const void* data, size_t bytes) const {
  absl::MutexLock lock(&mu_);
  return bytes > 0 && imported_.Covers(data, bytes);
}

absl::StatusOr<std::unique_ptr<Stream>> LevelZeroDevice::CreateStream() {
  return NewLevelZeroStream(this);
}

Device::BusySeconds LevelZeroDevice::Busy() const {
  absl::MutexLock lock(&mu_);
  return busy_;
}

void LevelZeroDevice::AddComputeSeconds(double s) {
  absl::MutexLock lock(&mu_);
  busy_.compute += s;
}

}  // namespace level_zero

absl::StatusOr<std::unique_ptr<Device>> OpenLevelZeroDevice(int ordinal) {
  using level_zero::ZeResultName;
  const ze_result_t init = zeInit(ZE_INIT_FLAG_GPU_ONLY);
  if (init != ZE_RESULT_SUCCESS) {
    return absl::UnavailableError(
        absl::StrCat("no Level Zero driver: zeInit: ", ZeResultName(init)));
  }
  uint32_t driver_count = 0;
  const ze_result_t got = zeDriverGet(&driver_count, nullptr);
  if (got != ZE_RESULT_SUCCESS) {
    return absl::UnavailableError(
        absl::StrCat("no Level Zero driver: zeDriverGet: ", ZeResultName(got)));
  }
  if (driver_count == 0) return absl::UnavailableError("zeDriverGet found no driver");
  std::vector<ze_driver_handle_t> drivers(driver_count);
  ZE_RETURN_IF_ERROR(zeDriverGet, &driver_count, drivers.data());

  struct Gpu {
    ze_driver_handle_t driver;
    ze_device_handle_t device;
    std::string name;
  };
  std::vector<Gpu> gpus;
  uint32_t devices_seen = 0;
  for (ze_driver_handle_t driver : drivers) {
    uint32_t count = 0;
    ZE_RETURN_IF_ERROR(zeDeviceGet, driver, &count, nullptr);
    std::vector<ze_device_handle_t> devices(count);
    ZE_RETURN_IF_ERROR(zeDeviceGet, driver, &count, devices.data());
    devices_seen += count;
    for (ze_device_handle_t device : devices) {
      ze_device_properties_t props = {};
      props.stype = ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES;
      ZE_RETURN_IF_ERROR(zeDeviceGetProperties, device, &props);
      if (props.type == ZE_DEVICE_TYPE_GPU) gpus.push_back({driver, device, props.name});
    }
  }
  if (gpus.empty()) {
    return absl::UnavailableError(absl::StrCat("no Level Zero GPU: ", driver_count,
                                               " driver(s) with ", devices_seen,
                                               " device(s), none of them a GPU"));
  }
  if (ordinal < 0 || static_cast<size_t>(ordinal) >= gpus.size()) {
    return absl::UnavailableError(
        absl::StrCat("no Level Zero GPU ", ordinal, " (", gpus.size(), " found)"));
  }
  const Gpu& gpu = gpus[static_cast<size_t>(ordinal)];
  auto dev = level_zero::LevelZeroDevice::Open(gpu.driver, gpu.device, ordinal);
  if (!dev.ok()) return dev.status();
  MUOND_LOG(INFO) << (*dev)->name() << ": " << gpu.name;
  return std::unique_ptr<Device>(*std::move(dev));
}

}  // namespace muond::server::device
