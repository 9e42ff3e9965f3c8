// The Job's lifecycle and sessions: construction, attach and detach, lost ranks, the step
// timeout, deletion and the status report. Steps: job_step.cc; commit and failure:
// job_commit.cc; shared memory: job_shared.cc; checkpoints: job_checkpoint.cc.
#include "server/jobs/job_impl.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "server/jobs/job_footprint.h"
#include "server/optim/newton_schulz.h"
#include "server/record/status_history.h"
#include "server/record/status_progress.h"

namespace muond::server {
namespace {

// Jobs alive in this process: each reports an equal share of the compute threads' scratch.
std::atomic<uint64_t> g_jobs_alive{0};

}  // namespace

JobImpl::JobImpl(common::JobSpec spec, std::string token_sha256, JobOwner owner, JobParts parts)
    : spec_(std::move(spec)),
      token_sha256_(std::move(token_sha256)),
      backend_(std::move(parts.backend)),
      executor_(parts.executor),
      step_timeout_(parts.step_timeout),
      prepare_timeout_(parts.prepare_timeout),
      owner_(std::move(owner)),
      created_unix_ms_(absl::ToUnixMillis(absl::Now())),
      layout_(spec_),
      footprint_(MeasureJob(spec_, parts.gather_budget_bytes, parts.step_window_bytes,
                            parts.devices->device->ComputesInHostMemory())
                     .value_or(JobFootprint())
                     .kinds()),
      momentum_(spec_, parts.devices->device.get(),
                StepWindowBytes(spec_, parts.step_window_bytes)),
      params_(spec_.mode == common::JobMode::kApply
                  ? std::make_unique<ParamStore>(spec_, parts.devices->device.get(),
                                                 StepWindowBytes(spec_, parts.step_window_bytes))
                  : nullptr),
      writer_(std::move(parts.checkpoint_dir), spec_.checkpoint_keep),
      pipeline_(spec_, layout_, momentum_, params_.get(), parts.devices, parts.gather_budget_bytes,
                &mu_, this, parts.batch_target_bytes),
      trainer_clock_(spec_.job_id) {
  absl::MutexLock lock(&mu_);
  sessions_.assign(spec_.world_size, 0);
  weights_in_.assign(spec_.world_size, false);
  uploading_.assign(spec_.world_size, false);
  lost_.resize(spec_.world_size);
  last_updates_.resize(spec_.world_size);
  cut_short_.resize(spec_.world_size);
  g_jobs_alive.fetch_add(1);
}

JobImpl::~JobImpl() {
  g_jobs_alive.fetch_sub(1);
  // A commit that raced the deletion may have recorded after MarkDeleted.
  StepHistory::Default().Forget(id(), created_unix_ms_);
}

bool JobImpl::TokenMatches(std::string_view token) const {
  const std::string hash = common::Sha256(token);
  if (hash.size() != token_sha256_.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < hash.size(); ++i) diff |= hash[i] ^ token_sha256_[i];
  return diff == 0;
}

absl::StatusOr<uint64_t> JobImpl::Attach(int rank, bool takeover) {
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

absl::Status JobImpl::Detach(int rank, uint64_t session) {
  RETURN_IF_ERROR(CheckRank(rank));
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckCurrentSession(rank, session, ""));
  if (in_flight_ != nullptr) AbortIfOwed(rank, "detached during the step");
  sessions_[rank] = 0;
  return absl::OkStatus();
}

absl::Status JobImpl::CheckSession(int rank, uint64_t session) const {
  RETURN_IF_ERROR(CheckRank(rank));
  absl::MutexLock lock(&mu_);
  if (deleted_) return absl::NotFoundError(absl::StrCat("job '", id(), "' was deleted"));
  return CheckCurrentSession(rank, session, "");
}

absl::Status JobImpl::CheckCurrentSession(int rank, uint64_t session, const char* hint) const {
  if (sessions_[rank] == 0 || sessions_[rank] != session) {
    return absl::FailedPreconditionError(absl::StrCat("job '", id(), "' rank ", rank, ": session ",
                                                      session, " is not the rank's current session",
                                                      hint));
  }
  return absl::OkStatus();
}

void JobImpl::AbortIfOwed(int rank, const std::string& why) {
  const RankInput& in = in_flight_->ranks[rank];
  if (in.begun && in.pushed()) return;
  FailStep(*in_flight_,
           absl::AbortedError(absl::StrCat(
               "job '", id(), "' step ", in_flight_->step, " aborted: rank ", rank, " ", why,
               in.begun ? " before it finished pushing its part" : " before it began its part")),
           /*fence=*/true);
}

void JobImpl::EndLostSession(int rank, uint64_t session, const std::string& why) {
  if (rank < 0 || rank >= spec_.world_size) return;
  absl::MutexLock lock(&mu_);
  if (sessions_[rank] != session) return;  // detached or taken over meanwhile
  if (in_flight_ != nullptr) AbortIfOwed(rank, absl::StrCat("went away (", why, ")"));
  sessions_[rank] = 0;
  lost_[rank] = why;
  MUOND_LOG(WARNING) << "job '" << id() << "' rank " << rank << ": session " << session
                     << " lost: " << why;
}

void JobImpl::CheckStepTimeout(absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (in_flight_ == nullptr || in_flight_->done || in_flight_->committing) return;
  if (in_flight_->prepared) {
    if (now - in_flight_->prepared_at >= prepare_timeout_) {
      DropPrepared(absl::StrCat("neither committed nor aborted by the trainer within the prepare "
                                "timeout of ", absl::ToInt64Seconds(prepare_timeout_),
                                " s (--prepare-timeout-seconds)"));
    }
    return;
  }
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
    return absl::StrCat(
        absl::StrJoin(shown, ", "),
        ranks.size() > kShown ? absl::StrCat(" and ", ranks.size() - kShown, " more") : "");
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

absl::Status JobImpl::CheckRank(int rank) const {
  if (rank < 0 || rank >= spec_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job '", id(), "': rank ", rank, " is outside the world size [0, ", spec_.world_size, ")"));
  }
  return absl::OkStatus();
}

void JobImpl::MarkDeleted() {
  {
    absl::MutexLock lock(&mu_);
    deleted_ = true;
    if (in_flight_ != nullptr) {
      FailStep(*in_flight_,
               absl::NotFoundError(absl::StrCat("job '", id(), "' was deleted during the step")),
               /*fence=*/false);
    }
  }
  // After deleted_ is set: a holder registering from now on is told at once.
  deletion_hooks_.Fire();
  // The status page's records of the job go with it (they are pruned on their own, not only
  // when the page renders).
  StepHistory::Default().Forget(id(), created_unix_ms_);
  OperationProgress::Default().Forget(id());
}

void JobImpl::ReportObservations(JobReport& r) const {
  r.gather_in_use_bytes = pipeline_.gather_in_use_bytes();
  r.pinned_staging_bytes = pipeline_.pinned_staging_bytes();
  if (params_ != nullptr) {
    const ParamStore::Pinned p = params_->pinned_bytes();
    r.pinned_masters_bytes = p.masters;
    r.pinned_momentum_bytes = p.momentum;
    r.pinned_moments_bytes = p.moments;
  } else {
    r.pinned_momentum_bytes = momentum_.pinned_bytes();
  }
  for (const StepObserver::ShapeTime& t : pipeline_.observer().ShapeTimes()) {
    r.newton_schulz.push_back({t.shape, t.per_step, t.matrices, t.seconds});
  }
  if (const auto o = pipeline_.observer().LastOrthogonality()) {
    r.orthogonality_step = o->step;
    r.orthogonality = o->value;
    r.orthogonality_matrices = o->matrices;
  }
  if (const auto t = trainer_clock_.last()) {
    r.trainer_step = t->step;
    r.trainer_visible_seconds = t->visible_seconds;
    r.trainer_wait_seconds = t->wait_seconds;
  }
}

void JobImpl::ReportMemory(JobReport& r) const {
  const StateBuffers::Held held = params_ != nullptr ? params_->held() : momentum_.held();
  JobMemory& m = r.memory;
  m.state = held.front;
  m.step_window = held.back + held.spare;
  m.save_copy = held.snapshot;
  m.gather = pipeline_.gather_in_use_bytes() + pipeline_.pooled_host_bytes();
  r.footprint = footprint_;
  m.tables = footprint_.tables;
  m.scratch = internal::NewtonSchulzScratchBytes() / std::max<uint64_t>(1, g_jobs_alive.load());
  absl::MutexLock lock(&mu_);
  ReportHeldBuffers(m);
}

void JobImpl::ReportHeldBuffers(JobMemory& m) const {
  auto strings = [](const std::vector<std::string>& v) {
    uint64_t bytes = 0;
    for (const std::string& s : v) bytes += s.capacity();
    return bytes;
  };
  for (const auto& rank : input_pool_) m.buffers += strings(rank);
  if (in_flight_ != nullptr) {
    for (const RankInput& in : in_flight_->ranks) m.buffers += strings(in.owned);
    for (const auto& out : in_flight_->outputs) {
      if (out != nullptr) m.buffers += strings(out->storage);
    }
  }
  for (const auto& last : last_updates_) {
    if (last == nullptr) continue;
    const bool current =
        in_flight_ != nullptr && std::any_of(in_flight_->outputs.begin(), in_flight_->outputs.end(),
                                             [&](const auto& o) { return o == last; });
    if (!current) m.replay += strings(last->storage);
  }
}

JobReport JobImpl::Report() const {
  JobReport r;
  r.spec = spec_;
  r.backend = backend_;
  r.created_unix_ms = created_unix_ms_;
  r.gather_budget_bytes = pipeline_.gather_budget_bytes();
  r.gather_peak_bytes = pipeline_.gather_peak_bytes();
  r.momentum_bytes = MomentumBytes();
  r.transport_copy_bytes = transport_copy_bytes_.load();
  if (writer_.last_step() >= 0) {
    r.last_checkpoint_step = writer_.last_step();
    r.last_checkpoint_unix_ms = writer_.last_unix_ms();
  }
  r.checkpoint_dir = writer_.dir();
  if (owner_.uid >= 0) r.owner_uid = owner_.uid;
  r.owner = owner_.description;
  r.step_timeout_seconds = static_cast<int32_t>(absl::ToInt64Seconds(step_timeout_));
  ReportObservations(r);
  ReportMemory(r);
  absl::MutexLock lock(&mu_);
  if (in_flight_ != nullptr) r.matrices_waiting = in_flight_->ready.size();
  r.qk_heads_clipped = qk_heads_clipped_;
  r.qk_max_logit = last_qk_max_logit_;
  r.next_step = next_step_;
  r.steps_completed = steps_completed_;
  r.steps_refused = steps_refused_;
  r.steps_skipped = steps_skipped_;
  r.steps_aborted = steps_aborted_;
  r.fenced = fenced_;
  r.fence_reason = fence_reason_;
  r.last_step_device_seconds = last_step_device_seconds_;
  if (in_flight_ != nullptr) r.step_in_flight = in_flight_->step;
  if (in_flight_ != nullptr && in_flight_->prepared) r.step_prepared = in_flight_->step;
  for (int rank = 0; rank < spec_.world_size; ++rank) {
    RankReport& rr = r.ranks.emplace_back();
    rr.rank = rank;
    rr.attached = sessions_[rank] != 0;
    rr.session_id = sessions_[rank];
    if (in_flight_ != nullptr) {
      rr.in_step = in_flight_->ranks[rank].begun;
      rr.finished_pushing = in_flight_->ranks[rank].finished;
    }
    rr.elements = layout_.RankElements(rank);
  }
  if (apply()) {
    r.ranks_missing_weights = RanksMissingWeights();
    r.weights_complete = r.ranks_missing_weights.empty();
  }
  if (apply() || spec_.clips_outside_share()) {  // update mode clips too
    r.clip_redo_steps = clip_redo_steps_;
    r.last_grad_norm = last_grad_norm_;
  }
  return r;
}

bool JobImpl::StepInFlight(int64_t step) const {
  absl::MutexLock lock(&mu_);
  return in_flight_ != nullptr && in_flight_->step == step;
}

}  // namespace muond::server
