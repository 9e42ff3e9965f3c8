// The daemon process itself: flags and config file, exit codes, the socket's life, and SIGTERM
// (DESIGN.md section 9; `muond --help`). Each test starts its own muond where it needs one.
#include <sys/stat.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/layout.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/reference_data.h"

namespace muond::integration {
namespace {

bool ExitedZero(int status) { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }

TEST(LifecycleTest, SigtermWithoutStepsExitsZeroAndRemovesTheSocket) {
  TempDir dir;
  auto daemon = DaemonProcess::StartIn(dir.path());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string socket = (*daemon)->socket_path();
  struct stat st;
  ASSERT_EQ(::lstat(socket.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u) << "the socket is for the daemon's user and group";
  ASSERT_EQ(::stat((dir.path() + "/state").c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  // A job with a committed step: nothing is in flight at SIGTERM.
  auto client = client::Client::Connect((*daemon)->address());
  ASSERT_TRUE(client.ok());
  auto token = (*client)->CreateJob(WholeMatrixJob("j", "wide_std", {CaseMatrix("wide_std", "w")}));
  ASSERT_TRUE(token.ok()) << token.status();
  auto session = (*client)->Attach("j", 0, *token);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->StepTensors(0, {RefGrad("wide_std", 0, "w")}).ok());

  const auto start = std::chrono::steady_clock::now();
  const int status = (*daemon)->Stop();
  EXPECT_TRUE(ExitedZero(status)) << DescribeWaitStatus(status) << "\n" << (*daemon)->Log();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5))
      << "an idle daemon must not wait out the grace period";
  EXPECT_FALSE(std::filesystem::exists(socket)) << "the socket file outlived the daemon";
  EXPECT_NE((*daemon)->Log().find("muond stopped"), std::string::npos) << (*daemon)->Log();
  EXPECT_FALSE((*client)->Health(1).ok());
}

TEST(LifecycleTest, SecondDaemonOnTheSameSocketFailsAndTheFirstKeepsServing) {
  TempDir dir;
  auto first = DaemonProcess::StartIn(dir.path());
  ASSERT_TRUE(first.ok()) << first.status();
  const ProcessResult second = RunProcess({MUOND_BIN, "--listen", (*first)->address(),
                                           "--state-dir", dir.path() + "/state2", "--threads", "1"},
                                          {}, 20);
  EXPECT_TRUE(second.exited) << "timed out: " << second.timed_out << " signal " << second.signal;
  EXPECT_NE(second.exit_code, 0);
  // Exactly one error line, the last one (informational log lines may precede it).
  const std::vector<std::string> lines = absl::StrSplit(second.err, '\n', absl::SkipEmpty());
  ASSERT_FALSE(lines.empty());
  int error_lines = 0;
  for (const std::string& line : lines) error_lines += absl::StartsWith(line, "muond: ");
  EXPECT_EQ(error_lines, 1) << second.err;
  EXPECT_TRUE(absl::StartsWith(lines.back(), "muond: ")) << second.err;
  EXPECT_NE(lines.back().find("another process serves"), std::string::npos) << second.err;
  EXPECT_NE(lines.back().find((*first)->socket_path()), std::string::npos) << second.err;
  auto client = client::Client::Connect((*first)->address());
  ASSERT_TRUE(client.ok());
  EXPECT_TRUE((*client)->Health(5).ok());
  const int status = (*first)->Stop();
  EXPECT_TRUE(ExitedZero(status)) << DescribeWaitStatus(status) << "\n" << (*first)->Log();
  EXPECT_FALSE(std::filesystem::exists((*first)->socket_path()));
}

TEST(LifecycleTest, StaleSocketFileIsReplaced) {
  TempDir dir;
  {
    auto d = DaemonProcess::StartIn(dir.path());
    ASSERT_TRUE(d.ok()) << d.status();
    ::kill((*d)->pid(), SIGKILL);  // a crash leaves the socket file behind
    ASSERT_TRUE((*d)->WaitExit(10));
  }
  ASSERT_TRUE(std::filesystem::exists(dir.path() + "/muond.sock"));
  auto d = DaemonProcess::StartIn(dir.path());
  ASSERT_TRUE(d.ok()) << d.status();
  const int status = (*d)->Stop();
  EXPECT_TRUE(ExitedZero(status)) << DescribeWaitStatus(status) << "\n" << (*d)->Log();
}

TEST(LifecycleTest, HelpExitsZeroAndNamesTheFlags) {
  const ProcessResult r = RunProcess({MUOND_BIN, "--help"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (const char* flag : {"--listen", "--state-dir", "--backend", "--config", "--threads"}) {
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag << " missing from:\n" << r.out;
  }
}

TEST(LifecycleTest, BadConfigurationExits2WithOneLine) {
  TempDir dir;
  const std::string listen = "unix://" + dir.File("muond.sock");
  const std::string state = dir.File("state");
  WriteWholeFile(dir.File("bad.conf"), "# comment\nlisten = " + listen + "\ncolour = blue\n");
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--backend", "nosuch"}, "nosuch"},
      {{"--listen", "unix://relative.sock"}, "--listen"},
      {{"--state-dir", "relative"}, "--state-dir"},
      {{"--threads", "many"}, "--threads"},
      {{"--frobnicate", "1"}, "frobnicate"},
      {{"positional"}, "positional"},
      {{"--config", dir.File("bad.conf")}, "bad.conf:3"},
      {{"--config", dir.File("missing.conf")}, "missing.conf"},
  };
  for (const auto& [flags, want] : cases) {
    SCOPED_TRACE(flags[0]);
    std::vector<std::string> argv = {MUOND_BIN, "--listen", listen, "--state-dir", state};
    argv.insert(argv.end(), flags.begin(), flags.end());
    const ProcessResult r = RunProcess(argv, {}, 20);
    EXPECT_TRUE(r.exited);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(CountLines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(want), std::string::npos) << r.err;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.File("muond.sock")));
}

TEST(LifecycleTest, ConfigFileSetsListenAndStateDir) {
  TempDir dir;
  const std::string socket = dir.File("from-config.sock");
  WriteWholeFile(dir.File("muond.conf"),
                 "# muond test config\n"
                 "listen = unix://" +
                     socket +
                     "\n"
                     "state-dir = " +
                     dir.File("state-from-config") +
                     "   # trailing comment\n"
                     "threads = 1\n"
                     "log-level = warning\n"
                     "\n"
                     "backend = cpu\n");
  auto d = DaemonProcess::Spawn({"--config", dir.File("muond.conf")}, dir.File("muond.log"));
  ASSERT_TRUE(d.ok()) << d.status();
  absl::Status s = (*d)->WaitServing("unix://" + socket);
  ASSERT_TRUE(s.ok()) << s << "\n" << (*d)->Log();
  EXPECT_TRUE(std::filesystem::is_directory(dir.File("state-from-config")));
  EXPECT_EQ((*d)->Log().find(" I "), std::string::npos)
      << "log-level = warning should silence info lines:\n"
      << (*d)->Log();
  const int status = (*d)->Stop();
  EXPECT_TRUE(ExitedZero(status)) << DescribeWaitStatus(status) << "\n" << (*d)->Log();
  EXPECT_FALSE(std::filesystem::exists(socket));
}

// SIGTERM while rank 0 waits for a rank that never comes: after the grace period the step is
// ended with an error for rank 0 and the daemon still exits 0 (it must not hang).
TEST(LifecycleTest, SigtermWithRankWaitingEndsAfterGracePeriod) {
  TempDir dir;
  auto d = DaemonProcess::StartIn(dir.path(), {"--shutdown-grace-seconds", "1"});
  ASSERT_TRUE(d.ok()) << d.status();
  auto client = client::Client::Connect((*d)->address());
  ASSERT_TRUE(client.ok());
  common::JobSpec spec = WholeMatrixJob("ws2", "wide_std", {CaseMatrix("wide_std", "w")});
  spec.world_size = 2;
  spec.zero_stage = 3;
  auto token = (*client)->CreateJob(spec);
  ASSERT_TRUE(token.ok()) << token.status();
  auto rank0 = (*client)->Attach("ws2", 0, *token);
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  const std::vector<float> grad = RefTensor("wide_std", 0, "grad");
  std::vector<float> update(grad.size());
  absl::Status rank0_status = absl::UnknownError("not run");
  std::thread rank0_thread([&] {
    const common::ShardSpan span = (*rank0)->spans().at(0);
    auto r = (*rank0)->Step(0, {{0, span.offset, grad.data() + span.offset, span.length}},
                            {{0, span.offset, update.data() + span.offset, span.length}});
    rank0_status = r.ok() ? absl::OkStatus() : r.status();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto start = std::chrono::steady_clock::now();
  const int status = (*d)->Stop(15);
  const auto took = std::chrono::steady_clock::now() - start;
  rank0_thread.join();
  EXPECT_TRUE(ExitedZero(status)) << DescribeWaitStatus(status) << "\n" << (*d)->Log();
  EXPECT_LT(took, std::chrono::seconds(8)) << "grace 1 s, but the daemon took longer to stop";
  EXPECT_FALSE(rank0_status.ok());
  EXPECT_TRUE(rank0_status.code() == absl::StatusCode::kAborted ||
              rank0_status.code() == absl::StatusCode::kUnavailable ||
              rank0_status.code() == absl::StatusCode::kCancelled)
      << rank0_status;
}

}  // namespace
}  // namespace muond::integration
