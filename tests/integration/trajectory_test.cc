// Reference trajectories through the C++ client library (DESIGN.md sections 3 and 4): several
// consecutive steps of real jobs against float64 references, bf16 gradients, ZeRO-3 shards pushed
// by two ranks, and two jobs that must not share state.
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/layout.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/reference_data.h"

namespace muond::integration {
namespace {

using common::DType;

class TrajectoryTest : public DaemonSuite {};

TEST_F(TrajectoryTest, SharedConfigJobFollowsReferenceForThreeSteps) {
  // wide_std, tall_std and per_head share one Muon config (per_head differs in num_heads only).
  for (const char* name : {"tall_std", "per_head"}) {
    const common::MuonConfig& a = Case("wide_std").muon;
    const common::MuonConfig& b = Case(name).muon;
    ASSERT_TRUE(a.momentum == b.momentum && a.nesterov == b.nesterov &&
                a.ns_method == b.ns_method && a.ns_steps == b.ns_steps &&
                a.scale_mode == b.scale_mode)
        << name;
  }
  ASSERT_EQ(Case("per_head").num_heads, 4);
  const std::vector<std::string> cases = {"wide_std", "tall_std", "per_head"};
  const std::string id = NewJobId("traj-std");
  std::vector<common::MatrixSpec> matrices;
  for (const std::string& c : cases) matrices.push_back(CaseMatrix(c, "layers." + c + ".weight"));
  auto token = client().CreateJob(WholeMatrixJob(id, "wide_std", matrices));
  ASSERT_TRUE(token.ok()) << token.status();
  ASSERT_EQ(token->size(), 64u) << "a token is 32 random bytes in hex";
  auto session = client().Attach(id, 0, *token);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->next_step_at_attach(), 0);

  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    // Gradients in reverse order: StepTensors matches them by name.
    std::vector<client::NamedTensor> grads;
    for (auto it = cases.rbegin(); it != cases.rend(); ++it) {
      grads.push_back(RefGrad(*it, step, "layers." + *it + ".weight"));
    }
    client::StepResult result;
    auto updates = (*session)->StepTensors(step, grads, &result);
    ASSERT_TRUE(updates.ok()) << updates.status();
    EXPECT_EQ(result.step, step);
    EXPECT_FALSE(result.replayed);
    ASSERT_EQ(updates->size(), cases.size());
    for (size_t i = 0; i < cases.size(); ++i) {
      const client::NamedTensor& u = (*updates)[i];
      EXPECT_EQ(u.name, "layers." + cases[i] + ".weight");
      EXPECT_EQ(u.dtype, DType::kFloat32);
      EXPECT_EQ(u.shape, (std::vector<int64_t>{Case(cases[i]).rows, Case(cases[i]).cols}));
      EXPECT_TRUE(MatchesReferenceUpdate(ToFloats(u), cases[i], step, 1e-4));
    }
  }
  auto status = client().GetJob(id, *token);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->next_step(), 3);
  EXPECT_EQ(status->steps_completed(), 3);
  EXPECT_EQ(status->steps_refused(), 0);
  EXPECT_FALSE(status->fenced());
  EXPECT_EQ(status->momentum_bytes(), (64u * 256 + 256 * 64 + 128 * 48) * sizeof(float));
  EXPECT_EQ(status->backend().rfind("cpu", 0), 0u) << status->backend();  // "cpu (why)"
}

TEST_F(TrajectoryTest, PolarExpressNonNesterovAndRmsAdamwJobsFollowReference) {
  ASSERT_EQ(Case("polar_express").muon.ns_method, common::NsMethod::kPolarExpress);
  ASSERT_EQ(Case("polar_express").muon.ns_steps, 6);
  ASSERT_FALSE(Case("square_nonesterov").muon.nesterov);
  ASSERT_EQ(Case("rms_adamw").muon.scale_mode, common::ScaleMode::kMatchRmsAdamw);
  for (const std::string c : {"polar_express", "square_nonesterov", "rms_adamw"}) {
    SCOPED_TRACE(c);
    const std::string id = NewJobId(c);
    auto token = client().CreateJob(WholeMatrixJob(id, c, {CaseMatrix(c, "w")}));
    ASSERT_TRUE(token.ok()) << token.status();
    auto session = client().Attach(id, 0, *token);
    ASSERT_TRUE(session.ok()) << session.status();
    for (int step = 0; step < Case(c).steps; ++step) {
      auto updates = (*session)->StepTensors(step, {RefGrad(c, step, "w")});
      ASSERT_TRUE(updates.ok()) << updates.status();
      EXPECT_TRUE(MatchesReferenceUpdate(ToFloats((*updates)[0]), c, step, 1e-4));
    }
  }
}

TEST_F(TrajectoryTest, Bf16GradientsGiveBf16UpdatesWithinTolerance) {
  const std::string id = NewJobId("traj-bf16");
  auto token =
      client().CreateJob(WholeMatrixJob(id, "wide_std",
                                        {CaseMatrix("wide_std", "wide", DType::kBFloat16),
                                         CaseMatrix("per_head", "heads", DType::kBFloat16)}));
  ASSERT_TRUE(token.ok()) << token.status();
  auto session = client().Attach(id, 0, *token);
  ASSERT_TRUE(session.ok()) << session.status();
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    client::StepResult result;
    auto updates = (*session)->StepTensors(step,
                                           {RefGrad("wide_std", step, "wide", DType::kBFloat16),
                                            RefGrad("per_head", step, "heads", DType::kBFloat16)},
                                           &result);
    ASSERT_TRUE(updates.ok()) << updates.status();
    ASSERT_EQ(updates->size(), 2u);
    EXPECT_EQ(result.bytes_in, (64u * 256 + 128 * 48) * 2) << "bf16 travels as 2 bytes";
    for (const client::NamedTensor& u : *updates) {
      EXPECT_EQ(u.dtype, DType::kBFloat16) << u.name;
      EXPECT_EQ(u.data.size(), (u.name == "wide" ? 64u * 256 : 128u * 48) * 2) << u.name;
    }
    EXPECT_TRUE(MatchesReferenceUpdate(ToFloats((*updates)[0]), "wide_std", step, 2e-2));
    EXPECT_TRUE(MatchesReferenceUpdate(ToFloats((*updates)[1]), "per_head", step, 2e-2));
  }
}

// ZeRO stage 3 with two ranks: each pushes its own slice of every matrix; the daemon reassembles
// whole matrices and each rank gets back exactly its slice of the reference update.
TEST_F(TrajectoryTest, TwoRankZero3ShardsReassembleToReference) {
  const std::string id = NewJobId("traj-zero3");
  common::JobSpec spec =
      WholeMatrixJob(id, "wide_std", {CaseMatrix("wide_std", "a"), CaseMatrix("per_head", "b")});
  spec.world_size = 2;
  spec.zero_stage = 3;
  auto token = client().CreateJob(spec);
  ASSERT_TRUE(token.ok()) << token.status();
  std::vector<std::unique_ptr<client::RankSession>> sessions;
  for (int r = 0; r < 2; ++r) {
    auto s = client().Attach(id, r, *token);
    ASSERT_TRUE(s.ok()) << s.status();
    sessions.push_back(*std::move(s));
  }
  const std::vector<std::string> cases = {"wide_std", "per_head"};
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    std::vector<std::vector<float>> grads, updates;
    for (const std::string& c : cases) {
      grads.push_back(RefTensor(c, step, "grad"));
      updates.emplace_back(grads.back().size(), -1.0f);
    }
    absl::Status results[2];
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.emplace_back([&, r] {
        std::vector<client::GradientSpan> in;
        std::vector<client::UpdateSpan> out;
        for (const common::ShardSpan& span : sessions[r]->spans()) {
          in.push_back(
              {span.matrix, span.offset, grads[span.matrix].data() + span.offset, span.length});
          out.push_back(
              {span.matrix, span.offset, updates[span.matrix].data() + span.offset, span.length});
        }
        auto res = sessions[r]->Step(step, in, out);
        results[r] = res.ok() ? absl::OkStatus() : res.status();
      });
    }
    for (std::thread& t : ranks) t.join();
    ASSERT_TRUE(results[0].ok()) << results[0];
    ASSERT_TRUE(results[1].ok()) << results[1];
    EXPECT_TRUE(MatchesReferenceUpdate(updates[0], "wide_std", step, 1e-4));
    EXPECT_TRUE(MatchesReferenceUpdate(updates[1], "per_head", step, 1e-4));
  }
}

// Two jobs with the same matrix names: job B gets the negated gradients of job A, so its
// trajectory is the negated reference. Any momentum shared by name would break both.
TEST_F(TrajectoryTest, InterleavedJobsWithSameMatrixNamesKeepTheirOwnState) {
  const std::string id_a = NewJobId("iso-a"), id_b = NewJobId("iso-b");
  auto matrices = [] {
    return std::vector<common::MatrixSpec>{CaseMatrix("wide_std", "w"),
                                           CaseMatrix("tall_std", "v")};
  };
  auto token_a = client().CreateJob(WholeMatrixJob(id_a, "wide_std", matrices()));
  auto token_b = client().CreateJob(WholeMatrixJob(id_b, "wide_std", matrices()));
  ASSERT_TRUE(token_a.ok() && token_b.ok());
  EXPECT_NE(*token_a, *token_b);
  auto session_a = client().Attach(id_a, 0, *token_a);
  auto session_b = client().Attach(id_b, 0, *token_b);
  ASSERT_TRUE(session_a.ok() && session_b.ok());

  auto step_job = [&](client::RankSession& s, int step, float sign) {
    std::vector<client::NamedTensor> grads;
    for (const auto& [c, name] :
         {std::pair<std::string, std::string>{"wide_std", "w"}, {"tall_std", "v"}}) {
      std::vector<float> g = RefTensor(c, step, "grad");
      for (float& x : g) x *= sign;
      grads.push_back(MakeTensor(name, {Case(c).rows, Case(c).cols}, g));
    }
    auto updates = s.StepTensors(step, grads);
    ASSERT_TRUE(updates.ok()) << updates.status();
    EXPECT_TRUE(MatchesReferenceUpdate(ToFloats((*updates)[0]), "wide_std", step, 1e-4, sign))
        << s.spec().job_id;
    EXPECT_TRUE(MatchesReferenceUpdate(ToFloats((*updates)[1]), "tall_std", step, 1e-4, sign))
        << s.spec().job_id;
  };
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    step_job(**session_a, step, 1.0f);
    step_job(**session_b, step, -1.0f);
  }
  ASSERT_TRUE(client().DeleteJob(id_a, *token_a).ok());
  {
    SCOPED_TRACE("job B after job A was deleted");
    step_job(**session_b, 2, -1.0f);
  }
  auto gone = client().GetJob(id_a, *token_a);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
  EXPECT_NE(gone.status().message().find(id_a), std::string_view::npos) << gone.status();
  auto stale =
      (*session_a)->StepTensors(2, {RefGrad("wide_std", 2, "w"), RefGrad("tall_std", 2, "v")});
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kNotFound) << stale.status();
  auto listed = client().ListJobs();
  ASSERT_TRUE(listed.ok()) << listed.status();
  bool has_a = false, has_b = false;
  for (const auto& j : *listed) {
    has_a |= j.spec().job_id() == id_a;
    has_b |= j.spec().job_id() == id_b;
  }
  EXPECT_FALSE(has_a);
  EXPECT_TRUE(has_b);
  ExpectStillServing();
}

}  // namespace
}  // namespace muond::integration
