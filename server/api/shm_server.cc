#include "server/api/shm_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/job_spec_proto.h"
#include "common/layout.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/shm_protocol.h"
#include "common/shm_region.h"
#include "muond/v1/muond.pb.h"
#include "server/api/shm_attach.h"
#include "server/api/shm_session.h"
#include "server/api/shm_wire.h"
#include "server/record/daemon_metrics.h"

namespace muond::server {

namespace shm = common::shm;
using shm_attach::Errno;
using shm_attach::PeerString;

absl::StatusOr<std::unique_ptr<ShmServer>> ShmServer::Start(const std::string& path,
                                                            JobRegistry* registry,
                                                            const ShmLimits& limits) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("shared-memory socket path too long: ", path));
  }
  if (limits.max_sessions == 0 || limits.attach_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "shared-memory limits: max_sessions and attach_timeout must be positive");
  }
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Errno("socket(AF_UNIX, SOCK_SEQPACKET)");
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  unlink(path.c_str());
  const mode_t old = umask(0117);
  const int bound = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  umask(old);
  if (bound != 0 || listen(fd, 64) != 0) {
    absl::Status s = Errno(absl::StrCat("bind/listen ", path));
    close(fd);
    return s;
  }
  chmod(path.c_str(), 0660);
  const int ep = epoll_create1(EPOLL_CLOEXEC);
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  const int reserve = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (ep < 0 || wake < 0 || reserve < 0) {
    absl::Status s = Errno("epoll_create1/eventfd/open(/dev/null)");
    for (int d : {fd, ep, wake, reserve}) {
      if (d >= 0) close(d);
    }
    return s;
  }
  DeclareMetrics();  // the families exist before the first scrape
  std::unique_ptr<ShmServer> server(new ShmServer(path, registry, limits, fd, ep, wake, reserve));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = fd;
  epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
  ev.data.fd = wake;
  epoll_ctl(ep, EPOLL_CTL_ADD, wake, &ev);
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  return server;
}

ShmServer::ShmServer(std::string path, JobRegistry* registry, const ShmLimits& limits,
                     int listen_fd, int epoll_fd, int wake_fd, int reserve_fd)
    : path_(std::move(path)),
      registry_(registry),
      limits_(limits),
      pending_per_uid_(limits.max_pending_per_uid != 0
                           ? limits.max_pending_per_uid
                           : std::max<size_t>(1, limits.max_sessions / 4)),
      pending_per_pid_(limits.max_pending_per_pid != 0 ? limits.max_pending_per_pid
                                                       : std::max<size_t>(1, pending_per_uid_ / 2)),
      listen_fd_(listen_fd),
      epoll_fd_(epoll_fd),
      wake_fd_(wake_fd),
      reserve_fd_(reserve_fd) {}

ShmServer::~ShmServer() {
  stopping_.store(true);
  const uint64_t one = 1;
  ssize_t unused = write(wake_fd_, &one, sizeof(one));
  (void)unused;
  thread_.join();
  {
    // The attaches being made finish (FinishAttach refuses them now that the loop stopped).
    absl::MutexLock lock(&post_mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(post_mu_) { return attach_workers_ == 0; };
    post_mu_.Await(absl::Condition(&idle));
  }
  RunPosted();
  std::vector<int> conns;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [conn, session] : sessions_) conns.push_back(conn);
  }
  for (int conn : conns) EndSession(conn, "muond is stopping");
  while (!pending_.empty()) ClosePending(pending_.begin()->first);
  if (reserve_fd_ >= 0) close(reserve_fd_);
  close(listen_fd_);
  close(epoll_fd_);
  close(wake_fd_);
  unlink(path_.c_str());
}

ShmServer::Usage ShmServer::usage() const {
  absl::MutexLock lock(&mu_);
  Usage u;
  for (const auto& [conn, session] : sessions_) {
    ++u.sessions;
    u.pinned_bytes += session->pinned_bytes;
    if (session->job == nullptr) continue;
    u.pinned_bytes_by_job[session->job->id()] += session->pinned_bytes;
    u.region_bytes_by_job[session->job->id()] += session->region_bytes;
  }
  return u;
}

std::map<std::pair<std::string, int>, uint64_t> ShmServer::shared_sessions() const {
  absl::MutexLock lock(&mu_);
  std::map<std::pair<std::string, int>, uint64_t> out;
  for (const auto& [conn, session] : sessions_) {
    if (session->job != nullptr) out[{session->job->id(), session->rank}] = session->session_id;
  }
  return out;
}

size_t ShmServer::session_count() const {
  absl::MutexLock lock(&mu_);
  return sessions_.size();
}

void ShmServer::Loop() {
  epoll_event events[32];
  while (!stopping_.load()) {
    heartbeat_.Beat();  // the watchdog ping needs this loop's progress (common/heartbeat.h)
    heartbeat_.StallPointForTesting();
    const int n = epoll_wait(epoll_fd_, events, 32, WaitMillis(Clock::now()));
    if (n < 0 && errno != EINTR) {
      MUOND_LOG(ERROR) << "shared-memory server: epoll_wait: " << std::strerror(errno);
      return;
    }
    for (int i = 0; i < n; ++i) Dispatch(events[i].data.fd, events[i].events);
    ExpireDeadlines(Clock::now());
  }
}

void ShmServer::Dispatch(int fd, uint32_t events) {
  if (fd == wake_fd_) {
    uint64_t count = 0;
    ssize_t unused = read(wake_fd_, &count, sizeof(count));
    (void)unused;
    return RunPosted();
  }
  if (fd == listen_fd_) return Accept();
  if (pending_.count(fd) != 0) return HandleAttach(fd);
  std::shared_ptr<ShmSession> doorbell_session;
  bool attached = false;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = by_doorbell_.find(fd); it != by_doorbell_.end()) doorbell_session = it->second;
    attached = sessions_.count(fd) != 0;
  }
  if (doorbell_session != nullptr) {
    HandleDoorbell(doorbell_session);
  } else if (attached && (events & (EPOLLIN | EPOLLHUP | EPOLLRDHUP | EPOLLERR))) {
    HandleSessionSocket(fd);
  }
}

int ShmServer::WaitMillis(Clock::time_point now) const {
  Clock::time_point next = Clock::time_point::max();
  if (!deadlines_.empty()) next = deadlines_.begin()->first;
  if (listen_paused_) next = std::min(next, listen_paused_until_);
  // Wakes at least every Heartbeat::kMaxWait to beat.
  const int64_t most = absl::ToInt64Milliseconds(common::Heartbeat::kMaxWait);
  if (next == Clock::time_point::max()) return static_cast<int>(most);
  if (next <= now) return 0;
  // Round up, so that the deadline has passed when epoll_wait returns.
  return static_cast<int>(
      std::min<int64_t>(std::chrono::ceil<std::chrono::milliseconds>(next - now).count(), most));
}

void ShmServer::ExpireDeadlines(Clock::time_point now) {
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    const int conn = deadlines_.begin()->second;
    RefusePending(conn,
                  absl::DeadlineExceededError(absl::StrCat(
                      "no shared-memory attach request completed within ",
                      absl::FormatDuration(limits_.attach_timeout),
                      " of connecting (--shm-attach-timeout-seconds); connection closed")),
                  "attach_timeout");
  }
  if (listen_paused_ && now >= listen_paused_until_) {
    if (reserve_fd_ < 0) reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = listen_fd_;
    epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, listen_fd_, &ev);
    listen_paused_ = false;
  }
}

void ShmServer::HandleSessionSocket(int conn) {
  // After attaching, the peer says one thing on the socket: the detach byte (a clean end,
  // possibly arriving with the hang-up); anything else ends the session as a failure.
  char byte = 0;
  const ssize_t n = recv(conn, &byte, 1, MSG_DONTWAIT | MSG_TRUNC);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  const bool detach = n == 1 && byte == shm::kDetachByte;
  EndSession(conn,
             detach   ? "detached"
             : n <= 0 ? "the peer hung up"
                      : absl::StrCat("unexpected message of ", n, " bytes after attach"),
             detach);
}

void ShmServer::Post(std::function<void()> task) {
  absl::MutexLock lock(&post_mu_);
  posted_.push_back(std::move(task));
  const uint64_t one = 1;
  ssize_t unused = write(wake_fd_, &one, sizeof(one));
  (void)unused;
}

void ShmServer::RunPosted() {
  std::vector<std::function<void()>> tasks;
  {
    absl::MutexLock lock(&post_mu_);
    tasks.swap(posted_);
  }
  for (auto& task : tasks) task();
}

void ShmServer::EndDeletedSession(int conn, uint64_t session_id) {
  EndSessionTelling(conn, session_id, [](const ShmSession& s) {
    return absl::NotFoundError(absl::StrCat("job '", s.job->id(),
                                            "' was deleted; its shared-memory session ",
                                            s.session_id, " (rank ", s.rank, ") ended"));
  }, "its job was deleted");
}

void ShmServer::EndTakenOverSessions(const Job& job, int rank, uint64_t new_session) {
  std::vector<std::pair<int, uint64_t>> old;  // (conn, session id)
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [conn, s] : sessions_) {
      if (s->job.get() == &job && s->rank == rank && s->session_id != new_session) {
        old.emplace_back(conn, s->session_id);
      }
    }
  }
  // Its regions go now, not when its (presumably dead) peer closes the socket.
  for (const auto& [conn, id] : old) {
    EndSessionTelling(conn, id, [new_session](const ShmSession& s) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", s.job->id(), "' rank ", s.rank, ": shared-memory session ", s.session_id,
          " was taken over by session ", new_session, " (attach with takeover)"));
    }, absl::StrCat("taken over by session ", new_session));
  }
}

void ShmServer::EndSessionTelling(
    int conn, uint64_t session_id,
    const std::function<absl::Status(const ShmSession&)>& status_of, const std::string& why) {
  std::shared_ptr<ShmSession> s;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(conn);
    if (it == sessions_.end() || it->second->session_id != session_id) return;  // ended already
    s = it->second;
  }
  const absl::Status gone = status_of(*s);
  // Submissions not read yet are answered with it, and so is the next one the peer sends (its
  // sequence number is the count of submissions so far): whatever the peer waits for, it learns
  // why the session ended before it sees the socket close.
  shm::Ring* ring = s->completions->ring();
  const uint64_t head = ring->header.sub_head.load(std::memory_order_acquire);
  if (shm_wire::CheckSubmissionHead(head, s->sub_tail).ok()) {
    for (; s->sub_tail < head; ++s->sub_tail) {
      const shm::Submission sub = ring->subs[s->sub_tail % shm::kRingSlots];
      s->completions->Complete(sub.seq, sub.step, gone, false, 0);
    }
    ring->header.sub_tail.store(s->sub_tail, std::memory_order_release);
  }
  s->completions->Complete(s->sub_tail, -1, gone, false, 0);
  EndSession(conn, why);
}

void ShmServer::EndSession(int conn, const std::string& why, bool clean) {
  std::shared_ptr<ShmSession> session;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(conn);
    if (it == sessions_.end()) return;
    session = std::move(it->second);
    sessions_.erase(it);
    by_doorbell_.erase(session->doorbell);
  }
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn, nullptr);
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, session->doorbell, nullptr);
  session->job->EndSharedSession(session->rank, session->session_id, session->regions.get(), clean);
  MUOND_LOG(INFO) << "job '" << session->job->id() << "' rank " << session->rank
                  << ": shared-memory session " << session->session_id << " (peer "
                  << PeerString(session->peer) << ") ended: " << why;
  close(conn);
}

}  // namespace muond::server
