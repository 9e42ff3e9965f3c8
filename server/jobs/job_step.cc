// The Job's steps: a rank's entry into a step (gRPC and shared memory share the rules), its
// gradient chunks (checked, claimed and copied), and its wait for the commit. See job.h.
#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "server/jobs/gradient_check.h"
#include "server/jobs/job_impl.h"

namespace muond::server {

RankStep::RankStep(std::shared_ptr<JobImpl> job, int rank, int64_t step,
                   std::shared_ptr<StepState> state, std::shared_ptr<const RankUpdate> replay)
    : job_(std::move(job)),
      rank_(rank),
      step_(step),
      state_(std::move(state)),
      replay_(std::move(replay)) {}

RankStep::~RankStep() {
  if (!done_ && state_ != nullptr) {
    (void)job_->AbandonRank(state_, rank_, "left before the step completed");
  }
}

absl::Status RankStep::AddGradient(uint32_t matrix, uint64_t offset, std::string_view data,
                                   uint32_t crc32c) {
  if (done_) return absl::FailedPreconditionError("the step already ended for this rank");
  bytes_in_ += data.size();
  if (replay_ != nullptr) {
    // A replay returns the committed bytes, never applies gradients again, and must re-send the
    // gradients the step was computed from (compared at Finish).
    size_t span = 0;
    uint64_t count = 0;
    const std::string where = absl::StrCat("job '", job_->id(), "' step ", step_, " (replay) rank ",
                                           rank_);
    const absl::Status checked =
        job_->CheckChunk(where, rank_, matrix, offset, data, crc32c, &span, &count);
    // A skipped step computed nothing from its gradients: a retry's are not kept or compared
    // (a non-finite value is what skipped it).
    if (replay_->skipped) return IsNonFiniteGradient(checked) ? absl::OkStatus() : checked;
    RETURN_IF_ERROR(checked);
    const JobLayout& layout = job_->layout_;
    if (replay_in_.empty()) {
      replay_in_.resize(layout.spans(rank_).size());
      replay_got_.assign(layout.spans(rank_).size(), 0);
    }
    std::string& buffer = replay_in_[span];
    if (buffer.empty()) buffer.resize(layout.SpanBytes(rank_, span));
    const common::ShardSpan& s = layout.spans(rank_)[span];
    const size_t esize = data.size() / count;
    std::memcpy(buffer.data() + (offset - s.offset) * esize, data.data(), data.size());
    replay_got_[span] += count;
    return absl::OkStatus();
  }
  absl::Status s = job_->AddGradient(state_, rank_, matrix, offset, data, crc32c);
  if (!s.ok()) done_ = true;  // the step ended (refused); nothing left to abort
  return s;
}

absl::Status RankStep::Abandon(const std::string& why) {
  if (done_) return absl::FailedPreconditionError("the step already ended for this rank");
  done_ = true;
  if (replay_ != nullptr) {
    return absl::CancelledError(absl::StrCat("step ", step_, " (replay): ", why,
                                             "; nothing changed, the step stays committed"));
  }
  return job_->AbandonRank(state_, rank_, why);
}

absl::StatusOr<std::shared_ptr<const RankUpdate>> RankStep::Finish(
    const std::function<bool()>& cancelled, double outside_sum_sq) {
  if (done_) return absl::FailedPreconditionError("the step already ended for this rank");
  done_ = true;
  if (replay_ != nullptr) {
    // No gradients at all: the rank only asks for the committed result (a rank told UNAVAILABLE
    // "the step is committed" fetches it so). Any gradients: all of them, the same.
    if (replay_->skipped) return replay_;
    if (replay_in_.empty()) return Committed();
    const JobLayout& layout = job_->layout_;
    std::vector<const char*> span_in(layout.spans(rank_).size(), nullptr);
    for (size_t k = 0; k < span_in.size(); ++k) {
      if (replay_got_[k] != layout.spans(rank_)[k].length) {
        return absl::AlreadyExistsError(absl::StrCat(
            "job '", job_->id(), "' rank ", rank_, ": step ", step_,
            " is committed, and this re-sent step does not carry all of the gradients it was "
            "computed from (span ", k, " of matrix '",
            job_->spec().matrices[layout.spans(rank_)[k].matrix].name,
            "' incomplete); a replay must send the same gradients; nothing changed"));
      }
      span_in[k] = replay_in_[k].data();
    }
    RETURN_IF_ERROR(job_->CheckReplayInput(rank_, *replay_, span_in));
    return Committed();
  }
  return job_->FinishRank(state_, rank_, cancelled, outside_sum_sq);
}

absl::StatusOr<std::shared_ptr<const RankUpdate>> RankStep::Committed() const {
  if (!replay_->from_masters) return replay_;
  return job_->ReplayFromMasters(rank_, replay_);
}

absl::StatusOr<std::unique_ptr<RankStep>> JobImpl::BeginStep(int rank, uint64_t session, int64_t step,
                                                         const StepHyper* hyper) {
  RETURN_IF_ERROR(CheckRank(rank));
  absl::MutexLock lock(&mu_);
  std::shared_ptr<const RankUpdate> replay;
  RETURN_IF_ERROR(EnterStep(rank, session, step, hyper, &replay));
  if (replay != nullptr) {
    return std::unique_ptr<RankStep>(new RankStep(shared_from_this(), rank, step, nullptr, replay));
  }
  PrepareOwnedRank(*in_flight_, rank);
  return std::unique_ptr<RankStep>(
      new RankStep(shared_from_this(), rank, step, in_flight_, nullptr));
}

absl::Status JobImpl::EnterStep(int rank, uint64_t session, int64_t step, const StepHyper* hyper,
                            std::shared_ptr<const RankUpdate>* replay) {
  if (deleted_) return absl::NotFoundError(absl::StrCat("job '", id(), "' was deleted"));
  RETURN_IF_ERROR(CheckCurrentSession(rank, session, "; attach the rank first"));
  if (fenced_) {
    return absl::FailedPreconditionError(absl::StrCat("job '", id(), "' is fenced (", fence_reason_,
                                                      "); reset it or load a checkpoint"));
  }
  if (in_flight_ == nullptr) {
    for (int r = 0; r < spec_.world_size; ++r) {
      if (lost_[r].empty()) continue;
      return absl::AbortedError(absl::StrCat("job '", id(), "' step ", step, " cannot run: rank ",
                                             r, " is gone (", lost_[r],
                                             ") and has not attached again; nothing changed"));
    }
  }
  if (in_flight_ != nullptr && in_flight_->prepared) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", id(), "' rank ", rank, ": step ", in_flight_->step,
        " is prepared and waits for the trainer's CommitStep or AbortStep (multi-node job '",
        spec_.multinode.global_job_id, "'); step ", step, " cannot begin before"));
  }
  if (step == next_step_ - 1 && last_updates_[rank] != nullptr &&
      last_updates_[rank]->step == step) {
    if (in_flight_ != nullptr && in_flight_->ranks[rank].begun) {
      return absl::FailedPreconditionError(
          absl::StrCat("job '", id(), "' rank ", rank, ": cannot replay step ", step,
                       " while the rank has step ", in_flight_->step, " in flight"));
    }
    *replay = last_updates_[rank];
    return absl::OkStatus();
  }
  if (step != next_step_) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", id(), "': step ", step, " out of order: expected step ", next_step_,
                     next_step_ > 0 ? absl::StrCat(" (or a replay of ", next_step_ - 1, ")") : ""));
  }
  // A rank that had not begun a refused step learns of the refusal on its first try, even when
  // other ranks already began the retry.
  if (absl::Status refused = refusal_.Take(rank, step); !refused.ok()) return refused;
  RETURN_IF_ERROR(CheckApplyEntry(step, hyper));
  if (in_flight_ == nullptr) {
    in_flight_ = NewStepState(step);
    rollback_step_.store(-1);  // the step writes the store's back: the old front is gone
  }
  if (in_flight_->ranks[rank].begun) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", id(), "' rank ", rank, " already has step ", step, " in flight"));
  }
  if (apply()) RETURN_IF_ERROR(AgreeHyper(*in_flight_, rank, *hyper));
  in_flight_->ranks[rank].begun = true;
  // The rank has the last step's update: a replay of it, should this step be refused, comes from
  // the masters, and its bytes are not held beside this step's.
  if (apply()) KeepReplayAsMasters(rank);
  return absl::OkStatus();
}

void JobImpl::KeepReplayAsMasters(int rank) {
  const std::shared_ptr<const RankUpdate>& last = last_updates_[rank];
  if (last == nullptr || last->skipped || last->from_masters) return;
  auto marker = std::make_shared<RankUpdate>();
  marker->step = last->step;
  marker->compute_seconds = last->compute_seconds;
  marker->grad_sum_sq = last->grad_sum_sq;
  marker->input_digest = last->input_digest;
  marker->from_masters = true;
  for (const UpdateSpan& span : last->spans) {
    marker->spans.push_back({span.matrix, span.offset, nullptr, span.size});
  }
  last_updates_[rank] = std::move(marker);
}

void JobImpl::WriteReplayFromMasters(const RankUpdate& replay, const std::vector<char*>& out) {
  for (size_t i = 0; i < replay.spans.size() && i < out.size(); ++i) {
    const UpdateSpan& span = replay.spans[i];
    const common::DType dtype = spec_.matrices[span.matrix].param_dtype;
    common::FromFloat32(params_->front(span.matrix, ParamStore::kMaster) + span.offset,
                        span.size / common::DTypeSize(dtype), dtype, out[i]);
    CountTransportCopy(span.size);
  }
}

absl::StatusOr<std::shared_ptr<const RankUpdate>> JobImpl::ReplayFromMasters(
    int rank, const std::shared_ptr<const RankUpdate>& replay) {
  absl::MutexLock lock(&mu_);
  if (last_updates_[rank] != replay) {
    return absl::AbortedError(absl::StrCat("job '", id(), "' rank ", rank, ": step ", replay->step,
                                           " (replay): the job's state changed during the replay "
                                           "(a checkpoint load or reset); nothing changed"));
  }
  auto update = std::make_shared<RankUpdate>(*replay);
  update->from_masters = false;
  update->storage.resize(update->spans.size());
  std::vector<char*> out;
  for (size_t i = 0; i < update->spans.size(); ++i) {
    update->storage[i].assign(update->spans[i].size, '\0');
    update->spans[i].data = update->storage[i].data();
    out.push_back(update->spans[i].data);
  }
  WriteReplayFromMasters(*replay, out);
  return std::shared_ptr<const RankUpdate>(std::move(update));
}

std::shared_ptr<StepState> JobImpl::NewStepState(int64_t step) {
  auto state = std::make_shared<StepState>();
  state->step = step;
  state->start = absl::Now();
  state->ranks.resize(spec_.world_size);
  state->outputs.resize(spec_.world_size);
  state->matrix_received.assign(spec_.matrices.size(), 0);
  for (int r = 0; r < spec_.world_size; ++r) {
    state->ranks[r].span_received.assign(layout_.spans(r).size(), 0);
  }
  if (apply() || spec_.clips_outside_share()) state->sum_sq.assign(spec_.matrices.size(), 0.0);
  return state;
}

void JobImpl::PrepareOwnedRank(StepState& state, int rank) {
  RankInput& in = state.ranks[rank];
  const size_t n = layout_.spans(rank).size();
  if (static_cast<size_t>(rank) < input_pool_.size()) in.owned = std::move(input_pool_[rank]);
  in.owned.resize(n);
  in.span_in.resize(n);
  in.claimed.resize(n);
  auto out = std::make_shared<RankUpdate>();
  out->step = state.step;
  out->storage.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const common::ShardSpan& span = layout_.spans(rank)[i];
    const size_t bytes = layout_.SpanBytes(rank, i);
    in.owned[i].resize(bytes);
    in.span_in[i] = in.owned[i].data();
    // Apply mode returns the new parameters, in the tensor's param dtype.
    const size_t out_bytes = apply() ? layout_.ParamSpanBytes(rank, i) : bytes;
    out->storage[i].assign(out_bytes, '\0');
    out->spans.push_back({span.matrix, span.offset, out->storage[i].data(), out_bytes});
  }
  state.outputs[rank] = std::move(out);
}

absl::Status JobImpl::AddGradient(const std::shared_ptr<StepState>& state_ptr, int rank,
                              uint32_t matrix, uint64_t offset, std::string_view data,
                              uint32_t crc32c) {
  StepState& state = *state_ptr;
  const std::string where = absl::StrCat("job '", id(), "' step ", state.step, " rank ", rank);
  size_t span = 0;
  uint64_t count = 0;
  const absl::Status bad = CheckChunk(where, rank, matrix, offset, data, crc32c, &span, &count);
  char* dst = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (state.skipped()) {
      // The step was skipped (a non-finite gradient): the rest of its data is not needed, and
      // the rank is told "skipped" when it finishes.
      return bad.ok() || IsNonFiniteGradient(bad) ? absl::OkStatus() : bad;
    }
    if (state.committing || state.in_place || (state.done && state.result.ok())) {
      // Every element was in (a step that updates its state in place is sealed): nothing more
      // can be applied, and re-sent data is never taken. A
      // malformed chunk is still refused as malformed (its code does not depend on how far the
      // step got); the message says the step itself went through.
      const std::string committed = absl::StrCat(
          "the step is ", state.done ? "committed" : "committing",
          " (all data was in); this chunk (matrix ", matrix, " at element ", offset,
          ") was not applied; ask for step ", state.step, " again to receive its update");
      if (!bad.ok()) return absl::Status(bad.code(), absl::StrCat(bad.message(), "; ", committed));
      return absl::FailedPreconditionError(absl::StrCat(where, ": ", committed));
    }
    if (state.done) return state.result;
    if (!bad.ok()) {
      FailStep(state, bad, /*fence=*/false);
      return state.skipped() ? absl::OkStatus() : bad;
    }
    ASSIGN_OR_RETURN(dst, ClaimChunk(state, where, rank, span, offset, count));
  }
  // The claimed range is this rank's alone: copy outside the lock.
  std::memcpy(dst, data.data(), data.size());
  CountTransportCopy(data.size());
  absl::MutexLock lock(&mu_);
  if (state.done) return state.result;
  state.ranks[rank].span_received[span] += count;
  MarkReceived(state_ptr, matrix, count);
  return absl::OkStatus();
}

absl::Status JobImpl::CheckChunk(const std::string& where, int rank, uint32_t matrix, uint64_t offset,
                             std::string_view data, uint32_t crc32c, size_t* span,
                             uint64_t* count_out) const {
  return CheckGradientChunk(where, spec_, layout_, rank, matrix, offset, data, crc32c, span,
                            count_out);
}

absl::StatusOr<char*> JobImpl::ClaimChunk(StepState& state, const std::string& where, int rank,
                                      size_t span_index, uint64_t offset, uint64_t count) {
  const common::ShardSpan& span = layout_.spans(rank)[span_index];
  const common::MatrixSpec& ms = spec_.matrices[span.matrix];
  RankInput& in = state.ranks[rank];
  auto& claimed = in.claimed[span_index];
  absl::Status refused;
  switch (ClaimRange(claimed, offset, count)) {
    case ClaimResult::kClaimed:
      break;
    case ClaimResult::kOverlaps:
      refused = absl::InvalidArgumentError(
          absl::StrCat(where, ": matrix '", ms.name, "' elements [", offset, ", ", offset + count,
                       ") overlap data already received for this step"));
      break;
    case ClaimResult::kTooManyPieces:
      refused = absl::ResourceExhaustedError(absl::StrCat(
          where, ": matrix '", ms.name, "' span at element ", span.offset, " has ", claimed.size(),
          " separate pieces received (limit ", kMaxClaimedRanges, "); send chunks in order"));
      break;
  }
  if (!refused.ok()) {
    FailStep(state, refused, /*fence=*/false);
    return refused;
  }
  return in.owned[span_index].data() + (offset - span.offset) * common::DTypeSize(ms.dtype);
}

void JobImpl::MarkReceived(const std::shared_ptr<StepState>& state, uint32_t matrix, uint64_t count) {
  state->matrix_received[matrix] += count;
  if (state->matrix_received[matrix] == static_cast<uint64_t>(spec_.matrices[matrix].numel())) {
    ++state->matrices_complete;
    state->last_input = absl::Now();
    state->ready.push_back(matrix);
    if (!state->drain_queued) {
      state->drain_queued = true;
      executor_->Submit([self = shared_from_this(), state] { self->pipeline_.Drain(*state); });
    }
  }
}

void JobImpl::CommitWhenComplete(const std::shared_ptr<StepState>& state) {
  if (state->done || state->committing || state->prepared || state->drain_queued) return;
  // Ready matrices that waited for the seal (the step window was full) go now.
  if (state->ready.empty()) {
    if (state->matrices_done != spec_.matrices.size() || !state->last_parts_in()) return;
    if (spec_.clips_outside_share() && !state->every_rank_pushed()) return;
  }
  state->drain_queued = true;
  executor_->Submit([self = shared_from_this(), state] { self->pipeline_.Drain(*state); });
}

absl::StatusOr<std::shared_ptr<const RankUpdate>> JobImpl::FinishRank(
    const std::shared_ptr<StepState>& state, int rank, const std::function<bool()>& cancelled,
    double outside_sum_sq) {
  absl::MutexLock lock(&mu_);
  if (state->done) {
    if (!state->result.ok()) return state->result;
    if (state->skipped()) return state->skipped_update;
    return std::shared_ptr<const RankUpdate>(state->outputs[rank]);
  }
  RankInput& in = state->ranks[rank];
  for (size_t i = 0; i < layout_.spans(rank).size(); ++i) {
    const common::ShardSpan& span = layout_.spans(rank)[i];
    if (in.span_received[i] != span.length) {
      absl::Status s = absl::InvalidArgumentError(absl::StrCat(
          "job '", id(), "' step ", state->step, " rank ", rank, ": matrix '",
          spec_.matrices[span.matrix].name, "' is incomplete: received ", in.span_received[i],
          " of ", span.length, " elements of the rank's span at element ", span.offset,
          in.span_received[i] == 0 ? " (missing from the step)" : ""));
      FailStep(*state, s, /*fence=*/false);
      return s;
    }
  }
  if (!spec_.clips_outside_share() && outside_sum_sq != 0) {
    absl::Status s = absl::InvalidArgumentError(absl::StrCat(
        "job '", id(), "' step ", state->step, " rank ", rank,
        ": StepEnd carries a sum of squares outside the job (", outside_sum_sq,
        "), but the job does not clip in mode 'update' (max_grad_norm 0, or mode 'apply'); the "
        "step is refused, nothing changed"));
    FailStep(*state, s, /*fence=*/false);
    return s;
  }
  if (spec_.clips_outside_share()) {
    absl::Status bad = CheckOutsideSumSq(
        absl::StrCat("job '", id(), "' step ", state->step, " rank ", rank), outside_sum_sq);
    if (!bad.ok()) {
      FailStep(*state, bad, /*fence=*/false);
      if (state->skipped()) return state->skipped_update;
      return bad;
    }
    in.outside_sum_sq = outside_sum_sq;
  }
  in.finished = true;
  // Update mode with max_grad_norm: the step's norm waited for this rank's share.
  if (spec_.clips_outside_share()) CommitWhenComplete(state);
  while (!state->done && !state->prepared) {
    state->cv.WaitWithTimeout(&mu_, kCancelPoll);
    if (!state->done && !state->prepared && cancelled && cancelled()) {
      FailStep(
          *state,
          absl::AbortedError(absl::StrCat("job '", id(), "' step ", state->step, " aborted: rank ",
                                          rank, " went away while waiting for the step")),
          /*fence=*/true);
    }
  }
  if (state->prepared) return std::shared_ptr<const RankUpdate>(state->outputs[rank]);
  if (!state->result.ok()) return state->result;
  if (state->skipped()) return state->skipped_update;
  return std::shared_ptr<const RankUpdate>(state->outputs[rank]);
}

}  // namespace muond::server
