// Update mode with max_grad_norm (the streamed clipping route, DESIGN.md 4d), in process, on the
// fixture of momentum_commit_fixture.h (the cpu device in place, the simulated one staged):
//  - The norm spans the job's matrices and every rank's share of the tensors outside the job,
//    which comes with the rank's last part: the committed momentum is bit for bit the serial EMA
//    of the gradients times ClipCoefficient(that sum), the step's completion carries the whole
//    raw sum, and a step within the norm is the plain EMA.
//  - A gRPC rank whose spans are all in but whose StepEnd is not holds the commit: the step
//    clips by its share once it comes.
//  - Bad shares refuse the step for every rank with nothing changed: negative
//    (INVALID_ARGUMENT), non-finite (refused as a non-finite gradient; skipped with "nonfinite":
//    "skip"); a StepEnd share on a job that does not clip in update mode is refused too.
//  - After a rank's session ends, its replay is what it was told: the bytes, the sum, "skipped".
//  - The clip redo reads every gradient again: a peer that rewrote its region meanwhile gets the
//    step refused, the momentum unchanged.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "common/crc32c.h"
#include "server/optim/grad_norm.h"
#include "tests/unit/server/momentum_commit_fixture.h"

namespace muond::server {
namespace {

using commit_test::BitDifferences;
using commit_test::FillRegion;
using commit_test::Outcome;
using commit_test::RandomGradients;
using commit_test::RankRegion;
using commit_test::TwoRankSpec;

class UpdateClipTest : public commit_test::CommitFixture {
 protected:
  common::JobSpec StartClipJob(const std::string& id, double max_grad_norm, bool skip = false) {
    common::JobSpec spec = TwoRankSpec(id);
    spec.max_grad_norm = max_grad_norm;
    spec.nonfinite_skip = skip;
    StartJob(spec);
    return spec;
  }

  // Submits the whole region with the rank's outside share.
  absl::Status Submit(int rank, int64_t step, RankRegion& region, Outcome* outcome,
                      double outside) {
    return CommitFixture::Submit(rank, step, region, outcome, nullptr, outside);
  }

  // Rank 0 as a gRPC rank: BeginStep and every chunk of its spans, without the StepEnd.
  std::unique_ptr<RankStep> GrpcRankInput(RankRegion& r0) {
    auto rank_step = job_->BeginStep(0, sessions_[0], 0);
    EXPECT_TRUE(rank_step.ok()) << rank_step.status();
    if (!rank_step.ok()) return nullptr;
    for (size_t i = 0; i < r0.spans.size(); ++i) {
      const std::string& bytes = r0.in[i];
      EXPECT_TRUE((*rank_step)
                      ->AddGradient(r0.spans[i].matrix, r0.spans[i].offset, bytes,
                                    common::Crc32c(bytes.data(), bytes.size()))
                      .ok());
    }
    return *std::move(rank_step);
  }

  // The whole matrices' raw sum of squares in job order (the daemon's order), plus `outside`.
  static double SumSq(const std::vector<std::vector<float>>& grads, double outside) {
    double total = 0;
    for (const std::vector<float>& g : grads) total += SumOfSquares(g.data(), g.size());
    return total + outside;
  }

  // The serial EMA of `grads` scaled by `clip` into `reference`.
  static void Ema(const common::JobSpec& spec, const std::vector<std::vector<float>>& grads,
                  float clip, std::vector<std::vector<float>>* reference) {
    for (size_t m = 0; m < grads.size(); ++m) {
      std::vector<float> g = grads[m];
      if (clip != 1.0f) {
        for (float& v : g) v *= clip;
      }
      ApplyMomentum(spec.muon, g.data(), (*reference)[m].data(), g.size());
    }
  }

  std::vector<std::vector<float>> Zeros(const common::JobSpec& spec) {
    std::vector<std::vector<float>> z;
    for (const common::MatrixSpec& m : spec.matrices) z.emplace_back(m.numel(), 0.0f);
    return z;
  }

  void ExpectMomentum(const std::vector<std::vector<float>>& reference, const std::string& what) {
    const std::vector<std::vector<float>> saved = SavedMomentum();
    ASSERT_EQ(saved.size(), reference.size());
    for (size_t m = 0; m < saved.size(); ++m) {
      EXPECT_EQ(BitDifferences(saved[m], reference[m]), 0u) << what << ", matrix " << m;
    }
  }

  // A step whose rank 1 sends `bad` as its share: refused (or skipped) for both ranks.
  void ExpectBadShare(const std::string& id, double bad, bool skip);
};

// Three steps, each clipping (the gradients' norm is ~360, max_grad_norm 1), the shares 3 and 5;
// then one within a huge max_grad_norm... of a second job: no clip, the plain EMA.
TEST_P(UpdateClipTest, MomentumIsTheClippedSerialEmaAndTheCompletionCarriesTheSum) {
  std::mt19937 rng(31);
  const common::JobSpec spec = StartClipJob(JobId("update-clip"), 1.0);
  ASSERT_NE(job_, nullptr);
  std::vector<std::vector<float>> reference = Zeros(spec);
  for (int64_t step = 0; step < 3; ++step) {
    const std::vector<std::vector<float>> grads = RandomGradients(spec, rng);
    RankRegion r0 = FillRegion(spec, 0, grads), r1 = FillRegion(spec, 1, grads);
    Outcome o0, o1;
    ASSERT_TRUE(Submit(0, step, r0, &o0, 3.0).ok());
    ASSERT_TRUE(Submit(1, step, r1, &o1, 5.0).ok());
    for (Outcome* o : {&o0, &o1}) {
      o->ended.WaitForNotification();
      ASSERT_TRUE(o->status.ok()) << o->status;
    }
    const double total = SumSq(grads, 8.0);
    EXPECT_EQ(o0.grad_sum_sq, total);
    EXPECT_EQ(o1.grad_sum_sq, total);
    const float clip = ClipCoefficient(total, 1.0);
    ASSERT_LT(clip, 1.0f);
    Ema(spec, grads, clip, &reference);
    ExpectMomentum(reference, absl::StrCat("step ", step));
  }
  const JobReport report = job_->Report();
  EXPECT_EQ(report.steps_completed, 3);
  // Each step clips; it recomputes only what it computed before the seal (rank 0's complete
  // matrix, when it was computed before rank 1 rang).
  EXPECT_LE(report.clip_redo_steps, 3);

  job_.reset();
  const common::JobSpec loose = StartClipJob(JobId("update-clip-loose"), 1e9);
  ASSERT_NE(job_, nullptr);
  std::vector<std::vector<float>> plain = Zeros(loose);
  const std::vector<std::vector<float>> grads = RandomGradients(loose, rng);
  RankRegion r0 = FillRegion(loose, 0, grads), r1 = FillRegion(loose, 1, grads);
  Outcome o0, o1;
  ASSERT_TRUE(Submit(0, 0, r0, &o0, 0.0).ok());
  ASSERT_TRUE(Submit(1, 0, r1, &o1, 2.5).ok());
  for (Outcome* o : {&o0, &o1}) {
    o->ended.WaitForNotification();
    ASSERT_TRUE(o->status.ok()) << o->status;
  }
  EXPECT_EQ(o1.grad_sum_sq, SumSq(grads, 2.5));
  Ema(loose, grads, 1.0f, &plain);
  ExpectMomentum(plain, "within the norm");
  EXPECT_EQ(job_->Report().clip_redo_steps, 0);
}

// Rank 0 over gRPC (BeginStep, its chunks, then Finish = StepEnd), rank 1 over shared memory.
// Every matrix is complete once rank 1 rang and rank 0's chunks are in; the step still waits for
// rank 0's StepEnd and its share (a huge one: the clip depends on it).
// One copy of the state (the window holds one matrix): the clip is decided when the step is
// sealed. A step whose rank 0 rang first computed "a" (all rank 0's) with clip 1 into the window
// and recomputes it with the clip after the seal; a step sealed before anything was computed
// computes every matrix once, in place, with the clip. Both are the clipped serial EMA bit for
// bit, and the window never holds more than its one matrix (no second copy).
TEST_P(UpdateClipTest, OneCopyDecidesTheClipAtTheSealAndRecomputesOnlyWhatCameBefore) {
  std::mt19937 rng(37);
  common::JobSpec spec = TwoRankSpec(JobId("update-clip-one-copy"));
  spec.max_grad_norm = 1.0;
  const uint64_t one_matrix = spec.StateBytesOf(spec.matrices[0]);
  spec.step_window_bytes = one_matrix;
  StartJob(spec);
  ASSERT_NE(job_, nullptr);
  std::vector<std::vector<float>> reference = Zeros(spec);
  int64_t redone = 0;
  for (int64_t step = 0; step < 4; ++step) {
    const bool split = step % 2 == 0;
    const std::vector<std::vector<float>> grads = RandomGradients(spec, rng);
    RankRegion r0 = FillRegion(spec, 0, grads), r1 = FillRegion(spec, 1, grads);
    Outcome o0, o1;
    absl::Notification release;
    if (!split) executor_->Submit([&release] { release.WaitForNotification(); });
    ASSERT_TRUE(Submit(0, step, r0, &o0, 3.0).ok());
    if (split) WaitForExecutor();  // "a" computed with clip 1, into the window
    ASSERT_TRUE(Submit(1, step, r1, &o1, 5.0).ok());
    if (!split) release.Notify();
    for (Outcome* o : {&o0, &o1}) {
      o->ended.WaitForNotification();
      ASSERT_TRUE(o->status.ok()) << o->status;
    }
    const float clip = ClipCoefficient(SumSq(grads, 8.0), 1.0);
    ASSERT_LT(clip, 1.0f);
    Ema(spec, grads, clip, &reference);
    ExpectMomentum(reference, absl::StrCat("step ", step, split ? " (split)" : " (sealed)"));
    const JobReport report = job_->Report();
    redone += split ? 1 : 0;
    EXPECT_EQ(report.clip_redo_steps, redone) << "step " << step;
    EXPECT_LE(report.memory.step_window, one_matrix) << "step " << step;
  }
}

TEST_P(UpdateClipTest, AGrpcRanksStepEndHoldsTheCommitUntilItsShareIsIn) {
  std::mt19937 rng(37);
  const common::JobSpec spec = StartClipJob(JobId("update-clip-grpc"), 100.0);
  ASSERT_NE(job_, nullptr);
  const std::vector<std::vector<float>> grads = RandomGradients(spec, rng);
  RankRegion r0 = FillRegion(spec, 0, grads), r1 = FillRegion(spec, 1, grads);
  std::unique_ptr<RankStep> rank_step = GrpcRankInput(r0);
  ASSERT_NE(rank_step, nullptr);
  Outcome o1;
  ASSERT_TRUE(Submit(1, 0, r1, &o1, 0.0).ok());
  WaitForExecutor();  // every matrix computed (speculatively, clip 1)
  EXPECT_FALSE(o1.ended.HasBeenNotified()) << "committed before rank 0's share was in";
  EXPECT_EQ(job_->Report().steps_completed, 0);
  constexpr double kShare = 1e6;  // norm >= 1000 > 100: clips
  auto update = rank_step->Finish([] { return false; }, kShare);
  ASSERT_TRUE(update.ok()) << update.status();
  o1.ended.WaitForNotification();
  ASSERT_TRUE(o1.status.ok()) << o1.status;
  const double total = SumSq(grads, kShare);
  EXPECT_EQ((*update)->grad_sum_sq, total);
  EXPECT_EQ(o1.grad_sum_sq, total);
  std::vector<std::vector<float>> reference = Zeros(spec);
  Ema(spec, grads, ClipCoefficient(total, 100.0), &reference);
  ExpectMomentum(reference, "clipped by the gRPC rank's share");
}

void UpdateClipTest::ExpectBadShare(const std::string& id, double bad, bool skip) {
  std::mt19937 rng(41);
  const common::JobSpec spec = StartClipJob(id, 1.0, skip);
  ASSERT_NE(job_, nullptr);
  {
    // One committed step first: the state to keep.
    const std::vector<std::vector<float>> first = RandomGradients(spec, rng);
    RankRegion r0 = FillRegion(spec, 0, first), r1 = FillRegion(spec, 1, first);
    Outcome o0, o1;
    ASSERT_TRUE(Submit(0, 0, r0, &o0, 0.0).ok());
    ASSERT_TRUE(Submit(1, 0, r1, &o1, 0.0).ok());
    for (Outcome* o : {&o0, &o1}) {
      o->ended.WaitForNotification();
      ASSERT_TRUE(o->status.ok()) << o->status;
    }
  }
  const std::vector<std::vector<float>> before = SavedMomentum();
  const std::vector<std::vector<float>> grads = RandomGradients(spec, rng);
  RankRegion r0 = FillRegion(spec, 0, grads), r1 = FillRegion(spec, 1, grads);
  Outcome o0, o1;
  ASSERT_TRUE(Submit(0, 1, r0, &o0, 0.0).ok());
  const absl::Status s1 = Submit(1, 1, r1, &o1, bad);
  o0.ended.WaitForNotification();
  const JobReport report = job_->Report();
  if (skip) {
    EXPECT_TRUE(s1.ok()) << s1;
    o1.ended.WaitForNotification();
    for (Outcome* o : {&o0, &o1}) EXPECT_TRUE(o->status.ok()) << o->status;
    EXPECT_NE(o0.flags & kDoneSkipped, 0u);
    EXPECT_NE(o1.flags & kDoneSkipped, 0u);
    EXPECT_EQ(report.steps_skipped, 1);
  } else {
    // Rank 1 is answered by SubmitShared's status, rank 0 by its completion.
    for (const absl::Status& s : {s1, o0.status}) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_NE(s.message().find("rank 1: the sum of squares of the rank's gradients outside"),
                std::string::npos)
          << s;
    }
    EXPECT_EQ(report.steps_refused, 1);
    EXPECT_FALSE(report.fenced);
  }
  EXPECT_EQ(report.steps_completed, 1);
  ExpectMomentum(before, "after the bad share");
  // The refused step's matrices may still be in the pipeline, reading the regions (a peer's
  // regions outlive its step: the shared-memory server holds them).
  WaitForExecutor();
}

TEST_P(UpdateClipTest, ANegativeShareIsRefusedAndChangesNothing) {
  ExpectBadShare(JobId("update-clip-negative"), -1.0, /*skip=*/false);
}

TEST_P(UpdateClipTest, ANonFiniteShareIsRefusedAsANonFiniteGradient) {
  ExpectBadShare(JobId("update-clip-nan"), std::numeric_limits<double>::quiet_NaN(), false);
  job_.reset();
  ExpectBadShare(JobId("update-clip-inf"), std::numeric_limits<double>::infinity(), false);
}

TEST_P(UpdateClipTest, ANonFiniteShareSkipsTheStepUnderNonfiniteSkip) {
  ExpectBadShare(JobId("update-clip-skip"), std::numeric_limits<double>::infinity(), true);
}

// A StepEnd with a share on an update job without max_grad_norm: refused, nothing committed.
TEST_P(UpdateClipTest, AShareOnAJobThatDoesNotClipIsRefused) {
  std::mt19937 rng(43);
  const common::JobSpec spec = StartClipJob(JobId("update-noclip-share"), 0.0);
  ASSERT_NE(job_, nullptr);
  const std::vector<std::vector<float>> grads = RandomGradients(spec, rng);
  RankRegion r0 = FillRegion(spec, 0, grads);
  std::unique_ptr<RankStep> rank_step = GrpcRankInput(r0);
  ASSERT_NE(rank_step, nullptr);
  auto update = rank_step->Finish([] { return false; }, 4.0);
  ASSERT_FALSE(update.ok());
  EXPECT_EQ(update.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(update.status().message().find("does not clip in mode 'update'"), std::string::npos)
      << update.status();
  EXPECT_EQ(job_->Report().steps_completed, 0);
  EXPECT_EQ(job_->Report().steps_refused, 1);
  WaitForExecutor();
}

// The redo reads the gradients a second time: rank 0 rewrites one bit of "a" after the first pass
// read it (before rank 1 rang); the step clips, so it is refused, the momentum as it was.
TEST_P(UpdateClipTest, TheRedoRefusesAGradientRewrittenAfterItWasRead) {
  std::mt19937 rng(47);
  const common::JobSpec spec = StartClipJob(JobId("update-clip-reread"), 1e-3);
  ASSERT_NE(job_, nullptr);
  const std::vector<std::vector<float>> before = SavedMomentum();
  const std::vector<std::vector<float>> grads = RandomGradients(spec, rng);
  RankRegion r0 = FillRegion(spec, 0, grads), r1 = FillRegion(spec, 1, grads);
  ASSERT_EQ(r0.spans[0].matrix, 0u);
  Outcome o0, o1;
  ASSERT_TRUE(Submit(0, 0, r0, &o0, 0.0).ok());
  WaitForExecutor();  // "a" (all rank 0's) was read by the first pass
  r0.in[0][4 * 2] ^= 0x01;
  ASSERT_TRUE(Submit(1, 0, r1, &o1, 0.0).ok());
  for (Outcome* o : {&o0, &o1}) {
    o->ended.WaitForNotification();
    EXPECT_EQ(o->status.code(), absl::StatusCode::kInvalidArgument) << o->status;
    EXPECT_NE(o->status.message().find("rank 0's gradient of tensor 'a'"), std::string::npos)
        << o->status;
  }
  EXPECT_EQ(job_->Report().steps_completed, 0);
  ExpectMomentum(before, "after the rewrite");
  WaitForExecutor();  // as ExpectBadShare
}

// Update mode keeps a private copy of a rank's committed update once its shared-memory session
// ends (the regions go; with Nesterov the update cannot be rebuilt). The copy is what the rank was
// told: a clipped step's replay carries the step's raw sum of squares and its bytes; a skipped
// step's replay is answered "skipped".
TEST_P(UpdateClipTest, AReplayAfterTheSessionEndedIsWhatTheRankWasTold) {
  std::mt19937 rng(53);
  const common::JobSpec spec = StartClipJob(JobId("update-clip-replay"), 1.0, /*skip=*/true);
  ASSERT_NE(job_, nullptr);
  const std::vector<std::vector<float>> grads = RandomGradients(spec, rng);
  RankRegion r0 = FillRegion(spec, 0, grads), r1 = FillRegion(spec, 1, grads);
  Outcome o0, o1;
  ASSERT_TRUE(Submit(0, 0, r0, &o0, 3.0).ok());
  ASSERT_TRUE(Submit(1, 0, r1, &o1, 5.0).ok());
  for (Outcome* o : {&o0, &o1}) {
    o->ended.WaitForNotification();
    ASSERT_TRUE(o->status.ok()) << o->status;
  }
  const double total = SumSq(grads, 8.0);
  ASSERT_EQ(o0.grad_sum_sq, total);
  // Rank 0's session ends; it comes back and replays step 0 into a fresh region.
  auto replay_once = [&](int64_t step, const std::vector<std::vector<float>>& g, Outcome* out,
                         RankRegion* region) {
    job_->EndSharedSession(0, sessions_[0], nullptr, /*clean=*/true);
    auto session = job_->Attach(0, /*takeover=*/false);
    ASSERT_TRUE(session.ok()) << session.status();
    sessions_[0] = *session;
    *region = FillRegion(spec, 0, g);
    for (std::string& bytes : region->out) std::fill(bytes.begin(), bytes.end(), '\0');
    ASSERT_TRUE(Submit(0, step, *region, out, 0.0).ok());
    out->ended.WaitForNotification();
    ASSERT_TRUE(out->status.ok()) << out->status;
  };
  Outcome replayed;
  RankRegion again;
  ASSERT_NO_FATAL_FAILURE(replay_once(0, grads, &replayed, &again));
  EXPECT_GT(job_->Report().memory.replay, 0u) << "update mode keeps the copy";
  EXPECT_NE(replayed.flags & kDoneReplayed, 0u);
  EXPECT_EQ(replayed.grad_sum_sq, total) << "the replay lost the step's sum of squares";
  EXPECT_EQ(again.out, r0.out) << "the replay's update differs";
  // Step 1 is skipped (rank 1's share is non-finite); rank 0's session ends again.
  const std::vector<std::vector<float>> next = RandomGradients(spec, rng);
  RankRegion s0 = FillRegion(spec, 0, next), s1 = FillRegion(spec, 1, next);
  Outcome p0, p1;
  ASSERT_TRUE(Submit(0, 1, s0, &p0, 0.0).ok());
  ASSERT_TRUE(Submit(1, 1, s1, &p1, std::numeric_limits<double>::infinity()).ok());
  for (Outcome* o : {&p0, &p1}) {
    o->ended.WaitForNotification();
    ASSERT_TRUE(o->status.ok()) << o->status;
    ASSERT_NE(o->flags & kDoneSkipped, 0u);
  }
  Outcome skipped;
  RankRegion third;
  ASSERT_NO_FATAL_FAILURE(replay_once(1, next, &skipped, &third));
  EXPECT_NE(skipped.flags & kDoneSkipped, 0u) << "the replay of a skipped step was not skipped";
  EXPECT_EQ(job_->Report().steps_completed, 1);
  WaitForExecutor();
}

INSTANTIATE_TEST_SUITE_P(Devices, UpdateClipTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "CpuInPlace" : "SimulatedStaged";
                         });

}  // namespace
}  // namespace muond::server
