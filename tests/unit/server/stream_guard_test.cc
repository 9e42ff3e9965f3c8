// StreamGuard's admission: the bound per job (2 per rank + kStreamsPerJobSlack) and in all,
// refusals that name the bound, and slots given back when a lease ends. (Cancelling idle streams
// needs a live call: tests/integration/hostile_grpc_streams_test.cc.)
#include "server/api/stream_guard.h"

#include <grpcpp/server_context.h>
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "absl/time/clock.h"

namespace muond::server {
namespace {

TEST(StreamGuardTest, BoundsStreamsPerJobAndInAll) {
  StreamGuard::Options options;
  options.max_streams = 2 * 3 + kStreamsPerJobSlack + 4;
  StreamGuard guard(options);
  grpc::ServerContext ctx;  // never cancelled here: no lease waits for its client
  std::vector<std::unique_ptr<StreamGuard::Lease>> held;
  // A job of 3 ranks: 2 x 3 + slack streams, then RESOURCE_EXHAUSTED naming the job.
  for (int i = 0; i < 2 * 3 + kStreamsPerJobSlack; ++i) {
    auto lease = guard.Admit(&ctx, "a", 3, "Step");
    ASSERT_TRUE(lease.ok()) << i << ": " << lease.status();
    held.push_back(*std::move(lease));
  }
  auto refused = guard.Admit(&ctx, "a", 3, "Step");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("job 'a' holds 14 streams"), std::string::npos)
      << refused.status();
  // Another job still gets streams, up to the bound in all.
  for (int i = 0; i < 4; ++i) {
    auto lease = guard.Admit(&ctx, "b", 1, "InitParams");
    ASSERT_TRUE(lease.ok()) << lease.status();
    held.push_back(*std::move(lease));
  }
  auto full = guard.Admit(&ctx, "c", 1, "ExportState");
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("of all jobs"), std::string::npos) << full.status();
  EXPECT_EQ(guard.active(), options.max_streams);
  // Ended leases give their slots back.
  held.erase(held.begin());
  EXPECT_TRUE(guard.Admit(&ctx, "a", 3, "Step").ok());
  held.clear();
  EXPECT_EQ(guard.active(), 0u);
  EXPECT_EQ(guard.cancelled_idle(), 0u);
}

// WatchSession calls: 1 per rank + slack per job and max_watches in all, counted apart from the
// streams (a job's watches do not use up its streams, nor the other way round); never idle.
TEST(StreamGuardTest, BoundsWatchesApartFromStreams) {
  StreamGuard::Options options;
  options.max_streams = 2 * 2 + kStreamsPerJobSlack;
  options.max_watches = 2 + kStreamsPerJobSlack + 3;
  options.idle_limit = absl::Milliseconds(50);
  StreamGuard guard(options);
  grpc::ServerContext ctx;
  std::vector<std::unique_ptr<StreamGuard::Lease>> held;
  for (int i = 0; i < 2 + kStreamsPerJobSlack; ++i) {
    auto lease = guard.AdmitWatch(&ctx, "a", 2);
    ASSERT_TRUE(lease.ok()) << i << ": " << lease.status();
    held.push_back(*std::move(lease));
  }
  auto refused = guard.AdmitWatch(&ctx, "a", 2);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find(
                "WatchSession: job 'a' holds 10 session watches, as many as a job of 2 rank(s) "
                "may (1 per rank + 8)"),
            std::string::npos)
      << refused.status();
  // The job's streams are untouched by its watches: all 2 x 2 + slack of them.
  for (int i = 0; i < 2 * 2 + kStreamsPerJobSlack; ++i) {
    auto lease = guard.Admit(&ctx, "a", 2, "Step");
    ASSERT_TRUE(lease.ok()) << i << ": " << lease.status();
    held.push_back(*std::move(lease));
  }
  // Another job's watches, up to the bound in all.
  for (int i = 0; i < 3; ++i) {
    auto lease = guard.AdmitWatch(&ctx, "b", 4);
    ASSERT_TRUE(lease.ok()) << lease.status();
    held.push_back(*std::move(lease));
  }
  auto full = guard.AdmitWatch(&ctx, "b", 4);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("muond holds 13 session watches of all jobs"),
            std::string::npos)
      << full.status();
  EXPECT_EQ(guard.active(), options.max_streams + options.max_watches);
  // A watch waits for nothing from its client: never cancelled as idle.
  absl::SleepFor(absl::Milliseconds(400));
  EXPECT_FALSE(held.front()->cancelled());
  EXPECT_EQ(guard.cancelled_idle(), 0u);
  held.erase(held.begin());  // a watch of job a ends: its slot is free again
  EXPECT_TRUE(guard.AdmitWatch(&ctx, "a", 2).ok());
  held.clear();
  EXPECT_EQ(guard.active(), 0u);
}

TEST(StreamGuardTest, WorkingStreamsAreNotIdle) {
  StreamGuard::Options options;
  options.idle_limit = absl::Milliseconds(50);
  StreamGuard guard(options);
  grpc::ServerContext ctx;
  auto lease = guard.Admit(&ctx, "a", 1, "Step");
  ASSERT_TRUE(lease.ok());
  (*lease)->Working();  // e.g. a step computing: the idle clock does not run
  absl::SleepFor(absl::Milliseconds(400));
  EXPECT_FALSE((*lease)->cancelled());
  EXPECT_EQ(guard.cancelled_idle(), 0u);
  guard.BeginShutdown();  // not waiting for its client: left to its handler
  EXPECT_FALSE((*lease)->cancelled());
}

}  // namespace
}  // namespace muond::server
