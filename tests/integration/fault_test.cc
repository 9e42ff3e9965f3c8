// Faults inside a step (DESIGN.md section 4): non-finite gradients leave every momentum
// bit-identical; a replay of the committed step returns the same bytes without applying momentum
// twice; a rank that disconnects mid-step aborts the step for every rank and fences the job until
// ResetJob.
#include <chrono>
#include <cmath>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/layout.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/raw_step.h"
#include "tests/integration/reference_data.h"

namespace muond::integration {
namespace {

struct Session {
  std::string id;
  std::string token;
  std::unique_ptr<client::RankSession> rank;
};

class FaultTest : public DaemonSuite {
 protected:
  // A job with matrices "w" (wide_std) and "v" (tall_std), attached as rank 0.
  Session NewJob(const std::string& prefix) {
    Session s;
    s.id = NewJobId(prefix);
    auto token = client().CreateJob(WholeMatrixJob(
        s.id, "wide_std", {CaseMatrix("wide_std", "w"), CaseMatrix("tall_std", "v")}));
    EXPECT_TRUE(token.ok()) << token.status();
    s.token = token.value_or("");
    auto rank = client().Attach(s.id, 0, s.token);
    EXPECT_TRUE(rank.ok()) << rank.status();
    if (rank.ok()) s.rank = *std::move(rank);
    return s;
  }

  // The clean gradients of reference step `grad_step`.
  static std::vector<client::NamedTensor> Grads(int grad_step) {
    return {RefGrad("wide_std", grad_step, "w"), RefGrad("tall_std", grad_step, "v")};
  }

  // Steps `step` with the gradients of reference step `grad_step`; expects success and returns
  // the updates.
  static std::vector<client::NamedTensor> CleanStep(Session& s, int64_t step, int grad_step,
                                                    client::StepResult* result = nullptr) {
    auto updates = s.rank->StepTensors(step, Grads(grad_step), result);
    EXPECT_TRUE(updates.ok()) << updates.status();
    return updates.value_or(std::vector<client::NamedTensor>{});
  }

  static v1::JobStatus Status(const Session& s) {
    auto st = client().GetJob(s.id, s.token);
    EXPECT_TRUE(st.ok()) << st.status();
    return st.value_or(v1::JobStatus());
  }
};

TEST_F(FaultTest, NonFiniteGradientIsRefusedAndMomentumStaysBitIdentical) {
  Session a = NewJob("nonfinite");
  ASSERT_NE(a.rank, nullptr);
  CleanStep(a, 0, 0);
  struct Poison {
    const char* matrix;  // "w" is the first matrix of the step, "v" the last
    size_t element;
    float value;
  };
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  const float kInf = std::numeric_limits<float>::infinity();
  const std::vector<Poison> poisons = {
      {"v", 123, kNaN}, {"w", 0, kInf}, {"v", 256 * 64 - 1, -kInf}, {"w", 4097, kNaN}};
  for (const Poison& p : poisons) {
    SCOPED_TRACE(absl::StrCat(p.matrix, "[", p.element, "] = ", p.value));
    std::vector<client::NamedTensor> grads = Grads(1);
    client::NamedTensor& g = grads[std::string(p.matrix) == "w" ? 0 : 1];
    std::vector<float> values = ToFloats(g);
    values[p.element] = p.value;
    g = MakeTensor(g.name, g.shape, values);
    auto r = a.rank->StepTensors(1, grads);
    ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    const std::string msg(r.status().message());
    for (const std::string& want : {absl::StrCat("matrix '", p.matrix, "'"),
                                    std::string("non-finite"), absl::StrCat("element ", p.element),
                                    std::string("rank 0"), std::string("step 1"), a.id}) {
      EXPECT_NE(msg.find(want), std::string::npos) << "wanted '" << want << "' in: " << msg;
    }
  }
  const v1::JobStatus st = Status(a);
  EXPECT_EQ(st.next_step(), 1);
  EXPECT_EQ(st.steps_refused(), static_cast<int64_t>(poisons.size()));
  EXPECT_EQ(st.steps_completed(), 1);
  EXPECT_FALSE(st.fenced()) << "a refused step does not fence the job";

  // The same step 1 with clean gradients, against a fresh job that never saw the bad steps.
  const std::vector<client::NamedTensor> after = CleanStep(a, 1, 1);
  Session fresh = NewJob("nonfinite-fresh");
  ASSERT_NE(fresh.rank, nullptr);
  CleanStep(fresh, 0, 0);
  const std::vector<client::NamedTensor> expected = CleanStep(fresh, 1, 1);
  ASSERT_EQ(after.size(), 2u);
  ASSERT_EQ(expected.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(after[i].data == expected[i].data)
        << after[i].name << ": the refused steps changed the momentum";
  }
  EXPECT_TRUE(MatchesReferenceUpdate(ToFloats(after[0]), "wide_std", 1, 1e-4));
  EXPECT_TRUE(MatchesReferenceUpdate(ToFloats(after[1]), "tall_std", 1, 1e-4));
  ExpectStillServing();
}

TEST_F(FaultTest, ReplayOfLastStepReturnsSameBytesWithoutApplyingMomentumTwice) {
  Session s = NewJob("replay");
  ASSERT_NE(s.rank, nullptr);
  CleanStep(s, 0, 0);
  client::StepResult first_result;
  const std::vector<client::NamedTensor> first = CleanStep(s, 1, 1, &first_result);
  EXPECT_FALSE(first_result.replayed);
  {  // a retry resends its gradients; they are not applied again
    client::StepResult result;
    const std::vector<client::NamedTensor> again = CleanStep(s, 1, 1, &result);
    EXPECT_TRUE(result.replayed);
    EXPECT_EQ(result.step, 1);
    ASSERT_EQ(again.size(), first.size());
    for (size_t i = 0; i < first.size(); ++i) {
      EXPECT_TRUE(again[i].data == first[i].data) << first[i].name << ": replay bytes differ";
    }
  }
  // Attaching an attached rank is refused; a restarted trainer takes the rank over and may replay.
  auto twice = client().Attach(s.id, 0, s.token);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(twice.status().message().find("rank 0 is already attached"), std::string::npos)
      << twice.status();
  auto reattached = client().Attach(s.id, 0, s.token, /*takeover=*/true);
  ASSERT_TRUE(reattached.ok()) << reattached.status();
  s.rank = *std::move(reattached);
  EXPECT_EQ(s.rank->next_step_at_attach(), 2);
  client::StepResult result;
  EXPECT_TRUE(CleanStep(s, 1, 1, &result)[0].data == first[0].data);
  EXPECT_TRUE(result.replayed);

  v1::JobStatus st = Status(s);
  EXPECT_EQ(st.next_step(), 2);
  EXPECT_EQ(st.steps_completed(), 2);
  const std::vector<client::NamedTensor> next = CleanStep(s, 2, 2, &result);
  EXPECT_FALSE(result.replayed);
  ASSERT_EQ(next.size(), 2u);
  EXPECT_TRUE(MatchesReferenceUpdate(ToFloats(next[0]), "wide_std", 2, 1e-4));
  EXPECT_TRUE(MatchesReferenceUpdate(ToFloats(next[1]), "tall_std", 2, 1e-4));
}

TEST_F(FaultTest, ClientDisconnectMidStepFencesJobUntilReset) {
  Session s = NewJob("fence");
  ASSERT_NE(s.rank, nullptr);
  CleanStep(s, 0, 0);
  // Step 1: StepBegin and a part of "w", then the client goes away. Should the daemon not even
  // have read StepBegin before the cancellation (a heavily loaded machine), nothing happened to
  // the job; try again.
  v1::JobStatus st;
  for (int attempt = 0; attempt < 3 && !st.fenced(); ++attempt) {
    auto stub = RawStub(address());
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-muond-job-token", s.token);
    auto stream = stub->Step(&ctx);
    const std::vector<float> w = RefTensor("wide_std", 1, "grad");
    ASSERT_TRUE(stream->Write(BeginRequest(s.id, 0, s.rank->session_id(), 1)));
    ASSERT_TRUE(stream->Write(GradientRequest(0, 0, Fp32Bytes({w.begin(), w.begin() + 4096}))));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ctx.TryCancel();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
    for (int i = 0; i < 100 && !st.fenced(); ++i) {
      st = Status(s);
      if (!st.fenced()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ASSERT_TRUE(st.fenced()) << "the job was not fenced after the client disconnected";
  EXPECT_NE(st.fence_reason().find("rank 0"), std::string::npos) << st.fence_reason();
  EXPECT_EQ(st.steps_aborted(), 1);
  EXPECT_EQ(st.next_step(), 1);

  // Fenced: the step (and a retry of step 0) are refused; the daemon and other jobs carry on.
  for (int64_t step : {1, 0}) {
    auto r = s.rank->StepTensors(step, Grads(static_cast<int>(step)));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
    EXPECT_NE(r.status().message().find("fenced"), std::string_view::npos) << r.status();
    EXPECT_NE(r.status().message().find(s.id), std::string_view::npos) << r.status();
  }
  ExpectStillServing();
  const ProcessResult show =
      RunMuonctl(address(), {"job", "show", "--job", s.id}, {{"MUOND_JOB_TOKEN", s.token}});
  EXPECT_EQ(show.exit_code, 0) << show.err;
  EXPECT_NE(show.out.find("fenced: yes"), std::string::npos) << show.out;

  // Reset: momentum zero, next step as given; the step then equals a fresh job's first step.
  ASSERT_TRUE(client().ResetJob(s.id, s.token, 7).ok());
  st = Status(s);
  EXPECT_FALSE(st.fenced());
  EXPECT_EQ(st.fence_reason(), "");
  EXPECT_EQ(st.next_step(), 7);
  auto early = s.rank->StepTensors(6, Grads(0));
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition) << early.status();
  const std::vector<client::NamedTensor> after_reset = CleanStep(s, 7, 0);
  Session fresh = NewJob("fence-fresh");
  ASSERT_NE(fresh.rank, nullptr);
  const std::vector<client::NamedTensor> fresh_first = CleanStep(fresh, 0, 0);
  ASSERT_EQ(after_reset.size(), 2u);
  ASSERT_EQ(fresh_first.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(after_reset[i].data == fresh_first[i].data)
        << after_reset[i].name << ": momentum was not zeroed by ResetJob";
  }
  EXPECT_TRUE(MatchesReferenceUpdate(ToFloats(after_reset[0]), "wide_std", 0, 1e-4));
  // ... and the trajectory continues from there.
  const std::vector<client::NamedTensor> next = CleanStep(s, 8, 1);
  ASSERT_EQ(next.size(), 2u);
  EXPECT_TRUE(MatchesReferenceUpdate(ToFloats(next[1]), "tall_std", 1, 1e-4));
}

// ZeRO-3 with two ranks: rank 0 has pushed everything and waits; rank 1 disconnects after one
// chunk. Rank 0 gets ABORTED (not a hang, not a half-applied update) and the job is fenced.
TEST_F(FaultTest, RankDisconnectAbortsTheStepForEveryRank) {
  const std::string id = NewJobId("abort");
  common::JobSpec spec = WholeMatrixJob(id, "wide_std", {CaseMatrix("wide_std", "w")});
  spec.world_size = 2;
  spec.zero_stage = 3;
  auto token = client().CreateJob(spec);
  ASSERT_TRUE(token.ok()) << token.status();
  auto rank0 = client().Attach(id, 0, *token);
  auto rank1 = client().Attach(id, 1, *token);
  ASSERT_TRUE(rank0.ok() && rank1.ok());
  const std::vector<float> grad = RefTensor("wide_std", 0, "grad");
  // Rank 0 on the raw stub with a deadline, so that a lost race below fails instead of hanging.
  RawStepResult rank0_result;
  std::thread rank0_thread([&] {
    const common::ShardSpan span = (*rank0)->spans().at(0);
    auto stub = RawStub(address());
    rank0_result = RunRawStep(
        *stub, &*token,
        {BeginRequest(id, 0, (*rank0)->session_id(), 0),
         GradientRequest(
             0, span.offset,
             Fp32Bytes({grad.begin() + span.offset, grad.begin() + span.offset + span.length})),
         EndRequest()},
        /*timeout_seconds=*/20);
  });
  // Sleeps order the two ranks (the daemon has no observable "rank 0 is waiting" yet).
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  {
    const common::ShardSpan span = (*rank1)->spans().at(0);
    auto stub = RawStub(address());
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-muond-job-token", *token);
    auto stream = stub->Step(&ctx);
    ASSERT_TRUE(stream->Write(BeginRequest(id, 1, (*rank1)->session_id(), 0)));
    ASSERT_TRUE(stream->Write(GradientRequest(
        0, span.offset,
        Fp32Bytes({grad.begin() + span.offset, grad.begin() + span.offset + 100}))));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    ctx.TryCancel();
    stream->Finish();
  }
  rank0_thread.join();
  const grpc::Status& rank0_status = rank0_result.status;
  EXPECT_EQ(rank0_status.error_code(), grpc::StatusCode::ABORTED) << rank0_status.error_message();
  EXPECT_NE(rank0_status.error_message().find("rank 1"), std::string::npos)
      << rank0_status.error_message();
  auto st = client().GetJob(id, *token);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->fenced());
  EXPECT_EQ(st->next_step(), 0);
  EXPECT_EQ(st->steps_completed(), 0);
  ExpectStillServing();
}

}  // namespace
}  // namespace muond::integration
