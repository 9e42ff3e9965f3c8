#include "server/ops/sd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/heartbeat.h"
#include "common/logging.h"

namespace muond::server {

absl::Status SdNotify(const std::string& state) {
  const char* env = std::getenv("NOTIFY_SOCKET");
  if (env == nullptr || env[0] == '\0') return absl::OkStatus();
  const std::string path = env;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if ((path[0] != '/' && path[0] != '@') || path.size() < 2 ||
      path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NOTIFY_SOCKET=", path, ": expected an absolute path or @abstract-name"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  // An abstract address starts with a NUL byte and its length is exact (no terminator).
  if (path[0] == '@') addr.sun_path[0] = '\0';
  const socklen_t len =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size() + (path[0] == '/'));
  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  const ssize_t sent = sendto(fd, state.data(), state.size(), MSG_NOSIGNAL,
                              reinterpret_cast<const sockaddr*>(&addr), len);
  const int err = errno;
  close(fd);
  if (sent != static_cast<ssize_t>(state.size())) {
    return absl::UnavailableError(
        absl::StrCat("sd_notify to ", path, ": ", sent < 0 ? std::strerror(err) : "short send"));
  }
  return absl::OkStatus();
}

absl::Duration SdWatchdogInterval() {
  const char* usec = std::getenv("WATCHDOG_USEC");
  uint64_t us = 0;
  if (usec == nullptr || !absl::SimpleAtoi(usec, &us) || us == 0) return absl::ZeroDuration();
  if (const char* pid = std::getenv("WATCHDOG_PID"); pid != nullptr && pid[0] != '\0') {
    int64_t p = 0;
    if (!absl::SimpleAtoi(pid, &p) || p != getpid()) return absl::ZeroDuration();
  }
  return absl::Microseconds(static_cast<int64_t>(us));
}

SdWatchdog::SdWatchdog(absl::Duration interval) {
  if (interval <= absl::ZeroDuration()) return;
  thread_ = std::thread([this, interval] { Loop(interval / 2); });
}

SdWatchdog::~SdWatchdog() {
  if (!thread_.joinable()) return;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void SdWatchdog::Loop(absl::Duration period) {
  bool logged = false;
  bool withheld = false;
  const absl::Duration window = std::max(period, 2 * common::Heartbeat::kMaxWait);
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    const std::vector<std::string> stale = common::Heartbeats::Default().Stale(window);
    if (!stale.empty()) {
      if (!withheld) {
        MUOND_LOG(ERROR) << "not pinging the systemd watchdog: no progress from the "
                         << absl::StrJoin(stale, ", ") << " within "
                         << absl::ToDoubleSeconds(window) << " s; systemd restarts the daemon";
      }
      withheld = true;
    } else {
      if (withheld) MUOND_LOG(INFO) << "systemd watchdog pings resume: every part shows progress";
      withheld = false;
      absl::Status s = SdNotify("WATCHDOG=1");
      if (!s.ok() && !logged) {
        MUOND_LOG(WARNING) << "systemd watchdog ping: " << s;
        logged = true;
      }
    }
    // Wakes early only to stop.
    mu_.AwaitWithTimeout(absl::Condition(&stop_), period);
  }
}

}  // namespace muond::server
