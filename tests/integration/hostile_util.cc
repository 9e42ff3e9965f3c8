#include "tests/integration/hostile_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tests/integration/reference_data.h"

extern char** environ;

namespace muond::integration {

ProcessResult RunAs(uid_t uid, gid_t gid, const std::vector<std::string>& argv, pid_t* pid_out,
                    double timeout_seconds) {
  ProcessResult result;
  TempDir io;
  const std::string out_path = io.File("stdout"), err_path = io.File("stderr");
  std::vector<std::string> args = argv;
  std::vector<char*> cargv;
  for (std::string& a : args) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  // The output files are opened before the fork, as root: the child keeps the descriptors after
  // it dropped its privileges.
  const int in = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) ::_exit(127);
    ::dup2(in, 0);
    ::dup2(out, 1);
    ::dup2(err, 2);
    if (::setgroups(0, nullptr) != 0 || ::setresgid(gid, gid, gid) != 0 ||
        ::setresuid(uid, uid, uid) != 0) {
      ::_exit(126);
    }
    ::execve(cargv[0], cargv.data(), environ);
    ::_exit(127);
  }
  ::close(in);
  ::close(out);
  ::close(err);
  if (pid_out != nullptr) *pid_out = pid;
  if (pid < 0) {
    result.err = absl::StrCat("fork: ", std::strerror(errno));
    return result;
  }
  return FinishProcess(pid, timeout_seconds, out_path, err_path);
}

int LoggedPort(const std::string& log) {
  const size_t at = log.find("(port ");
  if (at == std::string::npos) return 0;
  const size_t end = log.find(')', at);
  int port = 0;
  if (end == std::string::npos || !absl::SimpleAtoi(log.substr(at + 6, end - at - 6), &port)) {
    return 0;
  }
  return port;
}

bool WaitForLog(const DaemonProcess& daemon, const std::string& text, double timeout_seconds) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    if (daemon.Log().find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return daemon.Log().find(text) != std::string::npos;
}

int OpenDescriptors(pid_t pid) {
  DIR* dir = ::opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (dir == nullptr) return -1;
  int n = 0;
  while (dirent* e = ::readdir(dir)) n += e->d_name[0] != '.';
  ::closedir(dir);
  return n;
}

int LimitDescriptors(pid_t pid, int headroom) {
  const int base = OpenDescriptors(pid);
  if (base <= 0) return -1;
  const rlim_t limit = static_cast<rlim_t>(base + headroom);
  const rlimit lim{limit, limit};
  return ::prlimit(pid, RLIMIT_NOFILE, &lim, nullptr) == 0 ? base : -1;
}

int ClosedByPeer(const std::vector<int>& fds) {
  int closed = 0;
  for (int fd : fds) {
    char b;
    closed += ::recv(fd, &b, 1, MSG_DONTWAIT) == 0;
  }
  return closed;
}

double CpuSeconds(pid_t pid) {
  const std::string stat = ReadWholeFile(absl::StrCat("/proc/", pid, "/stat"));
  // Fields after the command name (which is in parentheses and may contain spaces): state is
  // field 3, utime 14, stime 15.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream in(stat.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && (in >> field); ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);
  }
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

common::JobSpec OneMatrixJob(const std::string& id) {
  return WholeMatrixJob(id, "wide_std", {CaseMatrix("wide_std", "w")});
}

absl::Status StepOnce(client::Client& client, const std::string& id, const std::string& token) {
  auto session = client.Attach(id, 0, token);
  if (!session.ok()) return session.status();
  auto updates = (*session)->StepTensors(0, {RefGrad("wide_std", 0, "w")});
  if (!updates.ok()) return updates.status();
  if (updates->size() != 1) return absl::InternalError("expected one update");
  ::testing::AssertionResult match =
      MatchesReferenceUpdate(ToFloats((*updates)[0]), "wide_std", 0, 1e-4);
  if (!match) return absl::InternalError(match.message());
  return absl::OkStatus();
}

}  // namespace muond::integration
