// A rank's steps over shared memory: the views of its buffers, a step in place or posted in
// parts (with the hyperparameters and the outside sum of squares written where the daemon reads
// them), and RankSession::StepShared, which copies spans in and out. Attaching and the
// transport-neutral steps are in client_session.cc.
#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/daemon_call.h"
#include "client/shm_channel.h"
#include "client/span_placement.h"
#include "common/status_macros.h"

namespace muond::client {

absl::StatusOr<RankSession::View> RankSession::GradientView(int64_t step) {
  if (shm_ == nullptr) return absl::FailedPreconditionError("not a shared-memory session");
  if (step < 0) return absl::InvalidArgumentError("negative step");
  return View{shm_->GradientBuffer(step), shm_->buffer_bytes()};
}

absl::StatusOr<RankSession::View> RankSession::UpdateView(int64_t step) {
  if (shm_ == nullptr) return absl::FailedPreconditionError("not a shared-memory session");
  if (step < 0) return absl::InvalidArgumentError("negative step");
  return View{const_cast<char*>(shm_->UpdateBuffer(step)), shm_->buffer_bytes()};
}

namespace {

// A shared-memory step's outcome (its whole buffer went in, its update came out).
absl::StatusOr<StepResult> SharedResult(const absl::StatusOr<ShmChannel::Ringing>& r,
                                        int64_t step, uint64_t buffer_bytes) {
  if (!r.ok()) return Annotate(r.status(), absl::StrCat("step ", step));
  StepResult result;
  result.step = r->step;
  result.replayed = r->replayed;
  result.skipped = r->skipped;
  result.compute_seconds = r->seconds;
  result.grad_sum_sq = r->grad_sum_sq;
  result.bytes_in = buffer_bytes;
  result.bytes_out = r->skipped ? 0 : buffer_bytes;
  return result;
}

}  // namespace

absl::StatusOr<StepResult> RankSession::StepInPlace(int64_t step) {
  if (shm_ == nullptr) return absl::FailedPreconditionError("not a shared-memory session");
  RETURN_IF_ERROR(CheckStepHyper(step));
  if (apply() && step >= 0) RETURN_IF_ERROR(WriteSharedHyper(step));  // Ring refuses step < 0
  if (step >= 0) RETURN_IF_ERROR(WriteSharedOutsideSumSq(step));
  return SharedResult(shm_->Ring(step), step, shm_->buffer_bytes());
}

absl::Status RankSession::PostPart(int64_t step, uint64_t byte_offset, uint64_t bytes,
                                   bool last) {
  if (shm_ == nullptr) {
    return absl::FailedPreconditionError(
        "steps in parts are a shared-memory feature; over gRPC the step stream sends the "
        "gradients chunk by chunk (StepBuffer, Step)");
  }
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("step ", step, " is negative"));
  if (parts_step_ != step) {  // the first part: the daemon reads the hyperparameters with it
    RETURN_IF_ERROR(CheckStepHyper(step));
    if (apply()) RETURN_IF_ERROR(WriteSharedHyper(step));
  }
  if (last) RETURN_IF_ERROR(WriteSharedOutsideSumSq(step));  // read with the last part
  absl::Status posted = shm_->Post(step, byte_offset, bytes, last);
  if (!posted.ok()) return Annotate(posted, absl::StrCat("step ", step));
  parts_step_ = last ? -1 : step;
  return absl::OkStatus();
}

absl::Status RankSession::WriteSharedOutsideSumSq(int64_t step) {
  if (!spec_.clips_outside_share()) return absl::OkStatus();
  const uint64_t at = shm_->hyper_byte_offset();
  const uint64_t size = shm_->buffer_bytes();
  bool fits = at % alignof(double) == 0 && at <= size &&
              common::shm::kOutsideSumSqBytes <= size - at;
  for (const ShmSpan& r : shm_->spans()) {
    const uint64_t begin = r.byte_offset;
    const uint64_t end = begin + r.length * common::DTypeSize(spec_.matrices[r.matrix].dtype);
    if (at < end && begin < at + common::shm::kOutsideSumSqBytes) fits = false;
  }
  if (!fits) {
    return absl::InternalError(absl::StrCat(
        "the daemon's shared-memory layout has no room for the step's outside sum of squares "
        "(8 bytes at byte ", at, " of a ", size, "-byte gradient buffer, clear of the gradients)"));
  }
  std::memcpy(shm_->GradientBuffer(step) + at, &outside_sum_sq_, sizeof(double));
  return absl::OkStatus();
}

absl::StatusOr<StepResult> RankSession::WaitParts(int64_t step) {
  if (shm_ == nullptr) return absl::FailedPreconditionError("not a shared-memory session");
  return SharedResult(shm_->WaitStep(step), step, shm_->buffer_bytes());
}

absl::Status RankSession::PartsProgress(int64_t step, double timeout_seconds,
                                        std::vector<bool>* ready, bool* ended) {
  if (shm_ == nullptr) return absl::FailedPreconditionError("not a shared-memory session");
  const int timeout_ms =
      timeout_seconds < 0 ? -1 : static_cast<int>(std::min(timeout_seconds, 3600.0) * 1e3);
  RETURN_IF_ERROR(shm_->WaitProgress(timeout_ms));
  *ended = shm_->StepEnded(step);
  ready->resize(shm_->spans().size());
  for (size_t i = 0; i < ready->size(); ++i) (*ready)[i] = shm_->SpanReady(i, step);
  if (*ended) {
    absl::Status outcome = shm_->StepOutcome(step);
    if (!outcome.ok()) return Annotate(outcome, absl::StrCat("step ", step));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepResult> RankSession::StepShared(int64_t step,
                                                   const std::vector<GradientSpan>& grads,
                                                   const std::vector<UpdateSpan>& updates) {
  // Place every gradient span in the region; together they must cover the rank's spans exactly,
  // since the daemon reads the whole buffer.
  ASSIGN_OR_RETURN(View in, GradientView(step));
  const auto& regions = shm_->spans();
  std::vector<uint64_t> covered(regions.size(), 0);
  for (const GradientSpan& g : grads) {
    ASSIGN_OR_RETURN(const BufferPlace place,
                     PlaceInBuffer(regions, spec_, g.matrix, g.offset, g.length, "gradient",
                                   BufferLayout::kGradients));
    std::memcpy(in.data + place.byte_offset, g.data, place.bytes);
    covered[place.region] += g.length;
  }
  for (size_t i = 0; i < regions.size(); ++i) {
    if (covered[i] != regions[i].length) {
      return absl::InvalidArgumentError(absl::StrCat(
          "matrix '", spec_.matrices[regions[i].matrix].name, "': the gradient spans cover ",
          covered[i], " of the rank's ", regions[i].length, " elements at element ",
          regions[i].offset));
    }
  }
  // Check the update spans before the step: a step that ran cannot be taken back.
  const BufferLayout out_layout = apply() ? BufferLayout::kParameters : BufferLayout::kGradients;
  std::vector<BufferPlace> out_places;
  for (const UpdateSpan& u : updates) {
    ASSIGN_OR_RETURN(const BufferPlace place, PlaceInBuffer(regions, spec_, u.matrix, u.offset,
                                                            u.length, "update", out_layout));
    if (place.byte_offset + place.bytes > shm_->buffer_bytes()) {
      return absl::InternalError(absl::StrCat(
          "the daemon's shared-memory layout puts the update of matrix '",
          spec_.matrices[u.matrix].name, "' past the end of its ", shm_->buffer_bytes(),
          "-byte buffer"));
    }
    out_places.push_back(place);
  }
  ASSIGN_OR_RETURN(StepResult result, StepInPlace(step));
  const char* out = shm_->UpdateBuffer(step);
  for (size_t i = 0; i < updates.size(); ++i) {
    const UpdateSpan& u = updates[i];
    const BufferPlace& place = out_places[i];
    std::memcpy(u.data, out + place.byte_offset, place.bytes);
  }
  return result;
}

}  // namespace muond::client
