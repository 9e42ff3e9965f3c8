// The real muond under systemd's notification protocol, started as the unit starts it (with the
// sample config, deploy/muond.conf.sample, and test-local overrides) and $NOTIFY_SOCKET pointing
// at a socket this test binds:
//   - the first datagram is READY=1 with a STATUS naming the socket, and when it arrives the gRPC
//     socket serves (grpc.health.v1 SERVING), the shared-memory socket exists and the metrics
//     endpoint is bound (the log says where);
//   - with WATCHDOG_USEC=400000 it pings WATCHDOG=1 (at least 3 pings, >= 2 periods of 200 ms);
//   - on SIGTERM it sends STOPPING=1 and exits 0.
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

TEST(DaemonNotifyTest, ReadyWatchdogAndStoppingFromTheRealDaemon) {
  char tmpl[] = "/tmp/muond-sd.XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string socket = dir + "/muond.sock";
  const std::string log = dir + "/muond.log";
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
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace muond::deploy_test
