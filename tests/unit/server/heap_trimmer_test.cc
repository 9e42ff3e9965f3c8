// HeapTrimmer: the heap is trimmed once no step is in flight, never while one is.
#include "server/jobs/heap_trimmer.h"

#include <gtest/gtest.h>

#include <memory>

#include "absl/time/clock.h"

namespace muond::server {
namespace {

TEST(HeapTrimmerTest, TrimsAfterTheLastStepEnds) {
  HeapTrimmer& trimmer = HeapTrimmer::Get();
  ASSERT_TRUE(trimmer.WaitIdleTrimmed(absl::Seconds(10)));
  const uint64_t before = trimmer.trims();
  { HeapTrimmer::Activity step; }
  EXPECT_TRUE(trimmer.WaitIdleTrimmed(absl::Seconds(10)));
  EXPECT_EQ(trimmer.trims(), before + 1);
}

TEST(HeapTrimmerTest, NeverTrimsWhileAStepIsInFlight) {
  HeapTrimmer& trimmer = HeapTrimmer::Get();
  ASSERT_TRUE(trimmer.WaitIdleTrimmed(absl::Seconds(10)));
  const uint64_t before = trimmer.trims();
  auto long_step = std::make_unique<HeapTrimmer::Activity>();
  { HeapTrimmer::Activity short_step; }  // ends while long_step runs: no trim yet
  EXPECT_FALSE(trimmer.WaitIdleTrimmed(HeapTrimmer::kQuiet * 5));
  EXPECT_EQ(trimmer.trims(), before);
  long_step.reset();
  EXPECT_TRUE(trimmer.WaitIdleTrimmed(absl::Seconds(10)));
  EXPECT_EQ(trimmer.trims(), before + 1);  // both steps share one trim
}

}  // namespace
}  // namespace muond::server
