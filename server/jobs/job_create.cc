// Creating a job (JobRegistry::Create, job_registry.h): its token, the JobImpl, its directory and
// job.json written durably, and its initial state (restored, imported or init_from) before anyone
// else can see it.
#include <malloc.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <new>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/names.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/jobs/job_footprint.h"
#include "server/jobs/job_impl.h"
#include "server/jobs/job_registry.h"
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

std::shared_ptr<JobImpl> JobRegistry::NewJob(common::JobSpec spec, std::string token_sha256,
                                             JobOwner owner) const {
  const uint64_t budget =
      spec.gather_budget_bytes != 0 ? spec.gather_budget_bytes : default_gather_budget_bytes_;
  const absl::Duration timeout = absl::Seconds(
      spec.step_timeout_seconds != 0 ? spec.step_timeout_seconds : limits_.step_timeout_seconds);
  const std::string checkpoints = absl::StrCat(JobDir(spec.job_id), "/checkpoints");
  JobParts parts;
  parts.executor = executor_;
  parts.gather_budget_bytes = budget;
  parts.step_window_bytes = limits_.step_window_bytes;
  parts.devices = devices_;
  parts.backend = backend_;
  parts.checkpoint_dir = checkpoints;
  parts.step_timeout = timeout;
  parts.prepare_timeout = absl::Seconds(limits_.prepare_timeout_seconds);
  return std::make_shared<JobImpl>(std::move(spec), std::move(token_sha256), std::move(owner),
                                   std::move(parts));
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

absl::Status JobRegistry::InitializeNewJob(Job& job, const std::shared_ptr<Job>& source,
                                           const std::optional<RestoreFrom>& restore,
                                           const std::string& import_dir, bool* load_failed,
                                           bool* made_dir) const {
  const std::string& id = job.id();
  absl::Status s;
  if (source != nullptr) s = job.LoadCheckpointFrom(source, restore->selector).status();
  int import_ordinal = 0;  // this create's place among imports (the test hook's count)
  if (s.ok() && !import_dir.empty()) {
    import_ordinal = imports_begun.fetch_add(1) + 1;
    s = job.ImportState(import_dir, job.owner().uid);
  }
  if (s.ok() && source == nullptr && !job.spec().init_from.empty()) {
    s = job.InitFromFile(job.owner().uid);  // read before the job is visible to anyone
  }
  *load_failed = !s.ok();
  if (s.ok()) *made_dir = (s = Persist(job)).ok();
  if (s.ok()) KillIfImportFault(import_ordinal, id);
  if (s.ok() && (source != nullptr || !import_dir.empty())) {
    // The restored (or imported) momentum exists only in memory until the job has a generation
    // of its own: a restart before its first save would bring it back empty (the marker makes a
    // restart remove this half-made job instead).
    s = job.SaveCheckpoint().status();
  }
  if (s.ok()) s = durable::RemoveTree(absl::StrCat(JobDir(id), "/", kCreatingMarker));
  return s;
}

void JobRegistry::LogCreated(const Job& job, const JobFootprint& footprint, const Job* source) {
  MUOND_LOG(INFO) << "job '" << job.id() << "' created by " << job.owner().description << ": "
                  << job.spec().matrices.size() << " matrices, " << footprint.state_bytes
                  << (job.apply() ? " bytes of masters and optimizer state (twice), "
                                  : " bytes of momentum, ")
                  << footprint.table_bytes << " bytes of tables (" << footprint.spans << " spans), "
                  << footprint.step_bytes + footprint.save_copy_bytes + footprint.gather_bytes
                  << " bytes at most of step buffers, shared-memory regions, save copies and "
                     "gathered matrices (all counted against --max-state-bytes), world size "
                  << job.spec().world_size << ", gather budget " << job.gather_budget_bytes()
                  << " bytes"
                  << (source != nullptr ? absl::StrCat(", momentum from job '", source->id(), "'")
                                        : std::string());
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
  ASSIGN_OR_RETURN(
      const JobFootprint footprint,
      MeasureJob(spec, default_gather_budget_bytes_, limits_.step_window_bytes, InHostMemory()));
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
    s = InitializeNewJob(*job, source, restore, import_dir, &load_failed, &made_dir);
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
  LogCreated(*job, footprint, source.get());
  return Created{std::move(job), std::move(token)};
}

}  // namespace muond::server
