// Fuzz target: a job directory's reset.json as the daemon reads it back at start
// (server/jobs/job_record.cc ParseResetRecord; JobRegistry::Restore ignores, with a log line, a
// record it refuses). Properties: no exception; a refusal is DATA_LOSS naming the file; an
// accepted record has a next step and a generation >= 0.
#include <cstdint>
#include <string>

#include "server/jobs/job_record.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

constexpr char kPath[] = "/state/jobs/j1/reset.json";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto r = muond::server::ParseResetRecord(text, kPath);
  if (!r.ok()) {
    FUZZ_CHECK(r.status().code() == absl::StatusCode::kDataLoss, r.status().ToString());
    FUZZ_CHECK(r.status().message().rfind(kPath, 0) == 0,
               "the message does not name the file: " + r.status().ToString());
    return 0;
  }
  FUZZ_CHECK(r->next_step >= 0 && r->after_generation >= 0, "a negative step or generation");
  return 0;
}
