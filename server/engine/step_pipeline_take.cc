// What a drain takes next (StepPipeline::Run, step_pipeline_run.h): the ready matrices that form
// a batch under the batch target and the gather budget, where each matrix's new state goes (the
// step window before the seal, in place after it; the window's bound), when the clip must be
// decided first (the norm pass), and how a drain ends (the commit, or the device's error).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/engine/step_pipeline.h"
#include "server/engine/step_pipeline_run.h"

namespace muond::server {

bool StepPipeline::Run::Take(Batch* batch, bool* commit, bool* decide) {
  absl::MutexLock lock(p_.job_mu_);
  return TakeLocked(batch, commit, decide);
}

bool StepPipeline::Run::TakeLocked(Batch* batch, bool* commit, bool* decide) {
  // The gather budget bounds everything assembled at once (all batches in flight); batches aim
  // at a third of it, at most the batch target, so that kDepth of them overlap. A matrix larger
  // than the budget goes alone, when nothing else is in flight.
  uint64_t in_flight = 0;
  for (const Batch& b : flight_) {
    for (uint32_t m : b.matrices) in_flight += p_.AssembledBytes(m);
  }
  const uint64_t budget = p_.gather_budget_bytes_;
  const uint64_t per_batch = BatchBytes(budget, p_.batch_target_bytes_);
  uint64_t batch_bytes = 0;
  size_t taken = 0;
  const bool sealed = state_.sealed(p_.spec_.matrices.size(), p_.spec_.clips_outside_share());
  const bool norm_pass = NeedsNormPass() && !state_.clip_decided;
  if (sealed && norm_pass && status_.ok() && !state_.done) {
    *decide = true;  // before anything is written in place
    return true;
  }
  for (uint32_t m : state_.ready) {
    if (state_.done || !status_.ok()) break;
    const uint64_t bytes = p_.AssembledBytes(m);
    const bool alone = batch->matrices.empty() && in_flight == 0;
    if (!alone && (batch_bytes + bytes > per_batch && !batch->matrices.empty())) break;
    if (!alone && in_flight + batch_bytes + bytes > budget) break;
    bool in_place = false;
    if (!TakeState(m, sealed, &in_place)) break;
    batch->matrices.push_back(m);
    batch->in_place.push_back(in_place);
    if (norm_pass) state_.speculated.push_back(m);  // clip 1, into the window
    batch_bytes += bytes;
    ++taken;
  }
  if (taken > 0 && !state_.store_begun) {
    state_.store_begun = true;
    batch->begin_step = true;
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
  if (RedoForClipping()) return TakeLocked(batch, commit, decide);  // ready again
  return Finish(commit);
}

bool StepPipeline::Run::Finish(bool* commit) {
  if (!status_.ok() && !state_.done) {
    // A device error fails this step only (the state store is untouched until commit); a
    // refusal found while assembling (apply mode) says so itself.
    p_.sink_->DeviceFailed(
        state_, refused_ ? status_
                         : absl::Status(
                               status_.code(),
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

bool StepPipeline::Run::TakeState(uint32_t m, bool sealed, bool* in_place) {
  *in_place = false;
  if (p_.spec_.transport_probe) return true;                   // no state
  if (p_.StateTwoCopies()) return true;                        // every array has its back buffer
  if (apply_mode() && state_.hyper.absent_at(m)) return true;  // carried: its state unchanged
  // Gradients divided by less than 1 may still refuse the step when a tensor is assembled (one
  // overflows float32 once divided, ApplyStep::CheckSumOfSquares): such a step is never written
  // in place, and its window is not bounded (a second copy of what it writes, for that step).
  if (apply_mode() && state_.hyper.grad_divisor < 1.0) return true;
  if (sealed) {
    *in_place = true;
    state_.in_place = true;
    return true;
  }
  const uint64_t bytes = p_.spec_.StateBytesOf(p_.spec_.matrices[m]);
  if (state_.window_reserved + bytes > p_.StateWindowBytes()) return false;  // wait for the seal
  state_.window_reserved += bytes;
  return true;
}

void StepPipeline::Run::PlanState(const Batch& batch) {
  if (batch.begin_step) {
    if (apply_mode()) {
      p_.params_->BeginStep();
    } else {
      p_.momentum_.BeginStep();
    }
  }
  for (size_t i = 0; i < batch.matrices.size(); ++i) {
    const uint32_t m = batch.matrices[i];
    if (apply_mode()) {
      if (!state_.hyper.absent_at(m)) p_.params_->Plan(m, batch.in_place[i] != 0);
    } else {
      p_.momentum_.Plan(m, batch.in_place[i] != 0);
    }
  }
}

}  // namespace muond::server
