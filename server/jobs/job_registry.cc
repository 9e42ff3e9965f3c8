#include "server/jobs/job_registry.h"

#include <dirent.h>
#include <malloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/jobs/job_footprint.h"
#include "server/jobs/job_impl.h"
#include "server/storage/durable_file.h"

namespace muond::server {

JobRegistry::JobRegistry(std::string backend, const DaemonLimits& limits,
                         uint64_t default_gather_budget_bytes, ComputeExecutor* executor,
                         DeviceStreams* devices, std::string state_dir)
    : backend_(std::move(backend)),
      limits_(limits),
      default_gather_budget_bytes_(default_gather_budget_bytes),
      executor_(executor),
      devices_(devices),
      state_dir_(std::move(state_dir)) {
  watchdog_ = std::thread([this] { WatchSteps(); });
}

JobRegistry::~JobRegistry() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  watchdog_.join();
}

void JobRegistry::WatchSteps() {
  absl::MutexLock lock(&mu_);
  auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopping), absl::Milliseconds(250))) {
    // With the registry's lock held: a deadlock on it stops the beats (common/heartbeat.h).
    heartbeat_.Beat();
    heartbeat_.StallPointForTesting();
    ReleaseDeleted();
    std::vector<std::shared_ptr<Job>> jobs;
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
    mu_.Unlock();
    const absl::Time now = absl::Now();
    for (const auto& job : jobs) job->CheckStepTimeout(now);
    jobs.clear();
    mu_.Lock();
  }
}

size_t JobRegistry::compute_queue_depth() const { return executor_->queue_depth(); }

device::Device* JobRegistry::device() const {
  return devices_ != nullptr ? devices_->device.get() : nullptr;
}

bool JobRegistry::InHostMemory() const {
  return device() != nullptr && device()->ComputesInHostMemory();
}

std::string JobRegistry::JobDir(const std::string& id) const {
  // Every caller passes an id that passed common::ValidateJobId: a single path component that
  // cannot be "." or ".." nor start with a dot.
  return absl::StrCat(state_dir_, "/jobs/", id);
}

absl::Status JobRegistry::Reserve(const common::JobSpec& spec, uint64_t bytes) {
  const std::string& id = spec.job_id;
  absl::MutexLock lock(&mu_);
  if (jobs_.count(id) != 0 || busy_.count(id) != 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("job '", id, "' already exists",
                     busy_.count(id) != 0 ? " (being created or deleted)" : ""));
  }
  if (auto it = broken_.find(id); it != broken_.end()) {
    return absl::AlreadyExistsError(absl::StrCat(
        "job '", id, "': its directory ", JobDir(id), " exists but could not be restored (",
        it->second, "); move it out of the state directory to reuse the id"));
  }
  const size_t jobs = jobs_.size() + busy_.size();
  if (jobs >= static_cast<size_t>(limits_.max_jobs)) {
    return absl::ResourceExhaustedError(absl::StrCat("job '", id, "': ", jobs,
                                                     " jobs exist or are being made; the limit "
                                                     "is --max-jobs ",
                                                     limits_.max_jobs));
  }
  if (limits_.max_state_bytes != 0 &&
      (bytes > limits_.max_state_bytes || state_bytes_ > limits_.max_state_bytes - bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "job '", id, "' needs ", bytes,
        " bytes at most (state, tables, step buffers and shared-memory regions, a save's copy, "
        "gathered matrices); ",
        state_bytes_, " of --max-state-bytes ", limits_.max_state_bytes, " are in use"));
  }
  busy_.insert(id);
  state_bytes_ += bytes;
  return absl::OkStatus();
}

void JobRegistry::Unreserve(const std::string& id, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  busy_.erase(id);
  state_bytes_ -= bytes;
}

void JobRegistry::Publish(std::shared_ptr<Job> job) {
  absl::MutexLock lock(&mu_);
  busy_.erase(job->id());
  jobs_.emplace(job->id(), std::move(job));
}

absl::Status JobRegistry::Delete(std::shared_ptr<Job> job) {
  const std::string job_id = job->id();
  // What Create or Restore reserved for it (the footprint is a function of the spec).
  const uint64_t bytes = MeasureJob(job->spec(), default_gather_budget_bytes_,
                                    limits_.step_window_bytes, InHostMemory())
                             .value_or(JobFootprint())
                             .total();
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end() || it->second != job) {
      return absl::NotFoundError(absl::StrCat("job ", common::Quoted(job_id), " not found"));
    }
    it->second.reset();
    jobs_.erase(it);
    busy_.insert(job_id);  // until its files are gone: a create of the same id waits for that
  }
  job->MarkDeleted();
  job->WaitForSaves();
  // Out of the way first (one rename): a restart never sees a half-removed job.
  const std::string dir = JobDir(job_id);
  const std::string gone = absl::StrCat(state_dir_, "/jobs/", kDeletedPrefix, job_id, "-",
                                        absl::ToUnixNanos(absl::Now()));
  absl::Status s;
  if (::rename(dir.c_str(), gone.c_str()) != 0 && errno != ENOENT) {
    s = absl::InternalError(
        absl::StrCat("job '", job_id, "': rename ", dir, " -> ", gone, ": ", std::strerror(errno)));
  } else if (absl::Status removed = durable::RemoveTree(gone); !removed.ok()) {
    MUOND_LOG(WARNING) << "job '" << job_id << "' deleted; its files: " << removed.message();
  }
  // MarkDeleted told every holder to let go (steps fail, shared-memory sessions end, gRPC streams
  // and exports are cancelled); they unwind within a poll period: wait for them, so the job's
  // memory is normally back before this returns. Its bytes (and id) count as free only once the
  // job is destroyed: a holder that outlives the wait leaves them counted until the watchdog
  // sees it gone (ReleaseDeleted).
  const std::weak_ptr<Job> last = job;
  job.reset();
  for (int i = 0; i < 1000 && !last.expired(); ++i) absl::SleepFor(absl::Milliseconds(5));
  const bool released = last.expired();
  {
    absl::MutexLock lock(&mu_);
    if (!s.ok()) broken_[job_id] = std::string(s.message());
    if (released) {
      busy_.erase(job_id);
      state_bytes_ -= bytes;
    } else {
      deleted_held_.push_back({job_id, bytes, last});
    }
  }
  if (!released) {
    MUOND_LOG(WARNING) << "job '" << job_id << "' deleted; something still holds it after 5 s: "
                       << "its " << bytes << " bytes stay counted until it lets go";
  }
  ::malloc_trim(0);
  if (!s.ok()) return s;
  MUOND_LOG(INFO) << "job '" << job_id << "' deleted";
  return absl::OkStatus();
}

void JobRegistry::ReleaseDeleted() {
  bool released = false;
  for (auto it = deleted_held_.begin(); it != deleted_held_.end();) {
    if (!it->job.expired()) {
      ++it;
      continue;
    }
    MUOND_LOG(INFO) << "job '" << it->id << "' (deleted) let go; its " << it->bytes
                    << " bytes are free";
    busy_.erase(it->id);
    state_bytes_ -= it->bytes;
    it = deleted_held_.erase(it);
    released = true;
  }
  if (released) ::malloc_trim(0);
}

absl::Status JobRegistry::Reset(const std::shared_ptr<Job>& job, int64_t next_step) {
  const std::string path = absl::StrCat(JobDir(job->id()), "/", kResetRecord);
  absl::Status s = job->ResetDurably(next_step, [&](int64_t newest_generation) {
    const nlohmann::json record = {{"format", "muond-reset"},
                                   {"next_step", next_step},
                                   {"after_generation", newest_generation}};
    return durable::WriteFileDurably(path, record.dump() + "\n");
  });
  if (!s.ok()) return s;
  MUOND_LOG(INFO) << "job '" << job->id() << "' reset; next step " << next_step;
  return absl::OkStatus();
}

absl::StatusOr<Job::LoadResult> JobRegistry::LoadCheckpoint(const std::shared_ptr<Job>& job,
                                                            const checkpoint::Selector& selector) {
  ASSIGN_OR_RETURN(Job::LoadResult loaded, job->LoadCheckpoint(selector));
  // The loaded state supersedes an earlier reset.
  (void)durable::RemoveTree(absl::StrCat(JobDir(job->id()), "/", kResetRecord));
  return loaded;
}

absl::StatusOr<std::shared_ptr<Job>> JobRegistry::Find(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job ", common::Quoted(job_id), " not found"));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<Job>> JobRegistry::Authorize(const std::string& job_id,
                                                            std::string_view token,
                                                            const std::string& hint) const {
  RETURN_IF_ERROR(common::ValidateJobId(job_id));
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, Find(job_id));
  if (token.empty()) {
    return absl::UnauthenticatedError(absl::StrCat("job '", job_id, "': missing job token", hint));
  }
  if (!job->TokenMatches(token)) {
    return absl::PermissionDeniedError(absl::StrCat("job '", job_id, "': wrong job token"));
  }
  return job;
}

std::vector<std::shared_ptr<Job>> JobRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Job>> out;
  for (const auto& [id, job] : jobs_) out.push_back(job);
  return out;
}

std::vector<JobRegistry::BrokenJob> JobRegistry::Broken() const {
  absl::MutexLock lock(&mu_);
  std::vector<BrokenJob> out;
  for (const auto& [name, reason] : broken_) out.push_back({JobDir(name), reason});
  return out;
}

void JobRegistry::WaitForSaves() const {
  for (const auto& job : List()) job->WaitForSaves();
}

bool JobRegistry::AnyStepInFlight() const {
  for (const auto& job : List()) {
    // A prepared step (two-phase, multi-node jobs) waits for the trainer's CommitStep, which a
    // daemon shutting down refuses: it is not drained (it stays uncommitted; its store is the
    // committed state a shutdown checkpoint saves).
    const JobReport r = job->Report();
    if (r.step_in_flight.has_value() && !r.step_prepared.has_value()) return true;
  }
  return false;
}

uint64_t JobRegistry::state_bytes() const {
  absl::MutexLock lock(&mu_);
  return state_bytes_;
}

uint64_t JobRegistry::momentum_bytes() const {
  uint64_t n = 0;
  for (const auto& job : List()) n += job->MomentumBytes();
  return n;
}

void JobRegistry::SaveChangedJobs() const {
  WaitForSaves();
  for (const auto& job : List()) {
    const JobReport st = job->Report();
    if (job->spec().transport_probe || st.fenced) {
      if (st.fenced) {
        MUOND_LOG(WARNING) << "job '" << job->id() << "' is fenced; no checkpoint at shutdown";
      }
      continue;
    }
    if (job->last_checkpoint_step() == st.next_step) continue;                 // unchanged since
    if (job->last_checkpoint_step() < 0 && st.steps_completed == 0) continue;  // never stepped
    auto saved = job->SaveCheckpoint();
    if (!saved.ok()) {
      MUOND_LOG(ERROR) << "shutdown checkpoint of job '" << job->id()
                       << "' failed: " << saved.status().message();
    }
  }
}

}  // namespace muond::server
