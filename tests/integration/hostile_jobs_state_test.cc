// Hostile and careless requests against jobs (label `hostile`): broken job directories at start
// are set aside, and resets are durable across a restart, also while a slow save runs. After each
// attack the daemon still serves and a victim job keeps its state.
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "common/job_spec_proto.h"
#include "gtest/gtest.h"
#include "tests/integration/hostile_jobs_fixture.h"

namespace muond::integration {
namespace {

TEST_F(HostileJobsTest, BrokenJobDirectoriesAreSetAsideAndTheRestStarts) {
  Start();
  MakeVictim();
  Stop();
  const std::string jobs = dir_.File("state/jobs");
  ASSERT_EQ(::mkdir((jobs + "/garbled").c_str(), 0750), 0);
  WriteWholeFile(jobs + "/garbled/job.json", "{not json");
  ASSERT_EQ(::mkdir((jobs + "/empty").c_str(), 0750), 0);
  WriteWholeFile(jobs + "/afile", "x");
  ASSERT_EQ(::mkdir((jobs + "/unreadable").c_str(), 0750), 0);
  WriteWholeFile(jobs + "/unreadable/job.json", "{}");
  ::chmod((jobs + "/unreadable/job.json").c_str(), 0);
  // What an interrupted create leaves: its temporary directory, or a marked job directory. Both
  // are the daemon's own and go at the start (not listed as broken).
  ASSERT_EQ(::mkdir((jobs + "/.creating-half-1").c_str(), 0750), 0);
  WriteWholeFile(jobs + "/.creating-half-1/.creating", "x");
  ASSERT_EQ(::mkdir((jobs + "/marked").c_str(), 0750), 0);
  WriteWholeFile(jobs + "/marked/.creating", "x");
  Start();
  struct stat st;
  EXPECT_NE(::lstat((jobs + "/.creating-half-1").c_str(), &st), 0);
  EXPECT_NE(::lstat((jobs + "/marked").c_str(), &st), 0);
  auto listed = client_->ListJobsWithBroken();
  ASSERT_TRUE(listed.ok()) << listed.status();
  std::vector<std::string> broken;
  for (const auto& b : listed->broken()) {
    broken.push_back(b.directory().substr(b.directory().rfind('/') + 1));
    std::printf("broken: %s: %s\n", b.directory().c_str(), b.reason().c_str());
  }
  std::sort(broken.begin(), broken.end());
  // (root reads a mode-0 file anyway: "unreadable" then fails as "not a muond job record")
  EXPECT_EQ(broken, (std::vector<std::string>{"afile", "empty", "garbled", "unreadable"}));
  const auto list = RunMuonctl(daemon_->address(), {"job", "list"});
  EXPECT_TRUE(absl::StrContains(list.out, "BROKEN")) << list.out << list.err;
  const grpc::Status again =
      RawCreate(daemon_->address(), common::JobSpecToProto(SmallSpec("garbled")));
  EXPECT_EQ(again.error_code(), grpc::StatusCode::ALREADY_EXISTS) << again.error_message();
  EXPECT_EQ(ReadWholeFile(jobs + "/garbled/job.json"), "{not json") << "a broken job was touched";
  ExpectVictimIntact();
  Stop();
}

TEST_F(HostileJobsTest, AResetSurvivesARestart) {
  Start();
  MakeVictim();
  common::JobSpec spec = SmallSpec("resettable");
  auto token = client_->CreateJob(spec);
  ASSERT_TRUE(token.ok());
  const MatrixBytes grads = MakeGradients(spec.matrices, 2, 9);
  {
    auto s = client_->Attach("resettable", 0, *token);
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(StepSpans(**s, 0, grads[0]).ok());
    ASSERT_TRUE(StepSpans(**s, 1, grads[1]).ok());
  }
  ASSERT_TRUE(client_->SaveCheckpoint("resettable", *token).ok());
  ASSERT_TRUE(client_->ResetJob("resettable", *token, 0).ok());
  Stop();
  Start();
  auto st = client_->GetJob("resettable", *token);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->next_step(), 0) << "the restart undid the reset";
  EXPECT_FALSE(st->fenced());
  // Zero momentum: step 0 equals a fresh job's step 0.
  auto fresh = ReferenceTrajectory(*client_, "fresh", spec, MatrixBytes{grads[0]});
  ASSERT_TRUE(fresh.ok());
  auto s = client_->Attach("resettable", 0, *token);
  ASSERT_TRUE(s.ok());
  auto u = StepSpans(**s, 0, grads[0]);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(*u, (*fresh)[0]);
  ExpectVictimIntact();
  Stop();
}

// A reset while a slow save of the old momentum is running: the save finishes first, and after a
// restart the job is still reset (the save's generation is older than the reset record).
TEST_F(HostileJobsTest, AResetDuringASlowSaveSurvivesARestart) {
#ifndef MUOND_TEST_HOOKS
  GTEST_SKIP() << "muond was built without test hooks (-DMUOND_TEST_HOOKS=ON)";
#endif
  ::setenv("MUOND_TEST_CHECKPOINT_FAULT", "delay:200", 1);
  Start();
  ::unsetenv("MUOND_TEST_CHECKPOINT_FAULT");
  common::JobSpec spec = SmallSpec("slowsave");
  auto token = client_->CreateJob(spec);
  ASSERT_TRUE(token.ok());
  const MatrixBytes grads = MakeGradients(spec.matrices, 2, 8);
  {
    auto s = client_->Attach("slowsave", 0, *token);
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(StepSpans(**s, 0, grads[0]).ok());
    ASSERT_TRUE(StepSpans(**s, 1, grads[1]).ok());
  }
  std::thread save([&] { EXPECT_TRUE(client_->SaveCheckpoint("slowsave", *token).ok()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the save is writing
  ASSERT_TRUE(client_->ResetJob("slowsave", *token, 0).ok());
  save.join();
  Stop();
  Start();
  auto st = client_->GetJob("slowsave", *token);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->next_step(), 0) << "the slow save undid the reset at the restart";
  EXPECT_FALSE(st->fenced()) << st->fence_reason();
  Stop();
}

}  // namespace
}  // namespace muond::integration
