// The daemon's jobs by id. Creating a job draws its random token and reserves its momentum memory
// against the daemon-wide quota. Thread-safe.
//
// Persistence: each job has a directory <state_dir>/jobs/<id>/ with job.json ({"format":
// "muond-job", "format_version": 1, "spec": job.json form, "token_sha256": hex}, written durably
// at creation; the token itself is never stored) and checkpoints/ (server/checkpoint.h). A muond
// started on the same state directory restores every job (Restore) from its newest good
// checkpoint generation. Deleting a job removes its directory.
#ifndef MUOND_SERVER_JOB_REGISTRY_H_
#define MUOND_SERVER_JOB_REGISTRY_H_

#include <cstdint>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/job_spec.h"
#include "server/compute_executor.h"
#include "server/job.h"

namespace muond::server {

// 32 random bytes from the kernel's CSPRNG, hex encoded (64 characters).
absl::StatusOr<std::string> NewJobToken();

class JobRegistry {
 public:
  // max_momentum_bytes: the sum of all jobs' fp32 momentum allowed (0: unlimited).
  // default_gather_budget_bytes: for jobs that do not set their own. `executor` outlives the jobs'
  // work (it runs every task submitted before it is destroyed).
  JobRegistry(std::string backend, uint64_t max_momentum_bytes, uint64_t default_gather_budget_bytes,
              ComputeExecutor* executor, ComputeDevice* compute, std::string state_dir);

  // Restores the jobs of the state directory (at startup, before serving): each from its newest
  // good checkpoint generation (none: zero momentum, next step 0; none good: the job is fenced with
  // the reason until a load or reset). Errors (unreadable job.json, quota) name the path.
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
  // ALREADY_EXISTS for a taken id; RESOURCE_EXHAUSTED when the momentum would exceed the quota;
  // with `restore`: NOT_FOUND / UNAUTHENTICATED / PERMISSION_DENIED for the source job, the load's
  // errors (FAILED_PRECONDITION for matrices that do not match); the restored job's first
  // checkpoint generation is written before it is returned. Nothing is created on error.
  // REQUIRES: spec passed ValidateJobSpec.
  absl::StatusOr<Created> Create(common::JobSpec spec,
                                 const std::optional<RestoreFrom>& restore = std::nullopt);
  // NOT_FOUND for an unknown id. Steps in flight on the job fail with NOT_FOUND.
  absl::Status Delete(const std::string& job_id);
  absl::StatusOr<std::shared_ptr<Job>> Find(const std::string& job_id) const;
  std::vector<std::shared_ptr<Job>> List() const;
  uint64_t momentum_bytes() const;
  // Waits for every job's checkpoint saves in progress.
  void WaitForSaves() const;
  // True while any job has a step in flight.
  bool AnyStepInFlight() const;
  // Compute tasks waiting on the daemon's executor (muond_compute_queue_depth).
  size_t compute_queue_depth() const { return executor_->queue_depth(); }

 private:
  const std::string backend_;
  const uint64_t max_momentum_bytes_;
  const uint64_t default_gather_budget_bytes_;
  ComputeExecutor* const executor_;
  ComputeDevice* const compute_;
  const std::string state_dir_;
  std::string JobDir(const std::string& id) const;
  // A job of this daemon (its gather budget: the spec's, else the default; its checkpoints under
  // JobDir), not registered.
  std::shared_ptr<Job> NewJob(common::JobSpec spec, std::string token_sha256) const;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  uint64_t momentum_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_JOB_REGISTRY_H_
