// muonctl end to end: job.json in, safetensors gradients in, safetensors updates out, and its exit
// codes (0 ok, the gRPC code of a failure, 64 usage) with one-line errors on stderr.
#include <cstring>
#include <filesystem>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/reference_data.h"

namespace muond::integration {
namespace {

class MuonctlTest : public DaemonSuite {
 protected:
  void SetUp() override {
    DaemonSuite::SetUp();
    files_ = std::make_unique<TempDir>();
  }
  std::string File(const std::string& name) const { return files_->File(name); }

  // Writes a safetensors file of the tensors; returns its path.
  std::string WriteGrads(const std::string& name, const std::vector<client::NamedTensor>& tensors) {
    std::vector<common::TensorRef> refs;
    for (const client::NamedTensor& t : tensors) refs.push_back({t.name, t.dtype, t.shape, t.data});
    const std::string path = File(name);
    absl::Status s = common::WriteSafetensorsFile(path, refs);
    EXPECT_TRUE(s.ok()) << s;
    return path;
  }

  // Creates a job with one wide_std matrix "w" through muonctl; returns the token file.
  std::string CreateOneMatrixJob(const std::string& id) {
    WriteWholeFile(File(id + ".json"),
                   absl::StrCat(R"({"job_id": ")", id,
                                R"(", "matrices": [{"name": "w", "shape": [64, 256]}]})"));
    const std::string token_file = File(id + ".token");
    const ProcessResult r = RunMuonctl(
        address(), {"job", "create", "--spec", File(id + ".json"), "--token-file", token_file});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return token_file;
  }

  ProcessResult Step(const std::string& id, int step, const std::string& grads,
                     const std::string& out, const std::string& token_file) {
    return RunMuonctl(
        address(), {"step", "--job", id, "--rank", "0", "--step", std::to_string(step), "--grads",
                    grads, "--out", out, "--token-file", token_file});
  }

  // muonctl failed with `code`, one line on stderr containing each of `substrings`.
  static void ExpectFailure(const ProcessResult& r, int code,
                            const std::vector<std::string>& substrings) {
    EXPECT_TRUE(r.exited) << "signal " << r.signal;
    EXPECT_EQ(r.exit_code, code) << r.out << r.err;
    EXPECT_EQ(CountLines(r.err), 1) << r.err;
    for (const std::string& s : substrings) {
      EXPECT_NE(r.err.find(s), std::string::npos) << "wanted '" << s << "' in: " << r.err;
    }
  }

  std::unique_ptr<TempDir> files_;
};

// A step skipped for a non-finite gradient ("nonfinite": "skip"): exit 0, the line says so and
// names the next step, no OUT is written, and the next step runs.
TEST_F(MuonctlTest, SkippedStepWritesNoUpdate) {
  const std::string id = NewJobId("ctl-skip");
  WriteWholeFile(File(id + ".json"),
                 absl::StrCat(R"({"job_id": ")", id, R"(", "nonfinite": "skip", )",
                              R"("matrices": [{"name": "w", "shape": [64, 256]}]})"));
  const std::string token_file = File(id + ".token");
  ProcessResult r = RunMuonctl(
      address(), {"job", "create", "--spec", File(id + ".json"), "--token-file", token_file});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  client::NamedTensor bad = RefGrad("wide_std", 0, "w");
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(bad.data.data() + 8 * sizeof(float), &nan, sizeof(float));
  const std::string out = File("update.safetensors");
  r = Step(id, 0, WriteGrads("bad.safetensors", {bad}), out, token_file);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("step 0: job " + id), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("skipped"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("next step 1"), std::string::npos) << r.out;
  EXPECT_FALSE(std::filesystem::exists(out)) << "a skipped step wrote " << out;
  r = Step(id, 1, WriteGrads("good.safetensors", {RefGrad("wide_std", 0, "w")}), out, token_file);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.find("skipped"), std::string::npos) << r.out;
  auto got = common::SafetensorsFile::ReadFile(out);
  ASSERT_TRUE(got.ok()) << got.status();
  const common::TensorInfo* t = got->Find("w");
  ASSERT_NE(t, nullptr);
  // The momentum did not see the skipped step: step 1 gives reference step 0's update.
  EXPECT_TRUE(MatchesReferenceUpdate(ToFloats(t->dtype, std::string(got->Data(*t))), "wide_std",
                                     0, 1e-4));
}

TEST_F(MuonctlTest, HealthPrintsServing) {
  const ProcessResult r = RunMuonctl(address(), {"health"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "SERVING\n");
  // Nothing listens there: UNAVAILABLE (14).
  const ProcessResult down = RunMuonctl("unix://" + File("nobody.sock"), {"health"});
  ExpectFailure(down, 14, {"UNAVAILABLE"});
}

TEST_F(MuonctlTest, ThreeStepsFromJobJsonMatchReference) {
  const std::string id = NewJobId("ctl-traj");
  // job.json as documented in common/job_spec.h; the config is that of wide_std.
  WriteWholeFile(File("job.json"), absl::StrCat(R"({
    "job_id": ")",
                                                id, R"(",
    "world_size": 1, "zero_stage": 0,
    "muon": {"momentum": 0.95, "nesterov": true, "ns_method": "standard", "ns_steps": 5,
             "compute_dtype": "float32", "scale_mode": "original"},
    "matrices": [
      {"name": "blocks.0.attn.qkv", "shape": [128, 48], "num_heads": 4, "dtype": "float32"},
      {"name": "blocks.0.mlp.up", "shape": [64, 256]},
      {"name": "blocks.0.mlp.down", "shape": [256, 64]}
    ]})"));
  const std::string token_file = File("job.token");
  ProcessResult r = RunMuonctl(
      address(), {"job", "create", "--spec", File("job.json"), "--token-file", token_file});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find(id), std::string::npos) << r.out;
  EXPECT_EQ(ReadWholeFile(token_file).size(), 65u) << "64 hex characters and a newline";

  const std::vector<std::pair<std::string, std::string>> matrices = {
      {"blocks.0.mlp.down", "tall_std"},
      {"blocks.0.attn.qkv", "per_head"},
      {"blocks.0.mlp.up", "wide_std"}};
  std::string last_out;
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    std::vector<client::NamedTensor> grads;
    for (const auto& [name, c] : matrices) grads.push_back(RefGrad(c, step, name));
    const std::string in = WriteGrads(absl::StrCat("grads", step, ".safetensors"), grads);
    last_out = File(absl::StrCat("update", step, ".safetensors"));
    r = Step(id, step, in, last_out, token_file);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find(absl::StrCat("step ", step, ": job ", id)), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("replayed"), std::string::npos) << r.out;
    auto out = common::SafetensorsFile::ReadFile(last_out);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->tensors().size(), matrices.size());
    for (const auto& [name, c] : matrices) {
      const common::TensorInfo* t = out->Find(name);
      ASSERT_NE(t, nullptr) << name;
      EXPECT_EQ(t->dtype, common::DType::kFloat32) << name;
      EXPECT_EQ(t->shape, (std::vector<int64_t>{Case(c).rows, Case(c).cols})) << name;
      EXPECT_TRUE(
          MatchesReferenceUpdate(ToFloats(t->dtype, std::string(out->Data(*t))), c, step, 1e-4))
          << name;
    }
    EXPECT_EQ(out->metadata().count("step"), 1u);
  }
  // A retry of the last step: the same bytes, marked replayed.
  r = Step(id, 2, File("grads2.safetensors"), File("replay.safetensors"), token_file);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("(replayed)"), std::string::npos) << r.out;
  auto first = common::SafetensorsFile::ReadFile(last_out);
  auto again = common::SafetensorsFile::ReadFile(File("replay.safetensors"));
  ASSERT_TRUE(first.ok() && again.ok());
  for (const common::TensorInfo& t : first->tensors()) {
    const common::TensorInfo* u = again->Find(t.name);
    ASSERT_NE(u, nullptr) << t.name;
    EXPECT_EQ(first->Data(t), again->Data(*u)) << t.name << ": replay bytes differ";
  }

  // list, show, delete.
  r = RunMuonctl(address(), {"job", "list"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("JOB"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(id), std::string::npos) << r.out;
  r = RunMuonctl(address(), {"job", "show", "--job", id, "--token-file", token_file});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const std::string& want :
       {"job: " + id, std::string("next_step: 3"), std::string("steps_completed: 3"),
        std::string("fenced: no"), std::string("backend: cpu"),
        std::string("matrix: blocks.0.attn.qkv shape=[128, 48] num_heads=4 dtype=float32"),
        std::string("ns_method=standard ns_steps=5")}) {
    EXPECT_NE(r.out.find(want), std::string::npos) << "wanted '" << want << "' in:\n" << r.out;
  }
  r = RunMuonctl(address(), {"job", "delete", "--job", id, "--token-file", token_file});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("deleted job " + id), std::string::npos) << r.out;
  r = RunMuonctl(address(), {"job", "show", "--job", id, "--token-file", token_file});
  ExpectFailure(r, 5, {"NOT_FOUND", id});
  r = RunMuonctl(address(), {"job", "list"});
  EXPECT_EQ(r.out.find(id), std::string::npos) << r.out;
}

TEST_F(MuonctlTest, DuplicateAndUnknownJobs) {
  const std::string id = NewJobId("ctl-dup");
  const std::string token_file = CreateOneMatrixJob(id);
  ProcessResult r = RunMuonctl(
      address(), {"job", "create", "--spec", File(id + ".json"), "--token-file", File("t2")});
  ExpectFailure(r, 6, {"ALREADY_EXISTS", id});
  // The first job's token still works.
  r = RunMuonctl(address(), {"job", "show", "--job", id, "--token-file", token_file});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  r = RunMuonctl(address(), {"job", "show", "--job", "no-such-job", "--token-file", token_file});
  ExpectFailure(r, 5, {"NOT_FOUND", "no-such-job"});
}

TEST_F(MuonctlTest, MalformedFilesExitInvalidArgumentWithOneLine) {
  const std::string id = NewJobId("ctl-files");
  const std::string token_file = CreateOneMatrixJob(id);
  // Safetensors: a header length beyond the file, then plain garbage, then an empty file.
  std::string truncated(8, '\0');
  truncated[0] = static_cast<char>(200);
  truncated += R"({"w": {"dtype": "F32", "sha)";
  WriteWholeFile(File("truncated.safetensors"), truncated);
  WriteWholeFile(File("garbage.safetensors"), "this is not a safetensors file at all \x01\x02");
  WriteWholeFile(File("empty.safetensors"), "");
  for (const std::string name : {"truncated", "garbage", "empty"}) {
    SCOPED_TRACE(name);
    const std::string path = File(name + ".safetensors");
    ExpectFailure(Step(id, 0, path, File("out.safetensors"), token_file), 3,
                  {"INVALID_ARGUMENT", path});
  }
  ExpectFailure(Step(id, 0, File("missing.safetensors"), File("out.safetensors"), token_file), 5,
                {"NOT_FOUND", "missing.safetensors"});

  // job.json: bad syntax, an unknown field, a bad enum value, num_heads not dividing rows.
  const std::vector<std::pair<std::string, std::string>> specs = {
      {R"({"job_id": "x", "matrices": [)", ""},
      {R"({"job_id": "x", "matrices": [{"name": "w", "shape": [4, 4]}], "colour": 1})", "colour"},
      {R"({"job_id": "x", "muon": {"ns_method": "magic"}, "matrices": [{"name": "w", "shape": [4, 4]}]})",
       "magic"},
      {R"({"job_id": "x", "matrices": [{"name": "w", "shape": [64, 256], "num_heads": 5}]})",
       "num_heads"},
  };
  for (size_t i = 0; i < specs.size(); ++i) {
    SCOPED_TRACE(specs[i].first);
    const std::string path = File(absl::StrCat("bad", i, ".json"));
    WriteWholeFile(path, specs[i].first);
    ExpectFailure(RunMuonctl(address(), {"job", "create", "--spec", path}), 3,
                  {"INVALID_ARGUMENT", path, specs[i].second});
  }
  // The job never stepped and still works.
  const client::NamedTensor g = RefGrad("wide_std", 0, "w");
  ProcessResult r =
      Step(id, 0, WriteGrads("good.safetensors", {g}), File("out.safetensors"), token_file);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  ExpectStillServing();
}

TEST_F(MuonctlTest, ShapeDtypeMissingAndExtraTensorsNameTheTensor) {
  const std::string id = NewJobId("ctl-shape");
  const std::string token_file = CreateOneMatrixJob(id);
  const client::NamedTensor good = RefGrad("wide_std", 0, "w");
  const std::vector<std::pair<std::vector<client::NamedTensor>, std::vector<std::string>>> cases = {
      {{MakeTensor("w", {256, 64}, RefTensor("wide_std", 0, "grad"))},
       {"'w'", "[256, 64]", "[64, 256]"}},
      {{RefGrad("wide_std", 0, "w", common::DType::kBFloat16)}, {"'w'", "bfloat16", "float32"}},
      {{RefGrad("wide_std", 0, "v")}, {"'w'", "missing"}},
      {{good, RefGrad("wide_std", 0, "extra.weight")}, {"'extra.weight'", id}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    const std::string in = WriteGrads(absl::StrCat("bad", i, ".safetensors"), cases[i].first);
    std::vector<std::string> want = cases[i].second;
    want.push_back("INVALID_ARGUMENT");
    want.push_back(in);
    ExpectFailure(Step(id, 0, in, File("out.safetensors"), token_file), 3, want);
  }
  ProcessResult r =
      Step(id, 0, WriteGrads("good.safetensors", {good}), File("out.safetensors"), token_file);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto out = common::SafetensorsFile::ReadFile(File("out.safetensors"));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(MatchesReferenceUpdate(
      ToFloats(common::DType::kFloat32, std::string(out->Data(out->tensors()[0]))), "wide_std", 0,
      1e-4));
}

TEST_F(MuonctlTest, UsageErrorsExit64) {
  const std::vector<std::vector<std::string>> bad = {
      {}, {"frobnicate"}, {"job"}, {"health", "--colour", "red"}, {"health", "--job"}};
  for (const auto& args : bad) {
    SCOPED_TRACE(args.empty() ? "(none)" : args[0]);
    const ProcessResult r = RunMuonctl(address(), args);
    EXPECT_EQ(r.exit_code, 64) << r.err;
    EXPECT_EQ(CountLines(r.err), 1) << r.err;
  }
  const ProcessResult help = RunProcess({MUONCTL_BIN, "--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("Usage: muonctl"), std::string::npos) << help.out;
}

}  // namespace
}  // namespace muond::integration
