// Test clients for the metrics endpoint, over TCP to 127.0.0.1 only: one-request HTTP fetches and
// raw connections for clients that misbehave. Failures are reported through gtest.
#ifndef MUOND_TESTS_UNIT_METRICS_HTTP_TEST_CLIENT_H_
#define MUOND_TESTS_UNIT_METRICS_HTTP_TEST_CLIENT_H_

#include <chrono>
#include <string>

namespace muond::server::http_test {

struct HttpResponse {
  std::string status_line;  // "" when no complete response head arrived.
  std::string headers;      // Raw, lines joined with "\r\n".
  std::string body;
};

// Splits a raw response; an incomplete one leaves status_line empty.
HttpResponse ParseResponse(const std::string& raw);

// A blocking TCP socket connected to 127.0.0.1:port, or -1 (errno set).
int ConnectLoopback(int port);

// One request with `Connection: close`, read to EOF.
// `host`: the Host header's value ("": 127.0.0.1:PORT; "-": no Host header).
HttpResponse Fetch(int port, const std::string& method, const std::string& path,
                   const std::string& host = "");

// The value of header `name` (case-insensitive), or "" when absent.
std::string Header(const HttpResponse& r, const std::string& name);

struct Exchange {
  std::string raw;      // Everything read.
  size_t sent = 0;      // Bytes of the request the server took before it closed.
  bool closed = false;  // The server closed (EOF or reset) within the time allowed.
};

// Sends `request` on a new connection while reading whatever comes back, until the server closes
// the connection or `timeout` passes. A server that stops reading does not block it.
Exchange SendAndRead(int port, const std::string& request, std::chrono::milliseconds timeout);

}  // namespace muond::server::http_test

#endif  // MUOND_TESTS_UNIT_METRICS_HTTP_TEST_CLIENT_H_
