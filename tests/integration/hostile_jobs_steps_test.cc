// Hostile and careless requests against a job's steps (label `hostile`): ranks that never come,
// die between steps or detach mid-step, streams that close before StepEnd, chunks re-sent after
// all data was in, and malformed specs, chunk streams and files. After each attack the daemon still
// serves and a victim job keeps its state.
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "common/job_spec_proto.h"
#include "gtest/gtest.h"
#include "tests/integration/hostile_jobs_fixture.h"
#include "tests/integration/raw_step.h"

namespace muond::integration {
namespace {

// Rank 0 of `job` attached with takeover on the raw stub; its session (0 on failure).
uint64_t RawAttach(v1::Muond::Stub& stub, const std::string& job, const std::string& token) {
  grpc::ClientContext ctx;
  ctx.AddMetadata("x-muond-job-token", token);
  v1::AttachRankRequest req;
  req.set_job_id(job);
  req.set_takeover(true);
  v1::AttachRankResponse resp;
  return stub.AttachRank(&ctx, req, &resp).ok() ? resp.session_id() : 0;
}

TEST_F(HostileJobsTest, AStepTimeoutAbortsNamingTheRanksThatNeverCame) {
  Start();
  MakeVictim();
  common::JobSpec spec = SmallSpec("slow", 3, 1);
  spec.step_timeout_seconds = 1;
  auto token = client_->CreateJob(spec);
  ASSERT_TRUE(token.ok());
  const MatrixBytes grads = MakeGradients(spec.matrices, 1, 2);
  auto s = client_->Attach("slow", 0, *token);
  ASSERT_TRUE(s.ok());
  const auto t0 = Clock::now();
  auto u = StepSpans(**s, 0, grads[0]);
  const double waited = Seconds(t0);
  std::printf("rank 0 waited %.2f s: %s\n", waited, u.status().ToString().c_str());
  EXPECT_TRUE(absl::IsAborted(u.status())) << u.status();
  EXPECT_TRUE(absl::StrContains(u.status().message(), "never arrived: 1, 2")) << u.status();
  EXPECT_LT(waited, 5.0);
  auto st = client_->GetJob("slow", *token);
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(st->fenced());
  ExpectVictimIntact();
  Stop();
}

TEST_F(HostileJobsTest, ARankThatDiesBetweenStepsIsNoticed) {
  Start();
  MakeVictim();
  common::JobSpec spec = SmallSpec("died", 2, 1);
  auto token = client_->CreateJob(spec);
  ASSERT_TRUE(token.ok());
  auto pusher = ChildProcess::Start({RANK_PUSHER_BIN, daemon_->address(), "died", "1", "-1"},
                                    {{"MUOND_JOB_TOKEN", *token}});
  ASSERT_TRUE(pusher.ok()) << pusher.status();
  ASSERT_TRUE((*pusher)->WaitForOutput("ATTACHED", 20)) << (*pusher)->Err();
  (*pusher)->Kill(SIGKILL);
  // The daemon sees the session watch end and detaches the rank.
  bool detached = false;
  for (int i = 0; i < 100 && !detached; ++i) {
    auto st = client_->GetJob("died", *token);
    ASSERT_TRUE(st.ok());
    detached = !st->ranks(1).attached();
    if (!detached) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(detached) << "the dead rank is still attached";
  const MatrixBytes grads = MakeGradients(spec.matrices, 1, 4);
  auto s0 = client_->Attach("died", 0, *token, false, client::Transport::kGrpc);
  ASSERT_TRUE(s0.ok());
  const auto t0 = Clock::now();
  auto u = StepSpans(**s0, 0, grads[0]);
  EXPECT_TRUE(absl::IsAborted(u.status())) << u.status();
  EXPECT_TRUE(absl::StrContains(u.status().message(), "rank 1 is gone")) << u.status();
  EXPECT_LT(Seconds(t0), 2.0) << "rank 0 waited for a dead rank";
  // Rank 1 comes back: the step runs (nothing was fenced).
  const std::vector<RankRun> runs = RunRanks(daemon_->address(), "died", *token, 2, grads,
                                             false, 0, /*takeover=*/true);
  for (const RankRun& r : runs) EXPECT_TRUE(r.status.back().ok()) << r.status.back();
  ExpectVictimIntact();
  Stop();
}

TEST_F(HostileJobsTest, ACleanDetachMidStepAbortsTheStep) {
  Start();
  MakeVictim();
  common::JobSpec spec = SmallSpec("leaver", 2, 1);
  auto token = client_->CreateJob(spec);
  ASSERT_TRUE(token.ok());
  const MatrixBytes grads = MakeGradients(spec.matrices, 1, 4);
  auto s1 = client_->Attach("leaver", 1, *token, false, client::Transport::kGrpc);
  ASSERT_TRUE(s1.ok());
  absl::Status rank0;
  std::thread t([&] {
    auto c = client::Client::Connect(daemon_->address());
    auto s0 = (*c)->Attach("leaver", 0, *token, false, client::Transport::kGrpc);
    rank0 = s0.ok() ? StepSpans(**s0, 0, grads[0]).status() : s0.status();
  });
  for (int i = 0; i < 200; ++i) {
    auto st = client_->GetJob("leaver", *token);
    if (st.ok() && st->has_step_in_flight()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE((*s1)->Detach().ok());
  t.join();
  EXPECT_TRUE(absl::IsAborted(rank0)) << rank0;
  EXPECT_TRUE(absl::StrContains(rank0.message(), "rank 1 detached during the step")) << rank0;
  ExpectVictimIntact();
  Stop();
}

// All of a step's chunks, then the stream closes without StepEnd: whether the abort or the commit
// wins, the answer says which, and the job's state agrees.
TEST_F(HostileJobsTest, AStreamClosedBeforeStepEndNeverLiesAboutTheCommit) {
  Start();
  MakeVictim();
  common::JobSpec spec = SmallSpec("race");
  spec.matrices = {Matrix("r", {32, 32})};
  auto token = client_->CreateJob(spec);
  ASSERT_TRUE(token.ok());
  auto stub = RawStub(daemon_->address());
  const MatrixBytes grads = MakeGradients(spec.matrices, 1, 3);
  int committed = 0, aborted = 0;
  constexpr int kRuns = 200;
  for (int i = 0; i < kRuns; ++i) {
    auto st = client_->GetJob("race", *token);
    ASSERT_TRUE(st.ok());
    const int64_t step = st->next_step();
    const uint64_t session = RawAttach(*stub, "race", *token);
    ASSERT_NE(session, 0u);
    // 0 to 9 ms between the last chunk and the close: both outcomes occur.
    const RawStepResult r = RunRawStep(
        *stub, &*token,
        {BeginRequest("race", 0, session, step), GradientRequest(0, 0, grads[0][0])}, 30, 0,
        (i % 10) * 1e-3);
    auto after = client_->GetJob("race", *token);
    ASSERT_TRUE(after.ok());
    if (after->next_step() == step + 1) {
      ++committed;
      EXPECT_NE(r.status.error_code(), grpc::StatusCode::ABORTED)
          << "ABORTED for a committed step: " << r.status.error_message();
      EXPECT_FALSE(after->fenced());
      if (committed == 1) {
        // The rank learns the committed step by asking for it again: a replay.
        const RawStepResult replay =
            RunRawStep(*stub, &*token, {BeginRequest("race", 0, session, step), EndRequest()});
        EXPECT_TRUE(replay.status.ok()) << replay.status.error_message();
        EXPECT_TRUE(replay.replayed());
      }
    } else {
      ++aborted;
      EXPECT_EQ(after->next_step(), step);
      EXPECT_EQ(r.status.error_code(), grpc::StatusCode::ABORTED) << r.status.error_message();
      EXPECT_TRUE(after->fenced());
      ASSERT_TRUE(client_->ResetJob("race", *token, step).ok());
    }
  }
  std::printf("stream closed before StepEnd, %d runs: %d committed (told UNAVAILABLE), %d "
              "aborted (told ABORTED)\n",
              kRuns, committed, aborted);
  ExpectVictimIntact();
  Stop();
}

// Chunks re-sent with other values after every element was in are refused, never taken. Either
// the step was sealed (all data in: it is committing, or updating its state in place) and goes on
// to commit, the chunk refused FAILED_PRECONDITION; or the re-sent chunk came first and the step is
// refused INVALID_ARGUMENT, nothing committed. A sealed step may still be computing when the
// stream ends, so its commit is awaited.
TEST_F(HostileJobsTest, ResentDataIsAlwaysRefused) {
  Start();
  MakeVictim();
  common::JobSpec spec = SmallSpec("resend");
  spec.matrices = {Matrix("r", {32, 32})};
  auto token = client_->CreateJob(spec);
  ASSERT_TRUE(token.ok());
  auto stub = RawStub(daemon_->address());
  const MatrixBytes grads = MakeGradients(spec.matrices, 2, 3);
  int committed = 0, refused = 0;
  for (int i = 0; i < 30; ++i) {
    auto st = client_->GetJob("resend", *token);
    ASSERT_TRUE(st.ok());
    const int64_t step = st->next_step();
    const uint64_t session = RawAttach(*stub, "resend", *token);
    ASSERT_NE(session, 0u);
    const RawStepResult r =
        RunRawStep(*stub, &*token,
                   {BeginRequest("resend", 0, session, step),
                    GradientRequest(0, 0, grads[0][0]), GradientRequest(0, 0, grads[1][0])},
                   30, (i % 6) * 2e-3);  // 0 to 10 ms before the re-sent chunk
    EXPECT_FALSE(r.status.ok()) << "a re-sent chunk with other values was accepted";
    auto after = client_->GetJob("resend", *token);
    ASSERT_TRUE(after.ok());
    if (r.status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
      ++committed;
      for (int wait = 0; wait < 500 && after->next_step() == step; ++wait) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        after = client_->GetJob("resend", *token);
        ASSERT_TRUE(after.ok());
      }
      EXPECT_EQ(after->next_step(), step + 1) << r.status.error_message();
      EXPECT_FALSE(after->fenced()) << after->fence_reason();
    } else {
      ++refused;
      EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
          << r.status.error_message();
      EXPECT_EQ(after->next_step(), step);
    }
  }
  std::printf("re-sent chunk, 30 runs: %d after the commit (FAILED_PRECONDITION), %d before it "
              "(INVALID_ARGUMENT, step refused)\n",
              committed, refused);
  ExpectVictimIntact();
  Stop();
}

// A re-sent committed step (a replay) must carry the gradients it was computed from: other values
// are refused ALREADY_EXISTS naming the step, an incomplete set too; the same values, or none at
// all (a fetch of the committed result), get the committed update. Nothing changes either way.
TEST_F(HostileJobsTest, ReplayWithOtherGradientsIsRefused) {
  Start();
  MakeVictim();
  common::JobSpec spec = SmallSpec("replayed");
  spec.matrices = {Matrix("r", {32, 32}), Matrix("s", {16, 32})};
  auto token = client_->CreateJob(spec);
  ASSERT_TRUE(token.ok());
  auto stub = RawStub(daemon_->address());
  const MatrixBytes grads = MakeGradients(spec.matrices, 2, 11);
  const uint64_t session = RawAttach(*stub, "replayed", *token);
  ASSERT_NE(session, 0u);
  auto begin = [&] { return BeginRequest("replayed", 0, session, 0); };
  const RawStepResult first = RunRawStep(
      *stub, &*token,
      {begin(), GradientRequest(0, 0, grads[0][0]), GradientRequest(1, 0, grads[0][1]),
       EndRequest()});
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  struct Case {
    std::string what;
    std::vector<v1::StepRequest> requests;
    bool accepted;
    std::string message;
  };
  std::string flipped = grads[0][1];
  flipped[flipped.size() / 2] ^= 0x01;  // one bit of one element of the second matrix
  const std::vector<Case> cases = {
      {"the same gradients", {begin(), GradientRequest(0, 0, grads[0][0]),
                              GradientRequest(1, 0, grads[0][1]), EndRequest()}, true, ""},
      {"no gradients (a fetch)", {begin(), EndRequest()}, true, ""},
      {"the next step's gradients", {begin(), GradientRequest(0, 0, grads[1][0]),
                                     GradientRequest(1, 0, grads[1][1]), EndRequest()},
       false, "matrix 'r' elements from 0"},
      {"one bit flipped", {begin(), GradientRequest(0, 0, grads[0][0]),
                           GradientRequest(1, 0, flipped), EndRequest()},
       false, "matrix 's' elements from 0"},
      {"half of the gradients", {begin(), GradientRequest(0, 0, grads[0][0]), EndRequest()}, false,
       "does not carry all of the gradients"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const RawStepResult r = RunRawStep(*stub, &*token, c.requests);
    if (c.accepted) {
      EXPECT_TRUE(r.status.ok()) << r.status.error_message();
      EXPECT_TRUE(r.replayed());
      EXPECT_EQ(r.Update(0, 32 * 32), first.Update(0, 32 * 32)) << "the committed bytes";
      EXPECT_EQ(r.Update(1, 16 * 32), first.Update(1, 16 * 32)) << "the committed bytes";
    } else {
      EXPECT_EQ(r.status.error_code(), grpc::StatusCode::ALREADY_EXISTS)
          << r.status.error_message();
      for (const std::string& want :
           {std::string("job 'replayed' rank 0: step 0 is committed"), c.message,
            std::string("nothing changed")}) {
        EXPECT_NE(r.status.error_message().find(want), std::string::npos)
            << want << " in: " << r.status.error_message();
      }
    }
    std::printf("replay of step 0 with %s: %s %s\n", c.what.c_str(),
                r.status.ok() ? "OK" : "refused",
                r.status.ok() ? "(the committed update)" : r.status.error_message().c_str());
    auto st = client_->GetJob("replayed", *token);
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->next_step(), 1);
    EXPECT_EQ(st->steps_completed(), 1);
    EXPECT_FALSE(st->fenced());
  }
  // The momentum was not touched: step 1 gives what it gives after step 0 alone.
  const RawStepResult next = RunRawStep(
      *stub, &*token,
      {BeginRequest("replayed", 0, session, 1), GradientRequest(0, 0, grads[1][0]),
       GradientRequest(1, 0, grads[1][1]), EndRequest()});
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_FALSE(next.replayed());
  auto ref = client_->CreateJob([&] {
    common::JobSpec s = spec;
    s.job_id = "replayed-ref";
    return s;
  }());
  ASSERT_TRUE(ref.ok());
  const uint64_t ref_session = RawAttach(*stub, "replayed-ref", *ref);
  for (int step = 0; step < 2; ++step) {
    const RawStepResult r = RunRawStep(
        *stub, &*ref,
        {BeginRequest("replayed-ref", 0, ref_session, step), GradientRequest(0, 0, grads[step][0]),
         GradientRequest(1, 0, grads[step][1]), EndRequest()});
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    if (step == 1) {
      EXPECT_EQ(r.Update(0, 32 * 32), next.Update(0, 32 * 32)) << "the replays changed the state";
      EXPECT_EQ(r.Update(1, 16 * 32), next.Update(1, 16 * 32)) << "the replays changed the state";
    }
  }
  ExpectVictimIntact();
  Stop();
}

// Malformed specs (negative and huge dims, duplicate names), a scattered chunk stream, and a
// malformed safetensors file given to muonctl: each a clear refusal, the victim untouched.
TEST_F(HostileJobsTest, MalformedSpecsChunksAndFilesAreRefused) {
  Start();
  MakeVictim();
  struct Case {
    std::string what;
    v1::JobSpec spec;
    std::string want;
  };
  std::vector<Case> cases;
  v1::JobSpec neg = common::JobSpecToProto(SmallSpec("neg"));
  neg.mutable_matrices(0)->set_shape(0, -16);
  cases.push_back({"negative dim", neg, "non-positive dimension"});
  v1::JobSpec huge = common::JobSpecToProto(SmallSpec("hugedim"));
  huge.mutable_matrices(0)->set_shape(0, int64_t{1} << 62);
  huge.mutable_matrices(0)->set_shape(1, int64_t{1} << 62);
  cases.push_back({"dims 2^62 x 2^62", huge, "elements"});
  v1::JobSpec dup = common::JobSpecToProto(SmallSpec("dup"));
  dup.mutable_matrices(1)->set_name("w");
  cases.push_back({"duplicate names", dup, "appears twice"});
  v1::JobSpec threed = common::JobSpecToProto(SmallSpec("dims"));
  for (int i = 0; i < 6; ++i) threed.mutable_matrices(0)->add_shape(2);
  cases.push_back({"8 dims", threed, "dimensions"});
  for (const Case& c : cases) {
    const grpc::Status s = RawCreate(daemon_->address(), c.spec);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.what;
    EXPECT_TRUE(absl::StrContains(s.error_message(), c.want)) << s.error_message();
    std::printf("%s: code %d: %s\n", c.what.c_str(), s.error_code(), s.error_message().c_str());
  }
  // One element per chunk, every other element first: the span's bookkeeping is bounded.
  common::JobSpec spec = SmallSpec("scatter");
  spec.matrices = {Matrix("s", {128, 128})};
  auto token = client_->CreateJob(spec);
  ASSERT_TRUE(token.ok());
  auto stub = RawStub(daemon_->address());
  const uint64_t session = RawAttach(*stub, "scatter", *token);
  ASSERT_NE(session, 0u);
  std::vector<v1::StepRequest> reqs = {BeginRequest("scatter", 0, session, 0)};
  for (uint64_t e = 0; e < 2 * 5000; e += 2) reqs.push_back(GradientRequest(0, e, Fp32Bytes({0.5f})));
  const RawStepResult r = RunRawStep(*stub, &*token, reqs);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << r.status.error_message();
  EXPECT_TRUE(absl::StrContains(r.status.error_message(), "separate pieces"));
  std::printf("scattered chunks: code %d: %s\n", r.status.error_code(),
              r.status.error_message().c_str());
  // muonctl step with a malformed safetensors file: refused before anything reaches the daemon.
  WriteWholeFile(dir_.File("token"), victim_token_ + "\n");
  ::chmod(dir_.File("token").c_str(), 0600);
  for (const std::string& junk : {std::string("\xff\xff\xff\xff\xff\xff\xff\x7f{"),
                                   std::string("\x10\0\0\0\0\0\0\0{\"w\":{\"dtype\":1}}  ", 27),
                                   std::string("abc")}) {
    WriteWholeFile(dir_.File("bad.safetensors"), junk);
    const ProcessResult p = RunMuonctl(
        daemon_->address(), {"step", "--job", "victim", "--rank", "0", "--step", "1", "--grads",
                             dir_.File("bad.safetensors"), "--out", dir_.File("out.safetensors"),
                             "--token-file", dir_.File("token")});
    EXPECT_TRUE(p.exited && p.exit_code != 0) << p.out;
    std::printf("muonctl step with a malformed safetensors file: exit %d: %s", p.exit_code,
                p.err.c_str());
  }
  ExpectVictimIntact();
  Stop();
}

}  // namespace
}  // namespace muond::integration
