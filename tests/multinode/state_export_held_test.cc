// Full-state exports of compressed state (job.json "state"; README "Compressed state") with a real
// daemon: an export holds each array as the job holds it (bfloat16 as BF16, int8 as one U8 array
// of its block scales and codes, the manifest saying dtype, map and block), or decoded to float32
// when asked (`--dtype float32`); a held export of the live state and of a checkpoint generation
// are the same bytes; importing either form into a job of the same dtypes continues the
// uninterrupted trajectory bit for bit, at another world size and ZeRO stage; importing into an
// fp32 job converts (the held export and the float32 one give that job the same bits). Bad
// compressed payloads are refused naming the file, tensor and what: a negative or non-finite
// block scale, a bf16 value that is not finite; no job is created. (The manifest's held forms:
// state_export_manifest_test.cc.)
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "common/state_export.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"

namespace muond::integration {
namespace {

namespace se = common::state_export;

common::JobSpec Spec(const std::string& id, int world, int stage, common::StateDType momentum) {
  common::JobSpec spec;
  spec.job_id = id;
  spec.world_size = world;
  spec.zero_stage = stage;
  spec.state.momentum = momentum;
  spec.matrices = MixedMatrices(common::DType::kFloat32, common::DType::kFloat32);
  return spec;
}

MatrixBytes Steps(const MatrixBytes& all, int first, int count) {
  return MatrixBytes(all.begin() + first, all.begin() + first + count);
}

// Runs steps [first, first + grads.size()) of job `id` and returns rank 0's update spans per step
// as whole matrices (world 1) or checks them against `want` (any world).
void ExpectRunsMatch(const std::string& addr, const common::JobSpec& spec, const std::string& token,
                     const MatrixBytes& grads, const MatrixBytes& want, int first) {
  const std::vector<RankRun> runs =
      RunRanks(addr, spec.job_id, token, spec.world_size, grads, false, first);
  ASSERT_EQ(runs.size(), static_cast<size_t>(spec.world_size));
  for (int r = 0; r < spec.world_size; ++r) {
    SCOPED_TRACE(absl::StrCat(spec.job_id, " rank ", r));
    ASSERT_EQ(runs[r].status.size(), grads.size());
    for (size_t i = 0; i < runs[r].status.size(); ++i) {
      ASSERT_TRUE(runs[r].status[i].ok()) << "step " << first + i << ": " << runs[r].status[i];
      EXPECT_TRUE(SpansEqual(spec, runs[r].layout, runs[r].spans[i], want[first + i]))
          << "step " << first + i;
    }
  }
}

// The held export `live` of `spec`'s job: every array in the job's dtype, the payload the header
// plus the held bytes, the manifest naming the dtype (int8: the map and block), the safetensors
// header the stored dtype. *payload: its bytes; *fp32_bytes: what the arrays take as float32.
void ExpectHeldExport(const common::JobSpec& spec, const client::StateExportFiles& live,
                      std::string* payload, uint64_t* fp32_bytes) {
  const common::StateDType held = spec.state.momentum;
  auto m = se::ParseManifest(ReadWholeFile(live.manifest), live.manifest);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->arrays.size(), spec.matrices.size());
  uint64_t held_bytes = 0;
  for (size_t i = 0; i < spec.matrices.size(); ++i) {
    EXPECT_EQ(m->arrays[i].dtype, held) << m->arrays[i].name;
    EXPECT_FALSE(m->arrays[i].non_negative) << m->arrays[i].name;  // momentum: the linear map
    EXPECT_EQ(m->arrays[i].shape, spec.matrices[i].shape);
    const uint64_t n = static_cast<uint64_t>(spec.matrices[i].numel());
    EXPECT_EQ(m->arrays[i].end - m->arrays[i].begin, common::StoredStateBytes(held, n));
    held_bytes += common::StoredStateBytes(held, n);
    *fp32_bytes += 4 * n;
  }
  EXPECT_EQ(m->payload_bytes, se::PayloadHeader(*m).size() + held_bytes);
  EXPECT_EQ(std::filesystem::file_size(live.payload), m->payload_bytes);
  const std::string text = ReadWholeFile(live.manifest);
  EXPECT_NE(
      text.find(absl::StrCat("\"dtype\": \"", std::string(common::StateDTypeName(held)), "\"")),
      std::string::npos)
      << text;
  if (held == common::StateDType::kInt8) {
    EXPECT_NE(text.find("\"map\": \"linear\""), std::string::npos) << text;
    EXPECT_NE(text.find("\"block\": 2048"), std::string::npos) << text;
  }
  // The safetensors header names the stored dtype.
  *payload = ReadWholeFile(live.payload);
  const char* st_dtype = held == common::StateDType::kInt8 ? "\"U8\"" : "\"BF16\"";
  EXPECT_NE(payload->substr(0, se::PayloadHeader(*m).size()).find(st_dtype), std::string::npos);
}

class StateExportHeldTest : public ::testing::TestWithParam<common::StateDType>,
                            protected OwnDaemon {
 protected:
  void SetUp() override { Start(); }
  void TearDown() override { Stop(); }
};

TEST_P(StateExportHeldTest, ExportsHoldTheStateAsHeldAndImportsContinue) {
  constexpr int kSteps = 5;
  const common::StateDType held = GetParam();
  const common::JobSpec spec = Spec("a", 2, 2, held);
  const MatrixBytes grads = MakeGradients(spec.matrices, kSteps, 31);
  auto want = ReferenceTrajectory(*client_, "ref", spec, grads);
  ASSERT_TRUE(want.ok()) << want.status();
  auto token = client_->CreateJob(spec);
  ASSERT_TRUE(token.ok()) << token.status();
  const std::string& addr = daemon_->address();
  ExpectRunsMatch(addr, spec, *token, Steps(grads, 0, 3), *want, 0);
  auto saved = client_->SaveCheckpoint("a", *token);
  ASSERT_TRUE(saved.ok()) << saved.status();

  // Held: every array in the job's dtype; the payload the header plus the held bytes.
  auto live = client::ExportStateToDir(*client_, "a", *token, 0, -1, Dir("held"));
  ASSERT_TRUE(live.ok()) << live.status();
  uint64_t fp32_bytes = 0;
  std::string payload;
  ASSERT_NO_FATAL_FAILURE(ExpectHeldExport(spec, *live, &payload, &fp32_bytes));

  // Decoded on request: float32 arrays, 4 bytes an element; muonctl --dtype float32 the same.
  auto f32 = client::ExportStateToDir(*client_, "a", *token, 0, -1, Dir("f32"), {}, true);
  ASSERT_TRUE(f32.ok()) << f32.status();
  auto mf = se::ParseManifest(ReadWholeFile(f32->manifest), f32->manifest);
  ASSERT_TRUE(mf.ok()) << mf.status();
  for (const se::Array& a : mf->arrays) EXPECT_EQ(a.dtype, common::StateDType::kFloat32) << a.name;
  EXPECT_EQ(mf->payload_bytes, se::PayloadHeader(*mf).size() + fp32_bytes);
  const std::map<std::string, std::string> env = {{"MUOND_JOB_TOKEN", *token}};
  ProcessResult r = RunMuonctl(
      addr, {"checkpoint", "export", "--job", "a", "--dir", Dir("cli"), "--dtype", "float32"}, env);
  ASSERT_TRUE(r.exited && r.exit_code == 0) << r.err;
  EXPECT_EQ(ReadWholeFile(Dir("cli/a.safetensors")), ReadWholeFile(f32->payload));
  r = RunMuonctl(addr, {"checkpoint", "export", "--job", "a", "--dir", Dir("x"), "--dtype", "int4"},
                 env);
  EXPECT_EQ(r.exit_code, 3) << r.err;  // INVALID_ARGUMENT, before anything is asked
  EXPECT_NE(r.err.find("state export dtype 'int4'"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(Dir("x")));

  // One more step; the generation saved at step 3 exports the live export's bytes.
  ExpectRunsMatch(addr, spec, *token, Steps(grads, 3, 1), *want, 3);
  auto gen = client::ExportStateToDir(*client_, "a", *token, 0, 3, Dir("gen"));
  ASSERT_TRUE(gen.ok()) << gen.status();
  EXPECT_EQ(gen->generation, saved->generation());
  EXPECT_EQ(ReadWholeFile(gen->payload), payload);

  // Into jobs holding the same dtype, from either form, at other world sizes and stages: steps
  // 3.. bit for bit the uninterrupted trajectory.
  for (const auto& [id, dir, world, stage] :
       {std::tuple{"b", Dir("held"), 3, 3}, std::tuple{"c", Dir("f32"), 1, 0}}) {
    const common::JobSpec other = Spec(id, world, stage, held);
    auto t = client_->CreateJobFromExport(other, dir);
    ASSERT_TRUE(t.ok()) << t.status();
    ExpectRunsMatch(addr, other, *t, Steps(grads, 3, kSteps - 3), *want, 3);
  }
  // Into fp32 jobs: the held export converts to the same state as the decoded one.
  const common::JobSpec from_held = Spec("d", 1, 0, common::StateDType::kFloat32);
  const common::JobSpec from_f32 = Spec("e", 1, 0, common::StateDType::kFloat32);
  auto td = client_->CreateJobFromExport(from_held, Dir("held"));
  ASSERT_TRUE(td.ok()) << td.status();
  auto te = client_->CreateJobFromExport(from_f32, Dir("f32"));
  ASSERT_TRUE(te.ok()) << te.status();
  const std::vector<RankRun> d = RunRanks(addr, "d", *td, 1, Steps(grads, 3, 2), false, 3);
  const std::vector<RankRun> e = RunRanks(addr, "e", *te, 1, Steps(grads, 3, 2), false, 3);
  ASSERT_EQ(d[0].status.size(), 2u);
  ASSERT_EQ(e[0].status.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(d[0].status[i].ok()) << d[0].status[i];
    ASSERT_TRUE(e[0].status[i].ok()) << e[0].status[i];
    EXPECT_EQ(d[0].spans[i], e[0].spans[i]) << "step " << 3 + i;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, StateExportHeldTest,
                         ::testing::Values(common::StateDType::kBFloat16,
                                           common::StateDType::kInt8),
                         [](const auto& info) {
                           return std::string(common::StateDTypeName(info.param));
                         });

// A hand-made update-mode export of matrix "w" [4, 3] held as `dtype` (int8: linear) whose data
// is `data` (the held bytes), into `dir`.
void WriteHeldExport(const std::string& dir, common::StateDType dtype, const std::string& data,
                     bool log_map = false) {
  se::Manifest m;
  m.job_id = "h";
  m.mode = common::JobMode::kUpdate;
  m.step = 2;
  m.payload = std::string("h") + se::kPayloadSuffix;
  se::Array a{"w", "w", {4, 3}};
  a.dtype = dtype;
  a.non_negative = log_map;
  a.crc32c = common::Crc32c(data.data(), data.size());
  m.arrays.push_back(a);
  se::LayOut(&m);
  std::filesystem::create_directories(dir);
  WriteWholeFile(dir + "/" + m.payload, se::PayloadHeader(m) + data);
  WriteWholeFile(dir + "/h" + se::kManifestSuffix, se::ManifestToJson(m));
}

// int8 bytes of 12 elements: one block scale, then 12 codes.
std::string Int8Bytes(float scale, int8_t code) {
  std::string out(reinterpret_cast<const char*>(&scale), sizeof scale);
  out.append(12, static_cast<char>(code));
  return out;
}

// bf16 bytes of 12 elements, element 5 `bad` (the rest 1.0).
std::string Bf16Bytes(uint16_t bad) {
  std::vector<uint16_t> v(12, 0x3f80);
  v[5] = bad;
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 2);
}

class StateExportHeldInputTest : public ::testing::Test, protected OwnDaemon {
 protected:
  void SetUp() override { Start(); }
  void TearDown() override { Stop(); }
  common::JobSpec Job(const std::string& id) const {
    common::JobSpec spec;
    spec.job_id = id;
    spec.matrices = {Matrix("w", {4, 3})};
    return spec;
  }
};

TEST_F(StateExportHeldInputTest, BadCompressedArraysAreRefusedNamingWhatAndWhere) {
  // A good int8 and a good bf16 export import (the job's next step is the export's).
  WriteHeldExport(Dir("int8"), common::StateDType::kInt8, Int8Bytes(0.5f, 3));
  WriteHeldExport(Dir("bf16"), common::StateDType::kBFloat16, Bf16Bytes(0x4000));
  for (const char* good : {"int8", "bf16"}) {
    const std::string id = absl::StrCat("ok-", good);
    auto t = client_->CreateJobFromExport(Job(id), Dir(good));
    ASSERT_TRUE(t.ok()) << good << ": " << t.status();
    auto st = client_->GetJob(id, *t);
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->next_step(), 2);
  }
  struct Case {
    std::string dir;
    std::string bytes;
    common::StateDType dtype;
    absl::StatusCode code;
    std::string message;
  };
  const std::string payload = absl::StrCat(" h", se::kPayloadSuffix, ": tensor 'w'");
  for (const Case& c : std::vector<Case>{
           {"neg", Int8Bytes(-0.5f, 3), common::StateDType::kInt8, absl::StatusCode::kDataLoss,
            "tensor 'w' block 0: scale -0.5"},
           {"inf", Int8Bytes(INFINITY, 3), common::StateDType::kInt8, absl::StatusCode::kDataLoss,
            "tensor 'w' block 0: scale inf"},
           {"nan", Bf16Bytes(0x7fc0), common::StateDType::kBFloat16, absl::StatusCode::kDataLoss,
            "tensor 'w' element 5 is not finite"},
       }) {
    SCOPED_TRACE(c.dir);
    WriteHeldExport(Dir(c.dir), c.dtype, c.bytes);
    auto t = client_->CreateJobFromExport(Job("bad-" + c.dir), Dir(c.dir));
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), c.code) << t.status();
    EXPECT_NE(t.status().message().find(c.message), std::string::npos) << t.status();
    EXPECT_NE(t.status().message().find(Dir(c.dir)), std::string::npos) << t.status();
  }
  // A damaged held payload: its CRC32C.
  WriteHeldExport(Dir("crc"), common::StateDType::kInt8, Int8Bytes(0.5f, 3));
  std::string bytes = ReadWholeFile(Dir("crc/h.safetensors"));
  bytes.back() ^= 1;
  WriteWholeFile(Dir("crc/h.safetensors"), bytes);
  auto t = client_->CreateJobFromExport(Job("bad-crc"), Dir("crc"));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kDataLoss) << t.status();
  EXPECT_NE(t.status().message().find("CRC32C mismatch"), std::string::npos) << t.status();
  auto list = client_->ListJobs();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->size(), 2u) << "a refused import created a job";
}

}  // namespace
}  // namespace muond::integration
