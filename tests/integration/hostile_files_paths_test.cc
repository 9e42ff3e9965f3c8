// Paths a job's creator names (init_from, import_dir) are resolved without following a symbolic
// link in any component, and checked on what was opened (server/jobs/creator_path.h): a link as
// the last component or in a parent is refused naming it, a file or directory the creator could
// not read is refused, a plain path works.
#include <sys/stat.h>
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/job_spec.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/hostile_util.h"

namespace muond::integration {
namespace {

constexpr uid_t kNobody = 65534;

// An apply-mode job of one 8x4 Muon matrix "w".
common::JobSpec ApplyJob(const std::string& id) {
  common::JobSpec spec;
  spec.job_id = id;
  spec.world_size = 1;
  spec.zero_stage = 0;
  spec.mode = common::JobMode::kApply;
  spec.groups = {{"muon", 0.02, 0.01}};
  common::MatrixSpec m;
  m.name = "w";
  m.shape = {8, 4};
  m.optimizer = common::Optimizer::kMuon;
  m.group = "muon";
  m.dtype = common::DType::kFloat32;
  m.param_dtype = common::DType::kFloat32;
  spec.matrices.push_back(m);
  return spec;
}

void WriteModel(const std::string& path) {
  static const std::vector<float> w(32, 0.25f);
  const common::TensorRef ref{
      "w",
      common::DType::kFloat32,
      {8, 4},
      std::string_view(reinterpret_cast<const char*>(w.data()), w.size() * sizeof(float))};
  ASSERT_TRUE(common::WriteSafetensorsFile(path, {ref}).ok()) << path;
  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
}

void MakeDir(const std::string& path, mode_t mode) {
  ASSERT_EQ(::mkdir(path.c_str(), mode), 0) << path;
  ASSERT_EQ(::chmod(path.c_str(), mode), 0) << path;
}

// `status` is `code` and its message names each of `wanted`.
void ExpectRefused(const absl::Status& status, absl::StatusCode code,
                   const std::vector<std::string>& wanted) {
  EXPECT_EQ(status.code(), code) << status;
  for (const std::string& w : wanted) {
    EXPECT_NE(status.message().find(w), std::string::npos) << "wanted '" << w << "' in " << status;
  }
  std::cout << "refused: " << status << "\n";
}

class HostileFilesPathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(::chmod(files_.path().c_str(), 0755), 0);
    // Open to the other uid of the tests run as root (the daemon's state dir is its own).
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
    auto d = DaemonProcess::StartIn(dir_.path(), {"--metrics-address", "off"});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    auto c = client::Client::Connect(daemon_->address());
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }
  void TearDown() override {
    if (daemon_ != nullptr) {
      EXPECT_EQ(daemon_->Stop(), 0) << daemon_->Log();
    }
  }

  TempDir dir_;    // the daemon's
  TempDir files_;  // the creator's (0755)
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::Client> client_;
};

TEST_F(HostileFilesPathTest, InitFromFollowsNoSymbolicLink) {
  // files/real/model.safetensors; files/link.safetensors -> it; files/dirlink -> files/real.
  const std::string real = files_.File("real");
  MakeDir(real, 0755);
  const std::string model = real + "/model.safetensors";
  WriteModel(model);
  ASSERT_EQ(::symlink(model.c_str(), files_.File("link.safetensors").c_str()), 0);
  ASSERT_EQ(::symlink(real.c_str(), files_.File("dirlink").c_str()), 0);
  int n = 0;
  auto create = [&](const std::string& path) {
    common::JobSpec spec = ApplyJob(absl::StrCat("from-", ++n));
    spec.init_from = path;
    return client_->CreateJob(spec);
  };
  // A plain path works.
  auto ok = create(model);
  ASSERT_TRUE(ok.ok()) << ok.status();
  // A link as the last component, and in a parent component.
  ExpectRefused(create(files_.File("link.safetensors")).status(),
                absl::StatusCode::kPermissionDenied,
                {files_.File("link.safetensors"), "is a symbolic link"});
  ExpectRefused(create(files_.File("dirlink/model.safetensors")).status(),
                absl::StatusCode::kPermissionDenied,
                {files_.File("dirlink"), "is a symbolic link"});
  // Missing: NOT_FOUND, naming the missing directory when it is a parent.
  ExpectRefused(create(files_.File("absent.safetensors")).status(), absl::StatusCode::kNotFound,
                {files_.File("absent.safetensors"), "No such file"});
  ExpectRefused(create(files_.File("nodir/model.safetensors")).status(),
                absl::StatusCode::kNotFound, {files_.File("nodir") + ": open: No such file"});
  // "..": the path is resolved as named, never through a parent.
  ExpectRefused(create(real + "/../real/model.safetensors").status(),
                absl::StatusCode::kInvalidArgument, {"'..'"});
  // /proc/self is a (magic) link: the daemon's own descriptors are out of reach.
  ExpectRefused(create("/proc/self/root" + model).status(), absl::StatusCode::kPermissionDenied,
                {"/proc/self", "is a symbolic link"});
  // Nothing refused was made.
  auto jobs = client_->ListJobsWithBroken();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_EQ(jobs->jobs_size(), 1);
}

TEST_F(HostileFilesPathTest, InitFromTheCreatorCannotReadIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another uid";
  // root's private file in an open directory, and root's open file in a private directory.
  const std::string secret = files_.File("secret.safetensors");
  WriteModel(secret);
  ASSERT_EQ(::chmod(secret.c_str(), 0600), 0);
  const std::string closed = files_.File("closed");
  MakeDir(closed, 0700);
  WriteModel(closed + "/model.safetensors");
  // A link the creator owns, to the private directory (stat() through it saw root's directory).
  const std::string mine = files_.File("mine");
  MakeDir(mine, 0755);
  ASSERT_EQ(::chown(mine.c_str(), kNobody, kNobody), 0);
  ASSERT_EQ(::symlink(closed.c_str(), (mine + "/link").c_str()), 0);
  ASSERT_EQ(::lchown((mine + "/link").c_str(), kNobody, kNobody), 0);
  ASSERT_EQ(::chmod(daemon_->socket_path().c_str(), 0666), 0);
  int n = 0;
  auto create_as_nobody = [&](const std::string& path) {
    common::JobSpec spec = ApplyJob(absl::StrCat("nobody-", ++n));
    spec.init_from = path;
    const std::string spec_file = files_.File(spec.job_id + ".json");
    WriteWholeFile(spec_file, common::JobSpecToJson(spec));
    ::chmod(spec_file.c_str(), 0644);
    pid_t pid = 0;
    return RunAs(
        kNobody, kNobody,
        {MUONCTL_BIN, "--address", daemon_->address(), "job", "create", "--spec", spec_file}, &pid);
  };
  auto expect = [](const ProcessResult& r, const std::vector<std::string>& wanted) {
    EXPECT_EQ(r.exit_code, 7) << "PERMISSION_DENIED wanted: " << r.out << r.err;
    for (const std::string& w : wanted) {
      EXPECT_NE(r.err.find(w), std::string::npos) << "wanted '" << w << "' in " << r.err;
    }
    std::cout << "refused as uid 65534: " << r.err;
  };
  expect(create_as_nobody(secret), {secret, "neither owned by the job's creator"});
  expect(create_as_nobody(closed + "/model.safetensors"),
         {"directory " + closed, "neither owned by the job's creator"});
  expect(create_as_nobody(mine + "/link/model.safetensors"), {mine + "/link", "symbolic link"});
  // The same file, world-readable in an open directory: created.
  const std::string open_model = files_.File("open.safetensors");
  WriteModel(open_model);
  const ProcessResult r = create_as_nobody(open_model);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
}

TEST_F(HostileFilesPathTest, ImportDirFollowsNoSymbolicLink) {
  // An export of a stepped job in files/real/export.
  const common::JobSpec source = OneMatrixJob("source");
  auto token = client_->CreateJob(source);
  ASSERT_TRUE(token.ok()) << token.status();
  ASSERT_TRUE(StepOnce(*client_, "source", *token).ok());
  const std::string real = files_.File("real");
  MakeDir(real, 0755);
  const std::string exported = real + "/export";
  auto files = client::ExportStateToDir(*client_, "source", *token, 0, -1, exported);
  ASSERT_TRUE(files.ok()) << files.status();
  ASSERT_EQ(::chmod(exported.c_str(), 0755), 0);
  ASSERT_EQ(::symlink(exported.c_str(), files_.File("link").c_str()), 0);
  ASSERT_EQ(::symlink(real.c_str(), files_.File("dirlink").c_str()), 0);
  int n = 0;
  auto import = [&](const std::string& dir) {
    return client_->CreateJobFromExport(OneMatrixJob(absl::StrCat("import-", ++n)), dir);
  };
  ExpectRefused(import(files_.File("link")).status(), absl::StatusCode::kPermissionDenied,
                {files_.File("link"), "is a symbolic link"});
  ExpectRefused(import(files_.File("dirlink/export")).status(), absl::StatusCode::kPermissionDenied,
                {files_.File("dirlink"), "is a symbolic link"});
  auto ok = import(exported);
  EXPECT_TRUE(ok.ok()) << ok.status();
}

}  // namespace
}  // namespace muond::integration
