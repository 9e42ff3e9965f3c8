#include "server/job.h"

#include <algorithm>
#include <chrono>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/dtype.h"
#include "common/job_spec_proto.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/muon/muon_math.h"

namespace muond::server {

// Largest data chunk accepted on any data path.
constexpr size_t kMaxChunkBytes = size_t{4} << 20;

// The whole-matrix assembly of one matrix for one step.
struct MatrixAssembly {
  std::vector<float> grad;                 // numel fp32 once the first chunk arrived
  std::map<uint64_t, uint64_t> received;   // element ranges [first, second) already claimed
};

// The step in flight. Fields are guarded by the owning Job's mu_, except the contents of
// MatrixAssembly::grad, which ranks write outside the lock into ranges they claimed under it.
struct StepState {
  int64_t step = 0;
  std::vector<MatrixAssembly> matrices;
  std::vector<std::vector<uint64_t>> rank_received;  // [rank][matrix] elements received
  std::vector<bool> rank_begun;
  std::vector<bool> rank_finished;
  int finished = 0;
  bool done = false;
  absl::Status result;
  std::vector<std::shared_ptr<const RankUpdate>> updates;  // per rank, when committed
  absl::CondVar cv;
};

RankStep::RankStep(Job* job, int rank, int64_t step, std::shared_ptr<StepState> state,
                   std::shared_ptr<const RankUpdate> replay)
    : job_(job), rank_(rank), step_(step), state_(std::move(state)), replay_(std::move(replay)) {}

RankStep::~RankStep() {
  if (!done_ && state_ != nullptr) job_->AbortRank(state_, rank_);
}

absl::Status RankStep::AddGradient(uint32_t matrix, uint64_t offset, std::string_view data,
                                   uint32_t crc32c) {
  if (done_) return absl::FailedPreconditionError("step already finished");
  bytes_in_ += data.size();
  if (replay_ != nullptr) {
    // A replay returns the committed bytes; the resent gradients are only checked for transport
    // integrity, never applied again.
    if (common::Crc32c(data.data(), data.size()) != crc32c) {
      return absl::InvalidArgumentError(absl::StrCat("step ", step_, " (replay): matrix ", matrix,
                                                     " chunk at element ", offset,
                                                     ": CRC32C mismatch"));
    }
    return absl::OkStatus();
  }
  absl::Status s = job_->AddGradient(*state_, rank_, matrix, offset, data, crc32c);
  if (!s.ok()) done_ = true;  // the step was refused; nothing left to abort
  return s;
}

absl::StatusOr<std::shared_ptr<const RankUpdate>> RankStep::Finish(
    const std::function<bool()>& cancelled) {
  if (done_) return absl::FailedPreconditionError("step already finished");
  done_ = true;
  if (replay_ != nullptr) return replay_;
  return job_->FinishRank(state_, rank_, cancelled);
}

Job::Job(common::JobSpec spec, std::string token, std::string backend)
    : spec_(std::move(spec)),
      token_(std::move(token)),
      backend_(std::move(backend)),
      created_unix_ms_(absl::ToUnixMillis(absl::Now())) {
  for (int r = 0; r < spec_.world_size; ++r) rank_spans_.push_back(common::RankSpans(spec_, r));
  absl::MutexLock lock(&mu_);
  momentum_.resize(spec_.matrices.size());
  for (size_t m = 0; m < spec_.matrices.size(); ++m) {
    momentum_[m].assign(static_cast<size_t>(spec_.matrices[m].numel()), 0.0f);
  }
  sessions_.assign(spec_.world_size, 0);
  last_updates_.resize(spec_.world_size);
}

Job::~Job() = default;

bool Job::TokenMatches(std::string_view token) const {
  if (token.size() != token_.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < token.size(); ++i) diff |= token[i] ^ token_[i];
  return diff == 0;
}

absl::StatusOr<uint64_t> Job::Attach(int rank) {
  if (rank < 0 || rank >= spec_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("job '", id(), "': rank ", rank,
                                                   " out of range [0, ", spec_.world_size, ")"));
  }
  absl::MutexLock lock(&mu_);
  if (deleted_) return absl::NotFoundError(absl::StrCat("job '", id(), "' was deleted"));
  sessions_[rank] = next_session_++;
  return sessions_[rank];
}

absl::StatusOr<std::unique_ptr<RankStep>> Job::BeginStep(int rank, uint64_t session, int64_t step) {
  if (rank < 0 || rank >= spec_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("job '", id(), "': rank ", rank,
                                                   " out of range [0, ", spec_.world_size, ")"));
  }
  absl::MutexLock lock(&mu_);
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
  if (step == next_step_ - 1 && last_updates_[rank] != nullptr &&
      last_updates_[rank]->step == step) {
    return std::unique_ptr<RankStep>(new RankStep(this, rank, step, nullptr, last_updates_[rank]));
  }
  if (step != next_step_) {
    return absl::FailedPreconditionError(absl::StrCat("job '", id(), "': step ", step,
                                                      " out of order: expected step ", next_step_));
  }
  if (in_flight_ == nullptr) {
    auto state = std::make_shared<StepState>();
    state->step = step;
    state->matrices.resize(spec_.matrices.size());
    state->rank_received.assign(spec_.world_size, std::vector<uint64_t>(spec_.matrices.size(), 0));
    state->rank_begun.assign(spec_.world_size, false);
    state->rank_finished.assign(spec_.world_size, false);
    state->updates.resize(spec_.world_size);
    in_flight_ = std::move(state);
  }
  if (in_flight_->rank_begun[rank]) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", id(), "' rank ", rank, " already has step ", step, " in flight"));
  }
  in_flight_->rank_begun[rank] = true;
  return std::unique_ptr<RankStep>(new RankStep(this, rank, step, in_flight_, nullptr));
}

absl::Status Job::AddGradient(StepState& state, int rank, uint32_t matrix, uint64_t offset,
                              std::string_view data, uint32_t crc32c) {
  const std::string where = absl::StrCat("job '", id(), "' step ", state.step, " rank ", rank);
  absl::Status bad;
  const common::MatrixSpec* ms = matrix < spec_.matrices.size() ? &spec_.matrices[matrix] : nullptr;
  const size_t esize = ms ? common::DTypeSize(ms->dtype) : 1;
  const uint64_t count = data.size() / esize;
  if (ms == nullptr) {
    bad = absl::InvalidArgumentError(absl::StrCat(where, ": matrix index ", matrix,
                                                  " out of range (job has ",
                                                  spec_.matrices.size(), " matrices)"));
  } else if (data.empty() || data.size() > kMaxChunkBytes || data.size() % esize != 0) {
    bad = absl::InvalidArgumentError(absl::StrCat(
        where, ": matrix '", ms->name, "' chunk at element ", offset, " has ", data.size(),
        " bytes; expected a non-empty multiple of ", esize, " (", std::string(common::DTypeName(ms->dtype)),
        ") of at most ", kMaxChunkBytes));
  } else if (common::Crc32c(data.data(), data.size()) != crc32c) {
    bad = absl::InvalidArgumentError(absl::StrCat(where, ": matrix '", ms->name,
                                                  "' chunk at element ", offset,
                                                  ": CRC32C mismatch (corrupt or truncated chunk)"));
  } else {
    // The chunk must lie inside one of the rank's spans of this matrix.
    bool inside = false;
    for (const common::ShardSpan& span : rank_spans_[rank]) {
      if (span.matrix == matrix && offset >= span.offset &&
          offset + count <= span.offset + span.length && offset + count >= offset) {
        inside = true;
        break;
      }
    }
    if (!inside) {
      bad = absl::InvalidArgumentError(absl::StrCat(
          where, ": matrix '", ms->name, "' elements [", offset, ", ", offset + count,
          ") are outside the rank's shard of the matrix (", ms->numel(), " elements)"));
    }
  }
  float* dst = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (state.done) return state.result;
    if (!bad.ok()) {
      FailStep(state, bad, /*fence=*/false);
      return bad;
    }
    MatrixAssembly& a = state.matrices[matrix];
    // Overlap check against claimed ranges: the first range starting at or after `offset`, and the
    // one before it.
    auto next = a.received.lower_bound(offset);
    const bool overlaps = (next != a.received.end() && next->first < offset + count) ||
                          (next != a.received.begin() && std::prev(next)->second > offset);
    if (overlaps) {
      absl::Status s = absl::InvalidArgumentError(
          absl::StrCat(where, ": matrix '", ms->name, "' elements [", offset, ", ",
                       offset + count, ") overlap data already received for this step"));
      FailStep(state, s, /*fence=*/false);
      return s;
    }
    a.received.emplace(offset, offset + count);
    if (a.grad.empty()) a.grad.resize(static_cast<size_t>(ms->numel()));
    state.rank_received[rank][matrix] += count;
    dst = a.grad.data() + offset;
  }
  // The claimed range is this rank's alone: convert outside the lock.
  common::ToFloat32(ms->dtype, data.data(), count, dst);
  const int64_t bad_index = common::FindNonFinite(dst, count);
  if (bad_index >= 0) {
    absl::Status s = absl::InvalidArgumentError(
        absl::StrCat(where, ": matrix '", ms->name, "' has a non-finite gradient value (",
                     dst[bad_index], ") at element ", offset + bad_index,
                     "; the step is refused and the momentum is unchanged"));
    absl::MutexLock lock(&mu_);
    if (state.done) return state.result;
    FailStep(state, s, /*fence=*/false);
    return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const RankUpdate>> Job::FinishRank(
    const std::shared_ptr<StepState>& state, int rank, const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  if (state->done) return state->result;
  // Every span of this rank must have arrived.
  std::vector<uint64_t> expected(spec_.matrices.size(), 0);
  for (const common::ShardSpan& span : rank_spans_[rank]) expected[span.matrix] += span.length;
  for (size_t m = 0; m < expected.size(); ++m) {
    const uint64_t got = state->rank_received[rank][m];
    if (got != expected[m]) {
      absl::Status s = absl::InvalidArgumentError(absl::StrCat(
          "job '", id(), "' step ", state->step, " rank ", rank, ": matrix '",
          spec_.matrices[m].name, "' is incomplete: received ", got, " of ", expected[m],
          " elements", got == 0 ? " (matrix missing from the step)" : ""));
      FailStep(*state, s, /*fence=*/false);
      return s;
    }
  }
  state->rank_finished[rank] = true;
  if (++state->finished == spec_.world_size) {
    mu_.Unlock();
    absl::Status s = ComputeAndCommit(*state);
    mu_.Lock();
    if (!s.ok() && !state->done) FailStep(*state, s, /*fence=*/false);
  }
  // Waiting for the other ranks: a rank whose call was cancelled meanwhile (client gone, server
  // shutting down) aborts the step; without this poll a shutdown would wait forever for a rank
  // that never comes.
  while (!state->done) {
    state->cv.WaitWithTimeout(&mu_, absl::Milliseconds(50));
    if (!state->done && cancelled && cancelled()) {
      FailStep(*state,
               absl::AbortedError(absl::StrCat("job '", id(), "' step ", state->step,
                                               " aborted: rank ", rank,
                                               " was cancelled while waiting for the other ranks")),
               /*fence=*/true);
    }
  }
  if (!state->result.ok()) return state->result;
  return state->updates[rank];
}

absl::Status Job::ComputeAndCommit(StepState& state) {
  const absl::Time start = absl::Now();
  std::vector<std::vector<float>> staged(spec_.matrices.size());
  for (size_t m = 0; m < spec_.matrices.size(); ++m) {
    {
      absl::MutexLock lock(&mu_);
      if (state.done) return state.result;
      staged[m] = momentum_[m];
    }
    float* grad = state.matrices[m].grad.data();
    absl::Status s = MuonUpdate(spec_.muon, spec_.matrices[m], grad, staged[m].data(), grad);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("job '", id(), "' step ", state.step,
                                                 ": matrix '", spec_.matrices[m].name, "': ",
                                                 s.message()));
    }
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  // Each rank's spans of the update, in the gradient dtype.
  std::vector<std::shared_ptr<const RankUpdate>> updates(spec_.world_size);
  for (int r = 0; r < spec_.world_size; ++r) {
    auto u = std::make_shared<RankUpdate>();
    u->step = state.step;
    u->compute_seconds = seconds;
    for (const common::ShardSpan& span : rank_spans_[r]) {
      const common::MatrixSpec& ms = spec_.matrices[span.matrix];
      UpdateSpan out;
      out.matrix = span.matrix;
      out.offset = span.offset;
      out.bytes.resize(span.length * common::DTypeSize(ms.dtype));
      common::FromFloat32(state.matrices[span.matrix].grad.data() + span.offset, span.length,
                          ms.dtype, out.bytes.data());
      u->spans.push_back(std::move(out));
    }
    updates[r] = std::move(u);
  }
  absl::MutexLock lock(&mu_);
  if (state.done) return state.result;
  for (size_t m = 0; m < staged.size(); ++m) momentum_[m].swap(staged[m]);
  state.updates = updates;
  last_updates_ = std::move(updates);
  state.done = true;
  state.result = absl::OkStatus();
  state.matrices.clear();  // release the assembly now, not when the last rank lets go
  ++next_step_;
  ++steps_completed_;
  if (in_flight_.get() == &state) in_flight_ = nullptr;
  state.cv.SignalAll();
  return absl::OkStatus();
}

void Job::FailStep(StepState& state, const absl::Status& status, bool fence) {
  if (state.done) return;
  state.done = true;
  state.result = status;
  state.matrices.clear();
  if (in_flight_.get() == &state) in_flight_ = nullptr;
  if (fence) {
    ++steps_aborted_;
    fenced_ = true;
    fence_reason_ = std::string(status.message());
    MUOND_LOG(WARNING) << "job '" << id() << "' fenced: " << status.message();
  } else {
    ++steps_refused_;
    MUOND_LOG(INFO) << "job '" << id() << "' step " << state.step << " refused: "
                    << status.message();
  }
  state.cv.SignalAll();
}

void Job::AbortRank(const std::shared_ptr<StepState>& state, int rank) {
  absl::MutexLock lock(&mu_);
  if (state->done) return;
  FailStep(*state,
           absl::AbortedError(absl::StrCat("job '", id(), "' step ", state->step,
                                           " aborted: rank ", rank,
                                           " left before the step completed")),
           /*fence=*/true);
}

absl::Status Job::Reset(int64_t next_step) {
  if (next_step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("next_step ", next_step, " is negative"));
  }
  absl::MutexLock lock(&mu_);
  if (in_flight_ != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", id(), "': step ", in_flight_->step, " is in flight; reset after it ends"));
  }
  for (auto& m : momentum_) std::fill(m.begin(), m.end(), 0.0f);
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
  absl::MutexLock lock(&mu_);
  st.set_next_step(next_step_);
  st.set_steps_completed(steps_completed_);
  st.set_steps_refused(steps_refused_);
  st.set_steps_aborted(steps_aborted_);
  st.set_fenced(fenced_);
  st.set_fence_reason(fence_reason_);
  uint64_t bytes = 0;
  for (const auto& m : momentum_) bytes += m.size() * sizeof(float);
  st.set_momentum_bytes(bytes);
  for (int r = 0; r < spec_.world_size; ++r) {
    v1::RankStatus* rs = st.add_ranks();
    rs->set_rank(r);
    rs->set_attached(sessions_[r] != 0);
    rs->set_session_id(sessions_[r]);
  }
  return st;
}

std::vector<float> Job::MomentumSnapshot(uint32_t m) const {
  absl::MutexLock lock(&mu_);
  return m < momentum_.size() ? momentum_[m] : std::vector<float>();
}

}  // namespace muond::server
