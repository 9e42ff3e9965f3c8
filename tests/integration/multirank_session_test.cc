// Sessions and step order in multi-rank jobs (DESIGN.md 4): a retry of the committed step returns
// the same bytes without applying momentum twice (also while other ranks are in the next step);
// step ids that skip or go back are FAILED_PRECONDITION; a rank outside the world size is
// INVALID_ARGUMENT; attaching an attached rank is ALREADY_EXISTS unless taken over.
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"
#include "tests/integration/raw_step.h"

namespace muond::integration {
namespace {

class MultiRankSessionTest : public DaemonSuite {
 protected:
  // A job of MixedMatrices() with its reference trajectory of `steps` steps, and one session per
  // rank, each on its own Client.
  void SetUpJob(const std::string& prefix, int world, int stage, int steps) {
    spec_.job_id = NewJobId(prefix);
    spec_.world_size = world;
    spec_.zero_stage = stage;
    spec_.matrices = MixedMatrices();
    auto token = client().CreateJob(spec_);
    ASSERT_TRUE(token.ok()) << token.status();
    token_ = *token;
    grads_ = MakeGradients(spec_.matrices, steps, /*seed=*/41);
    auto want = ReferenceTrajectory(client(), spec_.job_id + "-ref", spec_, grads_);
    ASSERT_TRUE(want.ok()) << want.status();
    want_ = *want;
    for (int r = 0; r < world; ++r) {
      auto c = client::Client::Connect(address());
      ASSERT_TRUE(c.ok()) << c.status();
      clients_.push_back(*std::move(c));
      auto s = clients_.back()->Attach(spec_.job_id, r, token_);
      ASSERT_TRUE(s.ok()) << s.status();
      sessions_.push_back(*std::move(s));
    }
  }

  // Rank r's step `step` with the gradients of trajectory step `grad_step`.
  absl::StatusOr<std::vector<std::string>> RankStep(int r, int64_t step, int grad_step,
                                                    client::StepResult* result = nullptr) {
    return StepSpans(*sessions_[r], step, grads_[grad_step], result);
  }

  // Every rank steps `step` concurrently; expects the updates of trajectory step `step`.
  void AllRanksStep(int64_t step) {
    std::vector<absl::StatusOr<std::vector<std::string>>> out(sessions_.size());
    std::vector<std::thread> threads;
    for (size_t r = 0; r < sessions_.size(); ++r) {
      threads.emplace_back([&, r] { out[r] = RankStep(r, step, step); });
    }
    for (std::thread& t : threads) t.join();
    for (size_t r = 0; r < sessions_.size(); ++r) {
      ASSERT_TRUE(out[r].ok()) << "rank " << r << " step " << step << ": " << out[r].status();
      EXPECT_TRUE(SpansEqual(spec_, sessions_[r]->spans(), *out[r], want_[step]))
          << "rank " << r << " step " << step;
      last_[r] = *out[r];
    }
  }

  v1::JobStatus Status() {
    auto st = client().GetJob(spec_.job_id, token_);
    EXPECT_TRUE(st.ok()) << st.status();
    return st.value_or(v1::JobStatus());
  }

  // Deletes the job: ends a step that waits for other ranks (StepThread on a failure path).
  std::function<void()> Unblocker() {
    return [this] { (void)client().DeleteJob(spec_.job_id, token_); };
  }

  // Waits until rank r has pushed everything for the step in flight.
  bool WaitPushed(int r) {
    return WaitForJob(client(), spec_.job_id, token_, [r](const v1::JobStatus& st) {
      return st.has_step_in_flight() && st.ranks(r).finished_pushing();
    });
  }

  common::JobSpec spec_;
  std::string token_;
  MatrixBytes grads_, want_;
  std::vector<std::unique_ptr<client::Client>> clients_;
  std::vector<std::unique_ptr<client::RankSession>> sessions_;
  std::map<int, std::vector<std::string>> last_;  // per rank, its update of the last step
};

TEST_F(MultiRankSessionTest, RetryOfCommittedStepReturnsSameBytesAndAppliesMomentumOnce) {
  SetUpJob("retry", 2, 3, 3);
  AllRanksStep(0);
  AllRanksStep(1);
  const auto committed = last_;
  // Rank 0 retries step 1 with its gradients: the same bytes. With different ones: refused
  // (ALREADY_EXISTS), nothing changed.
  {
    client::StepResult result;
    auto again = RankStep(0, 1, 1, &result);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(result.replayed);
    EXPECT_EQ(result.step, 1);
    EXPECT_TRUE(*again == committed.at(0)) << "replay with the gradients of step 1";
    auto other = RankStep(0, 1, 2, &result);
    EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists) << other.status();
  }
  // Rank 1 begins step 2 and waits; meanwhile rank 0 (not yet in step 2) retries step 1 again.
  absl::StatusOr<std::vector<std::string>> rank1_step2;
  StepThread rank1([&] { rank1_step2 = RankStep(1, 2, 2); }, Unblocker());
  ASSERT_TRUE(WaitPushed(1));
  client::StepResult result;
  auto again = RankStep(0, 1, 1, &result);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(result.replayed);
  EXPECT_TRUE(*again == committed.at(0));
  // Rank 1 is inside step 2: it cannot replay step 1 from a second stream meanwhile.
  auto stub = RawStub(address());
  const RawStepResult in_flight_replay = RunRawStep(
      *stub, &token_,
      {BeginRequest(spec_.job_id, 1, sessions_[1]->session_id(), 1), EndRequest()});
  EXPECT_EQ(in_flight_replay.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << in_flight_replay.status.error_message();
  // Step 2 completes for both and continues the trajectory: momentum was applied once per step.
  auto rank0_step2 = RankStep(0, 2, 2, &result);
  rank1.Join();
  ASSERT_TRUE(rank0_step2.ok()) << rank0_step2.status();
  ASSERT_TRUE(rank1_step2.ok()) << rank1_step2.status();
  EXPECT_FALSE(result.replayed);
  EXPECT_TRUE(SpansEqual(spec_, sessions_[0]->spans(), *rank0_step2, want_[2]));
  EXPECT_TRUE(SpansEqual(spec_, sessions_[1]->spans(), *rank1_step2, want_[2]));
  const v1::JobStatus st = Status();
  EXPECT_EQ(st.steps_completed(), 3);
  EXPECT_EQ(st.next_step(), 3);
  EXPECT_FALSE(st.fenced());
  // Step 1 is no longer the last committed step.
  auto stale = RankStep(0, 1, 1);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
}

TEST_F(MultiRankSessionTest, StepIdsThatSkipOrGoBackAreFailedPrecondition) {
  SetUpJob("order", 2, 1, 3);
  AllRanksStep(0);
  AllRanksStep(1);
  for (int64_t step : {3, 7, 0}) {  // skips ahead; goes back past the replayable step
    auto r = RankStep(0, step, 2);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition)
        << "step " << step << ": " << r.status();
    EXPECT_NE(r.status().message().find("expected step 2"), std::string::npos) << r.status();
  }
  // With step 2 in flight (rank 0 waiting), rank 1 cannot send another step id.
  absl::StatusOr<std::vector<std::string>> rank0_step2;
  StepThread rank0([&] { rank0_step2 = RankStep(0, 2, 2); }, Unblocker());
  ASSERT_TRUE(WaitPushed(0));
  for (int64_t step : {3, 0}) {
    auto r = RankStep(1, step, 2);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition)
        << "step " << step << ": " << r.status();
  }
  // Rank 0 sending step 2 a second time while its first one waits.
  auto stub = RawStub(address());
  const RawStepResult twice = RunRawStep(
      *stub, &token_, {BeginRequest(spec_.job_id, 0, sessions_[0]->session_id(), 2), EndRequest()});
  EXPECT_EQ(twice.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << twice.status.error_message();
  EXPECT_NE(twice.status.error_message().find("in flight"), std::string::npos)
      << twice.status.error_message();
  // None of that disturbed the step: it completes with the right updates.
  auto rank1_step2 = RankStep(1, 2, 2);
  rank0.Join();
  ASSERT_TRUE(rank0_step2.ok()) << rank0_step2.status();
  ASSERT_TRUE(rank1_step2.ok()) << rank1_step2.status();
  EXPECT_TRUE(SpansEqual(spec_, sessions_[0]->spans(), *rank0_step2, want_[2]));
  EXPECT_TRUE(SpansEqual(spec_, sessions_[1]->spans(), *rank1_step2, want_[2]));
  const v1::JobStatus st = Status();
  EXPECT_EQ(st.next_step(), 3);
  EXPECT_EQ(st.steps_completed(), 3);
  EXPECT_EQ(st.steps_refused(), 0);
  EXPECT_EQ(st.steps_aborted(), 0);
  EXPECT_FALSE(st.fenced());
}

TEST_F(MultiRankSessionTest, RanksOutsideTheWorldAndDoubleAttachAreRefused) {
  SetUpJob("ranks", 2, 3, 2);
  auto stub = RawStub(address());
  for (int rank : {2, 5, -1}) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-muond-job-token", token_);
    v1::AttachRankRequest req;
    req.set_job_id(spec_.job_id);
    req.set_rank(rank);
    v1::AttachRankResponse resp;
    const grpc::Status s = stub->AttachRank(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << rank << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(absl::StrCat("rank ", rank)), std::string::npos)
        << s.error_message();
    EXPECT_NE(s.error_message().find("world size"), std::string::npos) << s.error_message();
    const RawStepResult step =
        RunRawStep(*stub, &token_, {BeginRequest(spec_.job_id, rank, 1, 0), EndRequest()});
    EXPECT_EQ(step.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << rank << ": " << step.status.error_message();
  }
  EXPECT_EQ(client().Attach(spec_.job_id, 2, token_).status().code(),
            absl::StatusCode::kInvalidArgument);

  // Rank 0 is attached (SetUpJob): a second attach is ALREADY_EXISTS, naming the rank.
  auto twice = client().Attach(spec_.job_id, 0, token_);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kAlreadyExists) << twice.status();
  EXPECT_NE(twice.status().message().find("rank 0 is already attached"), std::string::npos)
      << twice.status();
  // Takeover: a new session; the old one can neither step nor detach.
  auto c = client::Client::Connect(address());
  ASSERT_TRUE(c.ok());
  auto taken = (*c)->Attach(spec_.job_id, 0, token_, /*takeover=*/true);
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_NE((*taken)->session_id(), sessions_[0]->session_id());
  EXPECT_EQ(Status().ranks(0).session_id(), (*taken)->session_id());
  auto old_step = RankStep(0, 0, 0);
  EXPECT_EQ(old_step.status().code(), absl::StatusCode::kFailedPrecondition) << old_step.status();
  // A gRPC session is told it is not the current one; a shared-memory one was ended at the
  // takeover (its regions released at once) and says so.
  const std::string why(old_step.status().message());
  EXPECT_TRUE(why.find("not the rank's current session") != std::string::npos ||
              why.find("was taken over by session " +
                       std::to_string((*taken)->session_id())) != std::string::npos)
      << old_step.status();
  (void)sessions_[0]->Detach();  // FAILED_PRECONDITION on gRPC sessions; must not end the new one
  EXPECT_TRUE(Status().ranks(0).attached()) << "the old session's detach ended the new one";
  EXPECT_EQ(Status().ranks(0).session_id(), (*taken)->session_id());
  sessions_[0] = *std::move(taken);
  AllRanksStep(0);
  const v1::JobStatus st = Status();
  EXPECT_EQ(st.next_step(), 1);
  EXPECT_FALSE(st.fenced()) << "a takeover between steps does not fence";

  // A takeover while the old session is inside a step (it has pushed part of its shard) aborts
  // that step for every rank and fences the job.
  absl::StatusOr<std::vector<std::string>> rank1_step1;
  StepThread rank1([&] { rank1_step1 = RankStep(1, 1, 1); }, Unblocker());
  ASSERT_TRUE(WaitPushed(1));
  grpc::ClientContext ctx;
  ctx.AddMetadata("x-muond-job-token", token_);
  auto stream = stub->Step(&ctx);
  const common::ShardSpan span = sessions_[0]->spans().at(0);
  const std::string half = Slice(grads_[1][span.matrix], common::DType::kFloat32, span.offset,
                                 span.length / 2);
  ASSERT_TRUE(stream->Write(BeginRequest(spec_.job_id, 0, sessions_[0]->session_id(), 1)));
  ASSERT_TRUE(stream->Write(GradientRequest(span.matrix, span.offset, half)));
  ASSERT_TRUE(WaitForJob(client(), spec_.job_id, token_,
                         [](const v1::JobStatus& st) { return st.ranks(0).in_step(); }));
  auto again = (*c)->Attach(spec_.job_id, 0, token_, /*takeover=*/true);
  ASSERT_TRUE(again.ok()) << again.status();
  rank1.Join();
  EXPECT_EQ(rank1_step1.status().code(), absl::StatusCode::kAborted) << rank1_step1.status();
  EXPECT_NE(rank1_step1.status().message().find("taken over"), std::string::npos)
      << rank1_step1.status();
  stream->Write(EndRequest());
  stream->WritesDone();
  v1::StepResponse resp;
  while (stream->Read(&resp)) {
  }
  const grpc::Status old_stream = stream->Finish();
  EXPECT_EQ(old_stream.error_code(), grpc::StatusCode::ABORTED) << old_stream.error_message();
  const v1::JobStatus fenced = Status();
  EXPECT_TRUE(fenced.fenced());
  EXPECT_NE(fenced.fence_reason().find("rank 0"), std::string::npos) << fenced.fence_reason();
  EXPECT_EQ(fenced.steps_aborted(), 1);
  sessions_[0] = *std::move(again);
  ASSERT_TRUE(client().ResetJob(spec_.job_id, token_, 0).ok());
  AllRanksStep(0);
  AllRanksStep(1);
}

}  // namespace
}  // namespace muond::integration
