// An export whose client stops reading (issue 32, item 9): the daemon streams from a copy taken
// under the job's checkpoint lock, so the job's checkpoint save, reset and delete complete while
// the export is stalled, and the stalled export is cancelled after --stream-idle-seconds.
#include <dirent.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <chrono>
#include <future>
#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "muond/v1/muond.grpc.pb.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/hostile_util.h"

namespace muond::integration {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// 64 MiB of fp32 momentum: far more than gRPC and the socket buffer for a reader that reads
// nothing, so the daemon's writes block.
common::JobSpec BigJob(const std::string& id) {
  common::JobSpec spec;
  spec.job_id = id;
  common::MatrixSpec m;
  m.name = "w";
  m.shape = {4096, 4096};
  spec.matrices.push_back(m);
  return spec;
}

// Apply mode, the same 64 MiB of fp32 masters (one Muon tensor).
common::JobSpec BigApplyJob(const std::string& id) {
  common::JobSpec spec = BigJob(id);
  spec.mode = common::JobMode::kApply;
  spec.groups.push_back({"all", 0.01, 0});
  spec.matrices[0].group = "all";
  return spec;
}

// Bytes of the files in `dir` (what an export has written so far).
uint64_t BytesIn(const std::string& dir) {
  uint64_t total = 0;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return 0;
  while (dirent* e = ::readdir(d)) {
    struct stat st {};
    if (::stat((dir + "/" + e->d_name).c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      total += static_cast<uint64_t>(st.st_size);
    }
  }
  ::closedir(d);
  return total;
}

// `muonctl checkpoint export` of job `id`, frozen (SIGSTOP) once it has received some data: its
// process reads nothing more, not even from its socket, so the daemon's writes block on a full
// socket buffer. Null on failure (a test failure is recorded).
std::unique_ptr<ChildProcess> FrozenExport(const DaemonProcess& daemon, const std::string& id,
                                           const std::string& token, const std::string& dir) {
  auto child = ChildProcess::Start({MUONCTL_BIN, "--address", daemon.address(), "checkpoint",
                                    "export", "--job", id, "--dir", dir},
                                   {{"MUOND_JOB_TOKEN", token}});
  EXPECT_TRUE(child.ok()) << child.status();
  if (!child.ok()) return nullptr;
  const auto start = Clock::now();
  while (BytesIn(dir) < (uint64_t{1} << 20) && SecondsSince(start) < 20) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ::kill((*child)->pid(), SIGSTOP);
  EXPECT_GE(BytesIn(dir), uint64_t{1} << 20) << "the export never started";
  EXPECT_LT(BytesIn(dir), uint64_t{256} << 20) << "the export ended before it was frozen";
  return *std::move(child);
}

// A live ExportState whose client reads nothing.
struct StalledExport {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::ExportStateChunk>> reader;
};

std::unique_ptr<StalledExport> StartStalledExport(v1::Muond::Stub& stub, const std::string& id,
                                                  const std::string& token) {
  auto e = std::make_unique<StalledExport>();
  e->ctx.AddMetadata("x-muond-job-token", token);
  e->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  v1::ExportStateRequest req;
  req.set_job_id(id);
  e->reader = stub.ExportState(&e->ctx, req);
  return e;
}

// Runs `op` on a thread; its status, or DEADLINE_EXCEEDED when it did not end within `seconds`
// (then *stuck holds the future, to be waited for after the export is cancelled). *took gets the
// seconds it ran.
absl::Status Within(double seconds, std::function<absl::Status()> op, double* took,
                    std::future<absl::Status>* stuck) {
  const auto start = Clock::now();
  std::future<absl::Status> f = std::async(std::launch::async, std::move(op));
  if (f.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready) {
    *took = SecondsSince(start);
    *stuck = std::move(f);
    return absl::DeadlineExceededError(absl::StrCat("still running after ", seconds, " s"));
  }
  *took = SecondsSince(start);
  return f.get();
}

TEST(HostileGrpcExportTest, StalledExportBlocksNothingAndIsCancelled) {
  constexpr double kIdleSeconds = 12;
  TempDir dir;
  auto daemon = DaemonProcess::StartIn(dir.path(),
                                       {"--metrics-address", "off", "--stream-idle-seconds", "12"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto c = client::Client::Connect((*daemon)->address());
  ASSERT_TRUE(c.ok());
  client::Client& client = **c;
  auto token = client.CreateJob(BigJob("big"));
  ASSERT_TRUE(token.ok()) << token.status();
  auto stub = v1::Muond::NewStub(
      grpc::CreateChannel((*daemon)->address(), grpc::InsecureChannelCredentials()));

  auto stalled = StartStalledExport(*stub, "big", *token);
  const auto export_started = Clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(2));  // the daemon fills the pipe and blocks

  std::vector<std::future<absl::Status>> stuck(3);
  double save_s = 0, reset_s = 0, delete_s = 0;
  const absl::Status save = Within(
      6, [&] { return client.SaveCheckpoint("big", *token).status(); }, &save_s, &stuck[0]);
  const absl::Status reset = Within(
      6, [&] { return client.ResetJob("big", *token, 0); }, &reset_s, &stuck[1]);
  std::cout << "export of 64 MiB not read: save " << save << " in " << save_s << " s, reset "
            << reset << " in " << reset_s << " s\n";
  EXPECT_TRUE(save.ok()) << save;
  EXPECT_TRUE(reset.ok()) << reset;

  // The stalled export is cancelled after the idle limit; the client sees it end in error.
  EXPECT_TRUE(WaitForLog(**daemon, "(--stream-idle-seconds), e.g. ExportState of job 'big'",
                         kIdleSeconds + 10))
      << (*daemon)->Log();
  const double cancelled_after = SecondsSince(export_started);
  v1::ExportStateChunk chunk;
  while (stalled->reader->Read(&chunk)) {
  }
  const grpc::Status ended = stalled->reader->Finish();
  std::cout << "stalled export cancelled after " << cancelled_after << " s: " << ended.error_code()
            << " " << ended.error_message() << "\n";
  EXPECT_FALSE(ended.ok());
  EXPECT_GE(cancelled_after, kIdleSeconds - 1);

  // Delete while another export is stalled.
  const auto second_started = Clock::now();
  auto second = StartStalledExport(*stub, "big", *token);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const absl::Status deleted = Within(
      10, [&] { return client.DeleteJob("big", *token); }, &delete_s, &stuck[2]);
  std::cout << "delete with a stalled export: " << deleted << " in " << delete_s << " s\n";
  EXPECT_TRUE(deleted.ok()) << deleted;
  // Unblock whatever is still stuck (the test failed): end the exports, then wait.
  second->ctx.TryCancel();
  stalled->ctx.TryCancel();
  for (auto& f : stuck) {
    if (f.valid()) f.wait();
  }
  while (second->reader->Read(&chunk)) {
  }
  std::cout << "second export ended " << SecondsSince(second_started) << " s after it began\n";
  (void)second->reader->Finish();
  second.reset();
  stalled.reset();
  stub.reset();
  c->reset();
  const auto stopping = Clock::now();
  const int status = (*daemon)->Stop();
  std::cout << "stopped in " << SecondsSince(stopping) << " s\n";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << DescribeWaitStatus(status);
}

// The same for ExportParams (apply mode): a save and a reset complete while the export stalls, and
// the export is cancelled after the idle limit.
TEST(HostileGrpcExportTest, StalledExportParamsBlocksNothing) {
  TempDir dir;
  auto daemon = DaemonProcess::StartIn(dir.path(),
                                       {"--metrics-address", "off", "--stream-idle-seconds", "8"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto c = client::Client::Connect((*daemon)->address());
  ASSERT_TRUE(c.ok());
  client::Client& client = **c;
  auto token = client.CreateJob(BigApplyJob("bigp"));
  ASSERT_TRUE(token.ok()) << token.status();
  {
    auto session = client.Attach("bigp", 0, *token, false, client::Transport::kGrpc);
    ASSERT_TRUE(session.ok()) << session.status();
    client::NamedTensor w;
    w.name = "w";
    w.shape = {4096, 4096};
    w.data.assign(size_t{4096} * 4096 * sizeof(float), '\0');
    const absl::Status init = (*session)->InitParamsTensors({w});
    ASSERT_TRUE(init.ok()) << init;
  }
  auto stub = v1::Muond::NewStub(
      grpc::CreateChannel((*daemon)->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.AddMetadata("x-muond-job-token", *token);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  v1::ExportRequest req;
  req.set_job_id("bigp");
  req.set_dtype(v1::DTYPE_FLOAT32);
  auto reader = stub->ExportParams(&ctx, req);
  const auto export_started = Clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(2));

  std::vector<std::future<absl::Status>> stuck(2);
  double save_s = 0, reset_s = 0;
  const absl::Status save = Within(
      6, [&] { return client.SaveCheckpoint("bigp", *token).status(); }, &save_s, &stuck[0]);
  const absl::Status reset = Within(
      6, [&] { return client.ResetJob("bigp", *token, 0); }, &reset_s, &stuck[1]);
  std::cout << "ExportParams of 64 MiB not read: save " << save << " in " << save_s << " s, reset "
            << reset << " in " << reset_s << " s\n";
  EXPECT_TRUE(save.ok()) << save;
  EXPECT_TRUE(reset.ok()) << reset;
  EXPECT_TRUE(WaitForLog(**daemon, "(--stream-idle-seconds), e.g. ExportParams of job 'bigp'", 20))
      << (*daemon)->Log();
  EXPECT_GE(SecondsSince(export_started), 8 - 1);
  ctx.TryCancel();  // unblocks the daemon when the test failed
  for (auto& f : stuck) {
    if (f.valid()) f.wait();
  }
  v1::ExportChunk chunk;
  while (reader->Read(&chunk)) {
  }
  EXPECT_FALSE(reader->Finish().ok());
  c->reset();
  const int status = (*daemon)->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << DescribeWaitStatus(status);
}

// A client that reads nothing at all (its process frozen, its socket full): a cancelled Write
// does not end on cancellation alone, so the daemon closes the connection 2 s after it cancelled
// the stream (idle, or at shutdown); saves go on meanwhile, and SIGTERM is not held up.
TEST(HostileGrpcExportTest, FrozenClientIsCutOff) {
  TempDir dir;
  auto daemon = DaemonProcess::StartIn(dir.path(),
                                       {"--metrics-address", "off", "--stream-idle-seconds", "4"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto c = client::Client::Connect((*daemon)->address());
  ASSERT_TRUE(c.ok());
  common::JobSpec spec = BigJob("huge");
  spec.matrices[0].shape = {8192, 8192};  // 256 MiB
  auto token = (*c)->CreateJob(spec);
  ASSERT_TRUE(token.ok()) << token.status();

  auto frozen = FrozenExport(**daemon, "huge", *token, dir.File("out1"));
  ASSERT_NE(frozen, nullptr);
  std::vector<std::future<absl::Status>> stuck(1);
  double save_s = 0;
  const absl::Status save = Within(
      10, [&] { return (*c)->SaveCheckpoint("huge", *token).status(); }, &save_s, &stuck[0]);
  std::cout << "frozen client: save " << save << " in " << save_s << " s\n";
  EXPECT_TRUE(save.ok()) << save;
  EXPECT_TRUE(WaitForLog(**daemon, "after it was cancelled: closed its connection", 15))
      << (*daemon)->Log();
  ::kill(frozen->pid(), SIGCONT);
  const int export_status = frozen->Kill(SIGCONT);  // waits for it to end
  EXPECT_TRUE(WIFEXITED(export_status) && WEXITSTATUS(export_status) != 0)
      << DescribeWaitStatus(export_status) << frozen->Err();
  for (auto& f : stuck) {
    if (f.valid()) f.wait();
  }

  // Frozen again, then SIGTERM before the idle limit: shutdown cancels the stream and closes its
  // connection, and the daemon exits.
  auto again = FrozenExport(**daemon, "huge", *token, dir.File("out2"));
  ASSERT_NE(again, nullptr);
  c->reset();
  const auto stopping = Clock::now();
  const int status = (*daemon)->Stop(30);
  const double stop_s = SecondsSince(stopping);
  std::cout << "SIGTERM with a frozen export: exited after " << stop_s << " s\n";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << DescribeWaitStatus(status);
  // Not forever (without closing the connection, gRPC's shutdown waits for the blocked Write);
  // at exit gRPC may wait out its TCP backup poller, started by the blocked write (10 s).
  EXPECT_LT(stop_s, 20) << (*daemon)->Log();
  ::kill(again->pid(), SIGCONT);
  (void)again->Kill(SIGCONT);
}

}  // namespace
}  // namespace muond::integration
