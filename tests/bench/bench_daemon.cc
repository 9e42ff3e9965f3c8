// Starting and stopping a real muond for the benchmarks that measure the daemon.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tests/bench/bench.h"

namespace muond::bench {

std::string MakeTempDir(const std::string& prefix) {
  std::string pattern = "/tmp/" + prefix + "-XXXXXX";
  const char* dir = mkdtemp(pattern.data());
  return dir == nullptr ? std::string("/tmp") : std::string(dir);
}

pid_t StartDaemon(const std::string& dir, int threads, std::string* address,
                  const std::vector<std::string>& extra) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  std::string bin = n > 0 ? std::string(self, n) : std::string("muond-bench");
  bin = bin.substr(0, bin.rfind('/') + 1) + "muond";
  *address = "unix://" + dir + "/muond.sock";
  const std::string threads_arg = std::to_string(threads);
  const std::string state = dir + "/state";
  std::vector<std::string> args = {bin,         "--listen",  *address,      "--state-dir", state,
                                   "--threads", threads_arg, "--log-level", "warning"};
  args.insert(args.end(), extra.begin(), extra.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    execv(bin.c_str(), argv.data());
    _exit(127);
  }
  return pid;
}

bool WaitHealthy(client::Client& client) {
  for (int i = 0; i < 200; ++i) {
    if (client.Health(1).ok()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

void StopDaemon(pid_t pid, const std::string& dir) {
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace muond::bench
