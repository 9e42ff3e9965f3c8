// Fuzz target: job.json as a client or a job record on disk gives it (common/job_spec.cc,
// job_spec_apply.cc). Properties: a refusal is INVALID_ARGUMENT with a message; an accepted spec
// writes back to JSON that parses to the same JSON, converts to the API message and back to the
// same spec, and (small jobs) lays out into spans that tile every matrix exactly once.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/layout.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

using muond::common::JobSpec;

// Every rank's spans of a small job cover each matrix's elements once, in bounds.
void CheckLayout(const JobSpec& spec) {
  if (spec.world_size > 16 || spec.matrices.size() > 32) return;
  std::vector<uint64_t> covered(spec.matrices.size(), 0);
  for (int r = 0; r < spec.world_size; ++r) {
    uint64_t rank_elements = 0;
    for (const auto& span : muond::common::RankSpans(spec, r)) {
      FUZZ_CHECK(span.matrix < spec.matrices.size(), "span of an unknown matrix");
      const uint64_t numel = static_cast<uint64_t>(spec.matrices[span.matrix].numel());
      FUZZ_CHECK(span.length > 0 && span.offset < numel && span.length <= numel - span.offset,
                 "span outside its matrix");
      covered[span.matrix] += span.length;
      rank_elements = std::max(rank_elements, span.rank_offset + span.length);
    }
    FUZZ_CHECK(rank_elements <= muond::common::RankBufferElements(spec, r),
               "span beyond the rank's buffer");
  }
  for (size_t m = 0; m < spec.matrices.size(); ++m) {
    FUZZ_CHECK(covered[m] == static_cast<uint64_t>(spec.matrices[m].numel()),
               "matrix " + std::to_string(m) + " not covered exactly once");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto spec = muond::common::ParseJobSpecJson(text);
  if (!spec.ok()) {
    FUZZ_CHECK(spec.status().code() == absl::StatusCode::kInvalidArgument &&
                   !spec.status().message().empty(),
               spec.status().ToString());
    return 0;
  }
  const std::string json = muond::common::JobSpecToJson(*spec);
  auto again = muond::common::ParseJobSpecJson(json);
  FUZZ_CHECK(again.ok(), "its own JSON refused: " + again.status().ToString() + "\n" + json);
  FUZZ_CHECK(muond::common::JobSpecToJson(*again) == json, "JSON round trip differs:\n" + json);
  auto back = muond::common::JobSpecFromProto(muond::common::JobSpecToProto(*spec));
  FUZZ_CHECK(back.ok(), "its API message refused: " + back.status().ToString() + "\n" + json);
  FUZZ_CHECK(
      muond::common::JobSpecToJson(*back) == json,
      "API message round trip differs:\n" + json + "\n" + muond::common::JobSpecToJson(*back));
  CheckLayout(*spec);
  return 0;
}
