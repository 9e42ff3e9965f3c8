#include "tests/deploy/notify_listener.h"

#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace muond::deploy_test {

NotifyListener::NotifyListener(Kind kind) {
  fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) {
    ADD_FAILURE() << "socket: " << std::strerror(errno);
    return;
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  socklen_t len = 0;
  if (kind == Kind::kPath) {
    char tmpl[] = "/tmp/muond-notify.XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      ADD_FAILURE() << "mkdtemp: " << std::strerror(errno);
      close(fd_);
      fd_ = -1;
      return;
    }
    dir_ = tmpl;
    address_ = dir_ + "/notify";
    std::memcpy(addr.sun_path, address_.data(), address_.size());
    len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address_.size() + 1);
  } else {
    address_ = absl::StrCat("@muond-test-", getpid(), "-", std::random_device{}());
    addr.sun_path[0] = '\0';
    std::memcpy(addr.sun_path + 1, address_.data() + 1, address_.size() - 1);
    len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address_.size());
  }
  if (bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    ADD_FAILURE() << "bind " << address_ << ": " << std::strerror(errno);
    close(fd_);
    fd_ = -1;
  }
}

NotifyListener::~NotifyListener() {
  if (fd_ >= 0) close(fd_);
  if (!dir_.empty()) {
    unlink(address_.c_str());
    rmdir(dir_.c_str());
  }
}

std::optional<std::string> NotifyListener::Receive(double timeout_seconds) {
  pollfd p{fd_, POLLIN, 0};
  const int ready = poll(&p, 1, static_cast<int>(timeout_seconds * 1000));
  if (ready <= 0) return std::nullopt;
  char buf[4096];
  const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
  if (n < 0) return std::nullopt;
  return std::string(buf, static_cast<size_t>(n));
}

}  // namespace muond::deploy_test
