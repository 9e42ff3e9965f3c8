// Job option "nonfinite": "skip" (fp16 loss scaling): a step whose gradients hold a NaN or Inf on
// any rank commits as a skipped step on every rank. Each rank is told "skipped" (not an error),
// gets no update, the momentum is unchanged (the next step's update is the one a job that never
// saw the bad step computes), the step number advances, a retry of the skipped step is answered
// "skipped" again, and the job counts it. Over gRPC and shared memory, with the bad value on one
// rank only, arriving before or after the other rank's data. The default ("refuse") still refuses
// the step with INVALID_ARGUMENT and leaves the step number where it was.
#include <cmath>
#include <limits>
#include <thread>

#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"

namespace muond::integration {
namespace {

class NonFiniteSkipTest : public DaemonSuite,
                          public ::testing::WithParamInterface<client::Transport> {
 protected:
  void SetUpJob(const std::string& prefix, bool skip) {
    spec_.job_id = NewJobId(prefix);
    spec_.world_size = 2;
    spec_.zero_stage = 2;
    spec_.matrices = MixedMatrices();
    spec_.nonfinite_skip = skip;
    auto token = client().CreateJob(spec_);
    ASSERT_TRUE(token.ok()) << token.status();
    token_ = *token;
    grads_ = MakeGradients(spec_.matrices, 2, /*seed=*/7);
    common::JobSpec like = spec_;
    like.nonfinite_skip = false;
    auto want = ReferenceTrajectory(client(), spec_.job_id + "-ref", like, grads_);
    ASSERT_TRUE(want.ok()) << want.status();
    want_ = *want;
    for (int r = 0; r < 2; ++r) {
      auto c = client::Client::Connect(address());
      ASSERT_TRUE(c.ok()) << c.status();
      clients_.push_back(*std::move(c));
      auto s = clients_.back()->Attach(spec_.job_id, r, token_, false, GetParam());
      ASSERT_TRUE(s.ok()) << s.status();
      sessions_.push_back(*std::move(s));
    }
    // The last element of the last matrix: rank 1's under ZeRO-2 with two ranks.
    bad_ = grads_[1];
    std::string& last = bad_.back();
    const float inf = std::numeric_limits<float>::infinity();
    ASSERT_EQ(spec_.matrices.back().dtype, common::DType::kFloat32);
    std::memcpy(last.data() + last.size() - sizeof(float), &inf, sizeof(float));
  }

  // Both ranks step `step` at once: rank 1 with `rank1`, rank 0 with `rank0`; rank 1 goes first
  // when `bad_first`.
  void BothStep(int64_t step, const std::vector<std::string>& rank0,
                const std::vector<std::string>& rank1, bool bad_first,
                absl::StatusOr<std::vector<std::string>>* out0, client::StepResult* res0,
                absl::StatusOr<std::vector<std::string>>* out1, client::StepResult* res1) {
    auto unblock = [this] { (void)client().DeleteJob(spec_.job_id, token_); };
    if (bad_first) {
      *out1 = StepSpans(*sessions_[1], step, rank1, res1);
      *out0 = StepSpans(*sessions_[0], step, rank0, res0);
      return;
    }
    StepThread t0([&] { *out0 = StepSpans(*sessions_[0], step, rank0, res0); }, unblock);
    // Rank 0 is in the step (pushed) before rank 1's bad data arrives.
    ASSERT_TRUE(WaitForJob(client(), spec_.job_id, token_, [](const v1::JobStatus& st) {
      return st.has_step_in_flight() && st.ranks(0).finished_pushing();
    }));
    *out1 = StepSpans(*sessions_[1], step, rank1, res1);
    t0.Join();
  }

  void ExpectSkipsAndResumes(bool bad_first) {
    // Step 0: both good.
    absl::StatusOr<std::vector<std::string>> out0, out1;
    client::StepResult r0, r1;
    BothStep(0, grads_[0], grads_[0], false, &out0, &r0, &out1, &r1);
    ASSERT_TRUE(out0.ok()) << out0.status();
    ASSERT_TRUE(out1.ok()) << out1.status();
    EXPECT_FALSE(r0.skipped);
    EXPECT_TRUE(SpansEqual(spec_, sessions_[0]->spans(), *out0, want_[0]));
    // Step 1: rank 1's gradient holds an Inf: both ranks are told "skipped", no error.
    BothStep(1, grads_[1], bad_, bad_first, &out0, &r0, &out1, &r1);
    ASSERT_TRUE(out0.ok()) << out0.status();
    ASSERT_TRUE(out1.ok()) << out1.status();
    EXPECT_TRUE(r0.skipped);
    EXPECT_TRUE(r1.skipped);
    EXPECT_FALSE(r0.replayed);
    EXPECT_EQ(r0.step, 1);
    auto st = client().GetJob(spec_.job_id, token_);
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->next_step(), 2);
    EXPECT_EQ(st->steps_skipped(), 1);
    EXPECT_EQ(st->steps_completed(), 1);
    EXPECT_EQ(st->steps_refused(), 0);
    // A retry of the skipped step (any gradients) is answered "skipped" again.
    client::StepResult again;
    auto retry = StepSpans(*sessions_[1], 1, bad_, &again);
    ASSERT_TRUE(retry.ok()) << retry.status();
    EXPECT_TRUE(again.skipped);
    // Step 2 with step 1's good gradients: the update of a job that never saw the bad step (the
    // momentum was not touched by it).
    BothStep(2, grads_[1], grads_[1], false, &out0, &r0, &out1, &r1);
    ASSERT_TRUE(out0.ok()) << out0.status();
    ASSERT_TRUE(out1.ok()) << out1.status();
    EXPECT_FALSE(r0.skipped);
    EXPECT_TRUE(SpansEqual(spec_, sessions_[0]->spans(), *out0, want_[1]));
    EXPECT_TRUE(SpansEqual(spec_, sessions_[1]->spans(), *out1, want_[1]));
  }

  common::JobSpec spec_;
  std::string token_;
  MatrixBytes grads_, want_;
  std::vector<std::string> bad_;
  std::vector<std::unique_ptr<client::Client>> clients_;
  std::vector<std::unique_ptr<client::RankSession>> sessions_;
};

TEST_P(NonFiniteSkipTest, BadRankFirstSkipsForEveryRank) {
  SetUpJob("skip-first", /*skip=*/true);
  ExpectSkipsAndResumes(/*bad_first=*/true);
}

TEST_P(NonFiniteSkipTest, BadRankLastSkipsForEveryRank) {
  SetUpJob("skip-last", /*skip=*/true);
  ExpectSkipsAndResumes(/*bad_first=*/false);
}

TEST_P(NonFiniteSkipTest, RefuseIsTheDefault) {
  SetUpJob("refuse", /*skip=*/false);
  client::StepResult r;
  auto bad = StepSpans(*sessions_[1], 0, bad_, &r);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_NE(bad.status().message().find("non-finite"), std::string::npos) << bad.status();
  auto st = client().GetJob(spec_.job_id, token_);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->next_step(), 0);
  EXPECT_EQ(st->steps_skipped(), 0);
}

INSTANTIATE_TEST_SUITE_P(Transports, NonFiniteSkipTest,
                         ::testing::Values(client::Transport::kGrpc, client::Transport::kShm),
                         [](const auto& info) {
                           return info.param == client::Transport::kGrpc ? "grpc" : "shm";
                         });

}  // namespace
}  // namespace muond::integration
