// A Level Zero stream: one immediate command list, appended to by one worker thread in the order
// the operations were enqueued, as HostStream does (server/device/host_device.cc): the first error
// sticks (later operations are skipped) until the next recorded event, which reports it.
//
// Ordering: commands of a Level Zero command list may overlap unless separated, so every copy and
// kernel is followed by a barrier; the list is then in order like a CUDA stream. Events are
// barriers that signal a pooled host-visible event. WaitFor is a host-side wait on the worker:
// it blocks until the other stream's event is reached, then lets later work be appended (the
// waited-for event is never referenced by this list, so its reuse cannot race with it).
// Muon runs the shared kernel driver (muon_kernel_driver.cc) on the worker with the stream as its
// KernelQueue; the driver ends with a blocking read of its non-finite flags.
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/device/level_zero/convert_elements.h"
#include "server/device/level_zero/kernel_queue.h"
#include "server/device/level_zero/level_zero_device.h"
#include "server/device/level_zero/muon_kernel_driver.h"
#include "server/device/level_zero/ze_status.h"

namespace muond::server::device::level_zero {
namespace {

class LevelZeroEvent final : public Event {
 public:
  LevelZeroEvent(LevelZeroDevice* device, ze_event_handle_t event)
      : device_(device), event_(event) {}
  ~LevelZeroEvent() override {
    // An event appended to a list is reset only once it was signalled.
    if (signalled_on_device_) {
      const ze_result_t r = zeEventHostSynchronize(event_, UINT64_MAX);
      if (r != ZE_RESULT_SUCCESS) {
        // Not reusable: the list may still signal it. It is destroyed with the device's pool.
        MUOND_LOG(ERROR) << device_->name() << ": " << ZeStatus("zeEventHostSynchronize", r);
        return;
      }
    }
    device_->events().Release(event_);
  }

  absl::Status Wait() override {
    absl::Status status;
    bool on_device = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&reached_by_worker_));
      status = status_;
      on_device = signalled_on_device_;
    }
    if (on_device) {
      ZE_RETURN_IF_ERROR(zeEventHostSynchronize, event_, UINT64_MAX);
    }
    return status;
  }
  bool Done() const override {
    absl::MutexLock lock(&mu_);
    if (!reached_by_worker_) return false;
    return !signalled_on_device_ || zeEventQueryStatus(event_) == ZE_RESULT_SUCCESS;
  }

  ze_event_handle_t handle() const { return event_; }
  // The worker appended the signal (on_device) or could not; `status` is the stream's first error
  // before the event.
  void ReachedByWorker(const absl::Status& status, bool on_device) {
    absl::MutexLock lock(&mu_);
    status_ = status;
    signalled_on_device_ = on_device;
    reached_by_worker_ = true;
  }

 private:
  LevelZeroDevice* const device_;
  const ze_event_handle_t event_;
  mutable absl::Mutex mu_;
  bool reached_by_worker_ ABSL_GUARDED_BY(mu_) = false;
  bool signalled_on_device_ = false;  // written once before reached_by_worker_ is set
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

class LevelZeroStream;

// Driver scratch memory: freed after the stream's list finished the work that used it.
class StreamScratch final : public QueueBuffer {
 public:
  StreamScratch(LevelZeroStream* stream, void* data) : stream_(stream), data_(data) {}
  ~StreamScratch() override;
  KernelBufferRef ref() const override { return {data_}; }

 private:
  LevelZeroStream* const stream_;
  void* const data_;
};

class LevelZeroStream final : public Stream, public KernelQueue {
 public:
  explicit LevelZeroStream(LevelZeroDevice* device) : device_(device) {}
  ~LevelZeroStream() override;
  // Creates the command list and the worker.
  absl::Status Init();

  // Stream (device.h checked the arguments of the Enqueue* halves).
  absl::Status EnqueueCopyToDevice(DeviceBuffer& dst, size_t offset, const void* src,
                                   size_t bytes) override;
  absl::Status EnqueueCopyToHost(void* dst, const DeviceBuffer& src, size_t offset,
                                 size_t bytes) override;
  absl::Status EnqueueConvert(const DeviceBuffer& src, common::DType from, DeviceBuffer& dst,
                              common::DType to, size_t elements, float scale) override;
  absl::Status Muon(const common::MuonConfig& config, std::vector<MuonKernelItem> items) override;
  absl::StatusOr<std::shared_ptr<Event>> Record() override;
  absl::Status WaitFor(std::shared_ptr<Event> event) override;
  absl::Status Synchronize() override;

  // KernelQueue, used by the driver on the worker thread only.
  absl::StatusOr<std::unique_ptr<QueueBuffer>> Allocate(size_t bytes) override;
  absl::Status Launch(const char* name, const std::vector<KernelArg>& args, LaunchSize global,
                      LaunchSize local) override;
  absl::Status Read(KernelBufferRef src, size_t offset, void* dst, size_t bytes) override;

  // Worker thread: blocks until every command appended so far has completed.
  absl::Status DrainList();
  LevelZeroDevice* device() const { return device_; }

 private:
  struct Op {
    std::function<absl::Status()> run;
    std::shared_ptr<LevelZeroEvent> record;    // reach this event
    std::shared_ptr<LevelZeroEvent> wait_for;  // wait for this event (host side)
  };
  void Enqueue(Op op);
  void Loop();
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !ops_.empty(); }
  absl::Status AppendInOrder(const char* what, ze_result_t appended);
  // Worker thread: Convert's launches.
  absl::Status AppendConvert(const void* src, common::DType from, void* dst, common::DType to,
                             int64_t elements, float scale);

  LevelZeroDevice* const device_;
  ze_command_list_handle_t list_ = nullptr;
  absl::Mutex mu_;
  std::deque<Op> ops_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;
  // Worker-thread state.
  absl::Status error_;
  std::map<std::string, ze_kernel_handle_t> kernels_;
  ze_event_handle_t drain_event_ = nullptr;
  void* staging_ = nullptr;  // USM host memory for Read
  size_t staging_size_ = 0;
};

StreamScratch::~StreamScratch() {
  absl::Status s = stream_->DrainList();
  if (s.ok()) s = stream_->device()->FreeMemory(data_);
  if (!s.ok()) MUOND_LOG(ERROR) << stream_->device()->name() << ": scratch memory: " << s;
}

absl::Status LevelZeroStream::Init() {
  ze_command_queue_desc_t desc = {};
  desc.stype = ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC;
  desc.ordinal = device_->compute_ordinal();
  desc.index = 0;
  desc.mode = ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS;
  desc.priority = ZE_COMMAND_QUEUE_PRIORITY_NORMAL;
  ZE_RETURN_IF_ERROR(zeCommandListCreateImmediate, device_->context(), device_->device(), &desc,
                     &list_);
  ASSIGN_OR_RETURN(drain_event_, device_->events().Acquire());
  worker_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

LevelZeroStream::~LevelZeroStream() {
  if (worker_.joinable()) {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    worker_.join();
  }
  if (list_ != nullptr) {
    const absl::Status s = DrainList();
    if (!s.ok()) MUOND_LOG(ERROR) << device_->name() << ": closing a stream: " << s;
  }
  for (auto& [name, kernel] : kernels_) {
    if (zeKernelDestroy(kernel) != ZE_RESULT_SUCCESS) {
      MUOND_LOG(ERROR) << device_->name() << ": zeKernelDestroy(" << name << ") failed";
    }
  }
  if (staging_ != nullptr) {
    const absl::Status s = device_->FreeMemory(staging_);
    if (!s.ok()) MUOND_LOG(ERROR) << device_->name() << ": " << s;
  }
  if (drain_event_ != nullptr) device_->events().Release(drain_event_);
  if (list_ != nullptr && zeCommandListDestroy(list_) != ZE_RESULT_SUCCESS) {
    MUOND_LOG(ERROR) << device_->name() << ": zeCommandListDestroy failed";
  }
}

absl::Status LevelZeroStream::AppendInOrder(const char* what, ze_result_t appended) {
  if (appended != ZE_RESULT_SUCCESS) return ZeStatus(what, appended);
  ZE_RETURN_IF_ERROR(zeCommandListAppendBarrier, list_, nullptr, 0, nullptr);
  return absl::OkStatus();
}

absl::Status LevelZeroStream::DrainList() {
  ZE_RETURN_IF_ERROR(zeCommandListAppendBarrier, list_, drain_event_, 0, nullptr);
  ZE_RETURN_IF_ERROR(zeEventHostSynchronize, drain_event_, UINT64_MAX);
  ZE_RETURN_IF_ERROR(zeEventHostReset, drain_event_);
  return absl::OkStatus();
}

void LevelZeroStream::Enqueue(Op op) {
  absl::MutexLock lock(&mu_);
  ops_.push_back(std::move(op));
}

absl::Status LevelZeroStream::EnqueueCopyToDevice(DeviceBuffer& dst, size_t offset,
                                                  const void* src, size_t bytes) {
  void* to = static_cast<char*>(dst.data()) + offset;
  Enqueue({[this, to, src, bytes] {
             return AppendInOrder(
                 "zeCommandListAppendMemoryCopy (to device)",
                 zeCommandListAppendMemoryCopy(list_, to, src, bytes, nullptr, 0, nullptr));
           },
           nullptr, nullptr});
  return absl::OkStatus();
}

absl::Status LevelZeroStream::EnqueueCopyToHost(void* dst, const DeviceBuffer& src,
                                                size_t offset, size_t bytes) {
  const void* from = static_cast<const char*>(src.data()) + offset;
  Enqueue({[this, dst, from, bytes] {
             return AppendInOrder(
                 "zeCommandListAppendMemoryCopy (to host)",
                 zeCommandListAppendMemoryCopy(list_, dst, from, bytes, nullptr, 0, nullptr));
           },
           nullptr, nullptr});
  return absl::OkStatus();
}

// The widening of gradients and narrowing of updates of the direct path (device.h), with the
// convert kernel of muon_kernels.cl (ConvertElements; round to nearest even, as the host). Not
// run on a Level Zero device here (no driver on the build machine); ConvertElements itself runs
// on PoCL in tests/gpu/level_zero_convert_opencl_test.cc.
absl::Status LevelZeroStream::EnqueueConvert(const DeviceBuffer& src, common::DType from,
                                             DeviceBuffer& dst, common::DType to, size_t elements,
                                             float scale) {
  if (elements == 0) return absl::OkStatus();
  const void* in = src.data();
  void* out = dst.data();
  const auto n = static_cast<int64_t>(elements);
  Enqueue(
      {[this, in, from, out, to, n, scale] { return AppendConvert(in, from, out, to, n, scale); },
       nullptr, nullptr});
  return absl::OkStatus();
}

absl::Status LevelZeroStream::AppendConvert(const void* src, common::DType from, void* dst,
                                            common::DType to, int64_t elements, float scale) {
  if (from == to && scale == 1.0f) {
    return AppendInOrder(
        "zeCommandListAppendMemoryCopy (device to device)",
        zeCommandListAppendMemoryCopy(list_, dst, src,
                                      static_cast<size_t>(elements) * common::DTypeSize(from),
                                      nullptr, 0, nullptr));
  }
  return ConvertElements(*this, {const_cast<void*>(src)}, from, {dst}, to, elements, scale);
}

absl::Status LevelZeroStream::Muon(const common::MuonConfig& config,
                                   std::vector<MuonKernelItem> items) {
  std::vector<KernelMuonItem> kernel_items;
  for (const MuonKernelItem& it : items) {
    if (it.momentum_out != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("matrix '", it.spec->name,
                       "': a separate momentum output is for host-memory devices; the Level Zero "
                       "kernel updates its device copy of the momentum in place"));
    }
    if (it.held_in != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("matrix '", it.spec->name,
                       "': momentum held compressed in host memory is for host-memory devices; "
                       "the Level Zero kernel takes a device copy of its decoding"));
    }
    kernel_items.push_back({it.spec, {it.grad_update->data()}, {it.momentum->data()}});
  }
  Enqueue({[this, config, kernel_items = std::move(kernel_items)] {
             const absl::Time start = absl::Now();
             absl::Status s = RunMuon(*this, config, kernel_items);
             device_->AddComputeSeconds(absl::ToDoubleSeconds(absl::Now() - start));
             return s;
           },
           nullptr, nullptr});
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Event>> LevelZeroStream::Record() {
  ASSIGN_OR_RETURN(ze_event_handle_t handle, device_->events().Acquire());
  auto event = std::make_shared<LevelZeroEvent>(device_, handle);
  Enqueue({nullptr, event, nullptr});
  return std::shared_ptr<Event>(event);
}

absl::Status LevelZeroStream::WaitFor(std::shared_ptr<Event> event) {
  auto ze = std::dynamic_pointer_cast<LevelZeroEvent>(event);
  if (ze == nullptr) return absl::InvalidArgumentError("event of another device");
  Enqueue({nullptr, nullptr, std::move(ze)});
  return absl::OkStatus();
}

absl::Status LevelZeroStream::Synchronize() {
  ASSIGN_OR_RETURN(std::shared_ptr<Event> event, Record());
  return event->Wait();
}

void LevelZeroStream::Loop() {
  while (true) {
    Op op;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &LevelZeroStream::HasWork));
      if (ops_.empty()) return;
      op = std::move(ops_.front());
      ops_.pop_front();
    }
    if (op.wait_for != nullptr) {
      const absl::Status s = op.wait_for->Wait();
      if (error_.ok() && !s.ok()) error_ = s;
    } else if (op.record != nullptr) {
      // An error is reported to the first event after it, then the stream is usable again.
      const ze_result_t r = zeCommandListAppendBarrier(list_, op.record->handle(), 0, nullptr);
      absl::Status s = error_;
      if (r != ZE_RESULT_SUCCESS && s.ok()) s = ZeStatus("zeCommandListAppendBarrier", r);
      op.record->ReachedByWorker(s, r == ZE_RESULT_SUCCESS);
      error_ = absl::OkStatus();
    } else if (error_.ok()) {
      error_ = op.run();
    }
  }
}

absl::StatusOr<std::unique_ptr<QueueBuffer>> LevelZeroStream::Allocate(size_t bytes) {
  ASSIGN_OR_RETURN(void* p, device_->AllocateDeviceMemory(bytes));
  return std::unique_ptr<QueueBuffer>(new StreamScratch(this, p));
}

absl::Status LevelZeroStream::Launch(const char* name, const std::vector<KernelArg>& args,
                                     LaunchSize global, LaunchSize local) {
  ze_kernel_handle_t& kernel = kernels_[name];
  if (kernel == nullptr) {
    ze_kernel_desc_t desc = {};
    desc.stype = ZE_STRUCTURE_TYPE_KERNEL_DESC;
    desc.pKernelName = name;
    const ze_result_t r = zeKernelCreate(device_->module(), &desc, &kernel);
    if (r != ZE_RESULT_SUCCESS) {
      kernels_.erase(name);
      const absl::Status s = ZeStatus("zeKernelCreate", r);
      return r == ZE_RESULT_ERROR_INVALID_KERNEL_NAME
                 ? absl::NotFoundError(absl::StrCat("kernel ", name, ": ", s.message()))
                 : absl::Status(s.code(), absl::StrCat("kernel ", name, ": ", s.message()));
    }
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const KernelArg& a = args[i];
    const auto index = static_cast<uint32_t>(i);
    switch (a.kind) {
      case KernelArg::Kind::kBuffer:
        ZE_RETURN_IF_ERROR(zeKernelSetArgumentValue, kernel, index, sizeof(void*), &a.buffer);
        break;
      case KernelArg::Kind::kInt:
        ZE_RETURN_IF_ERROR(zeKernelSetArgumentValue, kernel, index, sizeof(a.i32), &a.i32);
        break;
      case KernelArg::Kind::kLong:
        ZE_RETURN_IF_ERROR(zeKernelSetArgumentValue, kernel, index, sizeof(a.i64), &a.i64);
        break;
      case KernelArg::Kind::kFloat:
        ZE_RETURN_IF_ERROR(zeKernelSetArgumentValue, kernel, index, sizeof(a.f32), &a.f32);
        break;
    }
  }
  ZE_RETURN_IF_ERROR(zeKernelSetGroupSize, kernel, static_cast<uint32_t>(local.x),
                     static_cast<uint32_t>(local.y), static_cast<uint32_t>(local.z));
  ze_group_count_t groups = {static_cast<uint32_t>(global.x / local.x),
                             static_cast<uint32_t>(global.y / local.y),
                             static_cast<uint32_t>(global.z / local.z)};
  return AppendInOrder(
      "zeCommandListAppendLaunchKernel",
      zeCommandListAppendLaunchKernel(list_, kernel, &groups, nullptr, 0, nullptr));
}

absl::Status LevelZeroStream::Read(KernelBufferRef src, size_t offset, void* dst, size_t bytes) {
  if (staging_size_ < bytes) {
    if (staging_ != nullptr) {
      RETURN_IF_ERROR(DrainList());
      RETURN_IF_ERROR(device_->FreeMemory(staging_));
      staging_ = nullptr;
      staging_size_ = 0;
    }
    ASSIGN_OR_RETURN(staging_, device_->AllocateHostMemory(bytes));
    staging_size_ = bytes;
  }
  const void* from = static_cast<const char*>(src.handle) + offset;
  RETURN_IF_ERROR(AppendInOrder(
      "zeCommandListAppendMemoryCopy (read)",
      zeCommandListAppendMemoryCopy(list_, staging_, from, bytes, nullptr, 0, nullptr)));
  RETURN_IF_ERROR(DrainList());
  std::memcpy(dst, staging_, bytes);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Stream>> NewLevelZeroStream(LevelZeroDevice* device) {
  auto stream = std::make_unique<LevelZeroStream>(device);
  const absl::Status s = stream->Init();
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(device->name(), ": ", s.message()));
  return std::unique_ptr<Stream>(std::move(stream));
}

}  // namespace muond::server::device::level_zero
