// Faults in multi-rank steps (DESIGN.md 4): a non-finite value in one rank's shard refuses the step
// for every rank and leaves every momentum bit-identical; a rank process SIGKILLed mid-step aborts
// the step for every rank (ABORTED) and fences the job until ResetJob, while another job keeps
// stepping correctly.
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"

namespace muond::integration {
namespace {

struct TestJob {
  common::JobSpec spec;
  std::string token;
};

class MultiRankFaultTest : public DaemonSuite {
 protected:
  static TestJob CreateJob(const std::string& prefix, int world, int stage,
                           std::vector<common::MatrixSpec> matrices) {
    TestJob job;
    job.spec.job_id = NewJobId(prefix);
    job.spec.world_size = world;
    job.spec.zero_stage = stage;
    job.spec.matrices = std::move(matrices);
    auto token = client().CreateJob(job.spec);
    EXPECT_TRUE(token.ok()) << token.status();
    job.token = token.value_or("");
    return job;
  }

  static v1::JobStatus Status(const TestJob& job) {
    auto st = client().GetJob(job.spec.job_id, job.token);
    EXPECT_TRUE(st.ok()) << st.status();
    return st.value_or(v1::JobStatus());
  }

  // Clean steps first_step.. with every rank concurrently; expects them to equal want[...].
  static void CleanSteps(const TestJob& job, const MatrixBytes& grads, const MatrixBytes& want,
                         int64_t first_step, bool use_buffer, bool takeover = false) {
    const std::vector<RankRun> runs = RunRanks(address(), job.spec.job_id, job.token,
                                               job.spec.world_size, grads, use_buffer,
                                               first_step, takeover);
    for (int r = 0; r < job.spec.world_size; ++r) {
      ASSERT_EQ(runs[r].spans.size(), grads.size()) << "rank " << r << ": " << runs[r].status.back();
      for (size_t i = 0; i < grads.size(); ++i) {
        EXPECT_TRUE(SpansEqual(job.spec, runs[r].layout, runs[r].spans[i], want[i]))
            << "rank " << r << " step " << first_step + static_cast<int64_t>(i);
      }
    }
  }

  // Step `step` with every rank but `bad_rank` pushing `grads` (each its own thread and client)
  // and, once all of them have pushed everything and wait, `bad_rank` pushing `poisoned`.
  // Returns each rank's status.
  static std::vector<absl::Status> PoisonedStep(const TestJob& job, int64_t step, int bad_rank,
                                                const std::vector<std::string>& grads,
                                                const std::vector<std::string>& poisoned) {
    const int world = job.spec.world_size;
    std::vector<absl::Status> status(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      if (r == bad_rank) continue;
      threads.emplace_back([&, r] {
        auto c = client::Client::Connect(address());
        auto s = (*c)->Attach(job.spec.job_id, r, job.token);
        status[r] = s.ok() ? StepSpans(**s, step, grads).status() : s.status();
      });
    }
    auto c = client::Client::Connect(address());
    auto s = (*c)->Attach(job.spec.job_id, bad_rank, job.token);
    EXPECT_TRUE(s.ok()) << s.status();
    const bool others_wait = WaitForJob(client(), job.spec.job_id, job.token, [&](const auto& st) {
      for (int r = 0; r < world; ++r) {
        if (r != bad_rank && !st.ranks(r).finished_pushing()) return false;
      }
      return true;
    });
    EXPECT_TRUE(others_wait) << "the other ranks did not finish pushing";
    status[bad_rank] = s.ok() ? StepSpans(**s, step, poisoned).status() : s.status();
    for (std::thread& t : threads) t.join();
    return status;
  }
};

// `grads` with `value` at element `element` of float32 matrix `m`.
std::vector<std::string> Poison(std::vector<std::string> grads, uint32_t m, size_t element,
                                float value) {
  std::memcpy(grads[m].data() + element * sizeof(float), &value, sizeof(float));
  return grads;
}

TEST_F(MultiRankFaultTest, NonFiniteShardRefusesTheStepForEveryRankAndKeepsMomentum) {
  const std::vector<common::MatrixSpec> matrices = MixedMatrices();
  TestJob job = CreateJob("nonfinite", 3, 3, matrices);
  const MatrixBytes grads = MakeGradients(matrices, 3, /*seed=*/21);
  auto want = ReferenceTrajectory(client(), NewJobId("nonfinite-ref"), job.spec, grads);
  ASSERT_TRUE(want.ok()) << want.status();
  // Stage 3 with 3 ranks: "tall" (1600 elements) in chunks of 534, rank 2 owns [1068, 1600) and
  // pushes it last, after its complete chunks of the other matrices were already computed.
  // Rank 0 owns "big" [0, 2048) and pushes it first.
  struct Case {
    int64_t step;
    int rank;
    uint32_t matrix;
    const char* name;
    size_t element;
    float value;
  };
  const Case cases[] = {
      {0, 2, 4, "tall", 1599, std::numeric_limits<float>::quiet_NaN()},
      {2, 0, 0, "big", 0, std::numeric_limits<float>::infinity()},
  };
  int64_t refused = 0;
  for (int64_t step = 0; step < 3; ++step) {
    for (const Case& c : cases) {
      if (c.step != step) continue;
      SCOPED_TRACE(absl::StrCat("step ", step, ": ", c.name, "[", c.element, "] = ", c.value,
                                " from rank ", c.rank));
      const std::vector<absl::Status> status =
          PoisonedStep(job, step, c.rank, grads[step], Poison(grads[step], c.matrix, c.element,
                                                              c.value));
      ++refused;
      for (int r = 0; r < 3; ++r) {
        EXPECT_EQ(status[r].code(), absl::StatusCode::kInvalidArgument)
            << "rank " << r << ": " << status[r];
        // The refusal names the matrix and the rank that sent the value, for every rank.
        const std::string msg(status[r].message());
        for (const std::string& want_text :
             {absl::StrCat("matrix '", c.name, "'"), absl::StrCat("rank ", c.rank),
              std::string("non-finite"), absl::StrCat("element ", c.element),
              absl::StrCat("step ", step)}) {
          EXPECT_NE(msg.find(want_text), std::string::npos)
              << "rank " << r << ": wanted '" << want_text << "' in: " << msg;
        }
      }
      const v1::JobStatus st = Status(job);
      EXPECT_EQ(st.next_step(), step);
      EXPECT_EQ(st.steps_refused(), refused);
      EXPECT_EQ(st.steps_completed(), step);
      EXPECT_FALSE(st.fenced()) << "a refused step does not fence the job";
      EXPECT_FALSE(st.has_step_in_flight());
    }
    // The clean step equals the trajectory that never saw the bad values (step 0: a fresh job's
    // first step), so no momentum was touched by the refused step.
    SCOPED_TRACE(absl::StrCat("clean step ", step));
    CleanSteps(job, {grads[step]}, {(*want)[step]}, step, /*use_buffer=*/false);
  }
  EXPECT_EQ(Status(job).steps_completed(), 3);
}

// Over shared memory a rank's whole submission is checked before it joins the step, so the bad
// rank can be refused before any other rank began the step: the ranks that submit afterwards are
// refused too (not left waiting for it), each exactly once, and the retry computes the clean
// trajectory. Also when both ranks send a bad value, and when the bad rank is first again on the
// retry of a refused step.
TEST_F(MultiRankFaultTest, RefusedBeforeTheOthersBeganOverSharedMemory) {
  const std::vector<common::MatrixSpec> matrices = {Matrix("a", {32, 48}), Matrix("b", {16, 24})};
  TestJob job = CreateJob("shm-first", 2, 2, matrices);
  const MatrixBytes grads = MakeGradients(matrices, 1, /*seed=*/5);
  auto want = ReferenceTrajectory(client(), NewJobId("shm-first-ref"), job.spec, grads);
  ASSERT_TRUE(want.ok()) << want.status();
  const std::vector<std::string> bad =
      Poison(grads[0], 0, 7, std::numeric_limits<float>::quiet_NaN());
  std::vector<std::unique_ptr<client::Client>> clients;
  std::vector<std::unique_ptr<client::RankSession>> sessions;
  for (int r = 0; r < 2; ++r) {
    auto c = client::Client::Connect(address());
    ASSERT_TRUE(c.ok());
    auto s = (*c)->Attach(job.spec.job_id, r, job.token, false, client::Transport::kShm);
    ASSERT_TRUE(s.ok()) << s.status();
    clients.push_back(*std::move(c));
    sessions.push_back(*std::move(s));
  }
  // One rank's step 0 in a thread, with a deadline: a rank left waiting is a failure, and the job
  // is deleted to end its wait.
  auto step = [&](int rank, const std::vector<std::string>& g) -> absl::Status {
    absl::Status out = absl::DeadlineExceededError("the step did not end within 20 s");
    std::atomic<bool> done{false};
    std::thread t([&] {
      out = StepSpans(*sessions[rank], 0, g).status();
      done = true;
    });
    for (int i = 0; i < 2000 && !done; ++i) absl::SleepFor(absl::Milliseconds(10));
    if (!done) (void)client().DeleteJob(job.spec.job_id, job.token);
    t.join();
    return out;
  };
  // Rank 0 bad first, then rank 1 clean: both refused.
  absl::Status s0 = step(0, bad);
  EXPECT_EQ(s0.code(), absl::StatusCode::kInvalidArgument) << s0;
  absl::Status s1 = step(1, grads[0]);
  EXPECT_EQ(s1.code(), absl::StatusCode::kInvalidArgument) << s1;
  EXPECT_NE(std::string(s1.message()).find("matrix 'a'"), std::string::npos) << s1;
  // The retry: rank 0 bad first again (a new attempt), rank 1 refused again.
  s0 = step(0, bad);
  EXPECT_EQ(s0.code(), absl::StatusCode::kInvalidArgument) << s0;
  s1 = step(1, grads[0]);
  EXPECT_EQ(s1.code(), absl::StatusCode::kInvalidArgument) << s1;
  // Both bad in one attempt: each learns it once.
  s0 = step(0, bad);
  s1 = step(1, bad);
  EXPECT_EQ(s0.code(), absl::StatusCode::kInvalidArgument) << s0;
  EXPECT_EQ(s1.code(), absl::StatusCode::kInvalidArgument) << s1;
  const v1::JobStatus st = Status(job);
  EXPECT_EQ(st.steps_refused(), 3);
  EXPECT_FALSE(st.has_step_in_flight());
  EXPECT_EQ(st.next_step(), 0);
  // The clean retry: both ranks at once, equal to the trajectory that never saw the bad values.
  sessions.clear();
  CleanSteps(job, {grads[0]}, {(*want)[0]}, 0, /*use_buffer=*/false, /*takeover=*/true);
}

// Job B, world size 1, steps in a loop (reset, step 0, step 1) and checks each update bit for bit.
class BackgroundJob {
 public:
  explicit BackgroundJob(const std::string& address, client::Client& c, const std::string& id)
      : address_(address) {
    spec_.job_id = id;
    spec_.matrices = {Matrix("b", {48, 64})};
    grads_ = MakeGradients(spec_.matrices, 2, /*seed=*/99);
    auto want = ReferenceTrajectory(c, id + "-ref", spec_, grads_);
    EXPECT_TRUE(want.ok()) << want.status();
    want_ = want.value_or(MatrixBytes());
    auto token = c.CreateJob(spec_);
    EXPECT_TRUE(token.ok()) << token.status();
    token_ = token.value_or("");
    thread_ = std::thread([this] { Run(); });
  }
  ~BackgroundJob() { Stop(); }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  int rounds() const { return rounds_.load(); }
  std::string error() const {
    absl::MutexLock lock(&mu_);
    return error_;
  }
  // Waits until `n` more rounds completed than now, or the deadline passes.
  bool WaitRounds(int n, double timeout_seconds = 20) {
    const int target = rounds() + n;
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
    while (rounds() < target && error().empty()) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return rounds() >= target;
  }

 private:
  void Fail(const std::string& what) {
    absl::MutexLock lock(&mu_);
    if (error_.empty()) error_ = what;
  }
  void Run() {
    auto c = client::Client::Connect(address_);
    auto s = (*c)->Attach(spec_.job_id, 0, token_);
    if (!s.ok()) return Fail(std::string(s.status().message()));
    while (!stop_ && error().empty()) {
      absl::Status reset = (*c)->ResetJob(spec_.job_id, token_, 0);
      if (!reset.ok()) return Fail(std::string(reset.message()));
      for (int t = 0; t < 2; ++t) {
        auto u = StepSpans(**s, t, grads_[t]);
        if (!u.ok()) return Fail(absl::StrCat("step ", t, ": ", u.status().message()));
        if ((*u)[0] != want_[t][0]) return Fail(absl::StrCat("step ", t, ": update differs"));
      }
      ++rounds_;
    }
  }

  const std::string address_;
  common::JobSpec spec_;
  std::string token_;
  MatrixBytes grads_, want_;
  std::atomic<bool> stop_{false};
  std::atomic<int> rounds_{0};
  mutable absl::Mutex mu_;
  std::string error_;
  std::thread thread_;
};

TEST_F(MultiRankFaultTest, RankProcessKilledMidStepAbortsEveryRankAndFencesOnlyItsJob) {
  const std::vector<common::MatrixSpec> matrices = MixedMatrices();
  TestJob job = CreateJob("killed", 2, 2, matrices);
  const std::string& id = job.spec.job_id;
  const MatrixBytes grads = MakeGradients(matrices, 2, /*seed=*/31);
  auto want = ReferenceTrajectory(client(), NewJobId("killed-ref"), job.spec, grads);
  ASSERT_TRUE(want.ok()) << want.status();

  BackgroundJob other(address(), client(), NewJobId("bystander"));
  ASSERT_TRUE(other.WaitRounds(1)) << other.error();
  CleanSteps(job, {grads[0]}, {(*want)[0]}, 0, /*use_buffer=*/true);

  // Step 1: rank 0 (a thread) pushes everything and waits; rank 1 is a process that pushed half
  // of its first span and is then killed.
  absl::Status rank0_status;
  StepThread rank0(
      [&] {
        auto c = client::Client::Connect(address());
        auto s = (*c)->Attach(id, 0, job.token);
        rank0_status = s.ok() ? StepFlatBuffer(**s, 1, grads[1]).status() : s.status();
      },
      [&] { (void)client().DeleteJob(id, job.token); });
  auto pusher = ChildProcess::Start({RANK_PUSHER_BIN, address(), id, "1", "1"},
                                    {{"MUOND_JOB_TOKEN", job.token}});
  ASSERT_TRUE(pusher.ok()) << pusher.status();
  ASSERT_TRUE((*pusher)->WaitForOutput("PUSHED", 20))
      << "rank_pusher: " << (*pusher)->Out() << (*pusher)->Err();
  ASSERT_TRUE(WaitForJob(client(), id, job.token, [](const v1::JobStatus& st) {
    return st.has_step_in_flight() && st.step_in_flight() == 1 && st.ranks(0).finished_pushing() &&
           st.ranks(1).in_step() && !st.ranks(1).finished_pushing();
  })) << "rank 0 never waited for rank 1 in step 1";
  const int rounds_before_kill = other.rounds();
  const int wait_status = (*pusher)->Kill(SIGKILL);
  EXPECT_TRUE(WIFSIGNALED(wait_status) && WTERMSIG(wait_status) == SIGKILL)
      << DescribeWaitStatus(wait_status);
  rank0.Join();

  EXPECT_EQ(rank0_status.code(), absl::StatusCode::kAborted) << rank0_status;
  EXPECT_NE(rank0_status.message().find("rank 1"), std::string::npos) << rank0_status;
  v1::JobStatus st = Status(job);
  EXPECT_TRUE(st.fenced());
  EXPECT_NE(st.fence_reason().find("rank 1"), std::string::npos) << st.fence_reason();
  EXPECT_EQ(st.steps_aborted(), 1);
  EXPECT_EQ(st.steps_completed(), 1);
  EXPECT_EQ(st.next_step(), 1);
  EXPECT_FALSE(st.has_step_in_flight());

  // Fenced: the next step (and a retry of the committed one) are refused, naming the fence.
  {
    auto s = client().Attach(id, 0, job.token);
    ASSERT_TRUE(s.ok()) << s.status();
    for (int64_t step : {1, 0}) {
      auto r = StepFlatBuffer(**s, step, grads[step]);
      EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
      EXPECT_NE(r.status().message().find("fenced"), std::string::npos) << r.status();
    }
  }
  // The other job kept stepping through the abort and after it, bit for bit.
  EXPECT_TRUE(other.WaitRounds(2)) << other.error();
  EXPECT_GT(other.rounds(), rounds_before_kill);
  EXPECT_EQ(other.error(), "");

  // ResetJob: momentum zero, fence cleared, next step as given.
  ASSERT_TRUE(client().ResetJob(id, job.token, 5).ok());
  st = Status(job);
  EXPECT_FALSE(st.fenced());
  EXPECT_EQ(st.fence_reason(), "");
  EXPECT_EQ(st.next_step(), 5);
  // Rank 1 restarts (takeover of the dead session): steps 5 and 6 equal a fresh job's 0 and 1.
  CleanSteps(job, grads, *want, 5, /*use_buffer=*/true, /*takeover=*/true);
  st = Status(job);
  EXPECT_EQ(st.next_step(), 7);
  EXPECT_EQ(st.steps_aborted(), 1);
  EXPECT_FALSE(st.fenced());

  other.Stop();
  EXPECT_EQ(other.error(), "");
  EXPECT_GE(other.rounds(), 3);
}

}  // namespace
}  // namespace muond::integration
