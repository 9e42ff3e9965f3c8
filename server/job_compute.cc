// The step pipeline of a Job (DESIGN.md section 6): complete matrices are taken in batches under
// the gather budget, assembled on the host (fp32 whole matrices), copied to the device with their
// momentum, updated there, and the update written back; up to ComputeDevice::kDepth batches are in
// flight, on three streams ordered by events. The host reads a staging buffer only after the
// writeback event of its batch; device buffers and staging live until then.
//
// Momentum: the device computes the new momentum next to the update but it is not written back:
// the store changes only at commit (Job::Commit re-applies the same EMA on the host), which keeps a
// refused step's momentum bit-identical without a staged copy.
#include <algorithm>
#include <cstring>
#include <deque>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "server/compute_device.h"
#include "server/job.h"
#include "server/job_internal.h"
#include "server/parallel_bytes.h"

namespace muond::server {

absl::StatusOr<std::unique_ptr<ComputeDevice>> ComputeDevice::Create(
    std::unique_ptr<device::Device> device, std::string why, bool serial) {
  auto c = std::make_unique<ComputeDevice>();
  auto in = device->CreateStream();
  auto compute = device->CreateStream();
  auto out = device->CreateStream();
  if (!in.ok()) return in.status();
  if (!compute.ok()) return compute.status();
  if (!out.ok()) return out.status();
  c->copy_in = *std::move(in);
  c->compute = *std::move(compute);
  c->writeback = *std::move(out);
  c->device = std::move(device);
  c->why = std::move(why);
  c->serial = serial;
  return c;
}

namespace {

struct Batch {
  std::vector<uint32_t> matrices;
  std::vector<std::vector<float>> staging;  // per matrix: the gradient, then the update
  std::vector<device::DeviceBuffer> grad;   // per matrix, device
  std::vector<device::DeviceBuffer> mom;    // per matrix, device
  std::shared_ptr<device::Event> written;   // the writeback is complete
};

}  // namespace

void Job::DrainReady(const std::shared_ptr<StepState>& state_ptr) {
  StepState& state = *state_ptr;
  ComputeDevice& dev = *compute_;
  std::deque<Batch> flight;
  absl::Status status;
  // The simulated clock this call spends (every call drains what it enqueued before returning).
  const double clock_start = dev.device->SimulatedSeconds();
  const device::Device::BusySeconds busy_start = dev.device->Busy();

  // Waits for the oldest batch's writeback, then scatters its updates to the ranks' outputs.
  auto retire = [&]() {
    Batch b = std::move(flight.front());
    flight.pop_front();
    absl::Status s = b.written->Wait();
    if (!s.ok() && status.ok()) status = s;
    if (!status.ok()) return;
    const absl::Time scatter_start = absl::Now();
    for (size_t i = 0; i < b.matrices.size(); ++i) {
      const uint32_t m = b.matrices[i];
      const common::MatrixSpec& ms = spec_.matrices[m];
      for (const SpanRef& ref : matrix_spans_[m]) {
        const common::ShardSpan& span = rank_spans_[ref.rank][ref.span];
        common::FromFloat32(b.staging[i].data() + span.offset, span.length, ms.dtype,
                            state.outputs[ref.rank]->spans[ref.span].data);
      }
    }
    state.phase_seconds[4] += absl::ToDoubleSeconds(absl::Now() - scatter_start);
    absl::MutexLock lock(&mu_);
    state.matrices_done += b.matrices.size();
  };

  while (true) {
    Batch batch;
    uint64_t batch_bytes = 0;
    bool failed = false;
    {
      absl::MutexLock lock(&mu_);
      failed = state.done;
      // The gather budget bounds everything assembled at once (all batches in flight); batches
      // aim at a third of it so that kDepth of them overlap. A matrix larger than the budget goes
      // alone, when nothing else is in flight.
      auto bytes_of = [&](uint32_t m) -> uint64_t {
        return spec_.transport_probe
                   ? 0
                   : 2 * sizeof(float) * static_cast<uint64_t>(spec_.matrices[m].numel());
      };
      uint64_t in_flight = 0;
      for (const Batch& b : flight) {
        for (uint32_t m : b.matrices) in_flight += bytes_of(m);
      }
      const uint64_t per_batch = std::max<uint64_t>(1, gather_budget_bytes_ / ComputeDevice::kDepth);
      size_t taken = 0;
      for (uint32_t m : state.ready) {
        if (failed || !status.ok()) break;
        const uint64_t bytes = bytes_of(m);
        const bool alone = batch.matrices.empty() && in_flight == 0;
        if (!alone && (batch_bytes + bytes > per_batch && !batch.matrices.empty())) break;
        if (!alone && in_flight + batch_bytes + bytes > gather_budget_bytes_) break;
        batch.matrices.push_back(m);
        batch_bytes += bytes;
        ++taken;
      }
      state.ready.erase(state.ready.begin(), state.ready.begin() + taken);
      const uint64_t live = in_flight + batch_bytes;
      if (!spec_.transport_probe) gather_peak_bytes_ = std::max(gather_peak_bytes_, live);
      if (batch.matrices.empty() && flight.empty()) {
        if (!status.ok() && !state.done) {
          // A device error fails this step only (the momentum store is untouched until commit).
          FailStep(state,
                   absl::Status(status.code(),
                                absl::StrCat("job '", id(), "' step ", state.step,
                                             " failed on the compute device: ", status.message())),
                   /*fence=*/false);
        }
        const bool commit = status.ok() && !state.done &&
                            state.matrices_done == spec_.matrices.size();
        if (commit) state.committing = true;
        state.device_seconds += dev.device->SimulatedSeconds() - clock_start;
        const device::Device::BusySeconds busy = dev.device->Busy();
        state.phase_seconds[1] += busy.copy_in - busy_start.copy_in;
        state.phase_seconds[2] += busy.compute - busy_start.compute;
        state.phase_seconds[3] += busy.writeback - busy_start.writeback;
        if (!commit) state.drain_queued = false;
        if (!commit) return;
      }
    }
    if (batch.matrices.empty()) {
      if (!flight.empty()) {
        retire();
        continue;
      }
      Commit(state);
      absl::MutexLock lock(&mu_);
      state.drain_queued = false;
      return;
    }
    if (spec_.transport_probe) {
      // The data-path probe: each owner's span goes back as it came, one copy, no device, in
      // slices spread over the CPUs.
      constexpr size_t kSlice = size_t{4} << 20;
      struct Slice {
        char* dst;
        const char* src;
        size_t bytes;
      };
      std::vector<Slice> slices;
      size_t total = 0;
      for (uint32_t m : batch.matrices) {
        for (const SpanRef& ref : matrix_spans_[m]) {
          const common::ShardSpan& span = rank_spans_[ref.rank][ref.span];
          char* dst = state.outputs[ref.rank]->spans[ref.span].data;
          const char* src = state.ranks[ref.rank].span_in[ref.span];
          const size_t bytes = span.length * common::DTypeSize(spec_.matrices[m].dtype);
          for (size_t at = 0; at < bytes; at += kSlice) {
            slices.push_back({dst + at, src + at, std::min(kSlice, bytes - at)});
          }
          total += bytes;
        }
      }
      ParallelFor(slices.size(), total, [&](size_t i) {
        std::memcpy(slices[i].dst, slices[i].src, slices[i].bytes);
      });
      absl::MutexLock lock(&mu_);
      state.matrices_done += batch.matrices.size();
      continue;
    }
    // Assembly on the host, then copy-in / compute / writeback enqueued on the device.
    std::vector<device::MuonKernelItem> items;
    batch.staging.resize(batch.matrices.size());
    for (size_t i = 0; i < batch.matrices.size() && status.ok(); ++i) {
      const uint32_t m = batch.matrices[i];
      const common::MatrixSpec& ms = spec_.matrices[m];
      const size_t n = static_cast<size_t>(ms.numel());
      const absl::Time gather_start = absl::Now();
      batch.staging[i].resize(n);
      for (const SpanRef& ref : matrix_spans_[m]) {
        const common::ShardSpan& span = rank_spans_[ref.rank][ref.span];
        common::ToFloat32(ms.dtype, state.ranks[ref.rank].span_in[ref.span], span.length,
                          batch.staging[i].data() + span.offset);
      }
      state.phase_seconds[0] += absl::ToDoubleSeconds(absl::Now() - gather_start);
      auto g = dev.device->Allocate(n * sizeof(float));
      auto mo = dev.device->Allocate(n * sizeof(float));
      if (!g.ok() || !mo.ok()) {
        status = !g.ok() ? g.status() : mo.status();
        break;
      }
      batch.grad.push_back(*std::move(g));
      batch.mom.push_back(*std::move(mo));
    }
    for (size_t i = 0; i < batch.grad.size() && status.ok(); ++i) {
      const size_t bytes = batch.staging[i].size() * sizeof(float);
      status = dev.copy_in->CopyToDevice(batch.grad[i], 0, batch.staging[i].data(), bytes);
      if (status.ok()) {
        // The committed momentum, read in place from the (registered) store: it does not change
        // before commit, which waits for this step's device work.
        status = dev.copy_in->CopyToDevice(batch.mom[i], 0, momentum_[batch.matrices[i]].data(),
                                           bytes);
      }
      items.push_back({&spec_.matrices[batch.matrices[i]], &batch.grad[i], &batch.mom[i]});
    }
    if (status.ok()) {
      auto copied = dev.copy_in->Record();
      status = copied.status();
      if (status.ok()) status = dev.compute->WaitFor(*copied);
      if (status.ok()) status = dev.compute->Muon(spec_.muon, std::move(items));
      auto computed = status.ok() ? dev.compute->Record() : copied;
      if (status.ok()) status = computed.status();
      if (status.ok()) status = dev.writeback->WaitFor(*computed);
      for (size_t i = 0; i < batch.grad.size() && status.ok(); ++i) {
        status = dev.writeback->CopyToHost(batch.staging[i].data(), batch.grad[i], 0,
                                           batch.staging[i].size() * sizeof(float));
      }
      auto written = status.ok() ? dev.writeback->Record() : computed;
      if (status.ok()) status = written.status();
      if (status.ok()) batch.written = *written;
    }
    if (!status.ok()) {
      // Nothing of this batch may be in flight without an event to wait for: drain the streams.
      (void)dev.copy_in->Synchronize();
      (void)dev.compute->Synchronize();
      (void)dev.writeback->Synchronize();
      while (!flight.empty()) {
        Batch b = std::move(flight.front());
        flight.pop_front();
        if (b.written) (void)b.written->Wait();
      }
      continue;
    }
    flight.push_back(std::move(batch));
    if (dev.serial || flight.size() >= static_cast<size_t>(ComputeDevice::kDepth)) retire();
  }
}

}  // namespace muond::server
