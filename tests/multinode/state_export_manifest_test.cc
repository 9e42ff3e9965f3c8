// The full-state export's manifest (common/state_export.h), without a daemon: it round-trips,
// its offsets follow the shapes and the stored bytes, a damaged or edited one is refused naming
// the array (DATA_LOSS; a manifest of another format INVALID_ARGUMENT), rows of a tensor split
// across nodes are kept, and the held forms of compressed state (bf16, int8 with its map and
// block) parse while an unknown dtype, a missing or unknown map or another block size is named.
#include <string>
#include <vector>

#include "common/crc32c.h"
#include "common/state_export.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace muond::integration {
namespace {

namespace se = common::state_export;

TEST(StateExportManifestTest, RoundTripAndDamage) {
  se::Manifest m;
  m.job_id = "g.node1";
  m.global_job_id = "g";
  m.node = 1;
  m.nodes = 2;
  m.mode = common::JobMode::kApply;
  m.step = 7;
  m.payload = "g.node1.safetensors";
  m.arrays = {{"master/w", "w", {2, 3}}, {"momentum/w", "w", {2, 3}}};
  m.tensor_steps = {{"w", 0}};
  se::LayOut(&m);
  const std::string text = se::ManifestToJson(m);
  auto back = se::ParseManifest(text, "M");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->arrays[1].begin, 24u);
  EXPECT_EQ(back->payload_bytes, se::PayloadHeader(m).size() + 48);
  EXPECT_EQ(se::PayloadHeader(*back), se::PayloadHeader(m));
  EXPECT_EQ(se::ParseManifest("[1]", "M").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(se::ParseManifest(std::string(100, '['), "M").status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(se::ParseManifest("{\"format\": \"x\"}", "M").status().code(),
            absl::StatusCode::kInvalidArgument);
  // An edited offset with its checksum recomputed is still refused (offsets follow shapes).
  se::Manifest edited = m;
  edited.arrays[1].begin = 4;
  auto s = se::ParseManifest(se::ManifestToJson(edited), "M").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(std::string(s.message()).find("momentum/w"), std::string::npos) << s.message();
  edited = m;
  edited.payload = "../x";
  EXPECT_EQ(se::ParseManifest(se::ManifestToJson(edited), "M").status().code(),
            absl::StatusCode::kDataLoss);
  edited = m;
  edited.arrays[1].name = "master/w";
  s = se::ParseManifest(se::ManifestToJson(edited), "M").status();
  EXPECT_NE(std::string(s.message()).find("listed twice"), std::string::npos) << s.message();
  // Rows of a tensor split across nodes: written, read back; outside the tensor's rows: damaged.
  edited = m;
  edited.arrays[0].row_offset = edited.arrays[1].row_offset = 4;
  edited.arrays[0].full_rows = edited.arrays[1].full_rows = 6;
  back = se::ParseManifest(se::ManifestToJson(edited), "M");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->arrays[1].row_offset, 4);
  EXPECT_EQ(back->arrays[1].full_rows, 6);
  EXPECT_EQ(back->arrays[0].full_rows, 6);
  EXPECT_EQ(se::ParseManifest(se::ManifestToJson(m), "M")->arrays[0].full_rows, 0);
  edited.arrays[1].row_offset = 5;  // rows [5, 7) of 6
  s = se::ParseManifest(se::ManifestToJson(edited), "M").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(std::string(s.message()).find("are not within its 6 rows"), std::string::npos) << s;
}

// The manifest `text` with tensors[t][key] set to `value` (null: removed) and its checksum made
// right again, as the writer computes it: a well-formed manifest saying something else.
std::string Edited(const std::string& text, size_t t, const std::string& key,
                   const nlohmann::json& value) {
  nlohmann::json j = nlohmann::json::parse(text);
  if (value.is_null()) {
    j["tensors"][t].erase(key);
  } else {
    j["tensors"][t][key] = value;
  }
  j.erase("checksum");
  const std::string compact = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  j["checksum"] = common::Crc32c(compact.data(), compact.size());
  return j.dump(1);
}

// The manifest's held form is checked as it is parsed: an unknown dtype, int8 without "map" or
// with another map or block size.
TEST(StateExportManifestTest, HeldFormsParseAndBadOnesAreNamed) {
  se::Manifest m;
  m.job_id = "h";
  m.mode = common::JobMode::kApply;
  m.step = 1;
  m.payload = "h.safetensors";
  se::Array v{"exp_avg_sq/e", "e", {5000}};
  v.dtype = common::StateDType::kInt8;
  v.non_negative = true;
  se::Array b{"exp_avg/e", "e", {5000}};
  b.dtype = common::StateDType::kBFloat16;
  m.arrays = {b, v};
  m.tensor_steps = {{"e", 1}};
  se::LayOut(&m);
  const std::string text = se::ManifestToJson(m);
  auto back = se::ParseManifest(text, "m.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->arrays[0].dtype, common::StateDType::kBFloat16);
  EXPECT_EQ(back->arrays[0].end - back->arrays[0].begin, 10000u);
  EXPECT_EQ(back->arrays[1].dtype, common::StateDType::kInt8);
  EXPECT_TRUE(back->arrays[1].non_negative);
  EXPECT_EQ(back->arrays[1].end - back->arrays[1].begin, 5000u + 4 * 3);  // 3 blocks of 2048
  EXPECT_NE(se::PayloadHeader(m).find("\"U8\",\"shape\":[5012]"), std::string::npos)
      << se::PayloadHeader(m);
  EXPECT_NE(se::PayloadHeader(m).find("\"BF16\",\"shape\":[5000]"), std::string::npos)
      << se::PayloadHeader(m);
  struct Bad {
    size_t tensor;
    std::string key;
    nlohmann::json value;
    std::string message;
  };
  for (const Bad& c : std::vector<Bad>{
           {0, "dtype", "int4",
            "key 'tensors[0].dtype' is \"int4\", not \"float32\", \"bfloat16\""},
           {0, "dtype", "float16", "key 'tensors[0].dtype' is \"float16\""},
           {1, "map", nullptr, "has no key 'tensors[1].map'"},
           {1, "map", "ln", "key 'tensors[1].map' is \"ln\", not \"linear\" or \"log\""},
           {1, "block", 1024, "key 'tensors[1].block' is 1024, not an integer in [2048, 2048]"},
           // The offsets follow the stored bytes: an int8 array laid out as float32 is damaged.
           {1, "dtype", "float32", "do not follow its shape"}}) {
    SCOPED_TRACE(c.message);
    auto bad = se::ParseManifest(Edited(text, c.tensor, c.key, c.value), "m.json");
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
    EXPECT_NE(bad.status().message().find(c.message), std::string::npos) << bad.status();
    EXPECT_NE(bad.status().message().find("m.json"), std::string::npos) << bad.status();
  }
}

}  // namespace
}  // namespace muond::integration
