// Bad input (DESIGN.md section 8): each is refused with its gRPC code and a message that names what
// and where, the job is left as it was (not fenced, same next step, momentum untouched: the next
// clean step still follows the reference) and the daemon keeps serving.
#include <algorithm>
#include <chrono>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/raw_step.h"
#include "tests/integration/reference_data.h"

namespace muond::integration {
namespace {

// A job with matrices 0 "w" (wide_std, 64x256) and 1 "v" (tall_std, 256x64) that has committed
// step 0 and expects step 1.
struct TestJob {
  std::string id;
  std::string token;
  uint64_t session = 0;
  std::shared_ptr<client::RankSession> rank;  // keeps the session attached
};

class BadInputTest : public DaemonSuite {
 protected:
  TestJob NewJobAtStep1(const std::string& prefix) {
    TestJob job;
    job.id = NewJobId(prefix);
    auto token = client().CreateJob(WholeMatrixJob(
        job.id, "wide_std", {CaseMatrix("wide_std", "w"), CaseMatrix("tall_std", "v")}));
    EXPECT_TRUE(token.ok()) << token.status();
    job.token = token.value_or("");
    auto session = client().Attach(job.id, 0, job.token);
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok()) return job;
    job.session = (*session)->session_id();
    job.rank = *std::move(session);
    auto updates =
        job.rank->StepTensors(0, {RefGrad("wide_std", 0, "w"), RefGrad("tall_std", 0, "v")});
    EXPECT_TRUE(updates.ok()) << updates.status();
    return job;
  }

  // The clean requests of `step`: "w" in two chunks, "v" in one.
  // (Steps past the reference's last use its last gradients.)
  static std::vector<v1::StepRequest> GoodRequests(const TestJob& job, int step) {
    const int grad_step = std::min(step, 2);
    const std::vector<float> w = RefTensor("wide_std", grad_step, "grad");
    const std::vector<float> v = RefTensor("tall_std", grad_step, "grad");
    const size_t half = w.size() / 2;
    return {BeginRequest(job.id, 0, job.session, step),
            GradientRequest(0, half, Fp32Bytes({w.begin() + half, w.end()})),
            GradientRequest(1, 0, Fp32Bytes(v)),
            GradientRequest(0, 0, Fp32Bytes({w.begin(), w.begin() + half})), EndRequest()};
  }

  // `before_last`, when given, runs before the last request is written (RunRawStep).
  RawStepResult Run(const TestJob& job, const std::vector<v1::StepRequest>& requests,
                    const std::function<void()>& before_last = nullptr) {
    auto stub = RawStub(address());
    return RunRawStep(*stub, &job.token, requests, 30, 0, 0, before_last);
  }

  static void ExpectStatus(const grpc::Status& s, grpc::StatusCode code,
                           const std::vector<std::string>& substrings) {
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    for (const std::string& want : substrings) {
      EXPECT_NE(s.error_message().find(want), std::string::npos)
          << "wanted '" << want << "' in: " << s.error_message();
    }
  }

  // The job still expects step 1, is not fenced, counted `refused` refusals, and its clean step 1
  // follows the reference (so the refused steps left the momentum alone).
  void ExpectJobUnharmed(const TestJob& job, int64_t refused) {
    auto status = client().GetJob(job.id, job.token);
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_EQ(status->next_step(), 1);
    EXPECT_EQ(status->steps_completed(), 1);
    EXPECT_EQ(status->steps_refused(), refused);
    EXPECT_FALSE(status->fenced()) << status->fence_reason();
    ExpectCleanStep1(job, /*replayed=*/false);
  }

  // A clean step 1 returns the reference update (computed now, or `replayed`), and the daemon
  // still serves.
  void ExpectCleanStep1(const TestJob& job, bool replayed) {
    const RawStepResult r = Run(job, GoodRequests(job, 1));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.replayed(), replayed);
    EXPECT_TRUE(MatchesReferenceUpdate(r.Update(0, 64 * 256), "wide_std", 1, 1e-4));
    EXPECT_TRUE(MatchesReferenceUpdate(r.Update(1, 256 * 64), "tall_std", 1, 1e-4));
    ExpectStillServing();
  }
};

TEST_F(BadInputTest, UnknownJobIsNotFound) {
  const std::string id = "no-such-job";
  for (const absl::Status& s :
       {client().GetJob(id, "t").status(), client().DeleteJob(id, "t"),
        client().ResetJob(id, "t", 0), client().Attach(id, 0, "t").status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_NE(s.message().find("'no-such-job' not found"), std::string_view::npos) << s;
  }
  const TestJob fake{id, "t", 1, nullptr};
  ExpectStatus(Run(fake, GoodRequests(fake, 0)).status, grpc::StatusCode::NOT_FOUND, {id});
  ExpectStillServing();
}

TEST_F(BadInputTest, DuplicateJobIdIsAlreadyExists) {
  const TestJob job = NewJobAtStep1("dup");
  auto again =
      client().CreateJob(WholeMatrixJob(job.id, "wide_std", {CaseMatrix("per_head", "h")}));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists) << again.status();
  EXPECT_NE(again.status().message().find("'" + job.id + "' already exists"),
            std::string_view::npos)
      << again.status();
  ExpectJobUnharmed(job, 0);
}

TEST_F(BadInputTest, InvalidJobSpecsAreRejectedNamingTheField) {
  struct BadSpec {
    common::JobSpec spec;
    std::vector<std::string> substrings;
  };
  std::vector<BadSpec> bad;
  {
    common::MatrixSpec m = CaseMatrix("wide_std", "w");
    m.num_heads = 5;
    bad.push_back({WholeMatrixJob("bad-heads", "wide_std", {m}),
                   {"'w'", "num_heads 5 does not divide rows 64"}});
  }
  {
    common::JobSpec spec = WholeMatrixJob("bad-world", "wide_std", {CaseMatrix("wide_std", "w")});
    spec.world_size = 2;  // zero_stage 0 means one rank with whole matrices
    bad.push_back({spec, {"world_size"}});
  }
  bad.push_back({WholeMatrixJob("bad-empty", "wide_std", {}), {"matrices"}});
  bad.push_back({WholeMatrixJob("bad-names", "wide_std",
                                {CaseMatrix("wide_std", "w"), CaseMatrix("tall_std", "w")}),
                 {"'w'"}});
  bad.push_back({WholeMatrixJob("bad/id", "wide_std", {CaseMatrix("wide_std", "w")}), {"job_id"}});
  for (const BadSpec& b : bad) {
    SCOPED_TRACE(b.spec.job_id);
    auto token = client().CreateJob(b.spec);
    EXPECT_EQ(token.status().code(), absl::StatusCode::kInvalidArgument) << token.status();
    for (const std::string& want : b.substrings) {
      EXPECT_NE(token.status().message().find(want), std::string_view::npos)
          << "wanted '" << want << "' in: " << token.status();
    }
    // Nothing was created: NOT_FOUND, or INVALID_ARGUMENT for an id that no job can have.
    const absl::StatusCode code = client().GetJob(b.spec.job_id, "t").status().code();
    EXPECT_TRUE(code == absl::StatusCode::kNotFound || code == absl::StatusCode::kInvalidArgument)
        << code;
  }
  ExpectStillServing();
}

// Apply mode (DESIGN.md 4b) is parsed and checked, but this daemon does not serve it yet: a valid
// apply-mode spec gets UNIMPLEMENTED saying so, and no job is made; an invalid one is still
// INVALID_ARGUMENT first (the spec is checked on the API edge).
TEST_F(BadInputTest, ApplyModeJobWithAnUnknownGroupIsRefusedAndNothingIsMade) {
  common::JobSpec spec = WholeMatrixJob("apply-1", "wide_std", {CaseMatrix("wide_std", "w")});
  spec.mode = common::JobMode::kApply;
  spec.matrices[0].group = "muon";
  spec.matrices[0].param_dtype = spec.matrices[0].dtype;
  // Its tensor's group does not exist: INVALID_ARGUMENT naming the groups, no job.
  auto token = client().CreateJob(spec);
  EXPECT_EQ(token.status().code(), absl::StatusCode::kInvalidArgument) << token.status();
  EXPECT_NE(token.status().message().find("groups"), std::string_view::npos) << token.status();
  EXPECT_EQ(client().GetJob(spec.job_id, "t").status().code(), absl::StatusCode::kNotFound);
  auto jobs = client().ListJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  for (const auto& j : *jobs) EXPECT_NE(j.spec().job_id(), spec.job_id);
  ExpectStillServing();
}

TEST_F(BadInputTest, StepTensorsRejectsShapeDtypeMissingAndExtraTensors) {
  TestJob job = NewJobAtStep1("tensors");
  ASSERT_NE(job.rank, nullptr);
  auto* session = &job.rank;
  const client::NamedTensor w = RefGrad("wide_std", 1, "w"), v = RefGrad("tall_std", 1, "v");
  const std::vector<std::pair<std::vector<client::NamedTensor>, std::vector<std::string>>> cases = {
      {{MakeTensor("w", {256, 64}, RefTensor("wide_std", 1, "grad")), v},
       {"'w'", "shape [256, 64]", "[64, 256]"}},
      {{w, RefGrad("tall_std", 1, "v", common::DType::kFloat16)},
       {"'v'", "dtype float16", "float32"}},
      {{w}, {"'v'", "missing"}},
      {{w, v, RefGrad("per_head", 1, "lm_head")}, {"'lm_head'", "not a matrix of job"}},
      {{w, v, w}, {"'w'", "twice"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    auto r = (*session)->StepTensors(1, cases[i].first);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    for (const std::string& want : cases[i].second) {
      EXPECT_NE(r.status().message().find(want), std::string_view::npos)
          << "wanted '" << want << "' in: " << r.status();
    }
  }
  // Refused in the client: the daemon saw none of them.
  ExpectJobUnharmed(job, 0);
}

TEST_F(BadInputTest, CorruptChunkIsRefusedMentioningCrc32c) {
  const TestJob job = NewJobAtStep1("crc");
  std::vector<v1::StepRequest> req = GoodRequests(job, 1);
  const uint32_t good_crc = req[2].gradient().crc32c();
  req[2].mutable_gradient()->set_crc32c(good_crc ^ 0x1);  // "v"
  ExpectStatus(Run(job, req).status, grpc::StatusCode::INVALID_ARGUMENT,
               {"CRC32C", "'v'", "step 1", "rank 0", job.id});
  // A flipped bit in the data, CRC of the original.
  req = GoodRequests(job, 1);
  std::string data = req[1].gradient().data();
  data[17] ^= 0x40;
  req[1] = GradientRequest(0, req[1].gradient().element_offset(), data, req[1].gradient().crc32c());
  ExpectStatus(Run(job, req).status, grpc::StatusCode::INVALID_ARGUMENT, {"CRC32C", "'w'"});
  ExpectJobUnharmed(job, 2);
}

TEST_F(BadInputTest, TruncatedChunkIsRefused) {
  const TestJob job = NewJobAtStep1("trunc");
  std::vector<v1::StepRequest> req = GoodRequests(job, 1);
  const std::string data = req[2].gradient().data().substr(0, 6);  // 1.5 fp32 elements
  req[2] = GradientRequest(1, 0, data);
  ExpectStatus(Run(job, req).status, grpc::StatusCode::INVALID_ARGUMENT,
               {"'v'", "6 bytes", "multiple of 4"});
  req[2] = GradientRequest(1, 0, "");
  ExpectStatus(Run(job, req).status, grpc::StatusCode::INVALID_ARGUMENT, {"'v'", "0 bytes"});
  ExpectJobUnharmed(job, 2);
}

TEST_F(BadInputTest, ChunkOutsideTheMatrixIsRefused) {
  const TestJob job = NewJobAtStep1("outside");
  std::vector<v1::StepRequest> req = GoodRequests(job, 1);
  // The last 4 elements of "v" moved 2 past its end, sent before the last good chunk: the step
  // is still collecting, so it is refused and the job stays at step 1.
  req.insert(req.end() - 2, GradientRequest(1, 256 * 64 - 2, Fp32Bytes({1, 2, 3, 4})));
  ExpectStatus(Run(job, req).status, grpc::StatusCode::INVALID_ARGUMENT,
               {"'v'", "[16382, 16386)", "outside"});
  // An offset so large that offset + count wraps around.
  req = GoodRequests(job, 1);
  req.insert(req.begin() + 1, GradientRequest(0, ~uint64_t{0} - 1, Fp32Bytes({1, 2, 3, 4})));
  ExpectStatus(Run(job, req).status, grpc::StatusCode::INVALID_ARGUMENT, {"'w'", "outside"});
  // An extra matrix: index 2 of a two-matrix job.
  req = GoodRequests(job, 1);
  req.insert(req.end() - 2, GradientRequest(2, 0, Fp32Bytes({1, 2})));
  ExpectStatus(Run(job, req).status, grpc::StatusCode::INVALID_ARGUMENT,
               {"matrix index 2 out of range", "2 matrices"});
  ExpectJobUnharmed(job, 3);
}

// A malformed chunk that arrives after every element was in and the step committed is still
// INVALID_ARGUMENT, and its message says the step went through without it (the rank asks for the
// step again). The step stays committed: the job is at step 2, not fenced, and the replay of
// step 1 is the reference update.
TEST_F(BadInputTest, ChunkOutsideTheMatrixAfterTheCommitIsInvalidArgument) {
  const TestJob job = NewJobAtStep1("outside-late");
  std::vector<v1::StepRequest> req = GoodRequests(job, 1);
  req.back() = GradientRequest(1, 256 * 64 - 2, Fp32Bytes({1, 2, 3, 4}));  // instead of StepEnd
  auto wait_for_commit = [&] {
    for (int i = 0; i < 1000; ++i) {
      auto st = client().GetJob(job.id, job.token);
      if (st.ok() && st->next_step() == 2) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ADD_FAILURE() << "step 1 did not commit within 10 s of its last gradient";
  };
  const RawStepResult r = Run(job, req, wait_for_commit);
  ExpectStatus(r.status, grpc::StatusCode::INVALID_ARGUMENT,
               {"'v'", "[16382, 16386)", "outside", "the step is committed (all data was in)",
                "was not applied; ask for step 1 again"});
  auto status = client().GetJob(job.id, job.token);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->next_step(), 2);
  EXPECT_FALSE(status->fenced()) << status->fence_reason();
  ExpectCleanStep1(job, /*replayed=*/true);
}

TEST_F(BadInputTest, OverlappingChunksAreRefused) {
  const TestJob job = NewJobAtStep1("overlap");
  std::vector<v1::StepRequest> req = GoodRequests(job, 1);
  // Before the last good chunk, so the step is still collecting (after all data was in, a
  // re-sent chunk is FAILED_PRECONDITION once the step committed: HostileJobsTest).
  req.insert(req.end() - 2, GradientRequest(1, 100, Fp32Bytes({1, 2, 3})));
  ExpectStatus(Run(job, req).status, grpc::StatusCode::INVALID_ARGUMENT,
               {"'v'", "[100, 103)", "overlap"});
  // The same chunk twice.
  req = GoodRequests(job, 1);
  const v1::StepRequest again = req[1];
  req.insert(req.begin() + 2, again);
  ExpectStatus(Run(job, req).status, grpc::StatusCode::INVALID_ARGUMENT, {"'w'", "overlap"});
  ExpectJobUnharmed(job, 2);
}

TEST_F(BadInputTest, MissingOrIncompleteMatrixIsRefused) {
  const TestJob job = NewJobAtStep1("missing");
  std::vector<v1::StepRequest> req = GoodRequests(job, 1);
  req.erase(req.begin() + 2);  // no "v"
  ExpectStatus(Run(job, req).status, grpc::StatusCode::INVALID_ARGUMENT,
               {"'v'", "received 0 of 16384", "missing"});
  req = GoodRequests(job, 1);
  req.erase(req.begin() + 3);  // the first half of "w"
  ExpectStatus(Run(job, req).status, grpc::StatusCode::INVALID_ARGUMENT,
               {"'w'", "received 8192 of 16384"});
  // A stream that is not a step: no StepBegin first.
  req = GoodRequests(job, 1);
  req.erase(req.begin());
  ExpectStatus(Run(job, req).status, grpc::StatusCode::INVALID_ARGUMENT, {"StepBegin"});
  ExpectJobUnharmed(job, 2);
}

TEST_F(BadInputTest, StepsOutOfOrderAreFailedPrecondition) {
  const TestJob job = NewJobAtStep1("order");
  // Skip ahead.
  ExpectStatus(Run(job, GoodRequests(job, 2)).status, grpc::StatusCode::FAILED_PRECONDITION,
               {"step 2 out of order", "expected step 1", job.id});
  // Clean steps 1 and 2, then back two (step 1 after 2 committed: only 2 can be replayed).
  ExpectJobUnharmed(job, 0);
  RawStepResult r = Run(job, GoodRequests(job, 2));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_TRUE(MatchesReferenceUpdate(r.Update(0, 64 * 256), "wide_std", 2, 1e-4));
  for (int step : {1, 0, 5}) {
    SCOPED_TRACE(step);
    ExpectStatus(Run(job, GoodRequests(job, step)).status, grpc::StatusCode::FAILED_PRECONDITION,
                 {absl::StrCat("step ", step, " out of order"), "expected step 3"});
  }
  auto status = client().GetJob(job.id, job.token);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->next_step(), 3);
  EXPECT_FALSE(status->fenced());
  // A stale session (the rank was taken over since) is refused as well.
  auto session = client().Attach(job.id, 0, job.token, /*takeover=*/true);
  ASSERT_TRUE(session.ok());
  ExpectStatus(Run(job, GoodRequests(job, 3)).status, grpc::StatusCode::FAILED_PRECONDITION,
               {"not the rank's current session"});
  ExpectStillServing();
}

}  // namespace
}  // namespace muond::integration
