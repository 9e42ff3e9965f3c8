// Full-state export and import (re-sharding across nodes, DESIGN.md 4c) with a real daemon: a job
// exported (live, and from a checkpoint generation) and re-created from the export at other world
// sizes and ZeRO stages continues bit-identically to the uninterrupted trajectory; every bad input
// (wrong job or token, no such generation, an existing file, a relative or empty directory, a
// tensor missing, another shape, another mode, a tensor in two files, files of two steps, damaged
// payload or manifest) is refused naming what and where, and changes nothing: no job is created,
// no file is replaced, the exported job goes on.
#include "common/state_export.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"

namespace muond::integration {
namespace {

namespace se = common::state_export;

common::JobSpec Spec(const std::string& id, int world, int stage) {
  common::JobSpec spec;
  spec.job_id = id;
  spec.world_size = world;
  spec.zero_stage = stage;
  spec.matrices = MixedMatrices(common::DType::kFloat32, common::DType::kFloat32);
  return spec;
}

MatrixBytes Steps(const MatrixBytes& all, int first, int count) {
  return MatrixBytes(all.begin() + first, all.begin() + first + count);
}

void ExpectRunsMatch(const common::JobSpec& spec, const std::vector<RankRun>& runs,
                     const MatrixBytes& want, int first) {
  ASSERT_EQ(runs.size(), static_cast<size_t>(spec.world_size));
  for (int r = 0; r < spec.world_size; ++r) {
    SCOPED_TRACE(absl::StrCat(spec.job_id, " rank ", r));
    for (size_t i = 0; i < runs[r].status.size(); ++i) {
      ASSERT_TRUE(runs[r].status[i].ok()) << "step " << first + i << ": " << runs[r].status[i];
      EXPECT_TRUE(SpansEqual(spec, runs[r].layout, runs[r].spans[i], want[first + i]))
          << "step " << first + i;
    }
  }
}

class StateExportTest : public ::testing::Test, protected OwnDaemon {
 protected:
  void SetUp() override { Start(); }
  void TearDown() override { Stop(); }
};

TEST_F(StateExportTest, ExportAndImportContinueBitIdentically) {
  constexpr int kSteps = 6;
  const common::JobSpec spec = Spec("a", 2, 2);
  const MatrixBytes grads = MakeGradients(spec.matrices, kSteps, 77);
  auto want = ReferenceTrajectory(*client_, "ref", spec, grads);
  ASSERT_TRUE(want.ok()) << want.status();
  auto token = client_->CreateJob(spec);
  ASSERT_TRUE(token.ok()) << token.status();
  const std::string& addr = daemon_->address();
  ExpectRunsMatch(spec, RunRanks(addr, "a", *token, 2, Steps(grads, 0, 3), false, 0), *want, 0);
  auto saved = client_->SaveCheckpoint("a", *token);
  ASSERT_TRUE(saved.ok()) << saved.status();

  // Live export at step 3: files by job name, the manifest lists the momentum of every matrix.
  auto live = client::ExportStateToDir(*client_, "a", *token, 0, -1, Dir("live"));
  ASSERT_TRUE(live.ok()) << live.status();
  EXPECT_EQ(live->step, 3);
  EXPECT_EQ(live->generation, 0);
  EXPECT_EQ(live->payload, Dir("live") + "/a.safetensors");
  auto m = se::ParseManifest(ReadWholeFile(live->manifest), live->manifest);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->step, 3);
  EXPECT_EQ(m->mode, common::JobMode::kUpdate);
  ASSERT_EQ(m->arrays.size(), spec.matrices.size());
  for (size_t i = 0; i < spec.matrices.size(); ++i) {
    EXPECT_EQ(m->arrays[i].name, spec.matrices[i].name);
    EXPECT_EQ(m->arrays[i].shape, spec.matrices[i].shape);
  }
  // One more step on the job; the generation saved at step 3 exports the same state.
  ExpectRunsMatch(spec, RunRanks(addr, "a", *token, 2, Steps(grads, 3, 1), false, 3), *want, 3);
  auto gen = client::ExportStateToDir(*client_, "a", *token, 0, 3, Dir("gen"));
  ASSERT_TRUE(gen.ok()) << gen.status();
  EXPECT_EQ(gen->step, 3);
  EXPECT_EQ(gen->generation, saved->generation());
  EXPECT_EQ(ReadWholeFile(gen->payload), ReadWholeFile(live->payload));

  // Re-created at other world sizes and stages from either export: steps 3.. as uninterrupted.
  struct Case {
    std::string id, dir;
    int world, stage;
  };
  for (const Case& c :
       {Case{"b", Dir("live"), 3, 3}, Case{"c", Dir("gen"), 1, 0}, Case{"d", Dir("live"), 4, 1}}) {
    const common::JobSpec other = Spec(c.id, c.world, c.stage);
    auto t = client_->CreateJobFromExport(other, c.dir);
    ASSERT_TRUE(t.ok()) << t.status();
    auto st = client_->GetJob(c.id, *t);
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->next_step(), 3);
    ExpectRunsMatch(other, RunRanks(addr, c.id, *t, c.world, Steps(grads, 3, kSteps - 3), true, 3),
                    *want, 3);
  }
  // ref, a and the three imported jobs.
  auto list = client_->ListJobs();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->size(), 5u);
}

// Copies the files of export `from` into directory `to` (created), under their own names.
void CopyExport(const std::string& from, const std::string& to) {
  std::filesystem::create_directories(to);
  for (const auto& e : std::filesystem::directory_iterator(from)) {
    std::filesystem::copy_file(e.path(), to + "/" + e.path().filename().string());
  }
}

// Damaged copies of export `files` (a step-2 export of job "a"), beside its directory: in
// bitflip/ one bit of the payload's data, in manifest/ one digit of the manifest (its step), in
// short/ the payload truncated.
void CopyDamaged(const client::StateExportFiles& files) {
  const std::filesystem::path from = std::filesystem::path(files.payload).parent_path();
  const std::string root = from.parent_path().string();
  const std::string payload = ReadWholeFile(files.payload);
  CopyExport(from.string(), root + "/bitflip");
  std::string flipped = payload;
  flipped[flipped.size() - 5] ^= 0x10;
  WriteWholeFile(root + "/bitflip/a.safetensors", flipped);
  CopyExport(from.string(), root + "/manifest");
  std::string text = ReadWholeFile(files.manifest);
  const size_t at = text.find("\"step\": 2");
  ASSERT_NE(at, std::string::npos);
  text[at + 8] = '1';
  WriteWholeFile(root + "/manifest/a.manifest.json", text);
  CopyExport(from.string(), root + "/short");
  WriteWholeFile(root + "/short/a.safetensors", payload.substr(0, payload.size() - 8));
}

// Export requests that cannot be served: wrong job, wrong token, no such generation (nothing left
// behind), files already there (unchanged).
TEST_F(StateExportTest, BadExportRequestsAreRefusedAndLeaveNothing) {
  const common::JobSpec spec = Spec("a", 1, 0);
  auto token = client_->CreateJob(spec);
  ASSERT_TRUE(token.ok()) << token.status();
  ASSERT_TRUE(
      RunRanks(daemon_->address(), "a", *token, 1, MakeGradients(spec.matrices, 1, 5), false, 0)[0]
          .status[0]
          .ok());
  auto good = client::ExportStateToDir(*client_, "a", *token, 0, -1, Dir("good"));
  ASSERT_TRUE(good.ok()) << good.status();
  const std::string payload = ReadWholeFile(good->payload);
  auto s = client::ExportStateToDir(*client_, "nope", *token, 0, -1, Dir("x")).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  s = client::ExportStateToDir(*client_, "a", std::string(64, 'f'), 0, -1, Dir("x")).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  s = client::ExportStateToDir(*client_, "a", *token, 9, -1, Dir("x")).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_FALSE(std::filesystem::exists(Dir("x")));  // a failed export leaves nothing behind
  s = client::ExportStateToDir(*client_, "a", *token, 0, -1, Dir("good")).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_NE(std::string(s.message()).find(good->payload), std::string::npos) << s.message();
  EXPECT_EQ(ReadWholeFile(good->payload), payload);
}

TEST_F(StateExportTest, BadInputIsRefusedNamingWhatAndWhereAndChangesNothing) {
  const common::JobSpec spec = Spec("a", 1, 0);
  const MatrixBytes grads = MakeGradients(spec.matrices, 3, 5);
  auto token = client_->CreateJob(spec);
  ASSERT_TRUE(token.ok()) << token.status();
  const std::string& addr = daemon_->address();
  ASSERT_TRUE(RunRanks(addr, "a", *token, 1, Steps(grads, 0, 2), false, 0)[0].status[1].ok());
  auto good = client::ExportStateToDir(*client_, "a", *token, 0, -1, Dir("good"));
  ASSERT_TRUE(good.ok()) << good.status();
  const std::string payload = ReadWholeFile(good->payload);

  // Import refusals: (spec, dir, code, text the message names).
  common::JobSpec extra = Spec("n1", 1, 0);
  extra.matrices.push_back(Matrix("extra", {4, 4}));
  common::JobSpec reshaped = Spec("n2", 1, 0);
  reshaped.matrices[0].shape = {96, 64};
  auto apply = common::ParseJobSpecJson(
      R"({"job_id": "n3", "mode": "apply", "world_size": 1, "zero_stage": 0,
          "matrices": [{"name": "big", "shape": [64, 96], "optimizer": "muon", "group": "g"}],
          "groups": [{"name": "g", "lr": 0.01}]})");
  ASSERT_TRUE(apply.ok()) << apply.status();
  // A tensor in two files: the same export under a second name.
  CopyExport(Dir("good"), Dir("dup"));
  WriteWholeFile(Dir("dup/b.manifest.json"), ReadWholeFile(good->manifest));
  // Files of two steps: job "z" (other tensors) exported at step 0 next to "a" at step 2.
  common::JobSpec z = Spec("z", 1, 0);
  z.matrices = {Matrix("zz", {4, 4})};
  auto ztoken = client_->CreateJob(z);
  ASSERT_TRUE(ztoken.ok());
  CopyExport(Dir("good"), Dir("steps"));
  ASSERT_TRUE(client::ExportStateToDir(*client_, "z", *ztoken, 0, -1, Dir("steps")).ok());
  ASSERT_NO_FATAL_FAILURE(CopyDamaged(*good));
  std::filesystem::create_directories(Dir("empty"));
  struct Bad {
    common::JobSpec spec;
    std::string dir;
    absl::StatusCode code;
    std::string names;
  };
  const std::vector<Bad> bad = {
      {Spec("n0", 1, 0), "relative/dir", absl::StatusCode::kInvalidArgument, "absolute"},
      {Spec("n0", 1, 0), Dir("missing"), absl::StatusCode::kNotFound, Dir("missing")},
      {Spec("n0", 1, 0), Dir("empty"), absl::StatusCode::kNotFound, "manifest.json"},
      {extra, Dir("good"), absl::StatusCode::kInvalidArgument, "tensor 'extra'"},
      {reshaped, Dir("good"), absl::StatusCode::kInvalidArgument, "has shape [64, 96]"},
      {*apply, Dir("good"), absl::StatusCode::kInvalidArgument, "mode 'update'"},
      {Spec("n0", 1, 0), Dir("dup"), absl::StatusCode::kInvalidArgument, "is in both"},
      {Spec("n0", 1, 0), Dir("steps"), absl::StatusCode::kInvalidArgument, "different steps"},
      {Spec("n0", 1, 0), Dir("bitflip"), absl::StatusCode::kDataLoss, "CRC32C"},
      {Spec("n0", 1, 0), Dir("manifest"), absl::StatusCode::kDataLoss, "checksum"},
      {Spec("n0", 1, 0), Dir("short"), absl::StatusCode::kDataLoss, "a.safetensors"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.dir);
    auto t = client_->CreateJobFromExport(b.spec, b.dir);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), b.code) << t.status();
    EXPECT_NE(std::string(t.status().message()).find(b.names), std::string::npos)
        << t.status().message();
    // Nothing was created.
    EXPECT_EQ(client_->GetJob(b.spec.job_id, "").status().code(), absl::StatusCode::kNotFound);
  }
  // The exported job goes on as before; a good import of the same id works after the refusals.
  auto st = client_->GetJob("a", *token);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->next_step(), 2);
  EXPECT_FALSE(st->fenced());
  auto t = client_->CreateJobFromExport(Spec("n0", 1, 0), Dir("good"));
  ASSERT_TRUE(t.ok()) << t.status();
  auto runs = RunRanks(addr, "n0", *t, 1, Steps(grads, 2, 1), false, 2);
  auto same = RunRanks(addr, "a", *token, 1, Steps(grads, 2, 1), false, 2);
  ASSERT_TRUE(runs[0].status[0].ok()) << runs[0].status[0];
  ASSERT_TRUE(same[0].status[0].ok()) << same[0].status[0];
  EXPECT_EQ(runs[0].spans[0], same[0].spans[0]);
}

TEST_F(StateExportTest, MuonctlExportsAndCreatesFromTheExport) {
  const common::JobSpec spec = Spec("a", 1, 0);
  const MatrixBytes grads = MakeGradients(spec.matrices, 2, 9);
  auto token = client_->CreateJob(spec);
  ASSERT_TRUE(token.ok()) << token.status();
  const std::string& addr = daemon_->address();
  ASSERT_TRUE(RunRanks(addr, "a", *token, 1, Steps(grads, 0, 1), false, 0)[0].status[0].ok());
  const std::map<std::string, std::string> env = {{"MUOND_JOB_TOKEN", *token}};
  ProcessResult r =
      RunMuonctl(addr, {"checkpoint", "export", "--job", "a", "--dir", Dir("cli")}, env);
  ASSERT_TRUE(r.exited && r.exit_code == 0) << r.err;
  EXPECT_NE(r.out.find("exported job a live state at step 1: 5 tensors"), std::string::npos)
      << r.out;
  // Again into the same directory: ALREADY_EXISTS (exit 6), the files untouched.
  const std::string before = ReadWholeFile(Dir("cli/a.safetensors"));
  r = RunMuonctl(addr, {"checkpoint", "export", "--job", "a", "--dir", Dir("cli")}, env);
  EXPECT_EQ(r.exit_code, 6) << r.err;
  EXPECT_EQ(ReadWholeFile(Dir("cli/a.safetensors")), before);
  r = RunMuonctl(addr, {"checkpoint", "export", "--job", "a"}, env);
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_NE(r.err.find("--dir"), std::string::npos) << r.err;
  // A destination reached through a symbolic link is refused (PERMISSION_DENIED, exit 7), and
  // nothing is written where the link points.
  ASSERT_EQ(::symlink(Dir("").c_str(), Dir("link").c_str()), 0);
  r = RunMuonctl(addr, {"checkpoint", "export", "--job", "a", "--dir", Dir("link/via")}, env);
  EXPECT_EQ(r.exit_code, 7) << r.err;
  EXPECT_NE(r.err.find("is a symbolic link"), std::string::npos) << r.err;
  struct stat via {};
  EXPECT_NE(::stat(Dir("via/a.safetensors").c_str(), &via), 0) << "written through the link";
  // job create --import-dir: the new job (world 2, stage 3) expects step 1.
  common::JobSpec other = Spec("b", 2, 3);
  WriteWholeFile(Dir("b.json"), common::JobSpecToJson(other));
  r = RunMuonctl(addr, {"job", "create", "--spec", Dir("b.json"), "--import-dir", Dir("cli"),
                        "--token-file", Dir("b.token")});
  ASSERT_TRUE(r.exited && r.exit_code == 0) << r.err;
  std::string b_token = ReadWholeFile(Dir("b.token"));
  ASSERT_FALSE(b_token.empty());
  b_token.pop_back();  // the file's newline
  auto st = client_->GetJob("b", b_token);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->next_step(), 1);
  // The import shows as an operation of the new job, like a save or a load.
  auto ops = client_->GetProgress("b", b_token);
  ASSERT_TRUE(ops.ok()) << ops.status();
  bool imported = false;
  for (const auto& op : *ops) {
    if (op.kind() != "import") continue;
    imported = true;
    EXPECT_TRUE(op.done());
    EXPECT_EQ(op.error(), "");
    EXPECT_GT(op.bytes_total(), 0u);
    EXPECT_EQ(op.bytes_done(), op.bytes_total());
  }
  EXPECT_TRUE(imported) << "no import operation in GetProgress";
  r = RunMuonctl(
      addr,
      {"job", "create", "--spec", Dir("b.json"), "--import-dir", Dir("cli"), "--restore-from", "a"},
      env);
  EXPECT_EQ(r.exit_code, 3) << r.err;
}

// A hand-made export file of job `job`: AdamW tensor "e" (rows [offset, offset + rows) of 8, 2
// columns; full 0: the whole tensor), its three arrays filled with (row * 10 + column + slot / 4),
// and `steps` AdamW steps.
void WriteRowsExport(const std::string& dir, const std::string& job, int64_t offset,
                     int64_t rows, int64_t full, int64_t steps = 3) {
  se::Manifest m;
  m.job_id = job;
  m.mode = common::JobMode::kApply;
  m.step = 5;
  m.payload = job + se::kPayloadSuffix;
  std::string data;
  int slot = 0;
  for (const char* name : {"master/e", "exp_avg/e", "exp_avg_sq/e"}) {
    se::Array a{name, "e", {rows, 2}};
    a.row_offset = full > 0 ? offset : 0;
    a.full_rows = full;
    std::vector<float> v;
    for (int64_t r = offset; r < offset + rows; ++r) {
      for (int c = 0; c < 2; ++c) v.push_back(static_cast<float>(r * 10 + c) + slot / 4.0f);
    }
    a.crc32c = common::Crc32c(v.data(), v.size() * sizeof(float));
    data.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
    m.arrays.push_back(a);
    ++slot;
  }
  m.tensor_steps = {{"e", steps}};
  se::LayOut(&m);
  std::filesystem::create_directories(dir);
  WriteWholeFile(dir + "/" + m.payload, se::PayloadHeader(m) + data);
  WriteWholeFile(dir + "/" + job + se::kManifestSuffix, se::ManifestToJson(m));
}

// The job spec of a node job holding rows [offset, offset + rows) of "e" (full 0: all 8 rows).
common::JobSpec RowsJob(const std::string& id, int64_t offset, int64_t rows, int64_t full) {
  auto spec = common::ParseJobSpecJson(absl::StrCat(
      R"({"job_id": ")", id, R"(", "mode": "apply", "world_size": 1, "zero_stage": 0,
          "tensors": [{"name": "e", "shape": [)", rows, R"(, 2], "optimizer": "adamw")",
      full > 0 ? absl::StrCat(R"(, "rows": {"offset": )", offset, R"(, "of": )", full, "}") : "",
      R"(}], "groups": [{"name": "adamw", "lr": 0.001}],
          "multinode": {"global_job_id": "g", "node": 0, "nodes": 2}})"));
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

// Rows of a tensor split across nodes (the ownership plan) are taken from whichever files hold
// them: a job holding rows [2, 6) takes [2, 4) of one file's [0, 4) and [4, 6) of another's
// [4, 8); a whole tensor is put together from the pieces.
TEST_F(StateExportTest, RowsOfASplitTensorImportFromOtherCuts) {
  WriteRowsExport(Dir("cut"), "g.node0", 0, 4, 8);
  WriteRowsExport(Dir("cut"), "g.node1", 4, 4, 8);
  const auto expect_rows = [&](const std::string& job, const std::string& token, int64_t first,
                               int64_t rows) {
    auto out = client::ExportStateToDir(*client_, job, token, 0, -1, Dir("check-" + job));
    ASSERT_TRUE(out.ok()) << out.status();
    auto m = se::ParseManifest(ReadWholeFile(out->manifest), out->manifest);
    ASSERT_TRUE(m.ok()) << m.status();
    const std::string payload = ReadWholeFile(out->payload);
    const size_t header = se::PayloadHeader(*m).size();
    ASSERT_EQ(m->arrays.size(), 3u);
    for (size_t slot = 0; slot < 3; ++slot) {
      const se::Array& a = m->arrays[slot];
      EXPECT_EQ(a.shape, (std::vector<int64_t>{rows, 2}));
      for (int64_t r = 0; r < rows; ++r) {
        for (int c = 0; c < 2; ++c) {
          float v = 0;
          std::memcpy(&v, payload.data() + header + a.begin + ((r * 2 + c) * sizeof(float)), 4);
          EXPECT_EQ(v, static_cast<float>((first + r) * 10 + c) + slot / 4.0f)
              << job << " " << a.name << " row " << first + r;
        }
      }
    }
  };
  auto token = client_->CreateJobFromExport(RowsJob("middle", 2, 4, 8), Dir("cut"));
  ASSERT_TRUE(token.ok()) << token.status();
  expect_rows("middle", *token, 2, 4);
  token = client_->CreateJobFromExport(RowsJob("whole", 0, 8, 0), Dir("cut"));
  ASSERT_TRUE(token.ok()) << token.status();
  expect_rows("whole", *token, 0, 8);
  // The export of a job holding rows writes them as rows of the whole tensor.
  auto exported = se::ParseManifest(ReadWholeFile(Dir("check-middle/middle.manifest.json")), "M");
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(exported->arrays[0].row_offset, 2);
  EXPECT_EQ(exported->arrays[0].full_rows, 8);
}

// Rows a job cannot take: a gap, an overlap, a whole array beside rows of it, step counts that
// differ, another tensor's rows and a damaged piece (even where no row of it is taken) are
// refused naming the tensor, the rows and the files, and create nothing.
TEST_F(StateExportTest, RowsOfASplitTensorRefusedImports) {
  WriteRowsExport(Dir("cut"), "g.node0", 0, 4, 8);
  WriteRowsExport(Dir("cut"), "g.node1", 4, 4, 8);
  struct Bad {
    std::string dir;
    absl::StatusCode code;
    std::string phrase;
  };
  WriteRowsExport(Dir("gap"), "g.node0", 0, 4, 8);
  WriteRowsExport(Dir("overlap"), "g.node0", 0, 4, 8);
  WriteRowsExport(Dir("overlap"), "g.node1", 3, 5, 8);
  WriteRowsExport(Dir("whole-and-rows"), "a.node0", 0, 8, 0);
  WriteRowsExport(Dir("whole-and-rows"), "b.node1", 4, 4, 8);
  WriteRowsExport(Dir("steps"), "g.node0", 0, 4, 8, 3);
  WriteRowsExport(Dir("steps"), "g.node1", 4, 4, 8, 4);
  WriteRowsExport(Dir("other-rows"), "g.node0", 0, 4, 9);
  WriteRowsExport(Dir("other-rows"), "g.node1", 4, 5, 9);
  CopyExport(Dir("cut"), Dir("damaged"));
  {
    std::string p = ReadWholeFile(Dir("damaged/g.node1.safetensors"));
    p[p.size() - 1] ^= 1;  // the last row of exp_avg_sq/e: row 7, which the job does not take
    WriteWholeFile(Dir("damaged/g.node1.safetensors"), p);
  }
  const Bad bad[] = {
      {Dir("gap"), absl::StatusCode::kInvalidArgument,
       "no file there holds rows [4, 6) of tensor 'master/e' (8 rows; the job holds [2, 6))"},
      {Dir("overlap"), absl::StatusCode::kInvalidArgument,
       "tensor 'exp_avg/e' is in both " + Dir("overlap/g.node0.manifest.json") + " and " +
           Dir("overlap/g.node1.manifest.json") + " (rows [0, 4) of 8 and [3, 8) of 8)"},
      {Dir("whole-and-rows"), absl::StatusCode::kInvalidArgument, "tensor 'exp_avg/e' is in both"},
      {Dir("steps"), absl::StatusCode::kInvalidArgument,
       "tensor 'e' has taken 4 AdamW steps there and 3 in another file"},
      {Dir("other-rows"), absl::StatusCode::kInvalidArgument,
       "tensor 'master/e' has shape [9, 2], job 'refused' has [8, 2] (whole tensors)"},
      {Dir("damaged"), absl::StatusCode::kDataLoss,
       "g.node1.safetensors: tensor 'exp_avg_sq/e': CRC32C mismatch"},
  };
  for (const Bad& b : bad) {
    auto s = client_->CreateJobFromExport(RowsJob("refused", 2, 4, 8), b.dir).status();
    EXPECT_EQ(s.code(), b.code) << s;
    EXPECT_NE(std::string(s.message()).find(b.phrase), std::string::npos)
        << s.message() << "\n(wanted: " << b.phrase << ")";
  }
  auto jobs = client_->ListJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  for (const auto& j : *jobs) EXPECT_NE(j.spec().job_id(), "refused");
}

}  // namespace
}  // namespace muond::integration
