// The step pipeline through real daemons (issue 5, "Step pipeline" and "Tests"): each test starts
// its own muond(s) with the backend flags it needs.
//  - results are bit-identical between the pipelined and the forced serial schedule, and between
//    the cpu and the simulated backend, for a multi-matrix, multi-step, two-rank job whose small
//    gather budget keeps several batches in flight;
//  - on the simulated device, with copy and compute times of the same order, a step takes at most
//    1.15 x its largest stage (total copy-in, compute, writeback; computed here from the model),
//    clearly less than their sum, which the serial schedule takes; asserted on the simulated
//    device's own clock (JobStatus.last_step_device_seconds), never on wall-clock time;
//  - an injected kernel failure (--sim-fail-kernel) fails exactly that job's step with INTERNAL
//    naming it, without fencing; the retry and another job are unaffected;
//  - JobStatus.backend and `muonctl job show` say which backend.
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"

namespace muond::integration {
namespace {

using common::DType;

// One muond with extra flags in its own directory; stopped (and its exit checked) on destruction.
struct Daemon {
  std::unique_ptr<TempDir> dir;
  std::unique_ptr<DaemonProcess> process;
  std::unique_ptr<client::Client> client;
  std::string address() const { return process->address(); }
  ~Daemon() {
    if (process != nullptr && process->running()) {
      const int status = process->Stop();
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
          << DescribeWaitStatus(status) << "\n"
          << process->Log();
    }
  }
};

std::unique_ptr<Daemon> Start(const std::vector<std::string>& flags) {
  auto d = std::make_unique<Daemon>();
  d->dir = std::make_unique<TempDir>();
  auto p = DaemonProcess::StartIn(d->dir->path(), flags);
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return nullptr;
  d->process = *std::move(p);
  auto c = client::Client::Connect(d->process->address());
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return nullptr;
  d->client = *std::move(c);
  return d;
}

// Per step, per rank: the update spans' bytes.
using Trajectory = std::vector<std::vector<std::vector<std::string>>>;

// Runs `grads` through a new job `spec` on `d` with all its ranks at once; fills the job's status.
Trajectory RunJob(Daemon& d, const common::JobSpec& spec, const MatrixBytes& grads, bool use_buffer,
                  v1::JobStatus* status) {
  auto token = d.client->CreateJob(spec);
  EXPECT_TRUE(token.ok()) << token.status();
  if (!token.ok()) return {};
  std::vector<RankRun> runs =
      RunRanks(d.address(), spec.job_id, *token, spec.world_size, grads, use_buffer);
  Trajectory t(grads.size(), std::vector<std::vector<std::string>>(spec.world_size));
  for (int r = 0; r < spec.world_size; ++r) {
    EXPECT_EQ(runs[r].status.size(), grads.size()) << "rank " << r;
    for (size_t i = 0; i < runs[r].status.size(); ++i) {
      EXPECT_TRUE(runs[r].status[i].ok())
          << "rank " << r << " step " << i << ": " << runs[r].status[i];
    }
    for (size_t i = 0; i < runs[r].spans.size(); ++i) t[i][r] = runs[r].spans[i];
  }
  auto st = d.client->GetJob(spec.job_id, *token);
  EXPECT_TRUE(st.ok()) << st.status();
  if (st.ok()) *status = *st;
  return t;
}

// The simulated device's parameters for the overlap tests: per [64, 256] fp32 matrix, copy-in
// (gradient + momentum, 2 x 64 KiB at 0.5 GB/s + 2 x 10 us) 0.282 ms, Newton-Schulz (5 x
// (4 m^2 n + 2 m^3) = 23.6 MFLOP at 100 GFLOP/s) 0.236 ms, writeback (64 KiB) 0.141 ms.
constexpr double kCopyGbps = 0.5;
constexpr double kLatencyUs = 10;
constexpr double kGflops = 100;

std::vector<std::string> SimFlags() {
  return {"--backend",
          "simulated",
          "--sim-copy-gbps",
          absl::StrCat(kCopyGbps),
          "--sim-copy-latency-us",
          absl::StrCat(kLatencyUs),
          "--sim-compute-gflops",
          absl::StrCat(kGflops)};
}

std::vector<std::string> With(std::vector<std::string> flags,
                              const std::vector<std::string>& more) {
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}

// The modelled stage totals of one step (device.h's cost model, computed independently here).
struct Stages {
  double copy_in = 0, compute = 0, writeback = 0;
  double max() const { return std::max({copy_in, compute, writeback}); }
  double sum() const { return copy_in + compute + writeback; }
};

Stages ModelStages(const common::JobSpec& spec) {
  Stages s;
  auto copy = [](double bytes) { return kLatencyUs * 1e-6 + bytes / (kCopyGbps * 1e9); };
  for (const common::MatrixSpec& m : spec.matrices) {
    const double bytes = 4.0 * static_cast<double>(m.numel());  // fp32 on the device
    s.copy_in += 2 * copy(bytes);                               // gradient and momentum
    s.writeback += 2 * copy(bytes);  // the update and the new momentum (update mode)
    // Blocks of rows x cols (2-D, heads: rows / H; 3-D: E blocks).
    const size_t d = m.shape.size();
    double batch = static_cast<double>(m.num_heads);
    double rows = static_cast<double>(d == 3 ? m.shape[1] : m.shape[0]) / m.num_heads;
    double cols = static_cast<double>(m.shape[d - 1]);
    if (d == 3) batch *= static_cast<double>(m.shape[0]);
    if (d == 4) cols = static_cast<double>(m.shape[1] * m.shape[2] * m.shape[3]);
    const double a = std::min(rows, cols), b = std::max(rows, cols);
    s.compute += batch * spec.muon.ns_steps * (4 * a * a * b + 2 * a * a * a) / (kGflops * 1e9);
  }
  return s;
}

class PipelineTest : public testing::Test {};

// Bit-identical results across schedules and host backends, with several batches in flight.
TEST_F(PipelineTest, PipelinedSerialCpuAndSimulatedAreBitIdentical) {
  common::JobSpec spec;
  spec.job_id = "pipeline-equal";
  spec.world_size = 2;
  spec.zero_stage = 3;  // every matrix split over both ranks (stage 1/2 want one dtype)
  spec.matrices = MixedMatrices(DType::kFloat32, DType::kBFloat16);
  for (int i = 0; i < 6; ++i) {
    spec.matrices.push_back(Matrix(absl::StrCat("extra", i), {24 + 8 * i, 40}, 1,
                                   i % 2 ? DType::kBFloat16 : DType::kFloat32));
  }
  spec.matrices.push_back(Matrix("conv", {16, 4, 3, 3}));
  // 48 KiB: batches of <= 16 KiB (about one matrix each; "big" [64, 96] = 48 KiB of fp32 gradient
  // and momentum goes alone), up to three in flight.
  spec.gather_budget_bytes = 48 << 10;
  const MatrixBytes grads = MakeGradients(spec.matrices, 4, /*seed=*/505);

  struct Variant {
    const char* name;
    std::vector<std::string> flags;
  };
  const std::vector<Variant> variants = {
      {"cpu pipelined", {"--backend", "cpu"}},
      {"cpu serial", {"--backend", "cpu", "--serial-schedule", "true"}},
      {"simulated pipelined", SimFlags()},
      {"simulated serial", With(SimFlags(), {"--serial-schedule", "true"})},
  };
  Trajectory first;
  std::vector<double> device_seconds;  // per variant, of the last step
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    auto d = Start(v.flags);
    ASSERT_NE(d, nullptr);
    v1::JobStatus st;
    Trajectory t = RunJob(*d, spec, grads, /*use_buffer=*/false, &st);
    ASSERT_FALSE(HasFailure());
    EXPECT_EQ(st.steps_completed(), 4);
    EXPECT_FALSE(st.fenced());
    EXPECT_LE(st.gather_peak_bytes(), spec.gather_budget_bytes);
    device_seconds.push_back(st.last_step_device_seconds());
    std::printf("%s: gather peak %llu of %llu bytes, simulated step %.3f ms\n", v.name,
                static_cast<unsigned long long>(st.gather_peak_bytes()),
                static_cast<unsigned long long>(spec.gather_budget_bytes),
                st.last_step_device_seconds() * 1e3);
    if (first.empty()) {
      first = t;
      continue;
    }
    ASSERT_EQ(t.size(), first.size());
    for (size_t step = 0; step < t.size(); ++step) {
      for (int r = 0; r < spec.world_size; ++r) {
        EXPECT_TRUE(t[step][r] == first[step][r])
            << "step " << step << " rank " << r << " differs from cpu pipelined";
      }
    }
  }
  // Several batches were in flight: the pipelined simulated step overlapped (the serial one is
  // the sum of its stages); the cpu backend has no clock.
  ASSERT_EQ(device_seconds.size(), 4u);
  EXPECT_EQ(device_seconds[0], 0.0);
  EXPECT_EQ(device_seconds[1], 0.0);
  EXPECT_GT(device_seconds[3], 0.0);
  EXPECT_LT(device_seconds[2], 0.9 * device_seconds[3]);
}

// The overlap on the simulated clock, and the serial schedule's sum of stages.
TEST_F(PipelineTest, SimulatedStepOverlapsItsStages) {
  common::JobSpec spec;
  spec.job_id = "pipeline-overlap";
  for (int i = 0; i < 36; ++i) spec.matrices.push_back(Matrix(absl::StrCat("w", i), {64, 256}));
  // Two matrices (2 x 128 KiB of gradient + momentum) per batch, three batches in flight.
  spec.gather_budget_bytes = 3 * 2 * (128 << 10);
  const MatrixBytes grads = MakeGradients(spec.matrices, 3, /*seed=*/9);
  const Stages model = ModelStages(spec);

  double seconds[2] = {0, 0};
  Trajectory results[2];
  for (int serial = 0; serial < 2; ++serial) {
    SCOPED_TRACE(serial ? "serial" : "pipelined");
    auto d = Start(serial ? With(SimFlags(), {"--serial-schedule", "true"}) : SimFlags());
    ASSERT_NE(d, nullptr);
    auto token = d->client->CreateJob(spec);
    ASSERT_TRUE(token.ok()) << token.status();
    // Shared memory: the step's matrices become ready at once, so one drain schedules them all.
    auto session = d->client->Attach(spec.job_id, 0, *token, false, client::Transport::kShm);
    ASSERT_TRUE(session.ok()) << session.status();
    std::vector<double> per_step;
    for (int64_t step = 0; step < 3; ++step) {
      auto u = StepFlatBuffer(**session, step, grads[step]);
      ASSERT_TRUE(u.ok()) << u.status();
      results[serial].push_back({*u});
      auto st = d->client->GetJob(spec.job_id, *token);
      ASSERT_TRUE(st.ok()) << st.status();
      EXPECT_EQ(st->backend().rfind("simulated", 0), 0u) << st->backend();
      per_step.push_back(st->last_step_device_seconds());
    }
    // The model is deterministic: every step costs the same.
    for (double s : per_step) EXPECT_NEAR(s, per_step[0], 1e-9 * per_step[0]);
    seconds[serial] = per_step[0];
  }
  const double pipelined = seconds[0], serial = seconds[1];
  std::printf(
      "simulated step: copy-in %.3f ms, compute %.3f ms, writeback %.3f ms (sum %.3f, max %.3f); "
      "pipelined %.3f ms = %.3f x max = %.3f x sum; serial %.3f ms = %.4f x sum\n",
      model.copy_in * 1e3, model.compute * 1e3, model.writeback * 1e3, model.sum() * 1e3,
      model.max() * 1e3, pipelined * 1e3, pipelined / model.max(), pipelined / model.sum(),
      serial * 1e3, serial / model.sum());
  // Copy and compute are of the same order (the test is about overlap, not one dominant stage).
  EXPECT_LT(model.max() / std::min({model.copy_in, model.compute, model.writeback}), 2.5);
  EXPECT_GE(pipelined, model.max() * (1 - 1e-9));
  EXPECT_LE(pipelined, 1.15 * model.max());
  EXPECT_LT(pipelined, 0.6 * model.sum());
  EXPECT_NEAR(serial, model.sum(), 1e-9 * model.sum()) << "the serial schedule must not overlap";
  EXPECT_TRUE(results[0] == results[1]) << "pipelined and serial updates differ";
}

// --sim-fail-kernel N: kernels are counted across the daemon. Each matrix fills a batch (the
// budget is three matrices), so a step of job A is 4 kernels: step 0 = kernels 1-4, the first try
// of step 1 = kernels 5-8 of which 6 fails. The victim's chunks arrive over gRPC: when kernel 6
// runs before the step is sealed (its last chunk in), the failed step wrote only its step window
// and is refused, the state unchanged; when it runs after, the state was partly updated in place
// and the job is fenced, saying so, and its checkpoint of step 0 brings it back (README "Memory",
// "One copy of the state"). Either way the retry equals an undisturbed job's step.
TEST_F(PipelineTest, InjectedDeviceErrorFailsOnlyThatStep) {
  auto d = Start(With(SimFlags(), {"--sim-fail-kernel", "6"}));
  ASSERT_NE(d, nullptr);
  auto make = [](const std::string& id) {
    common::JobSpec spec;
    spec.job_id = id;
    for (int i = 0; i < 4; ++i) spec.matrices.push_back(Matrix(absl::StrCat("m", i), {32, 48}));
    spec.gather_budget_bytes = 3 * 2 * 4 * 32 * 48;
    return spec;
  };
  const common::JobSpec a = make("victim"), b = make("bystander");
  const MatrixBytes grads = MakeGradients(a.matrices, 2, /*seed=*/77);
  auto ta = d->client->CreateJob(a);
  auto tb = d->client->CreateJob(b);
  ASSERT_TRUE(ta.ok() && tb.ok());
  // The victim on gRPC (matrices become ready chunk by chunk), the bystander on shared memory.
  auto sa = d->client->Attach(a.job_id, 0, *ta, false, client::Transport::kGrpc);
  auto sb = d->client->Attach(b.job_id, 0, *tb, false, client::Transport::kShm);
  ASSERT_TRUE(sa.ok() && sb.ok());

  ASSERT_TRUE(StepFlatBuffer(**sa, 0, grads[0]).ok());  // kernels 1-4
  ASSERT_TRUE(d->client->SaveCheckpoint(a.job_id, *ta).ok());
  auto failed = StepFlatBuffer(**sa, 1, grads[1]);      // kernels 5-8: 6 fails
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
  const std::string msg(failed.status().message());
  EXPECT_NE(msg.find("injected kernel failure"), std::string::npos) << msg;
  EXPECT_NE(msg.find("victim"), std::string::npos) << msg;
  EXPECT_NE(msg.find("step 1"), std::string::npos) << msg;

  auto st = d->client->GetJob(a.job_id, *ta);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->steps_completed(), 1);
  EXPECT_EQ(st->next_step(), 1);
  if (st->fenced()) {
    EXPECT_NE(msg.find("partly updated in place"), std::string::npos) << msg;
    EXPECT_EQ(st->steps_aborted(), 1);
    ASSERT_TRUE(d->client->LoadCheckpoint(a.job_id, *ta, 0, -1).ok());
    std::printf("the kernel failed after the seal: fenced, reloaded step 0's checkpoint\n");
  } else {
    EXPECT_EQ(st->steps_refused(), 1);
    std::printf("the kernel failed before the seal: refused, state unchanged\n");
  }

  // The retry works, and the other job (stepped after) computes exactly the same updates: the
  // failed step left the victim's momentum as committed at step 0.
  auto retry = StepFlatBuffer(**sa, 1, grads[1]);
  ASSERT_TRUE(retry.ok()) << retry.status();
  auto b0 = StepFlatBuffer(**sb, 0, grads[0]);
  auto b1 = StepFlatBuffer(**sb, 1, grads[1]);
  ASSERT_TRUE(b0.ok() && b1.ok()) << b0.status() << " / " << b1.status();
  EXPECT_TRUE(*retry == *b1) << "the retried step differs from an undisturbed job's step";
  st = d->client->GetJob(a.job_id, *ta);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->steps_completed(), 2);
  EXPECT_FALSE(st->fenced());
  auto sbst = d->client->GetJob(b.job_id, *tb);
  ASSERT_TRUE(sbst.ok());
  EXPECT_EQ(sbst->steps_refused(), 0);
  EXPECT_EQ(sbst->steps_completed(), 2);
  EXPECT_TRUE(d->client->Health().ok());
  EXPECT_NE(d->process->Log().find("injected kernel failure"), std::string::npos);
}

TEST_F(PipelineTest, JobStatusAndMuonctlSayWhichBackend) {
  for (const char* backend : {"cpu", "simulated"}) {
    SCOPED_TRACE(backend);
    auto d = Start({"--backend", backend});
    ASSERT_NE(d, nullptr);
    common::JobSpec spec;
    spec.job_id = absl::StrCat("which-", backend);
    spec.matrices = {Matrix("w", {8, 16})};
    auto token = d->client->CreateJob(spec);
    ASSERT_TRUE(token.ok());
    auto st = d->client->GetJob(spec.job_id, *token);
    ASSERT_TRUE(st.ok());
    // The job status names the backend (possibly followed by why: "cpu (asked for)"); the log
    // says which and why.
    EXPECT_EQ(st->backend().rfind(backend, 0), 0u) << st->backend();
    const ProcessResult show = RunMuonctl(d->address(), {"job", "show", "--job", spec.job_id},
                                          {{"MUOND_JOB_TOKEN", *token}});
    EXPECT_EQ(show.exit_code, 0) << show.err;
    EXPECT_NE(show.out.find(absl::StrCat("backend: ", backend)), std::string::npos) << show.out;
    const std::string why = absl::StrCat("backend ", backend, " (asked for");
    EXPECT_NE(d->process->Log().find(why), std::string::npos) << d->process->Log();
  }
}

}  // namespace
}  // namespace muond::integration
