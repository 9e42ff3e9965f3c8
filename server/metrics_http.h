// MetricsServer: the HTTP endpoint Prometheus scrapes. Serves `GET /metrics` (and HEAD) from a
// common::Registry in text format 0.0.4, on its own small civetweb thread pool so a slow scraper
// never touches the daemon's gRPC threads.
//
//   /metrics, GET or HEAD -> 200, Content-Type "text/plain; version=0.0.4; charset=utf-8"
//   /metrics, any other method -> 405 with "Allow: GET, HEAD"
//   any other path -> 404
//
// Thread-safety: Start and the destructor are called from one thread; port()/address() are
// thread-safe. Requests are served on civetweb's threads, each calling Registry::Serialize().
#ifndef MUOND_SERVER_METRICS_HTTP_H_
#define MUOND_SERVER_METRICS_HTTP_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"

struct mg_context;
struct mg_connection;

namespace muond::server {

class MetricsServer {
 public:
  static constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

  // Listens on `address`, "HOST:PORT": HOST an IPv4 literal ("0.0.0.0" for all interfaces),
  // "localhost" (127.0.0.1) or an IPv6 literal in brackets ("[::1]"; needs a civetweb built with
  // IPv6, which Debian 12's is not: UNAVAILABLE there); PORT 0..65535, 0 meaning any free port (see
  // port()). The server is serving when Start returns. `registry` is not owned.
  // REQUIRES: `registry` outlives the returned server.
  // Errors name the address: INVALID_ARGUMENT for an address that does not parse, UNAVAILABLE when
  // it cannot be bound (port in use, address not on this host, permission).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& address,
                                                              common::Registry* registry);

  // Stops listening and waits for requests in progress to finish (milliseconds unless a scrape is
  // in progress).
  ~MetricsServer();

  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // The port actually bound (the one chosen by the kernel when the address asked for port 0).
  int port() const { return port_; }
  // "HOST:PORT" with the bound port, e.g. "127.0.0.1:40123" or "[::1]:9464".
  const std::string& address() const { return address_; }

 private:
  MetricsServer(common::Registry* registry) : registry_(registry) {}
  static int HandleRequest(mg_connection* conn, void* server);
  static int LogMessage(const mg_connection* conn, const char* message);

  common::Registry* const registry_;
  mg_context* context_ = nullptr;
  int port_ = 0;
  std::string address_;
  std::string listen_host_;  // "127.0.0.1" or "[::1]".
  bool listen_ipv6_ = false;
  std::atomic<bool> started_{false};  // Set once Start has succeeded.
  absl::Mutex startup_mu_;
  std::string startup_errors_ ABSL_GUARDED_BY(startup_mu_);  // civetweb's messages during Start.
};

}  // namespace muond::server

#endif  // MUOND_SERVER_METRICS_HTTP_H_
