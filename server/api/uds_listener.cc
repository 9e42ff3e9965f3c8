#include "server/api/uds_listener.h"

#include <fcntl.h>
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

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "server/api/peer_identity.h"

namespace muond::server {
namespace {

constexpr int kBackoffMs = 100;          // no accept for this long after EMFILE/ENFILE
constexpr int kCountIntervalMs = 1000;   // how often closed connections are counted
constexpr int64_t kWarningIntervalNs = int64_t{10} * 1000 * 1000 * 1000;
constexpr int kAcceptsPerWakeup = 64;    // then poll again (Stop stays responsive)

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

absl::StatusOr<std::unique_ptr<UdsListener>> UdsListener::Bind(const std::string& path,
                                                               size_t max_connections) {
  std::unique_ptr<UdsListener> l(new UdsListener());
  l->path_ = path;
  l->max_connections_ = max_connections > 0 ? max_connections : DefaultMaxConnections();
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": socket path too long"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  l->listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (l->listen_fd_ < 0) {
    return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  }
  // The umask makes the socket 0660 from its first moment; chmod afterwards for a umask that
  // another thread changed meanwhile.
  const mode_t old_umask = ::umask(0117);
  const int bound = ::bind(l->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int bind_errno = errno;
  ::umask(old_umask);
  if (bound != 0) {
    return absl::UnavailableError(absl::StrCat("bind ", path, ": ", std::strerror(bind_errno)));
  }
  ::chmod(path.c_str(), 0660);
  if (::listen(l->listen_fd_, SOMAXCONN) != 0) {
    return absl::UnavailableError(absl::StrCat("listen ", path, ": ", std::strerror(errno)));
  }
  l->wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  l->reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (l->wake_fd_ < 0 || l->reserve_fd_ < 0) {
    return absl::InternalError(absl::StrCat("eventfd/open: ", std::strerror(errno)));
  }
  return l;
}

UdsListener::~UdsListener() {
  Stop();
  if (wake_fd_ >= 0) ::close(wake_fd_);
  if (reserve_fd_ >= 0) ::close(reserve_fd_);
}

void UdsListener::Start(ConnectionSink sink) {
  sink_ = std::move(sink);
  thread_ = std::thread([this] { Loop(); });
}

void UdsListener::Stop() {
  stopping_.store(true);
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
}

void UdsListener::Loop() {
  int64_t next_count_ns = MonotonicNs() + int64_t{kCountIntervalMs} * 1000000;
  bool backing_off = false;
  while (!stopping_.load()) {
    // While backing off only the wake descriptor is watched: pending connections wait in the
    // backlog, and the loop sleeps instead of failing accept in a tight loop.
    pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    const int r = ::poll(fds, backing_off ? 1 : 2, backing_off ? kBackoffMs : kCountIntervalMs);
    if (r < 0 && errno != EINTR) {
      MUOND_LOG(ERROR) << "unix socket " << path_ << ": poll: " << std::strerror(errno);
      ::poll(nullptr, 0, kBackoffMs);
    }
    if (stopping_.load()) break;
    backing_off = false;
    if (MonotonicNs() >= next_count_ns) {
      CountOpen();
      next_count_ns = MonotonicNs() + int64_t{kCountIntervalMs} * 1000000;
    }
    if (r > 0 && (fds[1].revents & POLLIN) != 0) backing_off = !AcceptPending();
  }
}

bool UdsListener::AcceptPending() {
  for (int i = 0; i < kAcceptsPerWakeup; ++i) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        RefuseForLackOfDescriptors();
        return false;
      }
      MUOND_LOG(ERROR) << "unix socket " << path_ << ": accept: " << std::strerror(errno);
      return false;
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    struct stat st {};
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || ::fstat(fd, &st) != 0) {
      MUOND_LOG(WARNING) << "unix socket " << path_ << ": SO_PEERCRED: " << std::strerror(errno);
      ::close(fd);
      continue;
    }
    if (handed_.size() >= max_connections_) CountOpen();
    if (handed_.size() >= max_connections_ && handed_.count(fd) == 0) {
      ::close(fd);
      refused_over_bound_.fetch_add(1);
      ++refused_since_warning_;
      const int64_t now = MonotonicNs();
      if (now - last_warning_ns_ >= kWarningIntervalNs) {
        MUOND_LOG(WARNING) << "unix socket " << path_ << ": " << handed_.size()
                           << " connections open, the bound (--max-connections "
                           << max_connections_ << "); closed " << refused_since_warning_
                           << " new connection(s), the latest from uid " << cred.uid << " pid "
                           << cred.pid;
        last_warning_ns_ = now;
        refused_since_warning_ = 0;
      }
      continue;
    }
    RecordUnixPeer(fd, UnixCredentials{cred.uid, cred.gid, cred.pid});
    handed_[fd] = st.st_ino;  // a reused descriptor number: gRPC closed the old connection
    open_.store(handed_.size());
    sink_(fd);
  }
  return true;
}

void UdsListener::RefuseForLackOfDescriptors() {
  const int err = errno;
  uint64_t refused = 0;
  if (reserve_fd_ >= 0) {
    ::close(reserve_fd_);
    reserve_fd_ = -1;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
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
    MUOND_LOG(WARNING) << "unix socket " << path_ << ": out of file descriptors ("
                       << std::strerror(err) << ") with " << handed_.size()
                       << " connections open; closed " << refused_since_warning_
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

}  // namespace

void UdsListener::CountOpen() {
  for (auto it = handed_.begin(); it != handed_.end();) {
    if (StillSocket(it->first, it->second)) {
      ++it;
      continue;
    }
    ForgetUnixPeer(it->first);
    it = handed_.erase(it);
  }
  open_.store(handed_.size());
}

}  // namespace muond::server
