// HTTP/1.1 request heads and responses of the metrics endpoint (server/ops/metrics_http.h): finding
// the end of a request head, parsing it, and the answer each request gets. Pure functions;
// thread-safe.
#ifndef MUOND_SERVER_OPS_METRICS_HTTP_REQUEST_H_
#define MUOND_SERVER_OPS_METRICS_HTTP_REQUEST_H_

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "common/metrics.h"
#include "server/ops/metrics_http.h"

namespace muond::server::http {

inline constexpr char kMetricsPath[] = "/metrics";

// A whole response: status line, headers (Connection: close) and, unless `head`, the body.
std::string Response(const char* status, const std::string& body, bool head = false,
                     const char* extra_headers = "",
                     const char* content_type = "text/plain; charset=utf-8");
// The length of the request head in `in` (request line and headers up to and including the line
// break before the blank line), or npos while it is incomplete. Scans from `from`.
size_t HeadLength(std::string_view in, size_t from);
// The address a server listens on, for MetricsPage::check_host: `host` as bound ("127.0.0.1",
// "[::1]", "0.0.0.0", "[::]") and its port.
struct BoundAddress {
  std::string host;
  int port = 0;
};
// Whether a Host header value names `bound` (MetricsPage::check_host's rule).
bool HostNamesServer(std::string_view host_header, const BoundAddress& bound);
// The response to a complete request head: the registry's text for GET/HEAD /metrics; 400 for a
// malformed head, 404 for another path, 405 for another method, 413 for a request with a body.
// `pages` are answered as /metrics is (GET/HEAD 200, other methods 405), with their own bodies;
// one with check_host gets 421 unless its Host header names `bound`.
std::string Answer(std::string_view head, const common::MetricsRegistry& registry,
                   const std::vector<MetricsPage>& pages = {},
                   const BoundAddress& bound = BoundAddress());

}  // namespace muond::server::http

#endif  // MUOND_SERVER_OPS_METRICS_HTTP_REQUEST_H_
