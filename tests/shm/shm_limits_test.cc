// The shared-memory data plane against careless or hostile local users (ShmLimits in
// server/shm_server.h): thousands of idle connections, a daemon out of file descriptors, junk on
// the socket, and peers that go away before reading their attach reply. Each case asserts the
// exact code and message the offending connection gets, and that a victim job attached before the
// attack still steps over shared memory with the reference results, that a new attach works
// afterwards, and that the daemon's descriptors come back to where they were.
//
// Every test starts its own muond. When muond takes --max-shm-sessions and
// --shm-attach-timeout-seconds, the tests set them (smaller numbers, faster runs); otherwise they
// run against the defaults (256 connections, 5 s).
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/metrics_scrape.h"
#include "client/shm_channel.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"
#include "tests/shm/shm_test_util.h"

namespace muond::shmtest {
namespace {

using client::ShmChannel;
using client::Transport;
using integration::DaemonProcess;
using integration::Matrix;
using integration::TempDir;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The muond flags this build has (main.cc wires them to ShmLimits).
bool DaemonHasFlag(const std::string& flag) {
  static const std::string help = [] {
    integration::ProcessResult r = integration::RunProcess({MUOND_BIN, "--help"});
    return r.out + r.err;
  }();
  return absl::StrContains(help, flag);
}

// User + system CPU seconds of a process (/proc/PID/stat fields 14 and 15).
double CpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return -1;
  std::istringstream fields(stat.substr(paren + 2));
  std::string skip;
  for (int i = 3; i < 14; ++i) fields >> skip;  // state .. cmajflt
  long utime = 0, stime = 0;
  fields >> utime >> stime;
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

int DaemonFds(pid_t pid) { return MeasureProcess(pid).fds; }

// Descriptors of the process numbered `at_least` or higher (RLIMIT_NOFILE bounds the numbers of
// new descriptors, not the ones already open).
int DaemonFdsFrom(pid_t pid, int at_least) {
  int n = 0;
  if (DIR* d = opendir(absl::StrCat("/proc/", pid, "/fd").c_str())) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.' && std::atoi(e->d_name) >= at_least;
    closedir(d);
  }
  return n;
}

// Polls until the daemon holds `want` descriptors (at least `want` with `at_least`); returns the
// last count.
int WaitForFds(pid_t pid, int want, double timeout_seconds, bool at_least = false) {
  const auto start = Clock::now();
  int fds = DaemonFds(pid);
  while ((at_least ? fds < want : fds != want) && Since(start) < timeout_seconds) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    fds = DaemonFds(pid);
  }
  return fds;
}

// This process's soft RLIMIT_NOFILE raised to the hard limit; returns the new soft limit.
rlim_t RaiseNoFileLimit() {
  rlimit lim{};
  getrlimit(RLIMIT_NOFILE, &lim);
  lim.rlim_cur = lim.rlim_max;
  setrlimit(RLIMIT_NOFILE, &lim);
  getrlimit(RLIMIT_NOFILE, &lim);
  return lim.rlim_cur;
}

// A connection to the shm socket that has sent nothing; -1 on failure. connect() blocks while
// the daemon's backlog is full, at most 5 s.
int Connect(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const timeval timeout{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

std::string AttachRequest(const std::string& job_id, int rank, const std::string& token) {
  v1::ShmAttachRequest req;
  req.set_job_id(job_id);
  req.set_rank(rank);
  req.set_token(token);
  return req.SerializeAsString();
}

// What a raw connection received from the daemon.
struct Outcome {
  enum Kind { kNothing, kReply, kClosed } kind = kNothing;
  int code = -1;
  std::string message;
  int nfds = 0;  // descriptors that came with the reply (closed here)
  std::string ToString() const {
    if (kind == kNothing) return "nothing";
    if (kind == kClosed) return "closed without a reply";
    return absl::StrCat("reply ", absl::StatusCodeToString(static_cast<absl::StatusCode>(code)),
                        ": ", message, " (", nfds, " descriptors)");
  }
};

// The next datagram (or the hang-up) on `fd`, waiting at most `timeout_seconds`.
Outcome Receive(int fd, double timeout_seconds) {
  Outcome o;
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(timeout_seconds * 1000)) <= 0) return o;
  std::string buf(1 << 16, '\0');
  iovec iov{buf.data(), buf.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n = recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  // A reset (the daemon closed with data of ours unread) comes before a queued answer.
  if (n < 0 && errno == ECONNRESET) n = recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return o;
  if (n <= 0) {
    o.kind = Outcome::kClosed;
    return o;
  }
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      o.nfds = static_cast<int>((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
      for (int i = 0; i < o.nfds; ++i) {
        int d;
        std::memcpy(&d, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        close(d);
      }
    }
  }
  v1::ShmAttachResponse reply;
  o.kind = Outcome::kReply;
  if (!reply.ParseFromArray(buf.data(), static_cast<int>(n))) {
    o.message = "(unparsable reply)";
    return o;
  }
  o.code = reply.code();
  o.message = reply.message();
  return o;
}

::testing::AssertionResult IsReply(const Outcome& o, absl::StatusCode code,
                                   const std::string& text) {
  if (o.kind == Outcome::kReply && o.code == static_cast<int>(code) &&
      absl::StrContains(o.message, text)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "got " << o.ToString() << "; want "
                                       << absl::StatusCodeToString(code) << " containing '" << text
                                       << "'";
}

::testing::AssertionResult IsError(const absl::Status& s, absl::StatusCode code,
                                   const std::string& text) {
  if (s.code() == code && absl::StrContains(s.message(), text)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "got " << s << "; want " << absl::StatusCodeToString(code)
                                       << " containing '" << text << "'";
}

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

class ShmLimitsTest : public ::testing::Test {
 protected:
  void TearDown() override {
    client_.reset();
    if (daemon_ != nullptr && daemon_->running()) {
      const int status = daemon_->Stop();
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
          << "muond " << integration::DescribeWaitStatus(status) << " after SIGTERM";
    }
    if (HasFailure() && daemon_ != nullptr) {
      const std::string log = daemon_->Log();
      std::cout << "muond log (last 4000 bytes):\n"
                << log.substr(log.size() > 4000 ? log.size() - 4000 : 0) << std::endl;
    }
  }

  void StartDaemon(std::vector<std::string> flags) {
    flags.insert(flags.end(), {"--metrics-address", "127.0.0.1:0"});
    auto d = DaemonProcess::StartIn(dir_.path(), flags);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    auto c = client::Client::Connect(daemon_->address());
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }

  // The value of a sample of the daemon's /metrics (-1 when absent or not reachable).
  double Metric(const std::string& name, const std::map<std::string, std::string>& labels = {}) {
    const std::string log = daemon_->Log();
    const std::string mark = "metrics on http://";
    const size_t at = log.find(mark);
    if (at == std::string::npos) return -1;
    const size_t end = log.find("/metrics", at + mark.size());
    auto samples = client::ScrapeMetrics(log.substr(at + mark.size(), end - at - mark.size()));
    if (!samples.ok()) return -1;
    return client::FindSample(*samples, name, labels, -1);
  }
  double Refused(const std::string& reason) {
    return Metric("muond_shm_connections_refused_total", {{"reason", reason}});
  }

  std::string ShmPath() const { return client::ShmSocketFor(daemon_->address()); }
  pid_t pid() const { return daemon_->pid(); }

  std::unique_ptr<Victim> NewVictim(const std::string& id, int steps, uint64_t seed) {
    auto v = std::make_unique<Victim>();
    v->spec = MakeSpec(id, 1, 0, {Matrix("q", {32, 24}), Matrix("o", {24, 32})});
    v->grads = integration::MakeGradients(v->spec.matrices, steps, seed);
    auto ref =
        RunTrajectory(*client_, MakeSpec(id + "-ref", 1, 0, v->spec.matrices), Api::kGrpcStep,
                      v->grads);
    EXPECT_TRUE(ref.ok()) << ref.status();
    if (ref.ok()) v->want = ref->updates[0];
    auto token = client_->CreateJob(v->spec);
    EXPECT_TRUE(token.ok()) << token.status();
    if (token.ok()) v->token = *token;
    return v;
  }

  // Attaches the victim's rank over shared memory (the client library).
  void AttachVictim(Victim& v) {
    auto s = client_->Attach(v.spec.job_id, 0, v.token, false, Transport::kShm);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_EQ((*s)->transport(), Transport::kShm);
    v.session = *std::move(s);
  }

  // One step of the victim over shared memory: the reference update, bit for bit.
  void StepVictim(Victim& v, const std::string& when) {
    ASSERT_NE(v.session, nullptr);
    ASSERT_LT(static_cast<size_t>(v.next_step), v.want.size());
    auto u = StepWith(Api::kShmStep, *v.session, v.next_step, v.grads[v.next_step]);
    ASSERT_TRUE(u.ok()) << "victim " << v.spec.job_id << " step " << v.next_step << " (" << when
                        << "): " << u.status();
    EXPECT_EQ(*u, v.want[v.next_step]) << "victim step " << v.next_step << " (" << when << ")";
    ++v.next_step;
  }

  // The daemon serves: Health is OK and a job created now attaches over shared memory and
  // computes the reference update.
  void ExpectHealthy(const std::string& id) {
    ASSERT_TRUE(daemon_->running()) << integration::DescribeWaitStatus(daemon_->exit_status());
    ASSERT_TRUE(client_->Health(5).ok());
    std::unique_ptr<Victim> fresh = NewVictim(id, 1, 77);
    ASSERT_NO_FATAL_FAILURE(AttachVictim(*fresh));
    ASSERT_NO_FATAL_FAILURE(StepVictim(*fresh, "fresh job after the attack"));
    fresh->session.reset();
    EXPECT_TRUE(client_->DeleteJob(fresh->spec.job_id, fresh->token).ok());
  }

  bool RankAttached(const Victim& v) {
    auto st = client_->GetJob(v.spec.job_id, v.token);
    EXPECT_TRUE(st.ok()) << st.status();
    return st.ok() && st->ranks(0).attached();
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::Client> client_;
};

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

// Junk instead of an attach request ends that connection with INVALID_ARGUMENT; a valid attach
// followed by junk gets its session and then loses it (the rank is detached, the job not fenced).
// The victim steps correctly after each.
TEST_F(ShmLimitsTest, JunkOnTheSocketEndsOnlyThatConnection) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon({}));
  std::unique_ptr<Victim> victim = NewVictim("victim", 6, 14);
  std::unique_ptr<Victim> target = NewVictim("target", 1, 15);
  ASSERT_NO_FATAL_FAILURE(AttachVictim(*victim));
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "before the junk"));
  const int fds_before = DaemonFds(pid());
  std::mt19937 rng(42);
  int bad_requests = 0;

  struct Junk {
    std::string what;
    std::string bytes;
    absl::StatusCode code;
    std::string text;
  };
  std::string random(4096, '\0');
  for (char& c : random) c = static_cast<char>(rng());
  random[0] = '\x07';  // field 0, wire type 7: never a valid protobuf
  const std::vector<Junk> junk = {
      {"random bytes", random, absl::StatusCode::kInvalidArgument,
       "malformed shared-memory attach request (4096 bytes)"},
      {"1 MiB datagram", std::string(1 << 20, 'x'), absl::StatusCode::kInvalidArgument,
       "shared-memory attach request of 1048576 bytes is larger than the limit of 65536 bytes"},
      {"empty datagram", "", absl::StatusCode::kInvalidArgument,
       "empty shared-memory attach request"},
      {"attach request for no job", AttachRequest("no-such-job", 0, "x"),
       absl::StatusCode::kNotFound, "no-such-job"},
  };
  for (const Junk& j : junk) {
    SCOPED_TRACE(j.what);
    const int fd = Connect(ShmPath());
    ASSERT_GE(fd, 0);
    // A datagram larger than the default socket buffer needs a larger one (root may force it).
    const int sndbuf = static_cast<int>(j.bytes.size()) + (1 << 16);
    if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &sndbuf, sizeof(sndbuf)) != 0) {
      setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
    }
    const ssize_t sent = send(fd, j.bytes.data(), j.bytes.size(), MSG_NOSIGNAL);
    if (sent < 0 && errno == EMSGSIZE) {
      std::cout << j.what << ": the kernel refuses a datagram this large (not root?): skipped"
                << std::endl;
      close(fd);
      continue;
    }
    ASSERT_EQ(sent, static_cast<ssize_t>(j.bytes.size())) << std::strerror(errno);
    const Outcome answer = Receive(fd, 5);
    EXPECT_TRUE(IsReply(answer, j.code, j.text));
    bad_requests += j.code == absl::StatusCode::kInvalidArgument;
    std::cout << "junk: " << j.what << " (" << j.bytes.size() << " bytes) -> " << answer.ToString()
              << std::endl;
    EXPECT_EQ(Receive(fd, 5).kind, Outcome::kClosed) << "the daemon kept the connection";
    close(fd);
    ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, j.what));
  }

  // A valid attach, then garbage: the session is set up, then ended as a failure.
  {
    const int fd = Connect(ShmPath());
    ASSERT_GE(fd, 0);
    const std::string req = AttachRequest(target->spec.job_id, 0, target->token);
    ASSERT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
    ASSERT_EQ(send(fd, random.data(), 100, MSG_NOSIGNAL), 100);
    const Outcome answer = Receive(fd, 5);
    EXPECT_TRUE(IsReply(answer, absl::StatusCode::kOk, "")) << answer.ToString();
    EXPECT_EQ(answer.nfds, 5);
    EXPECT_EQ(Receive(fd, 5).kind, Outcome::kClosed) << "the daemon kept the session";
    close(fd);
    EXPECT_TRUE(integration::WaitForJob(
        *client_, target->spec.job_id, target->token,
        [](const v1::JobStatus& st) { return !st.ranks(0).attached() && !st.fenced(); }, 5))
        << "the rank stayed attached, or the job was fenced";
    EXPECT_TRUE(absl::StrContains(daemon_->Log(), "ended: unexpected message of 100 bytes after "
                                                  "attach"));
    ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "attach + garbage"));
  }
  EXPECT_EQ(WaitForFds(pid(), fds_before, 5), fds_before);
  EXPECT_EQ(Refused("bad_request"), bad_requests);
  ASSERT_NO_FATAL_FAILURE(AttachVictim(*target));
  ASSERT_NO_FATAL_FAILURE(StepVictim(*target, "attached after the garbage"));
  target->session.reset();
  ASSERT_NO_FATAL_FAILURE(ExpectHealthy("fresh-after-junk"));
}

// A peer that sends its attach request and goes away (closes, or shuts down its receiving side so
// that the reply cannot be delivered) leaves the rank detached: the same rank attaches again
// without takeover. The victim is unaffected.
TEST_F(ShmLimitsTest, PeerGoneBeforeTheReplyLeavesTheRankDetached) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon({}));
  std::unique_ptr<Victim> victim = NewVictim("victim", 3, 16);
  std::unique_ptr<Victim> target = NewVictim("target", 1, 17);
  ASSERT_NO_FATAL_FAILURE(AttachVictim(*victim));
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "before"));
  const int fds_before = DaemonFds(pid());
  const std::string req = AttachRequest(target->spec.job_id, 0, target->token);

  // 1. Send and close at once, many times (the daemon sees the hang-up before or after it
  // answered).
  for (int i = 0; i < 20; ++i) {
    const int fd = Connect(ShmPath());
    ASSERT_GE(fd, 0);
    ASSERT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
    close(fd);
  }
  EXPECT_EQ(WaitForFds(pid(), fds_before, 5), fds_before);
  {
    auto again = ShmChannel::Attach(ShmPath(), target->spec.job_id, 0, target->token, false);
    ASSERT_TRUE(again.ok()) << "the rank stayed attached: " << again.status();
  }
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "after send-and-close"));

  // 2. The reply cannot be delivered (the peer shut down its receiving side): sendmsg fails.
  {
    const int fd = Connect(ShmPath());
    ASSERT_GE(fd, 0);
    ASSERT_EQ(shutdown(fd, SHUT_RD), 0);
    ASSERT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
    // The daemon closes the connection: both directions are then shut.
    pollfd p{fd, POLLHUP, 0};
    const auto start = Clock::now();
    while (Since(start) < 5 && !(poll(&p, 1, 20) > 0 && (p.revents & POLLHUP))) {
    }
    EXPECT_TRUE(p.revents & POLLHUP) << "the daemon kept the connection";
    close(fd);
  }
  EXPECT_EQ(WaitForFds(pid(), fds_before, 5), fds_before);
  EXPECT_FALSE(RankAttached(*target));
  EXPECT_EQ(Refused("reply_failed"), 1);
  EXPECT_TRUE(absl::StrContains(daemon_->Log(), "shared-memory attach abandoned: sendmsg of the "
                                                "shared-memory attach reply: Broken pipe"));
  ASSERT_NO_FATAL_FAILURE(AttachVictim(*target));
  ASSERT_NO_FATAL_FAILURE(StepVictim(*target, "attached after the failed reply"));
  target->session.reset();
  ASSERT_NO_FATAL_FAILURE(StepVictim(*victim, "after the failed reply"));
  ASSERT_NO_FATAL_FAILURE(ExpectHealthy("fresh-after-hangups"));
}

}  // namespace
}  // namespace muond::shmtest
