// MetricsServer: the HTTP endpoint Prometheus scrapes. Serves `GET /metrics` (and HEAD) from a
// common::MetricsRegistry (prometheus-cpp's text serialization, format 0.0.4), on one thread of
// its own (an epoll loop over non-blocking sockets), so a slow scraper never touches the daemon's
// gRPC threads and no other client of the port can keep a scrape from being answered.
//
//   /metrics, GET or HEAD -> 200, Content-Type "text/plain; version=0.0.4; charset=utf-8"
//   /metrics, any other method -> 405 with "Allow: GET, HEAD"
//   a path of options.pages (MetricsPage) -> the same rules, with that page's body; a page with
//     check_host and a Host header that does not name this server -> 421
//   any other path -> 404
//   request line and headers longer than max_request_bytes -> 431
//   a body on GET or HEAD -> 413; a request that does not parse as HTTP/1.0 or 1.1 -> 400
// Every response carries "Connection: close" and ends its connection.
//
// Hostile clients hold bounded resources: at most max_connections connections, each with at most
// max_request_bytes buffered; a connection that has not sent its request and taken its response
// within request_timeout of being accepted is closed, so idle and slow ("slow-loris") connections
// cost a descriptor and a small buffer until then. When descriptors run out (EMFILE/ENFILE) the
// server sheds the waiting connections through a descriptor it keeps in reserve, pauses accepting
// for descriptor_backoff and then tries again: it neither spins nor stops for good.
//
// Thread-safety: Start and the destructor are called from one thread; port(), address() and
// stats() are thread-safe. Requests are served on the server's thread, each scrape calling
// MetricsRegistry::Serialize() there.
#ifndef MUOND_SERVER_OPS_METRICS_HTTP_H_
#define MUOND_SERVER_OPS_METRICS_HTTP_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/metrics.h"

namespace muond::server {

// A page served beside /metrics on the same address (the status page and its JSON,
// server/ops/status_page.h): GET and HEAD answered 200 with render()'s body, other methods 405.
struct MetricsPage {
  std::string path;  // the exact request path, e.g. "/" or "/api/v1/status"
  std::string content_type;
  std::string extra_headers;            // whole header lines, each ending "\r\n"
  std::function<std::string()> render;  // called on the server's thread for each GET
  // Answered only when the request's Host header names the address the server listens on (a
  // browser page that a rebinding DNS name points at this port is refused 421): the bound
  // HOST:PORT, "localhost:PORT" on a loopback or wildcard address, and on a wildcard address any
  // IP literal or this machine's host name with the port.
  bool check_host = false;
};

// Bounds on what clients of the metrics endpoint may hold; the defaults suit a daemon scraped by a
// few Prometheus servers.
struct MetricsServerOptions {
  // Connections open at once, at least 1. A connection accepted at the limit sheds the open one
  // closest to its deadline: one that has had its response, else the oldest (a scrape takes
  // milliseconds, so the oldest is an idle or a slow one).
  int max_connections = 1024;
  // Time from accepting a connection by which its request must have arrived and its response have
  // been written; the connection is closed then. Positive.
  absl::Duration request_timeout = absl::Seconds(10);
  // Bytes of request line and headers, at least 64; more without the end of the headers gets 431.
  size_t max_request_bytes = 8192;
  // How long accepting pauses when the process is out of descriptors. Not negative.
  absl::Duration descriptor_backoff = absl::Milliseconds(100);
  // Pages served beside /metrics; none by default.
  std::vector<MetricsPage> pages;
};

// Counts since Start. A snapshot: each field read atomically, not all at one instant.
struct MetricsServerStats {
  uint64_t accepted = 0;             // Connections taken in.
  uint64_t open = 0;                 // Connections open now.
  uint64_t responses = 0;            // Responses written in full, any status.
  uint64_t timed_out = 0;            // Closed at request_timeout before their response was out.
  uint64_t shed_at_limit = 0;        // Closed to make room at max_connections.
  uint64_t shed_no_descriptors = 0;  // Accepted and closed at once: descriptors had run out.
  uint64_t accept_pauses = 0;        // Times accepting paused (descriptors or memory ran out).
};

class MetricsServer {
 public:
  static constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

  // Listens on `address`, "HOST:PORT": HOST an IPv4 literal ("0.0.0.0" for all interfaces),
  // "localhost" (127.0.0.1) or an IPv6 literal in brackets ("[::1]"); PORT 0..65535, 0 meaning
  // any free port (see port()). The server is serving when Start returns. `registry` is not owned.
  // REQUIRES: `registry` outlives the returned server.
  // Errors name the address: INVALID_ARGUMENT for an address that does not parse or options out of
  // range, UNAVAILABLE when it cannot be bound (port in use, address not on this host, permission).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address, common::MetricsRegistry* registry,
      const MetricsServerOptions& options = MetricsServerOptions());

  // Stops listening, closes every connection and joins the server's thread (a scrape in progress
  // finishes rendering first; milliseconds).
  ~MetricsServer();

  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // The port actually bound (the one chosen by the kernel when the address asked for port 0).
  int port() const { return port_; }
  // "HOST:PORT" with the bound port, e.g. "127.0.0.1:40123" or "[::1]:9464".
  const std::string& address() const { return address_; }
  MetricsServerStats stats() const;

 private:
  class EventLoop;  // The connections and the epoll loop, all on thread_.

  MetricsServer() = default;

  std::unique_ptr<EventLoop> loop_;
  std::thread thread_;
  int port_ = 0;
  std::string address_;
};

}  // namespace muond::server

#endif  // MUOND_SERVER_OPS_METRICS_HTTP_H_
