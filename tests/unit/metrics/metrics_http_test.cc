#include "server/ops/metrics_http.h"

#include <string>

#include "gtest/gtest.h"
#include "tests/unit/metrics/http_test_client.h"

namespace muond::server {
namespace {

using http_test::Fetch;
using http_test::Header;
using http_test::HttpResponse;

class MetricsHttpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    registry_.AddCounter("muond_requests_total", "Requests.")
        .value()
        ->Add({{"code", "OK"}})
        .Increment(3);
    auto server = MetricsServer::Start("127.0.0.1:0", &registry_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  common::MetricsRegistry registry_;
  std::unique_ptr<MetricsServer> server_;
};

TEST_F(MetricsHttpTest, ServesMetrics) {
  ASSERT_GT(server_->port(), 0);
  EXPECT_EQ(server_->address(), "127.0.0.1:" + std::to_string(server_->port()));
  const HttpResponse r = Fetch(server_->port(), "GET", "/metrics");
  EXPECT_EQ(r.status_line, "HTTP/1.1 200 OK");
  EXPECT_EQ(Header(r, "Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(Header(r, "Content-Length"), std::to_string(r.body.size()));
  EXPECT_EQ(r.body, registry_.Serialize());
  EXPECT_EQ(r.body,
            "# HELP muond_requests_total Requests.\n# TYPE muond_requests_total counter\n"
            "muond_requests_total{code=\"OK\"} 3\n");
}

TEST_F(MetricsHttpTest, EachScrapeIsFresh) {
  common::Gauge& g = registry_.AddGauge("muond_depth", "Depth.").value()->Add({});
  int depth = 0;
  registry_.AddCollectCallback([&] { g.Set(++depth); });
  EXPECT_NE(Fetch(server_->port(), "GET", "/metrics").body.find("muond_depth 1\n"),
            std::string::npos);
  EXPECT_NE(Fetch(server_->port(), "GET", "/metrics?x=1").body.find("muond_depth 2\n"),
            std::string::npos);
}

TEST_F(MetricsHttpTest, HeadHasHeadersOnly) {
  const HttpResponse r = Fetch(server_->port(), "HEAD", "/metrics");
  EXPECT_EQ(r.status_line, "HTTP/1.1 200 OK");
  EXPECT_EQ(Header(r, "Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(Header(r, "Content-Length"), std::to_string(registry_.Serialize().size()));
  EXPECT_EQ(r.body, "");
}

TEST_F(MetricsHttpTest, OtherPathsAre404) {
  for (const char* path : {"/", "/metric", "/metrics/", "/metrics2", "/foo/bar"}) {
    const HttpResponse r = Fetch(server_->port(), "GET", path);
    EXPECT_EQ(r.status_line, "HTTP/1.1 404 Not Found") << path;
    EXPECT_EQ(r.body.find("muond_requests_total"), std::string::npos) << path;
  }
}

TEST_F(MetricsHttpTest, OtherMethodsAre405) {
  for (const char* method : {"POST", "PUT", "DELETE"}) {
    const HttpResponse r = Fetch(server_->port(), method, "/metrics");
    EXPECT_EQ(r.status_line, "HTTP/1.1 405 Method Not Allowed") << method;
    EXPECT_EQ(Header(r, "Allow"), "GET, HEAD") << method;
    EXPECT_EQ(r.body.find("muond_requests_total"), std::string::npos) << method;
  }
}

TEST_F(MetricsHttpTest, PortInUseNamesTheAddress) {
  const std::string address = "127.0.0.1:" + std::to_string(server_->port());
  auto second = MetricsServer::Start(address, &registry_);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find(address), std::string::npos) << second.status();
  EXPECT_NE(second.status().message().find("in use"), std::string::npos) << second.status();
}

TEST_F(MetricsHttpTest, StopReleasesThePort) {
  const int port = server_->port();
  server_.reset();
  auto again = MetricsServer::Start("127.0.0.1:" + std::to_string(port), &registry_);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->port(), port);
  EXPECT_EQ(Fetch(port, "GET", "/metrics").status_line, "HTTP/1.1 200 OK");
}

TEST(MetricsHttpAddressTest, BadAddressesRefused) {
  common::MetricsRegistry registry;
  for (const char* address :
       {"", "127.0.0.1", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:65536", "127.0.0.1:-1",
        "999.0.0.1:0", "example.com:9000", "::1:0", "[::1:0", "[nonsense]:0", ":9000"}) {
    auto server = MetricsServer::Start(address, &registry);
    ASSERT_FALSE(server.ok()) << address;
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << address;
    EXPECT_NE(server.status().message().find(std::string("\"") + address + "\""), std::string::npos)
        << server.status();
  }
}

TEST(MetricsHttpAddressTest, UnbindableAddressRefused) {
  common::MetricsRegistry registry;
  // 192.0.2.0/24 is TEST-NET-1: not an address of this host.
  auto server = MetricsServer::Start("192.0.2.1:0", &registry);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(server.status().message().find("192.0.2.1:0"), std::string::npos) << server.status();
}

TEST(MetricsHttpAddressTest, LocalhostMeansLoopback) {
  common::MetricsRegistry registry;
  auto server = MetricsServer::Start("localhost:0", &registry);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->address(), "127.0.0.1:" + std::to_string((*server)->port()));
  EXPECT_EQ(Fetch((*server)->port(), "GET", "/metrics").status_line, "HTTP/1.1 200 OK");
}

// A host without IPv6 (a container without ::1) refuses clearly, naming the address.
TEST(MetricsHttpAddressTest, Ipv6LoopbackServesOrIsRefusedClearly) {
  common::MetricsRegistry registry;
  auto server = MetricsServer::Start("[::1]:0", &registry);
  if (!server.ok()) {
    EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_NE(server.status().message().find("\"[::1]:0\""), std::string::npos) << server.status();
    return;
  }
  EXPECT_GT((*server)->port(), 0);
  EXPECT_EQ((*server)->address(), "[::1]:" + std::to_string((*server)->port()));
}

}  // namespace
}  // namespace muond::server
