// Streams that send nothing (issue 32, item 8): a Step stream is refused on its token before the
// daemon reads anything; a flood of idle Step streams with a valid token (a local user's own job)
// holds a bounded number of the daemon's threads, leaves Health and another job's steps working,
// and the streams the daemon admitted are cancelled after --stream-idle-seconds.
//
// MUOND_HOSTILE_IDLE_STREAMS sets the flood's size (default 2000).
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "muond/v1/muond.grpc.pb.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/hostile_util.h"
#include "tests/integration/reference_data.h"

namespace muond::integration {
namespace {

using StepStream = grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>;
using Clock = std::chrono::steady_clock;

constexpr int kSlack = 8;  // server/api/stream_guard.h kStreamsPerJobSlack

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Threads of a process (/proc/PID/status); -1 when it cannot be read.
int ThreadCount(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    int n = 0;
    if (line.rfind("Threads:", 0) == 0 && absl::SimpleAtoi(line.substr(8), &n)) return n;
  }
  return -1;
}

int FloodSize() {
  const char* v = std::getenv("MUOND_HOSTILE_IDLE_STREAMS");
  int n = 0;
  return v != nullptr && absl::SimpleAtoi(v, &n) && n > 0 ? n : 2000;
}

std::unique_ptr<v1::Muond::Stub> Stub(const std::string& address) {
  return v1::Muond::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
}

// A Step stream that sends nothing; `metadata` goes with it. Finishes within `deadline_seconds`.
struct IdleStream {
  grpc::ClientContext ctx;
  std::unique_ptr<StepStream> stream;
};

std::unique_ptr<IdleStream> OpenIdle(v1::Muond::Stub& stub,
                                     const std::map<std::string, std::string>& metadata,
                                     double deadline_seconds) {
  auto s = std::make_unique<IdleStream>();
  s->ctx.set_deadline(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(deadline_seconds * 1000)));
  for (const auto& [k, v] : metadata) s->ctx.AddMetadata(k, v);
  s->stream = stub.Step(&s->ctx);
  return s;
}

class HostileGrpcStreamsTest : public ::testing::Test {
 protected:
  void Start(const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"--metrics-address", "off"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto d = DaemonProcess::StartIn(dir_.path(), args);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    auto c = client::Client::Connect(daemon_->address());
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }
  void TearDown() override {
    client_.reset();
    if (daemon_ == nullptr) return;
    const int status = daemon_->Stop();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << DescribeWaitStatus(status);
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::Client> client_;
};

// A Step (and an InitParams) stream with a bad or missing token is refused at once: the daemon
// does not wait for the client's first message (the stream sends none here).
TEST_F(HostileGrpcStreamsTest, BadTokenIsRefusedBeforeAnyMessage) {
  ASSERT_NO_FATAL_FAILURE(Start({"--stream-idle-seconds", "60"}));
  auto token = client_->CreateJob(OneMatrixJob("victim"));
  ASSERT_TRUE(token.ok()) << token.status();
  auto stub = Stub(daemon_->address());
  struct Case {
    std::map<std::string, std::string> metadata;
    grpc::StatusCode code;
    std::string substring;
  };
  const std::vector<Case> cases = {
      {{}, grpc::StatusCode::UNAUTHENTICATED, "missing job token"},
      {{{"x-muond-job-token", "not-a-token"}},
       grpc::StatusCode::PERMISSION_DENIED,
       "wrong job token"},
      {{{"x-muond-job-token", "not-a-token"}, {"x-muond-job-id", "victim"}},
       grpc::StatusCode::PERMISSION_DENIED,
       "job 'victim': wrong job token"},
      {{{"x-muond-job-id", "victim"}},
       grpc::StatusCode::UNAUTHENTICATED,
       "job 'victim': missing job token"},
  };
  for (const Case& c : cases) {
    const auto start = Clock::now();
    auto idle = OpenIdle(*stub, c.metadata, 20);
    const grpc::Status s = idle->stream->Finish();
    const double seconds = SecondsSince(start);
    std::cout << "Step, " << c.metadata.size()
              << " metadata entries, nothing sent: " << s.error_code() << " '" << s.error_message()
              << "' after " << seconds << " s\n";
    EXPECT_EQ(s.error_code(), c.code) << s.error_message();
    EXPECT_NE(s.error_message().find(c.substring), std::string::npos) << s.error_message();
    EXPECT_LT(seconds, 5) << "the daemon waited for a message before checking the token";
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    ctx.AddMetadata("x-muond-job-token", "not-a-token");
    v1::InitResponse resp;
    const auto start = Clock::now();
    auto writer = stub->InitParams(&ctx, &resp);
    const grpc::Status s = writer->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_LT(SecondsSince(start), 5);
  }
  // The job is untouched and steps.
  EXPECT_TRUE(StepOnce(*client_, "victim", *token).ok());
}

// 2,000 idle Step streams with a valid token: the job's bound refuses most at once
// (RESOURCE_EXHAUSTED), the daemon's threads stay bounded, Health and another job's step (over
// gRPC) work meanwhile, and the admitted streams are cancelled after --stream-idle-seconds.
TEST_F(HostileGrpcStreamsTest, IdleStreamFloodIsBoundedAndCancelled) {
  constexpr double kIdleSeconds = 3;
  ASSERT_NO_FATAL_FAILURE(Start({"--stream-idle-seconds", "3"}));
  const pid_t pid = daemon_->pid();
  auto flood_token = client_->CreateJob(OneMatrixJob("flood"));
  ASSERT_TRUE(flood_token.ok()) << flood_token.status();
  auto victim_token = client_->CreateJob(OneMatrixJob("victim"));
  ASSERT_TRUE(victim_token.ok()) << victim_token.status();
  const int threads_before = ThreadCount(pid);
  ASSERT_GT(threads_before, 0);

  // The daemon's threads, sampled while the flood runs.
  std::atomic<bool> sampling{true};
  std::atomic<int> threads_peak{threads_before};
  std::thread sampler([&] {
    while (sampling.load()) {
      threads_peak.store(std::max(threads_peak.load(), ThreadCount(pid)));
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });

  const int n = FloodSize();
  auto stub = Stub(daemon_->address());
  std::vector<std::unique_ptr<IdleStream>> flood;
  const auto opened = Clock::now();
  for (int i = 0; i < n; ++i) {
    flood.push_back(OpenIdle(*stub, {{"x-muond-job-token", *flood_token}}, 60));
  }
  const double open_seconds = SecondsSince(opened);

  // During the flood: Health through a fresh client, the victim job's step over gRPC.
  auto other = client::Client::Connect(daemon_->address());
  ASSERT_TRUE(other.ok());
  const absl::Status health = (*other)->Health(5);
  const int threads_during = ThreadCount(pid);
  absl::Status step;
  {
    auto session = (*other)->Attach("victim", 0, *victim_token, false, client::Transport::kGrpc);
    step = session.status();
    if (session.ok()) {
      auto updates = (*session)->StepTensors(0, {RefGrad("wide_std", 0, "w")});
      step = updates.status();
      if (updates.ok()) {
        ::testing::AssertionResult match =
            MatchesReferenceUpdate(ToFloats((*updates)[0]), "wide_std", 0, 1e-4);
        if (!match) step = absl::InternalError(match.message());
      }
    }
  }
  EXPECT_TRUE(health.ok()) << health;
  EXPECT_TRUE(step.ok()) << step;

  // Every stream ends: refused at once, or cancelled once idle for the limit.
  std::map<grpc::StatusCode, int> codes;
  std::string cancelled_message;
  for (auto& s : flood) {
    const grpc::Status st = s->stream->Finish();
    ++codes[st.error_code()];
    if (st.error_code() == grpc::StatusCode::CANCELLED) cancelled_message = st.error_message();
  }
  const double all_ended = SecondsSince(opened);
  sampling.store(false);
  sampler.join();
  flood.clear();
  std::cout << n << " idle Step streams opened in " << open_seconds << " s; all ended " << all_ended
            << " s after the first; threads " << threads_before << " before, " << threads_during
            << " during, peak " << threads_peak.load() << "; ended with:";
  for (const auto& [code, count] : codes) std::cout << " code " << code << " x" << count;
  std::cout << "\n";

  const int refused = codes[grpc::StatusCode::RESOURCE_EXHAUSTED];
  const int cancelled = codes[grpc::StatusCode::CANCELLED];
  EXPECT_EQ(refused + cancelled, n) << "every stream is refused or cancelled as idle";
  EXPECT_GE(cancelled, 1);
  EXPECT_GE(refused, n / 2);
  EXPECT_EQ(codes[grpc::StatusCode::DEADLINE_EXCEEDED], 0) << "an idle stream was never cancelled";
  EXPECT_LT(all_ended, open_seconds + kIdleSeconds + 10);
  // Bounded: below one thread per stream (the server's quota is 1024 threads, streams may hold
  // 384; gRPC keeps some of the threads it started for the burst a while).
  EXPECT_LT(threads_peak.load(), threads_before + 1024 + 16);
  EXPECT_LT(threads_peak.load(), n);
  EXPECT_TRUE(WaitForLog(*daemon_, "(--stream-idle-seconds)", 5)) << daemon_->Log();
  // Idle streams cost nothing once cancelled: the flood's job still steps.
  EXPECT_TRUE(StepOnce(*client_, "flood", *flood_token).ok());
}

// WatchSession calls hold a server thread for their session's life: a flood of 200 watches of
// one valid session (the job's token and a live gRPC rank's session id) gets 1 per rank + 8 for
// the job (the client library's own watch is one of them), the rest RESOURCE_EXHAUSTED at once
// naming the bound; Health and the rank's steps keep working, and the watches end with the
// session.
TEST_F(HostileGrpcStreamsTest, SessionWatchFloodIsBounded) {
  ASSERT_NO_FATAL_FAILURE(Start({"--stream-idle-seconds", "60"}));
  auto token = client_->CreateJob(OneMatrixJob("watched"));
  ASSERT_TRUE(token.ok()) << token.status();
  auto session = client_->Attach("watched", 0, *token, false, client::Transport::kGrpc);
  ASSERT_TRUE(session.ok()) << session.status();
  const pid_t pid = daemon_->pid();
  const int threads_before = ThreadCount(pid);
  auto stub = Stub(daemon_->address());
  struct Watch {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::SessionEvent>> reader;
  };
  std::vector<std::unique_ptr<Watch>> watches;
  int admitted = 0, refused = 0;
  std::string refusal;
  for (int i = 0; i < 200; ++i) {
    auto w = std::make_unique<Watch>();
    w->ctx.AddMetadata("x-muond-job-token", *token);
    w->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::WatchSessionRequest req;
    req.set_job_id("watched");
    req.set_rank(0);
    req.set_session_id((*session)->session_id());
    w->reader = stub->WatchSession(&w->ctx, req);
    v1::SessionEvent event;
    if (w->reader->Read(&event)) {
      EXPECT_EQ(event.event(), "watching");
      ++admitted;
      watches.push_back(std::move(w));
      continue;
    }
    const grpc::Status st = w->reader->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    refusal = st.error_message();
    ++refused;
  }
  const int threads_during = ThreadCount(pid);
  const absl::Status health = client_->Health(5);
  auto updates = (*session)->StepTensors(0, {RefGrad("wide_std", 0, "w")});
  std::cout << "200 WatchSession calls on one session: " << admitted << " admitted, " << refused
            << " refused ('" << refusal << "'); daemon threads " << threads_before << " before, "
            << threads_during << " during\n";
  EXPECT_EQ(admitted, 1 + kSlack - 1) << "1 per rank + 8, less the client's own watch";
  EXPECT_EQ(refused, 200 - admitted);
  EXPECT_NE(refusal.find("WatchSession: job 'watched' holds 9 session watches, as many as a job "
                         "of 1 rank(s) may (1 per rank + 8)"),
            std::string::npos)
      << refusal;
  EXPECT_LT(threads_during, threads_before + 64) << "the refused watches held threads";
  EXPECT_TRUE(health.ok()) << health;
  EXPECT_TRUE(updates.ok()) << updates.status();
  // Detaching ends the session: every watch of it ends (OK, with the reason as its last event).
  ASSERT_TRUE((*session)->Detach().ok());
  for (auto& w : watches) {
    v1::SessionEvent event;
    while (w->reader->Read(&event)) {
    }
    const grpc::Status st = w->reader->Finish();
    EXPECT_TRUE(st.ok()) << st.error_message();
  }
}

// SIGTERM with idle streams open: the daemon exits at once, not after the grace period.
TEST_F(HostileGrpcStreamsTest, ShutdownCancelsIdleStreamsAtOnce) {
  ASSERT_NO_FATAL_FAILURE(
      Start({"--stream-idle-seconds", "600", "--shutdown-grace-seconds", "60"}));
  auto token = client_->CreateJob(OneMatrixJob("idle"));
  ASSERT_TRUE(token.ok()) << token.status();
  auto stub = Stub(daemon_->address());
  std::vector<std::unique_ptr<IdleStream>> idle;
  for (int i = 0; i < 8; ++i) {
    idle.push_back(OpenIdle(*stub, {{"x-muond-job-token", *token}}, 120));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto start = Clock::now();
  const int status = daemon_->Stop(90);
  const double seconds = SecondsSince(start);
  std::cout << "SIGTERM with 8 idle Step streams: exited after " << seconds << " s\n";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << DescribeWaitStatus(status);
  EXPECT_LT(seconds, 15) << "shutdown waited for idle streams";
  for (auto& s : idle) EXPECT_FALSE(s->stream->Finish().ok());
  daemon_.reset();
}

}  // namespace
}  // namespace muond::integration
