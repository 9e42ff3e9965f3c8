// The real muond under systemd's notification protocol, started as the unit starts it (with the
// sample config, deploy/muond.conf.sample, and test-local overrides) and $NOTIFY_SOCKET pointing
// at a socket this test binds:
//   - the first datagram is READY=1 with a STATUS naming the socket, and when it arrives the gRPC
//     socket serves (grpc.health.v1 SERVING), the shared-memory socket exists and the metrics
//     endpoint is bound (the log says where);
//   - with WATCHDOG_USEC=400000 it pings WATCHDOG=1 (at least 3 pings, >= 2 periods of 200 ms);
//   - on SIGTERM it sends STOPPING=1 and exits 0;
//   - when one part of it stops (a test hook, $MUOND_TEST_STALL: the compute executor in a task,
//     the job registry with its lock held, the shared-memory or metrics event loop), the pings
//     stop within the staleness window and the log names the part.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/deploy/notify_listener.h"

extern char** environ;

namespace muond::deploy_test {
namespace {

using Clock = std::chrono::steady_clock;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool IsSocket(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

// muond as the unit starts it: the sample config, with test-local overrides (the socket and state
// under `dir`, one thread, metrics on any free port).
std::vector<std::string> DaemonArgs(const std::string& dir, const std::string& socket) {
  return {MUOND_BIN,           "--config",         MUOND_SOURCE_DIR "/deploy/muond.conf.sample",
          "--listen",          "unix://" + socket, "--state-dir",
          dir + "/state",      "--threads",        "1",
          "--metrics-address", "127.0.0.1:0"};
}

// This process's environment without systemd's variables, then $NOTIFY_SOCKET pointing at
// `notify_socket` and a watchdog of 400 ms.
std::vector<std::string> NotifyEnvironment(const std::string& notify_socket) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string var = *e;
    if (absl::StartsWith(var, "NOTIFY_SOCKET=") || absl::StartsWith(var, "WATCHDOG_")) continue;
    env.push_back(var);
  }
  env.push_back("NOTIFY_SOCKET=" + notify_socket);
  env.push_back("WATCHDOG_USEC=400000");
  return env;
}

// Spawns `args` with environment `env`, stdin /dev/null and stdout and stderr appended to `log`;
// `pid` receives the child's id.
void Spawn(std::vector<std::string> args, std::vector<std::string> env, const std::string& log,
           pid_t& pid) {
  std::vector<char*> argv, envp;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  ASSERT_EQ(posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), envp.data()), 0);
  posix_spawn_file_actions_destroy(&actions);
}

// SIGKILLs and reaps the daemon if an assertion ends the test early.
struct Reaper {
  pid_t pid;
  bool reaped = false;
  ~Reaper() {
    if (!reaped) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
};

// READY comes first, naming the socket; by then every socket is bound and the gRPC socket serves.
// `client` receives the connection to it, kept by the caller while the daemon runs.
void ExpectReadyAndServing(NotifyListener& listener, const std::string& socket,
                           const std::string& log, std::unique_ptr<client::Client>& client) {
  // LibTorch's load and the binds take a few seconds on a slow machine.
  std::optional<std::string> ready = listener.Receive(60);
  ASSERT_TRUE(ready.has_value()) << "no notification within 60 s; log:\n" << ReadFile(log);
  EXPECT_EQ(*ready, "READY=1\nSTATUS=serving on unix://" + socket);
  // By then every socket is bound.
  EXPECT_TRUE(IsSocket(socket));
  EXPECT_TRUE(IsSocket(socket + ".shm"));
  EXPECT_NE(ReadFile(log).find("metrics on http://127.0.0.1:"), std::string::npos) << ReadFile(log);
  auto connected = client::Client::Connect("unix://" + socket);
  ASSERT_TRUE(connected.ok()) << connected.status();
  client = *std::move(connected);
  absl::Status health = client->Health(5);
  EXPECT_TRUE(health.ok()) << health;
}

// Watchdog pings every 200 ms: three of them, paced.
void ExpectWatchdogPings(NotifyListener& listener) {
  Clock::time_point first, last;
  for (int i = 0; i < 3; ++i) {
    std::optional<std::string> ping = listener.Receive(5);
    ASSERT_TRUE(ping.has_value()) << "no watchdog ping " << i;
    EXPECT_EQ(*ping, "WATCHDOG=1");
    (i == 0 ? first : last) = Clock::now();
  }
  // Two intervals of 200 ms; the first ping may have waited in the socket before it was read, so
  // the bound only says the pings are paced, not sent back to back.
  const double ms = std::chrono::duration<double, std::milli>(last - first).count();
  EXPECT_GE(ms, 300);
}

// SIGTERM: STOPPING=1 (pings may still come while it drains), then exit 0 within 30 s.
void ExpectStoppingAndExit0(NotifyListener& listener, const std::string& log, Reaper& reaper) {
  ASSERT_EQ(kill(reaper.pid, SIGTERM), 0);
  std::optional<std::string> stopping;
  for (int i = 0; i < 200; ++i) {
    stopping = listener.Receive(20);
    if (!stopping || *stopping != "WATCHDOG=1") break;
  }
  ASSERT_TRUE(stopping.has_value()) << "no STOPPING notification; log:\n" << ReadFile(log);
  EXPECT_EQ(*stopping, "STOPPING=1\nSTATUS=draining steps in flight");
  int status = 0;
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(30);
  pid_t done = 0;
  while ((done = waitpid(reaper.pid, &status, WNOHANG)) == 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(done, reaper.pid) << "muond did not exit within 30 s of SIGTERM";
  reaper.reaped = true;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "wait status " << status;
}

// A private directory for one daemon: its socket and log paths.
struct DaemonDir {
  std::string dir, socket, log;
  DaemonDir() {
    char tmpl[] = "/tmp/muond-sd.XXXXXX";
    EXPECT_NE(mkdtemp(tmpl), nullptr);
    dir = tmpl;
    socket = dir + "/muond.sock";
    log = dir + "/muond.log";
  }
  ~DaemonDir() { std::filesystem::remove_all(dir); }
};

TEST(DaemonNotifyTest, ReadyWatchdogAndStoppingFromTheRealDaemon) {
  const DaemonDir d;
  const std::string &dir = d.dir, &socket = d.socket, &log = d.log;
  NotifyListener listener;
  ASSERT_TRUE(listener.ok());

  pid_t pid = -1;
  ASSERT_NO_FATAL_FAILURE(
      Spawn(DaemonArgs(dir, socket), NotifyEnvironment(listener.address()), log, pid));
  Reaper reaper{pid};
  std::unique_ptr<client::Client> client;
  ASSERT_NO_FATAL_FAILURE(ExpectReadyAndServing(listener, socket, log, client));
  ASSERT_NO_FATAL_FAILURE(ExpectWatchdogPings(listener));
  ASSERT_NO_FATAL_FAILURE(ExpectStoppingAndExit0(listener, log, reaper));
}

// The ping proves progress: with one part of the daemon stopped for good, the pings stop.
class WatchdogStallTest : public ::testing::TestWithParam<const char*> {};

TEST_P(WatchdogStallTest, PingsStopWhenAPartStops) {
  const std::string part = GetParam();
  const DaemonDir d;
  const std::string &dir = d.dir, &socket = d.socket, &log = d.log;
  NotifyListener listener;
  ASSERT_TRUE(listener.ok());
  std::vector<std::string> env = NotifyEnvironment(listener.address());
  env.push_back("MUOND_TEST_STALL=" + part + ":2500");
  pid_t pid = -1;
  ASSERT_NO_FATAL_FAILURE(Spawn(DaemonArgs(dir, socket), env, log, pid));
  Reaper reaper{pid};
  std::unique_ptr<client::Client> client;
  ASSERT_NO_FATAL_FAILURE(ExpectReadyAndServing(listener, socket, log, client));
  if (ReadFile(log).find("stall armed") == std::string::npos) {
    GTEST_SKIP() << "muond was built without MUOND_TEST_HOOKS (no $MUOND_TEST_STALL)";
  }
  // Healthy first: pings while every part beats.
  ASSERT_NO_FATAL_FAILURE(ExpectWatchdogPings(listener));
  // The executor stops in its next task: give it one (a step that never finishes; the call ends
  // when the daemon is killed).
  std::thread step;
  if (part == "compute executor") {
    step = std::thread([socket] {
      auto c = client::Client::Connect("unix://" + socket);
      if (!c.ok()) return;
      common::JobSpec spec;
      spec.job_id = "stalled";
      spec.world_size = 1;
      common::MatrixSpec w;
      w.name = "w";
      w.shape = {64, 32};
      spec.matrices.push_back(w);
      auto token = (*c)->CreateJob(spec);
      if (!token.ok()) return;
      auto rank = (*c)->Attach("stalled", 0, *token);
      if (!rank.ok()) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(2600));
      std::vector<float> grads((*rank)->buffer_elements(), 0.5f), out(grads.size());
      (void)(*rank)->StepBuffer(0, grads.data(), out.data());
    });
  }
  // The part stops 2.5 s after start; pings may go on for the staleness window (1 s here) after
  // its last beat. Then none for 3 s.
  const Clock::time_point until = Clock::now() + std::chrono::seconds(30);
  while (ReadFile(log).find("stops for good") == std::string::npos && Clock::now() < until) {
    (void)listener.Receive(1);
  }
  ASSERT_NE(ReadFile(log).find("the " + part + " stops for good"), std::string::npos)
      << ReadFile(log);
  const Clock::time_point quiet_from = Clock::now() + std::chrono::milliseconds(1600);
  while (Clock::now() < quiet_from) (void)listener.Receive(1);
  std::optional<std::string> late = listener.Receive(3);
  EXPECT_FALSE(late.has_value()) << "pinged after the " << part << " stopped: " << *late;
  EXPECT_NE(ReadFile(log).find("not pinging the systemd watchdog: no progress from the " + part),
            std::string::npos)
      << ReadFile(log);
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  reaper.reaped = true;
  if (step.joinable()) step.join();
}

INSTANTIATE_TEST_SUITE_P(Parts, WatchdogStallTest,
                         ::testing::Values("compute executor", "job registry", "shm event loop",
                                           "metrics http loop", "grpc accept loop"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string name = info.param;
                           for (char& c : name) c = c == ' ' ? '_' : c;
                           return name;
                         });

}  // namespace
}  // namespace muond::deploy_test
