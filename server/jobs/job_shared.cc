// The shared-memory side of a Job: submissions from a rank's regions (whole or in parts) and the
// end of a rank's shared-memory session (see job.h).
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/jobs/gradient_check.h"
#include "server/jobs/job_impl.h"

namespace muond::server {

absl::Status JobImpl::SubmitShared(int rank, uint64_t session, int64_t step,
                               const std::vector<const char*>& in, const std::vector<char*>& out,
                               std::shared_ptr<const void> keepalive, SharedDone done,
                               const StepHyper* hyper, SharedProgress progress,
                               double outside_sum_sq) {
  RETURN_IF_ERROR(CheckRank(rank));
  SharedPart whole;
  whole.outside_sum_sq = outside_sum_sq;
  whole.spans.resize(layout_.spans(rank).size());
  for (size_t i = 0; i < whole.spans.size(); ++i) whole.spans[i] = i;
  return SubmitSharedPart(rank, session, step, whole, in, out, std::move(keepalive),
                          std::move(done), hyper, std::move(progress));
}

absl::Status JobImpl::SubmitSharedPart(int rank, uint64_t session, int64_t step,
                                       const SharedPart& part, const std::vector<const char*>& in,
                                       const std::vector<char*>& out,
                                       std::shared_ptr<const void> keepalive, SharedDone done,
                                       const StepHyper* hyper, SharedProgress progress) {
  RETURN_IF_ERROR(CheckRank(rank));
  const std::vector<common::ShardSpan>& spans = layout_.spans(rank);
  if (in.size() != spans.size() || out.size() != spans.size()) {
    return absl::InternalError("shared submission with the wrong number of spans");
  }
  for (size_t i : part.spans) {
    if (i >= spans.size()) return absl::InternalError("shared part names a span the rank lacks");
  }
  const std::string where = absl::StrCat("job '", id(), "' step ", step, " rank ", rank);
  const absl::Status bad = CheckPartValues(where, rank, part, in);
  absl::MutexLock lock(&mu_);
  RankInput* const open = SharedRankInFlight(rank, session, step, keepalive.get());
  // A later part of the step this rank is sending in parts.
  const bool continuing = open != nullptr && open->parts_open;
  if (part.continues && open == nullptr && step == next_step_) {
    // The try these parts belong to ended before this one arrived (another rank's part was
    // refused, or the step was aborted): opening a new try with it would hold half the rank's
    // gradients, refuse the other ranks' retry as "missing", and leave them waiting.
    return CutShortPart(rank, session, step, where);
  }
  if (!bad.ok()) return RefuseBadPart(rank, session, step, part, continuing, bad, done);
  if (open != nullptr && open->finished) return RefuseLatePart(where);
  if (!continuing) {
    bool replayed = false;
    RETURN_IF_ERROR(OpenSharedStep(rank, session, step, part.last, in, out, std::move(keepalive),
                                   done, hyper, std::move(progress), &replayed));
    if (replayed) return absl::OkStatus();
  }
  const std::shared_ptr<StepState> state = in_flight_;
  RETURN_IF_ERROR(TakePartSpans(state, rank, part, where));
  if (!part.last) return absl::OkStatus();
  return FinishSharedParts(state, rank, part, where, std::move(done));
}

absl::Status JobImpl::CheckPartValues(const std::string& where, int rank, const SharedPart& part,
                                      const std::vector<const char*>& in) const {
  // The part's values are checked in place, before the step knows about them.
  const std::vector<common::ShardSpan>& spans = layout_.spans(rank);
  std::vector<common::ShardSpan> part_spans;
  std::vector<const char*> part_in;
  for (size_t i : part.spans) {
    part_spans.push_back(spans[i]);
    part_in.push_back(in[i]);
  }
  RETURN_IF_ERROR(CheckFiniteSpans(where, spec_, part_spans, part_in));
  // Update mode with max_grad_norm: the last part's share of the norm, under the same rule (a
  // non-finite share is a non-finite gradient), before any of the part's spans is taken.
  if (part.last && spec_.clips_outside_share()) {
    RETURN_IF_ERROR(CheckOutsideSumSq(where, part.outside_sum_sq));
  }
  return absl::OkStatus();
}

absl::Status JobImpl::RefuseBadPart(int rank, uint64_t session, int64_t step,
                                    const SharedPart& part, bool continuing,
                                    const absl::Status& bad, SharedDone& done) {
  if (continuing) {
    FailStep(*in_flight_, bad, /*fence=*/false);
  } else {
    RefuseSubmission(rank, session, step, bad);
  }
  // "nonfinite": "skip": the step was skipped for every rank; this rank learns it at its last
  // part (the parts after this one are answered as parts of the skipped step).
  if (const auto& last = last_updates_[rank];
      last != nullptr && last->skipped && last->step == step) {
    if (part.last) done(absl::OkStatus(), kDoneSkipped, 0, 0);
    return absl::OkStatus();
  }
  return bad;
}

absl::Status JobImpl::RefuseLatePart(const std::string& where) {
  // The rank's last part is in and the step still runs: nothing may join it now.
  if (in_flight_->committing || in_flight_->prepared || in_flight_->in_place) {
    return absl::FailedPreconditionError(
        absl::StrCat(where,
                     ": a part after the rank's last part; the step is committing (all data was "
                     "in, the state updating), this part was not applied"));
  }
  absl::Status late = absl::InvalidArgumentError(
      absl::StrCat(where, ": a part after the rank's last part of the step"));
  FailStep(*in_flight_, late, /*fence=*/false);
  return late;
}

absl::Status JobImpl::TakePartSpans(const std::shared_ptr<StepState>& state, int rank,
                                    const SharedPart& part, const std::string& where) {
  const std::vector<common::ShardSpan>& spans = layout_.spans(rank);
  RankInput& rin = state->ranks[rank];
  for (size_t i : part.spans) {
    if (rin.span_received[i] == 0) continue;
    absl::Status overlap = absl::InvalidArgumentError(absl::StrCat(
        where, ": matrix '", spec_.matrices[spans[i].matrix].name, "' span at element ",
        spans[i].offset, " is in two parts of the step (each span goes in exactly one part)"));
    FailStep(*state, overlap, /*fence=*/false);
    return overlap;
  }
  for (size_t i : part.spans) {
    rin.span_received[i] = spans[i].length;
    // A drain queued here waits for the job's lock, held until the outputs are in place.
    MarkReceived(state, spans[i].matrix, spans[i].length);
  }
  return absl::OkStatus();
}

absl::Status JobImpl::FinishSharedParts(const std::shared_ptr<StepState>& state, int rank,
                                        const SharedPart& part, const std::string& where,
                                        SharedDone done) {
  const std::vector<common::ShardSpan>& spans = layout_.spans(rank);
  RankInput& rin = state->ranks[rank];
  for (size_t i = 0; i < spans.size(); ++i) {
    if (rin.span_received[i] == spans[i].length) continue;
    absl::Status missing = absl::InvalidArgumentError(absl::StrCat(
        where, ": matrix '", spec_.matrices[spans[i].matrix].name, "' span at element ",
        spans[i].offset, " (", spans[i].length, " elements) is in no part of the step"));
    FailStep(*state, missing, /*fence=*/false);
    return missing;
  }
  if (spec_.clips_outside_share()) rin.outside_sum_sq = part.outside_sum_sq;  // checked before
  rin.parts_open = false;
  rin.finished = true;
  // Not done yet: a step that ends (commit or failure) leaves in_flight_ under this lock.
  rin.done = std::move(done);
  CommitWhenComplete(state);
  return absl::OkStatus();
}

absl::Status JobImpl::CutShortPart(int rank, uint64_t session, int64_t step,
                               const std::string& where) const {
  const CutShort& cut = cut_short_[rank];
  if (cut.step != step || cut.session != session) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": a later part of a try of the step that is not in flight; nothing of it is "
               "applied; send the step again from its first part"));
  }
  return absl::Status(
      cut.why.code(),
      absl::StrCat(where, ": the step ended before this part arrived (", cut.why.message(),
                   "); this part and the rest of the try are not applied; send the step again"));
}

RankInput* JobImpl::SharedRankInFlight(int rank, uint64_t session, int64_t step,
                                   const void* keepalive) {
  if (in_flight_ == nullptr || in_flight_->step != step || sessions_[rank] != session) {
    return nullptr;
  }
  RankInput& rin = in_flight_->ranks[rank];
  return rin.keepalive.get() == keepalive ? &rin : nullptr;
}

absl::Status JobImpl::OpenSharedStep(int rank, uint64_t session, int64_t step, bool last,
                                 const std::vector<const char*>& in, const std::vector<char*>& out,
                                 std::shared_ptr<const void> keepalive, SharedDone& done,
                                 const StepHyper* hyper, SharedProgress progress, bool* replayed) {
  std::shared_ptr<const RankUpdate> replay;
  RETURN_IF_ERROR(EnterStep(rank, session, step, hyper, &replay));
  *replayed = replay != nullptr;
  if (replay != nullptr) {
    // A skipped step (its own late ranks, or a retry of it) is answered "skipped", whatever the
    // gradients: nothing was computed from them.
    if (replay->skipped) {
      if (last) done(absl::OkStatus(), kDoneSkipped, 0, 0);
      return absl::OkStatus();
    }
    // A replay must carry the gradients the step was computed from: checked when the whole step
    // is in (its last part).
    if (last) RETURN_IF_ERROR(CheckReplayInput(rank, *replay, in));
    // The committed bytes go where the rank reads them (already there when the rank used the
    // same buffer; apply mode writes them from the masters). Every part of a replayed step is
    // answered so.
    if (replay->from_masters) WriteReplayFromMasters(*replay, out);
    for (size_t i = 0; i < out.size() && !replay->from_masters; ++i) {
      if (out[i] != replay->spans[i].data) {
        std::memcpy(out[i], replay->spans[i].data, replay->spans[i].size);
        CountTransportCopy(replay->spans[i].size);
      }
    }
    if (last) {
      done(absl::OkStatus(), kDoneReplayed, replay->compute_seconds, replay->grad_sum_sq);
    }
    return absl::OkStatus();
  }
  cut_short_[rank] = CutShort{};
  const std::vector<common::ShardSpan>& spans = layout_.spans(rank);
  RankInput& rin = in_flight_->ranks[rank];
  rin.span_in = in;
  rin.keepalive = keepalive;
  rin.parts_open = true;
  auto update = std::make_shared<RankUpdate>();
  update->step = step;
  update->keepalive = std::move(keepalive);
  update->progress = std::move(progress);
  // The try owns the rank's progress words from here: a refused, dropped or aborted try of this
  // step may have set some (its pipeline announces nothing once it ended: step_pipeline.cc), and
  // none of them may read as this try's. The rank trusts the words only after the completion of
  // this try's first part, which this lock orders after the clearing (client/shm_channel.cc).
  if (update->progress.words != nullptr) {
    for (size_t i = 0; i < spans.size(); ++i) {
      __atomic_store_n(&update->progress.words[i], int64_t{0}, __ATOMIC_RELEASE);
    }
  }
  for (size_t i = 0; i < spans.size(); ++i) {
    // Apply mode returns the new parameters, in the tensor's param dtype.
    const size_t out_bytes = apply() ? layout_.ParamSpanBytes(rank, i) : layout_.SpanBytes(rank, i);
    update->spans.push_back({spans[i].matrix, spans[i].offset, out[i], out_bytes});
  }
  in_flight_->outputs[rank] = std::move(update);
  return absl::OkStatus();
}

absl::Status JobImpl::RefuseSharedPart(int rank, uint64_t session, int64_t step,
                                   const void* keepalive, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  const RankInput* open = SharedRankInFlight(rank, session, step, keepalive);
  if (open != nullptr && open->parts_open) FailStep(*in_flight_, why, /*fence=*/false);
  return why;
}

void JobImpl::EndSharedSession(int rank, uint64_t session, const void* keepalive, bool clean) {
  if (rank < 0 || rank >= spec_.world_size) return;
  absl::MutexLock lock(&mu_);
  if (in_flight_ != nullptr) {
    const RankInput& rin = in_flight_->ranks[rank];
    // The rank submitted through this session, or it still owed its part of the step: with its
    // session gone it can never complete the step, and the other ranks would wait for it forever.
    const bool submitted = keepalive != nullptr && rin.keepalive.get() == keepalive;
    // A clean detach that still owed its part ends the step the same way: the others would wait
    // for it until the step timeout.
    const bool owed = sessions_[rank] == session && !rin.begun;
    if (submitted || owed) {
      FailStep(*in_flight_,
               absl::AbortedError(absl::StrCat(
                   "job '", id(), "' step ", in_flight_->step, " aborted: rank ", rank,
                   " (shared memory) ", clean ? "detached " : "went away ",
                   submitted ? "during the step" : "before submitting its part of the step")),
               /*fence=*/true);
    }
  }
  if (last_updates_[rank] != nullptr && last_updates_[rank]->keepalive.get() == keepalive) {
    // The committed update lives in the regions being released. A rank that comes back (over
    // either transport) replays it: apply mode from the masters, update mode from a private copy
    // (with Nesterov the update cannot be rebuilt from the momentum).
    if (apply()) {
      KeepReplayAsMasters(rank);
    } else {
      // Everything the rank was told (sum of squares, skipped, digest) travels with the bytes.
      const RankUpdate& last = *last_updates_[rank];
      auto copy = std::make_shared<RankUpdate>(last);
      copy->keepalive = nullptr;
      copy->progress = SharedProgress{};
      copy->storage.assign(last.spans.size(), std::string());
      for (size_t i = 0; i < last.spans.size(); ++i) {
        copy->storage[i].assign(last.spans[i].data, last.spans[i].size);
        copy->spans[i].data = copy->storage[i].data();
      }
      last_updates_[rank] = std::move(copy);
    }
  }
  if (sessions_[rank] == session) {
    sessions_[rank] = 0;
    // A peer that died between steps: a step the others begin before it attaches again is
    // refused at once instead of waiting for it.
    if (!clean) lost_[rank] = "its shared-memory session ended without a detach";
  }
}

}  // namespace muond::server
