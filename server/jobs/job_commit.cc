// The end of a Job's step: commit (the momentum store changes here and only here), refusal and
// abort (the store untouched; an abort fences the job), a rank that leaves, and reset. See job.h.
#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/logging.h"
#include "common/parallel_for.h"
#include "common/status_macros.h"
#include "server/jobs/gradient_check.h"
#include "server/jobs/job_impl.h"
#include "server/record/daemon_metrics.h"
#include "server/record/optimizer_metrics.h"
#include "server/record/status_history.h"

namespace muond::server {
namespace {

std::atomic<int> commit_hold_ms{0};

// The test hook of job.h: holds the commit (the store flipped, the step not finished).
void HoldCommit(const std::string& job, int64_t step) {
  const int ms = commit_hold_ms.load(std::memory_order_relaxed);
  if (ms <= 0) return;
  MUOND_LOG(WARNING) << "test hook: commit of job '" << job << "' step " << step << " holds "
                     << ms << " ms (store flipped, results not released)";
  absl::SleepFor(absl::Milliseconds(ms));
}

}  // namespace

void SetCommitHoldForTesting(int ms) { commit_hold_ms.store(ms, std::memory_order_relaxed); }

void SetInPlaceHoldForTesting(int ms) { SetPipelineInPlaceHoldForTesting(ms); }

void JobImpl::Commit(StepState& state) {
  if (spec_.two_phase()) {
    Prepare(state);
    return;
  }
  CommitNow(state);
}

void JobImpl::NoteRollback(const StepState& state) {
  if (!spec_.two_phase()) return;
  absl::MutexLock lock(&mu_);
  rollback_absent_ = state.hyper.absent;
  rollback_step_.store(state.step);
}

void JobImpl::CommitNow(StepState& state) {
  const absl::Time commit_start = absl::Now();
  // What each rank sent, for replays of this step (they must carry the same gradients). The
  // inputs are complete and no longer written by the daemon.
  for (int r = 0; r < spec_.world_size; ++r) {
    state.outputs[r]->input_digest = InputDigest(r, state.ranks[r].span_in);
  }
  if (apply()) {
    // The step computed the next state into the store's back buffers: it becomes the front.
    // Held to the end, as below.
    ParamStore::Lock store(*params_);
    store.Flip(state.hyper.absent, /*keep_back=*/spec_.two_phase());
    NoteRollback(state);
    HoldCommit(id(), state.step);
    state.commit_seconds = absl::ToDoubleSeconds(absl::Now() - commit_start);
    FinishCommit(state, absl::OkStatus());
    return;
  }
  // Every matrix succeeded: the step wrote each matrix's new momentum, the one its update was
  // computed from, into the store's back buffers (step_pipeline.h); they become the front. The
  // gradients are not read again: a shared-memory peer that rewrote its region after ringing
  // changes nothing committed (DESIGN.md 4: the choice of a staged copy, momentum_store.h).
  // Under the store's lock (a save in progress gets the old values first), held to the end: a
  // save cannot begin between the change and the step counter's advance.
  MomentumStore::Lock store(momentum_);
  if (!spec_.transport_probe) store.Flip(/*keep_back=*/spec_.two_phase());
  NoteRollback(state);
  HoldCommit(id(), state.step);
  state.commit_seconds = absl::ToDoubleSeconds(absl::Now() - commit_start);
  FinishCommit(state, absl::OkStatus());
}

std::vector<uint32_t> JobImpl::InputDigest(int rank, const std::vector<const char*>& span_in) const {
  struct Slice {
    const char* data;
    size_t bytes;
  };
  std::vector<Slice> slices;
  size_t total = 0;
  for (size_t k = 0; k < span_in.size(); ++k) {
    const size_t bytes = layout_.SpanBytes(rank, k);
    for (size_t at = 0; at < bytes; at += RankUpdate::kDigestSlice) {
      slices.push_back({span_in[k] + at, std::min(RankUpdate::kDigestSlice, bytes - at)});
    }
    total += bytes;
  }
  std::vector<uint32_t> crc(slices.size());
  common::ParallelFor(slices.size(), total, [&](size_t i) {
    crc[i] = common::Crc32c(slices[i].data, slices[i].bytes);
  });
  return crc;
}

absl::Status JobImpl::CheckReplayInput(int rank, const RankUpdate& replay,
                                   const std::vector<const char*>& span_in) const {
  const std::vector<uint32_t> now = InputDigest(rank, span_in);
  if (now == replay.input_digest) return absl::OkStatus();
  // Name where: the first slice that differs.
  size_t slice = 0;
  for (size_t k = 0; k < span_in.size(); ++k) {
    const size_t bytes = layout_.SpanBytes(rank, k);
    for (size_t at = 0; at < bytes; at += RankUpdate::kDigestSlice, ++slice) {
      if (slice < replay.input_digest.size() && slice < now.size() &&
          now[slice] == replay.input_digest[slice]) {
        continue;
      }
      const common::ShardSpan& span = layout_.spans(rank)[k];
      const size_t esize = common::DTypeSize(spec_.matrices[span.matrix].dtype);
      return absl::AlreadyExistsError(absl::StrCat(
          "job '", id(), "' rank ", rank, ": step ", replay.step,
          " is committed, and this re-sent step carries other gradients than the ones it was "
          "computed from (matrix '", spec_.matrices[span.matrix].name, "' elements from ",
          span.offset + at / esize,
          "); a replay must send the same gradients; nothing changed (the next step is ",
          replay.step + 1, ")"));
    }
  }
  return absl::AlreadyExistsError(absl::StrCat("job '", id(), "' rank ", rank, ": step ",
                                               replay.step, " re-sent with other gradients"));
}

void JobImpl::FinishCommit(StepState& state, const absl::Status& changed) {
  const double seconds = absl::ToDoubleSeconds(absl::Now() - state.start);
  if (changed.ok()) {
    // Outside the job's lock: a scrape reads job status while holding the metrics' locks.
    RecordStepCompleted(id(), seconds);
    const StepPhase phases[5] = {StepPhase::kAssembly, StepPhase::kCopyIn, StepPhase::kNewtonSchulz,
                                 StepPhase::kWriteback, StepPhase::kReturn};
    for (int p = 0; p < 5; ++p) RecordPhase(id(), phases[p], state.phase_seconds[p]);
    RecordPhase(id(), StepPhase::kCommit, state.commit_seconds);
    StepHistory::Default().Record(
        id(), created_unix_ms_,
        {state.step,
         absl::ToUnixMillis(absl::Now()),
         seconds,
         {state.phase_seconds[0], state.phase_seconds[1], state.phase_seconds[2],
          state.phase_seconds[3], state.phase_seconds[4], state.commit_seconds}});
    if (state.clip_redo) RecordClipRedo(id());
    if (spec_.qk_clip.enabled()) RecordQkClip(id(), state.qk_heads_clipped, state.qk_max_logit);
  }
  absl::MutexLock lock(&mu_);
  state.committing = false;
  if (!changed.ok()) {
    FailStep(state, changed, /*fence=*/true);
    return;
  }
  // Apply mode: the step's raw sum of squares (a node's share of a global norm); update mode with
  // max_grad_norm: the whole norm's, with which the trainer clips the tensors it updates itself.
  const double sum_sq = apply() || spec_.clips_outside_share() ? state.TotalSumSq() : 0;
  for (auto& out : state.outputs) {
    out->compute_seconds = seconds;
    out->grad_sum_sq = sum_sq;
    // Every result is in: a rank's progress words say so before its completion does (a clipped
    // step announces nothing earlier; step_pipeline.cc).
    if (out->progress.words == nullptr) continue;
    for (size_t i = 0; i < out->spans.size(); ++i) {
      __atomic_store_n(&out->progress.words[i], state.step + 1, __ATOMIC_RELEASE);
    }
  }
  last_step_device_seconds_ = state.device_seconds;
  if (!spec_.two_phase()) ReleaseResults(state);  // a two-phase step released them when prepared
  last_updates_.assign(state.outputs.begin(), state.outputs.end());
  state.done = true;
  state.result = absl::OkStatus();
  input_pool_.resize(spec_.world_size);
  for (int r = 0; r < spec_.world_size; ++r) {
    if (!state.ranks[r].owned.empty()) input_pool_[r] = std::move(state.ranks[r].owned);
  }
  ++next_step_;
  ++steps_completed_;
  if (state.clip_redo) ++clip_redo_steps_;
  last_grad_norm_ = state.grad_norm;
  if (spec_.qk_clip.enabled()) {
    qk_heads_clipped_ += state.qk_heads_clipped;
    last_qk_max_logit_ = state.qk_max_logit;
  }
  if (in_flight_.get() == &state) in_flight_ = nullptr;
  for (RankInput& in : state.ranks) {
    if (in.done) std::exchange(in.done, nullptr)(absl::OkStatus(), 0, seconds, sum_sq);
  }
  state.cv.SignalAll();
  if (spec_.checkpoint_every_steps > 0 && !spec_.transport_probe &&
      static_cast<uint64_t>(steps_completed_) % spec_.checkpoint_every_steps == 0) {
    SaveCheckpointInBackground();
  }
}

void JobImpl::ReleaseResults(const StepState& state) {
  int grpc_ranks = 0;
  for (const RankInput& in : state.ranks) {
    // A shared-memory rank's completion is still to be posted (below); a gRPC rank has none: its
    // update goes out in messages after this.
    if (in.begun && in.done == nullptr) ++grpc_ranks;
  }
  trainer_clock_.Released(state.step, state.start, state.last_input, grpc_ranks);
}

void JobImpl::DeviceFailed(StepState& state, const absl::Status& status) {
  FailStep(state, status, /*fence=*/false);
}

std::shared_ptr<StepState> JobImpl::EndStep(StepState& state, const absl::Status& result,
                                         uint32_t flags) {
  // A step whose ranks are all on shared memory is owned by in_flight_ alone (no RankStep holds
  // it), and in_flight_ is reset below: the caller keeps `state` alive with what this returns.
  std::shared_ptr<StepState> keep = in_flight_.get() == &state ? in_flight_ : nullptr;
  state.done = true;
  state.result = result;
  state.ready.clear();
  for (int r = 0; r < spec_.world_size; ++r) {
    RankInput& in = state.ranks[r];
    if (in.done) std::exchange(in.done, nullptr)(result, flags, 0, 0);
    if (!result.ok() && in.parts_open) cut_short_[r] = {state.step, sessions_[r], result};
  }
  if (in_flight_.get() == &state) in_flight_ = nullptr;
  return keep;
}

void JobImpl::FenceInPlace(StepState& state, const absl::Status& status) {
  const absl::Status fenced(
      status.code(), absl::StrCat(status.message(),
                                  "; the step was sealed and its state partly updated in place, "
                                  "so job '",
                                  id(), "' is fenced: load its newest checkpoint"));
  const std::shared_ptr<StepState> keep = EndStep(state, fenced, 0);
  ++steps_aborted_;
  fenced_ = true;
  fence_reason_ = std::string(fenced.message());
  MUOND_LOG(WARNING) << "job '" << id() << "' fenced: " << fenced.message();
}

void JobImpl::FailStep(StepState& state, const absl::Status& status, bool fence) {
  // A step whose commit began is committed: nothing may report it as failed.
  if (state.done || state.committing || state.prepared) return;
  // The step window's buffers go back once the step's drain is over (the compute queue runs in
  // order, without the job's lock: the store's lock comes before it).
  executor_->Submit([weak = weak_from_this()] {
    const std::shared_ptr<JobImpl> self = weak.lock();
    if (self == nullptr) return;  // the job is gone, and its buffers with it
    if (self->params_ != nullptr) {
      self->params_->DropWindow();
    } else {
      self->momentum_.DropWindow();
    }
  });
  if (state.in_place) {
    // The sealed step was updating the state in place: what is stored is part old, part new.
    // Nothing can restore it but a checkpoint (README "Memory", "One copy of the state").
    FenceInPlace(state, status);
    return;
  }
  if (!fence && SkipStep(&state, state.step, status)) return;
  const std::shared_ptr<StepState> keep = EndStep(state, status, 0);
  if (fence) {
    ++steps_aborted_;
    fenced_ = true;
    fence_reason_ = std::string(status.message());
    MUOND_LOG(WARNING) << "job '" << id() << "' fenced: " << status.message();
  } else {
    ++steps_refused_;
    MUOND_LOG(INFO) << "job '" << id() << "' step " << state.step
                    << " refused: " << status.message();
    if (status.code() == absl::StatusCode::kInvalidArgument) {
      std::vector<bool> owed(spec_.world_size);
      for (int r = 0; r < spec_.world_size; ++r) owed[r] = !state.ranks[r].begun;
      refusal_.Record(state.step, status, std::move(owed));
    }
  }
  state.cv.SignalAll();
}

void JobImpl::RefuseSubmission(int rank, uint64_t session, int64_t step, const absl::Status& bad) {
  if (in_flight_ != nullptr && in_flight_->step == step) {
    FailStep(*in_flight_, bad, /*fence=*/false);
    // This rank learns of the refusal from this very answer: it is not owed it again on its
    // retry (it never began the step, so FailStep counted it among the ranks owed it).
    (void)refusal_.Take(rank, step);
  } else if (!deleted_ && !fenced_ && sessions_[rank] == session && step == next_step_) {
    if (in_flight_ == nullptr && SkipStep(nullptr, step, bad)) return;
    // Refused before any rank began the step: the ranks that submit it later are owed the
    // refusal, or they would begin a step this rank has already left.
    if (refusal_.Owes(rank, step)) {
      (void)refusal_.Take(rank, step);  // a refusal of this same attempt; it learns of it now
    } else {
      ++steps_refused_;
      std::vector<bool> owed(spec_.world_size, true);
      owed[rank] = false;
      refusal_.Record(step, bad, std::move(owed));
      MUOND_LOG(INFO) << "job '" << id() << "' step " << step << " refused: " << bad.message();
    }
  }
}

bool JobImpl::SkipStep(StepState* state, int64_t step, const absl::Status& status) {
  if (!spec_.nonfinite_skip || !IsNonFiniteGradient(status) || step != next_step_) return false;
  // Every rank's answer for the step, now and on any retry: skipped, nothing to read back.
  auto skipped = std::make_shared<RankUpdate>();
  skipped->step = step;
  skipped->skipped = true;
  for (int r = 0; r < spec_.world_size; ++r) last_updates_[r] = skipped;
  ++next_step_;
  ++steps_skipped_;
  refusal_.Clear();
  MUOND_LOG(INFO) << "job '" << id() << "' step " << step << " skipped: " << status.message();
  if (state != nullptr) {
    state->skipped_update = skipped;
    const std::shared_ptr<StepState> keep = EndStep(*state, absl::OkStatus(), kDoneSkipped);
    state->cv.SignalAll();
  }
  return true;
}

absl::Status JobImpl::CheckNoStepInFlight(const char* what) const {
  if (in_flight_ == nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("job '", id(), "': step ", in_flight_->step,
                                                    " is in flight; ", what, " after it ends"));
}

absl::Status JobImpl::AbandonRank(const std::shared_ptr<StepState>& state, int rank,
                              const std::string& why) {
  absl::MutexLock lock(&mu_);
  // A commit in progress finishes: wait for it so the answer names the outcome.
  while (state->committing && !state->done) state->cv.WaitWithTimeout(&mu_, kCancelPoll);
  if (state->prepared && !state->done) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", id(), "' step ", state->step, " rank ", rank, ": ", why,
                     ", but the step is prepared (all data was in): the trainer commits or "
                     "aborts it (CommitStep / AbortStep)"));
  }
  if (state->done) {
    if (!state->result.ok()) return state->result;
    if (state->skipped()) {
      return absl::UnavailableError(absl::StrCat(
          "job '", id(), "' step ", state->step, " rank ", rank, ": ", why, ", but the step was "
          "skipped (a non-finite gradient); ask for step ", state->step, " again to learn so"));
    }
    return absl::UnavailableError(
        absl::StrCat("job '", id(), "' step ", state->step, " rank ", rank, ": ", why,
                     ", but the step was already committed (all data was in); ask for step ",
                     state->step, " again to receive its update"));
  }
  const absl::Status aborted = absl::AbortedError(
      absl::StrCat("job '", id(), "' step ", state->step, " aborted: rank ", rank, " ", why));
  FailStep(*state, aborted, /*fence=*/true);
  return aborted;
}

absl::Status JobImpl::Reset(int64_t next_step) {
  if (next_step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("next step ", next_step, " is negative"));
  }
  MomentumStore::Lock store(momentum_);
  std::optional<ParamStore::Lock> params;
  if (apply()) params.emplace(*params_);
  absl::MutexLock lock(&mu_);
  DropPrepared("reset");
  RETURN_IF_ERROR(CheckNoStepInFlight("reset"));
  rollback_step_.store(-1);
  store.Zero();
  if (params) params->ZeroOptimizerState();
  writer_.Forget();
  for (auto& u : last_updates_) u = nullptr;
  next_step_ = next_step;
  fenced_ = false;
  fence_reason_.clear();
  return absl::OkStatus();
}

}  // namespace muond::server
