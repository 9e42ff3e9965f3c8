// Direct copies between the ranks' shared-memory regions and the device (server/jobs/
// step_pipeline.h, "Direct copies"; server/api/shm_attach.cc RegisterWithDevice):
//  - everywhere, on the simulated device's direct mode (host memory standing in for device
//    memory, SimulatedOptions::direct_host_copies): a daemon's steps copy every span straight
//    between the registered regions and the device, widen and narrow there, and return the same
//    bytes as the cpu backend's staged path; a registration the device refuses falls back to the
//    staged path (counted, same bytes); Stream::Convert rounds as the host; registered ranges are
//    tracked and released; apply mode's Muon tensors go direct in (widened and scaled on the
//    device, momentum written back from it) with the staged path's bytes, their updates back to
//    staging registered once pooled;
//  - with a CUDA or Level Zero device (CudaDirectCopyTest, LevelZeroDirectCopyTest, skipped with
//    the reason where there is none; none where this was written, so these did not run here): a
//    memfd region registered with the device (cudaHostRegister; zexDriverImportExternalPointer)
//    is copied in place; the Convert kernels match the host bit for bit; steps with registered
//    regions match the same backend's staged steps bit for bit (update and apply mode); and on
//    CUDA the pinned copy rates and a step's time against the PCIe floor, printed
//    (tests/gpu/run.sh greps them).
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/shm_region.h"
#include "gtest/gtest.h"
#include "server/device/device.h"
#include "tests/gpu/direct_copy_daemon.h"

namespace muond::server::testing_direct {
namespace {

using device::Device;
using device::DeviceBuffer;
using device::HostRegistration;
using device::SimulatedOptions;
using device::Stream;

// ZeRO-1: one bf16 partition per rank, its spans crossing matrix boundaries. ZeRO-3: every matrix
// split over both ranks, mixed dtypes (bf16, fp16 and fp32 gradients), per-head Muon.
constexpr char kZero1Job[] = R"({"job_id": "zero1", "world_size": 2, "zero_stage": 1,
  "matrices": [{"name": "q", "shape": [64, 96], "dtype": "bfloat16"},
               {"name": "k", "shape": [96, 64], "dtype": "bfloat16"},
               {"name": "o", "shape": [48, 80], "dtype": "bfloat16"}]})";
constexpr char kZero3Job[] = R"({"job_id": "zero3", "world_size": 2, "zero_stage": 3,
  "matrices": [{"name": "a", "shape": [64, 96], "dtype": "bfloat16"},
               {"name": "b", "shape": [80, 48], "dtype": "float16"},
               {"name": "c", "shape": [40, 72], "dtype": "float32", "num_heads": 2}]})";
// Gradient bytes of one step of both jobs (each also comes back as the update).
constexpr double kStepBytes =
    (64 * 96 + 96 * 64 + 48 * 80) * 2.0 + 64 * 96 * 2 + 80 * 48 * 2 + 40 * 72 * 4;
constexpr int kSteps = 3;

std::unique_ptr<Device> HostDevice(bool simulated, bool direct, bool fail_register = false) {
  SimulatedOptions sim;
  sim.direct_host_copies = direct;
  sim.fail_register = fail_register;
  return device::NewHostDevice(2, simulated ? &sim : nullptr);
}

// Both jobs' updates over kSteps steps on a daemon around `device`.
std::vector<StepResults> RunJobs(std::unique_ptr<Device> device, bool register_with_device) {
  std::vector<StepResults> out;
  auto daemon = InProcessDaemon::Start(std::move(device), register_with_device);
  EXPECT_TRUE(daemon.ok()) << daemon.status();
  if (!daemon.ok()) return out;
  for (const char* json : {kZero1Job, kZero3Job}) {
    auto token = (*daemon)->CreateJob(json);
    EXPECT_TRUE(token.ok()) << token.status();
    if (!token.ok()) return out;
    const std::string id = json == kZero1Job ? "zero1" : "zero3";
    auto run = RunSteps((*daemon)->shm_path(), id, *token, kSteps, 7);
    EXPECT_TRUE(run.ok()) << run.status();
    if (!run.ok()) return out;
    out.push_back(*std::move(run));
  }
  return out;
}

void ExpectSameUpdates(const std::vector<StepResults>& a, const std::vector<StepResults>& b) {
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  for (size_t job = 0; job < 2; ++job) {
    ASSERT_EQ(a[job].updates.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(b[job].updates.size(), static_cast<size_t>(kSteps));
    for (int t = 0; t < kSteps; ++t) {
      for (size_t r = 0; r < a[job].updates[t].size(); ++r) {
        const std::string& x = a[job].updates[t][r];
        EXPECT_FALSE(x.empty());
        EXPECT_NE(x, std::string(x.size(), '\0')) << "job " << job << " step " << t;
        EXPECT_TRUE(x == b[job].updates[t][r]) << "job " << job << " step " << t << " rank " << r;
      }
    }
  }
}

double CopyBytes(const char* path, const char* direction) {
  return MetricValue("muond_step_copy_bytes_total", {{"path", path}, {"direction", direction}});
}
double Registrations(const char* result) {
  return MetricValue("muond_shm_device_registrations_total", {{"result", result}});
}

TEST(DirectCopySimulatedTest, StepsGoDirectAndMatchTheCpuStagedPathBitForBit) {
  const std::vector<StepResults> staged = RunJobs(HostDevice(false, false), true);
  const double direct_in = CopyBytes("direct", "to_device");
  const double direct_out = CopyBytes("direct", "to_host");
  const double staged_in = CopyBytes("staged", "to_device");
  const double registered = Registrations("registered");
  const std::vector<StepResults> direct = RunJobs(HostDevice(true, true), true);
  ExpectSameUpdates(staged, direct);
  // Every gradient span went straight in, every update span straight out; nothing staged.
  EXPECT_EQ(CopyBytes("direct", "to_device") - direct_in, kSteps * kStepBytes);
  EXPECT_EQ(CopyBytes("direct", "to_host") - direct_out, kSteps * kStepBytes);
  EXPECT_EQ(CopyBytes("staged", "to_device") - staged_in, 0);
  EXPECT_EQ(Registrations("registered") - registered, 4);  // 2 jobs x 2 ranks
}

TEST(DirectCopySimulatedTest, RegistrationRefusedFallsBackToStagingWithTheSameBytes) {
  const std::vector<StepResults> cpu = RunJobs(HostDevice(false, false), true);
  const double direct_in = CopyBytes("direct", "to_device");
  const double staged_in = CopyBytes("staged", "to_device");
  const double failed = Registrations("failed");
  const std::vector<StepResults> refused = RunJobs(HostDevice(true, true, true), true);
  ExpectSameUpdates(cpu, refused);
  EXPECT_EQ(Registrations("failed") - failed, 4);
  EXPECT_EQ(CopyBytes("direct", "to_device") - direct_in, 0);
  EXPECT_GT(CopyBytes("staged", "to_device") - staged_in, 0);
  // Registration turned off: staged as well, nothing counted as failed.
  const double failed_before_off = Registrations("failed");
  ExpectSameUpdates(cpu, RunJobs(HostDevice(true, true), false));
  EXPECT_EQ(Registrations("failed"), failed_before_off);
}

// Apply mode: its Muon tensors go direct too. Each rank's gradient is copied straight from its
// registered region and widened and scaled (divisor, clip coefficient) on the device, which
// writes the new momentum back to the store; the host only reads the raw gradient for the norm
// and the checks (StepPipeline ReadDirectGradient), and the update comes back to the host's
// staging (registered once pooled: DMA from the second step) where the masters are applied.
// AdamW tensors stay on the host. The same bytes as the staged path, with a divisor and with
// global clipping (the redo recomputes from the same front).
constexpr char kApplyJob[] = R"({"job_id": "apply", "mode": "apply", "world_size": 2,
  "zero_stage": 3,
  "tensors": [{"name": "a", "shape": [64, 96], "dtype": "bfloat16", "param_dtype": "bfloat16",
               "optimizer": "muon", "group": "matrices"},
              {"name": "n", "shape": [96], "dtype": "float32", "optimizer": "adamw",
               "group": "vectors"},
              {"name": "c", "shape": [40, 72], "dtype": "float32", "optimizer": "muon",
               "group": "matrices"}],
  "groups": [{"name": "matrices", "lr": 0.02, "weight_decay": 0.1},
             {"name": "vectors", "lr": 0.01, "weight_decay": 0.0}],
  "adamw": {"betas": [0.9, 0.95], "eps": 1e-8}MAX_GRAD_NORM})";
constexpr double kApplyMuonBytes = (64 * 96 + 40 * 72) * 4.0;        // fp32 update per step
constexpr double kApplyMuonGradBytes = 64 * 96 * 2 + 40 * 72 * 4.0;  // raw gradients per step

StepResults RunApply(std::unique_ptr<Device> device, double divisor = 1.0, double max_grad_norm = 0,
                     bool register_with_device = true) {
  auto daemon = InProcessDaemon::Start(std::move(device), register_with_device);
  EXPECT_TRUE(daemon.ok()) << daemon.status();
  if (!daemon.ok()) return {};
  std::string json = kApplyJob;
  json.replace(json.find("MAX_GRAD_NORM"), 13,
               max_grad_norm > 0 ? absl::StrCat(", \"max_grad_norm\": ", max_grad_norm) : "");
  auto token = (*daemon)->CreateJob(json);
  EXPECT_TRUE(token.ok()) << token.status();
  if (!token.ok()) return {};
  auto run = RunSteps((*daemon)->shm_path(), "apply", *token, kSteps, 11, divisor);
  EXPECT_TRUE(run.ok()) << run.status();
  return run.ok() ? *std::move(run) : StepResults{};
}

bool CanLockStaging() {
  // The simulated device registers host memory with mlock: a process that may not lock its
  // staging (RLIMIT_MEMLOCK) cannot run these.
  std::vector<char> probe(size_t{256} << 10);
  if (mlock(probe.data(), probe.size()) != 0) return false;
  munlock(probe.data(), probe.size());
  return true;
}

void ExpectSameApplyUpdates(const StepResults& staged, const StepResults& direct) {
  ASSERT_EQ(staged.updates.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(direct.updates.size(), static_cast<size_t>(kSteps));
  for (int t = 0; t < kSteps; ++t) {
    for (size_t r = 0; r < 2; ++r) {
      EXPECT_FALSE(staged.updates[t][r].empty());
      EXPECT_TRUE(staged.updates[t][r] == direct.updates[t][r]) << "step " << t << " rank " << r;
    }
  }
}

TEST(DirectCopySimulatedTest, ApplyModeMuonTensorsGoDirectWithTheStagedPathsBytes) {
  if (!CanLockStaging()) {
    GTEST_SKIP() << "mlock of 256 KiB refused (" << std::strerror(errno)
                 << "): the simulated device cannot register the staging buffers";
  }
  const StepResults staged = RunApply(HostDevice(true, false));
  const double direct_in = CopyBytes("direct", "to_device");
  const double staged_in = CopyBytes("staged", "to_device");
  const double pinned_in = CopyBytes("pinned_staging", "to_device");
  const double staged_out = CopyBytes("staged", "to_host");
  const double pinned_out = CopyBytes("pinned_staging", "to_host");
  const StepResults direct = RunApply(HostDevice(true, true));
  ExpectSameApplyUpdates(staged, direct);
  // Every Muon gradient byte went straight in, as it came (bf16 stays 2 bytes); nothing was
  // staged in; the updates came back to fresh staging at step 0, then to registered staging.
  EXPECT_EQ(CopyBytes("direct", "to_device") - direct_in, kSteps * kApplyMuonGradBytes);
  EXPECT_EQ(CopyBytes("staged", "to_device") - staged_in, 0);
  EXPECT_EQ(CopyBytes("pinned_staging", "to_device") - pinned_in, 0);
  EXPECT_EQ(CopyBytes("staged", "to_host") - staged_out, kApplyMuonBytes);
  EXPECT_EQ(CopyBytes("pinned_staging", "to_host") - pinned_out, (kSteps - 1) * kApplyMuonBytes);
}

TEST(DirectCopySimulatedTest, ApplyModeDirectScalesAndClipsAsTheStagedPath) {
  if (!CanLockStaging()) {
    GTEST_SKIP() << "mlock of 256 KiB refused (" << std::strerror(errno)
                 << "): the simulated device cannot register the staging buffers";
  }
  // A divisor that changes every step (the gradients are scaled on the device: unscaled, the
  // momentum would weigh the steps otherwise) and a clip that triggers every step (decided at the
  // seal; the tensors computed before it are recomputed with the clip coefficient).
  for (const auto& [divisor, clip] :
       {std::pair<double, double>{4.0, 0}, std::pair<double, double>{1.0, 0.5},
        std::pair<double, double>{3.0, 0.25}}) {
    SCOPED_TRACE(absl::StrCat("divisor ", divisor, ", max_grad_norm ", clip));
    const StepResults staged = RunApply(HostDevice(true, false), divisor, clip);
    const double direct_in = CopyBytes("direct", "to_device");
    const StepResults direct = RunApply(HostDevice(true, true), divisor, clip);
    ExpectSameApplyUpdates(staged, direct);
    // Every tensor is copied once a step; with clipping, one computed before the step was sealed
    // (and the clip known) is copied again for its recompute.
    const double copied = CopyBytes("direct", "to_device") - direct_in;
    EXPECT_GE(copied, kSteps * kApplyMuonGradBytes);
    EXPECT_LE(copied, (clip > 0 ? 2 : 1) * kSteps * kApplyMuonGradBytes);
  }
}

// Values that exercise rounding: ties, subnormals, fp16 overflow, signed zeros.
std::vector<float> AwkwardValues(size_t n) {
  std::vector<float> v = Gradient(0, static_cast<int64_t>(n), 0, 3);
  const float special[] = {0.0f,   -0.0f,   1.0f + 1.0f / 256, 65520.0f, -1e6f,
                           1e-40f, 3.0e-8f, 1.00390625f,       -2.5f,    1e30f};
  for (size_t i = 0; i < n; i += 7) v[i] = special[(i / 7) % 10] * (i % 2 ? 1.0f : 3.0f);
  return v;
}

// Stream::Convert against common::ToFloat32 / FromFloat32, on `dev`.
void ExpectConvertLikeTheHost(Device& dev) {
  auto stream = dev.CreateStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  constexpr size_t kN = (size_t{1} << 20) + 37;
  const std::vector<float> values = AwkwardValues(kN);
  for (common::DType dtype : {common::DType::kBFloat16, common::DType::kFloat16}) {
    std::vector<char> want(kN * 2), got(kN * 2);
    common::FromFloat32(values.data(), kN, dtype, want.data());
    std::vector<float> widened_want(kN), widened_got(kN);
    common::ToFloat32(dtype, want.data(), kN, widened_want.data());
    auto f32 = dev.Allocate(kN * 4);
    auto raw = dev.Allocate(kN * 2);
    ASSERT_TRUE(f32.ok() && raw.ok());
    Stream& s = **stream;
    ASSERT_TRUE(s.CopyToDevice(*f32, 0, values.data(), kN * 4).ok());
    ASSERT_TRUE(s.Convert(*f32, common::DType::kFloat32, *raw, dtype, kN, 1.0f).ok());
    ASSERT_TRUE(s.CopyToHost(got.data(), *raw, 0, kN * 2).ok());
    ASSERT_TRUE(s.Convert(*raw, dtype, *f32, common::DType::kFloat32, kN, 1.0f).ok());
    ASSERT_TRUE(s.CopyToHost(widened_got.data(), *f32, 0, kN * 4).ok());
    // Widened and scaled (apply mode's gradient scale), from 16 bits and from float32 (into
    // another buffer): one float32 rounding of the product, as the host's g *= scale.
    constexpr float kScale = 0.3f;
    std::vector<float> scaled_want = widened_want, scaled_got(kN), scaled32_want = values,
                       scaled32_got(kN);
    for (float& v : scaled_want) v *= kScale;
    for (float& v : scaled32_want) v *= kScale;
    auto f32b = dev.Allocate(kN * 4);
    ASSERT_TRUE(f32b.ok());
    ASSERT_TRUE(s.Convert(*raw, dtype, *f32b, common::DType::kFloat32, kN, kScale).ok());
    ASSERT_TRUE(s.CopyToHost(scaled_got.data(), *f32b, 0, kN * 4).ok());
    ASSERT_TRUE(s.CopyToDevice(*f32, 0, values.data(), kN * 4).ok());
    ASSERT_TRUE(
        s.Convert(*f32, common::DType::kFloat32, *f32b, common::DType::kFloat32, kN, kScale).ok());
    ASSERT_TRUE(s.CopyToHost(scaled32_got.data(), *f32b, 0, kN * 4).ok());
    const absl::Status synced = s.Synchronize();
    ASSERT_TRUE(synced.ok()) << synced;
    EXPECT_TRUE(want == got) << common::DTypeName(dtype) << " narrowing differs from the host";
    EXPECT_EQ(std::memcmp(widened_want.data(), widened_got.data(), kN * 4), 0)
        << common::DTypeName(dtype) << " widening differs from the host";
    EXPECT_EQ(std::memcmp(scaled_want.data(), scaled_got.data(), kN * 4), 0)
        << common::DTypeName(dtype) << " scaled widening differs from the host";
    EXPECT_EQ(std::memcmp(scaled32_want.data(), scaled32_got.data(), kN * 4), 0)
        << "scaled float32 differs from the host";
    // Refused calls enqueue nothing.
    EXPECT_EQ(s.Convert(*raw, dtype, *f32, common::DType::kFloat32, kN + 1, 1.0f).code(),
              absl::StatusCode::kOutOfRange);
    EXPECT_EQ(s.Convert(*f32, common::DType::kFloat32, *f32, dtype, kN, 1.0f).code(),
              absl::StatusCode::kInvalidArgument);
    const common::DType other =
        dtype == common::DType::kBFloat16 ? common::DType::kFloat16 : common::DType::kBFloat16;
    EXPECT_EQ(s.Convert(*raw, dtype, *f32, other, kN, 1.0f).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(DirectCopySimulatedTest, ConvertWidensAndNarrowsAsTheHost) {
  ExpectConvertLikeTheHost(*HostDevice(false, false));
  ExpectConvertLikeTheHost(*HostDevice(true, true));
}

TEST(DirectCopySimulatedTest, RegisteredRangesAreTrackedAndReleased) {
  auto region = common::SharedRegion::Create("muond-test", size_t{4} << 20, false, false);
  ASSERT_TRUE(region.ok()) << region.status();
  char* base = region->data();
  std::unique_ptr<Device> cpu = HostDevice(false, false);
  EXPECT_FALSE(cpu->DirectHostCopies());
  {
    auto reg = HostRegistration::Register(*cpu, base, region->size());
    ASSERT_TRUE(reg.ok()) << reg.status();
    EXPECT_FALSE(cpu->IsHostRegistered(base, 64));  // the cpu backend never copies direct
  }
  std::unique_ptr<Device> dev = HostDevice(true, true);
  EXPECT_TRUE(dev->DirectHostCopies());
  {
    auto reg = HostRegistration::Register(*dev, base + 4096, size_t{1} << 20);
    ASSERT_TRUE(reg.ok()) << reg.status();
    EXPECT_TRUE(dev->IsHostRegistered(base + 4096, size_t{1} << 20));
    EXPECT_TRUE(dev->IsHostRegistered(base + 5000, 100));
    EXPECT_FALSE(dev->IsHostRegistered(base + 4095, 2));
    EXPECT_FALSE(dev->IsHostRegistered(base + 4096, (size_t{1} << 20) + 1));
    HostRegistration moved = *std::move(reg);
    EXPECT_TRUE(moved.registered());
    EXPECT_TRUE(dev->IsHostRegistered(base + 5000, 100));
  }
  EXPECT_FALSE(dev->IsHostRegistered(base + 5000, 100));
  EXPECT_EQ(HostRegistration::Register(*HostDevice(true, true, true), base, 4096).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(HostRegistration::Register(*dev, nullptr, 4096).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- GPU backends (each suite skipped, with the reason, where its backend has no device).

// A new device 0 of `backend`; whether there is one is decided once per process and backend, so
// either every test of a suite skips or none does (a later failure to open is a failure).
absl::StatusOr<std::unique_ptr<Device>> OpenGpu(const std::string& backend) {
  auto b = device::OpenBackend(backend, 2, SimulatedOptions{});
  if (!b.ok()) return b.status();
  return std::move(b->device);
}
const absl::Status& Availability(const std::string& backend) {
  static const auto* cuda = new absl::Status(OpenGpu("cuda").status());
  static const auto* level_zero = new absl::Status(OpenGpu("level_zero").status());
  return backend == "cuda" ? *cuda : *level_zero;
}
// Declares `std::unique_ptr<Device> dev` on `backend`, or skips: ctest reads "CUDA backend
// unavailable: " / "Level Zero backend unavailable: " as a skip (tests/gpu/CMakeLists.txt).
#define REQUIRE_GPU(dev, backend, label)                                               \
  if (!Availability(backend).ok()) {                                                   \
    GTEST_SKIP() << label " backend unavailable: " << Availability(backend).message(); \
  }                                                                                    \
  auto dev##_opened = OpenGpu(backend);                                                \
  ASSERT_TRUE(dev##_opened.ok()) << dev##_opened.status();                             \
  std::unique_ptr<Device> dev = *std::move(dev##_opened)
#define REQUIRE_CUDA(dev) REQUIRE_GPU(dev, "cuda", "CUDA")
#define REQUIRE_LEVEL_ZERO(dev) REQUIRE_GPU(dev, "level_zero", "Level Zero")

// Bytes with a pattern that differs at every offset of a small period.
void Fill(char* p, size_t n, uint32_t seed) {
  uint32_t x = seed;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    p[i] = static_cast<char>(x >> 24);
  }
}

// A memfd region (as a session's) registered with the device: copies of parts of it, at odd
// offsets, go to the device and back into another part in place; unregistered afterwards. A Level
// Zero driver without the host pointer import says so (skip with that reason, not a failure: the
// daemon falls back to staging there, StepsGoDirect... checks that).
void ExpectRegisteredRegionCopiesInPlace(Device& dev) {
  constexpr size_t kBytes = size_t{64} << 20;
  auto region = common::SharedRegion::Create("muond-test", 2 * kBytes, false, true);
  ASSERT_TRUE(region.ok()) << region.status();
  char* base = region->data();
  ASSERT_TRUE(dev.DirectHostCopies());
  EXPECT_FALSE(dev.IsHostRegistered(base, 64));
  {
    auto reg = HostRegistration::Register(dev, base, region->size());
    if (reg.status().code() == absl::StatusCode::kUnimplemented) {
      GTEST_SKIP() << "host memory cannot be registered here: " << reg.status().message();
    }
    ASSERT_TRUE(reg.ok()) << reg.status();
    EXPECT_TRUE(dev.IsHostRegistered(base + 3, kBytes));
    Fill(base + 3, kBytes - 3, 11);
    auto buffer = dev.Allocate(kBytes);
    auto s = dev.CreateStream();
    ASSERT_TRUE(buffer.ok() && s.ok());
    ASSERT_TRUE((*s)->CopyToDevice(*buffer, 5, base + 3, kBytes - 8).ok());
    ASSERT_TRUE((*s)->CopyToHost(base + kBytes + 1, *buffer, 5, kBytes - 8).ok());
    const absl::Status synced = (*s)->Synchronize();
    ASSERT_TRUE(synced.ok()) << synced;
    EXPECT_EQ(std::memcmp(base + 3, base + kBytes + 1, kBytes - 8), 0);
  }
  EXPECT_FALSE(dev.IsHostRegistered(base + 3, kBytes));
}

// The same backend's steps with the regions registered (direct) and not (staged through the
// host): the same bytes, and the direct ones counted as such; where the device refuses the
// registration, the fallback (counted as failed) gives the same bytes.
void ExpectStepsDirectLikeStaged(std::unique_ptr<Device> dev, const std::string& backend) {
  const std::vector<StepResults> staged = RunJobs(std::move(dev), false);
  auto again = OpenGpu(backend);
  ASSERT_TRUE(again.ok()) << again.status();
  const double direct_in = CopyBytes("direct", "to_device");
  const double registered = Registrations("registered");
  const double failed = Registrations("failed");
  const std::vector<StepResults> direct = RunJobs(*std::move(again), true);
  ExpectSameUpdates(staged, direct);
  if (Registrations("failed") - failed > 0) {
    std::printf("%s: the regions could not be registered; the fallback was checked\n",
                backend.c_str());
    EXPECT_EQ(Registrations("failed") - failed, 4);
    return;
  }
  EXPECT_EQ(CopyBytes("direct", "to_device") - direct_in, kSteps * kStepBytes);
  EXPECT_EQ(Registrations("registered") - registered, 4);
}

// Apply mode on a GPU: the Muon tensors' direct path (gradients widened and scaled on the device,
// momentum written back from it) against the same backend's staged path (assembled, scaled and
// its momentum computed on the host), with a divisor that changes every step and clipping.
void ExpectApplyDirectLikeStaged(std::unique_ptr<Device> dev, const std::string& backend) {
  const StepResults staged = RunApply(std::move(dev), 3.0, 0.25, /*register_with_device=*/false);
  auto again = OpenGpu(backend);
  ASSERT_TRUE(again.ok()) << again.status();
  const double direct_in = CopyBytes("direct", "to_device");
  const StepResults direct = RunApply(*std::move(again), 3.0, 0.25, true);
  ExpectSameApplyUpdates(staged, direct);
  std::printf("%s apply mode: %.0f gradient bytes direct over %d steps\n", backend.c_str(),
              CopyBytes("direct", "to_device") - direct_in, kSteps);
}

TEST(CudaDirectCopyTest, ApplyModeDirectMatchesTheStagedPathBitForBit) {
  REQUIRE_CUDA(dev);
  ExpectApplyDirectLikeStaged(std::move(dev), "cuda");
}

TEST(LevelZeroDirectCopyTest, ApplyModeDirectMatchesTheStagedPathBitForBit) {
  REQUIRE_LEVEL_ZERO(dev);
  ExpectApplyDirectLikeStaged(std::move(dev), "level_zero");
}

TEST(CudaDirectCopyTest, SharedRegionRegistersAndCopiesInPlace) {
  REQUIRE_CUDA(dev);
  ExpectRegisteredRegionCopiesInPlace(*dev);
}

TEST(CudaDirectCopyTest, ConvertMatchesTheHostBitForBit) {
  REQUIRE_CUDA(dev);
  ExpectConvertLikeTheHost(*dev);
}

TEST(CudaDirectCopyTest, StepsGoDirectAndMatchTheStagedPathBitForBit) {
  REQUIRE_CUDA(dev);
  ExpectStepsDirectLikeStaged(std::move(dev), "cuda");
}

TEST(LevelZeroDirectCopyTest, SharedRegionRegistersAndCopiesInPlace) {
  REQUIRE_LEVEL_ZERO(dev);
  ExpectRegisteredRegionCopiesInPlace(*dev);
}

TEST(LevelZeroDirectCopyTest, ConvertMatchesTheHostBitForBit) {
  REQUIRE_LEVEL_ZERO(dev);
  ExpectConvertLikeTheHost(*dev);
}

TEST(LevelZeroDirectCopyTest, StepsGoDirectAndMatchTheStagedPathBitForBit) {
  REQUIRE_LEVEL_ZERO(dev);
  ExpectStepsDirectLikeStaged(std::move(dev), "level_zero");
}

// GB/s of `reps` copies of `bytes` between `host` and `buffer` on `s`, one direction.
double CopyGbps(Stream& s, DeviceBuffer& buffer, char* host, size_t bytes, bool to_device,
                int reps) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) {
    const absl::Status q =
        to_device ? s.CopyToDevice(buffer, 0, host, bytes) : s.CopyToHost(host, buffer, 0, bytes);
    if (!q.ok()) return 0;
  }
  if (!s.Synchronize().ok()) return 0;
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(bytes) * reps / secs / 1e9;
}

// Measurement (tests/gpu/run.sh prints these lines): copies between a registered shared-memory
// region and the device, and an update-mode step (16 bf16 2048 x 2048 matrices, bf16 compute, one
// rank) with registered regions and staged, against the PCIe floor: the bytes the step moves
// (gradient and momentum in, update out) at the measured pinned rates, the two directions
// overlapped (full duplex). The assertions are on the bytes only; the times are printed.
TEST(CudaDirectCopyTest, PinnedCopyRatesAndStepTimeAgainstThePcieFloor) {
  REQUIRE_CUDA(dev);
  constexpr size_t kBytes = size_t{256} << 20;
  auto region = common::SharedRegion::Create("muond-test", 2 * kBytes, false, true);
  ASSERT_TRUE(region.ok()) << region.status();
  auto reg = HostRegistration::Register(*dev, region->data(), region->size());
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto buffer = dev->Allocate(kBytes);
  auto s = dev->CreateStream();
  ASSERT_TRUE(buffer.ok() && s.ok());
  char* in = region->data();
  char* out = region->data() + kBytes;
  Fill(in, kBytes, 5);
  CopyGbps(**s, *buffer, in, kBytes, true, 1);  // warm-up
  const double h2d = CopyGbps(**s, *buffer, in, kBytes, true, 8);
  const double d2h = CopyGbps(**s, *buffer, out, kBytes, false, 8);
  EXPECT_EQ(std::memcmp(in, out, kBytes), 0);
  ASSERT_GT(h2d, 0);
  ASSERT_GT(d2h, 0);
  std::printf(
      "pinned copy (registered shared-memory region, 256 MiB): region->device %.1f GB/s, "
      "device->region %.1f GB/s\n",
      h2d, d2h);
  buffer = DeviceBuffer();
  reg = HostRegistration();

  std::string json = R"({"job_id": "big", "muon": {"compute_dtype": "bfloat16"}, "matrices": [)";
  for (int m = 0; m < 16; ++m) {
    json += (m ? "," : "") + std::string(R"({"name": "w)") + std::to_string(m) +
            R"(", "shape": [2048, 2048], "dtype": "bfloat16"})";
  }
  json += "]}";
  double best[2] = {0, 0};
  std::vector<StepResults> runs;
  for (int direct = 0; direct < 2; ++direct) {
    absl::StatusOr<std::unique_ptr<Device>> cuda =
        direct ? OpenGpu("cuda") : absl::StatusOr<std::unique_ptr<Device>>(std::move(dev));
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    auto daemon = InProcessDaemon::Start(*std::move(cuda), direct == 1, uint64_t{1} << 30);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    auto token = (*daemon)->CreateJob(json);
    ASSERT_TRUE(token.ok()) << token.status();
    auto run = RunSteps((*daemon)->shm_path(), "big", *token, 4, 9);
    ASSERT_TRUE(run.ok()) << run.status();
    best[direct] = *std::min_element(run->seconds.begin() + 1, run->seconds.end());
    runs.push_back(*std::move(run));
  }
  EXPECT_TRUE(runs[0].updates == runs[1].updates) << "direct and staged updates differ";
  const double elements = 16.0 * 2048 * 2048;
  const double bytes_in = elements * (2 + 4), bytes_out = elements * 2;
  const double floor = std::max(bytes_in / (h2d * 1e9), bytes_out / (d2h * 1e9));
  std::printf(
      "step (16 x 2048x2048 bfloat16, 1 rank): direct %.2f ms, staged %.2f ms "
      "(direct/staged %.2f); PCIe floor %.2f ms (%.0f MB in, %.0f MB out at the pinned "
      "rates): direct/floor %.2f\n",
      best[1] * 1e3, best[0] * 1e3, best[1] / best[0], floor * 1e3, bytes_in / 1e6, bytes_out / 1e6,
      best[1] / floor);
}

}  // namespace
}  // namespace muond::server::testing_direct
