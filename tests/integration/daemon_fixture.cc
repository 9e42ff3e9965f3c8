#include "tests/integration/daemon_fixture.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/integration/reference_data.h"

extern char** environ;

namespace muond::integration {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<char*> CStrings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// This process's environment without the variables that would redirect muonctl, plus `extra`.
std::vector<std::string> ChildEnvironment(const std::map<std::string, std::string>& extra) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    if (key == "MUOND_ADDRESS" || key == "MUOND_JOB_TOKEN" || extra.count(key) != 0) continue;
    env.push_back(kv);
  }
  for (const auto& [key, value] : extra) env.push_back(key + "=" + value);
  return env;
}

// fork + exec with stdin from /dev/null and stdout/stderr appended to the given files. The child
// gets SIGKILL when this process dies, so a crashed test binary leaves no daemon behind. Only
// async-signal-safe calls between fork and exec (gRPC threads may hold locks).
absl::StatusOr<pid_t> Spawn(std::vector<std::string> argv, std::vector<std::string> env,
                            const std::string& out_path, const std::string& err_path) {
  std::vector<char*> cargv = CStrings(argv);
  std::vector<char*> cenv = CStrings(env);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) ::_exit(127);
    const int in = ::open("/dev/null", O_RDONLY);
    const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (in < 0 || out < 0 || err < 0) ::_exit(127);
    ::dup2(in, 0);
    ::dup2(out, 1);
    ::dup2(err, 2);
    ::execve(cargv[0], cargv.data(), cenv.data());
    ::_exit(127);
  }
  return pid;
}

// waitpid with a timeout; returns true and sets *status when the child exited.
bool WaitPid(pid_t pid, double timeout_seconds, int* status) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_seconds);
  while (true) {
    const pid_t r = ::waitpid(pid, status, WNOHANG);
    if (r == pid) return true;
    if (r < 0 && errno != EINTR) return false;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

bool UnixSocketAccepts(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

}  // namespace

TempDir::TempDir() {
  char tmpl[] = "/tmp/muond-it-XXXXXX";
  const char* made = ::mkdtemp(tmpl);
  if (made == nullptr) {
    std::fprintf(stderr, "mkdtemp: %s\n", std::strerror(errno));
    std::abort();
  }
  path_ = made;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteWholeFile(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << data;
  out.close();
  if (!out) ADD_FAILURE() << "cannot write " << path;
}

ProcessResult RunProcess(const std::vector<std::string>& argv,
                         const std::map<std::string, std::string>& env, double timeout_seconds) {
  ProcessResult result;
  TempDir io;
  const std::string out_path = io.File("stdout"), err_path = io.File("stderr");
  auto pid = Spawn(argv, ChildEnvironment(env), out_path, err_path);
  if (!pid.ok()) {
    result.err = std::string(pid.status().message());
    return result;
  }
  return FinishProcess(*pid, timeout_seconds, out_path, err_path);
}

ProcessResult FinishProcess(pid_t pid, double timeout_seconds, const std::string& out_path,
                            const std::string& err_path) {
  ProcessResult result;
  int status = 0;
  if (!WaitPid(pid, timeout_seconds, &status)) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    result.timed_out = true;
  }
  if (WIFEXITED(status)) {
    result.exited = !result.timed_out;
    result.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    result.signal = WTERMSIG(status);
  }
  result.out = ReadWholeFile(out_path);
  result.err = ReadWholeFile(err_path);
  return result;
}

ProcessResult RunMuonctl(const std::string& address, const std::vector<std::string>& args,
                         const std::map<std::string, std::string>& env) {
  std::vector<std::string> argv = {MUONCTL_BIN, "--address", address};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunProcess(argv, env);
}

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Start(
    const std::vector<std::string>& argv, const std::map<std::string, std::string>& env) {
  std::unique_ptr<ChildProcess> child(new ChildProcess());
  auto pid = Spawn(argv, ChildEnvironment(env), child->dir_.File("stdout"),
                   child->dir_.File("stderr"));
  if (!pid.ok()) return pid.status();
  child->pid_ = *pid;
  return child;
}

ChildProcess::~ChildProcess() {
  if (!reaped_) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &status_, 0);
  }
}

bool ChildProcess::WaitForOutput(const std::string& text, double timeout_seconds) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_seconds);
  while (true) {
    if (Out().find(text) != std::string::npos) return true;
    if (!reaped_ && WaitPid(pid_, 0, &status_)) reaped_ = true;
    if (reaped_) return Out().find(text) != std::string::npos;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

int ChildProcess::Kill(int signal) {
  if (reaped_) return status_;
  ::kill(pid_, signal);
  if (!WaitPid(pid_, 10, &status_)) return -1;
  reaped_ = true;
  return status_;
}

int CountLines(const std::string& text) {
  int n = 0;
  for (char c : text) n += c == '\n';
  if (!text.empty() && text.back() != '\n') ++n;
  return n;
}

std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited with ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("killed by signal ", WTERMSIG(status));
  return absl::StrCat("wait status ", status);
}

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::Spawn(
    const std::vector<std::string>& args, const std::string& log_path) {
  std::vector<std::string> argv = {MUOND_BIN};
  argv.insert(argv.end(), args.begin(), args.end());
  std::unique_ptr<DaemonProcess> d(new DaemonProcess());
  d->log_path_ = log_path;
  auto pid = integration::Spawn(argv, ChildEnvironment({}), log_path, log_path);
  if (!pid.ok()) return pid.status();
  d->pid_ = *pid;
  return d;
}

absl::StatusOr<std::unique_ptr<DaemonProcess>> DaemonProcess::StartIn(
    const std::string& dir, const std::vector<std::string>& extra) {
  const std::string socket = dir + "/muond.sock";
  std::vector<std::string> args = {"--listen",     "unix://" + socket, "--state-dir",
                                   dir + "/state", "--threads",        "1"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto d = Spawn(args, dir + "/muond.log");
  if (!d.ok()) return d.status();
  (*d)->socket_path_ = socket;
  absl::Status s = (*d)->WaitServing("unix://" + socket);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat(s.message(), "\nmuond log:\n", (*d)->Log()));
  }
  return d;
}

DaemonProcess::~DaemonProcess() {
  if (running()) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &status_, 0);
  }
}

absl::Status DaemonProcess::WaitServing(const std::string& address, double timeout_seconds) {
  address_ = address;
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_seconds);
  // First wait until the socket accepts connections: a gRPC channel that failed to connect backs
  // off for seconds before it tries again.
  if (absl::StartsWith(address, "unix://")) {
    const std::string path = address.substr(7);
    while (!UnixSocketAccepts(path)) {
      if (WaitExit(0)) {
        return absl::FailedPreconditionError(
            absl::StrCat("muond ", DescribeWaitStatus(status_), " before serving"));
      }
      if (Clock::now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("muond did not listen on ", address, " within ", timeout_seconds, " s"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  auto client = client::Client::Connect(address);
  if (!client.ok()) return client.status();
  absl::Status last;
  while (Clock::now() < deadline) {
    if (WaitExit(0)) {
      return absl::FailedPreconditionError(
          absl::StrCat("muond ", DescribeWaitStatus(status_), " before serving"));
    }
    last = (*client)->Health(0.5);
    if (last.ok()) return last;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("muond did not serve within ", timeout_seconds, " s: ", last.message()));
}

bool DaemonProcess::WaitExit(double timeout_seconds) {
  if (!running()) return true;
  if (!WaitPid(pid_, timeout_seconds, &status_)) return false;
  reaped_ = true;
  return true;
}

int DaemonProcess::Stop(double timeout_seconds) {
  if (!running()) return status_;
  ::kill(pid_, SIGTERM);
  if (!WaitExit(timeout_seconds)) {
    ADD_FAILURE() << "muond did not exit within " << timeout_seconds << " s of SIGTERM";
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &status_, 0);
    reaped_ = true;
  }
  return status_;
}

std::unique_ptr<TempDir> DaemonSuite::dir_;
std::unique_ptr<DaemonProcess> DaemonSuite::daemon_;
std::unique_ptr<client::Client> DaemonSuite::client_;
std::string DaemonSuite::canary_token_;
int DaemonSuite::next_job_ = 0;

void OwnDaemon::Start() {
  auto d = DaemonProcess::StartIn(dir_.path());
  ASSERT_TRUE(d.ok()) << d.status();
  daemon_ = *std::move(d);
  auto c = client::Client::Connect(daemon_->address());
  ASSERT_TRUE(c.ok()) << c.status();
  client_ = *std::move(c);
}

void OwnDaemon::Stop() {
  if (daemon_ != nullptr) {
    EXPECT_EQ(daemon_->Stop(), 0) << daemon_->Log();
  }
}

void DaemonSuite::SetUpTestSuite() {
  dir_ = std::make_unique<TempDir>();
  auto daemon = DaemonProcess::StartIn(dir_->path());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  daemon_ = *std::move(daemon);
  auto c = client::Client::Connect(daemon_->address());
  ASSERT_TRUE(c.ok()) << c.status();
  client_ = *std::move(c);
  auto token = client_->CreateJob(
      WholeMatrixJob("canary", "wide_std", {CaseMatrix("wide_std", "canary.w")}));
  ASSERT_TRUE(token.ok()) << token.status();
  canary_token_ = *token;
}

void DaemonSuite::TearDownTestSuite() {
  client_.reset();
  if (daemon_ != nullptr) {
    const int status = daemon_->Stop();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "muond " << DescribeWaitStatus(status) << " after SIGTERM; log:\n"
        << daemon_->Log();
    EXPECT_FALSE(std::filesystem::exists(daemon_->socket_path()))
        << "the socket file outlived the daemon";
  }
  daemon_.reset();
  dir_.reset();
}

void DaemonSuite::SetUp() {
  ASSERT_NE(daemon_, nullptr) << "the suite's muond did not start";
  ASSERT_NE(client_, nullptr);
}

std::string DaemonSuite::NewJobId(const std::string& prefix) {
  return absl::StrCat(prefix, "-", ++next_job_);
}

void DaemonSuite::ExpectStillServing() {
  ASSERT_TRUE(daemon_->running()) << "muond exited: " << DescribeWaitStatus(daemon_->exit_status())
                                  << "\n"
                                  << daemon_->Log();
  absl::Status health = client_->Health(5);
  ASSERT_TRUE(health.ok()) << health;
  ASSERT_TRUE(client_->ResetJob("canary", canary_token_, 0).ok());
  auto session = client_->Attach("canary", 0, canary_token_);
  ASSERT_TRUE(session.ok()) << session.status();
  auto updates = (*session)->StepTensors(0, {RefGrad("wide_std", 0, "canary.w")});
  ASSERT_TRUE(updates.ok()) << updates.status();
  ASSERT_EQ(updates->size(), 1u);
  EXPECT_TRUE(MatchesReferenceUpdate(ToFloats((*updates)[0]), "wide_std", 0, 1e-4));
}

}  // namespace muond::integration
