// Results are bit-identical across transports, the transport is chosen as documented, and the
// daemon's host copies are counted from the code path (issue 4).
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/layout.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"
#include "tests/shm/shm_test_util.h"

namespace muond::shmtest {
namespace {

using client::Transport;
using common::DType;
using integration::DaemonProcess;
using integration::DaemonSuite;
using integration::MakeGradients;
using integration::Matrix;
using integration::MixedMatrices;
using integration::SpansEqual;
using integration::TempDir;

constexpr int kSteps = 3;

std::string TransportName(Transport t) {
  return t == Transport::kShm ? "shm" : t == Transport::kGrpc ? "grpc" : "auto";
}

// Success when two trajectories hold the same bytes for every rank, step and span.
::testing::AssertionResult SameBytes(const Trajectory& got, const Trajectory& want) {
  if (got.updates.size() != want.updates.size()) {
    return ::testing::AssertionFailure() << got.updates.size() << " ranks vs " << want.updates.size();
  }
  for (size_t r = 0; r < got.updates.size(); ++r) {
    if (got.updates[r].size() != want.updates[r].size()) {
      return ::testing::AssertionFailure() << "rank " << r << ": " << got.updates[r].size()
                                           << " steps vs " << want.updates[r].size();
    }
    for (size_t t = 0; t < got.updates[r].size(); ++t) {
      for (size_t i = 0; i < want.updates[r][t].size(); ++i) {
        if (i >= got.updates[r][t].size() || got.updates[r][t][i] != want.updates[r][t][i]) {
          return ::testing::AssertionFailure()
                 << "rank " << r << " step " << t << " span " << i << " differs";
        }
      }
    }
  }
  return ::testing::AssertionSuccess();
}

class ShmTransportTest : public DaemonSuite {};

// The same multi-step trajectory through every client API over gRPC, over shared memory and
// through the zero-copy views, for a world-size-1 job (whole matrices; float32, bfloat16 and
// mixed dtypes) and a 2-rank ZeRO-2 job: every update byte is the same. The 2-rank updates also
// equal the whole-matrix ones (same backend).
TEST_F(ShmTransportTest, TrajectoriesAreBitIdenticalAcrossTransportsAndApis) {
  struct Config {
    std::string name;
    std::vector<common::MatrixSpec> matrices;
    bool uniform;
  };
  // "odd" makes the total element count odd: rank 1's ZeRO-2 partition ends in a padding
  // element, which the zero-copy path fills with NaN (the daemon must not read it).
  auto with_odd = [](DType dtype) {
    std::vector<common::MatrixSpec> m = MixedMatrices(dtype, dtype);
    m.push_back(Matrix("odd", {3, 5}, 1, dtype));
    return m;
  };
  const std::vector<Config> configs = {
      {"f32", with_odd(DType::kFloat32), true},
      {"bf16", with_odd(DType::kBFloat16), true},
      {"mixed", MixedMatrices(DType::kBFloat16, DType::kFloat32), false},
  };
  for (const Config& c : configs) {
    SCOPED_TRACE(c.name);
    const MatrixBytes grads = MakeGradients(c.matrices, kSteps, /*seed=*/41);
    // World size 1.
    std::vector<Api> ws1_apis = {Api::kGrpcStep, Api::kGrpcTensors, Api::kShmStep,
                                 Api::kShmTensors};
    if (c.uniform) {
      for (Api a : {Api::kGrpcBuffer, Api::kShmBuffer, Api::kZeroCopy}) ws1_apis.push_back(a);
    }
    Trajectory ws1_ref;
    for (size_t i = 0; i < ws1_apis.size(); ++i) {
      const Api api = ws1_apis[i];
      SCOPED_TRACE(absl::StrCat("world 1, ", ApiName(api)));
      auto run = RunTrajectory(client(), MakeSpec(NewJobId("ws1-" + c.name), 1, 0, c.matrices),
                               api, grads);
      ASSERT_TRUE(run.ok()) << run.status();
      EXPECT_EQ(TransportName(run->transport[0]), TransportName(ApiTransport(api)));
      ASSERT_EQ(run->updates[0].size(), static_cast<size_t>(kSteps));
      if (i == 0) {
        ws1_ref = *std::move(run);
        continue;
      }
      EXPECT_TRUE(SameBytes(*run, ws1_ref)) << ApiName(api) << " vs " << ApiName(ws1_apis[0]);
    }
    if (!c.uniform) continue;  // ZeRO 1/2 needs one dtype
    // World size 2, ZeRO stage 2: "big" straddles the partition boundary.
    Trajectory ws2_ref;
    const std::vector<Api> ws2_apis = {Api::kGrpcStep, Api::kGrpcBuffer, Api::kShmStep,
                                       Api::kShmBuffer, Api::kZeroCopy};
    for (size_t i = 0; i < ws2_apis.size(); ++i) {
      const Api api = ws2_apis[i];
      SCOPED_TRACE(absl::StrCat("world 2 ZeRO-2, ", ApiName(api)));
      const common::JobSpec spec = MakeSpec(NewJobId("ws2-" + c.name), 2, 2, c.matrices);
      auto run = RunTrajectory(client(), spec, api, grads);
      ASSERT_TRUE(run.ok()) << run.status();
      EXPECT_EQ(common::RankBufferElements(spec, 1), common::RankBufferElements(spec, 0));
      uint64_t rank1_elements = 0;
      for (const auto& span : run->layout[1]) rank1_elements += span.length;
      EXPECT_EQ(rank1_elements + 1, common::RankBufferElements(spec, 1)) << "one padding element";
      for (int r = 0; r < 2; ++r) {
        EXPECT_EQ(TransportName(run->transport[r]), TransportName(ApiTransport(api)));
        ASSERT_EQ(run->updates[r].size(), static_cast<size_t>(kSteps));
        for (int t = 0; t < kSteps; ++t) {
          // ws1_ref.updates[0][t] holds the whole matrices (one span per matrix).
          EXPECT_TRUE(SpansEqual(spec, run->layout[r], run->updates[r][t], ws1_ref.updates[0][t]))
              << "rank " << r << " step " << t << " vs the whole-matrix trajectory";
        }
      }
      if (i == 0) {
        ws2_ref = *std::move(run);
        continue;
      }
      EXPECT_TRUE(SameBytes(*run, ws2_ref)) << ApiName(api) << " vs " << ApiName(ws2_apis[0]);
    }
  }
}

// RankSession::transport() reports what the session uses; auto picks shared memory for a unix://
// daemon with its shm socket; the zero-copy views exist only on shared-memory sessions.
TEST_F(ShmTransportTest, TransportIsReportedAndAutoPicksSharedMemoryOnAUnixSocket) {
  const std::string id = NewJobId("transport");
  auto token = client().CreateJob(MakeSpec(id, 1, 0, {integration::Matrix("w", {8, 4})}));
  ASSERT_TRUE(token.ok()) << token.status();
  {
    auto s = client().Attach(id, 0, *token);  // Transport::kAuto
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(TransportName((*s)->transport()), "shm");
    auto view = (*s)->GradientView(0);
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(view->size, 8u * 4u * 4u);
    auto out = (*s)->UpdateView(1);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->size, view->size);
    EXPECT_NE(out->data, view->data);
  }
  {
    auto s = client().Attach(id, 0, *token, false, Transport::kShm);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(TransportName((*s)->transport()), "shm");
  }
  {
    auto s = client().Attach(id, 0, *token, false, Transport::kGrpc);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(TransportName((*s)->transport()), "grpc");
    auto view = (*s)->GradientView(0);
    EXPECT_EQ(view.status().code(), absl::StatusCode::kFailedPrecondition) << view.status();
    auto ring = (*s)->StepInPlace(0);
    EXPECT_EQ(ring.status().code(), absl::StatusCode::kFailedPrecondition) << ring.status();
  }
  // A wrong token over shared memory: the daemon's own error, no fallback to gRPC.
  auto bad = client().Attach(id, 0, "not-the-token", false, Transport::kAuto);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kPermissionDenied) << bad.status();
  ASSERT_TRUE(client().DeleteJob(id, *token).ok());
}

// The daemon's host-to-host copies on the data path (JobStatus.transport_copy_bytes): none for
// shared-memory steps (Step, StepBuffer or zero-copy); exactly the gradient bytes in plus the
// update bytes out for a gRPC step of the same job; a shared-memory replay of a step committed
// over gRPC copies the update once into the region. Switching transports mid-job keeps the
// trajectory bit-identical.
TEST_F(ShmTransportTest, HostCopiesAreCountedFromTheCodePath) {
  const std::vector<common::MatrixSpec> matrices = MixedMatrices(DType::kFloat32, DType::kFloat32);
  const int steps = 5;
  const MatrixBytes grads = MakeGradients(matrices, steps, /*seed=*/7);
  uint64_t total_bytes = 0;
  for (const auto& m : matrices) total_bytes += static_cast<uint64_t>(m.numel()) * 4;
  auto ref = RunTrajectory(client(), MakeSpec(NewJobId("copies-ref"), 2, 2, matrices),
                           Api::kGrpcStep, grads);
  ASSERT_TRUE(ref.ok()) << ref.status();

  const common::JobSpec spec = MakeSpec(NewJobId("copies"), 2, 2, matrices);
  auto token = client().CreateJob(spec);
  ASSERT_TRUE(token.ok()) << token.status();
  auto copies = [&]() -> uint64_t {
    auto st = client().GetJob(spec.job_id, *token);
    EXPECT_TRUE(st.ok()) << st.status();
    return st.ok() ? st->transport_copy_bytes() : ~uint64_t{0};
  };
  std::unique_ptr<client::RankSession> sessions[2];
  auto attach = [&](Transport t) {
    for (int r = 0; r < 2; ++r) {
      sessions[r].reset();
      auto s = client().Attach(spec.job_id, r, *token, false, t);
      ASSERT_TRUE(s.ok()) << s.status();
      sessions[r] = *std::move(s);
      ASSERT_EQ(TransportName(sessions[r]->transport()), TransportName(t));
    }
  };
  // Both ranks step `step` concurrently through `api`; the updates must equal the reference.
  auto step_all = [&](int64_t step, Api api) {
    auto got = StepAllRanks(client(), spec.job_id, *token, {sessions[0].get(), sessions[1].get()},
                            {api, api}, step, grads[step]);
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(got[r].ok()) << ApiName(api) << " rank " << r << ": " << got[r].status();
      EXPECT_EQ(*got[r], ref->updates[r][step]) << ApiName(api) << " rank " << r << " step " << step;
    }
  };

  attach(Transport::kShm);
  ASSERT_EQ(copies(), 0u);
  step_all(0, Api::kShmBuffer);
  EXPECT_EQ(copies(), 0u) << "shared-memory StepBuffer step";
  step_all(1, Api::kZeroCopy);
  EXPECT_EQ(copies(), 0u) << "zero-copy step";
  const uint64_t before_grpc = copies();

  attach(Transport::kGrpc);
  step_all(2, Api::kGrpcStep);
  const uint64_t grpc_delta = copies() - before_grpc;
  std::printf("host copies: gRPC step of %llu gradient + %llu update bytes -> %llu copied\n",
              static_cast<unsigned long long>(total_bytes),
              static_cast<unsigned long long>(total_bytes),
              static_cast<unsigned long long>(grpc_delta));
  EXPECT_EQ(grpc_delta, 2 * total_bytes) << "gradient bytes in + update bytes out";

  // Rank 0 comes back over shared memory and replays step 2 (committed over gRPC): the update is
  // copied once from the daemon's storage into the rank's update region.
  sessions[0].reset();
  {
    auto s = client().Attach(spec.job_id, 0, *token, false, Transport::kShm);
    ASSERT_TRUE(s.ok()) << s.status();
    sessions[0] = *std::move(s);
  }
  const uint64_t before_replay = copies();
  client::StepResult replay;
  auto replayed = StepWith(Api::kZeroCopy, *sessions[0], 2, grads[2], &replay);
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_TRUE(replay.replayed);
  EXPECT_EQ(*replayed, ref->updates[0][2]);
  uint64_t rank0_bytes = 0;
  for (const auto& span : ref->updates[0][2]) rank0_bytes += span.size();
  EXPECT_EQ(copies() - before_replay, rank0_bytes) << "the replay's copy into the region";

  // Back to shared memory for both: no copies, and the momentum was not applied twice.
  attach(Transport::kShm);
  const uint64_t before_shm = copies();
  step_all(3, Api::kShmStep);
  step_all(4, Api::kZeroCopy);
  EXPECT_EQ(copies(), before_shm) << "shared-memory steps after the switch";
  auto st = client().GetJob(spec.job_id, *token);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->steps_completed(), steps);
  EXPECT_EQ(st->next_step(), steps);
  EXPECT_FALSE(st->fenced());
  for (auto& s : sessions) s.reset();
  ASSERT_TRUE(client().DeleteJob(spec.job_id, *token).ok());
}

// Daemons without a usable shm socket: over TCP, Transport::kShm is FAILED_PRECONDITION and
// auto uses gRPC; a unix daemon started with --shm-socket off makes kShm UNAVAILABLE and auto
// falls back to gRPC. Their updates equal, bit for bit, those of a daemon stepped over shared
// memory.
TEST(ShmTransportFallbackTest, WithoutSharedMemoryAutoFallsBackToGrpcWithTheSameBytes) {
  const std::vector<common::MatrixSpec> matrices =
      MixedMatrices(DType::kBFloat16, DType::kBFloat16);
  const MatrixBytes grads = MakeGradients(matrices, 2, /*seed=*/99);

  TempDir tcp_dir, shm_dir, off_dir;
  auto tcp = DaemonProcess::Spawn({"--listen", "127.0.0.1:0", "--state-dir",
                                   tcp_dir.File("state"), "--threads", "1"},
                                  tcp_dir.File("muond.log"));
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  auto with_shm = DaemonProcess::StartIn(shm_dir.path());
  ASSERT_TRUE(with_shm.ok()) << with_shm.status();
  auto shm_off = DaemonProcess::StartIn(off_dir.path(), {"--shm-socket", "off"});
  ASSERT_TRUE(shm_off.ok()) << shm_off.status();
  // Port 0: the daemon logs the port it got.
  int port = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (port == 0 && std::chrono::steady_clock::now() < deadline && (*tcp)->running()) {
    const std::string log = (*tcp)->Log();
    const size_t at = log.find("(port ");
    if (at != std::string::npos) port = std::atoi(log.c_str() + at + 6);
    if (port == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_GT(port, 0) << "no port in the TCP daemon's log:\n" << (*tcp)->Log();
  const std::string tcp_address = absl::StrCat("127.0.0.1:", port);
  ASSERT_TRUE((*tcp)->WaitServing(tcp_address).ok()) << (*tcp)->Log();

  auto run = [&](const std::string& address, Transport t, const std::string& want_transport,
                 std::vector<std::vector<std::string>>* updates) {
    auto c = client::Client::Connect(address);
    ASSERT_TRUE(c.ok()) << c.status();
    const std::string id = absl::StrCat("fallback-", TransportName(t));
    auto token = (*c)->CreateJob(MakeSpec(id, 1, 0, matrices));
    ASSERT_TRUE(token.ok()) << token.status();
    auto s = (*c)->Attach(id, 0, *token, false, t);
    ASSERT_TRUE(s.ok()) << address << " " << TransportName(t) << ": " << s.status();
    EXPECT_EQ(TransportName((*s)->transport()), want_transport) << address;
    for (int64_t step = 0; step < 2; ++step) {
      auto u = integration::StepSpans(**s, step, grads[step]);
      ASSERT_TRUE(u.ok()) << u.status();
      updates->push_back(*std::move(u));
    }
    s->reset();
    ASSERT_TRUE((*c)->DeleteJob(id, *token).ok());
  };
  auto refuse = [&](const std::string& address, Transport t, absl::StatusCode code,
                    const std::string& text) {
    auto c = client::Client::Connect(address);
    ASSERT_TRUE(c.ok()) << c.status();
    auto token = (*c)->CreateJob(MakeSpec("refused", 1, 0, matrices));
    ASSERT_TRUE(token.ok()) << token.status();
    auto s = (*c)->Attach("refused", 0, *token, false, t);
    EXPECT_EQ(s.status().code(), code) << address << ": " << s.status();
    EXPECT_TRUE(absl::StrContains(s.status().message(), text)) << s.status();
    ASSERT_TRUE((*c)->DeleteJob("refused", *token).ok());
  };

  std::vector<std::vector<std::string>> via_shm, via_tcp, via_off;
  run((*with_shm)->address(), Transport::kShm, "shm", &via_shm);
  refuse(tcp_address, Transport::kShm, absl::StatusCode::kFailedPrecondition, "unix://");
  run(tcp_address, Transport::kAuto, "grpc", &via_tcp);
  refuse((*shm_off)->address(), Transport::kShm, absl::StatusCode::kUnavailable, ".shm");
  run((*shm_off)->address(), Transport::kAuto, "grpc", &via_off);
  ASSERT_EQ(via_shm.size(), 2u);
  EXPECT_EQ(via_tcp, via_shm) << "gRPC over TCP vs shared memory";
  EXPECT_EQ(via_off, via_shm) << "gRPC over a unix socket vs shared memory";

  for (auto* d : {&*tcp, &*with_shm, &*shm_off}) {
    const int status = (*d)->Stop();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << integration::DescribeWaitStatus(status) << "\n" << (*d)->Log();
  }
}

}  // namespace
}  // namespace muond::shmtest
