// The shared-memory data plane against a flood of connections and a daemon out of file
// descriptors (ShmLimits in server/api/shm_server.h): each case asserts the exact code and message
// the offending connection gets, and that a victim job attached before the attack still steps over
// shared memory with the reference results, that a new attach works afterwards, and that the
// daemon's descriptors come back to where they were.
//
// Every test starts its own muond. When muond takes --max-shm-sessions and
// --shm-attach-timeout-seconds, the tests set them (smaller numbers, faster runs); otherwise they
// run against the defaults (256 connections, 5 s).
#include <poll.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/shm_channel.h"
#include "gtest/gtest.h"
#include "tests/shm/shm_limits_util.h"

namespace muond::shmtest {
namespace {

using client::ShmChannel;

// Thousands of idle connections: beyond --max-shm-sessions (attached sessions included) each is
// answered RESOURCE_EXHAUSTED naming the limit; the ones within it are answered
// DEADLINE_EXCEEDED and closed after the attach timeout. The daemon's descriptors stay bounded
// and come back; the victim steps throughout.
TEST_F(ShmLimitsTest, IdleConnectionsAreBoundedAndTimedOut) {
  const bool flags = DaemonHasFlag("--max-shm-sessions") &&
                     DaemonHasFlag("--shm-attach-timeout-seconds");
  const int max_sessions = flags ? 200 : 256;
  const double timeout = flags ? 4 : 5;
  std::vector<std::string> extra;
  if (flags) extra = {"--max-shm-sessions", "200", "--shm-attach-timeout-seconds", "4"};
  ASSERT_NO_FATAL_FAILURE(StartDaemon(extra));
  const rlim_t nofile = RaiseNoFileLimit();
  std::unique_ptr<Victim> victim = NewVictim("victim", 3, 11);
  ASSERT_NO_FATAL_FAILURE(AttachVictim(*victim));
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "before the attack"));

  const int fds_before = DaemonFds(pid());
  const int n = static_cast<int>(std::min<rlim_t>(2000, nofile > 300 ? nofile - 200 : 100));
  std::vector<int> conns;
  std::vector<Clock::time_point> connected;
  const auto start = Clock::now();
  for (int i = 0; i < n; ++i) {
    const int fd = Connect(ShmPath());
    ASSERT_GE(fd, 0) << "connection " << i << ": " << std::strerror(errno);
    conns.push_back(fd);
    connected.push_back(Clock::now());
  }
  const double connect_seconds = Since(start);
  const int pending_expected = max_sessions - 1;  // the victim's session counts
  const int fds_during = WaitForFds(pid(), fds_before + pending_expected, 2, /*at_least=*/true);

  // While the connections are held: the victim steps; a new attach is refused, naming the limit.
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "during the attack"));
  auto refused = ShmChannel::Attach(ShmPath(), victim->spec.job_id, 0, victim->token, false);
  EXPECT_TRUE(IsError(refused.status(), absl::StatusCode::kResourceExhausted,
                      absl::StrCat("(--max-shm-sessions ", max_sessions, ")")));
  const double pending_gauge = Metric("muond_shm_pending_connections");
  EXPECT_LT(Since(start), timeout) << "the checks during the attack took too long";

  // Collect every connection's answer.
  std::vector<Outcome> outcome(n);
  std::vector<double> answered_after(n, -1);
  int open = n;
  while (open > 0 && Since(start) < timeout + 10) {
    std::vector<pollfd> p;
    std::vector<int> index;
    for (int i = 0; i < n; ++i) {
      if (outcome[i].kind != Outcome::kNothing) continue;
      p.push_back({conns[i], POLLIN, 0});
      index.push_back(i);
    }
    if (poll(p.data(), p.size(), 50) <= 0) continue;
    for (size_t k = 0; k < p.size(); ++k) {
      if (p[k].revents == 0) continue;
      const int i = index[k];
      outcome[i] = Receive(conns[i], 0);
      if (outcome[i].kind == Outcome::kNothing) continue;
      answered_after[i] = std::chrono::duration<double>(Clock::now() - connected[i]).count();
      --open;
    }
  }
  int over_limit = 0, timed_out = 0, other = 0;
  double earliest_timeout = 1e9, latest_timeout = 0;
  for (int i = 0; i < n; ++i) {
    if (IsReply(outcome[i], absl::StatusCode::kResourceExhausted,
                absl::StrCat("(--max-shm-sessions ", max_sessions,
                             "); connection refused, try again later"))) {
      ++over_limit;
    } else if (IsReply(outcome[i], absl::StatusCode::kDeadlineExceeded,
                       absl::StrCat("no shared-memory attach request completed within ",
                                    static_cast<int>(timeout),
                                    "s of connecting (--shm-attach-timeout-seconds)"))) {
      ++timed_out;
      earliest_timeout = std::min(earliest_timeout, answered_after[i]);
      latest_timeout = std::max(latest_timeout, answered_after[i]);
    } else if (other++ < 3) {
      ADD_FAILURE() << "connection " << i << ": " << outcome[i].ToString();
    }
  }
  // After its answer, every connection is closed by the daemon.
  int closed = 0;
  for (int i = 0; i < n; ++i) closed += Receive(conns[i], 2).kind == Outcome::kClosed;
  for (int fd : conns) close(fd);
  const int fds_after = WaitForFds(pid(), fds_before, 5);
  std::cout << "idle connections: " << n << " opened in " << connect_seconds << " s; limit "
            << max_sessions << ", attach timeout " << timeout << " s\n"
            << "  refused over the limit: " << over_limit << ", timed out: " << timed_out
            << " (answered " << earliest_timeout << " .. " << latest_timeout
            << " s after connecting), other: " << other << ", closed by the daemon: " << closed
            << "\n  daemon fds: before " << fds_before << ", during " << fds_during << ", after "
            << fds_after << std::endl;
  EXPECT_EQ(over_limit, n - pending_expected);
  EXPECT_EQ(timed_out, pending_expected);
  EXPECT_EQ(other, 0);
  EXPECT_EQ(closed, n);
  EXPECT_GE(earliest_timeout, timeout - 0.25) << "a pending connection was closed early";
  EXPECT_LE(latest_timeout, timeout + 2) << "a pending connection was held too long";
  // One descriptor per pending connection (plus, at most, one being refused at that moment).
  EXPECT_GE(fds_during, fds_before + pending_expected);
  EXPECT_LE(fds_during, fds_before + pending_expected + 2);
  EXPECT_EQ(fds_after, fds_before);
  // The operators' view: the refusals by reason, and the pending connections while held.
  std::cout << "  metrics: pending during " << pending_gauge << ", refused session_limit "
            << Refused("session_limit") << ", attach_timeout " << Refused("attach_timeout")
            << ", pending after " << Metric("muond_shm_pending_connections") << std::endl;
  EXPECT_EQ(pending_gauge, pending_expected);
  EXPECT_EQ(Refused("session_limit"), over_limit + 1);  // and the ShmChannel attach
  EXPECT_EQ(Refused("attach_timeout"), timed_out);
  EXPECT_EQ(Metric("muond_shm_pending_connections"), 0);

  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "after the attack"));
  ASSERT_NO_FATAL_FAILURE(ExpectHealthy("fresh-after-idle"));
  // The warnings are rate-limited: not one line per refused connection.
  const std::string log = daemon_->Log();
  int warnings = 0;
  for (size_t at = log.find("(session_limit)"); at != std::string::npos;
       at = log.find("(session_limit)", at + 1)) {
    ++warnings;
  }
  std::cout << "  session-limit warnings logged: " << warnings << std::endl;
  EXPECT_GE(warnings, 1);
  EXPECT_LE(warnings, 3);
}

// The daemon out of descriptors (RLIMIT_NOFILE lowered under it): connections are refused with
// RESOURCE_EXHAUSTED naming the cause, an attach that cannot create its five descriptors is
// refused and leaves the rank detached, the accept loop does not spin, and once the connections
// are gone a real attach and step work again.
TEST_F(ShmLimitsTest, OutOfDescriptorsNeitherSpinsNorWedges) {
  const bool flag = DaemonHasFlag("--shm-attach-timeout-seconds");
  std::vector<std::string> extra;
  if (flag) extra = {"--shm-attach-timeout-seconds", "60"};
  ASSERT_NO_FATAL_FAILURE(StartDaemon(extra));
  RaiseNoFileLimit();
  std::unique_ptr<Victim> victim = NewVictim("victim", 2, 12);
  std::unique_ptr<Victim> second = NewVictim("second", 1, 13);
  ASSERT_NO_FATAL_FAILURE(AttachVictim(*victim));
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "before the attack"));

  const int fds_before = DaemonFds(pid());
  const rlimit low{static_cast<rlim_t>(fds_before + 24), static_cast<rlim_t>(fds_before + 24)};
  rlimit old{};
  ASSERT_EQ(prlimit(pid(), RLIMIT_NOFILE, &low, &old), 0) << std::strerror(errno);
  const int above_limit = DaemonFdsFrom(pid(), static_cast<int>(low.rlim_cur));
  const auto start = Clock::now();
  // Fill the daemon's descriptor table with idle connections until one is refused.
  std::vector<int> held;
  Outcome first_refusal;
  while (first_refusal.kind == Outcome::kNothing && held.size() < 200) {
    const int fd = Connect(ShmPath());
    ASSERT_GE(fd, 0) << std::strerror(errno);
    first_refusal = Receive(fd, 0.1);
    if (first_refusal.kind == Outcome::kNothing) {
      held.push_back(fd);
    } else {
      close(fd);
    }
  }
  // A connection answered late is not held.
  for (size_t i = 0; i < held.size();) {
    if (Receive(held[i], 0).kind == Outcome::kNothing) {
      ++i;
      continue;
    }
    close(held[i]);
    held.erase(held.begin() + i);
  }
  const std::string out_of_fds = absl::StrCat(
      "muond is out of file descriptors (RLIMIT_NOFILE ", low.rlim_cur,
      "; accept: Too many open files): shared-memory connection refused, try again later");
  EXPECT_TRUE(IsReply(first_refusal, absl::StatusCode::kResourceExhausted, out_of_fds));
  const int fds_full = DaemonFds(pid());

  // Two descriptors free: not enough for an attach (a connection and five descriptors).
  ASSERT_GE(held.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    close(held.back());
    held.pop_back();
  }
  EXPECT_EQ(WaitForFds(pid(), fds_full - 2, 2), fds_full - 2);
  auto short_attach = ShmChannel::Attach(ShmPath(), second->spec.job_id, 0, second->token, false);
  EXPECT_TRUE(IsError(short_attach.status(), absl::StatusCode::kResourceExhausted,
                      absl::StrCat("job '", second->spec.job_id,
                                   "' rank 0: cannot set up the shared-memory session: ")));
  EXPECT_TRUE(absl::StrContains(short_attach.status().message(),
                                absl::StrCat("Too many open files (RLIMIT_NOFILE ", low.rlim_cur,
                                             ")")))
      << short_attach.status();
  EXPECT_FALSE(RankAttached(*second)) << "a failed attach left the rank attached";
  // Full again.
  for (int i = 0; i < 2; ++i) {
    const int fd = Connect(ShmPath());
    ASSERT_GE(fd, 0);
    held.push_back(fd);
  }
  EXPECT_LT(Since(start), flag ? 50 : 4.5) << "the held connections may have timed out";

  // Stuck for 2 s with connections arriving: the daemon's CPU time hardly grows.
  const double cpu_before = CpuSeconds(pid());
  const auto window = Clock::now();
  int refused = 0, attempts = 0;
  while (Since(window) < 2) {
    const int fd = Connect(ShmPath());
    if (fd < 0) continue;
    ++attempts;
    refused += IsReply(Receive(fd, 1), absl::StatusCode::kResourceExhausted, out_of_fds) ? 1 : 0;
    close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const double cpu_stuck = CpuSeconds(pid()) - cpu_before;
  const double window_seconds = Since(window);
  const int fds_stuck = DaemonFds(pid());

  for (int fd : held) close(fd);
  const int fds_after = WaitForFds(pid(), fds_before, 5);
  std::cout << "out of descriptors: RLIMIT_NOFILE " << low.rlim_cur << ", " << held.size()
            << " idle connections filled it\n  daemon CPU while stuck: " << cpu_stuck << " s over "
            << window_seconds << " s; " << refused << " of " << attempts
            << " new connections refused RESOURCE_EXHAUSTED\n  daemon fds: before " << fds_before
            << ", full " << fds_full << ", stuck " << fds_stuck << ", after " << fds_after
            << std::endl;
  EXPECT_LT(cpu_stuck, 0.5) << "the accept loop spins";
  EXPECT_GE(attempts, 10);
  EXPECT_EQ(refused, attempts);
  EXPECT_LE(fds_stuck, static_cast<int>(low.rlim_cur) + above_limit);
  EXPECT_EQ(fds_after, fds_before);

  std::cout << "  metrics: refused out_of_descriptors " << Refused("out_of_descriptors")
            << ", attach_failed " << Refused("attach_failed") << std::endl;
  EXPECT_GE(Refused("out_of_descriptors"), refused + 1);
  EXPECT_EQ(Refused("attach_failed"), 1);

  // Descriptors are back (the limit still low): everything works again.
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "after the attack"));
  ASSERT_NO_FATAL_FAILURE(AttachVictim(*second));
  ASSERT_NO_FATAL_FAILURE(StepVictim(*second, "attached after the attack"));
  second->session.reset();
  ASSERT_NO_FATAL_FAILURE(ExpectHealthy("fresh-after-emfile"));
  int warnings = 0;
  const std::string log = daemon_->Log();
  for (size_t at = log.find("(out_of_descriptors)"); at != std::string::npos;
       at = log.find("(out_of_descriptors)", at + 1)) {
    ++warnings;
  }
  std::cout << "  out-of-descriptor warnings logged: " << warnings << std::endl;
  EXPECT_GE(warnings, 1);
  EXPECT_LE(warnings, 3);
}

}  // namespace
}  // namespace muond::shmtest
