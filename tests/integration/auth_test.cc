// Job tokens (proto header, DESIGN.md section 9): every call about a job needs its token in
// "x-muond-job-token"; missing -> UNAUTHENTICATED (16), wrong -> PERMISSION_DENIED (7), on the
// raw API, through the client library and as muonctl exit codes.
#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/raw_step.h"
#include "tests/integration/reference_data.h"

namespace muond::integration {
namespace {

class AuthTest : public DaemonSuite {
 protected:
  // Creates a one-matrix wide_std job; returns its token.
  std::string CreateJob(const std::string& id) {
    auto token = client().CreateJob(WholeMatrixJob(id, "wide_std", {CaseMatrix("wide_std", "w")}));
    EXPECT_TRUE(token.ok()) << token.status();
    return token.ok() ? *token : "";
  }

  // Runs GetJob, DeleteJob, ResetJob, AttachRank and Step on `id` through the raw stub with
  // `token` (none when null); expects each to fail with `code` and `substring` in the message.
  void ExpectEveryRpcFails(const std::string& id, const std::string* token, grpc::StatusCode code,
                           const std::string& substring) {
    auto stub = RawStub(address());
    auto context = [&] {
      auto ctx = std::make_unique<grpc::ClientContext>();
      if (token != nullptr) ctx->AddMetadata("x-muond-job-token", *token);
      return ctx;
    };
    std::vector<std::pair<std::string, grpc::Status>> results;
    {
      v1::GetJobRequest req;
      req.set_job_id(id);
      v1::JobStatus resp;
      results.emplace_back("GetJob", stub->GetJob(context().get(), req, &resp));
    }
    {
      v1::DeleteJobRequest req;
      req.set_job_id(id);
      v1::DeleteJobResponse resp;
      results.emplace_back("DeleteJob", stub->DeleteJob(context().get(), req, &resp));
    }
    {
      v1::ResetJobRequest req;
      req.set_job_id(id);
      v1::ResetJobResponse resp;
      results.emplace_back("ResetJob", stub->ResetJob(context().get(), req, &resp));
    }
    {
      v1::AttachRankRequest req;
      req.set_job_id(id);
      v1::AttachRankResponse resp;
      results.emplace_back("AttachRank", stub->AttachRank(context().get(), req, &resp));
    }
    results.emplace_back(
        "Step", RunRawStep(*stub, token,
                           {BeginRequest(id, 0, 1, 0),
                            GradientRequest(0, 0, Fp32Bytes(RefTensor("wide_std", 0, "grad"))),
                            EndRequest()})
                    .status);
    for (const auto& [rpc, s] : results) {
      EXPECT_EQ(s.error_code(), code) << rpc << ": " << s.error_message();
      EXPECT_NE(s.error_message().find(substring), std::string::npos)
          << rpc << ": " << s.error_message();
      EXPECT_NE(s.error_message().find(id), std::string::npos)
          << rpc << ": the message should name the job: " << s.error_message();
    }
  }

  // The job is intact: found with its token, never stepped, not deleted, and steps correctly.
  void ExpectJobIntact(const std::string& id, const std::string& token) {
    auto status = client().GetJob(id, token);
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_EQ(status->next_step(), 0);
    EXPECT_EQ(status->steps_completed(), 0);
    EXPECT_FALSE(status->fenced());
    auto session = client().Attach(id, 0, token);
    ASSERT_TRUE(session.ok()) << session.status();
    auto updates = (*session)->StepTensors(0, {RefGrad("wide_std", 0, "w")});
    ASSERT_TRUE(updates.ok()) << updates.status();
    EXPECT_TRUE(MatchesReferenceUpdate(ToFloats((*updates)[0]), "wide_std", 0, 1e-4));
  }
};

TEST_F(AuthTest, MissingTokenIsUnauthenticatedOnEveryJobRpc) {
  const std::string id = NewJobId("auth-missing");
  const std::string token = CreateJob(id);
  ExpectEveryRpcFails(id, nullptr, grpc::StatusCode::UNAUTHENTICATED, "missing job token");
  ExpectJobIntact(id, token);
  ExpectStillServing();
}

TEST_F(AuthTest, EmptyTokenCountsAsMissing) {
  const std::string id = NewJobId("auth-empty");
  const std::string token = CreateJob(id);
  const std::string empty;
  ExpectEveryRpcFails(id, &empty, grpc::StatusCode::UNAUTHENTICATED, "missing job token");
  // The client library with an empty token (muonctl without a token) says the same.
  auto st = client().GetJob(id, "");
  EXPECT_EQ(st.status().code(), absl::StatusCode::kUnauthenticated) << st.status();
  auto session = client().Attach(id, 0, "");
  EXPECT_EQ(session.status().code(), absl::StatusCode::kUnauthenticated) << session.status();
  ExpectJobIntact(id, token);
}

TEST_F(AuthTest, WrongTokenIsPermissionDeniedOnEveryJobRpc) {
  const std::string id = NewJobId("auth-wrong");
  const std::string token = CreateJob(id);
  std::string wrong = token;
  wrong[0] = wrong[0] == 'a' ? 'b' : 'a';  // one character off
  ExpectEveryRpcFails(id, &wrong, grpc::StatusCode::PERMISSION_DENIED, "wrong job token");
  const std::string shorter = token.substr(0, 63);
  ExpectEveryRpcFails(id, &shorter, grpc::StatusCode::PERMISSION_DENIED, "wrong job token");
  EXPECT_EQ(client().GetJob(id, wrong).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(client().DeleteJob(id, wrong).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(client().ResetJob(id, wrong, 0).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(client().Attach(id, 0, wrong).status().code(), absl::StatusCode::kPermissionDenied);
  ExpectJobIntact(id, token);
  ExpectStillServing();
}

TEST_F(AuthTest, TokenOfOneJobDoesNotOpenAnother) {
  const std::string id_a = NewJobId("auth-a"), id_b = NewJobId("auth-b");
  const std::string token_a = CreateJob(id_a);
  const std::string token_b = CreateJob(id_b);
  ASSERT_NE(token_a, token_b);
  ExpectEveryRpcFails(id_b, &token_a, grpc::StatusCode::PERMISSION_DENIED, "wrong job token");
  ExpectEveryRpcFails(id_a, &token_b, grpc::StatusCode::PERMISSION_DENIED, "wrong job token");
  ExpectJobIntact(id_a, token_a);
  ExpectJobIntact(id_b, token_b);
}

TEST_F(AuthTest, ListJobsNeverShowsTokens) {
  const std::string id = NewJobId("auth-list");
  const std::string token = CreateJob(id);
  auto jobs = client().ListJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  bool found = false;
  for (const v1::JobStatus& j : *jobs) {
    found |= j.spec().job_id() == id;
    EXPECT_EQ(j.SerializeAsString().find(token), std::string::npos) << j.spec().job_id();
  }
  EXPECT_TRUE(found);
  const ProcessResult list = RunMuonctl(address(), {"job", "list"});
  EXPECT_EQ(list.exit_code, 0) << list.err;
  EXPECT_NE(list.out.find(id), std::string::npos) << list.out;
  EXPECT_EQ(list.out.find(token), std::string::npos) << list.out;
}

TEST_F(AuthTest, MuonctlExitCodesAreTheGrpcCodes) {
  const std::string id = NewJobId("auth-ctl");
  const std::string token_file = dir() + "/" + id + ".token";
  TempDir files;
  WriteWholeFile(files.File("job.json"),
                 absl::StrCat(R"({"job_id": ")", id,
                              R"(", "matrices": [{"name": "w", "shape": [64, 256]}]})"));
  const ProcessResult create = RunMuonctl(
      address(), {"job", "create", "--spec", files.File("job.json"), "--token-file", token_file});
  ASSERT_EQ(create.exit_code, 0) << create.err;
  struct stat st;
  ASSERT_EQ(::stat(token_file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "the token file must be private";
  WriteWholeFile(files.File("wrong.token"), std::string(64, 'f') + "\n");
  ::chmod(files.File("wrong.token").c_str(), 0600);  // token files must be private

  // No token at all: 16. Wrong token (file or $MUOND_JOB_TOKEN): 7. Right token: 0.
  for (const char* cmd : {"show", "delete", "reset"}) {
    SCOPED_TRACE(cmd);
    ProcessResult r = RunMuonctl(address(), {"job", cmd, "--job", id});
    EXPECT_EQ(r.exit_code, 16) << r.out << r.err;
    EXPECT_NE(r.err.find("UNAUTHENTICATED"), std::string::npos) << r.err;
    EXPECT_EQ(CountLines(r.err), 1) << r.err;
    r = RunMuonctl(address(), {"job", cmd, "--job", id, "--token-file", files.File("wrong.token")});
    EXPECT_EQ(r.exit_code, 7) << r.out << r.err;
    EXPECT_NE(r.err.find("wrong job token"), std::string::npos) << r.err;
    r = RunMuonctl(address(), {"job", cmd, "--job", id}, {{"MUOND_JOB_TOKEN", "0123"}});
    EXPECT_EQ(r.exit_code, 7) << r.out << r.err;
  }
  // A step with a wrong token fails before anything is pushed.
  const std::string grads = files.File("grads.safetensors");
  const client::NamedTensor g = RefGrad("wide_std", 0, "w");
  ASSERT_TRUE(common::WriteSafetensorsFile(grads, {{g.name, g.dtype, g.shape, g.data}}).ok());
  ProcessResult step = RunMuonctl(
      address(), {"step", "--job", id, "--rank", "0", "--step", "0", "--grads", grads, "--out",
                  files.File("out.safetensors"), "--token-file", files.File("wrong.token")});
  EXPECT_EQ(step.exit_code, 7) << step.err;
  step = RunMuonctl(address(), {"step", "--job", id, "--rank", "0", "--step", "0", "--grads", grads,
                                "--out", files.File("out.safetensors")});
  EXPECT_EQ(step.exit_code, 16) << step.err;

  const ProcessResult show =
      RunMuonctl(address(), {"job", "show", "--job", id, "--token-file", token_file});
  EXPECT_EQ(show.exit_code, 0) << show.err;
  EXPECT_NE(show.out.find("steps_completed: 0"), std::string::npos) << show.out;
  const ProcessResult del =
      RunMuonctl(address(), {"job", "delete", "--job", id, "--token-file", token_file});
  EXPECT_EQ(del.exit_code, 0) << del.err;
  ExpectStillServing();
}

}  // namespace
}  // namespace muond::integration
