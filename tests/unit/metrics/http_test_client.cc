#include "tests/unit/metrics/http_test_client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "gtest/gtest.h"

namespace muond::server::http_test {

HttpResponse ParseResponse(const std::string& raw) {
  HttpResponse r;
  const size_t eol = raw.find("\r\n");
  const size_t end = raw.find("\r\n\r\n");
  if (eol == std::string::npos || end == std::string::npos) return r;
  r.status_line = raw.substr(0, eol);
  r.headers = eol == end ? "" : raw.substr(eol + 2, end - eol - 2);
  r.body = raw.substr(end + 4);
  return r;
}

int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int error = errno;
    close(fd);
    errno = error;
    return -1;
  }
  return fd;
}

HttpResponse Fetch(int port, const std::string& method, const std::string& path,
                   const std::string& host) {
  const int fd = ConnectLoopback(port);
  if (fd < 0) {
    ADD_FAILURE() << "connect to port " << port << " failed: " << strerror(errno);
    return HttpResponse();
  }
  const std::string host_line =
      host == "-" ? "" : "Host: " + (host.empty() ? "127.0.0.1:" + std::to_string(port) : host) +
                             "\r\n";
  const std::string request = method + " " + path + " HTTP/1.1\r\n" + host_line +
                              "Connection: close\r\nContent-Length: 0\r\n\r\n";
  EXPECT_EQ(send(fd, request.data(), request.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(request.size()));
  std::string raw;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) raw.append(buf, n);
  close(fd);
  HttpResponse r = ParseResponse(raw);
  if (r.status_line.empty()) ADD_FAILURE() << "malformed response: " << raw;
  return r;
}

std::string Header(const HttpResponse& r, const std::string& name) {
  size_t pos = 0;
  while (pos < r.headers.size()) {
    size_t eol = r.headers.find("\r\n", pos);
    if (eol == std::string::npos) eol = r.headers.size();
    const std::string line = r.headers.substr(pos, eol - pos);
    pos = eol + 2;
    const size_t colon = line.find(':');
    if (colon != name.size() || strncasecmp(line.c_str(), name.c_str(), colon) != 0) continue;
    const size_t v = line.find_first_not_of(' ', colon + 1);
    return v == std::string::npos ? "" : line.substr(v);
  }
  return "";
}

Exchange SendAndRead(int port, const std::string& request, std::chrono::milliseconds timeout) {
  Exchange x;
  const int fd = ConnectLoopback(port);
  if (fd < 0) {
    ADD_FAILURE() << "connect to port " << port << " failed: " << strerror(errno);
    return x;
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool sending = true;
  char buf[4096];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, static_cast<short>(POLLIN | (sending ? POLLOUT : 0)), 0};
    if (poll(&p, 1, 10) <= 0) continue;
    if (sending && (p.revents & POLLOUT) != 0) {
      const ssize_t n = send(fd, request.data() + x.sent, request.size() - x.sent, MSG_NOSIGNAL);
      if (n > 0) x.sent += static_cast<size_t>(n);
      if (n < 0 && errno != EAGAIN) sending = false;  // EPIPE, ECONNRESET: the server closed.
      if (x.sent == request.size()) sending = false;
    }
    if ((p.revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
      const ssize_t n = recv(fd, buf, sizeof(buf), 0);
      if (n > 0) x.raw.append(buf, n);
      if (n == 0 || (n < 0 && errno != EAGAIN)) {
        x.closed = true;
        break;
      }
    }
  }
  close(fd);
  return x;
}

}  // namespace muond::server::http_test
