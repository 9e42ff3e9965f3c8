// The records of a job directory as the daemon reads them back at start (JobRegistry::Restore):
// job.json (the spec, the token's SHA-256 and the creator; written by JobRegistry::Persist) and
// reset.json (a reset after the newest checkpoint generation; written by JobRegistry::Reset).
// The files are the daemon's own, but a damaged disk, an operator's edit or an older or newer
// muond may have left anything there: every field is checked for presence and type, and a record
// that does not pass is an error naming the file and the key, never an exception. Thread-safe
// (pure functions).
#ifndef MUOND_SERVER_JOBS_JOB_RECORD_H_
#define MUOND_SERVER_JOBS_JOB_RECORD_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/job_spec.h"

namespace muond::server {

struct JobRecord {
  common::JobSpec spec;
  std::string token_sha256;       // 32 bytes
  int64_t owner_uid = -1;         // -1: unknown (TCP, or a record without an owner)
  std::string owner_description;  // "" when the record has none
};

// Parses job.json `text` read from `path` for the job directory named `name`. DATA_LOSS naming
// `path` and the key: not a JSON object, "format" not "muond-job", "spec" not a valid job spec
// or of another job id than `name`, "token_sha256" not 64 hex digits, "owner" not an object,
// "owner.uid" not an integer in -1..2^32-1, "owner.description" not a string.
absl::StatusOr<JobRecord> ParseJobRecord(std::string_view text, const std::string& path,
                                         const std::string& name);

struct ResetRecord {
  int64_t next_step = 0;
  int64_t after_generation = 0;
};

// Parses reset.json `text` read from `path`. DATA_LOSS naming `path` and the key: not a JSON
// object, "format" not "muond-reset", "next_step" or "after_generation" not a non-negative
// integer.
absl::StatusOr<ResetRecord> ParseResetRecord(std::string_view text, const std::string& path);

}  // namespace muond::server

#endif  // MUOND_SERVER_JOBS_JOB_RECORD_H_
