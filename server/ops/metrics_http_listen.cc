#include "server/ops/metrics_http_listen.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>

#include "absl/strings/str_cat.h"

namespace muond::server::http {
namespace {

absl::Status BadAddress(const std::string& address, std::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("metrics address \"", address, "\" is not HOST:PORT: ", std::string(why)));
}

}  // namespace

absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return BadAddress(address, "no port");
  std::string host = address.substr(0, colon);
  const std::string port_text = address.substr(colon + 1);
  if (port_text.empty() || port_text.size() > 5 ||
      port_text.find_first_not_of("0123456789") != std::string::npos ||
      std::stoi(port_text) > 65535) {
    return BadAddress(address, "the port must be a number from 0 to 65535");
  }
  ListenAddress out;
  out.port = std::stoi(port_text);
  if (host == "localhost") host = "127.0.0.1";
  std::memset(&out.socket_address, 0, sizeof(out.socket_address));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    auto* a = reinterpret_cast<sockaddr_in6*>(&out.socket_address);
    if (inet_pton(AF_INET6, host.substr(1, host.size() - 2).c_str(), &a->sin6_addr) != 1) {
      return BadAddress(address, "the host in brackets is not an IPv6 address");
    }
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(static_cast<uint16_t>(out.port));
    out.socket_address_size = sizeof(*a);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&out.socket_address);
    if (inet_pton(AF_INET, host.c_str(), &a->sin_addr) != 1) {
      return BadAddress(address,
                        "the host must be an IPv4 address, \"localhost\" or [an IPv6 address]");
    }
    a->sin_family = AF_INET;
    a->sin_port = htons(static_cast<uint16_t>(out.port));
    out.socket_address_size = sizeof(*a);
  }
  out.host = host;
  return out;
}

absl::StatusOr<std::pair<int, int>> Listen(const ListenAddress& a) {
  const int fd = socket(a.socket_address.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  const int one = 1;  // A restarted daemon rebinds while old connections are in TIME_WAIT.
  (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_storage bound;
  socklen_t bound_size = sizeof(bound);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&a.socket_address), a.socket_address_size) != 0 ||
      listen(fd, SOMAXCONN) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &bound_size) != 0) {
    const int error = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot bind to ", a.host, ":", a.port, ": ", std::strerror(error)));
  }
  const uint16_t port = bound.ss_family == AF_INET6
                            ? reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port
                            : reinterpret_cast<const sockaddr_in*>(&bound)->sin_port;
  return std::make_pair(fd, static_cast<int>(ntohs(port)));
}

}  // namespace muond::server::http
