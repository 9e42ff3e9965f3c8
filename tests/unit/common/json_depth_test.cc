// JSON nested far deeper than any muond format is refused with a clear error before anything
// recurses over it (common/json_depth.h): job.json and safetensors headers. Found by fuzzing (the
// inputs are in tests/fuzz/regressions/): such input overflowed the stack in nlohmann::json's
// recursive copy and dump, and the daemon died.
#include "common/json_depth.h"

#include <cstdint>
#include <string>

#include "common/job_spec.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace muond::common {
namespace {

std::string Nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

TEST(JsonDepthTest, LimitKeepsShallowValuesAndFlagsDeepOnes) {
  bool too_deep = true;
  auto j =
      ParseJsonWithDepthLimit<nlohmann::json>("{\"a\": " + Nested(kMaxJsonDepth) + "}", &too_deep);
  EXPECT_FALSE(j.is_discarded());
  EXPECT_FALSE(too_deep);
  j = ParseJsonWithDepthLimit<nlohmann::json>("{\"a\": " + Nested(kMaxJsonDepth + 1) + "}",
                                              &too_deep);
  EXPECT_TRUE(too_deep);
  j = ParseJsonWithDepthLimit<nlohmann::json>("{\"a\": " + Nested(200000) + "}", &too_deep);
  EXPECT_TRUE(too_deep);
  EXPECT_LT(j.dump().size(), 1000u);  // nothing deep was built
  j = ParseJsonWithDepthLimit<nlohmann::json>("[1,", &too_deep);
  EXPECT_TRUE(j.is_discarded());
}

TEST(JsonDepthTest, DeepJobJsonIsInvalidArgument) {
  const auto spec =
      ParseJobSpecJson(R"({"job_id": "j", "matrices": [{"name": "w", "shape": [4, 8]}], "muon": )" +
                       Nested(200000) + "}");
  ASSERT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << spec.status();
  EXPECT_EQ(spec.status().message(), "job.json: nested deeper than 64 levels");
}

TEST(JsonDepthTest, DeepSafetensorsHeaderIsInvalidArgument) {
  const std::string header =
      R"({"w": {"dtype": "F32", "shape": )" + Nested(200000) + R"(, "data_offsets": [0, 0]}})";
  const uint64_t n = header.size();
  std::string file(reinterpret_cast<const char*>(&n), 8);
  file += header;
  const auto parsed = SafetensorsFile::Parse(file);
  ASSERT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << parsed.status();
  EXPECT_EQ(parsed.status().message(), "safetensors: header nested deeper than 64 levels");
}

}  // namespace
}  // namespace muond::common
