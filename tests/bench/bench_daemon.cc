// Starting and stopping a real muond for the benchmarks that measure the daemon.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/metrics_scrape.h"
#include "server/optim/adamw.h"
#include "server/optim/cpu_isa.h"
#include "tests/bench/bench.h"

// OpenBLAS's name for its kernel set; weak: absent when the system BLAS is another library.
extern "C" char* openblas_get_corename(void) __attribute__((weak));

namespace muond::bench {

std::string MakeTempDir(const std::string& prefix) {
  std::string pattern = "/tmp/" + prefix + "-XXXXXX";
  const char* dir = mkdtemp(pattern.data());
  return dir == nullptr ? std::string("/tmp") : std::string(dir);
}

int SetBenchCpuIsa(const char* bench, const std::string& isa, int argc, char** argv) {
  if (isa == "avx2" && std::getenv("OPENBLAS_CORETYPE") == nullptr &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    setenv("OPENBLAS_CORETYPE", "Haswell", 1);
    std::vector<char*> args = {const_cast<char*>("muond-bench")};
    for (int i = 0; i < argc; ++i) args.push_back(argv[i]);
    args.push_back(nullptr);
    execv("/proc/self/exe", args.data());
    std::fprintf(stderr, "muond-bench %s: re-executing with OPENBLAS_CORETYPE=Haswell failed: %s\n",
                 bench, std::strerror(errno));
    return 1;
  }
  if (absl::Status s = server::ConfigureCpuIsa(isa); !s.ok()) {
    std::fprintf(stderr, "muond-bench %s: %s\n", bench, std::string(s.message()).c_str());
    return 2;
  }
  return -1;
}

std::string BlasCoreName() {
  if (openblas_get_corename == nullptr) return "unknown";
  const char* name = openblas_get_corename();
  return name != nullptr ? name : "unknown";
}

std::string CpuPathLine() {
  return absl::StrCat("cpu path: ", server::DescribeCpuMathPath(server::CurrentCpuMathPath()),
                      "; AdamW ", server::AdamWAutoPathName(), "; system BLAS kernels ",
                      BlasCoreName());
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

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  if (fd >= 0) close(fd);
  return port;
}

std::map<std::string, double> PhaseSums(const std::string& metrics, const std::string& job) {
  std::map<std::string, double> sums;
  auto samples = client::ScrapeMetrics(metrics);
  if (!samples.ok()) return sums;
  sums["step"] =
      client::FindSample(*samples, "muond_step_duration_seconds_sum", {{"muond_job", job}}, 0);
  for (const char* p : kPhases) {
    sums[p] = client::FindSample(*samples, "muond_step_phase_duration_seconds_sum",
                                 {{"muond_job", job}, {"phase", p}}, 0);
  }
  return sums;
}

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double CpuSeconds(pid_t pid) {
  std::ifstream in(pid == 0 ? std::string("/proc/self/stat")
                            : "/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Fields after the command name (which may hold spaces) start at field 3; utime and stime are
  // fields 14 and 15, in clock ticks.
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(text.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int f = 3; f <= 15 && (fields >> field); ++f) {
    if (f >= 14) ticks += std::strtod(field.c_str(), nullptr);
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

}  // namespace muond::bench
