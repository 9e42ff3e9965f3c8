// One user's (or one process's) flood of idle connections on the shared-memory socket does not
// refuse another's attach (issue 32, item 15; ShmLimits::max_pending_per_uid/_pid in
// server/api/shm_server.h). A forked child holds the flood: as uid 65534 (nobody) for the per-user
// bound, as root in a process of its own for the per-process bound. The flood is larger than the
// global limit (--max-shm-sessions): without per-peer bounds it takes every place and the other
// user's attach is refused RESOURCE_EXHAUSTED. With them the flood's connections beyond its bound
// are refused naming the bound, and the other user's attach and steps work while the flood holds.
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "tests/shm/shm_limits_util.h"

namespace muond::shmtest {
namespace {

constexpr uid_t kNobody = 65534;
constexpr gid_t kNogroup = 65534;

class ShmPeerPendingTest : public ShmLimitsTest {};

// A flood of idle connections held by a forked child until Release().
struct Flood {
  pid_t pid = -1;
  int release_fd = -1;        // closing it lets the child exit
  int held = 0;               // connections that got no answer (pending in the daemon)
  int refused = 0;            // connections answered at once
  std::string first_refusal;  // that answer (Outcome::ToString)
  int code = -1;              // its status code

  void Release() {
    if (release_fd >= 0) close(release_fd);
    release_fd = -1;
    if (pid > 0) waitpid(pid, nullptr, 0);
    pid = -1;
  }
  ~Flood() { Release(); }
};

// Forks a child that (as `uid`/`gid` when `uid` >= 0) opens `n` connections to `path` and sends
// nothing on them, then reports how many were answered (refused) within 1 s and holds the others
// until released.
void StartFlood(const std::string& path, int n, int uid, int gid, Flood& flood) {
  int report[2], release[2];
  ASSERT_EQ(pipe2(report, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(release, O_CLOEXEC), 0);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) {
    // Only system calls and plain library code from here (the parent has threads).
    close(report[0]);
    close(release[1]);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(127);
    if (uid >= 0 && (setgroups(0, nullptr) != 0 || setresgid(gid, gid, gid) != 0 ||
                     setresuid(uid, uid, uid) != 0)) {
      _exit(126);
    }
    std::vector<int> fds;
    for (int i = 0; i < n; ++i) fds.push_back(Connect(path));
    std::this_thread::sleep_for(std::chrono::seconds(1));
    int held = 0, refused = 0;
    Outcome first;
    for (int fd : fds) {
      if (fd < 0) continue;
      const Outcome o = Receive(fd, 0);
      if (o.kind == Outcome::kNothing) {
        ++held;
        continue;
      }
      if (refused++ == 0) first = o;
    }
    const std::string line =
        absl::StrCat(held, " ", refused, " ", first.code, " ", first.ToString(), "\n");
    ssize_t unused = write(report[1], line.data(), line.size());
    (void)unused;
    close(report[1]);
    char byte;
    unused = read(release[0], &byte, 1);  // EOF when the parent releases the flood
    _exit(0);
  }
  close(report[1]);
  close(release[0]);
  flood.pid = pid;
  flood.release_fd = release[1];
  std::string line;
  char buf[512];
  ssize_t got;
  while ((got = read(report[0], buf, sizeof(buf))) > 0) line.append(buf, got);
  close(report[0]);
  std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(' ', 3));
  ASSERT_EQ(parts.size(), 4u) << "the flood's child reported '" << line << "'";
  ASSERT_TRUE(absl::SimpleAtoi(parts[0], &flood.held));
  ASSERT_TRUE(absl::SimpleAtoi(parts[1], &flood.refused));
  ASSERT_TRUE(absl::SimpleAtoi(parts[2], &flood.code));
  flood.first_refusal = std::string(absl::StripSuffix(parts[3], "\n"));
}

// Lets every user reach the daemon's directory and shm socket (the test's own temporary
// directory; a deployment gives trainers the socket's group instead).
void OpenSocketToEveryone(const std::string& dir, const std::string& shm_path) {
  ASSERT_EQ(chmod(dir.c_str(), 0711), 0) << std::strerror(errno);
  ASSERT_EQ(chmod(shm_path.c_str(), 0666), 0) << std::strerror(errno);
}

// 48 idle connections from uid 65534 against --max-shm-sessions 32 and 8 per uid: 8 held, 40
// refused naming the per-user bound; root's attach (another user) works meanwhile.
TEST_F(ShmPeerPendingTest, OneUsersFloodDoesNotRefuseAnotherUsersAttach) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the flood as another uid";
  ASSERT_NO_FATAL_FAILURE(
      StartDaemon({"--max-shm-sessions", "32", "--shm-attach-timeout-seconds", "60",
                   "--max-shm-pending-per-uid", "8", "--max-shm-pending-per-pid", "8"}));
  std::unique_ptr<Victim> victim = NewVictim("victim", 2, 21);
  ASSERT_NO_FATAL_FAILURE(OpenSocketToEveryone(dir_.path(), ShmPath()));
  const int fds_before = DaemonFds(pid());

  Flood flood;
  ASSERT_NO_FATAL_FAILURE(StartFlood(ShmPath(), 48, kNobody, kNogroup, flood));
  std::cout << "flood from uid 65534: " << flood.held << " held, " << flood.refused
            << " refused; first refusal: " << flood.first_refusal << std::endl;
  EXPECT_EQ(flood.held, 8);
  EXPECT_EQ(flood.refused, 40);
  EXPECT_EQ(flood.code, static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_NE(flood.first_refusal.find("uid 65534 holds 8 shared-memory connections not attached "
                                     "yet, the limit per user (--max-shm-pending-per-uid 8)"),
            std::string::npos)
      << flood.first_refusal;
  EXPECT_EQ(Metric("muond_shm_pending_connections"), 8);
  EXPECT_EQ(Refused("peer_pending_limit"), 40);
  // The daemon holds one descriptor per held connection, none for the refused ones.
  EXPECT_EQ(WaitForFds(pid(), fds_before + 8, 2), fds_before + 8);

  // Another user (root) attaches and steps while the flood holds its connections.
  ASSERT_NO_FATAL_FAILURE(AttachVictim(*victim));
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "during the flood"));
  EXPECT_EQ(Refused("session_limit"), 0);
  const int fds_attached = DaemonFds(pid());

  flood.Release();
  double pending = -1;
  for (int i = 0; i < 50 && pending != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    pending = Metric("muond_shm_pending_connections");
  }
  EXPECT_EQ(pending, 0) << "the flood's connections were not all closed";
  // (A metrics scrape's connection may come and go meanwhile: at most, not exactly.)
  EXPECT_LE(WaitForFds(pid(), fds_attached - 8, 5), fds_attached - 8);
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "after the flood"));
}

// 48 idle connections from one root process against --max-shm-sessions 32, 32 per uid and 8 per
// pid: 8 held, 40 refused naming the per-process bound; this process (same uid, another pid)
// attaches meanwhile.
TEST_F(ShmPeerPendingTest, OneProcesssFloodDoesNotRefuseAnotherProcesssAttach) {
  ASSERT_NO_FATAL_FAILURE(
      StartDaemon({"--max-shm-sessions", "32", "--shm-attach-timeout-seconds", "60",
                   "--max-shm-pending-per-uid", "32", "--max-shm-pending-per-pid", "8"}));
  std::unique_ptr<Victim> victim = NewVictim("victim", 1, 22);
  Flood flood;
  ASSERT_NO_FATAL_FAILURE(StartFlood(ShmPath(), 48, -1, -1, flood));
  std::cout << "flood from pid " << flood.pid << ": " << flood.held << " held, " << flood.refused
            << " refused; first refusal: " << flood.first_refusal << std::endl;
  EXPECT_EQ(flood.held, 8);
  EXPECT_EQ(flood.refused, 40);
  EXPECT_NE(flood.first_refusal.find(
                absl::StrCat("pid ", flood.pid,
                             " holds 8 shared-memory connections not attached yet, the "
                             "limit per process (--max-shm-pending-per-pid 8)")),
            std::string::npos)
      << flood.first_refusal;
  ASSERT_NO_FATAL_FAILURE(AttachVictim(*victim));
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "during the flood"));
  EXPECT_EQ(Refused("peer_pending_limit"), 40);
  EXPECT_EQ(Refused("session_limit"), 0);
}

}  // namespace
}  // namespace muond::shmtest
