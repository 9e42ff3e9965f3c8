// checkpoint::Store::Load against generations whose checksums are right but whose contents lie
// (a hand-made or tampered checkpoint directory): every such generation is DATA_LOSS naming what
// is wrong, and is set aside; the daemon never crashes or allocates what the manifest claims.
// Found by the checkpoint fuzz target (tests/fuzz/checkpoint.cc; the input is in
// tests/fuzz/regressions/checkpoint/).
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "common/crc32c.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/storage/checkpoint.h"

namespace muond::server::checkpoint {
namespace {

using Json = nlohmann::json;

uint32_t Crc(const std::string& s) { return common::Crc32c(s.data(), s.size()); }

// Writes generation 1 into `dir`: one tensor "w" of `shape` claiming `data_bytes` bytes of data,
// header and manifest agreeing with each other and every checksum right. `header_shape`, when
// given, is the header's shape as JSON text instead.
void WriteGeneration(const std::string& dir, const Json& shape, uint64_t data_bytes,
                     const std::string& header_shape = "") {
  const std::string gen = dir + "/gen-000000000001";
  std::filesystem::create_directories(gen);
  std::string header = R"({"w": {"dtype": "F32", "shape": )" +
                       (header_shape.empty() ? shape.dump() : header_shape) +
                       R"(, "data_offsets": [0, )" + std::to_string(data_bytes) + "]}}";
  header.resize((header.size() + 7) / 8 * 8, ' ');
  const uint64_t header_len = header.size();
  const std::string data(data_bytes, '\0');
  std::string payload(reinterpret_cast<const char*>(&header_len), 8);
  payload += header + data;
  Json manifest = {
      {"format", "muond-checkpoint"},
      {"format_version", 1},
      {"generation", 1},
      {"step", 5},
      {"created_unix_ms", 0},
      {"job", Json::parse(common::JobSpecToJson(*common::ParseJobSpecJson(
                  R"({"job_id": "j", "matrices": [{"name": "w", "shape": [1, 1]}]})")))},
      {"payload", "momentum.safetensors"},
      {"payload_bytes", payload.size()},
      {"payload_header_crc32c", Crc(header)},
      {"tensors",
       {{{"name", "w"},
         {"shape", shape},
         {"dtype", "float32"},
         {"data_offsets", {0, data_bytes}},
         {"crc32c", Crc(data)}}}}};
  manifest["checksum"] = Crc(manifest.dump());
  std::ofstream(gen + "/manifest.json") << manifest.dump();
  std::ofstream(gen + "/momentum.safetensors", std::ios::binary) << payload;
}

class CheckpointManifestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/muond-ckpt-manifest-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

// 2^62 + 1 elements of 4 bytes wrap to 4 bytes in 64 bits: the size check alone passed, and the
// load then tried to allocate 2^62 floats (std::length_error: the daemon died).
TEST_F(CheckpointManifestTest, ShapeWhoseByteSizeWrapsIsDataLossNotACrash) {
  WriteGeneration(dir_, Json::array({(uint64_t{1} << 62) + 1}), 4);
  Store store(dir_, 2);
  auto loaded = store.Load({});
  ASSERT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss) << loaded.status();
  EXPECT_NE(loaded.status().message().find("does not fit the payload"), std::string::npos)
      << loaded.status();
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/gen-000000000001.broken"));
}

// The same with the wrap spread over several dimensions, and a shape far larger than the file.
TEST_F(CheckpointManifestTest, ShapesLargerThanThePayloadAreDataLoss) {
  for (const Json& shape : {Json::array({uint64_t{1} << 32, uint64_t{1} << 30, 1}),
                            Json::array({uint64_t{1} << 40}), Json::array({3, 0})}) {
    SCOPED_TRACE(shape.dump());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    WriteGeneration(dir_, shape, 4);
    Store store(dir_, 2);
    EXPECT_EQ(store.Load({}).status().code(), absl::StatusCode::kDataLoss);
  }
}

// A manifest or a payload header nested thousands of levels deep (found by fuzzing: nlohmann::json
// copies and dumps recursively, and the stack overflowed before the checksum was checked).
TEST_F(CheckpointManifestTest, DeeplyNestedManifestIsDataLossNotACrash) {
  const std::string gen = dir_ + "/gen-000000000001";
  std::filesystem::create_directories(gen);
  std::ofstream(gen + "/manifest.json")
      << "{\"checksum\": 1, \"a\": " << std::string(200000, '[') << std::string(200000, ']') << "}";
  std::ofstream(gen + "/momentum.safetensors") << "x";
  Store store(dir_, 2);
  auto list = store.List();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 1u);
  EXPECT_NE((*list)[0].problem.find("nested deeper than 64 levels"), std::string::npos)
      << (*list)[0].problem;
  EXPECT_EQ(store.Load({}).status().code(), absl::StatusCode::kDataLoss);
}

// A manifest with a right checksum whose "format" or "format_version" has another JSON type (found
// by fuzzing: json::value threw type_error, uncaught, and listing the generations aborted).
TEST_F(CheckpointManifestTest, FormatFieldsOfAnotherTypeAreDataLossNotACrash) {
  for (const auto& [key, value] : std::vector<std::pair<std::string, Json>>{
           {"format", 7}, {"format_version", "1"}, {"format", Json::array()}}) {
    SCOPED_TRACE(key + " = " + value.dump());
    std::filesystem::remove_all(dir_);
    const std::string gen = dir_ + "/gen-000000000001";
    std::filesystem::create_directories(gen);
    Json manifest = {{"format", "muond-checkpoint"}, {"format_version", 1}, {"generation", 1},
                     {"step", 5}, {"created_unix_ms", 0}, {"payload_bytes", 1}};
    manifest[key] = value;
    manifest["checksum"] = Crc(manifest.dump());
    std::ofstream(gen + "/manifest.json") << manifest.dump();
    std::ofstream(gen + "/momentum.safetensors") << "x";
    Store store(dir_, 2);
    auto list = store.List();
    ASSERT_TRUE(list.ok()) << list.status();
    ASSERT_EQ(list->size(), 1u);
    EXPECT_NE((*list)[0].problem.find("not a muond checkpoint of format version 1"),
              std::string::npos)
        << (*list)[0].problem;
    EXPECT_EQ(store.Load({}).status().code(), absl::StatusCode::kDataLoss);
  }
}

TEST_F(CheckpointManifestTest, DeeplyNestedPayloadHeaderIsDataLoss) {
  WriteGeneration(dir_, Json::array({1, 1}), 4,
                  std::string(200000, '[') + std::string(200000, ']'));
  Store store(dir_, 2);
  auto loaded = store.Load({});
  ASSERT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss) << loaded.status();
}

// Control: the same hand-made generation with a true shape loads.
TEST_F(CheckpointManifestTest, AHandMadeGenerationWithATrueShapeLoads) {
  WriteGeneration(dir_, Json::array({1, 1}), 4);
  Store store(dir_, 2);
  auto loaded = store.Load({});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->data.size(), 1u);
  EXPECT_EQ(loaded->data[0], std::vector<float>{0.f});
}

}  // namespace
}  // namespace muond::server::checkpoint
