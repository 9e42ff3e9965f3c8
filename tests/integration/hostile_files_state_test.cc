// The state directory is the daemon user's alone: a directory left 0750 with a file 0640 (an
// older muond's modes, readable by the socket's group) is repaired at start with a log line per
// path, and every directory and file the daemon writes afterwards (job records, checkpoint
// generations, reset records) is 0700 / 0600. Symbolic links in it are neither followed nor
// changed.
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/hostile_util.h"

namespace muond::integration {
namespace {

mode_t ModeOf(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

// Every directory and regular file under `root` (root included) with its mode.
std::vector<std::pair<std::string, struct stat>> Walk(const std::string& root) {
  static std::vector<std::pair<std::string, struct stat>>* out = nullptr;
  std::vector<std::pair<std::string, struct stat>> found;
  out = &found;
  EXPECT_EQ(::nftw(
                root.c_str(),
                [](const char* path, const struct stat* st, int, struct FTW*) {
                  out->emplace_back(path, *st);
                  return 0;
                },
                16, FTW_PHYS),
            0);
  out = nullptr;
  return found;
}

TEST(HostileFilesStateTest, StateDirectoryIsRepairedAndStaysPrivate) {
  TempDir dir;
  const std::string state = dir.File("state");
  // An older daemon's modes: 0750 directories, 0640 files.
  ASSERT_EQ(::mkdir(state.c_str(), 0750), 0);
  ASSERT_EQ(::chmod(state.c_str(), 0750), 0);
  ASSERT_EQ(::mkdir((state + "/jobs").c_str(), 0750), 0);
  ASSERT_EQ(::chmod((state + "/jobs").c_str(), 0750), 0);
  WriteWholeFile(state + "/notes.txt", "an operator's notes\n");
  ASSERT_EQ(::chmod((state + "/notes.txt").c_str(), 0640), 0);
  // A link to a file outside: neither followed nor changed.
  WriteWholeFile(dir.File("outside.txt"), "not the daemon's\n");
  ASSERT_EQ(::chmod(dir.File("outside.txt").c_str(), 0644), 0);
  ASSERT_EQ(::symlink(dir.File("outside.txt").c_str(), (state + "/outside-link").c_str()), 0);

  auto daemon = DaemonProcess::StartIn(dir.path(), {"--metrics-address", "off"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string log = (*daemon)->Log();
  for (const std::string& want :
       {absl::StrCat("state directory: ", state,
                     " was open to others (mode 0750); repaired to 0700"),
        absl::StrCat("state directory: ", state,
                     "/jobs was open to others (mode 0750); repaired to 0700"),
        absl::StrCat("state directory: ", state,
                     "/notes.txt was open to others (mode 0640); repaired to 0600")}) {
    EXPECT_NE(log.find(want), std::string::npos) << "wanted '" << want << "' in the log:\n" << log;
  }
  std::cout << log.substr(0, log.find("serving on"));
  EXPECT_EQ(ModeOf(state), 0700u);
  EXPECT_EQ(ModeOf(state + "/jobs"), 0700u);
  EXPECT_EQ(ModeOf(state + "/notes.txt"), 0600u);
  EXPECT_EQ(ModeOf(dir.File("outside.txt")), 0644u) << "the link's target was changed";

  // Everything the daemon writes from here on: a job, a checkpoint generation, a reset record.
  auto client = client::Client::Connect((*daemon)->address());
  ASSERT_TRUE(client.ok()) << client.status();
  auto token = (*client)->CreateJob(OneMatrixJob("private"));
  ASSERT_TRUE(token.ok()) << token.status();
  ASSERT_TRUE(StepOnce(**client, "private", *token).ok());
  auto saved = (*client)->SaveCheckpoint("private", *token);
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_TRUE((*client)->ResetJob("private", *token, 3).ok());
  int dirs = 0, files = 0;
  for (const auto& [path, st] : Walk(state)) {
    if (S_ISDIR(st.st_mode)) {
      ++dirs;
      EXPECT_EQ(st.st_mode & 07777, 0700u) << path;
    } else if (S_ISREG(st.st_mode)) {
      ++files;
      EXPECT_EQ(st.st_mode & 07777, 0600u) << path;
    }
  }
  std::cout << dirs << " directories 0700, " << files << " files 0600 under " << state << "\n";
  EXPECT_GE(dirs, 5);   // state, jobs, jobs/private, its checkpoints, a generation
  EXPECT_GE(files, 5);  // notes.txt, job.json, the generation's manifest and payload, reset.json
  EXPECT_EQ((*daemon)->Stop(), 0) << (*daemon)->Log();
}

TEST(HostileFilesStateTest, StateDirectoryThatCannotBeMadePrivateStopsTheStart) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run the daemon as another uid";
  constexpr uid_t kNobody = 65534;
  TempDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  ASSERT_EQ(::chown(dir.path().c_str(), kNobody, kNobody), 0);
  const std::string state = dir.File("state");
  ASSERT_EQ(::mkdir(state.c_str(), 0700), 0);
  ASSERT_EQ(::chown(state.c_str(), kNobody, kNobody), 0);
  // Another user's file, readable by its group: the daemon (as nobody) cannot change its mode.
  const std::string foreign = state + "/foreign.txt";
  WriteWholeFile(foreign, "root's\n");
  ASSERT_EQ(::chmod(foreign.c_str(), 0640), 0);
  pid_t pid = 0;
  const ProcessResult r =
      RunAs(kNobody, kNobody,
            {MUOND_BIN, "--listen", "unix://" + dir.File("muond.sock"), "--state-dir", state,
             "--threads", "1", "--metrics-address", "off"},
            &pid, 60);
  std::cout << "muond as uid 65534: "
            << r.err.substr(r.err.rfind("muond: ") == std::string::npos ? 0
                                                                        : r.err.rfind("muond: "));
  EXPECT_TRUE(r.exited && r.exit_code == 1) << DescribeWaitStatus(r.exit_code) << r.err;
  for (const std::string& want : {"--state-dir " + state, std::string("cannot make it private"),
                                  "chmod " + foreign, std::string("Operation not permitted")}) {
    EXPECT_NE(r.err.find(want), std::string::npos) << "wanted '" << want << "' in " << r.err;
  }
  EXPECT_EQ(ModeOf(foreign), 0640u);
  struct stat st {};
  EXPECT_NE(::lstat(dir.File("muond.sock").c_str(), &st), 0) << "it listened";
}

}  // namespace
}  // namespace muond::integration
