// A generation holds each array as the job holds it (job.json "state"; checkpoint.h, format):
// bfloat16 as BF16 values, int8 as its fp32 block scales then one code per element (U8), the
// masters float32. What a load returns, encoded again, is the job's held bytes bit for bit; the
// payload is the held size; a damaged code is found by its CRC32C.
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/optim/state_codec.h"
#include "server/storage/checkpoint.h"
#include "server/storage/durable_file.h"

namespace muond::server::checkpoint {
namespace {

using common::StateDType;

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/muond-ckpt-held-XXXXXX";
    path_ = ::mkdtemp(tmpl);
  }
  ~TempDir() { (void)durable::RemoveTree(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Apply mode: a Muon matrix of three blocks and a part (2048 * 3 + 100 elements), a small Muon
// matrix of less than a block, an AdamW vector.
common::JobSpec ApplySpec(StateDType momentum, StateDType adamw) {
  common::JobSpec spec;
  spec.job_id = "held";
  spec.mode = common::JobMode::kApply;
  spec.groups = {{"all", 1e-2, 0.01}};
  spec.matrices.push_back({"w", {62, 101}, 1, common::DType::kBFloat16});
  spec.matrices.push_back({"small", {7, 5}, 1, common::DType::kBFloat16});
  common::MatrixSpec bias{"bias", {300}, 1, common::DType::kBFloat16};
  bias.optimizer = common::Optimizer::kAdamW;
  spec.matrices.push_back(bias);
  for (common::MatrixSpec& m : spec.matrices) {
    m.group = "all";
    m.param_dtype = common::DType::kBFloat16;
  }
  spec.state.momentum = momentum;
  spec.state.adamw = adamw;
  return spec;
}

// State the job could hold, per array: as held (the words a snapshot hands the checkpoint writer)
// and decoded (what a load returns); the second moments non-negative.
struct HeldState {
  std::vector<std::vector<float>> held;
  std::vector<std::vector<float>> values;
};
HeldState HeldValues(const std::vector<StateTensor>& arrays, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  HeldState out;
  for (const StateTensor& t : arrays) {
    std::vector<float> x(t.numel());
    for (float& v : x) v = t.non_negative ? d(rng) * d(rng) * 1e-6f : d(rng) * 0.01f;
    std::vector<float> held(StoredWords(t.dtype, x.size()));
    const StateRole role = t.non_negative ? StateRole::kNonNegative : StateRole::kSigned;
    EncodeStoredAll(t.dtype, role, x.data(), x.size(), held.data());
    DecodeStoredAll(t.dtype, role, held.data(), x.size(), x.data());
    out.held.push_back(std::move(held));
    out.values.push_back(std::move(x));
  }
  return out;
}

nlohmann::json Manifest(const GenerationInfo& info) {
  std::ifstream f(info.path + "/manifest.json");
  return nlohmann::json::parse(f);
}

TEST(CheckpointHeldTest, EveryArrayIsStoredAsHeldAndLoadsBitForBit) {
  for (StateDType momentum : {StateDType::kBFloat16, StateDType::kInt8}) {
    for (StateDType adamw : {StateDType::kFloat32, StateDType::kBFloat16, StateDType::kInt8}) {
      SCOPED_TRACE(std::string("momentum ") + std::string(common::StateDTypeName(momentum)) +
                   ", adamw " + std::string(common::StateDTypeName(adamw)));
      const common::JobSpec spec = ApplySpec(momentum, adamw);
      ASSERT_TRUE(common::ValidateJobSpec(spec).ok()) << common::ValidateJobSpec(spec);
      const std::vector<StateTensor> arrays = StateTensors(spec);
      ASSERT_EQ(arrays.size(), 7u);
      const HeldState state = HeldValues(arrays, 3);
      const std::vector<std::vector<float>>& values = state.values;
      TempDir tmp;
      Store store(tmp.path() + "/ckpt", 3);
      auto info = store.Write(spec, 4,
                              [&](size_t a, std::vector<float>* out) {
                                *out = state.held[a];
                                return absl::OkStatus();
                              },
                              /*tensor_steps=*/{4, 4, 3});
      ASSERT_TRUE(info.ok()) << info.status();

      // The manifest names each array's form; the payload's data is the held size.
      const nlohmann::json manifest = Manifest(*info);
      uint64_t held_bytes = 0, fp32_bytes = 0;
      for (size_t a = 0; a < arrays.size(); ++a) {
        const nlohmann::json& e = manifest["tensors"][a];
        EXPECT_EQ(e["name"], arrays[a].name);
        EXPECT_EQ(e["dtype"], std::string(common::StateDTypeName(arrays[a].dtype)));
        if (arrays[a].dtype == StateDType::kInt8) {
          EXPECT_EQ(e["map"], arrays[a].non_negative ? "log" : "linear") << arrays[a].name;
          EXPECT_EQ(e["block"], common::kStateBlock);
        }
        const uint64_t bytes = common::StoredStateBytes(arrays[a].dtype, arrays[a].numel());
        EXPECT_EQ(e["data_offsets"][1].get<uint64_t>() - e["data_offsets"][0].get<uint64_t>(),
                  bytes)
            << arrays[a].name;
        held_bytes += bytes;
        fp32_bytes += 4 * arrays[a].numel();
      }
      EXPECT_EQ(arrays[0].dtype, StateDType::kFloat32) << "the masters stay fp32";
      EXPECT_EQ(arrays[1].dtype, momentum);
      EXPECT_EQ(arrays[6].dtype, adamw);
      EXPECT_TRUE(arrays[6].non_negative);
      EXPECT_LT(held_bytes, fp32_bytes);
      EXPECT_LT(info->bytes, fp32_bytes) << "the payload is the held size, not fp32";

      auto loaded = store.Load({});
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      ASSERT_EQ(loaded->data.size(), arrays.size());
      for (size_t a = 0; a < arrays.size(); ++a) {
        ASSERT_EQ(loaded->data[a].size(), values[a].size());
        EXPECT_EQ(0, std::memcmp(loaded->data[a].data(), values[a].data(),
                                 values[a].size() * sizeof(float)))
            << arrays[a].name << ": the load is not the held values";
      }
      EXPECT_EQ(loaded->tensor_steps, (std::vector<int64_t>{4, 4, 3}));
      EXPECT_EQ(loaded->spec.state.momentum, momentum);
      EXPECT_EQ(loaded->spec.state.adamw, adamw);
    }
  }
}

TEST(CheckpointHeldTest, UpdateModeInt8IsAQuarterOfFp32AndADamagedCodeIsDataLoss) {
  common::JobSpec spec;
  spec.job_id = "held-update";
  spec.matrices.push_back({"w", {64, 512}, 1, common::DType::kBFloat16});
  spec.state.momentum = StateDType::kInt8;
  const std::vector<StateTensor> arrays = StateTensors(spec);
  const HeldState state = HeldValues(arrays, 5);
  const std::vector<std::vector<float>>& values = state.values;
  TempDir tmp;
  Store store(tmp.path() + "/ckpt", 3);
  auto source = [&](size_t a, std::vector<float>* out) {
    *out = state.held[a];
    return absl::OkStatus();
  };
  auto first = store.Write(spec, 1, source);
  ASSERT_TRUE(first.ok()) << first.status();
  const uint64_t data = 64 * 512 + 4 * 16;  // codes + 16 block scales
  EXPECT_LT(first->bytes, data + 1024) << "header and data";
  EXPECT_GE(first->bytes, data);
  auto second = store.Write(spec, 2, source);
  ASSERT_TRUE(second.ok()) << second.status();

  // One code of the newest generation flipped: its CRC32C finds it, the generation is set aside
  // and the previous one loads.
  const nlohmann::json manifest = Manifest(*second);
  const std::string payload = second->path + "/momentum.safetensors";
  uint64_t header_len = 0;
  {
    std::ifstream f(payload, std::ios::binary);
    f.read(reinterpret_cast<char*>(&header_len), 8);
  }
  const uint64_t code =
      8 + header_len + manifest["tensors"][0]["data_offsets"][0].get<uint64_t>() + 4 * 16 + 1000;
  {
    std::fstream f(payload, std::ios::binary | std::ios::in | std::ios::out);
    f.seekg(static_cast<std::streamoff>(code));
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(static_cast<std::streamoff>(code));
    f.write(&c, 1);
  }
  auto loaded = store.Load({});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->info.generation, first->generation);
  ASSERT_EQ(loaded->set_aside.size(), 1u);
  EXPECT_EQ(0, std::memcmp(loaded->data[0].data(), values[0].data(), values[0].size() * 4));
  checkpoint::Selector newest;
  newest.generation = second->generation;
  EXPECT_EQ(store.Load(newest).status().code(), absl::StatusCode::kNotFound)
      << "set aside as .broken";
}

}  // namespace
}  // namespace muond::server::checkpoint
