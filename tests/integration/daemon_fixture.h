// Test harness for the integration tests: runs the real `muond` and `muonctl` binaries.
//
// DaemonProcess starts one muond (posix_spawn) on a Unix socket in a private temporary directory,
// waits until grpc.health.v1 reports SERVING, and stops it with SIGTERM. DaemonSuite is a gtest
// fixture that shares one daemon per test suite (daemon starts cost LibTorch's load time), and
// asserts in TearDownTestSuite that the daemon exits 0.
//
// Not thread-safe: used from the gtest main thread (tests may start their own threads for ranks).
#ifndef MUOND_TESTS_INTEGRATION_DAEMON_FIXTURE_H_
#define MUOND_TESTS_INTEGRATION_DAEMON_FIXTURE_H_

#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "gtest/gtest.h"

namespace muond::integration {

// A fresh directory under /tmp (short, so socket paths stay below the 100-byte limit), removed
// with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Reads a whole file ("" when it cannot be read); writes a whole file (ADD_FAILURE on error).
std::string ReadWholeFile(const std::string& path);
void WriteWholeFile(const std::string& path, const std::string& data);

// How a child process ended and what it printed.
struct ProcessResult {
  bool exited = false;  // false: killed by a signal or timed out
  int exit_code = -1;   // valid when exited
  int signal = 0;       // the terminating signal when !exited
  bool timed_out = false;
  std::string out;
  std::string err;
};

// Runs argv[0] (a path) with argv, stdin /dev/null, and the environment of this process minus
// MUOND_ADDRESS and MUOND_JOB_TOKEN, plus `env`. Kills it with SIGKILL after `timeout_seconds`.
ProcessResult RunProcess(const std::vector<std::string>& argv,
                         const std::map<std::string, std::string>& env = {},
                         double timeout_seconds = 30);

// Waits for the child `pid` (SIGKILL after `timeout_seconds`) and collects how it ended and what
// it wrote to `out_path` and `err_path`.
ProcessResult FinishProcess(pid_t pid, double timeout_seconds, const std::string& out_path,
                            const std::string& err_path);

// Runs muonctl --address ADDRESS ARGS...
ProcessResult RunMuonctl(const std::string& address, const std::vector<std::string>& args,
                         const std::map<std::string, std::string>& env = {});

// A child process that runs while the test goes on (e.g. a rank process to be killed mid-step);
// stdin /dev/null, stdout and stderr to files, the environment as for RunProcess. SIGKILLed and
// reaped on destruction when still running.
class ChildProcess {
 public:
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(
      const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {});
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  // What it printed so far.
  std::string Out() const { return ReadWholeFile(dir_.File("stdout")); }
  std::string Err() const { return ReadWholeFile(dir_.File("stderr")); }
  // Polls until stdout contains `text`; false after `timeout_seconds` or when the process exited.
  bool WaitForOutput(const std::string& text, double timeout_seconds);
  // Sends `signal` and waits for the process to end; returns its wait status (-1 if it did not
  // end within 10 s).
  int Kill(int signal);
  bool running() const { return !reaped_; }

 private:
  ChildProcess() = default;
  TempDir dir_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
};

// The number of '\n'-terminated lines in `text` (a last line without '\n' counts too).
int CountLines(const std::string& text);

// One running muond process.
class DaemonProcess {
 public:
  // Spawns `MUOND_BIN args...` with stdout and stderr appended to `log_path`.
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> Spawn(const std::vector<std::string>& args,
                                                              const std::string& log_path);
  // Spawns muond with --listen unix://DIR/muond.sock --state-dir DIR/state --threads 1 (plus
  // `extra` flags) and waits until it serves.
  static absl::StatusOr<std::unique_ptr<DaemonProcess>> StartIn(
      const std::string& dir, const std::vector<std::string>& extra = {});
  ~DaemonProcess();  // SIGKILLs a daemon that is still running

  // How long a test waits for a starting muond by default. A sanitized muond loads and maps
  // LibTorch and gRPC under the sanitizer's runtime first: the ASan build took 25 s to listen on
  // two busy cores, and every daemon test of the lane failed at 10 s.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  static constexpr double kStartSeconds = 120;
#else
  static constexpr double kStartSeconds = 10;
#endif
  // Polls Client::Health until SERVING; FAILED_PRECONDITION when the process exited first,
  // DEADLINE_EXCEEDED after `timeout_seconds`.
  absl::Status WaitServing(const std::string& address, double timeout_seconds = kStartSeconds);
  // Waits up to `timeout_seconds` for the process to exit without signalling it. Returns true
  // when it exited; the status is then in exit_status().
  bool WaitExit(double timeout_seconds);
  // Sends SIGTERM and waits up to `timeout_seconds` (then SIGKILL). Returns the wait status.
  int Stop(double timeout_seconds = 20);

  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0 && !reaped_; }
  int exit_status() const { return status_; }
  const std::string& address() const { return address_; }
  const std::string& socket_path() const { return socket_path_; }
  std::string Log() const { return ReadWholeFile(log_path_); }

 private:
  DaemonProcess() = default;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  std::string address_;
  std::string socket_path_;
  std::string log_path_;
};

// "exited with N" / "killed by signal N" for a wait status.
std::string DescribeWaitStatus(int status);

// A muond of the test's own (in a temporary state directory) and a client of it, for fixtures
// that start one per test: Start() in SetUp, Stop() in TearDown (the daemon must exit 0).
class OwnDaemon {
 protected:
  void Start();
  void Stop();
  // A path in the daemon's temporary directory.
  std::string Dir(const std::string& name) const { return dir_.File(name); }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::Client> client_;
};

// A gtest fixture that shares one muond per test suite.
class DaemonSuite : public ::testing::Test {
 protected:
  static void SetUpTestSuite();
  static void TearDownTestSuite();
  void SetUp() override;

  static client::Client& client() { return *client_; }
  static const std::string& address() { return daemon_->address(); }
  static const std::string& dir() { return dir_->path(); }
  // The daemon's process id (for /proc/<pid>/status).
  static pid_t daemon_pid() { return daemon_->pid(); }
  // A job id unique within the suite: "<prefix>-<n>".
  static std::string NewJobId(const std::string& prefix);

  // Asserts the daemon still serves: Health is OK, and a canary job (reset to step 0) computes
  // the wide_std reference update of step 0 (rel. error < 1e-4).
  static void ExpectStillServing();

 private:
  static std::unique_ptr<TempDir> dir_;
  static std::unique_ptr<DaemonProcess> daemon_;
  static std::unique_ptr<client::Client> client_;
  static std::string canary_token_;
  static int next_job_;
};

}  // namespace muond::integration

#endif  // MUOND_TESTS_INTEGRATION_DAEMON_FIXTURE_H_
