#include "server/engine/step_pipeline.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/dtype.h"
#include "common/parallel_for.h"
#include "common/status_macros.h"
#include "server/optim/grad_norm.h"

namespace muond::server {

struct StepPipeline::Batch {
  std::vector<uint32_t> matrices;
  std::vector<std::vector<float>> staging;  // per matrix: the gradient, then the update (staged)
  std::vector<bool> direct;                 // per matrix: copied straight from and to the ranks
  std::vector<device::DeviceBuffer> grad;   // per device matrix (Muon), device
  std::vector<device::DeviceBuffer> mom;    // per device matrix, device
  // Per device matrix on a device that computes in host memory: the store's back buffer that
  // receives the new momentum (`grad` is then a view of the staging and `mom` of the committed
  // momentum, read in place: nothing is copied); else empty.
  std::vector<device::DeviceBuffer> mom_out;
  // Per device matrix: direct with a 16-bit gradient (or, in apply mode, a scaled fp32 one), the
  // gradient as it came (update mode: then the update narrowed for the ranks); else empty.
  std::vector<device::DeviceBuffer> raw;
  std::vector<size_t> on_device;           // the indices into `matrices` that have buffers
  std::shared_ptr<device::Event> written;  // the writeback is complete (null: no device work)
};

// One call of Drain: the batches it has in flight and the first device error.
class StepPipeline::Run {
 public:
  Run(StepPipeline& p, StepState& state)
      : p_(p),
        state_(state),
        dev_(*p.devices_),
        clock_start_(dev_.device->SimulatedSeconds()),
        busy_start_(dev_.device->Busy()) {}

  void Go() {
    while (true) {
      Batch batch;
      bool commit = false;
      if (!Take(&batch, &commit)) {
        p_.gather_in_use_bytes_.store(0);
        return;
      }
      if (batch.matrices.empty()) {
        if (!flight_.empty()) {
          Retire();
          continue;
        }
        p_.gather_in_use_bytes_.store(0);
        // QK-Clip rescales the new masters of its pairs before they are released (DESIGN.md 4e).
        if (p_.apply_ != nullptr) p_.apply_->QkClip(state_);
        p_.sink_->Commit(state_);
        absl::MutexLock lock(p_.job_mu_);
        state_.drain_queued = false;
        return;
      }
      if (p_.spec_.transport_probe) {
        Echo(batch);
        continue;
      }
      if (status_.ok()) CarryAbsent(batch);
      if (batch.matrices.empty()) continue;  // every tensor of it was absent
      if (status_.ok()) status_ = Assemble(batch);
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

 private:
  // Under the job's lock: takes the next batch from the ready matrices. With nothing taken and
  // nothing in flight the call ends: false (the drain is over; a device error refused the step),
  // or true with an empty batch and *commit when the step's last matrix is done.
  bool Take(Batch* batch, bool* commit) {
    absl::MutexLock lock(p_.job_mu_);
    return TakeLocked(batch, commit);
  }

  bool TakeLocked(Batch* batch, bool* commit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p_.job_mu_) {
    // The gather budget bounds everything assembled at once (all batches in flight); batches aim
    // at a third of it so that kDepth of them overlap. A matrix larger than the budget goes
    // alone, when nothing else is in flight.
    uint64_t in_flight = 0;
    for (const Batch& b : flight_) {
      for (uint32_t m : b.matrices) in_flight += p_.AssembledBytes(m);
    }
    const uint64_t budget = p_.gather_budget_bytes_;
    const uint64_t per_batch = std::max<uint64_t>(1, budget / DeviceStreams::kDepth);
    uint64_t batch_bytes = 0;
    size_t taken = 0;
    for (uint32_t m : state_.ready) {
      if (state_.done || !status_.ok()) break;
      const uint64_t bytes = p_.AssembledBytes(m);
      const bool alone = batch->matrices.empty() && in_flight == 0;
      if (!alone && (batch_bytes + bytes > per_batch && !batch->matrices.empty())) break;
      if (!alone && in_flight + batch_bytes + bytes > budget) break;
      batch->matrices.push_back(m);
      batch_bytes += bytes;
      ++taken;
    }
    state_.ready.erase(state_.ready.begin(), state_.ready.begin() + taken);
    p_.gather_in_use_bytes_.store(in_flight + batch_bytes);
    if (!p_.spec_.transport_probe) {
      uint64_t peak = p_.gather_peak_bytes_.load();
      while (peak < in_flight + batch_bytes &&
             !p_.gather_peak_bytes_.compare_exchange_weak(peak, in_flight + batch_bytes)) {
      }
    }
    if (!batch->matrices.empty() || !flight_.empty()) return true;
    if (RedoForClipping()) return TakeLocked(batch, commit);  // every tensor is ready again
    return Finish(commit);
  }

  // Under the job's lock, every tensor of the step done: when global clipping triggers, queues
  // every tensor again with the clip coefficient (the state's front is unchanged, so the
  // recomputation is the serial computation bit for bit). True when it did. The first pass is
  // speculative (clip 1): most steps do not clip, and their results stand.
  bool RedoForClipping() {
    if (!status_.ok() || state_.done || state_.matrices_done != p_.spec_.matrices.size()) {
      return false;
    }
    if (p_.apply_ == nullptr) return RedoUpdateForClipping();
    state_.grad_norm = ApplyStep::GradNorm(state_);
    // A node of a multi-node job: its clip came with the step (clip 1 while speculating).
    if (state_.hyper.clip_source == ClipSource::kGlobal) {
      state_.grad_norm = std::sqrt(state_.hyper.global_sum_sq) / state_.hyper.grad_divisor;
    }
    if (state_.clip_redo || state_.hyper.clip_source != ClipSource::kLocal) return false;
    const float clip = p_.apply_->ClipCoefficient(state_);
    if (clip >= 1.0f) return false;
    state_.clip = clip;
    state_.clip_redo = true;
    state_.grad_scale = ApplyStep::GradScale(clip, state_.hyper.grad_divisor);
    state_.matrices_done = 0;
    state_.ready.clear();
    for (uint32_t m = 0; m < p_.spec_.matrices.size(); ++m) state_.ready.push_back(m);
    return true;
  }

  // Update mode with max_grad_norm: the norm spans the job's matrices and every rank's share of
  // the tensors outside the job, which comes with the rank's last part; until every rank's is in
  // nothing is decided (the commit waits too: Finish, Job::CommitWhenComplete).
  bool RedoUpdateForClipping() {
    if (!p_.spec_.clips_outside_share() || state_.clip_redo || !state_.every_rank_pushed()) {
      return false;
    }
    const double total = state_.TotalSumSq();
    state_.grad_norm = std::sqrt(total);
    const float clip = server::ClipCoefficient(total, p_.spec_.max_grad_norm);
    if (clip >= 1.0f) return false;
    state_.clip = clip;
    state_.clip_redo = true;
    state_.grad_scale = clip;
    state_.matrices_done = 0;
    state_.ready.clear();
    for (uint32_t m = 0; m < p_.spec_.matrices.size(); ++m) state_.ready.push_back(m);
    return true;
  }

  // Under the job's lock, nothing left to do: refuses the step on a device error, decides the
  // commit and accounts the device time. False ends the drain.
  bool Finish(bool* commit) {
    if (!status_.ok() && !state_.done) {
      // A device error fails this step only (the state store is untouched until commit); a
      // refusal found while assembling (apply mode) says so itself.
      p_.sink_->DeviceFailed(
          state_,
          refused_
              ? status_
              : absl::Status(status_.code(),
                             absl::StrCat("job '", p_.spec_.job_id, "' step ", state_.step,
                                          " failed on the compute device: ", status_.message())));
    }
    // A rank whose last part is not in yet commits the step when it comes (CommitWhenComplete).
    *commit = status_.ok() && !state_.done && state_.matrices_done == p_.spec_.matrices.size() &&
              state_.last_parts_in() &&
              (!p_.spec_.clips_outside_share() || state_.every_rank_pushed());
    if (*commit) state_.committing = true;
    state_.device_seconds += dev_.device->SimulatedSeconds() - clock_start_;
    const device::Device::BusySeconds busy = dev_.device->Busy();
    state_.phase_seconds[1] += busy.copy_in - busy_start_.copy_in;
    state_.phase_seconds[2] += busy.compute - busy_start_.compute;
    state_.phase_seconds[3] += busy.writeback - busy_start_.writeback;
    if (!*commit) state_.drain_queued = false;
    return *commit;
  }

  // Waits for the oldest batch's writeback, then scatters its updates to the ranks' outputs.
  void Retire() {
    Batch b = std::move(flight_.front());
    flight_.pop_front();
    absl::Status s = b.written != nullptr ? b.written->Wait() : absl::OkStatus();
    if (!s.ok() && status_.ok()) status_ = s;
    uint64_t assembled = 0;
    for (uint32_t m : b.matrices) assembled += p_.AssembledBytes(m);
    uint64_t in_use = p_.gather_in_use_bytes_.load();
    while (!p_.gather_in_use_bytes_.compare_exchange_weak(in_use,
                                                          in_use - std::min(in_use, assembled))) {
    }
    if (!status_.ok()) return;
    Observe(b);
    const absl::Time scatter_start = absl::Now();
    // Update mode: every owner's span of the batch, cut into slices for the CPUs (the narrowing
    // to bf16 or fp16 is a pass over the whole model each step).
    struct Scatter {
      const float* src;
      uint64_t length;
      common::DType dtype;
      char* dst;
    };
    std::vector<Scatter> slices;
    size_t bytes = 0;
    for (size_t i = 0; i < b.matrices.size(); ++i) {
      const uint32_t m = b.matrices[i];
      if (p_.apply_ != nullptr) {
        // W <- W*(1 - lr*wd) - lr*U into the store's back, new parameters to the owners.
        if (p_.spec_.matrices[m].optimizer == common::Optimizer::kMuon) {
          p_.apply_->ApplyMuon(state_, m, b.staging[i].data());
        }
        continue;
      }
      if (b.direct[i]) continue;  // already in the ranks' update regions
      const common::DType dtype = p_.spec_.matrices[m].dtype;
      const size_t esize = common::DTypeSize(dtype);
      for (const JobLayout::OwnerSlice& piece : p_.layout_.OwnerSlices(m, uint64_t{1} << 20)) {
        const common::ShardSpan& span = p_.layout_.spans(piece.ref->rank)[piece.ref->span];
        char* out =
            static_cast<char*>(state_.outputs[piece.ref->rank]->spans[piece.ref->span].data);
        slices.push_back({b.staging[i].data() + span.offset + piece.begin, piece.length, dtype,
                          out + piece.begin * esize});
        bytes += piece.length * (sizeof(float) + esize);
      }
    }
    common::ParallelFor(slices.size(), bytes, [&](size_t k) {
      common::FromFloat32(slices[k].src, slices[k].length, slices[k].dtype, slices[k].dst);
    });
    state_.phase_seconds[4] += absl::ToDoubleSeconds(absl::Now() - scatter_start);
    for (std::vector<float>& v : b.staging) {
      if (!v.empty()) p_.GiveBack(std::move(v));
    }
    for (device::DeviceBuffer& d : b.grad) p_.GiveBack(std::move(d));
    for (device::DeviceBuffer& d : b.mom) p_.GiveBack(std::move(d));
    for (device::DeviceBuffer& d : b.raw) p_.GiveBack(std::move(d));
    // mom_out holds views only.
    MarkDone(b.matrices);
  }

  // What the operators see of a retired batch (step_observer.h): its device compute time shared
  // among its Muon matrices, and the orthogonality of the sampled ones whose update is in the
  // host staging in fp32 (before apply mode applies it to the masters).
  void Observe(const Batch& b) {
    const double compute = dev_.device->Busy().compute;
    std::vector<uint32_t> muon;
    for (size_t i : b.on_device) muon.push_back(b.matrices[i]);
    p_.observer_.Attribute(muon, compute - compute_seen_);
    compute_seen_ = compute;
    for (size_t i : b.on_device) {
      const uint32_t m = b.matrices[i];
      if (b.direct[i] || b.staging[i].empty() || !p_.observer_.Samples(state_.step, m)) continue;
      p_.observer_.Measure(state_.step, m, b.staging[i].data());
    }
  }

  // `matrices` are done, their owners' results in place: counted, and their shared-memory ranks
  // may use them now (progress words, then a wake-up per rank, after the lock). Not with
  // clipping: a clipped step recomputes every result once the norm is known, so its words are
  // set at the commit (Job::FinishCommit). A try that ended before its commit (refused, dropped
  // by its rank, aborted) announces nothing: the words are the rank's, and its next try of the
  // same step may have opened already (Job::OpenSharedStep clears them under the job's lock;
  // they are written under it here, so a word of an ended try is never read as the new try's).
  void MarkDone(const std::vector<uint32_t>& matrices) {
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

  // Apply mode: the batch's tensors that no rank has a gradient of this step (the presence mask)
  // leave it, their state carried unchanged and their parameters returned as they are.
  void CarryAbsent(Batch& batch) {
    if (p_.apply_ == nullptr || state_.hyper.absent.empty()) return;
    std::vector<uint32_t> absent, rest;
    for (uint32_t m : batch.matrices) (state_.hyper.absent_at(m) ? absent : rest).push_back(m);
    if (absent.empty()) return;
    for (uint32_t m : absent) p_.apply_->Carry(state_, m);
    batch.matrices = std::move(rest);
    MarkDone(absent);
  }

  // The data-path probe: each owner's span goes back as it came, one copy, no device, in slices
  // spread over the CPUs.
  void Echo(const Batch& batch) {
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

  // Each matrix of the batch: assembled whole on the host (fp32), unless it goes direct; and its
  // device buffers.
  absl::Status Assemble(Batch& batch) {
    batch.staging.resize(batch.matrices.size());
    for (size_t i = 0; i < batch.matrices.size(); ++i) {
      const uint32_t m = batch.matrices[i];
      const common::MatrixSpec& ms = p_.spec_.matrices[m];
      const bool direct = p_.Direct(state_, m);
      batch.direct.push_back(direct);
      if (!direct) {
        RETURN_IF_ERROR(AssembleOnHost(batch, i));
      } else if (p_.apply_ != nullptr) {
        RETURN_IF_ERROR(ReadDirectGradient(batch, i));
      }
      if (ms.optimizer == common::Optimizer::kAdamW && p_.apply_ != nullptr) continue;
      batch.on_device.push_back(i);
      const size_t n = static_cast<size_t>(ms.numel());
      if (!direct && dev_.device->ComputesInHostMemory()) {
        // The kernel runs on the staging and the stores themselves.
        const size_t bytes = n * sizeof(float);
        batch.grad.push_back(device::DeviceBuffer::HostView(batch.staging[i].data(), bytes));
        batch.mom.push_back(
            device::DeviceBuffer::HostView(const_cast<float*>(p_.CommittedMomentum(m)), bytes));
        batch.mom_out.push_back(device::DeviceBuffer::HostView(p_.NextMomentum(m), bytes));
        batch.raw.emplace_back();
        continue;
      }
      auto g = p_.TakeDeviceBuffer(n * sizeof(float));
      if (!g.ok()) return g.status();
      auto mo = p_.TakeDeviceBuffer(n * sizeof(float));
      if (!mo.ok()) return mo.status();
      device::DeviceBuffer raw;
      if (direct && (ms.dtype != common::DType::kFloat32 ||
                     (p_.apply_ != nullptr && state_.grad_scale != 1.0f))) {
        auto r = p_.TakeDeviceBuffer(n * common::DTypeSize(ms.dtype));
        if (!r.ok()) return r.status();
        raw = *std::move(r);
      }
      batch.grad.push_back(*std::move(g));
      batch.mom.push_back(*std::move(mo));
      batch.mom_out.emplace_back();
      batch.raw.push_back(std::move(raw));
    }
    return absl::OkStatus();
  }

  // The staged path's assembly of matrix i of the batch: the owners' spans in fp32, in slices
  // over the CPUs (large tensors are hundreds of megabytes); apply mode scales and sums it.
  absl::Status AssembleOnHost(Batch& batch, size_t i) {
    const uint32_t m = batch.matrices[i];
    const common::MatrixSpec& ms = p_.spec_.matrices[m];
    const size_t n = static_cast<size_t>(ms.numel());
    const absl::Time gather_start = absl::Now();
    batch.staging[i] = p_.TakeStaging(n);
    const std::vector<JobLayout::OwnerSlice> slices = p_.layout_.OwnerSlices(m, uint64_t{1} << 20);
    const size_t esize = common::DTypeSize(ms.dtype);
    // With clipping the redo reads every gradient a second time, so the first pass notes what it
    // read and the redo checks that it reads the same (CheckReread).
    const bool crcs = p_.spec_.max_grad_norm > 0;
    // Update mode's redo scales the gradient by the clip (apply mode: PrepareGradient).
    const float scale = p_.apply_ == nullptr && state_.clip_redo ? state_.grad_scale : 1.0f;
    std::vector<uint32_t> crc(crcs ? slices.size() : 0);
    common::ParallelFor(slices.size(), n * (esize + sizeof(float)), [&](size_t k) {
      const JobLayout::SpanRef& ref = *slices[k].ref;
      const common::ShardSpan& span = p_.layout_.spans(ref.rank)[ref.span];
      const char* raw = state_.ranks[ref.rank].span_in[ref.span] + slices[k].begin * esize;
      if (crcs) crc[k] = common::Crc32c(raw, slices[k].length * esize);
      float* dst = batch.staging[i].data() + span.offset + slices[k].begin;
      common::ToFloat32(ms.dtype, raw, slices[k].length, dst);
      if (scale != 1.0f) {
        for (uint64_t j = 0; j < slices[k].length; ++j) dst[j] *= scale;
      }
    });
    if (crcs) {
      if (absl::Status s = CheckReread(m, slices, std::move(crc)); !s.ok()) {
        refused_ = true;
        return s;
      }
    }
    if (crcs && p_.apply_ == nullptr && !state_.clip_redo) {
      // Update mode: the matrix's share of the norm, from the first (unscaled) pass.
      state_.sum_sq[m] = ParallelSumOfSquares(batch.staging[i].data(), n);
    }
    if (p_.apply_ != nullptr) {
      // A device computing in host memory writes a Muon tensor's new momentum into the back
      // buffer itself (Assemble gives it NextMomentum as momentum_out).
      absl::Status s =
          p_.apply_->PrepareGradient(state_, m, batch.staging[i].data(), &state_.sum_sq[m],
                                     dev_.device->ComputesInHostMemory());
      if (!s.ok()) {
        refused_ = true;
        return s;
      }
    }
    state_.phase_seconds[0] += absl::ToDoubleSeconds(absl::Now() - gather_start);
    return absl::OkStatus();
  }

  // Apply mode, a Muon tensor that goes direct (its gradient is copied straight from the ranks'
  // regions and widened and scaled on the device, which also writes its new momentum back): the
  // host reads the raw gradient once, without assembling it, for what apply mode needs of it on
  // the host: its sum of squares (in the order PrepareGradient sums, so the norm and the clip
  // are the staged path's bit for bit), the finiteness and divisor checks, and under clipping the
  // CRC32Cs the redo compares. The update comes back into pooled (registered) staging.
  absl::Status ReadDirectGradient(Batch& batch, size_t i) {
    const uint32_t m = batch.matrices[i];
    const common::MatrixSpec& ms = p_.spec_.matrices[m];
    const size_t n = static_cast<size_t>(ms.numel());
    const absl::Time gather_start = absl::Now();
    const std::vector<JobLayout::OwnerSlice> slices = p_.layout_.OwnerSlices(m, uint64_t{1} << 20);
    const size_t esize = common::DTypeSize(ms.dtype);
    std::vector<ApplyStep::RawPiece> pieces;
    pieces.reserve(slices.size());
    for (const JobLayout::OwnerSlice& s : slices) {
      const common::ShardSpan& span = p_.layout_.spans(s.ref->rank)[s.ref->span];
      pieces.push_back({span.offset + s.begin, s.length,
                        state_.ranks[s.ref->rank].span_in[s.ref->span] + s.begin * esize});
    }
    absl::Status s = p_.apply_->CheckRawGradient(state_, m, std::move(pieces), &state_.sum_sq[m]);
    if (s.ok() && p_.spec_.max_grad_norm > 0) {
      std::vector<uint32_t> crc(slices.size());
      common::ParallelFor(slices.size(), n * esize, [&](size_t k) {
        const JobLayout::SpanRef& ref = *slices[k].ref;
        crc[k] = common::Crc32c(state_.ranks[ref.rank].span_in[ref.span] + slices[k].begin * esize,
                                slices[k].length * esize);
      });
      s = CheckReread(m, slices, std::move(crc));
    }
    if (!s.ok()) {
      refused_ = true;
      return s;
    }
    batch.staging[i] = p_.TakeStaging(n);  // where the update comes back
    state_.phase_seconds[0] += absl::ToDoubleSeconds(absl::Now() - gather_start);
    return absl::OkStatus();
  }

  // Apply mode with clipping: the first pass keeps the CRC32C of every slice of tensor m's raw
  // gradients it read; the clip redo, which reads them again, refuses the step (INVALID_ARGUMENT,
  // nothing committed) when one differs: the step's norm and clip coefficient came from the bytes
  // first read, and its result must too.
  absl::Status CheckReread(uint32_t m, const std::vector<JobLayout::OwnerSlice>& slices,
                           std::vector<uint32_t> crc) {
    if (state_.read_crc.empty()) state_.read_crc.resize(p_.spec_.matrices.size());
    std::vector<uint32_t>& first = state_.read_crc[m];
    if (!state_.clip_redo) {
      first = std::move(crc);
      return absl::OkStatus();
    }
    for (size_t k = 0; k < slices.size() && k < first.size(); ++k) {
      if (crc[k] == first[k]) continue;
      const JobLayout::SpanRef& ref = *slices[k].ref;
      return absl::InvalidArgumentError(absl::StrCat(
          "job '", p_.spec_.job_id, "' step ", state_.step, ": rank ", ref.rank,
          "'s gradient of tensor '", p_.spec_.matrices[m].name, "' (elements ",
          p_.layout_.spans(ref.rank)[ref.span].offset + slices[k].begin, " to ",
          p_.layout_.spans(ref.rank)[ref.span].offset + slices[k].begin + slices[k].length,
          ") changed after it was read, before the step ended (global clipping reads every "
          "gradient again); the step is refused and nothing changed"));
    }
    return absl::OkStatus();
  }

  // Copy-in, compute and writeback of the batch, enqueued on the three streams.
  absl::Status Enqueue(Batch& batch) {
    if (batch.on_device.empty()) return absl::OkStatus();  // AdamW only: host work
    std::vector<device::MuonKernelItem> items;
    for (size_t k = 0; k < batch.grad.size(); ++k) {
      const size_t i = batch.on_device[k];
      const uint32_t m = batch.matrices[i];
      const size_t bytes = static_cast<size_t>(p_.spec_.matrices[m].numel()) * sizeof(float);
      if (InPlace(batch, k)) {
        items.push_back({&p_.spec_.matrices[m], &batch.grad[k], &batch.mom[k], &batch.mom_out[k]});
        continue;
      }
      if (batch.direct[i]) {
        RETURN_IF_ERROR(p_.CopySpansIn(state_, m, RawOrGrad(batch, k)));
      } else {
        RETURN_IF_ERROR(
            dev_.copy_in->CopyToDevice(batch.grad[k], 0, batch.staging[i].data(), bytes));
        CountStaged(true, bytes, p_.StagingPinned(batch.staging[i].data()));
      }
      // The committed momentum, read in place from the (registered) store: it does not change
      // before commit, which waits for this step's device work.
      RETURN_IF_ERROR(dev_.copy_in->CopyToDevice(batch.mom[k], 0, p_.CommittedMomentum(m), bytes));
      items.push_back({&p_.spec_.matrices[m], &batch.grad[k], &batch.mom[k]});
    }
    auto copied = dev_.copy_in->Record();
    if (!copied.ok()) return copied.status();
    RETURN_IF_ERROR(dev_.compute->WaitFor(*copied));
    RETURN_IF_ERROR(ConvertRaw(batch, /*widen=*/true));
    RETURN_IF_ERROR(dev_.compute->Muon(p_.spec_.muon, std::move(items)));
    RETURN_IF_ERROR(ConvertRaw(batch, /*widen=*/false));
    auto computed = dev_.compute->Record();
    if (!computed.ok()) return computed.status();
    RETURN_IF_ERROR(dev_.writeback->WaitFor(*computed));
    for (size_t k = 0; k < batch.grad.size(); ++k) {
      const size_t i = batch.on_device[k];
      if (InPlace(batch, k)) continue;  // the update is in the staging already
      if (batch.direct[i] && p_.apply_ == nullptr) {
        RETURN_IF_ERROR(p_.CopySpansOut(state_, batch.matrices[i], RawOrGrad(batch, k)));
        continue;
      }
      std::vector<float>& staging = batch.staging[i];
      RETURN_IF_ERROR(dev_.writeback->CopyToHost(staging.data(), batch.grad[k], 0,
                                                 staging.size() * sizeof(float)));
      CountStaged(false, staging.size() * sizeof(float), p_.StagingPinned(staging.data()));
    }
    // The new momentum (the one the update was computed from) into the store's back buffer,
    // which the commit makes the front: update mode, and apply mode's direct tensors (apply mode
    // computes a staged tensor's momentum on the host, PrepareGradient).
    for (size_t k = 0; k < batch.mom.size(); ++k) {
      if (InPlace(batch, k)) continue;  // written there by the kernel
      if (p_.params_ != nullptr && !batch.direct[batch.on_device[k]]) continue;
      const uint32_t m = batch.matrices[batch.on_device[k]];
      const size_t bytes = static_cast<size_t>(p_.spec_.matrices[m].numel()) * sizeof(float);
      RETURN_IF_ERROR(dev_.writeback->CopyToHost(p_.NextMomentum(m), batch.mom[k], 0, bytes));
    }
    auto written = dev_.writeback->Record();
    if (!written.ok()) return written.status();
    batch.written = *written;
    return absl::OkStatus();
  }

  // True when device matrix k runs in place on host memory (no copies; see Batch::mom_out).
  static bool InPlace(const Batch& batch, size_t k) { return batch.mom_out[k].size() > 0; }

  // Where device matrix k of a direct batch is copied from and to the ranks: its raw buffer for a
  // 16-bit gradient, else the fp32 gradient buffer itself.
  static device::DeviceBuffer& RawOrGrad(Batch& batch, size_t k) {
    return batch.raw[k].size() > 0 ? batch.raw[k] : batch.grad[k];
  }

  // On the compute stream, the direct matrices with a raw buffer: widens the raw gradients into
  // the fp32 buffers (apply mode: scaled by the step's divisor and clip coefficient, as
  // PrepareGradient scales a staged one), or (update mode) narrows the updates into the raw
  // buffers. Apply mode's updates go back in fp32 (to the staging).
  absl::Status ConvertRaw(Batch& batch, bool widen) {
    if (!widen && p_.apply_ != nullptr) return absl::OkStatus();
    const float scale = p_.apply_ != nullptr ? state_.grad_scale : 1.0f;
    for (size_t k = 0; k < batch.raw.size(); ++k) {
      if (batch.raw[k].size() == 0) continue;
      const common::MatrixSpec& ms = p_.spec_.matrices[batch.matrices[batch.on_device[k]]];
      const common::DType dtype = ms.dtype;
      const size_t n = static_cast<size_t>(ms.numel());
      RETURN_IF_ERROR(widen ? dev_.compute->Convert(batch.raw[k], dtype, batch.grad[k],
                                                    common::DType::kFloat32, n, scale)
                            : dev_.compute->Convert(batch.grad[k], common::DType::kFloat32,
                                                    batch.raw[k], dtype, n, 1.0f));
    }
    return absl::OkStatus();
  }

  // Apply mode: the batch's AdamW tensors, on the host threads (the device meanwhile runs the
  // batch's Muon tensors).
  void HostWork(Batch& batch) {
    if (p_.apply_ == nullptr) return;
    for (size_t i = 0; i < batch.matrices.size(); ++i) {
      const uint32_t m = batch.matrices[i];
      if (p_.spec_.matrices[m].optimizer != common::Optimizer::kAdamW) continue;
      p_.apply_->ApplyAdamW(state_, m, batch.staging[i].data());
      p_.GiveBack(std::move(batch.staging[i]));  // done with it: leave the budget
      batch.staging[i] = std::vector<float>();
    }
  }

  // After a device error: nothing may stay in flight without an event to wait for.
  void Abandon() {
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

  // A batch that will not retire: its staging goes back to the pool (a registered staging buffer
  // must never be freed without being unregistered). REQUIRES: the streams synchronized (Abandon)
  // so that none of its copies is in flight.
  void Recycle(Batch& b) {
    for (std::vector<float>& v : b.staging) {
      if (!v.empty()) p_.GiveBack(std::move(v));
    }
    b.staging.clear();
  }

  StepPipeline& p_;
  StepState& state_;
  DeviceStreams& dev_;
  std::deque<Batch> flight_;
  absl::Status status_;
  bool refused_ = false;  // status_ is a refusal of the step's data, not a device error
  // The simulated clock this call spends (every call drains what it enqueued before returning).
  const double clock_start_;
  const device::Device::BusySeconds busy_start_;
  // The device's compute busy seconds when the previous batch retired (Observe).
  double compute_seen_ = busy_start_.compute;
};

StepPipeline::StepPipeline(const common::JobSpec& spec, const JobLayout& layout,
                           MomentumStore& momentum, ParamStore* params, DeviceStreams* devices,
                           uint64_t gather_budget_bytes, absl::Mutex* job_mu, Sink* sink)
    : spec_(spec),
      layout_(layout),
      momentum_(momentum),
      params_(params),
      apply_(params != nullptr ? std::make_unique<ApplyStep>(spec, layout, params) : nullptr),
      devices_(devices),
      gather_budget_bytes_(gather_budget_bytes),
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
