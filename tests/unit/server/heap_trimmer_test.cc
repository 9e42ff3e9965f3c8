// HeapTrimmer: the heap is trimmed once no step is in flight, never while one is.
#include "server/engine/heap_trimmer.h"

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

// What other threads free after the trim (gRPC's buffers of a cancelled stream) is caught by
// kSettleRounds settling trims (kSettle, 3 and 9 times it apart); a step that begins first ends
// the series, and its own trim starts a new one.
const absl::Duration kAllSettled = HeapTrimmer::kSettle * (1 + 3 + 9) + absl::Seconds(1);

TEST(HeapTrimmerTest, SettlesAfterTheTrim) {
  HeapTrimmer& trimmer = HeapTrimmer::Get();
  ASSERT_TRUE(trimmer.WaitIdleTrimmed(absl::Seconds(10)));
  absl::SleepFor(kAllSettled);  // any earlier settling trim is done
  const uint64_t trims = trimmer.trims();
  const uint64_t settles = trimmer.settle_trims();
  { HeapTrimmer::Activity step; }
  ASSERT_TRUE(trimmer.WaitIdleTrimmed(absl::Seconds(10)));
  EXPECT_EQ(trimmer.trims(), trims + 1);
  const uint64_t rounds = HeapTrimmer::kSettleRounds;
  const absl::Time deadline = absl::Now() + kAllSettled + absl::Seconds(10);
  while (trimmer.settle_trims() < settles + rounds && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(trimmer.settle_trims(), settles + rounds);
  absl::SleepFor(HeapTrimmer::kSettle * 3);
  EXPECT_EQ(trimmer.settle_trims(), settles + rounds) << "settled more than kSettleRounds times";
  EXPECT_EQ(trimmer.trims(), trims + 1);

  // A step in flight across the settling time: no settling trim while it runs.
  { HeapTrimmer::Activity step; }
  ASSERT_TRUE(trimmer.WaitIdleTrimmed(absl::Seconds(10)));
  auto long_step = std::make_unique<HeapTrimmer::Activity>();
  absl::SleepFor(HeapTrimmer::kSettle * 3);
  EXPECT_EQ(trimmer.settle_trims(), settles + rounds);
  long_step.reset();
  ASSERT_TRUE(trimmer.WaitIdleTrimmed(absl::Seconds(10)));
  EXPECT_EQ(trimmer.trims(), trims + 3);
}

}  // namespace
}  // namespace muond::server
