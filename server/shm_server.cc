#include "server/shm_server.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/job_spec_proto.h"
#include "common/layout.h"
#include "common/logging.h"
#include "common/shm_protocol.h"
#include "common/shm_region.h"
#include "server/daemon_metrics.h"
#include "muond/v1/muond.pb.h"

namespace muond::server {

namespace shm = common::shm;

// The regions a step reads and writes; shared with the steps that use them (keepalive).
struct ShmRegions {
  common::SharedRegion in;
  common::SharedRegion out;
};

// Where completions go: the ring and the completion eventfd. Shared with pending step callbacks,
// so a callback that runs after the session ended still writes into valid memory.
class CompletionChannel {
 public:
  CompletionChannel(common::SharedRegion ring, int event_fd)
      : ring_(std::move(ring)), event_fd_(event_fd) {}
  ~CompletionChannel() { close(event_fd_); }
  shm::Ring* ring() const { return reinterpret_cast<shm::Ring*>(ring_.data()); }

  void Complete(uint64_t seq, int64_t step, const absl::Status& status, bool replayed,
                double seconds) {
    absl::MutexLock lock(&mu_);
    shm::RingHeader& h = ring()->header;
    const uint64_t tail = h.comp_tail.load(std::memory_order_acquire);
    if (head_ - tail >= shm::kRingSlots) {
      // The peer stopped reading completions (it may ring only one step at a time).
      MUOND_LOG(WARNING) << "shared-memory completion ring full; dropping completion of step "
                         << step;
      return;
    }
    shm::Completion& c = ring()->comps[head_ % shm::kRingSlots];
    c.seq = seq;
    c.step = step;
    c.code = static_cast<int32_t>(status.code());
    c.replayed = replayed ? 1 : 0;
    c.seconds = seconds;
    const std::string msg(status.message());
    const size_t n = std::min(msg.size(), shm::kMessageBytes - 1);
    std::memcpy(c.message, msg.data(), n);
    c.message[n] = '\0';
    ++head_;
    h.comp_head.store(head_, std::memory_order_release);
    const uint64_t one = 1;
    ssize_t unused = write(event_fd_, &one, sizeof(one));
    (void)unused;
  }

 private:
  common::SharedRegion ring_;
  const int event_fd_;
  absl::Mutex mu_;
  uint64_t head_ ABSL_GUARDED_BY(mu_) = 0;
};

struct ShmSession {
  int conn = -1;
  int doorbell = -1;
  std::shared_ptr<Job> job;
  int rank = 0;
  uint64_t session_id = 0;
  uint64_t buffer_bytes = 0;
  uint64_t pinned_bytes = 0;  // bytes of the session's regions locked in memory (metrics)
  std::vector<uint64_t> byte_offsets;  // per span of RankSpans
  std::shared_ptr<ShmRegions> regions;
  std::shared_ptr<CompletionChannel> completions;
  uint64_t sub_tail = 0;  // used by the server thread only
};

namespace {

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

void SendReply(int conn, const v1::ShmAttachResponse& reply, const int* fds, int nfds) {
  const std::string bytes = reply.SerializeAsString();
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * shm::kNumFds)];
  if (nfds > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    std::memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  }
  if (sendmsg(conn, &msg, MSG_NOSIGNAL) < 0) {
    MUOND_LOG(WARNING) << "shared-memory attach reply: sendmsg: " << std::strerror(errno);
  }
}

v1::ShmAttachResponse ErrorReply(const absl::Status& s) {
  v1::ShmAttachResponse r;
  r.set_code(static_cast<int>(s.code()));
  r.set_message(std::string(s.message()));
  return r;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmServer>> ShmServer::Start(const std::string& path,
                                                            JobRegistry* registry) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("shared-memory socket path too long: ", path));
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
  if (ep < 0 || wake < 0) return Errno("epoll_create1/eventfd");
  std::unique_ptr<ShmServer> server(new ShmServer(path, registry, fd, ep, wake));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = fd;
  epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
  ev.data.fd = wake;
  epoll_ctl(ep, EPOLL_CTL_ADD, wake, &ev);
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  return server;
}

ShmServer::ShmServer(std::string path, JobRegistry* registry, int listen_fd, int epoll_fd,
                     int wake_fd)
    : path_(std::move(path)),
      registry_(registry),
      listen_fd_(listen_fd),
      epoll_fd_(epoll_fd),
      wake_fd_(wake_fd) {}

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
  close(listen_fd_);
  close(epoll_fd_);
  close(wake_fd_);
  unlink(path_.c_str());
}

ShmServer::Usage ShmServer::usage() const {
  absl::MutexLock lock(&mu_);
  Usage u;
  for (const auto& [conn, session] : sessions_) {
    if (session == nullptr) continue;
    ++u.sessions;
    u.pinned_bytes += session->pinned_bytes;
  }
  return u;
}

size_t ShmServer::session_count() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [conn, session] : sessions_) n += session != nullptr;
  return n;
}

void ShmServer::Loop() {
  epoll_event events[32];
  while (!stopping_.load()) {
    const int n = epoll_wait(epoll_fd_, events, 32, -1);
    if (n < 0 && errno != EINTR) {
      MUOND_LOG(ERROR) << "shared-memory server: epoll_wait: " << std::strerror(errno);
      return;
    }
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == wake_fd_) continue;
      if (fd == listen_fd_) {
        Accept();
        continue;
      }
      std::shared_ptr<ShmSession> doorbell_session;
      bool is_conn = false, attached = false;
      {
        absl::MutexLock lock(&mu_);
        if (auto it = by_doorbell_.find(fd); it != by_doorbell_.end()) doorbell_session = it->second;
        if (auto it = sessions_.find(fd); it != sessions_.end()) {
          is_conn = true;
          attached = it->second != nullptr;
        }
      }
      if (doorbell_session != nullptr) {
        HandleDoorbell(doorbell_session);
      } else if (is_conn) {
        if (attached && (events[i].events & EPOLLIN)) {
          // After attaching, the peer says one thing on the socket: the detach byte (a clean
          // end, possibly arriving with the hang-up); anything else ends the session as a failure.
          char byte = 0;
          const ssize_t n = recv(fd, &byte, 1, MSG_DONTWAIT);
          const bool detach = n == 1 && byte == shm::kDetachByte;
          EndSession(fd, detach ? "detached" : n == 0 ? "the peer hung up"
                                                      : "unexpected message after attach",
                     detach);
        } else if (events[i].events & (EPOLLHUP | EPOLLRDHUP | EPOLLERR)) {
          EndSession(fd, "the peer hung up");
        } else if (!attached) {
          HandleAttach(fd);
        }
      }
    }
  }
}

void ShmServer::Accept() {
  while (true) {
    const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (conn < 0) return;
    {
      absl::MutexLock lock(&mu_);
      sessions_[conn] = nullptr;
    }
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = conn;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, conn, &ev);
  }
}

void ShmServer::HandleAttach(int conn) {
  char buf[64 * 1024];
  const ssize_t n = recv(conn, buf, sizeof(buf), 0);
  if (n <= 0) {
    EndSession(conn, "closed before attaching");
    return;
  }
  v1::ShmAttachRequest req;
  auto fail = [&](const absl::Status& s) {
    SendReply(conn, ErrorReply(s), nullptr, 0);
    EndSession(conn, std::string(s.message()));
  };
  if (!req.ParseFromArray(buf, static_cast<int>(n))) {
    return fail(absl::InvalidArgumentError("malformed shared-memory attach request"));
  }
  if (shutting_down_.load()) return fail(absl::UnavailableError("muond is shutting down"));
  auto job = registry_->Find(req.job_id());
  if (!job.ok()) return fail(job.status());
  if (req.token().empty()) {
    return fail(absl::UnauthenticatedError(
        absl::StrCat("job '", req.job_id(), "': missing job token")));
  }
  if (!(*job)->TokenMatches(req.token())) {
    return fail(absl::PermissionDeniedError(absl::StrCat("job '", req.job_id(),
                                                         "': wrong job token")));
  }
  const common::JobSpec& spec = (*job)->spec();
  if (req.rank() < 0 || req.rank() >= spec.world_size) {
    return fail(absl::InvalidArgumentError(absl::StrCat("job '", req.job_id(), "': rank ",
                                                        req.rank(), " is outside the world size [0, ",
                                                        spec.world_size, ")")));
  }
  auto session_id = (*job)->Attach(req.rank(), req.takeover());
  if (!session_id.ok()) return fail(session_id.status());
  auto session = std::make_shared<ShmSession>();
  session->conn = conn;
  session->job = *job;
  session->rank = req.rank();
  session->session_id = *session_id;
  v1::ShmAttachResponse reply;
  // Span byte offsets: the rank's flat buffer when all matrices share a dtype, else back to back.
  bool uniform = true;
  for (const auto& m : spec.matrices) uniform = uniform && m.dtype == spec.matrices[0].dtype;
  uint64_t bytes = 0;
  for (const common::ShardSpan& span : common::RankSpans(spec, req.rank())) {
    const size_t esize = common::DTypeSize(spec.matrices[span.matrix].dtype);
    const uint64_t at = uniform ? span.rank_offset * esize : bytes;
    session->byte_offsets.push_back(at);
    bytes = std::max(bytes, at + span.length * esize);
    v1::ShmSpan* s = reply.add_spans();
    s->set_matrix_index(span.matrix);
    s->set_offset(span.offset);
    s->set_length(span.length);
    s->set_byte_offset(at);
  }
  if (uniform) {
    bytes = common::RankBufferElements(spec, req.rank()) * common::DTypeSize(spec.matrices[0].dtype);
  }
  session->buffer_bytes = std::max<uint64_t>(bytes, 1);
  auto regions = std::make_shared<ShmRegions>();
  auto in = common::SharedRegion::Create("muond-grad", 2 * session->buffer_bytes, false, true);
  auto out = common::SharedRegion::Create("muond-update", 2 * session->buffer_bytes, true, true);
  auto ring = common::SharedRegion::Create("muond-ring", shm::kRingBytes, false, true);
  const int doorbell = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  const int completion = eventfd(0, EFD_CLOEXEC);
  if (!in.ok() || !out.ok() || !ring.ok() || doorbell < 0 || completion < 0) {
    if (doorbell >= 0) close(doorbell);
    if (completion >= 0) close(completion);
    (void)(*job)->Detach(req.rank(), *session_id);
    return fail(!in.ok() ? in.status() : !out.ok() ? out.status() : !ring.ok() ? ring.status()
                                                   : Errno("eventfd"));
  }
  auto* r = reinterpret_cast<shm::Ring*>(ring->data());
  r->header.magic = shm::kRingMagic;
  r->header.version = shm::kRingVersion;
  r->header.generation = *session_id;
  const bool pinned = in->locked() && out->locked() && ring->locked();
  for (const common::SharedRegion* region : {&*in, &*out, &*ring}) {
    if (region->locked()) session->pinned_bytes += region->size();
  }
  const int fds[shm::kNumFds] = {in->fd(), out->fd(), ring->fd(), doorbell, completion};
  regions->in = *std::move(in);
  regions->out = *std::move(out);
  session->regions = regions;
  session->completions = std::make_shared<CompletionChannel>(*std::move(ring), completion);
  session->doorbell = doorbell;
  reply.set_session_id(*session_id);
  reply.set_generation(*session_id);
  reply.set_buffer_bytes(session->buffer_bytes);
  reply.set_next_step((*job)->Status().next_step());
  *reply.mutable_spec() = common::JobSpecToProto(spec);
  reply.set_pinned(pinned);
  SendReply(conn, reply, fds, shm::kNumFds);
  if (!pinned) {
    MUOND_LOG(WARNING) << "job '" << spec.job_id << "' rank " << req.rank()
                       << ": shared regions are not locked in memory (mlock failed; raise "
                          "RLIMIT_MEMLOCK, e.g. LimitMEMLOCK=infinity)";
  }
  {
    absl::MutexLock lock(&mu_);
    sessions_[conn] = session;
    by_doorbell_[doorbell] = session;
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = doorbell;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, doorbell, &ev);
  MUOND_LOG(INFO) << "job '" << spec.job_id << "' rank " << req.rank()
                  << ": shared-memory session " << *session_id << ", 2 x "
                  << session->buffer_bytes << " bytes per direction";
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
    if (session != nullptr) by_doorbell_.erase(session->doorbell);
  }
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn, nullptr);
  if (session != nullptr) {
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, session->doorbell, nullptr);
    session->job->EndSharedSession(session->rank, session->session_id, session->regions.get(),
                                   clean);
    close(session->doorbell);
    MUOND_LOG(INFO) << "job '" << session->job->id() << "' rank " << session->rank
                    << ": shared-memory session " << session->session_id << " ended: " << why;
  }
  close(conn);
}

}  // namespace muond::server
