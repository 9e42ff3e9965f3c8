// Fuzz target: the job spec as a gRPC client sends it (muond.v1.JobSpec bytes, converted by
// common/job_spec_proto.cc). Properties: a refusal is INVALID_ARGUMENT with a message; an
// accepted spec converts back to a message that converts to the same spec, and its job.json form
// parses to the same spec.
#include "common/job_spec_proto.h"

#include <cstdint>
#include <string>

#include "common/job_spec.h"
#include "muond/v1/muond.pb.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  muond::v1::JobSpec proto;
  if (!proto.ParseFromArray(data, static_cast<int>(size))) return 0;
  auto spec = muond::common::JobSpecFromProto(proto);
  if (!spec.ok()) {
    FUZZ_CHECK(spec.status().code() == absl::StatusCode::kInvalidArgument &&
                   !spec.status().message().empty(),
               spec.status().ToString());
    return 0;
  }
  const std::string json = muond::common::JobSpecToJson(*spec);
  auto back = muond::common::JobSpecFromProto(muond::common::JobSpecToProto(*spec));
  FUZZ_CHECK(back.ok(), "its own message refused: " + back.status().ToString() + "\n" + json);
  FUZZ_CHECK(muond::common::JobSpecToJson(*back) == json, "message round trip differs:\n" + json);
  auto parsed = muond::common::ParseJobSpecJson(json);
  FUZZ_CHECK(parsed.ok(), "its job.json refused: " + parsed.status().ToString() + "\n" + json);
  FUZZ_CHECK(muond::common::JobSpecToJson(*parsed) == json,
             "job.json round trip differs:\n" + json);
  return 0;
}
