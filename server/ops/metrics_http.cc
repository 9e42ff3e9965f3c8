#include "server/ops/metrics_http.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <iterator>
#include <set>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/heartbeat.h"
#include "common/logging.h"
#include "server/ops/metrics_http_listen.h"
#include "server/ops/metrics_http_request.h"

// Threads in a process with a large static TLS. glibc carves every thread's static TLS out of its
// stack, and muond loads LibTorch, OpenBLAS and glog, whose static TLS is ~100 KiB together: a
// thread created with a small fixed stack fails with EINVAL. This definition interposes on the
// libc one for the whole process (the executable's dynamic symbols come first) and raises any
// smaller request to 1 MiB; a larger request is passed through unchanged. It was added for
// civetweb's ~100 KiB threads, which this server no longer uses; it stays because it covers every
// thread in the process. Thread stacks are virtual memory, so the cost is address space only.
extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  using SetStackSize = int (*)(pthread_attr_t*, size_t);
  static const SetStackSize next =
      reinterpret_cast<SetStackSize>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  if (next == nullptr) return ENOSYS;
  return next(attr, std::max<size_t>(size, size_t{1} << 20));
}

namespace muond::server {
namespace {

using http::Answer;
using http::HeadLength;
using http::Response;

using Clock = std::chrono::steady_clock;

constexpr size_t kReadChunk = 4096;
constexpr int kReadsPerEvent = 16;  // A client that floods yields to the others after 64 KiB.
constexpr int kAcceptsPerEvent = 64;
constexpr int kMaxEvents = 64;
// After its response a connection is half-closed and read until the peer closes too, for at most
// this long: close() with request bytes still unread makes the kernel send a reset, which can
// destroy the response before the client has read it.
constexpr auto kDrainTime = std::chrono::seconds(1);
// What a connection shed for want of descriptors is told before it is closed.
constexpr char kNoDescriptors[] =
    "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

// A whole response that closes the connection; HEAD gets the headers only. `status` is the code
// and reason phrase, "404 Not Found".
constexpr int kSkippedAcceptErrors[] = {EINTR,       ECONNABORTED, EPROTO, ENETDOWN,
                                        ENOPROTOOPT, EHOSTDOWN,    ENONET, EHOSTUNREACH,
                                        EOPNOTSUPP,  ENETUNREACH,  EPERM};

constexpr uint64_t EpollTag(uint64_t id, int fd) { return (id << 32) | static_cast<uint32_t>(fd); }

}  // namespace

// The connections and the epoll loop. Everything but Stop() and Stats() runs on the server's
// thread.
class MetricsServer::EventLoop {
 public:
  // Takes ownership of `listen_fd`.
  EventLoop(common::MetricsRegistry* registry, const MetricsServerOptions& options, int listen_fd,
            http::BoundAddress bound)
      : registry_(registry),
        options_(options),
        bound_(std::move(bound)),
        timeout_(absl::ToChronoNanoseconds(options.request_timeout)),
        backoff_(absl::ToChronoNanoseconds(options.descriptor_backoff)),
        listen_fd_(listen_fd) {}
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  ~EventLoop() {
    for (auto& [fd, c] : connections_) close(fd);
    for (int fd : {listen_fd_, epoll_fd_, wake_fd_, reserve_fd_}) {
      if (fd >= 0) close(fd);
    }
  }

  // Creates the epoll set, the wake-up descriptor and the reserve descriptor.
  absl::Status Init() {
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (epoll_fd_ < 0 || wake_fd_ < 0 || reserve_fd_ < 0 ||
        !Watch(listen_fd_, EpollTag(0, listen_fd_), EPOLLIN, EPOLL_CTL_ADD) ||
        !Watch(wake_fd_, EpollTag(0, wake_fd_), EPOLLIN, EPOLL_CTL_ADD)) {
      return absl::UnavailableError(absl::StrCat("epoll: ", std::strerror(errno)));
    }
    return absl::OkStatus();
  }

  // Makes Run() return soon. Any thread.
  void Stop() {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }

  MetricsServerStats Stats() const ABSL_LOCKS_EXCLUDED(stats_mu_) {
    absl::MutexLock lock(&stats_mu_);
    return stats_;
  }

  // Serves until Stop().
  void Run() {
    epoll_event events[kMaxEvents];
    for (;;) {
      heartbeat_.Beat();
      heartbeat_.StallPointForTesting();
      const int n = epoll_wait(epoll_fd_, events, kMaxEvents, WaitMs(Clock::now()));
      if (n < 0 && errno != EINTR) {
        MUOND_LOG(ERROR) << "metrics http: epoll_wait: " << std::strerror(errno) << "; stopped";
        return;
      }
      for (int i = 0; i < n; ++i) {
        if (events[i].data.u64 == EpollTag(0, wake_fd_)) return;
        Dispatch(events[i]);
      }
      const Clock::time_point now = Clock::now();
      while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
        Connection& c = connections_.at(deadlines_.begin()->second);
        if (c.phase != Phase::kDraining) Count(&MetricsServerStats::timed_out);
        Close(c);
      }
      if (!accepting_ && now >= resume_at_) {
        if (reserve_fd_ < 0) RestoreReserve();
        accepting_ = Watch(listen_fd_, EpollTag(0, listen_fd_), EPOLLIN, EPOLL_CTL_MOD);
        if (!accepting_) resume_at_ = now + backoff_;  // Retried later, never in a busy loop.
      }
    }
  }

 private:
  enum class Phase { kReading, kWriting, kDraining };
  struct Connection {
    uint64_t id = 0;  // Tells a stale epoll event from one for a new connection on the same fd.
    int fd = -1;
    Phase phase = Phase::kReading;
    uint32_t events = EPOLLIN;
    Clock::time_point deadline;
    std::string in;  // The request so far, at most options_.max_request_bytes.
    std::string out;
    size_t sent = 0;
  };

  bool Watch(int fd, uint64_t tag, uint32_t events, int op) {
    epoll_event event{};
    event.events = events;
    event.data.u64 = tag;
    return epoll_ctl(epoll_fd_, op, fd, &event) == 0;
  }

  void Count(uint64_t MetricsServerStats::*field, uint64_t n = 1) ABSL_LOCKS_EXCLUDED(stats_mu_) {
    absl::MutexLock lock(&stats_mu_);
    stats_.*field += n;
    stats_.open = connections_.size();
  }

  void Dispatch(const epoll_event& event) {
    const int fd = static_cast<int>(event.data.u64 & 0xffffffffu);
    const uint64_t id = event.data.u64 >> 32;
    if (id == 0) {
      if (fd == listen_fd_ && accepting_) AcceptPending();
      return;
    }
    auto it = connections_.find(fd);
    if (it == connections_.end() || it->second.id != id) return;  // Closed earlier in this batch.
    Connection& c = it->second;
    if ((event.events & EPOLLERR) != 0) return Close(c);
    if (c.phase == Phase::kWriting) return Write(c);  // EPOLLOUT, or EPOLLHUP: send then fails.
    Read(c);
  }

  void AcceptPending() {
    for (int i = 0; i < kAcceptsPerEvent; ++i) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) {
        Admit(fd);
        continue;
      }
      const int error = errno;
      if (error == EAGAIN || error == EWOULDBLOCK) return;
      if (error == EMFILE || error == ENFILE || error == ENOBUFS || error == ENOMEM) {
        return ShedForDescriptors(error);
      }
      // The peer gave up (ECONNABORTED), or one of the network errors Linux reports on accept.
      if (std::find(std::begin(kSkippedAcceptErrors), std::end(kSkippedAcceptErrors), error) ==
          std::end(kSkippedAcceptErrors)) {
        MUOND_LOG(ERROR) << "metrics http: accept: " << std::strerror(error);
        return PauseAccepting();
      }
    }
  }

  // Out of descriptors (or kernel memory): the connections waiting in the backlog cannot be taken
  // in, and left there they keep the listener readable, so the loop would spin. So: free the
  // reserve descriptor, accept each waiting connection, tell it 503 and close it, take the reserve
  // back, and pause accepting for a while.
  void ShedForDescriptors(int error) {
    if (reserve_fd_ >= 0) {
      close(reserve_fd_);
      reserve_fd_ = -1;
      uint64_t shed = 0;
      for (int i = 0; i < kAcceptsPerEvent; ++i) {
        const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0 && (errno == EINTR || errno == ECONNABORTED)) continue;
        if (fd < 0) break;
        (void)send(fd, kNoDescriptors, sizeof(kNoDescriptors) - 1, MSG_DONTWAIT | MSG_NOSIGNAL);
        close(fd);
        ++shed;
      }
      Count(&MetricsServerStats::shed_no_descriptors, shed);
      RestoreReserve();
    }
    if (!descriptors_ran_out_) {
      descriptors_ran_out_ = true;
      MUOND_LOG(WARNING) << "metrics http: accept: " << std::strerror(error)
                         << "; shedding new connections, accepting again every "
                         << absl::FormatDuration(options_.descriptor_backoff);
    }
    PauseAccepting();
  }

  // Another thread may take the descriptor the reserve gave up, and keep every other: then the
  // descriptor comes from the connection closest to its deadline, as at max_connections. With no
  // connection to close only the pause remains, and the reserve is retried on resuming.
  void RestoreReserve() {
    reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (reserve_fd_ >= 0 || (errno != EMFILE && errno != ENFILE) || deadlines_.empty()) return;
    Count(&MetricsServerStats::shed_no_descriptors);
    Close(connections_.at(deadlines_.begin()->second));
    reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  }

  void PauseAccepting() {
    Count(&MetricsServerStats::accept_pauses);
    // The listener stays in the set, reporting nothing until Run() re-arms it.
    accepting_ = !Watch(listen_fd_, EpollTag(0, listen_fd_), 0, EPOLL_CTL_MOD);
    resume_at_ = Clock::now() + backoff_;
  }

  void Admit(int fd) {
    if (descriptors_ran_out_ && reserve_fd_ >= 0) {
      descriptors_ran_out_ = false;
      MUOND_LOG(INFO) << "metrics http: accepting connections again";
    }
    if (connections_.size() >= static_cast<size_t>(options_.max_connections)) {
      Count(&MetricsServerStats::shed_at_limit);
      Close(connections_.at(deadlines_.begin()->second));
    }
    const uint64_t id = next_id_;
    next_id_ = next_id_ == 0xffffffffu ? 1 : next_id_ + 1;
    if (!Watch(fd, EpollTag(id, fd), EPOLLIN, EPOLL_CTL_ADD)) {  // ENOMEM, ENOSPC: shed it.
      close(fd);
      return;
    }
    Connection& c = connections_[fd];
    c.id = id;
    c.fd = fd;
    c.deadline = Clock::now() + timeout_;
    deadlines_.emplace(c.deadline, fd);
    Count(&MetricsServerStats::accepted);
  }

  // Read, Write and Close may close `c`; callers return right after them.
  void Read(Connection& c) {
    char buffer[kReadChunk];
    for (int i = 0; i < kReadsPerEvent; ++i) {
      const ssize_t n = recv(c.fd, buffer, sizeof(buffer), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) return Close(c);  // The peer is done (the normal end of draining) or gone.
      if (c.phase != Phase::kReading) continue;  // Draining: discarded.
      const size_t from = c.in.size() < 2 ? 0 : c.in.size() - 2;
      const size_t room = options_.max_request_bytes - c.in.size();
      c.in.append(buffer, std::min(static_cast<size_t>(n), room));
      const size_t head_length = HeadLength(c.in, from);
      if (head_length != std::string_view::npos) {
        return Respond(
            c, Answer(std::string_view(c.in).substr(0, head_length), *registry_, options_.pages,
                      bound_));
      }
      if (c.in.size() >= options_.max_request_bytes) {
        return Respond(c, Response("431 Request Header Fields Too Large",
                                   absl::StrCat("Request header fields too large: at most ",
                                                options_.max_request_bytes,
                                                " bytes of request line and headers\n")));
      }
    }
  }

  void Respond(Connection& c, std::string response) {
    std::string().swap(c.in);
    c.out = std::move(response);
    c.phase = Phase::kWriting;
    Write(c);
  }

  void Write(Connection& c) {
    while (c.sent < c.out.size()) {
      const ssize_t n = send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
      if (n > 0) {
        c.sent += static_cast<size_t>(n);
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        // Only EPOLLOUT: input is left unread meanwhile, so it cannot make the loop spin.
        (void)SetEvents(c, EPOLLOUT);
        return;
      } else if (n == 0 || errno != EINTR) {
        return Close(c);
      }
    }
    Count(&MetricsServerStats::responses);
    std::string().swap(c.out);
    (void)shutdown(c.fd, SHUT_WR);
    c.phase = Phase::kDraining;
    if (!SetEvents(c, EPOLLIN)) return;
    deadlines_.erase({c.deadline, c.fd});
    c.deadline = std::min(c.deadline, Clock::now() + kDrainTime);
    deadlines_.emplace(c.deadline, c.fd);
  }

  // False when it failed and closed `c`.
  bool SetEvents(Connection& c, uint32_t events) {
    if (c.events == events) return true;
    if (!Watch(c.fd, EpollTag(c.id, c.fd), events, EPOLL_CTL_MOD)) {
      Close(c);
      return false;
    }
    c.events = events;
    return true;
  }

  void Close(Connection& c) {
    const int fd = c.fd;
    deadlines_.erase({c.deadline, fd});
    close(fd);  // Also leaves the epoll set: the descriptor is not shared.
    connections_.erase(fd);
    Count(&MetricsServerStats::open, 0);
  }

  int WaitMs(Clock::time_point now) const {
    Clock::time_point next = Clock::time_point::max();
    if (!deadlines_.empty()) next = deadlines_.begin()->first;
    if (!accepting_) next = std::min(next, resume_at_);
    // Wakes at least every Heartbeat::kMaxWait to beat.
    const int64_t most = absl::ToInt64Milliseconds(common::Heartbeat::kMaxWait);
    if (next == Clock::time_point::max()) return static_cast<int>(most);
    if (next <= now) return 0;
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(next - now).count();
    return static_cast<int>(std::min<int64_t>(ms, most));
  }

  common::Heartbeat heartbeat_{"metrics http loop"};
  common::MetricsRegistry* const registry_;
  const MetricsServerOptions options_;
  const http::BoundAddress bound_;
  const Clock::duration timeout_;
  const Clock::duration backoff_;
  const int listen_fd_;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  int reserve_fd_ = -1;  // /dev/null, closed to free a descriptor when there is none.
  bool accepting_ = true;
  Clock::time_point resume_at_;       // While !accepting_.
  bool descriptors_ran_out_ = false;  // Logged once until accepting works again.
  uint64_t next_id_ = 1;
  std::unordered_map<int, Connection> connections_;        // By fd.
  std::set<std::pair<Clock::time_point, int>> deadlines_;  // (deadline, fd) of each connection.
  mutable absl::Mutex stats_mu_;
  MetricsServerStats stats_ ABSL_GUARDED_BY(stats_mu_);
};

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address, common::MetricsRegistry* registry,
    const MetricsServerOptions& options) {
  absl::StatusOr<http::ListenAddress> listen_address = http::ParseListenAddress(address);
  if (!listen_address.ok()) return listen_address.status();
  if (options.max_connections < 1 || options.max_request_bytes < 64 ||
      options.request_timeout <= absl::ZeroDuration() ||
      options.descriptor_backoff < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics server on \"", address, "\": options out of range"));
  }
  absl::StatusOr<std::pair<int, int>> listener = http::Listen(*listen_address);
  if (!listener.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on \"", address, "\": ", listener.status().message()));
  }
  auto loop = std::make_unique<EventLoop>(registry, options, listener->first,
                                          http::BoundAddress{listen_address->host, listener->second});
  if (absl::Status s = loop->Init(); !s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on \"", address, "\": ", s.message()));
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->port_ = listener->second;
  server->address_ = absl::StrCat(listen_address->host, ":", server->port_);
  server->loop_ = std::move(loop);
  server->thread_ = std::thread([loop = server->loop_.get()] { loop->Run(); });
  return server;
}

MetricsServer::~MetricsServer() {
  if (loop_ == nullptr) return;
  loop_->Stop();
  if (thread_.joinable()) thread_.join();
}

MetricsServerStats MetricsServer::stats() const {
  return loop_ != nullptr ? loop_->Stats() : MetricsServerStats();
}

}  // namespace muond::server
