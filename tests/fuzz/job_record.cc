// Fuzz target: a job directory's job.json as the daemon reads it back at start
// (server/jobs/job_record.cc ParseJobRecord; JobRegistry::Restore sets a job aside when it is
// refused). The bug class: a field of another type than expected ("format": 7, a text uid) threw
// from nlohmann's value()/get() and aborted the daemon's start.
//
// Input: 1 byte of fix-ups, then the record. Fix-up bit 0 names the job directory after the
// record's own spec.job_id (when it has one), so that the checks after that one are reached.
// Properties: no exception; a refusal is DATA_LOSS naming the file; an accepted record has a
// 32-byte token hash, the directory's job id, an owner uid in -1..2^32-1 and a spec that writes
// back to JSON that parses again.
#include "server/jobs/job_record.h"

#include <cstdint>
#include <string>

#include "common/job_spec.h"
#include "nlohmann/json.hpp"
#include "tests/fuzz/fuzz_check.h"

namespace {

using Json = nlohmann::json;

constexpr char kPath[] = "/state/jobs/j1/job.json";

// The record's spec.job_id, or "j1".
std::string DirectoryName(const std::string& text) {
  const Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return "j1";
  const auto spec = j.find("spec");
  if (spec == j.end() || !spec->is_object()) return "j1";
  const auto id = spec->find("job_id");
  if (id == spec->end() || !id->is_string()) return "j1";
  return id->get<std::string>();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  const std::string name = (data[0] & 1) ? DirectoryName(text) : "j1";
  auto r = muond::server::ParseJobRecord(text, kPath, name);
  if (!r.ok()) {
    FUZZ_CHECK(r.status().code() == absl::StatusCode::kDataLoss, r.status().ToString());
    FUZZ_CHECK(r.status().message().rfind(kPath, 0) == 0,
               "the message does not name the file: " + r.status().ToString());
    return 0;
  }
  FUZZ_CHECK(r->token_sha256.size() == 32, "token hash of another size");
  FUZZ_CHECK(r->spec.job_id == name, "a record of another job accepted");
  FUZZ_CHECK(r->owner_uid >= -1 && r->owner_uid <= int64_t{0xffffffff}, "owner uid out of range");
  const std::string json = muond::common::JobSpecToJson(r->spec);
  auto again = muond::common::ParseJobSpecJson(json);
  FUZZ_CHECK(again.ok(), "its spec's own JSON refused: " + again.status().ToString());
  return 0;
}
