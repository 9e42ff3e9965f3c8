// Helpers of the hostile-environment tests (peer credentials, TLS, descriptor exhaustion).
//
// Not thread-safe: used from the gtest main thread.
#ifndef MUOND_TESTS_INTEGRATION_HOSTILE_UTIL_H_
#define MUOND_TESTS_INTEGRATION_HOSTILE_UTIL_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "tests/integration/daemon_fixture.h"

namespace muond::integration {

// Runs argv (argv[0] a path) as uid/gid with no supplementary groups (REQUIRES root), stdin
// /dev/null, the environment of this process; kills it after `timeout_seconds`. *pid gets the
// child's process id (the pid the daemon sees through SO_PEERCRED).
ProcessResult RunAs(uid_t uid, gid_t gid, const std::vector<std::string>& argv, pid_t* pid,
                    double timeout_seconds = 30);

// The TCP port a muond started on HOST:0 logged ("(port N)"); 0 when it has not yet.
int LoggedPort(const std::string& log);

// Waits until `log_text()` contains `text`; false after `timeout_seconds`.
bool WaitForLog(const DaemonProcess& daemon, const std::string& text, double timeout_seconds);

// Open descriptors of a process (entries of /proc/PID/fd); -1 when it cannot be read.
int OpenDescriptors(pid_t pid);
// Sets process `pid`'s descriptor limit (soft and hard) to what it holds now plus `headroom`;
// returns what it held (the base), or -1 with errno set when it cannot be read or set.
int LimitDescriptors(pid_t pid, int headroom);
// How many of the connections `fds` the peer has closed (a non-blocking read sees EOF).
int ClosedByPeer(const std::vector<int>& fds);
// User + system CPU seconds a process has used (/proc/PID/stat).
double CpuSeconds(pid_t pid);

// A job with the wide_std reference case's matrix, named "w".
common::JobSpec OneMatrixJob(const std::string& id);
// Attaches rank 0 of a OneMatrixJob and runs step 0 with the reference gradient; OK when the
// update matches the reference (relative error < 1e-4).
absl::Status StepOnce(client::Client& client, const std::string& id, const std::string& token);

}  // namespace muond::integration

#endif  // MUOND_TESTS_INTEGRATION_HOSTILE_UTIL_H_
