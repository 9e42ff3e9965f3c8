// The admission side of the shared-memory server: accepting connections under the session and
// descriptor limits, the attach handshake (token, regions, reply) and the refusals, counted and
// logged at a bounded rate. The sessions and their doorbells: shm_server.cc.
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
#include <memory>
#include <system_error>
#include <thread>
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
#include "common/status_macros.h"
#include "muond/v1/muond.pb.h"
#include "server/api/shm_attach.h"
#include "server/api/shm_server.h"
#include "server/api/shm_session.h"
#include "server/api/shm_wire.h"
#include "server/record/daemon_metrics.h"

namespace muond::server {

namespace shm = common::shm;
using shm_attach::Authorize;
using shm_attach::CreateSessionResources;
using shm_attach::DrainAndClose;
using shm_attach::Errno;
using shm_attach::ErrorReply;
using shm_attach::OutOfDescriptors;
using shm_wire::ParseAttachRequest;
using shm_attach::PeerHungUp;
using shm_attach::PeerOf;
using shm_attach::PeerString;
using shm_attach::SendReply;
using shm_attach::SetupError;

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
constexpr const char* kReasons[] = {"session_limit",     "attach_timeout", "out_of_descriptors",
                                    "bad_request",       "attach_failed",  "reply_failed",
                                    "peer_pending_limit"};

// The server's own metrics, declared next to the code that updates them.
struct ShmMetrics {
  ShmMetrics() {
    common::MetricsRegistry& r = common::DefaultRegistry();
    auto f = r.AddCounter("muond_shm_connections_refused_total",
                          "Shared-memory connections answered with an error (or dropped) before "
                          "a session was attached, by reason.");
    auto g = r.AddGauge("muond_shm_pending_connections",
                        "Shared-memory connections accepted and not attached yet.");
    auto d = r.AddCounter("muond_shm_device_registrations_total",
                          "Attached shared-memory sessions whose regions were registered with "
                          "the compute device for direct copies, or failed to be (their steps "
                          "stage on the host), by result.");
    if (!f.ok() || !g.ok() || !d.ok()) {
      MUOND_LOG(ERROR) << "metrics: " << (!f.ok() ? f.status() : !g.ok() ? g.status() : d.status());
      return;
    }
    for (const char* reason : kReasons) refused[reason] = &(*f)->Add({{"reason", reason}});
    pending = &(*g)->Add({});
    registered = &(*d)->Add({{"result", "registered"}});
    not_registered = &(*d)->Add({{"result", "failed"}});
  }
  std::map<std::string, common::Counter*> refused;
  common::Gauge* pending = nullptr;
  common::Counter* registered = nullptr;
  common::Counter* not_registered = nullptr;
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

void ShmServer::DeclareMetrics() { Metrics(); }

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

absl::Status ShmServer::CheckPeerPending(const ShmPeer& peer) const {
  // OK while `who` (named "uid N" / "pid N") holds fewer than `limit` pending connections.
  auto check = [](const auto& counts, auto key, const char* who, const char* per,
                  const char* flag, size_t limit) -> absl::Status {
    auto it = counts.find(key);
    const size_t n = it == counts.end() ? size_t{0} : it->second;
    if (n < limit) return absl::OkStatus();
    return absl::ResourceExhaustedError(absl::StrCat(
        who, " ", key, " holds ", n, " shared-memory connections not attached yet, the limit per ",
        per, " (", flag, " ", limit,
        "); connection refused, attach on the connections held or close them"));
  };
  RETURN_IF_ERROR(check(pending_uids_, peer.uid, "uid", "user", "--max-shm-pending-per-uid",
                        pending_per_uid_));
  return check(pending_pids_, peer.pid, "pid", "process", "--max-shm-pending-per-pid",
               pending_per_pid_);
}

void ShmServer::Admit(int conn) {
  // One peer's flood of idle connections is bounded before it can fill the global limit.
  const ShmPeer peer = PeerOf(conn);
  if (absl::Status s = CheckPeerPending(peer); !s.ok()) {
    (void)SendReply(conn, ErrorReply(s), nullptr, 0);
    CountRefusal("peer_pending_limit");
    LogRefusal("peer_pending_limit", s, peer);
    DrainAndClose(conn);
    return;
  }
  size_t attached = 0;
  {
    absl::MutexLock lock(&mu_);
    attached = sessions_.size();
  }
  if (attached + pending_.size() >= limits_.max_sessions) {
    const absl::Status s = absl::ResourceExhaustedError(
        absl::StrCat("muond holds ", attached, " shared-memory sessions and ", pending_.size(),
                     " connections not attached yet, the limit (--max-shm-sessions ",
                     limits_.max_sessions, "); connection refused, try again later"));
    (void)SendReply(conn, ErrorReply(s), nullptr, 0);
    CountRefusal("session_limit");
    LogRefusal("session_limit", s, peer);
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
    LogRefusal("out_of_descriptors", s, peer);
    DrainAndClose(conn);
    return;
  }
  AddPending(conn, peer);
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
  auto req =
      ParseAttachRequest(buf.data(), static_cast<size_t>(n), limits_.max_attach_request_bytes);
  if (!req.ok()) return RefusePending(conn, req.status(), "bad_request");
  if (shutting_down_.load()) {
    return RefusePending(conn, absl::UnavailableError("muond is shutting down"), nullptr);
  }
  auto job = Authorize(*registry_, *req);
  if (!job.ok()) return RefusePending(conn, job.status(), nullptr);
  auto session_id = (*job)->Attach(req->rank(), req->takeover());
  if (!session_id.ok()) return RefusePending(conn, session_id.status(), nullptr);
  // Before the new regions are made: the old session's go first (not two sets at once).
  if (req->takeover()) EndTakenOverSessions(**job, req->rank(), *session_id);
  auto session = std::make_shared<ShmSession>();
  session->conn = conn;
  session->peer = peer;
  session->job = *job;
  session->rank = req->rank();
  session->session_id = *session_id;
  const std::string who = absl::StrCat("job '", req->job_id(), "' rank ", req->rank());
  // The regions (memfd, ftruncate, mlock, device registration: seconds for a rank of GiBs) are
  // made on a worker of their own, not on this thread, which serves every job's doorbells; the
  // connection waits out of the epoll set, without a deadline (its request came in time), and
  // still counts as pending.
  {
    absl::MutexLock lock(&post_mu_);
    ++attach_workers_;
  }
  try {
    std::thread([this, session, who] {
      auto reply = std::make_shared<v1::ShmAttachResponse>();
      absl::Status created = CreateSessionResources(*session, *reply);
      if (created.ok()) RegisterWithDevice(*session, who);
      // Handed back under the lock that the destructor waits on: the server outlives this.
      absl::MutexLock lock(&post_mu_);
      posted_.push_back(
          [this, session, reply, created, who] { FinishAttach(session, *reply, created, who); });
      --attach_workers_;
      const uint64_t one = 1;
      ssize_t unused = write(wake_fd_, &one, sizeof(one));
      (void)unused;
    }).detach();
  } catch (const std::system_error& e) {
    {
      absl::MutexLock lock(&post_mu_);
      --attach_workers_;
    }
    (void)(*job)->Detach(req->rank(), *session_id);
    return RefusePending(conn,
                         absl::ResourceExhaustedError(absl::StrCat(
                             who, ": cannot start a thread to set up the session: ", e.what())),
                         "attach_failed");
  }
  deadlines_.erase({pending_.at(conn).deadline, conn});
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn, nullptr);
}

void ShmServer::FinishAttach(const std::shared_ptr<ShmSession>& session,
                             const v1::ShmAttachResponse& reply, const absl::Status& created,
                             const std::string& who) {
  const int conn = session->conn;
  Job& job = *session->job;
  if (!created.ok()) {
    (void)job.Detach(session->rank, session->session_id);
    return RefusePending(conn, SetupError(who, created), "attach_failed");
  }
  // Deleted, taken over or detached while the regions were made; or the server is stopping.
  absl::Status current = job.CheckSession(session->rank, session->session_id);
  if (current.ok() && stopping_.load()) current = absl::UnavailableError("muond is stopping");
  if (!current.ok()) {
    (void)job.Detach(session->rank, session->session_id);
    return RefusePending(conn, current, nullptr);
  }
  const int fds[shm::kNumFds] = {session->regions->in.fd(), session->regions->out.fd(),
                                 session->completions->ring_fd(), session->doorbell,
                                 session->completions->event_fd()};
  if (absl::Status s = SendReply(conn, reply, fds, shm::kNumFds); !s.ok()) {
    // The peer never got its session: detach the rank, so that it can attach again. The session's
    // descriptors close with it.
    (void)job.Detach(session->rank, session->session_id);
    if (PeerHungUp(conn)) {  // it went away while its session was made: nothing to report
      ClosePending(conn);
      return;
    }
    MUOND_LOG(WARNING) << who << " (peer " << PeerString(session->peer)
                       << "): shared-memory attach abandoned: " << s.message();
    CountRefusal("reply_failed");
    ClosePending(conn);
    return;
  }
  RemovePending(conn);
  // Back in the epoll set: the peer's detach byte or hang-up ends the session.
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.fd = conn;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, conn, &ev);
  RegisterSession(session, who, reply.pinned());
}

void ShmServer::RegisterWithDevice(ShmSession& session, const std::string& who) {
  device::Device* device = registry_->device();
  if (!limits_.register_with_device || device == nullptr || !device->DirectHostCopies()) {
    return;  // host devices: steps assemble on the host, nothing to register
  }
  const absl::Status s = shm_attach::RegisterWithDevice(session, *device);
  common::Counter* counter = s.ok() ? Metrics().registered : Metrics().not_registered;
  if (counter != nullptr) counter->Increment();
  if (!s.ok()) {
    MUOND_LOG(WARNING) << who << ": shared-memory regions not registered with "
                       << device->name() << " (" << s.message()
                       << "); its steps copy through host staging";
  }
}

void ShmServer::RegisterSession(const std::shared_ptr<ShmSession>& session, const std::string& who,
                                bool pinned) {
  {
    absl::MutexLock lock(&mu_);
    sessions_[session->conn] = session;
    by_doorbell_[session->doorbell] = session;
  }
  // A deleted job ends the session on this thread (at once, when it is deleted already).
  session->on_delete =
      session->job->OnDelete([this, conn = session->conn, id = session->session_id] {
        Post([this, conn, id] { EndDeletedSession(conn, id); });
      });
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = session->doorbell;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, session->doorbell, &ev);
  if (!pinned) {
    MUOND_LOG(WARNING) << who
                       << ": shared regions are not locked in memory (mlock failed; raise "
                          "RLIMIT_MEMLOCK, e.g. LimitMEMLOCK=infinity)";
  }
  MUOND_LOG(INFO) << who << ": shared-memory session " << session->session_id << " (peer "
                  << PeerString(session->peer) << "), " << session->buffers << " x "
                  << session->buffer_bytes << " bytes per direction"
                  << (session->device_registered ? ", registered with the device" : "");
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
  ++pending_uids_[peer.uid];
  ++pending_pids_[peer.pid];
  if (Metrics().pending != nullptr) Metrics().pending->Set(static_cast<double>(pending_.size()));
}

void ShmServer::RemovePending(int conn) {
  auto it = pending_.find(conn);
  if (it == pending_.end()) return;
  deadlines_.erase({it->second.deadline, conn});
  auto release = [](auto& counts, auto key) {
    if (auto c = counts.find(key); c != counts.end() && --c->second == 0) counts.erase(c);
  };
  release(pending_uids_, it->second.peer.uid);
  release(pending_pids_, it->second.peer.pid);
  pending_.erase(it);
  if (Metrics().pending != nullptr) Metrics().pending->Set(static_cast<double>(pending_.size()));
}

void ShmServer::ClosePending(int conn) {
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn, nullptr);
  DrainAndClose(conn);
  RemovePending(conn);
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
