// JobRegistry::Restore: the jobs of the state directory at start (see job_registry.h).
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <fstream>
#include <new>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "server/jobs/job_footprint.h"
#include "server/jobs/job_impl.h"
#include "server/jobs/job_record.h"
#include "server/jobs/job_registry.h"
#include "server/storage/durable_file.h"

namespace muond::server {
namespace {

constexpr std::streamsize kMaxRecordBytes = 64 << 20;

absl::StatusOr<std::string> ReadRecord(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": ", std::strerror(errno)));
  const std::streamsize size = in.tellg();
  if (size < 0 || size > kMaxRecordBytes) {
    return absl::DataLossError(absl::StrCat(path, " is larger than ", kMaxRecordBytes, " bytes"));
  }
  std::string text(static_cast<size_t>(size), '\0');
  in.seekg(0);
  if (!in.read(text.data(), size)) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  return text;
}

// The reset record at `path`, when there is one that parses (a damaged one is logged and
// ignored: the newest checkpoint generation is loaded instead).
std::optional<ResetRecord> ReadReset(const std::string& name, const std::string& path) {
  auto text = ReadRecord(path);
  if (!text.ok()) {
    if (text.status().code() != absl::StatusCode::kNotFound) {
      MUOND_LOG(ERROR) << "restore: job '" << name << "': " << text.status().message()
                       << "; the reset record is ignored";
    }
    return std::nullopt;
  }
  auto reset = ParseResetRecord(*text, path);
  if (!reset.ok()) {
    MUOND_LOG(ERROR) << "restore: job '" << name << "': " << reset.status().message()
                     << "; the reset record is ignored";
    return std::nullopt;
  }
  return *reset;
}

// Brings the restored `job`'s state back (a reset, its newest checkpoint generation, its
// init_from file); returns how, for the log. Throws std::bad_alloc when memory runs out.
std::string RestoreState(const std::string& name, const std::string& reset_path,
                         JobImpl& job) {
  std::string how;
  if (job.spec().transport_probe) return how;
  // A reset newer than every generation wins, and nothing is loaded.
  const std::optional<ResetRecord> reset = ReadReset(name, reset_path);
  if (reset && job.NewestGeneration() <= reset->after_generation) {
    (void)job.Reset(reset->next_step);
    how = absl::StrCat("reset before the restart: zero momentum, next step ", reset->next_step);
  } else if (auto loaded = job.LoadCheckpoint({}); loaded.ok()) {
    how = absl::StrCat("from checkpoint generation ", loaded->info.generation, ", next step ",
                       loaded->next_step);
  } else if (loaded.status().code() == absl::StatusCode::kNotFound) {
    how = "no checkpoint: zero momentum, next step 0";
  } else {
    how = absl::StrCat("FENCED: ", loaded.status().message());
    job.Fence(absl::StrCat("restart: ", loaded.status().message()));
  }
  // Apply mode without a generation to load (or after a reset newer than every generation): the
  // masters were in memory only; init_from is read again, else the ranks upload them.
  if (job.apply() && !job.WeightsComplete()) {
    if (job.spec().init_from.empty()) {
      how += "; initial weights not in (ranks upload them again)";
    } else if (absl::Status init = job.InitFromFile(job.owner().uid); init.ok()) {
      how += "; initial weights from init_from";
    } else {
      how += absl::StrCat("; initial weights not in: ", init.message());
    }
  }
  return how;
}

}  // namespace

void JobRegistry::SetBroken(const std::string& name, const std::string& reason) {
  MUOND_LOG(ERROR) << "restore: " << JobDir(name) << " set aside (not served): " << reason;
  absl::MutexLock lock(&mu_);
  broken_[name] = reason;
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
    if (absl::StartsWith(name, kDeletedPrefix) || absl::StartsWith(name, kCreatingPrefix)) {
      // A deletion or a create that did not finish (only this daemon makes such names: ids
      // cannot start with a dot).
      (void)durable::RemoveTree(absl::StrCat(jobs_dir, "/", name));
      continue;
    }
    names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) RestoreOne(name);
  return absl::OkStatus();
}

void JobRegistry::RestoreOne(const std::string& name) {
  if (absl::Status s = common::ValidateJobId(name, "directory name"); !s.ok()) {
    if (name[0] == '.') {
      MUOND_LOG(WARNING) << "restore: ignoring " << JobDir(name) << " (not a job directory)";
      return;
    }
    return SetBroken(name, std::string(s.message()));
  }
  const std::string dir = JobDir(name);
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return SetBroken(name, "not a directory");
  }
  if (::lstat(absl::StrCat(dir, "/", kCreatingMarker).c_str(), &st) == 0) {
    MUOND_LOG(WARNING) << "restore: " << dir << " is an interrupted create; removing it";
    (void)durable::RemoveTree(dir);
    return;
  }
  const std::string record_path = absl::StrCat(dir, "/job.json");
  auto text = ReadRecord(record_path);
  if (!text.ok()) return SetBroken(name, std::string(text.status().message()));
  auto record = ParseJobRecord(*text, record_path, name);
  if (!record.ok()) return SetBroken(name, std::string(record.status().message()));
  auto footprint = MeasureJob(record->spec, default_gather_budget_bytes_, limits_.step_window_bytes,
                              InHostMemory());
  absl::Status s = footprint.status();
  if (s.ok()) s = CheckJobLimits(record->spec, *footprint, limits_, default_gather_budget_bytes_);
  const uint64_t bytes = footprint.ok() ? footprint->total() : 0;
  if (s.ok()) s = Reserve(record->spec, bytes);
  if (!s.ok()) return SetBroken(name, std::string(s.message()));
  // The id and bytes are released on every way out but the one that publishes the job
  // (exceptions included); declared before the job, so the job's memory goes first.
  absl::Cleanup unreserve = [this, &name, bytes] { Unreserve(name, bytes); };
  std::shared_ptr<JobImpl> job;
  std::string how;
  try {
    JobOwner owner{record->owner_uid, std::move(record->owner_description)};
    if (owner.description.empty()) owner.description = "unknown (older record)";
    job = NewJob(std::move(record->spec), std::move(record->token_sha256), std::move(owner));
    how = RestoreState(name, absl::StrCat(dir, "/", kResetRecord), *job);
  } catch (const std::bad_alloc&) {
    job.reset();
    return SetBroken(name,
                     absl::StrCat("the system could not allocate its ", bytes, " bytes of state"));
  } catch (const std::exception& e) {  // one job's files never stop the daemon's start
    job.reset();
    return SetBroken(name, absl::StrCat("restoring it failed: ", e.what()));
  }
  MUOND_LOG(INFO) << "job '" << name << "' restored (" << how << ")";
  Publish(std::move(job));
  std::move(unreserve).Cancel();
}

}  // namespace muond::server
