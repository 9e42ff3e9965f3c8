// JobRegistry::Restore: the jobs of the state directory at start (see job_registry.h).
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/json_depth.h"
#include "common/logging.h"
#include "common/names.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/jobs/job_footprint.h"
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

struct Record {
  common::JobSpec spec;
  std::string token_sha256;
  JobOwner owner;
};

absl::StatusOr<Record> ParseRecord(const std::string& path, const std::string& name) {
  ASSIGN_OR_RETURN(const std::string text, ReadRecord(path));
  bool too_deep = false;
  const nlohmann::json record = common::ParseJsonWithDepthLimit<nlohmann::json>(text, &too_deep);
  Record r;
  const auto hash = record.is_object() ? record.find("token_sha256") : record.end();
  if (record.is_discarded() || too_deep || !record.is_object() ||
      record.value("format", "") != "muond-job" || !record.contains("spec") ||
      hash == record.end() || !hash->is_string() ||
      (r.token_sha256 = absl::HexStringToBytes(hash->get<std::string>())).size() != 32) {
    return absl::DataLossError(absl::StrCat(path, " is not a muond job record"));
  }
  auto spec = common::ParseJobSpecJson(record["spec"].dump());
  if (!spec.ok()) return absl::DataLossError(absl::StrCat(path, ": ", spec.status().message()));
  if (spec->job_id != name) {
    return absl::DataLossError(absl::StrCat(path, " names job ", common::Quoted(spec->job_id),
                                            ", its directory ", common::Quoted(name)));
  }
  r.spec = *std::move(spec);
  if (const auto it = record.find("owner"); it != record.end() && it->is_object()) {
    r.owner.uid = it->value("uid", int64_t{-1});
    r.owner.description = it->value("description", std::string());
  }
  if (r.owner.description.empty()) r.owner.description = "unknown (older record)";
  return r;
}

// A reset.json written after the newest generation means: restart reset.
struct ResetRecord {
  int64_t next_step = 0;
  int64_t after_generation = 0;
};

std::optional<ResetRecord> ReadReset(const std::string& path) {
  auto text = ReadRecord(path);
  if (!text.ok()) return std::nullopt;
  bool too_deep = false;
  const nlohmann::json j = common::ParseJsonWithDepthLimit<nlohmann::json>(*text, &too_deep);
  if (j.is_discarded() || too_deep || !j.is_object() || j.value("format", "") != "muond-reset" ||
      !j.contains("next_step") || !j.contains("after_generation") ||
      !j.at("next_step").is_number_integer() || !j.at("after_generation").is_number_integer()) {
    return std::nullopt;
  }
  return ResetRecord{j["next_step"].get<int64_t>(), j["after_generation"].get<int64_t>()};
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
  auto record = ParseRecord(absl::StrCat(dir, "/job.json"), name);
  if (!record.ok()) return SetBroken(name, std::string(record.status().message()));
  auto footprint = MeasureJob(record->spec);
  absl::Status s = footprint.status();
  if (s.ok()) s = CheckJobLimits(record->spec, *footprint, limits_, default_gather_budget_bytes_);
  const uint64_t bytes = footprint.ok() ? footprint->total() : 0;
  if (s.ok()) s = Reserve(record->spec, bytes);
  if (!s.ok()) return SetBroken(name, std::string(s.message()));
  std::shared_ptr<Job> job =
      NewJob(std::move(record->spec), std::move(record->token_sha256), std::move(record->owner));
  std::string how;
  if (!job->spec().transport_probe) {
    // A reset newer than every generation wins, and nothing is loaded.
    const std::optional<ResetRecord> reset = ReadReset(absl::StrCat(dir, "/", kResetRecord));
    if (reset && job->NewestGeneration() <= reset->after_generation) {
      (void)job->Reset(reset->next_step);
      how = absl::StrCat("reset before the restart: zero momentum, next step ", reset->next_step);
    } else if (auto loaded = job->LoadCheckpoint({}); loaded.ok()) {
      how = absl::StrCat("from checkpoint generation ", loaded->info.generation, ", next step ",
                         loaded->next_step);
    } else if (loaded.status().code() == absl::StatusCode::kNotFound) {
      how = "no checkpoint: zero momentum, next step 0";
    } else {
      how = absl::StrCat("FENCED: ", loaded.status().message());
      job->Fence(absl::StrCat("restart: ", loaded.status().message()));
    }
    // Apply mode without a generation to load (or after a reset newer than every generation):
    // the masters were in memory only; init_from is read again, else the ranks upload them.
    if (job->apply() && !job->WeightsComplete()) {
      if (job->spec().init_from.empty()) {
        how += "; initial weights not in (ranks upload them again)";
      } else if (absl::Status init = job->InitFromFile(job->owner().uid); init.ok()) {
        how += "; initial weights from init_from";
      } else {
        how += absl::StrCat("; initial weights not in: ", init.message());
      }
    }
  }
  MUOND_LOG(INFO) << "job '" << name << "' restored (" << how << ")";
  Publish(std::move(job));
}

}  // namespace muond::server
