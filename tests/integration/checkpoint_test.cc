// Checkpoints end to end (DESIGN.md 7) with real daemons: a trajectory interrupted by save,
// kill -9, restart and load equals the uninterrupted one bit for bit, also resumed at another world
// size and ZeRO stage; steps run during a background save and the saved generation is the
// snapshot of its step boundary; disk full; corrupt generations at restart; bad requests.
// Each test starts its own daemons (restarts on the same state directory are the point).
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"

namespace muond::integration {
namespace {

using common::DType;

common::JobSpec TrajectorySpec(const std::string& id, int world, int stage) {
  common::JobSpec spec;
  spec.job_id = id;
  spec.world_size = world;
  spec.zero_stage = stage;
  // One dtype: stage 1/2 partitions are one flat buffer.
  spec.matrices = MixedMatrices(DType::kFloat32, DType::kFloat32);
  return spec;
}

MatrixBytes Steps(const MatrixBytes& all, int first, int count) {
  return MatrixBytes(all.begin() + first, all.begin() + first + count);
}

// Every rank's update spans of steps first.. equal the whole-matrix reference.
void ExpectRunsMatch(const common::JobSpec& spec, const std::vector<RankRun>& runs,
                     const MatrixBytes& want, int first) {
  ASSERT_EQ(runs.size(), static_cast<size_t>(spec.world_size));
  for (int r = 0; r < spec.world_size; ++r) {
    SCOPED_TRACE(absl::StrCat(spec.job_id, " rank ", r));
    const RankRun& run = runs[r];
    for (size_t i = 0; i < run.status.size(); ++i) {
      ASSERT_TRUE(run.status[i].ok()) << "step " << first + i << ": " << run.status[i];
      EXPECT_TRUE(SpansEqual(spec, run.layout, run.spans[i], want[first + i]))
          << "step " << first + i;
    }
  }
}

void KillDaemon(std::unique_ptr<DaemonProcess>& d) {
  ASSERT_EQ(::kill(d->pid(), SIGKILL), 0);
  d.reset();  // reaps it
}

std::unique_ptr<client::Client> Connect(const DaemonProcess& d) {
  auto c = client::Client::Connect(d.address());
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

class CheckpointTest : public ::testing::Test {};

TEST_F(CheckpointTest, KillRestartLoadEqualsTheUninterruptedTrajectory) {
  constexpr int kSteps = 6;
  const common::JobSpec spec = TrajectorySpec("traj", 2, 2);
  const MatrixBytes grads = MakeGradients(spec.matrices, kSteps, 41);

  // The uninterrupted whole-matrix trajectory (world size 1), on its own daemon.
  TempDir ref_dir;
  auto ref = DaemonProcess::StartIn(ref_dir.path());
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto ref_client = Connect(**ref);
  auto want = ReferenceTrajectory(*ref_client, "ref", spec, grads);
  ASSERT_TRUE(want.ok()) << want.status();

  TempDir dir;
  auto daemon = DaemonProcess::StartIn(dir.path());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto c = Connect(**daemon);
  auto token = c->CreateJob(spec);
  ASSERT_TRUE(token.ok()) << token.status();
  ExpectRunsMatch(spec, RunRanks((*daemon)->address(), "traj", *token, 2, Steps(grads, 0, 3),
                                 false, 0),
                  *want, 0);
  auto saved = c->SaveCheckpoint("traj", *token);
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->step(), 3);
  EXPECT_EQ(saved->generation(), 1);
  // One more step, then the daemon dies without a chance to save: step 3 is lost.
  ExpectRunsMatch(spec, RunRanks((*daemon)->address(), "traj", *token, 2, Steps(grads, 3, 1),
                                 false, 3),
                  *want, 3);
  KillDaemon(*daemon);

  auto restarted = DaemonProcess::StartIn(dir.path());
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  c = Connect(**restarted);
  auto st = c->GetJob("traj", *token);  // the token still works (stored hashed)
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->next_step(), 3);
  EXPECT_FALSE(st->fenced());
  // The token is not on disk in plain text.
  EXPECT_EQ(ReadWholeFile(dir.File("state/jobs/traj/job.json")).find(*token), std::string::npos);
  ExpectRunsMatch(spec, RunRanks((*restarted)->address(), "traj", *token, 2,
                                 Steps(grads, 3, kSteps - 3), false, 3),
                  *want, 3);

  // The same checkpoint resumed at other world sizes and stages.
  struct Layout {
    int world, stage;
  };
  for (Layout l : {Layout{3, 3}, Layout{4, 1}, Layout{1, 0}}) {
    common::JobSpec other = TrajectorySpec(absl::StrCat("traj-w", l.world, "s", l.stage), l.world,
                                           l.stage);
    v1::RestoreFrom from;
    from.set_job_id("traj");
    from.set_token(*token);
    from.set_step(3);
    auto other_token = c->CreateJob(other, &from);
    ASSERT_TRUE(other_token.ok()) << other_token.status();
    auto ost = c->GetJob(other.job_id, *other_token);
    ASSERT_TRUE(ost.ok());
    EXPECT_EQ(ost->next_step(), 3);
    ExpectRunsMatch(other, RunRanks((*restarted)->address(), other.job_id, *other_token,
                                    l.world, Steps(grads, 3, kSteps - 3), true, 3),
                    *want, 3);
  }

  // SIGTERM saves every job (after draining); a restart resumes at step 6.
  EXPECT_EQ((*restarted)->Stop(), 0) << (*restarted)->Log();
  auto again = DaemonProcess::StartIn(dir.path());
  ASSERT_TRUE(again.ok()) << again.status();
  c = Connect(**again);
  st = c->GetJob("traj", *token);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->next_step(), kSteps);
  auto list = c->ListCheckpoints("traj", *token);
  ASSERT_TRUE(list.ok());
  ASSERT_GE(list->size(), 2u);
  EXPECT_EQ((*list)[0].step(), kSteps);
  EXPECT_EQ((*again)->Stop(), 0);
}

// A save whose disk is slow (every write call sleeps): steps keep committing while it runs, and the
// generation it writes is the momentum at the step boundary where it started (copy-on-write).
TEST_F(CheckpointTest, StepsRunDuringABackgroundSaveAndTheSnapshotIsConsistent) {
#ifndef MUOND_TEST_HOOKS
  GTEST_SKIP() << "muond was built without test hooks (-DMUOND_TEST_HOOKS=ON)";
#endif
  const common::JobSpec spec = TrajectorySpec("bg", 1, 0);
  constexpr int kSteps = 8;
  const MatrixBytes grads = MakeGradients(spec.matrices, kSteps, 7);
  TempDir dir;
  ::setenv("MUOND_TEST_CHECKPOINT_FAULT", "delay:150", 1);
  auto daemon = DaemonProcess::StartIn(dir.path());
  ::unsetenv("MUOND_TEST_CHECKPOINT_FAULT");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto c = Connect(**daemon);
  auto token = c->CreateJob(spec);
  ASSERT_TRUE(token.ok());
  // Steps without a save, timed.
  absl::Time t0 = absl::Now();
  auto before = RunRanks((*daemon)->address(), "bg", *token, 1, Steps(grads, 0, 3), false, 0);
  const double quiet = absl::ToDoubleSeconds(absl::Now() - t0) / 3;
  ASSERT_TRUE(before[0].status.back().ok());

  std::atomic<bool> save_done{false};
  absl::StatusOr<v1::CheckpointInfo> saved;
  std::thread saver([&] {
    auto sc = client::Client::Connect((*daemon)->address());
    saved = (*sc)->SaveCheckpoint("bg", *token);
    save_done = true;
  });
  // The save has taken its snapshot once its temporary directory exists.
  const std::string tmp = dir.File("state/jobs/bg/checkpoints/gen-000000000001.tmp");
  struct stat sb;
  for (int i = 0; i < 1000 && ::stat(tmp.c_str(), &sb) != 0; ++i) absl::SleepFor(absl::Milliseconds(2));
  ASSERT_EQ(::stat(tmp.c_str(), &sb), 0) << "the save did not start";
  t0 = absl::Now();
  auto during = RunRanks((*daemon)->address(), "bg", *token, 1, Steps(grads, 3, 3), false, 3);
  const double busy = absl::ToDoubleSeconds(absl::Now() - t0) / 3;
  const bool overlapped = !save_done.load();
  saver.join();
  for (const absl::Status& s : during[0].status) ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(overlapped) << "the steps waited for the save";
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->step(), 3);
  std::printf("step time: %.4f s without a save, %.4f s during a background save (ratio %.2f)\n",
              quiet, busy, busy / quiet);

  // The generation holds the momentum of the step-3 boundary: a job restored from it computes
  // the same updates for steps 3..5 as the original did.
  common::JobSpec copy = spec;
  copy.job_id = "bg-copy";
  v1::RestoreFrom from;
  from.set_job_id("bg");
  from.set_token(*token);
  auto copy_token = c->CreateJob(copy, &from);
  ASSERT_TRUE(copy_token.ok()) << copy_token.status();
  auto replay = RunRanks((*daemon)->address(), "bg-copy", *copy_token, 1, Steps(grads, 3, 3),
                         false, 3);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(replay[0].status[i].ok()) << replay[0].status[i];
    EXPECT_EQ(replay[0].spans[i], during[0].spans[i]) << "step " << 3 + i;
  }
  EXPECT_EQ((*daemon)->Stop(), 0);
}

TEST_F(CheckpointTest, DiskFullFailsTheSaveAndKeepsOlderGenerations) {
#ifndef MUOND_TEST_HOOKS
  GTEST_SKIP() << "muond was built without test hooks (-DMUOND_TEST_HOOKS=ON)";
#endif
  common::JobSpec spec;
  spec.job_id = "full";
  spec.matrices = {Matrix("a", {16, 24}), Matrix("b", {24, 8})};
  const MatrixBytes grads = MakeGradients(spec.matrices, 4, 3);
  TempDir dir;
  // One save makes 5 write calls (length, header, 2 tensors, manifest): the 8th is in the second.
  ::setenv("MUOND_TEST_CHECKPOINT_FAULT", "write:8:28", 1);
  auto daemon = DaemonProcess::StartIn(dir.path());
  ::unsetenv("MUOND_TEST_CHECKPOINT_FAULT");
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string addr = (*daemon)->address();
  WriteWholeFile(dir.File("job.json"), common::JobSpecToJson(spec));
  ProcessResult r = RunMuonctl(addr, {"job", "create", "--spec", dir.File("job.json"),
                                      "--token-file", dir.File("tok")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::string token = ReadWholeFile(dir.File("tok"));
  while (!token.empty() && (token.back() == '\n' || token.back() == ' ')) token.pop_back();
  auto run = RunRanks(addr, "full", token, 1, Steps(grads, 0, 2), false, 0);
  ASSERT_TRUE(run[0].status.back().ok());
  r = RunMuonctl(addr, {"checkpoint", "save", "--job", "full", "--token-file", dir.File("tok")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("generation 1 at step 2"), std::string::npos) << r.out;
  run = RunRanks(addr, "full", token, 1, Steps(grads, 2, 1), false, 2);
  ASSERT_TRUE(run[0].status.back().ok());
  r = RunMuonctl(addr, {"checkpoint", "save", "--job", "full", "--token-file", dir.File("tok")});
  EXPECT_EQ(r.exit_code, 8) << r.out << r.err;  // RESOURCE_EXHAUSTED
  EXPECT_NE(r.err.find("No space left on device"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("write"), std::string::npos) << r.err;
  r = RunMuonctl(addr, {"checkpoint", "list", "--job", "full", "--token-file", dir.File("tok")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(CountLines(r.out), 2) << r.out;  // the header and generation 1
  // The job goes on, and generation 1 loads.
  run = RunRanks(addr, "full", token, 1, Steps(grads, 3, 1), false, 3);
  ASSERT_TRUE(run[0].status.back().ok());
  r = RunMuonctl(addr, {"checkpoint", "load", "--job", "full", "--generation", "1",
                        "--token-file", dir.File("tok")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("next step 2"), std::string::npos) << r.out;
  EXPECT_EQ((*daemon)->Stop(), 0);
}

// Flips one bit near the end of a file.
void Corrupt(const std::string& path) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f.good()) << path;
  f.seekg(-7, std::ios::end);
  char ch = 0;
  f.read(&ch, 1);
  ch ^= 1;
  f.seekp(-7, std::ios::end);
  f.write(&ch, 1);
}

TEST_F(CheckpointTest, CorruptGenerationsAtRestart) {
  common::JobSpec spec;
  spec.job_id = "bad";
  spec.matrices = {Matrix("a", {16, 24})};
  const MatrixBytes grads = MakeGradients(spec.matrices, 4, 5);
  TempDir dir;
  auto daemon = DaemonProcess::StartIn(dir.path());
  ASSERT_TRUE(daemon.ok());
  auto c = Connect(**daemon);
  auto token = c->CreateJob(spec);
  ASSERT_TRUE(token.ok());
  RunRanks((*daemon)->address(), "bad", *token, 1, Steps(grads, 0, 1), false, 0);
  ASSERT_TRUE(c->SaveCheckpoint("bad", *token).ok());
  RunRanks((*daemon)->address(), "bad", *token, 1, Steps(grads, 1, 1), false, 1);
  ASSERT_TRUE(c->SaveCheckpoint("bad", *token).ok());
  KillDaemon(*daemon);
  const std::string gens = dir.File("state/jobs/bad/checkpoints/");
  Corrupt(gens + "gen-000000000002/momentum.safetensors");

  // The newest is corrupt: set aside, the previous one is used.
  daemon = DaemonProcess::StartIn(dir.path());
  ASSERT_TRUE(daemon.ok());
  c = Connect(**daemon);
  auto st = c->GetJob("bad", *token);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->next_step(), 1);
  EXPECT_FALSE(st->fenced());
  struct stat sb;
  EXPECT_EQ(::stat((gens + "gen-000000000002.broken").c_str(), &sb), 0);
  EXPECT_NE((*daemon)->Log().find("checksum mismatch"), std::string::npos);
  KillDaemon(*daemon);

  // None is good: the job comes back fenced, saying why; steps are refused until a reset.
  Corrupt(gens + "gen-000000000001/momentum.safetensors");
  daemon = DaemonProcess::StartIn(dir.path());
  ASSERT_TRUE(daemon.ok());
  c = Connect(**daemon);
  st = c->GetJob("bad", *token);
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(st->fenced());
  EXPECT_NE(st->fence_reason().find("gen-000000000001"), std::string::npos) << st->fence_reason();
  auto run = RunRanks((*daemon)->address(), "bad", *token, 1, Steps(grads, 1, 1), false, 1);
  EXPECT_EQ(run[0].status[0].code(), absl::StatusCode::kFailedPrecondition) << run[0].status[0];
  EXPECT_EQ(c->SaveCheckpoint("bad", *token).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c->LoadCheckpoint("bad", *token, 0, -1).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(c->ResetJob("bad", *token, 0).ok());
  run = RunRanks((*daemon)->address(), "bad", *token, 1, Steps(grads, 0, 1), false, 0);
  EXPECT_TRUE(run[0].status[0].ok()) << run[0].status[0];
  EXPECT_EQ((*daemon)->Stop(), 0);
}

// A job re-created from another job's checkpoint is durable at once: a kill -9 before its first
// own save still brings it back with the restored momentum and step.
TEST_F(CheckpointTest, RestoredJobSurvivesARestartBeforeItsFirstStep) {
  common::JobSpec spec;
  spec.job_id = "src";
  spec.matrices = {Matrix("a", {16, 24}), Matrix("b", {8, 8})};
  const MatrixBytes grads = MakeGradients(spec.matrices, 3, 9);
  TempDir dir;
  auto daemon = DaemonProcess::StartIn(dir.path());
  ASSERT_TRUE(daemon.ok());
  auto c = Connect(**daemon);
  auto token = c->CreateJob(spec);
  ASSERT_TRUE(token.ok());
  RunRanks((*daemon)->address(), "src", *token, 1, Steps(grads, 0, 2), false, 0);
  ASSERT_TRUE(c->SaveCheckpoint("src", *token).ok());
  common::JobSpec copy = spec;
  copy.job_id = "copy";
  v1::RestoreFrom from;
  from.set_job_id("src");
  from.set_token(*token);
  auto copy_token = c->CreateJob(copy, &from);
  ASSERT_TRUE(copy_token.ok()) << copy_token.status();
  auto list = c->ListCheckpoints("copy", *copy_token);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].step(), 2);
  KillDaemon(*daemon);
  daemon = DaemonProcess::StartIn(dir.path());
  ASSERT_TRUE(daemon.ok());
  c = Connect(**daemon);
  auto st = c->GetJob("copy", *copy_token);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->next_step(), 2);
  // Step 2 of the copy equals step 2 of the source.
  auto a = RunRanks((*daemon)->address(), "src", *token, 1, Steps(grads, 2, 1), false, 2);
  auto b = RunRanks((*daemon)->address(), "copy", *copy_token, 1, Steps(grads, 2, 1), false, 2);
  ASSERT_TRUE(a[0].status[0].ok() && b[0].status[0].ok()) << a[0].status[0] << b[0].status[0];
  EXPECT_EQ(a[0].spans[0], b[0].spans[0]);
  EXPECT_EQ((*daemon)->Stop(), 0);
}

TEST_F(CheckpointTest, BadRequests) {
  common::JobSpec spec;
  spec.job_id = "req";
  spec.matrices = {Matrix("a", {16, 24}), Matrix("b", {8, 8})};
  TempDir dir;
  auto daemon = DaemonProcess::StartIn(dir.path());
  ASSERT_TRUE(daemon.ok());
  auto c = Connect(**daemon);
  auto token = c->CreateJob(spec);
  ASSERT_TRUE(token.ok());
  // Nothing saved yet.
  EXPECT_EQ(c->LoadCheckpoint("req", *token, 0, -1).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(c->SaveCheckpoint("req", *token).ok());
  // A generation or step that does not exist.
  auto s = c->LoadCheckpoint("req", *token, 9, -1).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(s.message()).find("generation 9"), std::string::npos) << s;
  EXPECT_EQ(c->LoadCheckpoint("req", *token, 0, 5).status().code(), absl::StatusCode::kNotFound);
  // Tokens.
  EXPECT_EQ(c->SaveCheckpoint("req", "").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(c->SaveCheckpoint("req", "nope").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(c->ListCheckpoints("nope", *token).status().code(), absl::StatusCode::kNotFound);
  // Restoring: wrong token, unknown source, matrices that do not match; nothing is created.
  common::JobSpec other = spec;
  other.job_id = "req2";
  v1::RestoreFrom from;
  from.set_job_id("req");
  from.set_token("wrong");
  EXPECT_EQ(c->CreateJob(other, &from).status().code(), absl::StatusCode::kPermissionDenied);
  from.set_job_id("missing");
  EXPECT_EQ(c->CreateJob(other, &from).status().code(), absl::StatusCode::kNotFound);
  from.set_job_id("req");
  from.set_token(*token);
  other.matrices[1].shape = {8, 16};
  s = c->CreateJob(other, &from).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(s.message()).find("'b'"), std::string::npos) << s;
  other.matrices.pop_back();
  s = c->CreateJob(other, &from).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(s.message()).find("'b'"), std::string::npos) << s;
  auto jobs = c->ListJobs();
  ASSERT_TRUE(jobs.ok());
  EXPECT_EQ(jobs->size(), 1u);
  // muonctl usage errors.
  ProcessResult r = RunMuonctl((*daemon)->address(), {"checkpoint", "load", "--job", "req",
                                                      "--generation", "1", "--step", "0"},
                               {{"MUOND_JOB_TOKEN", *token}});
  EXPECT_EQ(r.exit_code, 3) << r.err;  // INVALID_ARGUMENT
  r = RunMuonctl((*daemon)->address(), {"checkpoint", "load", "--job", "req", "--generation", "0"},
                 {{"MUOND_JOB_TOKEN", *token}});
  EXPECT_EQ(r.exit_code, 3) << r.err;
  r = RunMuonctl((*daemon)->address(), {"checkpoint", "frobnicate", "--job", "req"},
                 {{"MUOND_JOB_TOKEN", *token}});
  EXPECT_EQ(r.exit_code, 3) << r.err;
  // Deleting the job removes its state: a restart does not bring it back.
  ASSERT_TRUE(c->DeleteJob("req", *token).ok());
  EXPECT_EQ((*daemon)->Stop(), 0);
  daemon = DaemonProcess::StartIn(dir.path());
  ASSERT_TRUE(daemon.ok());
  c = Connect(**daemon);
  jobs = c->ListJobs();
  ASSERT_TRUE(jobs.ok());
  EXPECT_TRUE(jobs->empty());
  EXPECT_EQ((*daemon)->Stop(), 0);
}

}  // namespace
}  // namespace muond::integration
