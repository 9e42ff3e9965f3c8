#include "server/job.h"
#include "server/daemon_metrics.h"
#include "server/job_internal.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/dtype.h"
#include "common/job_spec_proto.h"
#include "common/logging.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "server/muon/muon_math.h"

namespace muond::server {

RankStep::RankStep(std::shared_ptr<Job> job, int rank, int64_t step,
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
    // A replay returns the committed bytes; resent gradients are checked for transport integrity
    // only and never applied again.
    if (common::Crc32c(data.data(), data.size()) != crc32c) {
      return absl::InvalidArgumentError(absl::StrCat("step ", step_, " (replay): matrix ", matrix,
                                                     " chunk at element ", offset,
                                                     ": CRC32C mismatch"));
    }
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
    const std::function<bool()>& cancelled) {
  if (done_) return absl::FailedPreconditionError("the step already ended for this rank");
  done_ = true;
  if (replay_ != nullptr) return replay_;
  return job_->FinishRank(state_, rank_, cancelled);
}

Job::Job(common::JobSpec spec, std::string token_sha256, std::string backend,
         ComputeExecutor* executor, uint64_t gather_budget_bytes, ComputeDevice* compute,
         std::string checkpoint_dir, absl::Duration step_timeout, JobOwner owner)
    : spec_(std::move(spec)),
      token_sha256_(std::move(token_sha256)),
      backend_(std::move(backend)),
      executor_(executor),
      compute_(compute),
      gather_budget_bytes_(gather_budget_bytes),
      step_timeout_(step_timeout),
      owner_(std::move(owner)),
      created_unix_ms_(absl::ToUnixMillis(absl::Now())),
      store_(std::move(checkpoint_dir), spec_.checkpoint_keep) {
  const size_t num_matrices = spec_.matrices.size();
  matrix_spans_.resize(num_matrices);
  for (int r = 0; r < spec_.world_size; ++r) {
    rank_spans_.push_back(common::RankSpans(spec_, r));
    const std::vector<common::ShardSpan>& spans = rank_spans_[r];
    std::vector<uint32_t>& index = rank_span_index_.emplace_back(spans.size());
    for (size_t i = 0; i < spans.size(); ++i) {
      index[i] = static_cast<uint32_t>(i);
      matrix_spans_[spans[i].matrix].push_back({r, i});
    }
    std::sort(index.begin(), index.end(), [&spans](uint32_t a, uint32_t b) {
      return spans[a].matrix != spans[b].matrix ? spans[a].matrix < spans[b].matrix
                                                : spans[a].offset < spans[b].offset;
    });
  }
  momentum_.resize(num_matrices);
  pinned_.assign(num_matrices, false);
  for (size_t m = 0; m < num_matrices && !spec_.transport_probe; ++m) {
    momentum_[m].assign(static_cast<size_t>(spec_.matrices[m].numel()), 0.0f);
    pinned_[m] = compute_->device->RegisterHost(momentum_[m].data(),
                                                momentum_[m].size() * sizeof(float));
  }
  absl::MutexLock lock(&mu_);
  sessions_.assign(spec_.world_size, 0);
  lost_.resize(spec_.world_size);
  last_updates_.resize(spec_.world_size);
}

Job::~Job() {
  for (size_t m = 0; m < momentum_.size(); ++m) {
    if (pinned_[m]) {
      compute_->device->UnregisterHost(momentum_[m].data(), momentum_[m].size() * sizeof(float));
    }
  }
}

bool Job::TokenMatches(std::string_view token) const {
  const std::string hash = common::Sha256(token);
  if (hash.size() != token_sha256_.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < hash.size(); ++i) diff |= hash[i] ^ token_sha256_[i];
  return diff == 0;
}

absl::StatusOr<uint64_t> Job::Attach(int rank, bool takeover) {
  RETURN_IF_ERROR(CheckRank(rank));
  absl::MutexLock lock(&mu_);
  if (deleted_) return absl::NotFoundError(absl::StrCat("job '", id(), "' was deleted"));
  if (sessions_[rank] != 0) {
    if (!takeover) {
      return absl::AlreadyExistsError(absl::StrCat(
          "job '", id(), "': rank ", rank, " is already attached (session ", sessions_[rank],
          "); detach it, or attach with takeover to replace a session whose process is gone"));
    }
    if (in_flight_ != nullptr && in_flight_->ranks[rank].begun &&
        !in_flight_->ranks[rank].finished) {
      FailStep(*in_flight_,
               absl::AbortedError(absl::StrCat("job '", id(), "' step ", in_flight_->step,
                                               " aborted: rank ", rank,
                                               " was taken over by a new session mid-step")),
               /*fence=*/true);
    }
    MUOND_LOG(INFO) << "job '" << id() << "' rank " << rank << ": session " << sessions_[rank]
                    << " taken over";
  }
  sessions_[rank] = next_session_++;
  lost_[rank].clear();
  return sessions_[rank];
}

absl::Status Job::Detach(int rank, uint64_t session) {
  RETURN_IF_ERROR(CheckRank(rank));
  absl::MutexLock lock(&mu_);
  if (sessions_[rank] == 0 || sessions_[rank] != session) {
    return absl::FailedPreconditionError(absl::StrCat("job '", id(), "' rank ", rank,
                                                      ": session ", session,
                                                      " is not the rank's current session"));
  }
  if (in_flight_ != nullptr) AbortIfOwed(rank, "detached during the step");
  sessions_[rank] = 0;
  return absl::OkStatus();
}

absl::Status Job::CheckSession(int rank, uint64_t session) const {
  RETURN_IF_ERROR(CheckRank(rank));
  absl::MutexLock lock(&mu_);
  if (deleted_) return absl::NotFoundError(absl::StrCat("job '", id(), "' was deleted"));
  if (sessions_[rank] == 0 || sessions_[rank] != session) {
    return absl::FailedPreconditionError(absl::StrCat("job '", id(), "' rank ", rank,
                                                      ": session ", session,
                                                      " is not the rank's current session"));
  }
  return absl::OkStatus();
}

void Job::AbortIfOwed(int rank, const std::string& why) {
  const RankInput& in = in_flight_->ranks[rank];
  if (in.begun && in.pushed()) return;
  FailStep(*in_flight_,
           absl::AbortedError(absl::StrCat("job '", id(), "' step ", in_flight_->step,
                                           " aborted: rank ", rank, " ", why,
                                           in.begun ? " before it finished pushing its part"
                                                    : " before it began its part")),
           /*fence=*/true);
}

void Job::EndLostSession(int rank, uint64_t session, const std::string& why) {
  if (rank < 0 || rank >= spec_.world_size) return;
  absl::MutexLock lock(&mu_);
  if (sessions_[rank] != session) return;  // detached or taken over meanwhile
  if (in_flight_ != nullptr) AbortIfOwed(rank, absl::StrCat("went away (", why, ")"));
  sessions_[rank] = 0;
  lost_[rank] = why;
  MUOND_LOG(WARNING) << "job '" << id() << "' rank " << rank << ": session " << session
                     << " lost: " << why;
}

void Job::CheckStepTimeout(absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (in_flight_ == nullptr || in_flight_->done || in_flight_->committing) return;
  if (now - in_flight_->start < step_timeout_) return;
  std::vector<int> absent, pushing;
  for (int r = 0; r < spec_.world_size; ++r) {
    const RankInput& in = in_flight_->ranks[r];
    if (!in.begun) {
      absent.push_back(r);
    } else if (!in.pushed()) {
      pushing.push_back(r);
    }
  }
  if (absent.empty() && pushing.empty()) return;  // all data is in: the device is working on it
  auto list = [](const std::vector<int>& ranks) {
    constexpr size_t kShown = 16;
    std::vector<int> shown(ranks.begin(), ranks.begin() + std::min(ranks.size(), kShown));
    return absl::StrCat(absl::StrJoin(shown, ", "),
                        ranks.size() > kShown ? absl::StrCat(" and ", ranks.size() - kShown,
                                                             " more")
                                              : "");
  };
  std::string missing;
  if (!absent.empty()) missing = absl::StrCat("ranks never arrived: ", list(absent));
  if (!pushing.empty()) {
    absl::StrAppend(&missing, missing.empty() ? "" : "; ",
                    "ranks did not finish pushing: ", list(pushing));
  }
  FailStep(*in_flight_,
           absl::AbortedError(absl::StrCat(
               "job '", id(), "' step ", in_flight_->step, " aborted: the step timeout of ",
               absl::ToInt64Seconds(step_timeout_), " s expired (", missing, ")")),
           /*fence=*/true);
}

std::shared_ptr<StepState> Job::NewStepState(int64_t step) {
  auto state = std::make_shared<StepState>();
  state->step = step;
  state->start = absl::Now();
  state->ranks.resize(spec_.world_size);
  state->outputs.resize(spec_.world_size);
  state->matrix_received.assign(spec_.matrices.size(), 0);
  for (int r = 0; r < spec_.world_size; ++r) {
    state->ranks[r].span_received.assign(rank_spans_[r].size(), 0);
  }
  return state;
}

void Job::PrepareOwnedRank(StepState& state, int rank) {
  RankInput& in = state.ranks[rank];
  const size_t n = rank_spans_[rank].size();
  if (static_cast<size_t>(rank) < input_pool_.size()) in.owned = std::move(input_pool_[rank]);
  in.owned.resize(n);
  in.span_in.resize(n);
  in.claimed.resize(n);
  auto out = std::make_shared<RankUpdate>();
  out->step = state.step;
  out->storage.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const common::ShardSpan& span = rank_spans_[rank][i];
    const size_t bytes = span.length * common::DTypeSize(spec_.matrices[span.matrix].dtype);
    in.owned[i].resize(bytes);
    in.span_in[i] = in.owned[i].data();
    out->storage[i].assign(bytes, '\0');
    out->spans.push_back({span.matrix, span.offset, out->storage[i].data(), bytes});
  }
  state.outputs[rank] = std::move(out);
}

absl::StatusOr<std::unique_ptr<RankStep>> Job::BeginStep(int rank, uint64_t session, int64_t step) {
  RETURN_IF_ERROR(CheckRank(rank));
  absl::MutexLock lock(&mu_);
  std::shared_ptr<const RankUpdate> replay;
  RETURN_IF_ERROR(EnterStep(rank, session, step, &replay));
  if (replay != nullptr) {
    return std::unique_ptr<RankStep>(new RankStep(shared_from_this(), rank, step, nullptr, replay));
  }
  PrepareOwnedRank(*in_flight_, rank);
  return std::unique_ptr<RankStep>(
      new RankStep(shared_from_this(), rank, step, in_flight_, nullptr));
}

absl::Status Job::CheckRank(int rank) const {
  if (rank < 0 || rank >= spec_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("job '", id(), "': rank ", rank,
                                                   " is outside the world size [0, ",
                                                   spec_.world_size, ")"));
  }
  return absl::OkStatus();
}

absl::Status Job::EnterStep(int rank, uint64_t session, int64_t step,
                            std::shared_ptr<const RankUpdate>* replay) {
  if (deleted_) return absl::NotFoundError(absl::StrCat("job '", id(), "' was deleted"));
  if (sessions_[rank] == 0 || sessions_[rank] != session) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", id(), "' rank ", rank, ": session ", session,
                     " is not the rank's current session; attach the rank first"));
  }
  if (fenced_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", id(), "' is fenced (", fence_reason_, "); reset it or load a checkpoint"));
  }
  if (in_flight_ == nullptr) {
    for (int r = 0; r < spec_.world_size; ++r) {
      if (lost_[r].empty()) continue;
      return absl::AbortedError(absl::StrCat(
          "job '", id(), "' step ", step, " cannot run: rank ", r, " is gone (", lost_[r],
          ") and has not attached again; nothing changed"));
    }
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
    return absl::FailedPreconditionError(absl::StrCat("job '", id(), "': step ", step,
                                                      " out of order: expected step ", next_step_,
                                                      next_step_ > 0 ? " (or a replay of " : "",
                                                      next_step_ > 0 ? absl::StrCat(next_step_ - 1, ")") : ""));
  }
  // A rank that had not begun a refused step learns of the refusal on its first try, even when
  // other ranks already began the retry.
  if (absl::Status refused = TakeRefusal(rank, step); !refused.ok()) return refused;
  if (in_flight_ == nullptr) in_flight_ = NewStepState(step);
  if (in_flight_->ranks[rank].begun) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", id(), "' rank ", rank, " already has step ", step, " in flight"));
  }
  in_flight_->ranks[rank].begun = true;
  return absl::OkStatus();
}

absl::Status Job::AddGradient(const std::shared_ptr<StepState>& state_ptr, int rank,
                              uint32_t matrix, uint64_t offset, std::string_view data,
                              uint32_t crc32c) {
  StepState& state = *state_ptr;
  const std::string where = absl::StrCat("job '", id(), "' step ", state.step, " rank ", rank);
  // Checks that need no lock: the layout tables are immutable.
  absl::Status bad;
  const common::MatrixSpec* ms = matrix < spec_.matrices.size() ? &spec_.matrices[matrix] : nullptr;
  const size_t esize = ms ? common::DTypeSize(ms->dtype) : 1;
  const uint64_t count = data.size() / esize;
  size_t span_index = 0;
  if (ms == nullptr) {
    bad = absl::InvalidArgumentError(absl::StrCat(where, ": matrix index ", matrix,
                                                  " out of range (the job has ",
                                                  spec_.matrices.size(), " matrices)"));
  } else if (data.empty() || data.size() > kMaxChunkBytes || data.size() % esize != 0) {
    bad = absl::InvalidArgumentError(absl::StrCat(
        where, ": matrix '", ms->name, "' chunk at element ", offset, " has ", data.size(),
        " bytes; expected a non-empty multiple of ", esize, " (",
        std::string(common::DTypeName(ms->dtype)), ") of at most ", kMaxChunkBytes,
        " (truncated chunk?)"));
  } else if (common::Crc32c(data.data(), data.size()) != crc32c) {
    bad = absl::InvalidArgumentError(absl::StrCat(where, ": matrix '", ms->name,
                                                  "' chunk at element ", offset,
                                                  ": CRC32C mismatch (corrupt or truncated chunk)"));
  } else {
    // The rank's last span of `matrix` starting at or before `offset` is the only candidate.
    bool inside = false;
    const std::vector<common::ShardSpan>& spans = rank_spans_[rank];
    const std::vector<uint32_t>& index = rank_span_index_[rank];
    auto after = std::upper_bound(index.begin(), index.end(), std::make_pair(matrix, offset),
                                  [&spans](const std::pair<uint32_t, uint64_t>& key, uint32_t i) {
                                    return key.first != spans[i].matrix
                                               ? key.first < spans[i].matrix
                                               : key.second < spans[i].offset;
                                  });
    if (after != index.begin()) {
      const uint32_t i = *std::prev(after);
      const common::ShardSpan& span = spans[i];
      if (span.matrix == matrix && offset - span.offset <= span.length &&
          count <= span.length - (offset - span.offset)) {
        inside = true;
        span_index = i;
      }
    }
    if (!inside) {
      bad = absl::InvalidArgumentError(absl::StrCat(
          where, ": matrix '", ms->name, "' elements [", offset, ", ", offset + count,
          ") are outside the rank's shard of the matrix (", ms->numel(), " elements)"));
    } else if (const int64_t at = common::FindNonFiniteRaw(ms->dtype, data.data(), count);
               at >= 0) {
      bad = absl::InvalidArgumentError(
          absl::StrCat(where, ": matrix '", ms->name, "' has a non-finite gradient value at element ",
                       offset + static_cast<uint64_t>(at),
                       "; the step is refused for every rank and the momentum is unchanged"));
    }
  }
  char* dst = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (state.committing || (state.done && state.result.ok())) {
      // Every element was in: nothing more can be applied, and re-sent data is never taken.
      return absl::FailedPreconditionError(absl::StrCat(
          where, ": the step is ", state.done ? "committed" : "committing",
          " (all data was in); this chunk (matrix ", matrix, " at element ", offset,
          ") was not applied; ask for step ", state.step, " again to receive its update"));
    }
    if (state.done) return state.result;
    if (!bad.ok()) {
      FailStep(state, bad, /*fence=*/false);
      return bad;
    }
    const common::ShardSpan& span = rank_spans_[rank][span_index];
    RankInput& in = state.ranks[rank];
    auto& claimed = in.claimed[span_index];
    auto next = claimed.lower_bound(offset);
    const bool overlaps = (next != claimed.end() && next->first < offset + count) ||
                          (next != claimed.begin() && std::prev(next)->second > offset);
    if (overlaps) {
      absl::Status s = absl::InvalidArgumentError(
          absl::StrCat(where, ": matrix '", ms->name, "' elements [", offset, ", ",
                       offset + count, ") overlap data already received for this step"));
      FailStep(state, s, /*fence=*/false);
      return s;
    }
    // Adjacent ranges merge, so a span pushed in order is one entry; a client that scatters tiny
    // chunks is bounded (the bookkeeping is memory the client makes the daemon hold).
    auto prev = next == claimed.begin() ? claimed.end() : std::prev(next);
    if (prev != claimed.end() && prev->second == offset) {
      prev->second = offset + count;
      if (next != claimed.end() && next->first == prev->second) {
        prev->second = next->second;
        claimed.erase(next);
      }
    } else if (next != claimed.end() && next->first == offset + count) {
      const uint64_t end = next->second;
      claimed.erase(next);
      claimed.emplace(offset, end);
    } else if (claimed.size() >= kMaxClaimedRanges) {
      absl::Status s = absl::ResourceExhaustedError(absl::StrCat(
          where, ": matrix '", ms->name, "' span at element ", span.offset, " has ",
          claimed.size(), " separate pieces received (limit ", kMaxClaimedRanges,
          "); send chunks in order"));
      FailStep(state, s, /*fence=*/false);
      return s;
    } else {
      claimed.emplace(offset, offset + count);
    }
    dst = in.owned[span_index].data() + (offset - span.offset) * esize;
  }
  // The claimed range is this rank's alone: copy outside the lock.
  std::memcpy(dst, data.data(), data.size());
  CountHostCopy(data.size());
  absl::MutexLock lock(&mu_);
  if (state.done) return state.result;
  state.ranks[rank].span_received[span_index] += count;
  state.matrix_received[matrix] += count;
  if (state.matrix_received[matrix] == static_cast<uint64_t>(ms->numel())) {
    state.ready.push_back(matrix);
    if (!state.drain_queued) {
      state.drain_queued = true;
      executor_->Submit([self = shared_from_this(), state_ptr] { self->DrainReady(state_ptr); });
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const RankUpdate>> Job::FinishRank(
    const std::shared_ptr<StepState>& state, int rank, const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  if (state->done) {
    if (!state->result.ok()) return state->result;
    return std::shared_ptr<const RankUpdate>(state->outputs[rank]);
  }
  RankInput& in = state->ranks[rank];
  for (size_t i = 0; i < rank_spans_[rank].size(); ++i) {
    const common::ShardSpan& span = rank_spans_[rank][i];
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
  in.finished = true;
  while (!state->done) {
    state->cv.WaitWithTimeout(&mu_, kCancelPoll);
    if (!state->done && cancelled && cancelled()) {
      FailStep(*state,
               absl::AbortedError(absl::StrCat("job '", id(), "' step ", state->step,
                                               " aborted: rank ", rank,
                                               " went away while waiting for the step")),
               /*fence=*/true);
    }
  }
  if (!state->result.ok()) return state->result;
  return std::shared_ptr<const RankUpdate>(state->outputs[rank]);
}

void Job::Commit(StepState& state) {
  // Every matrix succeeded and every gradient value was checked: apply the momentum EMA to the
  // store from the gradients still in the input buffers, with the function MuonUpdate used. A
  // shared-memory peer could have changed its gradients after ringing; a non-finite value found
  // now means the store may be half-updated, so the job is fenced rather than committed.
  // The store changes below: a save in progress gets the old values first.
  absl::MutexLock snap_lock(&snap_mu_);
  if (!spec_.transport_probe) PreserveForSnapshot();
  std::vector<float> wide;
  absl::Status changed;
  for (int r = 0; r < spec_.world_size && changed.ok() && !spec_.transport_probe; ++r) {
    for (size_t i = 0; i < rank_spans_[r].size() && changed.ok(); ++i) {
      const common::ShardSpan& span = rank_spans_[r][i];
      const common::MatrixSpec& ms = spec_.matrices[span.matrix];
      wide.resize(span.length);
      common::ToFloat32(ms.dtype, state.ranks[r].span_in[i], span.length, wide.data());
      if (const int64_t bad = common::FindNonFinite(wide.data(), wide.size()); bad >= 0) {
        changed = absl::DataLossError(absl::StrCat(
            "job '", id(), "' step ", state.step, " rank ", r, ": matrix '", ms.name,
            "' element ", span.offset + static_cast<uint64_t>(bad),
            " became non-finite after it was checked (gradient memory changed during the step)"));
        break;
      }
      ApplyMomentum(spec_.muon, wide.data(), momentum_[span.matrix].data() + span.offset,
                    span.length);
    }
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - state.start);
  if (changed.ok()) {
    // Outside the job's lock: a scrape reads job status while holding the metrics' locks.
    RecordStepCompleted(id(), seconds);
    const StepPhase phases[5] = {StepPhase::kAssembly, StepPhase::kCopyIn,
                                 StepPhase::kNewtonSchulz, StepPhase::kWriteback,
                                 StepPhase::kReturn};
    for (int p = 0; p < 5; ++p) RecordPhase(id(), phases[p], state.phase_seconds[p]);
  }
  absl::MutexLock lock(&mu_);
  state.committing = false;
  if (!changed.ok()) {
    FailStep(state, changed, /*fence=*/true);
    return;
  }
  for (auto& out : state.outputs) out->compute_seconds = seconds;
  last_step_device_seconds_ = state.device_seconds;
  last_updates_.assign(state.outputs.begin(), state.outputs.end());
  state.done = true;
  state.result = absl::OkStatus();
  input_pool_.resize(spec_.world_size);
  for (int r = 0; r < spec_.world_size; ++r) {
    if (!state.ranks[r].owned.empty()) input_pool_[r] = std::move(state.ranks[r].owned);
  }
  ++next_step_;
  ++steps_completed_;
  if (in_flight_.get() == &state) in_flight_ = nullptr;
  for (RankInput& in : state.ranks) {
    if (in.done) std::exchange(in.done, nullptr)(absl::OkStatus(), false, seconds);
  }
  state.cv.SignalAll();
  if (spec_.checkpoint_every_steps > 0 && !spec_.transport_probe &&
      static_cast<uint64_t>(steps_completed_) % spec_.checkpoint_every_steps == 0) {
    SaveCheckpointInBackground();
  }
}

void Job::FailStep(StepState& state, const absl::Status& status, bool fence) {
  // A step whose commit began is committed: nothing may report it as failed.
  if (state.done || state.committing) return;
  // A step whose ranks are all on shared memory is owned by in_flight_ alone (no RankStep holds
  // it), and in_flight_ is reset below: keep `state` alive until this function returns.
  const std::shared_ptr<StepState> keep = in_flight_.get() == &state ? in_flight_ : nullptr;
  state.done = true;
  state.result = status;
  state.ready.clear();
  for (RankInput& in : state.ranks) {
    if (in.done) std::exchange(in.done, nullptr)(status, false, 0);
  }
  if (in_flight_.get() == &state) in_flight_ = nullptr;
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
      refusal_.step = state.step;
      refusal_.status = status;
      refusal_.owed.assign(spec_.world_size, false);
      for (int r = 0; r < spec_.world_size; ++r) refusal_.owed[r] = !state.ranks[r].begun;
    }
  }
  state.cv.SignalAll();
}

absl::Status Job::TakeRefusal(int rank, int64_t step) {
  if (refusal_.step != step || !refusal_.owed[rank]) return absl::OkStatus();
  refusal_.owed[rank] = false;
  return refusal_.status;
}

absl::Status Job::AbandonRank(const std::shared_ptr<StepState>& state, int rank,
                              const std::string& why) {
  absl::MutexLock lock(&mu_);
  // A commit in progress finishes: wait for it so the answer names the outcome.
  while (state->committing && !state->done) state->cv.WaitWithTimeout(&mu_, kCancelPoll);
  if (state->done) {
    if (!state->result.ok()) return state->result;
    return absl::UnavailableError(absl::StrCat(
        "job '", id(), "' step ", state->step, " rank ", rank, ": ", why,
        ", but the step was already committed (all data was in); ask for step ", state->step,
        " again to receive its update"));
  }
  const absl::Status aborted = absl::AbortedError(absl::StrCat(
      "job '", id(), "' step ", state->step, " aborted: rank ", rank, " ", why));
  FailStep(*state, aborted, /*fence=*/true);
  return aborted;
}

absl::Status Job::Reset(int64_t next_step) {
  if (next_step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("next step ", next_step, " is negative"));
  }
  absl::MutexLock snap_lock(&snap_mu_);
  absl::MutexLock lock(&mu_);
  if (in_flight_ != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", id(), "': step ", in_flight_->step, " is in flight; reset after it ends"));
  }
  PreserveForSnapshot();
  for (auto& m : momentum_) std::fill(m.begin(), m.end(), 0.0f);
  last_checkpoint_step_ = -1;
  for (auto& u : last_updates_) u = nullptr;
  next_step_ = next_step;
  fenced_ = false;
  fence_reason_.clear();
  return absl::OkStatus();
}

void Job::MarkDeleted() {
  absl::MutexLock lock(&mu_);
  deleted_ = true;
  if (in_flight_ != nullptr) {
    FailStep(*in_flight_,
             absl::NotFoundError(absl::StrCat("job '", id(), "' was deleted during the step")),
             /*fence=*/false);
  }
}

v1::JobStatus Job::Status() const {
  v1::JobStatus st;
  *st.mutable_spec() = common::JobSpecToProto(spec_);
  st.set_backend(backend_);
  st.set_created_unix_ms(created_unix_ms_);
  st.set_gather_budget_bytes(gather_budget_bytes_);
  st.set_momentum_bytes(MomentumBytes());
  absl::MutexLock lock(&mu_);
  st.set_next_step(next_step_);
  st.set_steps_completed(steps_completed_);
  st.set_steps_refused(steps_refused_);
  st.set_steps_aborted(steps_aborted_);
  st.set_fenced(fenced_);
  st.set_fence_reason(fence_reason_);
  st.set_gather_peak_bytes(gather_peak_bytes_);
  st.set_last_step_device_seconds(last_step_device_seconds_);
  st.set_host_copy_bytes(host_copy_bytes_.load());
  if (last_checkpoint_step_.load() >= 0) {
    st.set_last_checkpoint_step(last_checkpoint_step_.load());
    st.set_last_checkpoint_unix_ms(last_checkpoint_unix_ms_.load());
  }
  st.set_checkpoint_dir(store_.dir());
  if (owner_.uid >= 0) st.set_owner_uid(owner_.uid);
  st.set_owner(owner_.description);
  st.set_step_timeout_seconds(static_cast<int32_t>(absl::ToInt64Seconds(step_timeout_)));
  if (in_flight_ != nullptr) st.set_step_in_flight(in_flight_->step);
  for (int r = 0; r < spec_.world_size; ++r) {
    v1::RankStatus* rs = st.add_ranks();
    rs->set_rank(r);
    rs->set_attached(sessions_[r] != 0);
    rs->set_session_id(sessions_[r]);
    if (in_flight_ != nullptr) {
      rs->set_in_step(in_flight_->ranks[r].begun);
      rs->set_finished_pushing(in_flight_->ranks[r].finished);
    }
    for (const common::ShardSpan& span : rank_spans_[r]) rs->set_elements(rs->elements() + span.length);
  }
  return st;
}

void Job::CountHostCopy(uint64_t bytes) { host_copy_bytes_.fetch_add(bytes); }

bool Job::StepInFlight(int64_t step) const {
  absl::MutexLock lock(&mu_);
  return in_flight_ != nullptr && in_flight_->step == step;
}

std::vector<float> Job::MomentumSnapshot(uint32_t m) const {
  // A copy taken between steps is consistent; during a commit it may mix old and new values.
  absl::MutexLock lock(&mu_);
  return m < momentum_.size() ? momentum_[m] : std::vector<float>();
}

}  // namespace muond::server
