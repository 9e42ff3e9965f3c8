#include "server/job_registry.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace muond::server {
namespace {

uint64_t MomentumBytes(const common::JobSpec& spec) {
  if (spec.transport_probe) return 0;
  uint64_t n = 0;
  for (const common::MatrixSpec& m : spec.matrices) n += static_cast<uint64_t>(m.numel());
  return n * sizeof(float);
}

}  // namespace

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
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(raw), sizeof(raw)));
}

JobRegistry::JobRegistry(std::string backend, uint64_t max_momentum_bytes,
                         uint64_t default_gather_budget_bytes, ComputeExecutor* executor,
                         ComputeDevice* compute)
    : backend_(std::move(backend)),
      max_momentum_bytes_(max_momentum_bytes),
      default_gather_budget_bytes_(default_gather_budget_bytes),
      executor_(executor),
      compute_(compute) {}

absl::StatusOr<JobRegistry::Created> JobRegistry::Create(common::JobSpec spec) {
  auto token = NewJobToken();
  if (!token.ok()) return token.status();
  const uint64_t bytes = MomentumBytes(spec);
  const std::string id = spec.job_id;
  absl::MutexLock lock(&mu_);
  if (jobs_.count(id) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("job '", id, "' already exists"));
  }
  if (max_momentum_bytes_ != 0 && momentum_bytes_ + bytes > max_momentum_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "job '", id, "' needs ", bytes, " bytes of momentum; ", momentum_bytes_, " of ",
        max_momentum_bytes_, " bytes (--max-momentum-bytes) are in use"));
  }
  const uint64_t budget =
      spec.gather_budget_bytes != 0 ? spec.gather_budget_bytes : default_gather_budget_bytes_;
  auto job = std::make_shared<Job>(std::move(spec), *token, backend_, executor_, budget, compute_);
  jobs_.emplace(id, job);
  momentum_bytes_ += bytes;
  MUOND_LOG(INFO) << "job '" << id << "' created: " << job->spec().matrices.size()
                  << " matrices, " << bytes << " bytes of momentum, world size "
                  << job->spec().world_size << ", gather budget " << budget << " bytes";
  return Created{std::move(job), *std::move(token)};
}

absl::Status JobRegistry::Delete(const std::string& job_id) {
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
    job = std::move(it->second);
    jobs_.erase(it);
    momentum_bytes_ -= MomentumBytes(job->spec());
  }
  job->MarkDeleted();
  MUOND_LOG(INFO) << "job '" << job_id << "' deleted";
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Job>> JobRegistry::Find(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  return it->second;
}

std::vector<std::shared_ptr<Job>> JobRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Job>> out;
  for (const auto& [id, job] : jobs_) out.push_back(job);
  return out;
}

bool JobRegistry::AnyStepInFlight() const {
  for (const auto& job : List()) {
    if (job->Status().has_step_in_flight()) return true;
  }
  return false;
}

uint64_t JobRegistry::momentum_bytes() const {
  absl::MutexLock lock(&mu_);
  return momentum_bytes_;
}

}  // namespace muond::server
