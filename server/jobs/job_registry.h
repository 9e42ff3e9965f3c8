// The daemon's jobs by id. Creating a job checks every limit against the job's footprint (sized
// from the spec, server/jobs/job_footprint.h) and reserves it before anything is allocated, draws the
// job's random token, and persists the job. Thread-safe.
//
// Lock discipline: the registry's mutex guards only the maps and counters; it is never held
// across allocation, mlock, checkpoint work, file I/O or fsync. A create reserves its id and
// bytes under the lock, builds and persists the job without it, then publishes it; a delete
// unpublishes under the lock and removes files without it. One job's heavy create, restore or
// delete therefore never stalls another job's steps, attaches or metric scrapes.
//
// Persistence: each job has a directory <state_dir>/jobs/<id>/ (the id validated by
// common::ValidateJobId, so it can never be ".", ".." or start with a dot) holding job.json
// ({"format": "muond-job", "format_version": 1, "spec": job.json form, "token_sha256": hex,
// "owner": {...}}; the token itself is never stored), reset.json after a reset, and
// checkpoints/ (server/storage/checkpoint.h). A new job's directory is made as ".creating-<id>-<ns>"
// with its job.json and a ".creating" marker, renamed into place, and loses the marker once the
// job is complete (a job restored from a checkpoint: after its first generation); a deleted job's
// directory is first renamed to ".deleted-<id>-<ns>". The daemon only ever removes what it made:
// .creating-* and .deleted-* entries and marked interrupted creates.
// At start, every job directory is restored from its newest good checkpoint generation; one that
// cannot be restored (unreadable, not a job, beyond a limit) is set aside as broken (listed, its
// id reserved, its files untouched) while every other job starts normally.
#ifndef MUOND_SERVER_JOBS_JOB_REGISTRY_H_
#define MUOND_SERVER_JOBS_JOB_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/heartbeat.h"
#include "common/job_spec.h"
#include "server/jobs/job.h"
#include "server/record/daemon_limits.h"

namespace muond::server {

namespace device {
class Device;
}  // namespace device
class ComputeExecutor;
class JobImpl;
struct JobFootprint;
struct DeviceStreams;

// 32 random bytes from the kernel's CSPRNG, hex encoded (64 characters).
absl::StatusOr<std::string> NewJobToken();

class JobRegistry {
 public:
  // default_gather_budget_bytes: for jobs that do not set their own, and the most a job may set.
  // `executor` outlives the jobs' work (it runs every task submitted before it is destroyed).
  // Starts the step-timeout watchdog (stopped by the destructor).
  JobRegistry(std::string backend, const DaemonLimits& limits,
              uint64_t default_gather_budget_bytes, ComputeExecutor* executor,
              DeviceStreams* devices, std::string state_dir);
  ~JobRegistry();

  // Restores the jobs of the state directory (at startup, before serving). Fails only when the
  // jobs directory itself cannot be read; a job that cannot be restored is listed in Broken().
  absl::Status Restore();

  struct Created {
    std::shared_ptr<Job> job;
    std::string token;
  };
  // Where a new job's momentum comes from (CreateJobRequest.restore).
  struct RestoreFrom {
    std::string job_id;
    std::string token;
    checkpoint::Selector selector;
  };
  // ALREADY_EXISTS for a taken (or broken, or being-deleted) id; RESOURCE_EXHAUSTED naming the
  // limit for a job beyond a limit (jobs, world size, tensors, spans, gather budget, state
  // bytes); with `restore`: NOT_FOUND / UNAUTHENTICATED / PERMISSION_DENIED for the source job,
  // the load's errors; the restored job's first generation is written before it is returned.
  // Nothing is created (and nothing stays allocated) on error.
  // `import_dir` (not with `restore` or init_from): the state from a full-state export directory
  // (Job::ImportState, read as owner.uid could), its first generation written before it is
  // returned.
  // REQUIRES: spec passed ValidateJobSpec.
  absl::StatusOr<Created> Create(common::JobSpec spec,
                                 const std::optional<RestoreFrom>& restore = std::nullopt,
                                 JobOwner owner = {}, const std::string& import_dir = "");
  // Test hook (muond arms it from $MUOND_TEST_IMPORT_FAULT=KILL:N in a build with
  // MUOND_TEST_HOOKS): the N-th Create that begins reading an import_dir (counted from 1 in this
  // process) SIGKILLs the daemon once that state was read and the job's directory made, before its
  // first generation is written: a daemon that dies in the middle of an import (its restart removes
  // the half-made job). An import refused before that point spends its turn without firing. Once;
  // 0 disarms it.
  static void SetImportKillForTesting(int nth);
  // Deletes `job` (taken from the caller, who keeps no reference). Steps in flight on the job fail
  // with NOT_FOUND; its shared-memory sessions end, its gRPC streams and exports are cancelled
  // (Job::MarkDeleted), and the job's memory is returned to the system before this returns, unless
  // a holder takes longer than 5 s to let go: then its bytes stay counted against
  // --max-state-bytes (and its id taken) until it does. NOT_FOUND when it is no longer registered
  // (deleted meanwhile).
  absl::Status Delete(std::shared_ptr<Job> job);
  // Job::Reset, made durable (Job::ResetDurably): a reset.json in the job's directory says the
  // job restarts reset unless a newer checkpoint generation was written after it. When the record
  // cannot be written the job is fenced (its memory was reset, its disk says otherwise) and the
  // error returned names the path.
  absl::Status Reset(const std::shared_ptr<Job>& job, int64_t next_step);
  // Job::LoadCheckpoint; a successful load supersedes an earlier reset record.
  absl::StatusOr<Job::LoadResult> LoadCheckpoint(const std::shared_ptr<Job>& job,
                                                 const checkpoint::Selector& selector);
  absl::StatusOr<std::shared_ptr<Job>> Find(const std::string& job_id) const;
  // The job `job_id` if `token` is its token: INVALID_ARGUMENT for an id no job can have,
  // NOT_FOUND, UNAUTHENTICATED for an empty token ("missing job token", then `hint`, e.g. where
  // the token is carried), PERMISSION_DENIED for a wrong one. The one token check of every path
  // (gRPC calls, shared-memory attaches, CreateJob's restore source).
  absl::StatusOr<std::shared_ptr<Job>> Authorize(const std::string& job_id,
                                                 std::string_view token,
                                                 const std::string& hint = "") const;
  std::vector<std::shared_ptr<Job>> List() const;
  struct BrokenJob {
    std::string directory;
    std::string reason;
  };
  std::vector<BrokenJob> Broken() const;
  // Bytes of job state and tables counted against --max-state-bytes (reservations included).
  uint64_t state_bytes() const;
  uint64_t momentum_bytes() const;
  const DaemonLimits& limits() const { return limits_; }
  // Waits for every job's checkpoint saves in progress.
  void WaitForSaves() const;
  // At shutdown, after the steps drained: waits for background saves, then saves every job whose
  // momentum changed since its newest generation (not probes, fenced or never-stepped jobs).
  // Failures are logged.
  void SaveChangedJobs() const;
  // True while any job has a step in flight.
  bool AnyStepInFlight() const;
  // Compute tasks waiting on the daemon's executor (muond_compute_queue_depth).
  size_t compute_queue_depth() const;
  // The daemon's compute device (the shared-memory server registers the ranks' regions with it);
  // null when the registry was made without one.
  device::Device* device() const;
  // The device computes in place in host memory (the cpu backend): what admission counts of a
  // job's gather (MeasureJob).
  bool InHostMemory() const;

 private:
  // Entries of a jobs directory only this daemon makes (job ids cannot start with a dot), and the
  // files of a job directory besides job.json and checkpoints/.
  static constexpr char kCreatingPrefix[] = ".creating-";
  static constexpr char kDeletedPrefix[] = ".deleted-";
  static constexpr char kCreatingMarker[] = ".creating";
  static constexpr char kResetRecord[] = "reset.json";
  std::string JobDir(const std::string& id) const;
  std::shared_ptr<JobImpl> NewJob(common::JobSpec spec, std::string token_sha256,
                                  JobOwner owner) const;
  // Create's part after the job is made: its initial state (restored from `source`, imported from
  // `import_dir` or read from init_from), its directory and, for a restored or imported state,
  // its first generation. *load_failed when reading the initial state failed; *made_dir once the
  // job's directory exists.
  absl::Status InitializeNewJob(Job& job, const std::shared_ptr<Job>& source,
                                const std::optional<RestoreFrom>& restore,
                                const std::string& import_dir, bool* load_failed,
                                bool* made_dir) const;
  static void LogCreated(const Job& job, const JobFootprint& footprint, const Job* source);
  // Checks the limits and reserves the id and bytes under the lock.
  absl::Status Reserve(const common::JobSpec& spec, uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Unreserve(const std::string& id, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Registers a job whose id and bytes Reserve reserved.
  void Publish(std::shared_ptr<Job> job) ABSL_LOCKS_EXCLUDED(mu_);
  // Writes the new job's directory (marker, job.json, marker removed).
  absl::Status Persist(const Job& job) const;
  // Restores one entry of the jobs directory (a broken one is recorded).
  void RestoreOne(const std::string& name);
  void SetBroken(const std::string& name, const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);
  void WatchSteps();
  // Counts free the bytes (and frees the id) of deleted jobs that were still held when Delete
  // returned and have been destroyed since.
  void ReleaseDeleted() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string backend_;
  const DaemonLimits limits_;
  const uint64_t default_gather_budget_bytes_;
  ComputeExecutor* const executor_;
  DeviceStreams* const devices_;
  const std::string state_dir_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> busy_ ABSL_GUARDED_BY(mu_);  // ids being created or deleted
  std::map<std::string, std::string> broken_ ABSL_GUARDED_BY(mu_);  // directory -> reason
  uint64_t state_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Deleted jobs something still held when Delete returned: id and bytes stay reserved until the
  // job is destroyed.
  struct DeletedHeld {
    std::string id;
    uint64_t bytes = 0;
    std::weak_ptr<Job> job;
  };
  std::vector<DeletedHeld> deleted_held_ ABSL_GUARDED_BY(mu_);
  std::thread watchdog_;
  common::Heartbeat heartbeat_{"job registry"};  // beaten by WatchSteps with mu_ held
};

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_JOB_REGISTRY_H_
