#include "server/api/connection_listener.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "server/api/peer_identity.h"

namespace muond::server {
namespace {

constexpr int kBackoffMs = 100;         // no accept for this long after EMFILE/ENFILE
constexpr int kCountIntervalMs = 1000;  // how often closed connections are counted
constexpr int64_t kWarningIntervalNs = int64_t{10} * 1000 * 1000 * 1000;
constexpr int kAcceptsPerWakeup = 64;  // then poll again (Stop stays responsive)

int64_t MonotonicNs() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

size_t DefaultMaxConnections() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return 4096;
  const size_t soft = static_cast<size_t>(lim.rlim_cur);
  const size_t kept = std::max<size_t>(64, soft / 4);
  return soft > kept + 16 ? soft - kept : 16;
}

}  // namespace

absl::Status ConnectionListener::OpenWakeAndReserve() {
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (wake_fd_ < 0 || reserve_fd_ < 0) {
    return absl::InternalError(absl::StrCat("eventfd/open: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ConnectionListener>> ConnectionListener::BindUnix(
    const std::string& path, size_t max_connections) {
  std::unique_ptr<ConnectionListener> l(new ConnectionListener());
  l->what_ = absl::StrCat("unix socket ", path);
  l->unix_ = true;
  l->max_connections_ = max_connections > 0 ? max_connections : DefaultMaxConnections();
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": socket path too long"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  l->listen_fds_.push_back(fd);
  // The umask makes the socket 0660 from its first moment; chmod afterwards for a umask that
  // another thread changed meanwhile.
  const mode_t old_umask = ::umask(0117);
  const int bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int bind_errno = errno;
  ::umask(old_umask);
  if (bound != 0) {
    return absl::UnavailableError(absl::StrCat("bind ", path, ": ", std::strerror(bind_errno)));
  }
  ::chmod(path.c_str(), 0660);
  if (::listen(fd, SOMAXCONN) != 0) {
    return absl::UnavailableError(absl::StrCat("listen ", path, ": ", std::strerror(errno)));
  }
  if (absl::Status s = l->OpenWakeAndReserve(); !s.ok()) return s;
  return l;
}

absl::StatusOr<std::unique_ptr<ConnectionListener>> ConnectionListener::BindTcp(
    const std::string& host_port, size_t max_connections) {
  std::unique_ptr<ConnectionListener> l(new ConnectionListener());
  l->max_connections_ = max_connections > 0 ? max_connections : DefaultMaxConnections();
  const size_t colon = host_port.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(host_port.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(host_port, ": expected HOST:PORT"));
  }
  std::string host = host_port.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_protocol = IPPROTO_TCP;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(host_port, ": cannot resolve ", host, ": ", ::gai_strerror(rc)));
  }
  std::string last_error;
  int count = 0;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) ++count;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    sockaddr_storage addr{};
    std::memcpy(&addr, a->ai_addr, a->ai_addrlen);
    // Every address on one port: the first bound picks it when the address asked for 0.
    if (l->port_ != 0) {
      if (addr.ss_family == AF_INET) {
        reinterpret_cast<sockaddr_in*>(&addr)->sin_port = htons(l->port_);
      } else if (addr.ss_family == AF_INET6) {
        reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = htons(l->port_);
      }
    }
    const int fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    // With an IPv4 address of the same host beside it, an IPv6 socket takes IPv6 only.
    if (a->ai_family == AF_INET6 && count > 1) {
      ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
    }
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), a->ai_addrlen) != 0 ||
        ::listen(fd, SOMAXCONN) != 0) {
      last_error = std::strerror(errno);
      ::close(fd);
      continue;
    }
    if (l->port_ == 0) {
      sockaddr_storage bound{};
      socklen_t len = sizeof(bound);
      if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
        l->port_ = bound.ss_family == AF_INET
                       ? ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port)
                       : ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
      }
    }
    l->listen_fds_.push_back(fd);
  }
  ::freeaddrinfo(found);
  if (l->listen_fds_.empty()) {
    return absl::UnavailableError(absl::StrCat("bind ", host_port, ": ", last_error));
  }
  l->what_ = absl::StrCat("TCP ", host, ":", l->port_);
  if (absl::Status s = l->OpenWakeAndReserve(); !s.ok()) return s;
  return l;
}

ConnectionListener::~ConnectionListener() {
  Stop();
  if (wake_fd_ >= 0) ::close(wake_fd_);
  if (reserve_fd_ >= 0) ::close(reserve_fd_);
}

void ConnectionListener::Start(ConnectionSink sink) {
  sink_ = std::move(sink);
  thread_ = std::thread([this] { Loop(); });
}

void ConnectionListener::Stop() {
  stopping_.store(true);
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  for (int fd : listen_fds_) ::close(fd);
  listen_fds_.clear();
}

void ConnectionListener::Loop() {
  int64_t next_count_ns = MonotonicNs() + int64_t{kCountIntervalMs} * 1000000;
  bool backing_off = false;
  std::vector<pollfd> fds;
  fds.push_back({wake_fd_, POLLIN, 0});
  for (int fd : listen_fds_) fds.push_back({fd, POLLIN, 0});
  // Wakes at least every Heartbeat::kMaxWait to beat (the watchdog ping needs this loop).
  const int wait_ms = static_cast<int>(
      std::min<int64_t>(kCountIntervalMs, absl::ToInt64Milliseconds(common::Heartbeat::kMaxWait)));
  while (!stopping_.load()) {
    heartbeat_.Beat();
    heartbeat_.StallPointForTesting();
    // While backing off only the wake descriptor is watched: pending connections wait in the
    // backlog, and the loop sleeps instead of failing accept in a tight loop.
    for (pollfd& p : fds) p.revents = 0;
    const int r = ::poll(fds.data(), backing_off ? 1 : fds.size(),
                         backing_off ? kBackoffMs : wait_ms);
    if (r < 0 && errno != EINTR) {
      MUOND_LOG(ERROR) << what_ << ": poll: " << std::strerror(errno);
      ::poll(nullptr, 0, kBackoffMs);
    }
    if (stopping_.load()) break;
    backing_off = false;
    if (MonotonicNs() >= next_count_ns) {
      CountOpen();
      next_count_ns = MonotonicNs() + int64_t{kCountIntervalMs} * 1000000;
    }
    for (size_t i = 1; r > 0 && i < fds.size() && !backing_off; ++i) {
      if ((fds[i].revents & POLLIN) != 0) backing_off = !AcceptPending(fds[i].fd);
    }
  }
}

bool ConnectionListener::AcceptPending(int listen_fd) {
  for (int i = 0; i < kAcceptsPerWakeup; ++i) {
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        RefuseForLackOfDescriptors(listen_fd);
        return false;
      }
      MUOND_LOG(ERROR) << what_ << ": accept: " << std::strerror(errno);
      return false;
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    struct stat st {};
    if ((unix_ && ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) ||
        ::fstat(fd, &st) != 0) {
      MUOND_LOG(WARNING) << what_ << ": SO_PEERCRED/fstat: " << std::strerror(errno);
      ::close(fd);
      continue;
    }
    if (!unix_) {
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    }
    if (handed_.size() >= max_connections_) CountOpen();
    if (handed_.size() >= max_connections_ && handed_.count(fd) == 0) {
      ::close(fd);
      refused_over_bound_.fetch_add(1);
      ++refused_since_warning_;
      const int64_t now = MonotonicNs();
      if (now - last_warning_ns_ >= kWarningIntervalNs) {
        MUOND_LOG(WARNING) << what_ << ": " << handed_.size()
                           << " connections open, the bound (--max-connections " << max_connections_
                           << "); closed " << refused_since_warning_ << " new connection(s)"
                           << (unix_ ? absl::StrCat(", the latest from uid ", cred.uid, " pid ",
                                                    cred.pid)
                                     : std::string());
        last_warning_ns_ = now;
        refused_since_warning_ = 0;
      }
      continue;
    }
    if (unix_) {
      RecordUnixPeer(fd, UnixCredentials{cred.uid, cred.gid, cred.pid});
    } else {
      ForgetUnixPeer(fd);  // a TCP peer has no Unix credentials
    }
    handed_[fd] = st.st_ino;  // a reused descriptor number: gRPC closed the old connection
    RememberPeer(fd, st.st_ino);
    open_.store(handed_.size());
    sink_(listen_fd, fd);
  }
  return true;
}

void ConnectionListener::RefuseForLackOfDescriptors(int listen_fd) {
  const int err = errno;
  uint64_t refused = 0;
  if (reserve_fd_ >= 0) {
    ::close(reserve_fd_);
    reserve_fd_ = -1;
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      ::close(fd);
      refused = 1;
    }
    reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);  // -1: retried next time
  }
  refused_no_fds_.fetch_add(refused);
  refused_since_warning_ += refused;
  if (reserve_fd_ < 0) reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const int64_t now = MonotonicNs();
  if (now - last_warning_ns_ >= kWarningIntervalNs) {
    CountOpen();
    MUOND_LOG(WARNING) << what_ << ": out of file descriptors (" << std::strerror(err) << ") with "
                       << handed_.size() << " connections open; closed " << refused_since_warning_
                       << " new connection(s) since the last warning; pausing accept for "
                       << kBackoffMs << " ms at a time until descriptors are free";
    last_warning_ns_ = now;
    refused_since_warning_ = 0;
  }
}

namespace {

// True when descriptor `fd` is still the socket with inode `inode`. Looked up by path in
// /proc/self/fd ("socket:[INODE]"), not with fstat(fd): the descriptor belongs to gRPC, which
// closes it when it likes, and another thread may reuse the number meanwhile; a path lookup
// touches neither (and ThreadSanitizer, which models descriptors, sees no race on them). Falls
// back to fstat where /proc is not mounted.
bool StillSocket(int fd, ino_t inode) {
  static const bool have_proc = ::access("/proc/self/fd", X_OK) == 0;
  if (!have_proc) {
    struct stat st {};
    return ::fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) && st.st_ino == inode;
  }
  char path[40], target[64];
  std::snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
  const ssize_t n = ::readlink(path, target, sizeof(target) - 1);
  if (n <= 0) return false;
  target[n] = '\0';
  unsigned long long found = 0;
  char close = '\0';
  return std::sscanf(target, "socket:[%llu%c", &found, &close) == 2 && close == ']' &&
         found == static_cast<unsigned long long>(inode);
}

// The name gRPC gives the peer of connection `fd`: "fd:N" for a Unix connection handed with
// AddInsecureChannelFromFd, the peer's address URI ("ipv4:A:P", "ipv6:[A]:P") for TCP.
std::string GrpcPeerName(int fd, bool unix_socket) {
  if (unix_socket) return absl::StrCat("fd:", fd);
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "";
  char host[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    return absl::StrCat("ipv4:", host, ":", ntohs(in->sin_port));
  }
  if (addr.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    return absl::StrCat("ipv6:[", host, "]:", ntohs(in6->sin6_port));
  }
  return "";
}

}  // namespace

void ConnectionListener::RememberPeer(int fd, ino_t inode) {
  std::string peer = GrpcPeerName(fd, unix_);
  if (peer.empty()) return;
  absl::MutexLock lock(&peers_mu_);
  by_peer_[peer] = {fd, inode};
  peer_of_fd_[fd] = std::move(peer);
}

bool ConnectionListener::ShutdownPeer(const std::string& peer) {
  absl::MutexLock lock(&peers_mu_);
  auto it = by_peer_.find(peer);
  if (it == by_peer_.end() || !StillSocket(it->second.first, it->second.second)) return false;
  return ::shutdown(it->second.first, SHUT_RDWR) == 0;
}

void ConnectionListener::CountOpen() {
  for (auto it = handed_.begin(); it != handed_.end();) {
    if (StillSocket(it->first, it->second)) {
      ++it;
      continue;
    }
    ForgetUnixPeer(it->first);
    if (auto p = peer_of_fd_.find(it->first); p != peer_of_fd_.end()) {
      absl::MutexLock lock(&peers_mu_);
      auto known = by_peer_.find(p->second);
      if (known != by_peer_.end() && known->second.first == it->first) by_peer_.erase(known);
      peer_of_fd_.erase(p);
    }
    it = handed_.erase(it);
  }
  open_.store(handed_.size());
}

}  // namespace muond::server
