#include "server/engine/step_pipeline.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/parallel_for.h"
#include "common/status_macros.h"
#include "server/engine/step_pipeline_run.h"

namespace muond::server {
namespace {

std::atomic<int> in_place_hold_ms{0};

}  // namespace

void SetPipelineInPlaceHoldForTesting(int ms) {
  in_place_hold_ms.store(ms, std::memory_order_relaxed);
}

StepPipeline::Run::Run(StepPipeline& p, StepState& state)
    : p_(p),
      state_(state),
      dev_(*p.devices_),
      clock_start_(dev_.device->SimulatedSeconds()),
      busy_start_(dev_.device->Busy()) {}

void StepPipeline::Run::Go() {
  while (true) {
    Batch batch;
    bool commit = false, decide = false;
    if (!Take(&batch, &commit, &decide)) {
      p_.gather_in_use_bytes_.store(0);
      return;
    }
    if (decide) {
      DecideClip();
      continue;
    }
    if (batch.matrices.empty()) {
      if (!flight_.empty()) {
        Retire();
        continue;
      }
      p_.gather_in_use_bytes_.store(0);
      // QK-Clip rescales the new masters of its pairs before they are released (DESIGN.md 4e).
      if (apply_mode()) p_.apply_->QkClip(state_);
      p_.sink_->Commit(state_);
      absl::MutexLock lock(p_.job_mu_);
      state_.drain_queued = false;
      return;
    }
    if (p_.spec_.transport_probe) {
      Echo(batch);
      continue;
    }
    if (status_.ok()) PlanState(batch);
    if (status_.ok()) CarryAbsent(batch);
    if (batch.matrices.empty()) continue;  // every tensor of it was absent
    if (status_.ok()) status_ = Prepare(batch);
    if (status_.ok()) status_ = Enqueue(batch);
    if (!status_.ok()) {
      Abandon();
      Recycle(batch);
      continue;
    }
    HostWork(batch);  // apply mode's AdamW, while the device runs the batch's Newton-Schulz
    flight_.push_back(std::move(batch));
    if (dev_.serial || flight_.size() >= static_cast<size_t>(DeviceStreams::kDepth)) Retire();
  }
}

MatrixPath StepPipeline::Run::ChoosePath(uint32_t m) const {
  if (p_.Direct(state_, m)) return MatrixPath::kDirect;
  if (apply_mode() && p_.spec_.matrices[m].optimizer == common::Optimizer::kAdamW) {
    return MatrixPath::kHost;
  }
  if (dev_.device->ComputesInHostMemory()) return MatrixPath::kInPlace;
  return MatrixPath::kStaged;
}

absl::Status StepPipeline::Run::Prepare(Batch& batch) {
  batch.staging.resize(batch.matrices.size());
  for (size_t i = 0; i < batch.matrices.size(); ++i) {
    const MatrixPath path = ChoosePath(batch.matrices[i]);
    batch.path.push_back(path);
    if (path != MatrixPath::kDirect) {
      RETURN_IF_ERROR(AssembleOnHost(batch, i));
    } else if (apply_mode()) {
      RETURN_IF_ERROR(ReadDirectGradient(batch, i));
    }
    if (path == MatrixPath::kHost) continue;
    // Held compressed: the staged and direct paths get an fp32 decoding; the cpu kernel decodes
    // and encodes block by block itself (EnqueueCopyIn).
    if (p_.MomentumHeld() && path != MatrixPath::kInPlace) DecodeMomentum(batch, i);
    batch.on_device.push_back(i);
    if (path == MatrixPath::kInPlace) {
      BindInPlace(batch, i);
    } else {
      RETURN_IF_ERROR(TakeDeviceBuffers(batch, i));
    }
  }
  return absl::OkStatus();
}

absl::Status StepPipeline::Run::TakeDeviceBuffers(Batch& batch, size_t i) {
  const common::MatrixSpec& ms = p_.spec_.matrices[batch.matrices[i]];
  const size_t n = static_cast<size_t>(ms.numel());
  auto g = p_.TakeDeviceBuffer(n * sizeof(float));
  if (!g.ok()) return g.status();
  auto mo = p_.TakeDeviceBuffer(n * sizeof(float));
  if (!mo.ok()) return mo.status();
  device::DeviceBuffer raw;
  if (batch.path[i] == MatrixPath::kDirect &&
      (ms.dtype != common::DType::kFloat32 || (apply_mode() && state_.grad_scale != 1.0f))) {
    auto r = p_.TakeDeviceBuffer(n * common::DTypeSize(ms.dtype));
    if (!r.ok()) return r.status();
    raw = *std::move(r);
  }
  batch.grad.push_back(*std::move(g));
  batch.mom.push_back(*std::move(mo));
  batch.mom_out.emplace_back();
  batch.raw.push_back(std::move(raw));
  return absl::OkStatus();
}

absl::Status StepPipeline::Run::Enqueue(Batch& batch) {
  if (batch.on_device.empty()) return absl::OkStatus();  // AdamW only: host work
  std::vector<device::MuonKernelItem> items;
  RETURN_IF_ERROR(EnqueueCopyIn(batch, &items));
  auto copied = dev_.copy_in->Record();
  if (!copied.ok()) return copied.status();
  RETURN_IF_ERROR(dev_.compute->WaitFor(*copied));
  RETURN_IF_ERROR(ConvertRaw(batch, /*widen=*/true));
  RETURN_IF_ERROR(dev_.compute->Muon(p_.spec_.muon, std::move(items)));
  RETURN_IF_ERROR(ConvertRaw(batch, /*widen=*/false));
  auto computed = dev_.compute->Record();
  if (!computed.ok()) return computed.status();
  RETURN_IF_ERROR(dev_.writeback->WaitFor(*computed));
  RETURN_IF_ERROR(EnqueueWriteback(batch));
  auto written = dev_.writeback->Record();
  if (!written.ok()) return written.status();
  batch.written = *written;
  return absl::OkStatus();
}

absl::Status StepPipeline::Run::EnqueueCopyIn(Batch& batch,
                                              std::vector<device::MuonKernelItem>* items) {
  for (size_t k = 0; k < batch.grad.size(); ++k) {
    const uint32_t m = batch.matrices[batch.on_device[k]];
    const common::MatrixSpec* ms = &p_.spec_.matrices[m];
    switch (batch.device_path(k)) {
      case MatrixPath::kInPlace:
        if (p_.MomentumHeld()) {  // the kernel reads and writes the store as held
          device::MuonKernelItem item{ms, &batch.grad[k]};
          item.held_in = p_.CommittedMomentum(m);
          item.held_out = p_.NextMomentum(m);
          item.held_dtype = p_.spec_.state.momentum;
          items->push_back(item);
        } else {
          items->push_back({ms, &batch.grad[k], &batch.mom[k], &batch.mom_out[k]});
        }
        continue;
      case MatrixPath::kDirect:
        RETURN_IF_ERROR(p_.CopySpansIn(state_, m, RawOrGrad(batch, k)));
        break;
      default:
        RETURN_IF_ERROR(CopyStagedIn(batch, k));
    }
    // The committed momentum, read in place from the (registered) store: it does not change
    // before commit, which waits for this step's device work.
    const size_t bytes = static_cast<size_t>(ms->numel()) * sizeof(float);
    RETURN_IF_ERROR(
        dev_.copy_in->CopyToDevice(batch.mom[k], 0, MomentumIn(batch, batch.on_device[k]), bytes));
    items->push_back({ms, &batch.grad[k], &batch.mom[k]});
  }
  return absl::OkStatus();
}

absl::Status StepPipeline::Run::EnqueueWriteback(Batch& batch) {
  for (size_t k = 0; k < batch.grad.size(); ++k) {
    const MatrixPath path = batch.device_path(k);
    if (path == MatrixPath::kInPlace) continue;  // the update is in the staging already
    if (path == MatrixPath::kDirect && !apply_mode()) {
      RETURN_IF_ERROR(p_.CopySpansOut(state_, batch.matrices[batch.on_device[k]],
                                      RawOrGrad(batch, k)));
      continue;
    }
    RETURN_IF_ERROR(CopyStagedOut(batch, k));
  }
  // The new momentum (the one the update was computed from) where the store says (its window
  // buffer or in place): update mode, and apply mode's direct tensors and those updated in place
  // (apply mode computes another staged tensor's momentum on the host, PrepareGradient; every
  // backend rounds the EMA as ApplyMomentum does).
  for (size_t k = 0; k < batch.mom.size(); ++k) {
    const MatrixPath path = batch.device_path(k);
    if (path == MatrixPath::kInPlace) continue;  // written there by the kernel
    if (apply_mode() && !p_.MomentumHeld() && path != MatrixPath::kDirect &&
        !batch.in_place[batch.on_device[k]]) {
      continue;
    }
    const uint32_t m = batch.matrices[batch.on_device[k]];
    const size_t bytes = static_cast<size_t>(p_.spec_.matrices[m].numel()) * sizeof(float);
    RETURN_IF_ERROR(
        dev_.writeback->CopyToHost(MomentumOut(batch, batch.on_device[k]), batch.mom[k], 0, bytes));
  }
  return absl::OkStatus();
}

void StepPipeline::Run::Retire() {
  Batch b = std::move(flight_.front());
  flight_.pop_front();
  absl::Status s = b.written != nullptr ? b.written->Wait() : absl::OkStatus();
  if (!s.ok() && status_.ok()) status_ = s;
  ReleaseBudget(b);
  if (!status_.ok()) return;
  Observe(b);
  const absl::Time deliver_start = absl::Now();
  EncodeMomentum(b);
  if (apply_mode()) {
    ApplyToMasters(b);
  } else {
    ScatterToRanks(b);
  }
  state_.phase_seconds[4] += absl::ToDoubleSeconds(absl::Now() - deliver_start);
  GiveBackBuffers(b);
  MarkDone(b.matrices);
  if (std::find(b.in_place.begin(), b.in_place.end(), 1) != b.in_place.end()) HoldInPlace();
}

void StepPipeline::Run::HoldInPlace() {
  const int ms = in_place_hold_ms.load(std::memory_order_relaxed);
  if (ms <= 0 || held_in_place_) return;
  held_in_place_ = true;
  MUOND_LOG(WARNING) << "test hook: job '" << p_.spec_.job_id << "' step " << state_.step
                     << " holds in the middle of an in-place update, " << ms << " ms";
  absl::SleepFor(absl::Milliseconds(ms));
}

void StepPipeline::Run::ReleaseBudget(const Batch& b) {
  uint64_t assembled = 0;
  for (uint32_t m : b.matrices) assembled += p_.AssembledBytes(m);
  uint64_t in_use = p_.gather_in_use_bytes_.load();
  while (!p_.gather_in_use_bytes_.compare_exchange_weak(in_use,
                                                        in_use - std::min(in_use, assembled))) {
  }
}

void StepPipeline::Run::GiveBackHostBuffers(Batch& b) {
  for (std::vector<std::vector<float>>* host : {&b.staging, &b.momentum}) {
    for (std::vector<float>& v : *host) {
      if (!v.empty()) p_.GiveBack(std::move(v));
    }
    host->clear();
  }
}

void StepPipeline::Run::GiveBackBuffers(Batch& b) {
  GiveBackHostBuffers(b);
  for (device::DeviceBuffer& d : b.grad) p_.GiveBack(std::move(d));
  for (device::DeviceBuffer& d : b.mom) p_.GiveBack(std::move(d));
  for (device::DeviceBuffer& d : b.raw) p_.GiveBack(std::move(d));
  // mom_out holds views only.
}

// Its device compute time shared among its Muon matrices, and the orthogonality of the sampled
// ones whose update is in the host staging in fp32 (before apply mode applies it to the masters).
void StepPipeline::Run::Observe(const Batch& b) {
  const double compute = dev_.device->Busy().compute;
  std::vector<uint32_t> muon;
  for (size_t i : b.on_device) muon.push_back(b.matrices[i]);
  p_.observer_.Attribute(muon, compute - compute_seen_);
  compute_seen_ = compute;
  for (size_t i : b.on_device) {
    const uint32_t m = b.matrices[i];
    if (b.path[i] == MatrixPath::kDirect || b.staging[i].empty() ||
        !p_.observer_.Samples(state_.step, m)) {
      continue;
    }
    p_.observer_.Measure(state_.step, m, b.staging[i].data());
  }
}

// Counted, and their shared-memory ranks may use them now (progress words, then a wake-up per
// rank, after the lock). Not with clipping: a clipped step recomputes every result once the norm
// is known, so its words are set at the commit (Job::FinishCommit). A try that ended before its
// commit (refused, dropped by its rank, aborted) announces nothing: the words are the rank's, and
// its next try of the same step may have opened already (Job::OpenSharedStep clears them under
// the job's lock; they are written under it here, so a word of an ended try is never read as the
// new try's).
void StepPipeline::Run::MarkDone(const std::vector<uint32_t>& matrices) {
  std::vector<std::function<void()>> notify;
  {
    absl::MutexLock lock(p_.job_mu_);
    state_.matrices_done += matrices.size();
    if (state_.done || p_.spec_.max_grad_norm > 0) return;
    std::vector<bool> touched(state_.outputs.size(), false);
    for (uint32_t m : matrices) {
      if (p_.qk_withheld_[m]) continue;  // QK-Clip rescales it before the commit
      for (const JobLayout::SpanRef& ref : p_.layout_.owners(m)) {
        const RankUpdate* out = state_.outputs[ref.rank].get();
        if (out == nullptr || out->progress.words == nullptr) continue;
        __atomic_store_n(&out->progress.words[ref.span], state_.step + 1, __ATOMIC_RELEASE);
        touched[ref.rank] = true;
      }
    }
    for (size_t r = 0; r < touched.size(); ++r) {
      if (touched[r] && state_.outputs[r]->progress.notify) {
        notify.push_back(state_.outputs[r]->progress.notify);
      }
    }
  }
  for (const std::function<void()>& wake : notify) wake();  // eventfd writes
}

// One copy, no device, in slices spread over the CPUs.
void StepPipeline::Run::Echo(const Batch& batch) {
  constexpr size_t kSlice = size_t{4} << 20;
  struct Slice {
    char* dst;
    const char* src;
    size_t bytes;
  };
  std::vector<Slice> slices;
  size_t total = 0;
  for (uint32_t m : batch.matrices) {
    for (const JobLayout::SpanRef& ref : p_.layout_.owners(m)) {
      char* dst = state_.outputs[ref.rank]->spans[ref.span].data;
      const char* src = state_.ranks[ref.rank].span_in[ref.span];
      const size_t bytes = p_.layout_.SpanBytes(ref.rank, ref.span);
      for (size_t at = 0; at < bytes; at += kSlice) {
        slices.push_back({dst + at, src + at, std::min(kSlice, bytes - at)});
      }
      total += bytes;
    }
  }
  common::ParallelFor(slices.size(), total, [&](size_t i) {
    std::memcpy(slices[i].dst, slices[i].src, slices[i].bytes);
  });
  MarkDone(batch.matrices);
}

void StepPipeline::Run::Abandon() {
  (void)dev_.copy_in->Synchronize();
  (void)dev_.compute->Synchronize();
  (void)dev_.writeback->Synchronize();
  while (!flight_.empty()) {
    Batch b = std::move(flight_.front());
    flight_.pop_front();
    if (b.written) (void)b.written->Wait();
    Recycle(b);
  }
}

// A registered staging buffer must never be freed without being unregistered. REQUIRES: the
// streams synchronized (Abandon) so that none of the batch's copies is in flight.
void StepPipeline::Run::Recycle(Batch& b) { GiveBackHostBuffers(b); }

StepPipeline::StepPipeline(const common::JobSpec& spec, const JobLayout& layout,
                           MomentumStore& momentum, ParamStore* params, DeviceStreams* devices,
                           uint64_t gather_budget_bytes, absl::Mutex* job_mu, Sink* sink,
                           uint64_t batch_target_bytes)
    : spec_(spec),
      layout_(layout),
      momentum_(momentum),
      params_(params),
      apply_(params != nullptr ? std::make_unique<ApplyStep>(spec, layout, params) : nullptr),
      devices_(devices),
      gather_budget_bytes_(gather_budget_bytes),
      batch_target_bytes_(batch_target_bytes),
      job_mu_(job_mu),
      sink_(sink),
      observer_(spec, devices->device->name()),
      qk_withheld_(spec.matrices.size(), false) {
  if (spec.qk_clip.enabled()) {
    for (const auto& [q, k] : common::QkClipTensors(spec)) qk_withheld_[q] = qk_withheld_[k] = true;
  }
  CountStaged(true, 0);  // declares muond_step_copy_bytes_total before the first scrape
}

StepPipeline::~StepPipeline() {
  // Every staging buffer is back in the pool (each drain returns what it took).
  absl::MutexLock lock(&pool_mu_);
  for (const auto& [data, bytes] : pinned_staging_) {
    devices_->device->UnregisterHost(const_cast<float*>(data), bytes);
  }
}

void StepPipeline::Drain(StepState& state) { Run(*this, state).Go(); }

}  // namespace muond::server
