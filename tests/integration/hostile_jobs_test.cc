// Hostile and careless requests against jobs (label `hostile`): names that would escape the state
// directory, sizes beyond the daemon's limits, broken job directories at start, durable resets,
// ranks that never come, die between steps or detach mid-step, streams that close before StepEnd
// and chunks re-sent after all data was in, and one job's heavy work next to another job's steps.
// After each attack the daemon still serves and a victim job keeps its state.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/job_spec_proto.h"
#include "common/layout.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"
#include "tests/integration/raw_step.h"

namespace muond::integration {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// Resident memory of a process in bytes (VmRSS).
uint64_t ResidentBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "VmRSS:")) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

common::JobSpec SmallSpec(const std::string& id, int world = 1, int stage = 0) {
  common::JobSpec spec;
  spec.job_id = id;
  spec.world_size = world;
  spec.zero_stage = stage;
  spec.matrices = {Matrix("w", {16, 24}), Matrix("v", {24, 8})};
  return spec;
}

// CreateJob on the raw stub (the client library checks specs itself first).
grpc::Status RawCreate(const std::string& address, const v1::JobSpec& spec) {
  auto stub = RawStub(address);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::CreateJobRequest req;
  *req.mutable_spec() = spec;
  v1::CreateJobResponse resp;
  return stub->CreateJob(&ctx, req, &resp);
}

// A TCP connection to 127.0.0.1:PORT with a 5 s receive timeout; -1 when it cannot connect.
int ConnectLoopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// GET http://127.0.0.1:PORT/metrics: the body (empty on failure).
std::string Scrape(int port) {
  const int fd = ConnectLoopback(port);
  std::string got;
  if (fd >= 0) {
    const std::string req = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
      char buf[65536];
      ssize_t n;
      while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) got.append(buf, static_cast<size_t>(n));
    }
  }
  if (fd >= 0) ::close(fd);
  return got;
}

// The metrics port a daemon started with --metrics-address 127.0.0.1:0 chose (from its log).
int MetricsPort(const std::string& log) {
  const std::string key = "metrics on http://127.0.0.1:";
  const size_t at = log.find(key);
  return at == std::string::npos ? 0 : std::atoi(log.c_str() + at + key.size());
}

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

class HostileJobsTest : public ::testing::Test {
 protected:
  void Start(const std::vector<std::string>& flags = {}) {
    auto d = DaemonProcess::StartIn(dir_.path(), flags);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    auto c = client::Client::Connect(daemon_->address());
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }
  void Stop() {
    client_.reset();
    ASSERT_EQ(daemon_->Stop(), 0) << daemon_->Log();
  }
  // A victim job with one committed step and a checkpoint generation.
  void MakeVictim() {
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
  // The victim is at step 1 with its generation, and its step 1 equals the step 1 of an
  // unattacked twin.
  void ExpectVictimIntact() {
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

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::Client> client_;
  common::JobSpec victim_;
  std::string victim_token_;
  MatrixBytes grads_;
  std::vector<std::string> victim_update1_;
  int twins_ = 0;
};

TEST_F(HostileJobsTest, NamesThatWouldEscapeAreRefusedAndNothingIsRemoved) {
  Start();
  MakeVictim();
  const std::string nul("a\0b", 3);
  for (const std::string& id : {std::string("."), std::string(".."), std::string(".deleted-x"),
                                std::string("a/b"), std::string("../x"), std::string(10000, 'a'),
                                nul, std::string(""), std::string(".hidden")}) {
    v1::JobSpec spec = common::JobSpecToProto(SmallSpec("x"));
    spec.set_job_id(id);
    const grpc::Status s = RawCreate(daemon_->address(), spec);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << id.substr(0, 20);
    EXPECT_LT(s.error_message().size(), 400u) << "the message repeats the whole id";
    std::printf("job_id %s (%zu bytes): %d %s\n", id.substr(0, 12).c_str(), id.size(),
                s.error_code(), s.error_message().substr(0, 120).c_str());
  }
  for (const std::string& name : {nul, std::string(300, 'm'), std::string("a\nb")}) {
    v1::JobSpec spec = common::JobSpecToProto(SmallSpec("names"));
    spec.mutable_matrices(0)->set_name(name);
    const grpc::Status s = RawCreate(daemon_->address(), spec);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  }
  // A GetJob with a huge id: a short INVALID_ARGUMENT (no metadata-size failure).
  auto huge = client_->GetJob(std::string(10000, 'z'), "t");
  EXPECT_TRUE(absl::IsInvalidArgument(huge.status())) << huge.status();
  EXPECT_LT(huge.status().message().size(), 400u);
  ExpectVictimIntact();
  // Nothing outside the victim's directory moved; a restart brings it back.
  Stop();
  Start();
  auto st = client_->GetJob("victim", victim_token_);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->next_step(), 1);
  Stop();
}

TEST_F(HostileJobsTest, SizesBeyondTheLimitsAreRefusedBeforeAllocating) {
  Start({"--max-jobs", "3", "--max-state-bytes", "268435456"});
  MakeVictim();
  const uint64_t rss_before = ResidentBytes(daemon_->pid());
  struct Case {
    std::string what;
    common::JobSpec spec;
    std::string limit;
  };
  std::vector<Case> cases;
  {
    common::JobSpec s = SmallSpec("wide", 65536, 3);
    s.matrices.clear();
    for (int i = 0; i < 1500; ++i) s.matrices.push_back(Matrix(absl::StrCat("m", i), {2, 2}));
    cases.push_back({"world size 65536, stage 3, 1500 x [2, 2]", s, "--max-world-size 4096"});
  }
  {
    common::JobSpec s = SmallSpec("huge");
    s.matrices = {Matrix("h", {131072, 131072})};
    cases.push_back({"one [131072, 131072] matrix", s, "--max-state-bytes 268435456"});
  }
  {
    common::JobSpec s = SmallSpec("spans", 4096, 3);
    s.matrices.clear();
    for (int i = 0; i < 300; ++i) s.matrices.push_back(Matrix(absl::StrCat("m", i), {64, 64}));
    cases.push_back({"4096 ranks x 300 tensors of 4096 elements", s, "--max-spans-per-job"});
  }
  {
    common::JobSpec s = SmallSpec("many");
    s.matrices.clear();
    for (int i = 0; i < 70000; ++i) s.matrices.push_back(Matrix(absl::StrCat("t", i), {1, 1}));
    cases.push_back({"70000 tensors", s, "--max-tensors-per-job 65536"});
  }
  {
    common::JobSpec s = SmallSpec("budget");
    s.gather_budget_bytes = uint64_t{1} << 40;
    cases.push_back({"gather budget 1 TiB", s, "--gather-budget-bytes"});
  }
  for (const Case& c : cases) {
    const grpc::Status s = RawCreate(daemon_->address(), common::JobSpecToProto(c.spec));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << c.what << ": "
                                                                   << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), c.limit)) << s.error_message();
    std::printf("%s: code %d: %s\n", c.what.c_str(), s.error_code(), s.error_message().c_str());
  }
  // Jobs: the victim plus two more fit under --max-jobs 3; the fourth is refused.
  auto j2 = client_->CreateJob(SmallSpec("j2"));
  auto j3 = client_->CreateJob(SmallSpec("j3"));
  ASSERT_TRUE(j2.ok() && j3.ok());
  const grpc::Status fourth = RawCreate(daemon_->address(), common::JobSpecToProto(SmallSpec("j4")));
  EXPECT_EQ(fourth.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << fourth.error_message();
  EXPECT_TRUE(absl::StrContains(fourth.error_message(), "--max-jobs 3")) << fourth.error_message();
  const uint64_t rss_after = ResidentBytes(daemon_->pid());
  std::printf("resident memory before %.1f MiB, after the refusals %.1f MiB\n",
              rss_before / 1048576.0, rss_after / 1048576.0);
  EXPECT_LT(rss_after, rss_before + (24u << 20)) << "a refusal allocated";
  ASSERT_TRUE(client_->DeleteJob("j2", *j2).ok());
  ASSERT_TRUE(client_->DeleteJob("j3", *j3).ok());
  ExpectVictimIntact();
  Stop();
}

TEST_F(HostileJobsTest, MemoryOfADeletedJobIsReturned) {
  Start();
  MakeVictim();
  const uint64_t before = ResidentBytes(daemon_->pid());
  // The shape that took 2.3 GiB before (at the largest world size allowed now), and 64 MiB of
  // momentum.
  common::JobSpec wide = SmallSpec("wide", 4096, 3);
  wide.matrices.clear();
  for (int i = 0; i < 1500; ++i) wide.matrices.push_back(Matrix(absl::StrCat("m", i), {2, 2}));
  auto wide_token = client_->CreateJob(wide);
  ASSERT_TRUE(wide_token.ok()) << wide_token.status();
  const uint64_t with_wide = ResidentBytes(daemon_->pid());
  common::JobSpec big = SmallSpec("big");
  big.matrices = {Matrix("b", {4096, 4096})};
  auto big_token = client_->CreateJob(big);
  ASSERT_TRUE(big_token.ok()) << big_token.status();
  const uint64_t with_big = ResidentBytes(daemon_->pid());
  ASSERT_TRUE(client_->DeleteJob("wide", *wide_token).ok());
  ASSERT_TRUE(client_->DeleteJob("big", *big_token).ok());
  const uint64_t after = ResidentBytes(daemon_->pid());
  std::printf("resident MiB: before %.1f, + world 4096 x 1500 tensors %.1f, + 64 MiB job %.1f, "
              "after deleting both %.1f\n",
              before / 1048576.0, with_wide / 1048576.0, with_big / 1048576.0,
              after / 1048576.0);
  EXPECT_LT(with_wide, before + (64u << 20)) << "a world-4096 job of 24 KB momentum";
  EXPECT_GT(with_big, with_wide + (48u << 20)) << "the 64 MiB momentum is resident";
  EXPECT_LT(after, before + (8u << 20)) << "memory stayed after the jobs were deleted";
  ExpectVictimIntact();
  Stop();
}

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

// Chunks re-sent with other values after every element was in are refused, never taken.
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
    if (after->next_step() == step + 1) {
      ++committed;
      EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
          << r.status.error_message();
    } else {
      ++refused;
      EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
          << r.status.error_message();
    }
  }
  std::printf("re-sent chunk, 30 runs: %d after the commit (FAILED_PRECONDITION), %d before it "
              "(INVALID_ARGUMENT, step refused)\n",
              committed, refused);
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

// The live daemon's /metrics while hundreds of connections sit idle on it, and oversized
// requests to it: scrapes stay fast, the junk gets a 4xx, the victim steps on.
TEST_F(HostileJobsTest, IdleAndOversizedMetricsRequestsDoNotStarveScrapes) {
  Start({"--metrics-address", "127.0.0.1:0"});
  MakeVictim();
  const int port = MetricsPort(daemon_->Log());
  ASSERT_NE(port, 0) << daemon_->Log();
  std::vector<int> idle;
  for (int i = 0; i < 300; ++i) {
    const int fd = ConnectLoopback(port);
    ASSERT_GE(fd, 0);
    idle.push_back(fd);
  }
  double worst = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    const std::string body = Scrape(port);
    worst = std::max(worst, Seconds(t0));
    EXPECT_TRUE(absl::StrContains(body, "muond_limit{limit=\"max_jobs\"} 64")) << body.substr(0, 300);
  }
  std::printf("/metrics with 300 idle connections open: worst scrape of 5 %.1f ms\n", worst * 1e3);
  EXPECT_LT(worst, 1.0);
  // A 64 KiB request line and 1 MiB of headers: a 4xx, and the connection ends.
  for (const std::string& req :
       {"GET /" + std::string(65536, 'a') + " HTTP/1.1\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nX: " + std::string(1 << 20, 'h') + "\r\n\r\n"}) {
    const int fd = ConnectLoopback(port);
    ASSERT_GE(fd, 0);
    (void)::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
    char buf[256] = {};
    const ssize_t n = ::recv(fd, buf, sizeof(buf) - 1, 0);
    ::close(fd);
    ASSERT_GT(n, 12);
    const std::string status(buf, 12);
    EXPECT_TRUE(status == "HTTP/1.1 431" || status == "HTTP/1.1 413" || status == "HTTP/1.1 400")
        << status;
    std::printf("oversized request of %zu bytes: %s\n", req.size(), status.c_str());
  }
  for (int fd : idle) ::close(fd);
  ExpectVictimIntact();
  Stop();
}

// Job A's heavy work (a slow checkpoint save, a create restored from it that writes its first
// generation slowly) never stalls job B: B's steps, attaches and job listings go on.
TEST_F(HostileJobsTest, OneJobsHeavyWorkDoesNotStallAnother) {
#ifndef MUOND_TEST_HOOKS
  GTEST_SKIP() << "muond was built without test hooks (-DMUOND_TEST_HOOKS=ON)";
#endif
  ::setenv("MUOND_TEST_CHECKPOINT_FAULT", "delay:300", 1);
  Start({"--metrics-address", "127.0.0.1:0"});
  ::unsetenv("MUOND_TEST_CHECKPOINT_FAULT");
  const int metrics_port = MetricsPort(daemon_->Log());
  ASSERT_NE(metrics_port, 0) << daemon_->Log();
  common::JobSpec a = SmallSpec("heavy");
  a.matrices = {Matrix("a0", {1024, 1024}), Matrix("a1", {1024, 1024}),
                Matrix("a2", {1024, 1024}), Matrix("a3", {1024, 1024})};
  auto a_token = client_->CreateJob(a);
  ASSERT_TRUE(a_token.ok());
  common::JobSpec b = SmallSpec("light");
  auto b_token = client_->CreateJob(b);
  ASSERT_TRUE(b_token.ok());
  const MatrixBytes grads = MakeGradients(b.matrices, 1, 6);
  auto session = client_->Attach("light", 0, *b_token, false, client::Transport::kGrpc);
  ASSERT_TRUE(session.ok());
  int64_t step = 0;
  // B's step latency (a step, an attach, a job listing and a /metrics scrape), median of n.
  auto measure = [&](int n) {
    std::vector<double> t;
    for (int i = 0; i < n; ++i) {
      const auto t0 = Clock::now();
      EXPECT_TRUE(StepSpans(**session, step, grads[0]).ok());
      ++step;
      EXPECT_TRUE(client_->ListJobs().ok());
      EXPECT_TRUE(absl::StrContains(Scrape(metrics_port), "muond_jobs")) << "a scrape failed";
      auto other = client_->Attach("light", 0, *b_token, /*takeover=*/true,
                                   client::Transport::kGrpc);
      EXPECT_TRUE(other.ok());
      session = std::move(other);
      t.push_back(Seconds(t0));
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  const double quiet = measure(15);
  std::atomic<bool> heavy_done{false};
  double save_seconds = 0, create_seconds = 0;
  std::thread heavy([&] {
    const auto t0 = Clock::now();
    EXPECT_TRUE(client_->SaveCheckpoint("heavy", *a_token).ok());
    save_seconds = Seconds(t0);
    const auto t1 = Clock::now();
    common::JobSpec copy = a;
    copy.job_id = "heavy-copy";
    auto c = client::Client::Connect(daemon_->address());
    v1::RestoreFrom from;
    from.set_job_id("heavy");
    from.set_token(*a_token);
    auto copied = (*c)->CreateJob(copy, &from);
    EXPECT_TRUE(copied.ok()) << copied.status();
    create_seconds = Seconds(t1);
    heavy_done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const double busy = measure(15);
  const bool overlapped = !heavy_done.load();
  heavy.join();
  std::printf("job B step+list+attach+scrape median: %.1f ms quiet, %.1f ms while job A saves (%.1f s) "
              "and a job is created from A's checkpoint (%.1f s); ratio %.2f\n",
              quiet * 1e3, busy * 1e3, save_seconds, create_seconds, busy / quiet);
  EXPECT_TRUE(overlapped) << "A's work ended before B's measurement";
  EXPECT_LT(busy, quiet * 5 + 0.25) << "job B stalled behind job A";
  Stop();
}

}  // namespace
}  // namespace muond::integration
