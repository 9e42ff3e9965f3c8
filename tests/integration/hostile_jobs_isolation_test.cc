// One job's load next to another's (label `hostile`): idle and oversized requests to the live
// daemon's /metrics do not starve scrapes, and one job's heavy checkpoint work does not stall
// another job's steps.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/integration/hostile_jobs_fixture.h"

namespace muond::integration {
namespace {

// A TCP connection to 127.0.0.1:PORT with a 5 s receive timeout; -1 when it cannot connect.
int ConnectLoopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// GET http://127.0.0.1:PORT/metrics: the body (empty on failure).
std::string Scrape(int port) {
  const int fd = ConnectLoopback(port);
  std::string got;
  if (fd >= 0) {
    const std::string req = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
      char buf[65536];
      ssize_t n;
      while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) got.append(buf, static_cast<size_t>(n));
    }
  }
  if (fd >= 0) ::close(fd);
  return got;
}

// The metrics port a daemon started with --metrics-address 127.0.0.1:0 chose (from its log).
int MetricsPort(const std::string& log) {
  const std::string key = "metrics on http://127.0.0.1:";
  const size_t at = log.find(key);
  return at == std::string::npos ? 0 : std::atoi(log.c_str() + at + key.size());
}

// The live daemon's /metrics while hundreds of connections sit idle on it, and oversized
// requests to it: scrapes stay fast, the junk gets a 4xx, the victim steps on.
TEST_F(HostileJobsTest, IdleAndOversizedMetricsRequestsDoNotStarveScrapes) {
  Start({"--metrics-address", "127.0.0.1:0"});
  MakeVictim();
  const int port = MetricsPort(daemon_->Log());
  ASSERT_NE(port, 0) << daemon_->Log();
  std::vector<int> idle;
  for (int i = 0; i < 300; ++i) {
    const int fd = ConnectLoopback(port);
    ASSERT_GE(fd, 0);
    idle.push_back(fd);
  }
  double worst = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    const std::string body = Scrape(port);
    worst = std::max(worst, Seconds(t0));
    EXPECT_TRUE(absl::StrContains(body, "muond_limit{limit=\"max_jobs\"} 64")) << body.substr(0, 300);
  }
  std::printf("/metrics with 300 idle connections open: worst scrape of 5 %.1f ms\n", worst * 1e3);
  EXPECT_LT(worst, 1.0);
  // A 64 KiB request line and 1 MiB of headers: a 4xx, and the connection ends.
  for (const std::string& req :
       {"GET /" + std::string(65536, 'a') + " HTTP/1.1\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nX: " + std::string(1 << 20, 'h') + "\r\n\r\n"}) {
    const int fd = ConnectLoopback(port);
    ASSERT_GE(fd, 0);
    (void)::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
    char buf[256] = {};
    const ssize_t n = ::recv(fd, buf, sizeof(buf) - 1, 0);
    ::close(fd);
    ASSERT_GT(n, 12);
    const std::string status(buf, 12);
    EXPECT_TRUE(status == "HTTP/1.1 431" || status == "HTTP/1.1 413" || status == "HTTP/1.1 400")
        << status;
    std::printf("oversized request of %zu bytes: %s\n", req.size(), status.c_str());
  }
  for (int fd : idle) ::close(fd);
  ExpectVictimIntact();
  Stop();
}

// Job A's heavy work (a slow checkpoint save, a create restored from it that writes its first
// generation slowly) never stalls job B: B's steps, attaches and job listings go on.
TEST_F(HostileJobsTest, OneJobsHeavyWorkDoesNotStallAnother) {
#ifndef MUOND_TEST_HOOKS
  GTEST_SKIP() << "muond was built without test hooks (-DMUOND_TEST_HOOKS=ON)";
#endif
  ::setenv("MUOND_TEST_CHECKPOINT_FAULT", "delay:300", 1);
  Start({"--metrics-address", "127.0.0.1:0"});
  ::unsetenv("MUOND_TEST_CHECKPOINT_FAULT");
  const int metrics_port = MetricsPort(daemon_->Log());
  ASSERT_NE(metrics_port, 0) << daemon_->Log();
  common::JobSpec a = SmallSpec("heavy");
  a.matrices = {Matrix("a0", {1024, 1024}), Matrix("a1", {1024, 1024}),
                Matrix("a2", {1024, 1024}), Matrix("a3", {1024, 1024})};
  auto a_token = client_->CreateJob(a);
  ASSERT_TRUE(a_token.ok());
  common::JobSpec b = SmallSpec("light");
  auto b_token = client_->CreateJob(b);
  ASSERT_TRUE(b_token.ok());
  const MatrixBytes grads = MakeGradients(b.matrices, 1, 6);
  auto session = client_->Attach("light", 0, *b_token, false, client::Transport::kGrpc);
  ASSERT_TRUE(session.ok());
  int64_t step = 0;
  // B's step latency (a step, an attach, a job listing and a /metrics scrape), median of n.
  auto measure = [&](int n) {
    std::vector<double> t;
    for (int i = 0; i < n; ++i) {
      const auto t0 = Clock::now();
      EXPECT_TRUE(StepSpans(**session, step, grads[0]).ok());
      ++step;
      EXPECT_TRUE(client_->ListJobs().ok());
      EXPECT_TRUE(absl::StrContains(Scrape(metrics_port), "muond_jobs")) << "a scrape failed";
      auto other = client_->Attach("light", 0, *b_token, /*takeover=*/true,
                                   client::Transport::kGrpc);
      EXPECT_TRUE(other.ok());
      session = std::move(other);
      t.push_back(Seconds(t0));
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  const double quiet = measure(15);
  std::atomic<bool> heavy_done{false};
  double save_seconds = 0, create_seconds = 0;
  std::thread heavy([&] {
    const auto t0 = Clock::now();
    EXPECT_TRUE(client_->SaveCheckpoint("heavy", *a_token).ok());
    save_seconds = Seconds(t0);
    const auto t1 = Clock::now();
    common::JobSpec copy = a;
    copy.job_id = "heavy-copy";
    auto c = client::Client::Connect(daemon_->address());
    v1::RestoreFrom from;
    from.set_job_id("heavy");
    from.set_token(*a_token);
    auto copied = (*c)->CreateJob(copy, &from);
    EXPECT_TRUE(copied.ok()) << copied.status();
    create_seconds = Seconds(t1);
    heavy_done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const double busy = measure(15);
  const bool overlapped = !heavy_done.load();
  heavy.join();
  std::printf("job B step+list+attach+scrape median: %.1f ms quiet, %.1f ms while job A saves (%.1f s) "
              "and a job is created from A's checkpoint (%.1f s); ratio %.2f\n",
              quiet * 1e3, busy * 1e3, save_seconds, create_seconds, busy / quiet);
  EXPECT_TRUE(overlapped) << "A's work ended before B's measurement";
  EXPECT_LT(busy, quiet * 5 + 0.25) << "job B stalled behind job A";
  Stop();
}

}  // namespace
}  // namespace muond::integration
