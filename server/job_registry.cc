#include "server/job_registry.h"

#include <dirent.h>
#include <sys/random.h>
#include <sys/stat.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/sha256.h"
#include "nlohmann/json.hpp"
#include "server/durable_file.h"

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
                         ComputeDevice* compute, std::string state_dir)
    : backend_(std::move(backend)),
      max_momentum_bytes_(max_momentum_bytes),
      default_gather_budget_bytes_(default_gather_budget_bytes),
      executor_(executor),
      compute_(compute),
      state_dir_(std::move(state_dir)) {}

std::string JobRegistry::JobDir(const std::string& id) const {
  return absl::StrCat(state_dir_, "/jobs/", id);
}

std::shared_ptr<Job> JobRegistry::NewJob(common::JobSpec spec, std::string token_sha256) const {
  const uint64_t budget =
      spec.gather_budget_bytes != 0 ? spec.gather_budget_bytes : default_gather_budget_bytes_;
  const std::string checkpoints = absl::StrCat(JobDir(spec.job_id), "/checkpoints");
  return std::make_shared<Job>(std::move(spec), std::move(token_sha256), backend_, executor_,
                               budget, compute_, checkpoints);
}

absl::StatusOr<JobRegistry::Created> JobRegistry::Create(common::JobSpec spec,
                                                         const std::optional<RestoreFrom>& restore) {
  std::shared_ptr<Job> source;
  if (restore) {
    auto found = Find(restore->job_id);
    if (!found.ok()) {
      return absl::NotFoundError(absl::StrCat("restore: job '", restore->job_id, "' not found"));
    }
    if (restore->token.empty()) {
      return absl::UnauthenticatedError(
          absl::StrCat("restore: the token of job '", restore->job_id, "' is missing"));
    }
    if (!(*found)->TokenMatches(restore->token)) {
      return absl::PermissionDeniedError(
          absl::StrCat("restore: wrong token for job '", restore->job_id, "'"));
    }
    source = *std::move(found);
  }
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
  const std::string dir = JobDir(id);
  std::shared_ptr<Job> job = NewJob(std::move(spec), common::Sha256(*token));
  const uint64_t budget = job->gather_budget_bytes();
  if (source != nullptr) {
    auto loaded = job->LoadCheckpointFrom(source, restore->selector);
    if (!loaded.ok()) return loaded.status();
  }
  nlohmann::json record = {
      {"format", "muond-job"},
      {"format_version", 1},
      {"spec", nlohmann::json::parse(common::JobSpecToJson(job->spec()))},
      {"token_sha256", absl::BytesToHexString(job->token_sha256())}};
  // A directory left by a job of this id that is gone (a failed create) holds nothing of the new
  // job's.
  absl::Status persisted = durable::RemoveTree(dir);
  if (persisted.ok()) persisted = durable::MakeDirs(dir);
  if (persisted.ok()) {
    persisted = durable::WriteFileDurably(absl::StrCat(dir, "/job.json"), record.dump(1) + "\n");
  }
  if (persisted.ok() && source != nullptr) {
    // The restored momentum exists only in memory until the job has a generation of its own: a
    // restart before its first save would bring it back empty.
    persisted = job->SaveCheckpoint().status();
  }
  if (!persisted.ok()) {
    (void)durable::RemoveTree(dir);
    return absl::Status(persisted.code(), absl::StrCat("job '", id, "' could not be stored in ",
                                                       state_dir_, ": ", persisted.message()));
  }
  jobs_.emplace(id, job);
  momentum_bytes_ += bytes;
  MUOND_LOG(INFO) << "job '" << id << "' created: " << job->spec().matrices.size()
                  << " matrices, " << bytes << " bytes of momentum, world size "
                  << job->spec().world_size << ", gather budget " << budget << " bytes"
                  << (source != nullptr ? absl::StrCat(", momentum from job '", source->id(), "'")
                                        : std::string());
  return Created{std::move(job), *std::move(token)};
}

absl::Status JobRegistry::Restore() {
  const std::string jobs_dir = absl::StrCat(state_dir_, "/jobs");
  DIR* d = ::opendir(jobs_dir.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("opendir ", jobs_dir, ": ", std::strerror(errno)));
  }
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    if (name.rfind(".deleted-", 0) == 0) {
      // A deletion that did not finish.
      (void)durable::RemoveTree(absl::StrCat(jobs_dir, "/", name));
      continue;
    }
    names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const std::string path = absl::StrCat(jobs_dir, "/", name, "/job.json");
    std::ifstream in(path);
    if (!in) {
      MUOND_LOG(WARNING) << "restore: " << jobs_dir << "/" << name
                         << " has no job.json (an interrupted create); removing it";
      (void)durable::RemoveTree(absl::StrCat(jobs_dir, "/", name));
      continue;
    }
    std::stringstream text;
    text << in.rdbuf();
    const nlohmann::json record = nlohmann::json::parse(text.str(), nullptr, false);
    std::string hash;
    if (record.is_discarded() || record.value("format", "") != "muond-job" ||
        !record.contains("spec") || !record["token_sha256"].is_string() ||
        (hash = absl::HexStringToBytes(record["token_sha256"].get<std::string>())).size() != 32) {
      return absl::DataLossError(absl::StrCat("restore: ", path, " is not a muond job record"));
    }
    auto spec = common::ParseJobSpecJson(record["spec"].dump());
    if (!spec.ok()) {
      return absl::DataLossError(absl::StrCat("restore: ", path, ": ", spec.status().message()));
    }
    if (spec->job_id != name) {
      return absl::DataLossError(absl::StrCat("restore: ", path, " names job '", spec->job_id,
                                              "', its directory '", name, "'"));
    }
    const uint64_t bytes = MomentumBytes(*spec);
    absl::MutexLock lock(&mu_);
    if (max_momentum_bytes_ != 0 && momentum_bytes_ + bytes > max_momentum_bytes_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "restore: job '", name, "' needs ", bytes, " bytes of momentum; with the jobs before it ",
          momentum_bytes_ + bytes, " > --max-momentum-bytes ", max_momentum_bytes_));
    }
    std::shared_ptr<Job> job = NewJob(*std::move(spec), hash);
    std::string how;
    if (!job->spec().transport_probe) {
      auto loaded = job->LoadCheckpoint({});
      if (loaded.ok()) {
        how = absl::StrCat("from checkpoint generation ", loaded->info.generation, ", next step ",
                           loaded->next_step);
      } else if (loaded.status().code() == absl::StatusCode::kNotFound) {
        how = "no checkpoint: zero momentum, next step 0";
      } else {
        how = absl::StrCat("FENCED: ", loaded.status().message());
        job->Fence(absl::StrCat("restart: ", loaded.status().message()));
      }
    }
    MUOND_LOG(INFO) << "job '" << name << "' restored (" << how << ")";
    jobs_.emplace(name, std::move(job));
    momentum_bytes_ += bytes;
  }
  return absl::OkStatus();
}

absl::Status JobRegistry::Delete(const std::string& job_id) {
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
    // Out of the way first (one rename): a restart never sees a half-removed job.
    const std::string dir = JobDir(job_id);
    const std::string gone = absl::StrCat(state_dir_, "/jobs/.deleted-", job_id, "-",
                                          absl::ToUnixNanos(absl::Now()));
    if (::rename(dir.c_str(), gone.c_str()) != 0 && errno != ENOENT) {
      return absl::InternalError(absl::StrCat("job '", job_id, "': rename ", dir, " -> ", gone,
                                              ": ", std::strerror(errno)));
    }
    job = std::move(it->second);
    jobs_.erase(it);
    momentum_bytes_ -= MomentumBytes(job->spec());
    job->MarkDeleted();
    job->WaitForSaves();
    if (absl::Status s = durable::RemoveTree(gone); !s.ok()) {
      MUOND_LOG(WARNING) << "job '" << job_id << "' deleted; its files: " << s.message();
    }
  }
  MUOND_LOG(INFO) << "job '" << job_id << "' deleted";
  return absl::OkStatus();
}

void JobRegistry::WaitForSaves() const {
  for (const auto& job : List()) job->WaitForSaves();
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
