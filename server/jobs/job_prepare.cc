// Two-phase steps of a Job (multi-node jobs, DESIGN.md 4c): prepare, commit on the trainer's
// word, abort. See job.h.
//
// The choice: an explicit commit (CommitStep), not "the next step's begin commits the last one".
// A trainer that spans nodes learns whether every node's daemon computed step t only after an
// agreement among its ranks (an all-reduce); it then tells each daemon to commit, or to abort.
// With an explicit commit the daemon's state after a step is never in doubt when the trainer
// stops (a checkpoint taken after CommitStep holds step t; one taken while t is prepared holds
// t - 1), and a prepared step needs nothing kept beyond the step's own buffers:
//  - update mode: the step wrote the new momentum into the MomentumStore's back buffers, and
//  - apply mode: the next state into the ParamStore's back buffers;
//    the commit flips the store, an abort leaves the front as it was.
// Memory cost of keeping a step prepared: none beyond the step in flight itself (the stores hold
// their back buffers anyway; the gradients are not read again).
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/jobs/job_impl.h"

namespace muond::server {

void JobImpl::Prepare(StepState& state) {
  const double seconds = absl::ToDoubleSeconds(absl::Now() - state.start);
  absl::MutexLock lock(&mu_);
  state.committing = false;
  if (state.done) return;  // cannot happen (FailStep leaves a committing step alone); defensive
  state.prepared = true;
  state.prepared_at = absl::Now();
  const double sum_sq = apply() ? state.TotalSumSq() : 0;
  for (auto& out : state.outputs) {
    out->compute_seconds = seconds;
    out->grad_sum_sq = sum_sq;
  }
  ReleaseResults(state);
  for (RankInput& in : state.ranks) {
    if (in.done) std::exchange(in.done, nullptr)(absl::OkStatus(), 0, seconds, sum_sq);
  }
  state.cv.SignalAll();
}

absl::Status JobImpl::CommitStep(int64_t step) {
  std::shared_ptr<StepState> state;
  {
    absl::MutexLock lock(&mu_);
    const std::string where = absl::StrCat("job '", id(), "' commit of step ", step);
    if (deleted_) return absl::NotFoundError(absl::StrCat(where, ": the job was deleted"));
    if (!spec_.two_phase()) {
      return absl::FailedPreconditionError(
          absl::StrCat(where, ": not a multi-node job; its steps commit by themselves"));
    }
    if (in_flight_ != nullptr && in_flight_->step == step) {
      state = in_flight_;
      while (state->committing && !state->done) state->cv.WaitWithTimeout(&mu_, kCancelPoll);
      if (state->done) return state->result;  // another rank's commit finished it
      if (!state->prepared) {
        return absl::FailedPreconditionError(absl::StrCat(
            where,
            ": the step is in flight but not prepared (not every rank of this node has "
            "its result yet)"));
      }
      state->prepared = false;
      state->committing = true;
    } else if (step < next_step_ && !fenced_) {
      return absl::OkStatus();  // committed already (another rank's CommitStep)
    } else if (fenced_) {
      return absl::FailedPreconditionError(
          absl::StrCat(where, ": the job is fenced (", fence_reason_, ")"));
    } else if (step == dropped_step_ && step == next_step_) {
      return absl::FailedPreconditionError(
          absl::StrCat(where, ": the step was dropped while prepared (", dropped_why_,
                       "); nothing of it changed the state, and the job expects it again"));
    } else {
      return absl::FailedPreconditionError(
          absl::StrCat(where, ": no such step is prepared (the job expects step ", next_step_,
                       "; an aborted or refused step is run again, not committed)"));
    }
  }
  CommitNow(*state);
  absl::MutexLock lock(&mu_);
  return state->result;
}

absl::Status JobImpl::CheckTwoPhase(const std::string& where) const {
  if (deleted_) return absl::NotFoundError(absl::StrCat(where, ": the job was deleted"));
  if (!spec_.two_phase()) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": not a multi-node job (its steps commit by themselves)"));
  }
  return absl::OkStatus();
}

std::optional<absl::Status> JobImpl::EndUncommitted(int64_t step, const std::string& verb,
                                                const std::string& reason) {
  if (in_flight_ == nullptr || in_flight_->step != step) return std::nullopt;
  const std::shared_ptr<StepState> state = in_flight_;
  while (state->committing && !state->done) state->cv.WaitWithTimeout(&mu_, kCancelPoll);
  if (state->done && state->result.ok()) return std::nullopt;  // committed
  if (state->prepared) {
    DropPrepared(verb == "aborted" ? reason : absl::StrCat(verb, ": ", reason));
  } else if (!state->done) {
    FailStep(*state,
             absl::AbortedError(absl::StrCat("job '", id(), "' step ", step, " ", verb,
                                             " by the trainer: ", reason, "; nothing changed")),
             /*fence=*/false);
  }
  return absl::OkStatus();
}

absl::Status JobImpl::AbortStep(int64_t step, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  const std::string where = absl::StrCat("job '", id(), "' abort of step ", step);
  RETURN_IF_ERROR(CheckTwoPhase(where));
  const bool in_flight = in_flight_ != nullptr && in_flight_->step == step;
  if (std::optional<absl::Status> ended = EndUncommitted(step, "aborted", reason)) return *ended;
  if (in_flight) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": the step is already committed on this node"));
  }
  if (step < next_step_) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": the step is already committed (the job expects step ", next_step_, ")"));
  }
  return absl::OkStatus();  // nothing of it here: never begun, refused or dropped already
}

absl::Status JobImpl::RollbackStep(int64_t step, const std::string& reason) {
  const std::string where = absl::StrCat("job '", id(), "' rollback of step ", step);
  {
    // Never committed here: dropping the prepared (or still running) step is the rollback. (Not
    // under the stores' locks: a commit in progress takes them.)
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckTwoPhase(where));
    if (std::optional<absl::Status> ended = EndUncommitted(step, "rolled back", reason)) {
      return *ended;
    }
  }
  MomentumStore::Lock store(momentum_);
  std::optional<ParamStore::Lock> params;
  if (apply()) params.emplace(*params_);
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckTwoPhase(where));
  if (step == next_step_ && (rolled_back_step_ == step || in_flight_ == nullptr)) {
    return absl::OkStatus();  // rolled back already (another rank of the node), or never here
  }
  if (fenced_) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": the job is fenced (", fence_reason_, ")"));
  }
  if (step != next_step_ - 1 || rollback_step_.load() != step || in_flight_ != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        where,
        ": only the last step committed can be rolled back, before a later step begins "
        "or a checkpoint is saved or loaded (the job expects step ",
        next_step_, "); load a checkpoint to bring the nodes together"));
  }
  if (params) {
    params->Unflip(rollback_absent_);
  } else if (!spec_.transport_probe) {
    store.Unflip();
  }
  rollback_step_.store(-1);
  rolled_back_step_ = step;
  next_step_ = step;
  for (auto& u : last_updates_) u = nullptr;  // no replay of the step undone
  --steps_completed_;
  ++steps_aborted_;
  dropped_step_ = step;
  dropped_why_ = absl::StrCat("rolled back after its commit: ", reason);
  MUOND_LOG(WARNING) << "job '" << id() << "' step " << step
                     << " rolled back after its commit: " << reason;
  return absl::OkStatus();
}

void JobImpl::DropPrepared(const std::string& why) {
  if (in_flight_ == nullptr || !in_flight_->prepared) return;
  const std::shared_ptr<StepState> state = std::move(in_flight_);
  state->prepared = false;
  state->done = true;
  state->result =
      absl::AbortedError(absl::StrCat("job '", id(), "' step ", state->step,
                                      " aborted while prepared: ", why, "; nothing changed"));
  ++steps_aborted_;
  dropped_step_ = state->step;
  dropped_why_ = why;
  MUOND_LOG(INFO) << "job '" << id() << "' prepared step " << state->step << " dropped: " << why;
  state->cv.SignalAll();
}

}  // namespace muond::server
