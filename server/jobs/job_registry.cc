#include "server/jobs/job_registry.h"

#include <dirent.h>
#include <malloc.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>
#include <sstream>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/names.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/jobs/job_footprint.h"
#include "server/storage/durable_file.h"

namespace muond::server {
namespace {

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

// The import kill of job_registry.h (SetImportKillForTesting): which import dies, and how many
// have begun.
std::atomic<int> import_kill_nth{0};
std::atomic<int> imports_begun{0};

void KillIfImportFault(int ordinal, const std::string& id) {
  if (ordinal <= 0 || import_kill_nth.load() != ordinal) return;
  import_kill_nth.store(0);
  MUOND_LOG(WARNING) << "test hook MUOND_TEST_IMPORT_FAULT: SIGKILL in import " << ordinal
                     << " (job '" << id << "': state read, directory made, no generation yet)";
  ::kill(::getpid(), SIGKILL);  // to the process (raise() would target this thread alone)
}

}  // namespace

void JobRegistry::SetImportKillForTesting(int nth) {
  import_kill_nth.store(nth);
  imports_begun.store(0);
}

absl::StatusOr<std::string> NewJobToken() {
  unsigned char raw[32];
  size_t got = 0;
  while (got < sizeof(raw)) {
    ssize_t n = getrandom(raw + got, sizeof(raw) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("getrandom: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(raw), sizeof(raw)));
}

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

std::string JobRegistry::JobDir(const std::string& id) const {
  // Every caller passes an id that passed common::ValidateJobId: a single path component that
  // cannot be "." or ".." nor start with a dot.
  return absl::StrCat(state_dir_, "/jobs/", id);
}

std::shared_ptr<Job> JobRegistry::NewJob(common::JobSpec spec, std::string token_sha256,
                                         JobOwner owner) const {
  const uint64_t budget =
      spec.gather_budget_bytes != 0 ? spec.gather_budget_bytes : default_gather_budget_bytes_;
  const absl::Duration timeout = absl::Seconds(
      spec.step_timeout_seconds != 0 ? spec.step_timeout_seconds : limits_.step_timeout_seconds);
  const std::string checkpoints = absl::StrCat(JobDir(spec.job_id), "/checkpoints");
  return std::make_shared<Job>(std::move(spec), std::move(token_sha256), backend_, executor_,
                               budget, devices_, checkpoints, timeout, std::move(owner),
                               absl::Seconds(limits_.prepare_timeout_seconds));
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

absl::Status JobRegistry::Persist(const Job& job) const {
  const std::string dir = JobDir(job.id());
  const std::string jobs_dir = absl::StrCat(state_dir_, "/jobs");
  nlohmann::json record = {
      {"format", "muond-job"},
      {"format_version", 1},
      {"spec", nlohmann::json::parse(common::JobSpecToJson(job.spec()))},
      {"token_sha256", absl::BytesToHexString(job.token_sha256())},
      {"owner", {{"uid", job.owner().uid}, {"description", job.owner().description}}}};
  // Made under a name only this daemon uses (a dot first), complete with its marker and record,
  // then renamed into place: a crash leaves either that temporary directory or a marked one,
  // both removed at the next start, never an unmarked half-made job directory.
  const std::string tmp =
      absl::StrCat(jobs_dir, "/", kCreatingPrefix, job.id(), "-", absl::ToUnixNanos(absl::Now()));
  RETURN_IF_ERROR(durable::MakeDirs(tmp));
  absl::Status s = durable::WriteFileDurably(absl::StrCat(tmp, "/", kCreatingMarker),
                                             "muond: job directory being created\n");
  if (s.ok()) {
    s = durable::WriteFileDurably(
        absl::StrCat(tmp, "/job.json"),
        record.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
  }
  bool renamed = false;
  if (s.ok()) renamed = (s = durable::Rename(tmp, dir)).ok();
  if (s.ok()) s = durable::FsyncDir(jobs_dir);
  if (!s.ok()) (void)durable::RemoveTree(renamed ? dir : tmp);
  return s;
}

absl::StatusOr<JobRegistry::Created> JobRegistry::Create(common::JobSpec spec,
                                                         const std::optional<RestoreFrom>& restore,
                                                         JobOwner owner,
                                                         const std::string& import_dir) {
  RETURN_IF_ERROR(common::ValidateJobId(spec.job_id));
  if (!import_dir.empty() && (restore || !spec.init_from.empty())) {
    return absl::InvalidArgumentError(
        absl::StrCat("job '", spec.job_id,
                     "': import_dir takes the whole state; not with restore or init_from"));
  }
  ASSIGN_OR_RETURN(const JobFootprint footprint, MeasureJob(spec, default_gather_budget_bytes_));
  RETURN_IF_ERROR(CheckJobLimits(spec, footprint, limits_, default_gather_budget_bytes_));
  std::shared_ptr<Job> source;
  if (restore) {
    auto found = Authorize(restore->job_id, restore->token, " (restore.token)");
    if (!found.ok()) {
      return absl::Status(found.status().code(),
                          absl::StrCat("restore: ", found.status().message()));
    }
    source = *std::move(found);
  }
  ASSIGN_OR_RETURN(std::string token, NewJobToken());
  const uint64_t bytes = footprint.total();
  const std::string id = spec.job_id;
  RETURN_IF_ERROR(Reserve(spec, bytes));
  // From here on the id and bytes are ours; the lock is not held. They are released on every way
  // out but the one that publishes the job, exceptions included (declared before the job: its
  // memory is returned first).
  absl::Cleanup unreserve = [this, &id, bytes] {
    Unreserve(id, bytes);
    ::malloc_trim(0);
  };
  if (Exists(JobDir(id))) {
    return absl::AlreadyExistsError(
        absl::StrCat("job '", id, "': ", JobDir(id), " exists and was not made by this daemon"));
  }
  std::shared_ptr<Job> job;
  absl::Status s;
  bool load_failed = false;
  bool made_dir = false;
  try {
    job = NewJob(std::move(spec), common::Sha256(token), std::move(owner));
    if (source != nullptr) s = job->LoadCheckpointFrom(source, restore->selector).status();
    int import_ordinal = 0;  // this create's place among imports (the test hook's count)
    if (s.ok() && !import_dir.empty()) {
      import_ordinal = imports_begun.fetch_add(1) + 1;
      s = job->ImportState(import_dir, job->owner().uid);
    }
    if (s.ok() && source == nullptr && !job->spec().init_from.empty()) {
      s = job->InitFromFile(job->owner().uid);  // read before the job is visible to anyone
    }
    load_failed = !s.ok();
    if (s.ok()) made_dir = (s = Persist(*job)).ok();
    if (s.ok()) KillIfImportFault(import_ordinal, id);
    if (s.ok() && (source != nullptr || !import_dir.empty())) {
      // The restored (or imported) momentum exists only in memory until the job has a generation
      // of its own: a restart before its first save would bring it back empty (the marker makes a
      // restart remove this half-made job instead).
      s = job->SaveCheckpoint().status();
    }
    if (s.ok()) s = durable::RemoveTree(absl::StrCat(JobDir(id), "/", kCreatingMarker));
  } catch (const std::bad_alloc&) {
    load_failed = true;
    const std::string from = source != nullptr     ? "job '" + restore->job_id + "'s checkpoint"
                             : !import_dir.empty() ? "import_dir '" + import_dir + "'"
                                                   : "its init_from file";
    s = absl::ResourceExhaustedError(
        job == nullptr
            ? absl::StrCat("job '", id, "': the system could not allocate its ", bytes,
                           " bytes of state")
            : absl::StrCat("job '", id, "': the system could not allocate the memory to read its ",
                           "initial state from ", from, "; the job was not created"));
  }
  if (!s.ok()) {
    if (made_dir) (void)durable::RemoveTree(JobDir(id));
    job.reset();
    if (load_failed) return s;
    return absl::Status(s.code(), absl::StrCat("job '", id, "' could not be stored in ", state_dir_,
                                               ": ", s.message()));
  }
  Publish(job);
  std::move(unreserve).Cancel();
  MUOND_LOG(INFO) << "job '" << id << "' created by " << job->owner().description << ": "
                  << job->spec().matrices.size() << " matrices, " << footprint.state_bytes
                  << (job->apply() ? " bytes of masters and optimizer state (twice), "
                                   : " bytes of momentum, ")
                  << footprint.table_bytes << " bytes of tables (" << footprint.spans << " spans), "
                  << footprint.step_bytes + footprint.save_copy_bytes + footprint.gather_bytes
                  << " bytes at most of step buffers, shared-memory regions, save copies and "
                     "gathered matrices (all counted against --max-state-bytes), world size "
                  << job->spec().world_size << ", gather budget " << job->gather_budget_bytes()
                  << " bytes"
                  << (source != nullptr ? absl::StrCat(", momentum from job '", source->id(), "'")
                                        : std::string());
  return Created{std::move(job), std::move(token)};
}

absl::Status JobRegistry::Delete(std::shared_ptr<Job> job) {
  const std::string job_id = job->id();
  // What Create or Restore reserved for it (the footprint is a function of the spec).
  const uint64_t bytes =
      MeasureJob(job->spec(), default_gather_budget_bytes_).value_or(JobFootprint()).total();
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
