#include "tests/shm/shm_limits_util.h"

#include <dirent.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/metrics_scrape.h"
#include "tests/integration/multirank_util.h"

namespace muond::shmtest {

using client::Transport;
using integration::DaemonProcess;
using integration::Matrix;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

bool DaemonHasFlag(const std::string& flag) {
  static const std::string help = [] {
    integration::ProcessResult r = integration::RunProcess({MUOND_BIN, "--help"});
    return r.out + r.err;
  }();
  return absl::StrContains(help, flag);
}

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

int DaemonFdsFrom(pid_t pid, int at_least) {
  int n = 0;
  if (DIR* d = opendir(absl::StrCat("/proc/", pid, "/fd").c_str())) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.' && std::atoi(e->d_name) >= at_least;
    closedir(d);
  }
  return n;
}

int WaitForFds(pid_t pid, int want, double timeout_seconds, bool at_least) {
  const auto start = Clock::now();
  int fds = DaemonFds(pid);
  while ((at_least ? fds < want : fds != want) && Since(start) < timeout_seconds) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    fds = DaemonFds(pid);
  }
  return fds;
}

rlim_t RaiseNoFileLimit() {
  rlimit lim{};
  getrlimit(RLIMIT_NOFILE, &lim);
  lim.rlim_cur = lim.rlim_max;
  setrlimit(RLIMIT_NOFILE, &lim);
  getrlimit(RLIMIT_NOFILE, &lim);
  return lim.rlim_cur;
}

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

std::string Outcome::ToString() const {
  if (kind == kNothing) return "nothing";
  if (kind == kClosed) return "closed without a reply";
  return absl::StrCat("reply ", absl::StatusCodeToString(static_cast<absl::StatusCode>(code)), ": ",
                      message, " (", nfds, " descriptors)");
}

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
  return ::testing::AssertionFailure()
         << "got " << o.ToString() << "; want " << absl::StatusCodeToString(code) << " containing '"
         << text << "'";
}

void ShmLimitsTest::TearDown() {
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

void ShmLimitsTest::StartDaemon(std::vector<std::string> flags) {
  flags.insert(flags.end(), {"--metrics-address", "127.0.0.1:0"});
  auto d = DaemonProcess::StartIn(dir_.path(), flags);
  ASSERT_TRUE(d.ok()) << d.status();
  daemon_ = *std::move(d);
  auto c = client::Client::Connect(daemon_->address());
  ASSERT_TRUE(c.ok()) << c.status();
  client_ = *std::move(c);
}

double ShmLimitsTest::Metric(const std::string& name,
                             const std::map<std::string, std::string>& labels) {
  const std::string log = daemon_->Log();
  const std::string mark = "metrics on http://";
  const size_t at = log.find(mark);
  if (at == std::string::npos) return -1;
  const size_t end = log.find("/metrics", at + mark.size());
  auto samples = client::ScrapeMetrics(log.substr(at + mark.size(), end - at - mark.size()));
  if (!samples.ok()) return -1;
  return client::FindSample(*samples, name, labels, -1);
}

std::unique_ptr<Victim> ShmLimitsTest::NewVictim(const std::string& id, int steps, uint64_t seed) {
  auto v = std::make_unique<Victim>();
  v->spec = MakeSpec(id, 1, 0, {Matrix("q", {32, 24}), Matrix("o", {24, 32})});
  v->grads = integration::MakeGradients(v->spec.matrices, steps, seed);
  auto ref = RunTrajectory(*client_, MakeSpec(id + "-ref", 1, 0, v->spec.matrices), Api::kGrpcStep,
                           v->grads);
  EXPECT_TRUE(ref.ok()) << ref.status();
  if (ref.ok()) v->want = ref->updates[0];
  auto token = client_->CreateJob(v->spec);
  EXPECT_TRUE(token.ok()) << token.status();
  if (token.ok()) v->token = *token;
  return v;
}

void ShmLimitsTest::AttachVictim(Victim& v) {
  auto s = client_->Attach(v.spec.job_id, 0, v.token, false, Transport::kShm);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ((*s)->transport(), Transport::kShm);
  v.session = *std::move(s);
}

void ShmLimitsTest::StepVictim(Victim& v, const std::string& when) {
  ASSERT_NE(v.session, nullptr);
  ASSERT_LT(static_cast<size_t>(v.next_step), v.want.size());
  auto u = StepWith(Api::kShmStep, *v.session, v.next_step, v.grads[v.next_step]);
  ASSERT_TRUE(u.ok()) << "victim " << v.spec.job_id << " step " << v.next_step << " (" << when
                      << "): " << u.status();
  EXPECT_EQ(*u, v.want[v.next_step]) << "victim step " << v.next_step << " (" << when << ")";
  ++v.next_step;
}

void ShmLimitsTest::ExpectHealthy(const std::string& id) {
  ASSERT_TRUE(daemon_->running()) << integration::DescribeWaitStatus(daemon_->exit_status());
  ASSERT_TRUE(client_->Health(5).ok());
  std::unique_ptr<Victim> fresh = NewVictim(id, 1, 77);
  ASSERT_NO_FATAL_FAILURE(AttachVictim(*fresh));
  ASSERT_NO_FATAL_FAILURE(StepVictim(*fresh, "fresh job after the attack"));
  fresh->session.reset();
  EXPECT_TRUE(client_->DeleteJob(fresh->spec.job_id, fresh->token).ok());
}

bool ShmLimitsTest::RankAttached(const Victim& v) {
  auto st = client_->GetJob(v.spec.job_id, v.token);
  EXPECT_TRUE(st.ok()) << st.status();
  return st.ok() && st->ranks(0).attached();
}

}  // namespace muond::shmtest
