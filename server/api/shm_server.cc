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
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/job_spec_proto.h"
#include "common/layout.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/shm_protocol.h"
#include "common/shm_region.h"
#include "server/ops/daemon_metrics.h"
#include "server/api/shm_attach.h"
#include "server/api/shm_session.h"
#include "muond/v1/muond.pb.h"

namespace muond::server {

namespace shm = common::shm;
using shm_attach::Errno;
using shm_attach::NoFileLimit;
using shm_attach::PeerString;
using shm_attach::PeerOf;
using shm_attach::PeerHungUp;
using shm_attach::SendReply;
using shm_attach::DrainAndClose;
using shm_attach::ErrorReply;
using shm_attach::ParseAttachRequest;
using shm_attach::Authorize;
using shm_attach::CreateSessionResources;
using shm_attach::SetupError;
using shm_attach::OutOfDescriptors;

namespace {

// Connections accepted per wake-up of the listening socket, so that a flood of connections does
// not hold up the doorbells of attached sessions (the level-triggered socket wakes us again).
constexpr int kAcceptBatch = 64;
// How long the listening socket is ignored after the process ran out of descriptors.
constexpr auto kOutOfDescriptorsPause = std::chrono::milliseconds(100);
// At most one warning per reason this often; the ones held back are counted in the next.
constexpr auto kRefusalLogPeriod = std::chrono::seconds(10);

// Why a connection was refused or dropped before attaching: the `reason` label of
// muond_shm_connections_refused_total.
constexpr const char* kReasons[] = {"session_limit", "attach_timeout", "out_of_descriptors",
                                    "bad_request", "attach_failed", "reply_failed"};

// The server's own metrics, declared next to the code that updates them.
struct ShmMetrics {
  ShmMetrics() {
    common::Registry& r = common::DefaultRegistry();
    auto f = r.AddCounter("muond_shm_connections_refused_total",
                          "Shared-memory connections answered with an error (or dropped) before "
                          "a session was attached, by reason.");
    auto g = r.AddGauge("muond_shm_pending_connections",
                        "Shared-memory connections accepted and not attached yet.");
    if (!f.ok() || !g.ok()) {
      MUOND_LOG(ERROR) << "metrics: " << (f.ok() ? g.status() : f.status());
      return;
    }
    for (const char* reason : kReasons) refused[reason] = &(*f)->Add({{"reason", reason}});
    pending = &(*g)->Add({});
  }
  std::map<std::string, common::Counter*> refused;
  common::Gauge* pending = nullptr;
};

ShmMetrics& Metrics() {
  static ShmMetrics* metrics = new ShmMetrics();
  return *metrics;
}

void CountRefusal(const char* reason) {
  auto it = Metrics().refused.find(reason);
  if (it != Metrics().refused.end()) it->second->Increment();
}

}  // namespace

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
  Metrics();  // declares the families before the first scrape
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
  }
  return u;
}

size_t ShmServer::session_count() const {
  absl::MutexLock lock(&mu_);
  return sessions_.size();
}

void ShmServer::Loop() {
  epoll_event events[32];
  while (!stopping_.load()) {
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
  if (fd == wake_fd_) return;
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
  if (next == Clock::time_point::max()) return -1;
  if (next <= now) return 0;
  // Round up, so that the deadline has passed when epoll_wait returns.
  return static_cast<int>(
      std::min<int64_t>(std::chrono::ceil<std::chrono::milliseconds>(next - now).count(), 60000));
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

void ShmServer::Accept() {
  bool out_of_descriptors = false;
  for (int i = 0; i < kAcceptBatch; ++i) {
    const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (conn >= 0) {
      Admit(conn);
      continue;
    }
    const int err = errno;
    if (err == EINTR || err == ECONNABORTED) continue;
    if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
      // The connection stays in the backlog and keeps the socket readable: without a pause the
      // level-triggered loop would spin until descriptors come back.
      out_of_descriptors = true;
      if (RefuseWithoutDescriptors(err)) continue;
    }
    break;
  }
  if (out_of_descriptors) PauseListening(Clock::now());
}

void ShmServer::Admit(int conn) {
  size_t attached = 0;
  {
    absl::MutexLock lock(&mu_);
    attached = sessions_.size();
  }
  if (attached + pending_.size() >= limits_.max_sessions) {
    const absl::Status s = absl::ResourceExhaustedError(absl::StrCat(
        "muond holds ", attached, " shared-memory sessions and ", pending_.size(),
        " connections not attached yet, the limit (--max-shm-sessions ", limits_.max_sessions,
        "); connection refused, try again later"));
    (void)SendReply(conn, ErrorReply(s), nullptr, 0);
    CountRefusal("session_limit");
    LogRefusal("session_limit", s, PeerOf(conn));
    DrainAndClose(conn);
    return;
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.fd = conn;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, conn, &ev) != 0) {
    const absl::Status s = Errno("epoll_ctl (new shared-memory connection)");
    (void)SendReply(conn, ErrorReply(s), nullptr, 0);
    CountRefusal("out_of_descriptors");
    LogRefusal("out_of_descriptors", s, PeerOf(conn));
    DrainAndClose(conn);
    return;
  }
  AddPending(conn, PeerOf(conn));
}

bool ShmServer::RefuseWithoutDescriptors(int err) {
  const absl::Status s = OutOfDescriptors(err);
  if (reserve_fd_ < 0) {
    LogRefusal("out_of_descriptors", s, ShmPeer{});
    return false;
  }
  close(reserve_fd_);
  const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (conn >= 0) {
    (void)SendReply(conn, ErrorReply(s), nullptr, 0);
    CountRefusal("out_of_descriptors");
    LogRefusal("out_of_descriptors", s, PeerOf(conn));
    DrainAndClose(conn);
  }
  // Another thread may have taken the descriptor meanwhile: then retried when listening resumes.
  reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  return conn >= 0 && reserve_fd_ >= 0;
}

void ShmServer::PauseListening(Clock::time_point now) {
  epoll_event ev{};
  ev.events = 0;
  ev.data.fd = listen_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, listen_fd_, &ev);
  listen_paused_ = true;
  listen_paused_until_ = now + kOutOfDescriptorsPause;
}

void ShmServer::HandleAttach(int conn) {
  const ShmPeer peer = pending_.at(conn).peer;
  if (PeerHungUp(conn)) {  // nobody would read the reply
    ClosePending(conn);
    return;
  }
  std::string buf(limits_.max_attach_request_bytes, '\0');
  // MSG_TRUNC: the datagram's full length, even when it is larger than the buffer.
  const ssize_t n = recv(conn, buf.data(), buf.size(), MSG_DONTWAIT | MSG_TRUNC);
  if (n < 0) {
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) ClosePending(conn);
    return;
  }
  auto req = ParseAttachRequest(buf.data(), static_cast<size_t>(n),
                                limits_.max_attach_request_bytes);
  if (!req.ok()) return RefusePending(conn, req.status(), "bad_request");
  if (shutting_down_.load()) {
    return RefusePending(conn, absl::UnavailableError("muond is shutting down"), nullptr);
  }
  auto job = Authorize(*registry_, *req);
  if (!job.ok()) return RefusePending(conn, job.status(), nullptr);
  auto session_id = (*job)->Attach(req->rank(), req->takeover());
  if (!session_id.ok()) return RefusePending(conn, session_id.status(), nullptr);
  auto session = std::make_shared<ShmSession>();
  session->conn = conn;
  session->peer = peer;
  session->job = *job;
  session->rank = req->rank();
  session->session_id = *session_id;
  const std::string who = absl::StrCat("job '", req->job_id(), "' rank ", req->rank());
  v1::ShmAttachResponse reply;
  if (absl::Status s = CreateSessionResources(*session, reply); !s.ok()) {
    (void)(*job)->Detach(req->rank(), *session_id);
    return RefusePending(conn, SetupError(who, s), "attach_failed");
  }
  const int fds[shm::kNumFds] = {session->regions->in.fd(), session->regions->out.fd(),
                                 session->completions->ring_fd(), session->doorbell,
                                 session->completions->event_fd()};
  if (absl::Status s = SendReply(conn, reply, fds, shm::kNumFds); !s.ok()) {
    // The peer never got its session: detach the rank, so that it can attach again. The session's
    // descriptors close with it.
    (void)(*job)->Detach(req->rank(), *session_id);
    MUOND_LOG(WARNING) << who << " (peer " << PeerString(peer)
                       << "): shared-memory attach abandoned: " << s.message();
    CountRefusal("reply_failed");
    ClosePending(conn);
    return;
  }
  RemovePending(conn);
  RegisterSession(session, who, reply.pinned());
}

void ShmServer::RegisterSession(const std::shared_ptr<ShmSession>& session, const std::string& who,
                                bool pinned) {
  {
    absl::MutexLock lock(&mu_);
    sessions_[session->conn] = session;
    by_doorbell_[session->doorbell] = session;
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = session->doorbell;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, session->doorbell, &ev);
  if (!pinned) {
    MUOND_LOG(WARNING) << who << ": shared regions are not locked in memory (mlock failed; raise "
                                 "RLIMIT_MEMLOCK, e.g. LimitMEMLOCK=infinity)";
  }
  MUOND_LOG(INFO) << who << ": shared-memory session " << session->session_id << " (peer "
                  << PeerString(session->peer) << "), 2 x " << session->buffer_bytes
                  << " bytes per direction";
}

void ShmServer::RefusePending(int conn, const absl::Status& status, const char* reason) {
  (void)SendReply(conn, ErrorReply(status), nullptr, 0);
  if (reason != nullptr) {
    CountRefusal(reason);
    LogRefusal(reason, status, pending_.at(conn).peer);
  }
  ClosePending(conn);
}

void ShmServer::AddPending(int conn, const ShmPeer& peer) {
  const Clock::time_point deadline =
      Clock::now() + absl::ToChronoNanoseconds(limits_.attach_timeout);
  pending_[conn] = Pending{deadline, peer};
  deadlines_.insert({deadline, conn});
  if (Metrics().pending != nullptr) Metrics().pending->Set(static_cast<double>(pending_.size()));
}

void ShmServer::RemovePending(int conn) {
  auto it = pending_.find(conn);
  if (it == pending_.end()) return;
  deadlines_.erase({it->second.deadline, conn});
  pending_.erase(it);
  if (Metrics().pending != nullptr) Metrics().pending->Set(static_cast<double>(pending_.size()));
}

void ShmServer::ClosePending(int conn) {
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn, nullptr);
  DrainAndClose(conn);
  RemovePending(conn);
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

void ShmServer::HandleDoorbell(const std::shared_ptr<ShmSession>& s) {
  uint64_t count = 0;
  if (read(s->doorbell, &count, sizeof(count)) != sizeof(count)) return;
  shm::Ring* ring = s->completions->ring();
  const uint64_t head = ring->header.sub_head.load(std::memory_order_acquire);
  if (head < s->sub_tail || head - s->sub_tail > shm::kRingSlots) {
    EndSession(s->conn, absl::StrCat("corrupt submission ring (head ", head, ", tail ",
                                     s->sub_tail, ")"));
    return;
  }
  const std::string& job_id = s->job->id();
  while (s->sub_tail < head) {
    // Copy the entry out of shared memory before looking at it: the peer may change it.
    const shm::Submission sub = ring->subs[s->sub_tail % shm::kRingSlots];
    const uint64_t index = s->sub_tail++;
    ring->header.sub_tail.store(s->sub_tail, std::memory_order_release);
    const std::string where =
        absl::StrCat("job '", job_id, "' rank ", s->rank, " doorbell ", index, " (step ", sub.step, ")");
    absl::Status bad;
    if (sub.seq != index) {
      bad = absl::InvalidArgumentError(
          absl::StrCat(where, ": sequence ", sub.seq, " does not match its slot ", index));
    } else if (sub.generation != s->session_id) {
      bad = absl::FailedPreconditionError(absl::StrCat(
          where, ": stale generation ", sub.generation, " (the session's is ", s->session_id, ")"));
    } else if (sub.step < 0 || sub.buffer != static_cast<uint32_t>(sub.step % 2)) {
      bad = absl::InvalidArgumentError(
          absl::StrCat(where, ": buffer ", sub.buffer, " is not step % 2"));
    } else if (sub.offset != 0 || sub.size != s->buffer_bytes) {
      bad = absl::InvalidArgumentError(
          absl::StrCat(where, ": region [", sub.offset, ", +", sub.size, ") is not the rank's ",
                       s->buffer_bytes, "-byte buffer at offset 0"));
    }
    if (!bad.ok()) {
      s->completions->Complete(sub.seq, sub.step, bad, false, 0);
      continue;
    }
    const char* in_base = s->regions->in.data() + sub.buffer * s->buffer_bytes;
    char* out_base = s->regions->out.data() + sub.buffer * s->buffer_bytes;
    std::vector<const char*> in;
    std::vector<char*> out;
    for (uint64_t at : s->byte_offsets) {
      in.push_back(in_base + at);
      out.push_back(out_base + at);
    }
    auto channel = s->completions;
    const uint64_t seq = sub.seq;
    const int64_t step = sub.step;
    const uint64_t buffer_bytes = s->buffer_bytes;
    absl::Status st = s->job->SubmitShared(
        s->rank, s->session_id, step, in, out, s->regions,
        [channel, seq, step, buffer_bytes](const absl::Status& status, bool replayed,
                                           double seconds) {
          if (status.ok()) {  // the rank's whole buffer went in, its update came out
            RecordBytes(Transport::kShm, Direction::kIn, buffer_bytes);
            RecordBytes(Transport::kShm, Direction::kOut, buffer_bytes);
          }
          channel->Complete(seq, step, status, replayed, seconds);
        });
    if (!st.ok()) s->completions->Complete(seq, step, st, false, 0);
  }
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
  session->job->EndSharedSession(session->rank, session->session_id, session->regions.get(),
                                 clean);
  MUOND_LOG(INFO) << "job '" << session->job->id() << "' rank " << session->rank
                  << ": shared-memory session " << session->session_id << " (peer "
                  << PeerString(session->peer) << ") ended: " << why;
  close(conn);
}

void ShmServer::LogRefusal(const char* reason, const absl::Status& status, const ShmPeer& peer) {
  auto& [last, held] = refusal_log_[reason];
  const Clock::time_point now = Clock::now();
  if (last != Clock::time_point{} && now - last < kRefusalLogPeriod) {
    ++held;
    return;
  }
  MUOND_LOG(WARNING) << "shared-memory connection"
                     << (peer.pid != 0 ? absl::StrCat(" from ", PeerString(peer)) : "")
                     << " refused (" << reason << "): " << status.message()
                     << (held > 0 ? absl::StrCat(" (and ", held, " more since the last warning)")
                                  : "");
  last = now;
  held = 0;
}

}  // namespace muond::server
