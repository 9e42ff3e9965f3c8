// The listening socket of the metrics endpoint (server/ops/metrics_http.h): its HOST:PORT
// address parsed and bound. Thread-safe.
#ifndef MUOND_SERVER_OPS_METRICS_HTTP_LISTEN_H_
#define MUOND_SERVER_OPS_METRICS_HTTP_LISTEN_H_

#include <sys/socket.h>

#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace muond::server::http {

// An address to listen on: IPv4, "localhost" or [IPv6], and a port (0: any free one).
struct ListenAddress {
  std::string host;  // As address() shows it: "127.0.0.1" or "[::1]".
  int port = 0;
  sockaddr_storage socket_address;
  socklen_t socket_address_size = 0;
};

// INVALID_ARGUMENT naming `address` and what is wrong with it when it is not HOST:PORT.
absl::StatusOr<ListenAddress> ParseListenAddress(const std::string& address);

// A listening, non-blocking socket bound to `a`, and the port it got; errors say why.
absl::StatusOr<std::pair<int, int>> Listen(const ListenAddress& a);

}  // namespace muond::server::http

#endif  // MUOND_SERVER_OPS_METRICS_HTTP_LISTEN_H_
