// The host-memory devices: "cpu" (streams are worker threads, kernels run the LibTorch math) and
// "simulated" (the same, plus a modelled device clock: copies cost latency + bytes / bandwidth,
// kernels cost flops / rate, streams advance their own timelines and events carry timestamps, so
// overlap can be measured and tested without a GPU). The host has a clock too: waiting for an
// event moves it to the event's time, and work enqueued later starts no earlier (as on a GPU,
// where the host enqueues after it saw the event), so a serial schedule costs the sum of its
// stages on the modelled clock. Neither copies from registered memory directly (their "device"
// memory is host memory: steps keep the host assembly), except the simulated device in its
// direct-copy test mode (SimulatedOptions::direct_host_copies), which stands in for a GPU so that
// the step pipeline's direct path runs and is checked on any machine.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/dtype.h"
#include "server/device/device.h"
#include "server/device/host_ranges.h"
#include "server/optim/muon_math.h"

namespace muond::server::device {

namespace {

class HostDevice;

class HostEvent final : public Event {
 public:
  explicit HostEvent(HostDevice* device) : device_(device) {}
  // The host waits: the device's host clock moves to the event's time (work the host enqueues
  // afterwards cannot start earlier).
  absl::Status Wait() override;
  // A stream worker waits (WaitFor): the host clock is not involved.
  absl::Status WaitOnDevice() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
    return status_;
  }
  bool Done() const override {
    absl::MutexLock lock(&mu_);
    return done_;
  }
  void Reach(const absl::Status& status, double sim_time) {
    absl::MutexLock lock(&mu_);
    status_ = status;
    sim_time_ = sim_time;
    done_ = true;
  }
  double sim_time() const {
    absl::MutexLock lock(&mu_);
    return sim_time_;
  }

 private:
  HostDevice* const device_;
  mutable absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  double sim_time_ ABSL_GUARDED_BY(mu_) = 0;
};

// An in-order stream: one worker thread running the enqueued operations. The first error sticks
// (later operations are skipped and events report it), as on CUDA.
class HostStream final : public Stream {
 public:
  HostStream(HostDevice* device, int math_threads);
  ~HostStream() override;

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

 private:
  // Runs `op` on the worker; `sim_cost` is its modelled duration (simulated device).
  void Enqueue(std::function<absl::Status()> op, double sim_cost, int kind);
  void Loop(int math_threads);
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !ops_.empty(); }

  struct Op {
    std::function<absl::Status()> run;
    double sim_cost = 0;
    double not_before = 0;  // the host clock when enqueued (the op cannot start earlier)
    std::shared_ptr<HostEvent> wait_for;  // a cross-stream dependency
    std::shared_ptr<HostEvent> record;    // an event to reach
    int kind = 0;                         // 0 copy in, 1 kernel, 2 writeback (for HostDevice::Busy)
  };
  HostDevice* device_;
  absl::Mutex mu_;
  std::deque<Op> ops_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // Worker-thread state.
  absl::Status error_;
  double sim_time_ = 0;
  std::thread worker_;
};

class HostDevice final : public Device {
 public:
  HostDevice(std::string name, int math_threads, const SimulatedOptions* sim)
      : name_(std::move(name)), math_threads_(math_threads) {
    if (sim != nullptr) {
      simulated_ = true;
      sim_ = *sim;
    }
  }
  std::string name() const override { return name_; }
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    void* p = std::malloc(std::max<size_t>(bytes, 1));
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat(name_, ": cannot allocate ", bytes, " bytes"));
    }
    return DeviceBuffer(this, p, bytes);
  }
  // Locks are per page and not counted: locking a buffer's partial edge pages, which other heap
  // data shares, and unlocking them when the buffer goes would silently unlock a neighbour's
  // locked bytes. Only the pages the buffer owns whole are locked (a small buffer: none).
  bool RegisterHost(void* data, size_t bytes) override {
    const auto [at, n] = WholePages(data, bytes);
    return n == 0 || mlock(at, n) == 0;
  }
  void UnregisterHost(void* data, size_t bytes) override {
    {
      absl::MutexLock lock(&mu_);
      direct_.Remove(data);
    }
    const auto [at, n] = WholePages(data, bytes);
    if (n != 0) munlock(at, n);
  }
  // The direct-copy test hooks (SimulatedOptions): registered ranges are remembered so that the
  // step pipeline's direct path can be run and checked without a GPU.
  bool DirectHostCopies() const override { return simulated_ && sim_.direct_host_copies; }
  // The cpu device's kernels run on host memory in place; the simulated one keeps its copies.
  bool ComputesInHostMemory() const override { return !simulated_; }
  absl::Status RegisterHostRegion(void* data, size_t bytes) override {
    if (simulated_ && sim_.fail_register) {
      return absl::FailedPreconditionError(
          absl::StrCat(name_, ": registration of ", bytes,
                       " bytes refused (test hook SimulatedOptions::fail_register)"));
    }
    if (!RegisterHost(data, bytes)) {
      const int err = errno;
      return absl::ResourceExhaustedError(
          absl::StrCat(name_, ": mlock of ", bytes, " bytes: ", std::strerror(err)));
    }
    if (DirectHostCopies()) {
      absl::MutexLock lock(&mu_);
      direct_.Add(data, bytes);
    }
    return absl::OkStatus();
  }
  bool IsHostRegistered(const void* data, size_t bytes) const override {
    if (!DirectHostCopies()) return false;
    absl::MutexLock lock(&mu_);
    return direct_.Covers(data, bytes);
  }
  static std::pair<void*, size_t> WholePages(void* data, size_t bytes) {
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
    const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / page * page;
    if (end <= begin) return {nullptr, 0};
    return {reinterpret_cast<void*>(begin), static_cast<size_t>(end - begin)};
  }
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    return std::unique_ptr<Stream>(new HostStream(this, math_threads_));
  }
  BusySeconds Busy() const override {
    absl::MutexLock lock(&mu_);
    return busy_;
  }
  void AddBusy(int kind, double seconds) {
    absl::MutexLock lock(&mu_);
    (kind == 0 ? busy_.copy_in : kind == 1 ? busy_.compute : busy_.writeback) += seconds;
  }
  double SimulatedSeconds() const override {
    absl::MutexLock lock(&mu_);
    return sim_end_;
  }

  bool simulated() const { return simulated_; }
  const SimulatedOptions& sim() const { return sim_; }
  double CopyCost(size_t bytes) const {
    return simulated_
               ? sim_.copy_latency_us * 1e-6 + static_cast<double>(bytes) / (sim_.copy_gbps * 1e9)
               : 0;
  }
  double KernelCost(double flops) const {
    return simulated_ ? flops / (sim_.compute_gflops * 1e9) : 0;
  }
  // Counts kernels; true when this one must fail (SimulatedOptions::fail_kernel).
  bool InjectKernelFailure() {
    absl::MutexLock lock(&mu_);
    return sim_.fail_kernel > 0 && ++kernels_ == sim_.fail_kernel;
  }
  void AdvanceClock(double t) {
    absl::MutexLock lock(&mu_);
    sim_end_ = std::max(sim_end_, t);
  }
  // The host clock: the latest simulated time the host has seen reached (Event::Wait,
  // Stream::Synchronize). Work enqueued after that cannot start before it, as on a real device.
  void ObserveOnHost(double t) {
    absl::MutexLock lock(&mu_);
    host_time_ = std::max(host_time_, t);
  }
  double HostTime() const {
    absl::MutexLock lock(&mu_);
    return host_time_;
  }

 protected:
  void Free(void* data, size_t) override { std::free(data); }

 private:
  const std::string name_;
  const int math_threads_;
  bool simulated_ = false;
  SimulatedOptions sim_;
  mutable absl::Mutex mu_;
  double sim_end_ ABSL_GUARDED_BY(mu_) = 0;
  double host_time_ ABSL_GUARDED_BY(mu_) = 0;
  int kernels_ ABSL_GUARDED_BY(mu_) = 0;
  BusySeconds busy_ ABSL_GUARDED_BY(mu_);
  HostRanges direct_ ABSL_GUARDED_BY(mu_);  // test mode: ranges registered for direct copies
};

absl::Status HostEvent::Wait() {
  absl::Status status = WaitOnDevice();
  device_->ObserveOnHost(sim_time());
  return status;
}

HostStream::HostStream(HostDevice* device, int math_threads)
    : device_(device), worker_([this, math_threads] { Loop(math_threads); }) {}

HostStream::~HostStream() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  worker_.join();
}

void HostStream::Enqueue(std::function<absl::Status()> op, double sim_cost, int kind) {
  const double not_before = device_->HostTime();
  absl::MutexLock lock(&mu_);
  ops_.push_back(Op{std::move(op), sim_cost, not_before, nullptr, nullptr, kind});
}

absl::Status HostStream::EnqueueCopyToDevice(DeviceBuffer& dst, size_t offset, const void* src,
                                             size_t bytes) {
  char* to = static_cast<char*>(dst.data()) + offset;
  Enqueue(
      [to, src, bytes] {
        std::memcpy(to, src, bytes);
        return absl::OkStatus();
      },
      device_->CopyCost(bytes), 0);
  return absl::OkStatus();
}

absl::Status HostStream::EnqueueCopyToHost(void* dst, const DeviceBuffer& src, size_t offset,
                                           size_t bytes) {
  const char* from = static_cast<const char*>(src.data()) + offset;
  Enqueue(
      [dst, from, bytes] {
        std::memcpy(dst, from, bytes);
        return absl::OkStatus();
      },
      device_->CopyCost(bytes), 2);
  return absl::OkStatus();
}

absl::Status HostStream::EnqueueConvert(const DeviceBuffer& src, common::DType from,
                                        DeviceBuffer& dst, common::DType to, size_t elements,
                                        float scale) {
  const void* in = src.data();
  void* out = dst.data();
  // Memory-bound work on the "device" (host memory here): not modelled on the simulated clock,
  // as the link is two orders of magnitude slower than a GPU's memory.
  Enqueue(
      [in, from, out, to, elements, scale] {
        if (from == to && scale == 1.0f) {
          std::memcpy(out, in, elements * common::DTypeSize(from));
        } else if (scale == 1.0f && to == common::DType::kFloat32) {
          common::ToFloat32(from, in, elements, static_cast<float*>(out));
        } else if (scale == 1.0f) {
          common::FromFloat32(static_cast<const float*>(in), elements, to, out);
        } else {
          // Widen, scale, narrow, a block at a time.
          constexpr size_t kBlock = 4096;
          float block[kBlock];
          const size_t in_size = common::DTypeSize(from), out_size = common::DTypeSize(to);
          for (size_t at = 0; at < elements; at += kBlock) {
            const size_t n = std::min(kBlock, elements - at);
            common::ToFloat32(from, static_cast<const char*>(in) + at * in_size, n, block);
            for (size_t i = 0; i < n; ++i) block[i] *= scale;
            common::FromFloat32(block, n, to, static_cast<char*>(out) + at * out_size);
          }
        }
        return absl::OkStatus();
      },
      0, 1);
  return absl::OkStatus();
}

namespace {

// A kernel call's items by Newton-Schulz batch: same-shape matrices (equal shape and heads, and
// both with or both without held momentum) go into one batched Newton-Schulz, and the groups
// into one call (their Newton-Schulz shares the compute threads' barriers).
struct KernelGroup {
  std::vector<const common::MatrixSpec*> specs;
  std::vector<const float*> grads, momenta_in, held_in;
  std::vector<float*> momenta, updates, held_out;
  common::StateDType held_dtype = common::StateDType::kFloat32;
};

std::vector<KernelGroup> GroupItems(const std::vector<MuonKernelItem>& items) {
  std::vector<KernelGroup> groups;
  std::vector<bool> done(items.size(), false);
  for (size_t i = 0; i < items.size(); ++i) {
    if (done[i]) continue;
    const MuonKernelItem& first = items[i];
    KernelGroup& group = groups.emplace_back();
    group.held_dtype = first.held_dtype;
    for (size_t j = i; j < items.size(); ++j) {
      const MuonKernelItem& it = items[j];
      if (done[j] || it.spec->shape != first.spec->shape ||
          it.spec->num_heads != first.spec->num_heads ||
          (it.held_in != nullptr) != (first.held_in != nullptr) ||
          it.held_dtype != first.held_dtype) {
        continue;
      }
      done[j] = true;
      group.specs.push_back(it.spec);
      auto* g = static_cast<float*>(it.grad_update->data());
      group.grads.push_back(g);
      group.updates.push_back(g);
      if (it.held_in != nullptr) {  // held compressed: decoded and encoded by the kernel
        group.held_in.push_back(it.held_in);
        group.held_out.push_back(it.held_out);
        continue;
      }
      // A separate momentum output: the input is only read (MuonKernelItem).
      const DeviceBuffer* out = it.momentum_out;
      group.momenta_in.push_back(static_cast<const float*>(it.momentum->data()));
      group.momenta.push_back(static_cast<float*>((out != nullptr ? out : it.momentum)->data()));
    }
  }
  return groups;
}

}  // namespace

absl::Status HostStream::Muon(const common::MuonConfig& config, std::vector<MuonKernelItem> items) {
  double flops = 0;
  for (const MuonKernelItem& it : items) {
    const size_t bytes = static_cast<size_t>(it.spec->numel()) * sizeof(float);
    const bool held = it.held_in != nullptr && it.held_out != nullptr;
    if (it.grad_update->size() < bytes || (!held && it.momentum->size() < bytes) ||
        (!held && it.momentum_out != nullptr && it.momentum_out->size() < bytes)) {
      return absl::InvalidArgumentError(absl::StrCat("matrix '", it.spec->name,
                                                     "': a buffer of its Muon kernel call holds "
                                                     "fewer than ",
                                                     bytes, " bytes"));
    }
    flops += NewtonSchulzFlops(config, *it.spec);
  }
  HostDevice* device = device_;
  Enqueue(
      [config, items = std::move(items), device]() -> absl::Status {
        if (device->InjectKernelFailure()) {
          return absl::InternalError(absl::StrCat(device->name(), ": injected kernel failure"));
        }
        const std::vector<KernelGroup> groups = GroupItems(items);
        std::vector<MuonGroup> muon_groups;
        for (const KernelGroup& g : groups) {
          MuonGroup& m = muon_groups.emplace_back();
          m.count = g.specs.size();
          m.specs = g.specs.data();
          m.grads = g.grads.data();
          m.updates = g.updates.data();
          if (!g.held_in.empty()) {
            m.held_in = g.held_in.data();
            m.held_out = g.held_out.data();
            m.held_dtype = g.held_dtype;
            continue;
          }
          m.momenta = g.momenta.data();
          m.momenta_in = g.momenta_in.data();
        }
        return MuonUpdateGroups(config, muon_groups.data(), muon_groups.size());
      },
      device_->KernelCost(flops), 1);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Event>> HostStream::Record() {
  auto event = std::make_shared<HostEvent>(device_);
  absl::MutexLock lock(&mu_);
  ops_.push_back(Op{nullptr, 0, 0, nullptr, event});
  return std::shared_ptr<Event>(event);
}

absl::Status HostStream::WaitFor(std::shared_ptr<Event> event) {
  auto host = std::dynamic_pointer_cast<HostEvent>(event);
  if (host == nullptr) return absl::InvalidArgumentError("event of another device");
  absl::MutexLock lock(&mu_);
  ops_.push_back(Op{nullptr, 0, 0, std::move(host), nullptr});
  return absl::OkStatus();
}

absl::Status HostStream::Synchronize() {
  auto event = Record();
  if (!event.ok()) return event.status();
  return (*event)->Wait();
}

void HostStream::Loop(int math_threads) {
  SetMathThreads(math_threads);
  while (true) {
    Op op;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &HostStream::HasWork));
      if (ops_.empty()) return;
      op = std::move(ops_.front());
      ops_.pop_front();
    }
    if (op.wait_for != nullptr) {
      // Host-side synchronization between streams: this worker blocks until the event.
      absl::Status s = op.wait_for->WaitOnDevice();
      if (error_.ok() && !s.ok()) error_ = s;
      sim_time_ = std::max(sim_time_, op.wait_for->sim_time());
    } else if (op.record != nullptr) {
      // An error is reported to the first event after it, then the stream is usable again (a
      // failed batch fails its job's step, not the next job's).
      op.record->Reach(error_, sim_time_);
      error_ = absl::OkStatus();
    } else {
      const absl::Time start = absl::Now();
      if (error_.ok()) error_ = op.run();
      device_->AddBusy(
          op.kind, device_->simulated() ? op.sim_cost : absl::ToDoubleSeconds(absl::Now() - start));
      sim_time_ = std::max(sim_time_, op.not_before) + op.sim_cost;
      device_->AdvanceClock(sim_time_);
      if (device_->simulated() && device_->sim().sleep && op.sim_cost > 0) {
        absl::SleepFor(absl::Seconds(op.sim_cost));
      }
    }
  }
}

}  // namespace

std::unique_ptr<Device> NewHostDevice(int cpu_threads, const SimulatedOptions* simulated) {
  return std::make_unique<HostDevice>(simulated != nullptr ? "simulated" : "cpu", cpu_threads,
                                      simulated);
}

}  // namespace muond::server::device
