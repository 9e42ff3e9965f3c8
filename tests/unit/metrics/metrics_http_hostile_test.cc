// The metrics endpoint under clients that misbehave: many idle connections, slow-loris clients,
// oversized requests, wrong methods and paths, and a process out of file descriptors. Every client
// connects to 127.0.0.1 only. Each case prints what it measured.
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/ops/metrics_http.h"
#include "tests/unit/metrics/http_test_client.h"

namespace muond::server {
namespace {

using Steady = std::chrono::steady_clock;
using http_test::ConnectLoopback;
using http_test::Exchange;
using http_test::Fetch;
using http_test::Header;
using http_test::HttpResponse;
using http_test::ParseResponse;
using http_test::SendAndRead;
using std::chrono::milliseconds;

double SecondsSince(Steady::time_point start) {
  return std::chrono::duration<double>(Steady::now() - start).count();
}

// User plus system CPU time of the whole process: the test's thread and the server's.
double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

long ResidentKiB() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::strtol(line.c_str() + 6, nullptr, 10);
  }
  return -1;
}

int HighestOpenFd() {
  int highest = -1;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  for (dirent* e; (e = readdir(dir)) != nullptr;) {
    if (e->d_name[0] != '.') highest = std::max(highest, std::atoi(e->d_name));
  }
  closedir(dir);
  return highest;
}

template <typename Predicate>
bool WaitFor(Predicate done, milliseconds timeout) {
  const Steady::time_point deadline = Steady::now() + timeout;
  while (!done() && Steady::now() < deadline) std::this_thread::sleep_for(milliseconds(5));
  return done();
}

// Waits up to `timeout` for the server to end `fd`: true on EOF or reset, false if it stays open.
bool ClosedByServer(int fd, milliseconds timeout) {
  timeval tv{static_cast<time_t>(timeout.count() / 1000),
             static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[256];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
    if (n < 0) return false;  // EAGAIN: still open when the time ran out.
  }
}

class MetricsHttpHostileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Each connection costs this process two descriptors, the client's and the server's.
    rlimit limit{};
    ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit), 0);
    limit.rlim_cur = std::min<rlim_t>(limit.rlim_max, 65536);
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &limit), 0);
    ASSERT_GE(limit.rlim_cur, 2048u) << "too few descriptors for 500 connections";
    registry_.AddCounter("muond_requests_total", "Requests.")
        .value()
        ->Add({{"code", "OK"}})
        .Increment(3);
  }

  void TearDown() override {
    server_.reset();
    for (int fd : clients_) close(fd);
  }

  void StartServer(const MetricsServerOptions& options = MetricsServerOptions()) {
    auto server = MetricsServer::Start("127.0.0.1:0", &registry_, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  // One GET /metrics; checks it is the registry's text and returns its latency in seconds.
  double TimedScrape() {
    const Steady::time_point start = Steady::now();
    const HttpResponse r = Fetch(server_->port(), "GET", "/metrics");
    const double seconds = SecondsSince(start);
    EXPECT_EQ(r.status_line, "HTTP/1.1 200 OK");
    EXPECT_EQ(Header(r, "Content-Type"), MetricsServer::kContentType);
    EXPECT_EQ(r.body, registry_.Serialize());
    return seconds;
  }

  // Opens `n` connections that send nothing; kept in clients_.
  void OpenIdle(int n) {
    for (int i = 0; i < n; ++i) {
      const int fd = ConnectLoopback(server_->port());
      ASSERT_GE(fd, 0) << "connection " << i << ": " << strerror(errno);
      clients_.push_back(fd);
    }
  }

  common::MetricsRegistry registry_;
  std::unique_ptr<MetricsServer> server_;
  std::vector<int> clients_;
};

TEST_F(MetricsHttpHostileTest, ScrapeWithManyIdleConnections) {
  constexpr int kIdle = 500;
  StartServer();
  const double baseline = TimedScrape();
  OpenIdle(kIdle);
  ASSERT_TRUE(WaitFor([&] { return server_->stats().open >= kIdle; }, milliseconds(5000)))
      << server_->stats().open << " connections open";
  double worst = 0;
  for (int i = 0; i < 5; ++i) worst = std::max(worst, TimedScrape());
  EXPECT_LT(worst, 1.0);
  // None shed, none timed out (the scrapes' own connections end once the server reads their EOF).
  EXPECT_TRUE(WaitFor([&] { return server_->stats().open == kIdle; }, milliseconds(2000)))
      << server_->stats().open;
  std::cout << "scrape latency: " << baseline * 1e3 << " ms with no other connection, "
            << worst * 1e3 << " ms (worst of 5) with " << kIdle << " idle connections open"
            << " (ratio " << worst / baseline << ")\n";
}

TEST_F(MetricsHttpHostileTest, ScrapeDuringSlowLoris) {
  constexpr int kSlow = 50;
  StartServer();
  OpenIdle(kSlow);
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  std::atomic<bool> stop{false};
  std::thread dribbler([&] {  // One byte per connection per second.
    for (size_t i = 0; i < request.size() && !stop.load(); ++i) {
      for (int fd : clients_) (void)send(fd, &request[i], 1, MSG_NOSIGNAL);
      for (int t = 0; t < 100 && !stop.load(); ++t) std::this_thread::sleep_for(milliseconds(10));
    }
  });
  double worst = 0;
  const Steady::time_point start = Steady::now();
  int scrapes = 0;
  while (SecondsSince(start) < 3.5) {
    worst = std::max(worst, TimedScrape());
    ++scrapes;
    std::this_thread::sleep_for(milliseconds(250));
  }
  stop.store(true);
  dribbler.join();
  EXPECT_LT(worst, 1.0);
  const MetricsServerStats stats = server_->stats();
  EXPECT_EQ(stats.responses, static_cast<uint64_t>(scrapes));  // The slow requests got nothing.
  EXPECT_EQ(stats.open, static_cast<uint64_t>(kSlow));
  std::cout << "scrape latency with " << kSlow << " slow-loris clients: " << worst * 1e3
            << " ms (worst of " << scrapes << ")\n";
}

TEST_F(MetricsHttpHostileTest, LongRequestLineIs431AndClosed) {
  StartServer();
  const std::string request =
      "GET /" + std::string(64 * 1024, 'a') + " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  const Exchange x = SendAndRead(server_->port(), request, milliseconds(5000));
  EXPECT_TRUE(x.closed);
  EXPECT_EQ(ParseResponse(x.raw).status_line, "HTTP/1.1 431 Request Header Fields Too Large");
  TimedScrape();
}

TEST_F(MetricsHttpHostileTest, MegabyteOfHeadersIs431AndMemoryBounded) {
  constexpr int kClients = 8;
  StartServer();
  std::string request = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n";
  for (int i = 0; request.size() < (1u << 20); ++i) {
    request += "X-Filler-" + std::to_string(i) + ": " + std::string(100, 'x') + "\r\n";
  }
  request += "\r\n";
  TimedScrape();  // The server's first allocations are made before the baseline.
  const long before_kib = ResidentKiB();
  std::vector<Exchange> results(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back(
        [&, i] { results[i] = SendAndRead(server_->port(), request, milliseconds(5000)); });
  }
  for (std::thread& t : threads) t.join();
  const long after_kib = ResidentKiB();
  for (const Exchange& x : results) {
    EXPECT_TRUE(x.closed);
    EXPECT_EQ(ParseResponse(x.raw).status_line, "HTTP/1.1 431 Request Header Fields Too Large");
    EXPECT_EQ(x.raw.find("muond_requests_total"), std::string::npos);
  }
  EXPECT_LT(after_kib - before_kib, 4096) << before_kib << " KiB -> " << after_kib << " KiB";
  std::cout << kClients << " requests with 1 MiB of headers each: resident memory " << before_kib
            << " KiB -> " << after_kib << " KiB\n";
  TimedScrape();
}

TEST_F(MetricsHttpHostileTest, WrongRequestsGetTheirStatusAndAreClosed) {
  StartServer();
  struct Case {
    std::string request;
    std::string status_line;
  };
  const std::vector<Case> cases = {
      {"POST /metrics HTTP/1.1\r\nContent-Length: 11\r\n\r\nhello world",
       "HTTP/1.1 405 Method Not Allowed"},
      {"GET /admin HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", "HTTP/1.1 404 Not Found"},
      {"GET /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", "HTTP/1.1 413 Payload Too Large"},
      {"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
       "HTTP/1.1 413 Payload Too Large"},
      {"NONSENSE\r\n\r\n", "HTTP/1.1 400 Bad Request"},
      {"GET /metrics HTTP/9.9\r\n\r\n", "HTTP/1.1 400 Bad Request"},
      {"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n", "HTTP/1.1 400 Bad Request"},
  };
  for (const Case& c : cases) {
    const Exchange x = SendAndRead(server_->port(), c.request, milliseconds(3000));
    const HttpResponse r = ParseResponse(x.raw);
    EXPECT_TRUE(x.closed) << c.request;
    EXPECT_EQ(r.status_line, c.status_line) << c.request;
    EXPECT_EQ(Header(r, "Connection"), "close") << c.request;
    EXPECT_EQ(r.body.find("muond_requests_total"), std::string::npos) << c.request;
    if (c.status_line.find("405") != std::string::npos) {
      EXPECT_EQ(Header(r, "Allow"), "GET, HEAD");
    }
  }
  TimedScrape();
}

TEST_F(MetricsHttpHostileTest, IdleAndDribblingConnectionsClosedAtTimeout) {
  MetricsServerOptions options;
  options.request_timeout = absl::Milliseconds(300);
  StartServer(options);
  OpenIdle(2);
  const Steady::time_point start = Steady::now();
  std::thread dribbler([fd = clients_[1]] {  // A byte every 50 ms: active, never complete.
    for (int i = 0; i < 40 && send(fd, "G", 1, MSG_NOSIGNAL) == 1; ++i) {
      std::this_thread::sleep_for(milliseconds(50));
    }
  });
  EXPECT_TRUE(ClosedByServer(clients_[0], milliseconds(3000)));
  const double idle_closed = SecondsSince(start);
  EXPECT_TRUE(ClosedByServer(clients_[1], milliseconds(3000)));
  const double dribbling_closed = SecondsSince(start);
  dribbler.join();
  EXPECT_GE(idle_closed, 0.25);
  EXPECT_LT(idle_closed, 1.0);
  EXPECT_LT(dribbling_closed, 1.0);
  EXPECT_EQ(server_->stats().timed_out, 2u);
  EXPECT_EQ(server_->stats().open, 0u);
  std::cout << "timeout 300 ms: idle connection closed after " << idle_closed * 1e3
            << " ms, dribbling one after " << dribbling_closed * 1e3 << " ms\n";
  TimedScrape();
}

TEST_F(MetricsHttpHostileTest, ConnectionLimitShedsTheOldest) {
  constexpr int kLimit = 8;
  MetricsServerOptions options;
  options.max_connections = kLimit;
  StartServer(options);
  for (int i = 0; i < kLimit; ++i) {
    OpenIdle(1);
    ASSERT_TRUE(
        WaitFor([&] { return server_->stats().open == clients_.size(); }, milliseconds(2000)));
  }
  OpenIdle(1);  // The ninth: the first goes.
  EXPECT_TRUE(ClosedByServer(clients_[0], milliseconds(2000)));
  TimedScrape();  // Sheds the second.
  EXPECT_TRUE(ClosedByServer(clients_[1], milliseconds(2000)));
  for (size_t i = 2; i < clients_.size(); ++i) {
    EXPECT_FALSE(ClosedByServer(clients_[i], milliseconds(1))) << i;
  }
  EXPECT_EQ(server_->stats().shed_at_limit, 2u);
  EXPECT_LE(server_->stats().open, static_cast<uint64_t>(kLimit));
}

TEST_F(MetricsHttpHostileTest, RecoversFromDescriptorExhaustion) {
  StartServer();  // Pauses accepting for 100 ms after each exhaustion.
  // Sockets made now and connected once no descriptor is left.
  std::vector<int> spares;
  for (int i = 0; i < 64; ++i) spares.push_back(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = HighestOpenFd() + 1 + 16;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  int fill_errno = 0;
  for (int i = 0; i < 1000; ++i) {  // Until this process, client or server, has no descriptor left.
    const int fd = ConnectLoopback(server_->port());
    if (fd < 0) {
      fill_errno = errno;
      break;
    }
    clients_.push_back(fd);
  }
  size_t next_spare = 0;
  const auto connect_spare = [&] {
    if (next_spare == spares.size()) return;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(server_->port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(spares[next_spare++], reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  };
  for (int i = 0; i < 16 && server_->stats().shed_no_descriptors == 0; ++i) {
    connect_spare();
    WaitFor([&] { return server_->stats().shed_no_descriptors > 0; }, milliseconds(200));
  }
  ASSERT_GT(server_->stats().shed_no_descriptors, 0u) << "the server never ran out";
  // A spare connected before the first shed may have found the server one descriptor short of
  // the limit and been taken in: the first one the server must refuse is the next.
  const size_t first_refused = next_spare;
  // About a second of connections arriving while none can be taken in.
  const double cpu_before = ProcessCpuSeconds();
  const Steady::time_point start = Steady::now();
  while (SecondsSince(start) < 1.0) {
    connect_spare();
    std::this_thread::sleep_for(milliseconds(40));
  }
  const double cpu = ProcessCpuSeconds() - cpu_before;
  const double wall = SecondsSince(start);
  const MetricsServerStats at_limit = server_->stats();
  const bool spare_refused = ClosedByServer(spares[first_refused], milliseconds(1000));
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  for (int fd : clients_) close(fd);
  for (int fd : spares) close(fd);
  clients_.clear();
  EXPECT_EQ(fill_errno, EMFILE);
  EXPECT_TRUE(spare_refused);
  EXPECT_LT(cpu, 0.3);
  const Steady::time_point recovering = Steady::now();
  ASSERT_TRUE(WaitFor([&] { return server_->stats().open == 0; }, milliseconds(3000)));
  TimedScrape();
  std::cout << "out of descriptors: " << cpu << " CPU seconds in " << wall << " s, "
            << at_limit.shed_no_descriptors << " connections shed, " << at_limit.accept_pauses
            << " accept pauses, " << at_limit.open << " open; serving again "
            << SecondsSince(recovering) * 1e3 << " ms after descriptors came back\n";
}

}  // namespace
}  // namespace muond::server
