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

// Occurrences of `needle` in `text` (the daemon's warnings of one reason in its log).
int CountOccurrences(const std::string& text, const std::string& needle) {
  int count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
    ++count;
  }
  return count;
}

// Idle connections to the shm socket, with when each was connected.
struct IdleConnections {
  std::vector<int> fds;
  std::vector<Clock::time_point> connected;
};

// Opens `n` connections that send nothing; fails the test at the first that cannot connect.
void OpenIdleConnections(const std::string& path, int n, IdleConnections& conns) {
  for (int i = 0; i < n; ++i) {
    const int fd = Connect(path);
    ASSERT_GE(fd, 0) << "connection " << i << ": " << std::strerror(errno);
    conns.fds.push_back(fd);
    conns.connected.push_back(Clock::now());
  }
}

// One connection's answer, and how long after connecting it came (-1: none came).
struct Answer {
  Outcome outcome;
  double after_seconds = -1;
};

// Polls every connection until each has its answer or `give_up_seconds` passed since `start`.
std::vector<Answer> AwaitAnswers(const IdleConnections& conns, Clock::time_point start,
                                 double give_up_seconds) {
  const int n = static_cast<int>(conns.fds.size());
  std::vector<Answer> answers(n);
  int open = n;
  while (open > 0 && Since(start) < give_up_seconds) {
    std::vector<pollfd> p;
    std::vector<int> index;
    for (int i = 0; i < n; ++i) {
      if (answers[i].outcome.kind != Outcome::kNothing) continue;
      p.push_back({conns.fds[i], POLLIN, 0});
      index.push_back(i);
    }
    if (poll(p.data(), p.size(), 50) <= 0) continue;
    for (size_t k = 0; k < p.size(); ++k) {
      if (p[k].revents == 0) continue;
      const int i = index[k];
      answers[i].outcome = Receive(conns.fds[i], 0);
      if (answers[i].outcome.kind == Outcome::kNothing) continue;
      answers[i].after_seconds =
          std::chrono::duration<double>(Clock::now() - conns.connected[i]).count();
      --open;
    }
  }
  return answers;
}

// The idle connections' answers by kind: refused over --max-shm-sessions, or timed out after
// --shm-attach-timeout-seconds (with the earliest and latest time of those answers), or other
// (the first three reported as failures).
struct IdleAnswers {
  int over_limit = 0;
  int timed_out = 0;
  int other = 0;
  double earliest_timeout = 1e9;
  double latest_timeout = 0;
};

IdleAnswers SortIdleAnswers(const std::vector<Answer>& answers, int max_sessions, double timeout) {
  IdleAnswers got;
  for (size_t i = 0; i < answers.size(); ++i) {
    const Answer& a = answers[i];
    if (IsReply(a.outcome, absl::StatusCode::kResourceExhausted,
                absl::StrCat("(--max-shm-sessions ", max_sessions,
                             "); connection refused, try again later"))) {
      ++got.over_limit;
    } else if (IsReply(a.outcome, absl::StatusCode::kDeadlineExceeded,
                       absl::StrCat("no shared-memory attach request completed within ",
                                    static_cast<int>(timeout),
                                    "s of connecting (--shm-attach-timeout-seconds)"))) {
      ++got.timed_out;
      got.earliest_timeout = std::min(got.earliest_timeout, a.after_seconds);
      got.latest_timeout = std::max(got.latest_timeout, a.after_seconds);
    } else if (got.other++ < 3) {
      ADD_FAILURE() << "connection " << i << ": " << a.outcome.ToString();
    }
  }
  return got;
}

// How many of `fds` the daemon has closed (each waited for at most 2 s).
int CountClosedByTheDaemon(const std::vector<int>& fds) {
  int closed = 0;
  for (int fd : fds) closed += Receive(fd, 2).kind == Outcome::kClosed;
  return closed;
}

// An idle-connection flood as measured: its size and the limits it met, the answers, and the
// daemon's descriptors before, while the connections were held, and after.
struct IdleFlood {
  int n = 0;
  int max_sessions = 0;
  double timeout = 0;
  int pending_expected = 0;  // connections within the limit (the victim's session counts)
  double connect_seconds = 0;
  IdleAnswers answers;
  int closed = 0;
  int fds_before = 0;
  int fds_during = 0;
  int fds_after = 0;
};

// Every connection over the limit refused, every one within it timed out on time, all closed by
// the daemon; its descriptors bounded by the pending connections, and back after.
void ExpectIdleFloodAnswered(const IdleFlood& f) {
  const IdleAnswers& a = f.answers;
  std::cout << "idle connections: " << f.n << " opened in " << f.connect_seconds << " s; limit "
            << f.max_sessions << ", attach timeout " << f.timeout << " s\n"
            << "  refused over the limit: " << a.over_limit << ", timed out: " << a.timed_out
            << " (answered " << a.earliest_timeout << " .. " << a.latest_timeout
            << " s after connecting), other: " << a.other << ", closed by the daemon: " << f.closed
            << "\n  daemon fds: before " << f.fds_before << ", during " << f.fds_during
            << ", after " << f.fds_after << std::endl;
  EXPECT_EQ(a.over_limit, f.n - f.pending_expected);
  EXPECT_EQ(a.timed_out, f.pending_expected);
  EXPECT_EQ(a.other, 0);
  EXPECT_EQ(f.closed, f.n);
  EXPECT_GE(a.earliest_timeout, f.timeout - 0.25) << "a pending connection was closed early";
  EXPECT_LE(a.latest_timeout, f.timeout + 2) << "a pending connection was held too long";
  // One descriptor per pending connection (plus, at most, one being refused at that moment).
  EXPECT_GE(f.fds_during, f.fds_before + f.pending_expected);
  EXPECT_LE(f.fds_during, f.fds_before + f.pending_expected + 2);
  EXPECT_EQ(f.fds_after, f.fds_before);
}

// Thousands of idle connections: beyond --max-shm-sessions (attached sessions included) each is
// answered RESOURCE_EXHAUSTED naming the limit; the ones within it are answered
// DEADLINE_EXCEEDED and closed after the attach timeout. The daemon's descriptors stay bounded
// and come back; the victim steps throughout.
TEST_F(ShmLimitsTest, IdleConnectionsAreBoundedAndTimedOut) {
  const bool flags =
      DaemonHasFlag("--max-shm-sessions") && DaemonHasFlag("--shm-attach-timeout-seconds");
  IdleFlood f;
  f.max_sessions = flags ? 200 : 256;
  f.timeout = flags ? 4 : 5;
  std::vector<std::string> extra;
  // One process floods here: its per-peer bounds as large as the global limit, which is tested.
  if (flags) {
    extra = {"--max-shm-sessions",        "200", "--shm-attach-timeout-seconds", "4",
             "--max-shm-pending-per-uid", "200", "--max-shm-pending-per-pid",    "200"};
  }
  ASSERT_NO_FATAL_FAILURE(StartDaemon(extra));
  const rlim_t nofile = RaiseNoFileLimit();
  std::unique_ptr<Victim> victim = NewVictim("victim", 3, 11);
  ASSERT_NO_FATAL_FAILURE(AttachVictim(*victim));
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "before the attack"));

  f.fds_before = DaemonFds(pid());
  f.n = static_cast<int>(std::min<rlim_t>(2000, nofile > 300 ? nofile - 200 : 100));
  IdleConnections conns;
  const auto start = Clock::now();
  ASSERT_NO_FATAL_FAILURE(OpenIdleConnections(ShmPath(), f.n, conns));
  f.connect_seconds = Since(start);
  f.pending_expected = f.max_sessions - 1;  // the victim's session counts
  f.fds_during = WaitForFds(pid(), f.fds_before + f.pending_expected, 2, /*at_least=*/true);

  // While the connections are held: the victim steps; a new attach is refused, naming the limit.
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "during the attack"));
  auto refused = ShmChannel::Attach(ShmPath(), victim->spec.job_id, 0, victim->token, false);
  EXPECT_TRUE(IsError(refused.status(), absl::StatusCode::kResourceExhausted,
                      absl::StrCat("(--max-shm-sessions ", f.max_sessions, ")")));
  const double pending_gauge = Metric("muond_shm_pending_connections");
  EXPECT_LT(Since(start), f.timeout) << "the checks during the attack took too long";

  // Collect every connection's answer; after its answer, every connection is closed by the
  // daemon.
  f.answers =
      SortIdleAnswers(AwaitAnswers(conns, start, f.timeout + 10), f.max_sessions, f.timeout);
  f.closed = CountClosedByTheDaemon(conns.fds);
  for (int fd : conns.fds) close(fd);
  f.fds_after = WaitForFds(pid(), f.fds_before, 5);
  ExpectIdleFloodAnswered(f);
  // The operators' view: the refusals by reason, and the pending connections while held.
  std::cout << "  metrics: pending during " << pending_gauge << ", refused session_limit "
            << Refused("session_limit") << ", attach_timeout " << Refused("attach_timeout")
            << ", pending after " << Metric("muond_shm_pending_connections") << std::endl;
  EXPECT_EQ(pending_gauge, f.pending_expected);
  EXPECT_EQ(Refused("session_limit"), f.answers.over_limit + 1);  // and the ShmChannel attach
  EXPECT_EQ(Refused("attach_timeout"), f.answers.timed_out);
  EXPECT_EQ(Metric("muond_shm_pending_connections"), 0);

  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "after the attack"));
  ASSERT_NO_FATAL_FAILURE(ExpectHealthy("fresh-after-idle"));
  // The warnings are rate-limited: not one line per refused connection.
  const int warnings = CountOccurrences(daemon_->Log(), "(session_limit)");
  std::cout << "  session-limit warnings logged: " << warnings << std::endl;
  EXPECT_GE(warnings, 1);
  EXPECT_LE(warnings, 3);
}

// Fills the daemon's descriptor table with idle connections until one is refused, and returns
// that refusal in `first_refusal`; `held` gets the connections that got no answer (one answered
// late is not held).
void FillWithIdleConnections(const std::string& path, std::vector<int>& held,
                             Outcome& first_refusal) {
  while (first_refusal.kind == Outcome::kNothing && held.size() < 200) {
    const int fd = Connect(path);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    first_refusal = Receive(fd, 0.1);
    if (first_refusal.kind == Outcome::kNothing) {
      held.push_back(fd);
    } else {
      close(fd);
    }
  }
  for (size_t i = 0; i < held.size();) {
    if (Receive(held[i], 0).kind == Outcome::kNothing) {
      ++i;
      continue;
    }
    close(held[i]);
    held.erase(held.begin() + i);
  }
}

// Closes two of the `held` connections and waits until the daemon holds two descriptors fewer
// than `fds_full`.
void FreeTwoDescriptors(pid_t pid, int fds_full, std::vector<int>& held) {
  ASSERT_GE(held.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    close(held.back());
    held.pop_back();
  }
  EXPECT_EQ(WaitForFds(pid, fds_full - 2, 2), fds_full - 2);
}

// An attach of `v`'s rank cannot create its descriptors: RESOURCE_EXHAUSTED naming the job, the
// rank and RLIMIT_NOFILE `limit`.
void ExpectAttachShortOfDescriptorsRefused(const std::string& path, const Victim& v, rlim_t limit) {
  auto short_attach = ShmChannel::Attach(path, v.spec.job_id, 0, v.token, false);
  EXPECT_TRUE(IsError(
      short_attach.status(), absl::StatusCode::kResourceExhausted,
      absl::StrCat("job '", v.spec.job_id, "' rank 0: cannot set up the shared-memory session: ")));
  EXPECT_TRUE(absl::StrContains(short_attach.status().message(),
                                absl::StrCat("Too many open files (RLIMIT_NOFILE ", limit, ")")))
      << short_attach.status();
}

// Two more idle connections fill the descriptor table again.
void HoldTwoMoreConnections(const std::string& path, std::vector<int>& held) {
  for (int i = 0; i < 2; ++i) {
    const int fd = Connect(path);
    ASSERT_GE(fd, 0);
    held.push_back(fd);
  }
}

// The daemon stuck out of descriptors for 2 s with connections arriving: its CPU time meanwhile,
// and how many of the connections were refused with `out_of_fds`.
struct StuckWindow {
  double cpu_seconds = 0;
  double seconds = 0;
  int refused = 0;
  int attempts = 0;
};

StuckWindow ConnectWhileStuck(pid_t pid, const std::string& path, const std::string& out_of_fds) {
  StuckWindow w;
  const double cpu_before = CpuSeconds(pid);
  const auto window = Clock::now();
  while (Since(window) < 2) {
    const int fd = Connect(path);
    if (fd < 0) continue;
    ++w.attempts;
    w.refused += IsReply(Receive(fd, 1), absl::StatusCode::kResourceExhausted, out_of_fds) ? 1 : 0;
    close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  w.cpu_seconds = CpuSeconds(pid) - cpu_before;
  w.seconds = Since(window);
  return w;
}

// The daemon out of descriptors (RLIMIT_NOFILE lowered under it): connections are refused with
// RESOURCE_EXHAUSTED naming the cause, an attach that cannot create its five descriptors is
// refused and leaves the rank detached, the accept loop does not spin, and once the connections
// are gone a real attach and step work again.
TEST_F(ShmLimitsTest, OutOfDescriptorsNeitherSpinsNorWedges) {
  const bool flag = DaemonHasFlag("--shm-attach-timeout-seconds");
  std::vector<std::string> extra;
  if (flag) {
    extra = {"--shm-attach-timeout-seconds", "60", "--max-shm-pending-per-uid", "256",
             "--max-shm-pending-per-pid", "256"};
  }
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
  std::vector<int> held;
  Outcome first_refusal;
  ASSERT_NO_FATAL_FAILURE(FillWithIdleConnections(ShmPath(), held, first_refusal));
  const std::string out_of_fds = absl::StrCat(
      "muond is out of file descriptors (RLIMIT_NOFILE ", low.rlim_cur,
      "; accept: Too many open files): shared-memory connection refused, try again later");
  EXPECT_TRUE(IsReply(first_refusal, absl::StatusCode::kResourceExhausted, out_of_fds));
  const int fds_full = DaemonFds(pid());

  // Two descriptors free: not enough for an attach (a connection and five descriptors).
  ASSERT_NO_FATAL_FAILURE(FreeTwoDescriptors(pid(), fds_full, held));
  ExpectAttachShortOfDescriptorsRefused(ShmPath(), *second, low.rlim_cur);
  EXPECT_FALSE(RankAttached(*second)) << "a failed attach left the rank attached";
  // Full again.
  ASSERT_NO_FATAL_FAILURE(HoldTwoMoreConnections(ShmPath(), held));
  EXPECT_LT(Since(start), flag ? 50 : 4.5) << "the held connections may have timed out";

  // Stuck for 2 s with connections arriving: the daemon's CPU time hardly grows.
  const StuckWindow stuck = ConnectWhileStuck(pid(), ShmPath(), out_of_fds);
  const int fds_stuck = DaemonFds(pid());
  for (int fd : held) close(fd);
  const int fds_after = WaitForFds(pid(), fds_before, 5);
  std::cout << "out of descriptors: RLIMIT_NOFILE " << low.rlim_cur << ", " << held.size()
            << " idle connections filled it\n  daemon CPU while stuck: " << stuck.cpu_seconds
            << " s over " << stuck.seconds << " s; " << stuck.refused << " of " << stuck.attempts
            << " new connections refused RESOURCE_EXHAUSTED\n  daemon fds: before " << fds_before
            << ", full " << fds_full << ", stuck " << fds_stuck << ", after " << fds_after
            << std::endl;
  EXPECT_LT(stuck.cpu_seconds, 0.5) << "the accept loop spins";
  EXPECT_GE(stuck.attempts, 10);
  EXPECT_EQ(stuck.refused, stuck.attempts);
  EXPECT_LE(fds_stuck, static_cast<int>(low.rlim_cur) + above_limit);
  EXPECT_EQ(fds_after, fds_before);

  std::cout << "  metrics: refused out_of_descriptors " << Refused("out_of_descriptors")
            << ", attach_failed " << Refused("attach_failed") << std::endl;
  EXPECT_GE(Refused("out_of_descriptors"), stuck.refused + 1);
  EXPECT_EQ(Refused("attach_failed"), 1);

  // Descriptors are back (the limit still low): everything works again.
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "after the attack"));
  ASSERT_NO_FATAL_FAILURE(AttachVictim(*second));
  ASSERT_NO_FATAL_FAILURE(StepVictim(*second, "attached after the attack"));
  second->session.reset();
  ASSERT_NO_FATAL_FAILURE(ExpectHealthy("fresh-after-emfile"));
  const int warnings = CountOccurrences(daemon_->Log(), "(out_of_descriptors)");
  std::cout << "  out-of-descriptor warnings logged: " << warnings << std::endl;
  EXPECT_GE(warnings, 1);
  EXPECT_LE(warnings, 3);
}

}  // namespace
}  // namespace muond::shmtest
