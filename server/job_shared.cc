// The shared-memory side of a Job: whole-shard submissions from a rank's regions and the end of
// a rank's shared-memory session (see job.h).
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "server/job.h"
#include "server/job_internal.h"
#include "common/status_macros.h"
#include "server/parallel_bytes.h"

namespace muond::server {

absl::Status Job::SubmitShared(int rank, uint64_t session, int64_t step,
                              const std::vector<const char*>& in, const std::vector<char*>& out,
                              std::shared_ptr<const void> keepalive, SharedDone done) {
  RETURN_IF_ERROR(CheckRank(rank));
  const std::vector<common::ShardSpan>& spans = rank_spans_[rank];
  if (in.size() != spans.size() || out.size() != spans.size()) {
    return absl::InternalError("shared submission with the wrong number of spans");
  }
  const std::string where = absl::StrCat("job '", id(), "' step ", step, " rank ", rank);
  // Every value is checked in place, before the step knows about the rank: in slices of 1M
  // elements over the CPUs, then the first bad element reported.
  struct Slice {
    size_t span;
    uint64_t first;
    uint64_t count;
  };
  constexpr uint64_t kSlice = uint64_t{1} << 20;
  std::vector<Slice> slices;
  size_t total = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    for (uint64_t at = 0; at < spans[i].length; at += kSlice) {
      slices.push_back({i, at, std::min(kSlice, spans[i].length - at)});
    }
    total += spans[i].length * common::DTypeSize(spec_.matrices[spans[i].matrix].dtype);
  }
  std::vector<int64_t> found(slices.size(), -1);
  ParallelFor(slices.size(), total, [&](size_t k) {
    const Slice& sl = slices[k];
    const common::DType dtype = spec_.matrices[spans[sl.span].matrix].dtype;
    found[k] = common::FindNonFiniteRaw(dtype, in[sl.span] + sl.first * common::DTypeSize(dtype),
                                        sl.count);
  });
  for (size_t k = 0; k < slices.size(); ++k) {
    if (found[k] < 0) continue;
    const size_t i = slices[k].span;
    const common::MatrixSpec& ms = spec_.matrices[spans[i].matrix];
    if (const int64_t at = static_cast<int64_t>(slices[k].first) + found[k]; at >= 0) {
      absl::Status bad = absl::InvalidArgumentError(absl::StrCat(
          where, ": matrix '", ms.name, "' has a non-finite gradient value at element ",
          spans[i].offset + static_cast<uint64_t>(at),
          "; the step is refused for every rank and the momentum is unchanged"));
      absl::MutexLock lock(&mu_);
      if (in_flight_ != nullptr && in_flight_->step == step) {
        FailStep(*in_flight_, bad, false);
        // This rank learns of the refusal from this very answer: it is not owed it again on its
        // retry (it never began the step, so FailStep counted it among the ranks owed it).
        if (refusal_.step == step && static_cast<size_t>(rank) < refusal_.owed.size()) {
          refusal_.owed[rank] = false;
        }
      } else if (!deleted_ && !fenced_ && sessions_[rank] == session && step == next_step_) {
        // Refused before any rank began the step: the ranks that submit it later are owed the
        // refusal, or they would begin a step this rank has already left.
        if (refusal_.step == step && refusal_.owed[rank]) {
          refusal_.owed[rank] = false;  // a refusal of this same attempt; it learns of it now
        } else {
          ++steps_refused_;
          refusal_.step = step;
          refusal_.status = bad;
          refusal_.owed.assign(spec_.world_size, true);
          refusal_.owed[rank] = false;
          MUOND_LOG(INFO) << "job '" << id() << "' step " << step << " refused: " << bad.message();
        }
      }
      return bad;
    }
  }
  absl::MutexLock lock(&mu_);
  std::shared_ptr<const RankUpdate> replay;
  RETURN_IF_ERROR(EnterStep(rank, session, step, &replay));
  if (replay != nullptr) {
    // The committed bytes go where the rank reads them (already there when the rank used the
    // same buffer).
    for (size_t i = 0; i < out.size(); ++i) {
      if (out[i] != replay->spans[i].data) {
        std::memcpy(out[i], replay->spans[i].data, replay->spans[i].size);
        CountHostCopy(replay->spans[i].size);
      }
    }
    done(absl::OkStatus(), /*replayed=*/true, replay->compute_seconds);
    return absl::OkStatus();
  }
  StepState& state = *in_flight_;
  RankInput& rin = state.ranks[rank];
  rin.finished = true;
  rin.span_in = in;
  rin.keepalive = keepalive;
  rin.done = std::move(done);
  auto update = std::make_shared<RankUpdate>();
  update->step = step;
  update->keepalive = std::move(keepalive);
  for (size_t i = 0; i < spans.size(); ++i) {
    const size_t bytes = spans[i].length * common::DTypeSize(spec_.matrices[spans[i].matrix].dtype);
    update->spans.push_back({spans[i].matrix, spans[i].offset, out[i], bytes});
    rin.span_received[i] = spans[i].length;
    state.matrix_received[spans[i].matrix] += spans[i].length;
    if (state.matrix_received[spans[i].matrix] ==
        static_cast<uint64_t>(spec_.matrices[spans[i].matrix].numel())) {
      state.ready.push_back(spans[i].matrix);
    }
  }
  state.outputs[rank] = std::move(update);
  if (!state.ready.empty() && !state.drain_queued) {
    state.drain_queued = true;
    executor_->Submit([self = shared_from_this(), state_ptr = in_flight_] {
      self->DrainReady(state_ptr);
    });
  }
  return absl::OkStatus();
}

void Job::EndSharedSession(int rank, uint64_t session, const void* keepalive, bool clean) {
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
    // The committed update lives in the regions being released: keep a private copy, so a rank
    // that comes back (over either transport) can still replay the step.
    const RankUpdate& last = *last_updates_[rank];
    auto copy = std::make_shared<RankUpdate>();
    copy->step = last.step;
    copy->compute_seconds = last.compute_seconds;
    copy->storage.resize(last.spans.size());
    for (size_t i = 0; i < last.spans.size(); ++i) {
      copy->storage[i].assign(last.spans[i].data, last.spans[i].size);
      copy->spans.push_back({last.spans[i].matrix, last.spans[i].offset, copy->storage[i].data(),
                             last.spans[i].size});
    }
    last_updates_[rank] = std::move(copy);
  }
  if (sessions_[rank] == session) {
    sessions_[rank] = 0;
    // A peer that died between steps: a step the others begin before it attaches again is
    // refused at once instead of waiting for it.
    if (!clean) lost_[rank] = "its shared-memory session ended without a detach";
  }
}

}  // namespace muond::server
