// The fixture and raw-socket helpers of the shared-memory limits tests (shm_limits_*_test.cc, the
// shm_limits_test executable): a daemon of the test's own, a victim job attached over shared memory
// before the attack with its reference updates, raw connections to the shm socket that send what
// they like and read the daemon's answer, and the daemon's descriptors and CPU time from /proc.
//
// Thread-compatible: each object is used by one thread at a time.
#ifndef MUOND_TESTS_SHM_SHM_LIMITS_UTIL_H_
#define MUOND_TESTS_SHM_SHM_LIMITS_UTIL_H_

#include <sys/resource.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/client.h"
#include "client/shm_channel.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/shm/shm_test_util.h"

namespace muond::shmtest {

using Clock = std::chrono::steady_clock;

// Seconds since `t`.
double Since(Clock::time_point t);

// Whether this build's muond takes `flag` (main.cc wires the shm flags to ShmLimits).
bool DaemonHasFlag(const std::string& flag);

// User + system CPU seconds of a process (/proc/PID/stat fields 14 and 15); -1 when unreadable.
double CpuSeconds(pid_t pid);

// Descriptors the process holds.
int DaemonFds(pid_t pid);

// Descriptors of the process numbered `at_least` or higher (RLIMIT_NOFILE bounds the numbers of
// new descriptors, not the ones already open).
int DaemonFdsFrom(pid_t pid, int at_least);

// Polls until the daemon holds `want` descriptors (at least `want` with `at_least`); returns the
// last count.
int WaitForFds(pid_t pid, int want, double timeout_seconds, bool at_least = false);

// This process's soft RLIMIT_NOFILE raised to the hard limit; returns the new soft limit.
rlim_t RaiseNoFileLimit();

// A connection to the shm socket that has sent nothing; -1 on failure. connect() blocks while
// the daemon's backlog is full, at most 5 s.
int Connect(const std::string& path);

// The serialized attach request a raw peer sends.
std::string AttachRequest(const std::string& job_id, int rank, const std::string& token);

// What a raw connection received from the daemon.
struct Outcome {
  enum Kind { kNothing, kReply, kClosed } kind = kNothing;
  int code = -1;
  std::string message;
  int nfds = 0;  // descriptors that came with the reply (closed here)
  std::string ToString() const;
};

// The next datagram (or the hang-up) on `fd`, waiting at most `timeout_seconds`.
Outcome Receive(int fd, double timeout_seconds);

// Success when `o` is a reply with `code` whose message contains `text`.
::testing::AssertionResult IsReply(const Outcome& o, absl::StatusCode code,
                                   const std::string& text);

// A world-size-1 job attached over shared memory before the attack, with its reference updates
// (the same gradients through a separate job over gRPC).
struct Victim {
  common::JobSpec spec;
  std::string token;
  MatrixBytes grads;
  std::vector<std::vector<std::string>> want;  // [step][matrix]
  std::unique_ptr<client::RankSession> session;
  int64_t next_step = 0;
};

// Every test starts its own muond (StartDaemon); TearDown stops it, expects a clean exit and
// prints the end of its log on failure.
class ShmLimitsTest : public ::testing::Test {
 protected:
  void TearDown() override;

  void StartDaemon(std::vector<std::string> flags);

  // The value of a sample of the daemon's /metrics (-1 when absent or not reachable).
  double Metric(const std::string& name, const std::map<std::string, std::string>& labels = {});
  double Refused(const std::string& reason) {
    return Metric("muond_shm_connections_refused_total", {{"reason", reason}});
  }

  std::string ShmPath() const { return client::ShmSocketFor(daemon_->address()); }
  pid_t pid() const { return daemon_->pid(); }

  std::unique_ptr<Victim> NewVictim(const std::string& id, int steps, uint64_t seed);

  // Attaches the victim's rank over shared memory (the client library).
  void AttachVictim(Victim& v);

  // One step of the victim over shared memory: the reference update, bit for bit.
  void StepVictim(Victim& v, const std::string& when);

  // The daemon serves: Health is OK and a job created now attaches over shared memory and
  // computes the reference update.
  void ExpectHealthy(const std::string& id);

  bool RankAttached(const Victim& v);

  integration::TempDir dir_;
  std::unique_ptr<integration::DaemonProcess> daemon_;
  std::unique_ptr<client::Client> client_;
};

}  // namespace muond::shmtest

#endif  // MUOND_TESTS_SHM_SHM_LIMITS_UTIL_H_
