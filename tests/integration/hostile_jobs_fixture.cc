#include "tests/integration/hostile_jobs_fixture.h"

#include "absl/strings/str_cat.h"
#include "tests/integration/raw_step.h"

namespace muond::integration {

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

common::JobSpec SmallSpec(const std::string& id, int world, int stage) {
  common::JobSpec spec;
  spec.job_id = id;
  spec.world_size = world;
  spec.zero_stage = stage;
  spec.matrices = {Matrix("w", {16, 24}), Matrix("v", {24, 8})};
  return spec;
}

grpc::Status RawCreate(const std::string& address, const v1::JobSpec& spec) {
  auto stub = RawStub(address);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::CreateJobRequest req;
  *req.mutable_spec() = spec;
  v1::CreateJobResponse resp;
  return stub->CreateJob(&ctx, req, &resp);
}

void HostileJobsTest::Start(const std::vector<std::string>& flags) {
  auto d = DaemonProcess::StartIn(dir_.path(), flags);
  ASSERT_TRUE(d.ok()) << d.status();
  daemon_ = *std::move(d);
  auto c = client::Client::Connect(daemon_->address());
  ASSERT_TRUE(c.ok()) << c.status();
  client_ = *std::move(c);
}

void HostileJobsTest::Stop() {
  client_.reset();
  ASSERT_EQ(daemon_->Stop(), 0) << daemon_->Log();
}

void HostileJobsTest::MakeVictim() {
  victim_ = SmallSpec("victim");
  auto token = client_->CreateJob(victim_);
  ASSERT_TRUE(token.ok()) << token.status();
  victim_token_ = *token;
  grads_ = MakeGradients(victim_.matrices, 3, 5);
  auto s = client_->Attach("victim", 0, victim_token_);
  ASSERT_TRUE(s.ok()) << s.status();
  auto u = StepSpans(**s, 0, grads_[0]);
  ASSERT_TRUE(u.ok()) << u.status();
  victim_update1_.clear();
  ASSERT_TRUE(client_->SaveCheckpoint("victim", victim_token_).ok());
}

void HostileJobsTest::ExpectVictimIntact() {
  auto st = client_->GetJob("victim", victim_token_);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->next_step(), 1);
  EXPECT_FALSE(st->fenced()) << st->fence_reason();
  auto gens = client_->ListCheckpoints("victim", victim_token_);
  ASSERT_TRUE(gens.ok()) << gens.status();
  EXPECT_GE(gens->size(), 1u);
  auto twin = ReferenceTrajectory(*client_, absl::StrCat("twin", ++twins_), victim_,
                                  MatrixBytes{grads_[0], grads_[1]});
  ASSERT_TRUE(twin.ok()) << twin.status();
  auto s = client_->Attach("victim", 0, victim_token_, /*takeover=*/true);
  ASSERT_TRUE(s.ok()) << s.status();
  auto u = StepSpans(**s, 1, grads_[1]);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(*u, (*twin)[1]) << "the victim's step 1 differs from an unattacked run";
  ASSERT_TRUE(client_->ResetJob("victim", victim_token_, 1).ok());
  ASSERT_TRUE(client_->LoadCheckpoint("victim", victim_token_, 0, 1).ok());
}

}  // namespace muond::integration
