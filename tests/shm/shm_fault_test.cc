// Peer death on the shared-memory data plane (issue 4): a rank process killed with SIGKILL is seen
// from its socket; the step semantics of the multi-rank issue apply (ABORTED for the waiting rank,
// the job fenced); the daemon's descriptors, region mappings and locked memory return to their
// baseline; another job keeps stepping. And the regions are pinned (mlock) once at attach.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/shm_channel.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"
#include "tests/shm/shm_test_util.h"

namespace muond::shmtest {
namespace {

// The sanitizers' runtimes make mlock a no-op (tests/sanitize/run.sh builds): locked memory cannot
// be observed there.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kMlockObservable = false;
#else
constexpr bool kMlockObservable = true;
#endif

using client::Transport;
using common::DType;
using integration::ChildProcess;
using integration::DaemonSuite;
using integration::MakeGradients;
using integration::Matrix;
using integration::MixedMatrices;
using integration::StepThread;
using integration::WaitForJob;

class ShmFaultTest : public DaemonSuite {
 protected:
  // A second job stepping over shared memory beside the one whose rank is killed, with its
  // reference updates (the same gradients through a separate job over gRPC).
  struct Bystander {
    common::JobSpec spec;
    MatrixBytes grads;
    Trajectory ref;
    std::string token;
    std::unique_ptr<client::RankSession> session;
  };

  // What one KillRankProcess run holds, declared in the order the run creates it: destroyed in
  // reverse, the waiting step's thread (which deletes the job to release rank 0) goes before the
  // sessions and the rank process.
  struct KillRun {
    bool rank1_rings = false;
    std::vector<common::MatrixSpec> matrices;
    MatrixBytes grads;
    Bystander other;
    common::JobSpec spec;
    std::string token;
    std::unique_ptr<client::RankSession> rank0;
    ProcCounts baseline;  // the daemon before rank 1 attached
    std::unique_ptr<ChildProcess> child;
    ProcCounts attached;  // the daemon with rank 1 attached
    absl::StatusOr<std::vector<std::string>> rank0_result;
    std::unique_ptr<StepThread> waiting;
  };

  // Kills a rank process of a 2-rank job at a point given by `rank1_rings`:
  //   false: rank 1 (the process) attached and never rang; rank 0 (this test) rang and waits.
  //   true:  rank 1 rang (its submission holds its regions) and waits; rank 0 has not rung.
  // Checks ABORTED/fenced, the daemon's resources back to the baseline measured before the
  // process attached, and a second job stepping correctly meanwhile.
  void KillRankProcess(bool rank1_rings) {
    KillRun run;
    run.rank1_rings = rank1_rings;
    run.matrices = MixedMatrices(DType::kFloat32, DType::kFloat32);
    run.grads = MakeGradients(run.matrices, 3, /*seed=*/17);
    ASSERT_NO_FATAL_FAILURE(StartBystander(run.other));
    StepBystander(run.other, 0);

    ASSERT_NO_FATAL_FAILURE(CreateKilledJob(run));
    ASSERT_NO_FATAL_FAILURE(StartRank1Process(run));
    ExpectRank1SessionHeld(run);
    if (!rank1_rings) {
      ASSERT_NO_FATAL_FAILURE(StartRank0Waiting(run));
    }
    StepBystander(run.other, 1);  // the second job steps while this one waits

    ASSERT_NO_FATAL_FAILURE(KillRank1AndExpectFence(run));
    ExpectDaemonResourcesBack(run);

    StepBystander(run.other, 2);  // the second job never noticed
    ASSERT_NO_FATAL_FAILURE(ExpectJobRecoversAfterReset(run));
  }

  // Creates the second job and attaches its rank over shared memory.
  void StartBystander(Bystander& b) {
    b.spec = MakeSpec(NewJobId("bystander"), 1, 0, {Matrix("a", {48, 32}), Matrix("b", {32, 48})});
    b.grads = MakeGradients(b.spec.matrices, 3, /*seed=*/18);
    auto ref = RunTrajectory(client(), MakeSpec(NewJobId("bystander-ref"), 1, 0, b.spec.matrices),
                             Api::kGrpcStep, b.grads);
    ASSERT_TRUE(ref.ok()) << ref.status();
    b.ref = *std::move(ref);
    auto token = client().CreateJob(b.spec);
    ASSERT_TRUE(token.ok()) << token.status();
    b.token = *token;
    auto session = client().Attach(b.spec.job_id, 0, b.token, false, Transport::kShm);
    ASSERT_TRUE(session.ok()) << session.status();
    b.session = *std::move(session);
  }

  // One step of the second job: its reference update. A failure here does not end the test.
  void StepBystander(Bystander& b, int64_t step) {
    auto u = StepWith(Api::kZeroCopy, *b.session, step, b.grads[step]);
    ASSERT_TRUE(u.ok()) << "the second job, step " << step << ": " << u.status();
    EXPECT_EQ(*u, b.ref.updates[0][step]) << "the second job, step " << step;
  }

  // The killed job's status (an empty one, and a failure, when GetJob fails).
  v1::JobStatus KilledJobStatus(const KillRun& run) {
    auto st = client().GetJob(run.spec.job_id, run.token);
    EXPECT_TRUE(st.ok()) << st.status();
    return st.ok() ? *st : v1::JobStatus();
  }

  // Creates the 2-rank job and attaches rank 0 (this test) over shared memory.
  void CreateKilledJob(KillRun& run) {
    run.spec =
        MakeSpec(NewJobId(run.rank1_rings ? "killed-rang" : "killed-idle"), 2, 2, run.matrices);
    auto token = client().CreateJob(run.spec);
    ASSERT_TRUE(token.ok()) << token.status();
    run.token = *token;
    auto rank0 = client().Attach(run.spec.job_id, 0, run.token, false, Transport::kShm);
    ASSERT_TRUE(rank0.ok()) << rank0.status();
    run.rank0 = *std::move(rank0);
    (void)KilledJobStatus(run);
  }

  // Measures the daemon's baseline, then starts rank 1 as its own process (shm_rank) and waits
  // until it attached and, with `rank1_rings`, rang.
  void StartRank1Process(KillRun& run) {
    // The baseline: the daemon idle between RPCs (a measurement that repeats).
    ASSERT_TRUE(WaitForCounts(daemon_pid(), MeasureProcess(daemon_pid()), 5, &run.baseline));
    auto child = ChildProcess::Start(
        {SHM_RANK_BIN, address(), run.spec.job_id, "1", "0", run.rank1_rings ? "ring" : "idle"},
        {{"MUOND_JOB_TOKEN", run.token}});
    ASSERT_TRUE(child.ok()) << child.status();
    run.child = *std::move(child);
    ASSERT_TRUE(run.child->WaitForOutput(run.rank1_rings ? "RINGING" : "ATTACHED", 10))
        << run.child->Out() << run.child->Err();
    if (run.rank1_rings) {
      ASSERT_TRUE(WaitForJob(client(), run.spec.job_id, run.token, [](const v1::JobStatus& st) {
        return st.ranks(1).finished_pushing();
      })) << "rank 1's submission";
    }
    ASSERT_TRUE(KilledJobStatus(run).ranks(1).attached());
  }

  // The daemon holds rank 1's session: its socket, three regions, two eventfds; three mappings;
  // and (as root) locked memory.
  void ExpectRank1SessionHeld(KillRun& run) {
    run.attached = MeasureProcess(daemon_pid());
    const ProcCounts& attached = run.attached;
    EXPECT_EQ(attached.fds, run.baseline.fds + 6) << attached.ToString();
    EXPECT_EQ(attached.memfd_maps, run.baseline.memfd_maps + 3) << attached.ToString();
    if (geteuid() == 0 && kMlockObservable) {
      EXPECT_GT(attached.vmlck_kb, run.baseline.vmlck_kb) << attached.ToString();
    }
  }

  // Rank 0 steps in a thread of its own and waits there for rank 1.
  void StartRank0Waiting(KillRun& run) {
    run.waiting = std::make_unique<StepThread>(
        [&] { run.rank0_result = StepWith(Api::kZeroCopy, *run.rank0, 0, run.grads[0]); },
        [&] { (void)client().DeleteJob(run.spec.job_id, run.token); });
    ASSERT_TRUE(WaitForJob(client(), run.spec.job_id, run.token, [](const v1::JobStatus& st) {
      return st.has_step_in_flight() && st.ranks(0).finished_pushing();
    })) << "rank 0's submission";
  }

  // SIGKILLs rank 1: the job is fenced naming rank 1, a waiting rank 0 gets ABORTED, the step
  // counts as aborted, and rank 0 (re)trying the step is refused.
  void KillRank1AndExpectFence(KillRun& run) {
    ASSERT_NE(run.child->Kill(SIGKILL), -1);
    // Bounded: should the abort not come, the StepThread's destructor deletes the job to release
    // rank 0.
    ASSERT_TRUE(WaitForJob(
        client(), run.spec.job_id, run.token, [](const v1::JobStatus& st) { return st.fenced(); },
        10))
        << "the job was not fenced after rank 1 died";
    if (run.waiting != nullptr) {
      run.waiting->Join();
      const absl::Status& result = run.rank0_result.status();
      EXPECT_EQ(result.code(), absl::StatusCode::kAborted) << result;
      EXPECT_TRUE(absl::StrContains(result.message(), "rank 1")) << result;
    }
    const v1::JobStatus st = KilledJobStatus(run);
    EXPECT_EQ(st.steps_aborted(), 1);
    EXPECT_EQ(st.steps_completed(), 0);
    EXPECT_FALSE(st.ranks(1).attached());
    EXPECT_FALSE(st.has_step_in_flight());
    EXPECT_TRUE(absl::StrContains(st.fence_reason(), "rank 1")) << st.fence_reason();
    // Rank 0 (re)trying the step: the job is fenced.
    auto fenced = StepWith(Api::kZeroCopy, *run.rank0, 0, run.grads[0]);
    EXPECT_EQ(fenced.status().code(), absl::StatusCode::kFailedPrecondition) << fenced.status();
    EXPECT_TRUE(absl::StrContains(fenced.status().message(), "fenced")) << fenced.status();
  }

  // The daemon's descriptors, mappings and locked memory return to the baseline.
  void ExpectDaemonResourcesBack(const KillRun& run) {
    ProcCounts after;
    const bool back = WaitForCounts(daemon_pid(), run.baseline, 10, &after);
    std::printf("daemon resources (%s): baseline %s | rank 1 attached %s | after SIGKILL %s\n",
                run.rank1_rings ? "killed after ringing" : "killed before ringing",
                run.baseline.ToString().c_str(), run.attached.ToString().c_str(),
                after.ToString().c_str());
    std::fflush(stdout);
    EXPECT_TRUE(back) << "baseline " << run.baseline.ToString() << ", after " << after.ToString();
  }

  // The job recovers after a reset: both ranks step 0 and 1 over shared memory, equal to a gRPC
  // run of a fresh job. Then both jobs are deleted.
  void ExpectJobRecoversAfterReset(KillRun& run) {
    ASSERT_TRUE(client().ResetJob(run.spec.job_id, run.token, 0).ok());
    auto rank1 = client().Attach(run.spec.job_id, 1, run.token, false, Transport::kShm);
    ASSERT_TRUE(rank1.ok()) << rank1.status();
    auto ref = RunTrajectory(client(), MakeSpec(NewJobId("killed-ref"), 2, 2, run.matrices),
                             Api::kGrpcStep, MatrixBytes(run.grads.begin(), run.grads.begin() + 2));
    ASSERT_TRUE(ref.ok()) << ref.status();
    for (int64_t step = 0; step < 2; ++step) {
      auto got = StepAllRanks(client(), run.spec.job_id, run.token, {run.rank0.get(), rank1->get()},
                              {Api::kShmBuffer, Api::kZeroCopy}, step, run.grads[step]);
      for (int r = 0; r < 2; ++r) {
        ASSERT_TRUE(got[r].ok()) << "rank " << r << " step " << step << ": " << got[r].status();
        EXPECT_EQ(*got[r], ref->updates[r][step]) << "rank " << r << " step " << step;
      }
    }
    run.rank0.reset();
    rank1->reset();
    run.other.session.reset();
    ASSERT_TRUE(client().DeleteJob(run.spec.job_id, run.token).ok());
    ASSERT_TRUE(client().DeleteJob(run.other.spec.job_id, run.other.token).ok());
  }
};

TEST_F(ShmFaultTest, RankKilledBeforeRingingAbortsTheWaitingRankAndLeaksNothing) {
  KillRankProcess(/*rank1_rings=*/false);
}

TEST_F(ShmFaultTest, RankKilledAfterRingingAbortsTheStepAndLeaksNothing) {
  KillRankProcess(/*rank1_rings=*/true);
}

// The regions are locked in memory once, at attach: the attach reports pinned and the daemon's
// VmLck grows by exactly the session's three regions (2 gradient + 2 update buffers, the ring),
// and falls back when the session ends. Needs the right to lock that much memory (root, or a
// large enough RLIMIT_MEMLOCK for the daemon).
TEST_F(ShmFaultTest, RegionsArePinnedOnceAtAttach) {
  if (!kMlockObservable) GTEST_SKIP() << "sanitizer build: its runtime makes mlock a no-op";
  if (geteuid() != 0) {
    GTEST_SKIP() << "not root: mlock of the regions may fail under RLIMIT_MEMLOCK, and the daemon "
                    "then runs unpinned (it logs a warning); the pinned assertions need root";
  }
  const common::JobSpec spec = MakeSpec(NewJobId("pinned"), 1, 0, {Matrix("w", {512, 384})});
  auto token = client().CreateJob(spec);
  ASSERT_TRUE(token.ok()) << token.status();
  ProcCounts before;
  ASSERT_TRUE(WaitForCounts(daemon_pid(), MeasureProcess(daemon_pid()), 5, &before));
  auto ch = client::ShmChannel::Attach(client::ShmSocketFor(address()), spec.job_id, 0, *token,
                                       false);
  ASSERT_TRUE(ch.ok()) << ch.status();
  EXPECT_TRUE((*ch)->pinned());
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t buffer = (*ch)->buffer_bytes();
  EXPECT_EQ(buffer, 512u * 384u * 4u);
  const uint64_t region = (2 * buffer + page - 1) / page * page;
  // The update region also holds the progress words (8 bytes per span, 64-byte aligned).
  const uint64_t progress = (2 * buffer + 63) / 64 * 64 + 8 * (*ch)->spans().size();
  const uint64_t update_region = (progress + page - 1) / page * page;
  const int64_t want_kb = static_cast<int64_t>((region + update_region + page) / 1024);
  const int64_t during = VmLckKb(daemon_pid());
  std::printf("pinned: VmLck %lld kB -> %lld kB (+%lld kB; regions %llu + %llu + %llu bytes)\n",
              static_cast<long long>(before.vmlck_kb), static_cast<long long>(during),
              static_cast<long long>(during - before.vmlck_kb),
              static_cast<unsigned long long>(region),
              static_cast<unsigned long long>(update_region),
              static_cast<unsigned long long>(page));
  EXPECT_EQ(during - before.vmlck_kb, want_kb);
  // Steps lock nothing more.
  std::memset((*ch)->GradientBuffer(0), 0, buffer);
  for (int64_t step = 0; step < 2; ++step) {
    std::vector<float> g(512 * 384, 0.001f * static_cast<float>(step + 1));
    std::memcpy((*ch)->GradientBuffer(step), g.data(), buffer);
    auto r = (*ch)->Ring(step);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  EXPECT_EQ(VmLckKb(daemon_pid()), during);
  ch->reset();
  ProcCounts after;
  EXPECT_TRUE(WaitForCounts(daemon_pid(), before, 10, &after))
      << "before " << before.ToString() << ", after " << after.ToString();
  ASSERT_TRUE(client().DeleteJob(spec.job_id, *token).ok());
}

}  // namespace
}  // namespace muond::shmtest
