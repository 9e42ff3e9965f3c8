// Conformance of the device backends (issue 5, "Conformance"): every backend built here runs the
// Muon kernel through the Stream API (Allocate, CopyToDevice, Record/WaitFor, Muon, CopyToHost) on
// random matrices of many shapes, for every Newton-Schulz method and compute dtype, and
//  - equals the direct host MuonUpdate bit for bit (the host backends run the same math), update
//    and new momentum alike;
//  - meets the accuracy bounds of DESIGN.md 3 against the cpu backend (the GPU backends join this
//    test with their own, non-bit-identical math).
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/device/device.h"
#include "server/optim/muon_math.h"
#include "tests/common/muon_cases.h"

namespace muond::server::device {
namespace {

using common::DType;
using common::MatrixSpec;
using common::MuonConfig;
using common::NsMethod;

constexpr int kMathThreads = 2;

// The backends every build has; GPU backends are added here when compiled in.
const char* const kBackends[] = {"cpu", "simulated"};

using test_util::Bound;
using test_util::Case;
using test_util::DeviceUpdate;
using test_util::HostUpdate;
using test_util::RandomValues;
using test_util::RelativeError;
using test_util::SameBits;
using test_util::ShapeCase;

const std::vector<ShapeCase> kShapes = {
    {"wide", {24, 72}, 1},
    {"tall", {72, 24}, 1},
    {"square", {32, 32}, 1},
    {"tiny", {2, 3}, 1},
    {"vector_like", {1, 40}, 1},
    {"per_head", {64, 24}, 4},        // 4 blocks of 16 x 24
    {"per_head_tall", {128, 12}, 4},  // 4 tall blocks of 32 x 12
    {"experts", {3, 20, 36}, 1},      // 3 blocks of 20 x 36
    {"experts_heads", {2, 32, 20}, 2},
    {"conv", {16, 4, 3, 3}, 1},       // 16 x 36
    {"conv_tall", {48, 2, 2, 3}, 2},  // 2 blocks of 24 x 12
    // Same shapes again, in the same kernel call: a backend batches them (one batched
    // Newton-Schulz) and must still give each matrix its own bits.
    {"wide_2", {24, 72}, 1},
    {"per_head_2", {64, 24}, 4},
    {"wide_3", {24, 72}, 1},
};

std::vector<Case> MakeCases(uint32_t seed) { return test_util::MakeCases(kShapes, seed); }

std::string ConfigName(const MuonConfig& c) {
  return absl::StrCat(std::string(common::NsMethodName(c.ns_method)), "/",
                      std::string(common::DTypeName(c.compute_dtype)),
                      c.nesterov ? "" : "/no-nesterov");
}

std::vector<MuonConfig> AllConfigs() {
  std::vector<MuonConfig> configs;
  for (NsMethod method : {NsMethod::kStandard, NsMethod::kGram, NsMethod::kPolarExpress}) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      MuonConfig c;
      c.ns_method = method;
      c.compute_dtype = dtype;
      configs.push_back(c);
    }
  }
  MuonConfig plain;  // no Nesterov, other scale, more iterations
  plain.nesterov = false;
  plain.ns_steps = 7;
  plain.scale_mode = common::ScaleMode::kMatchRmsAdamw;
  plain.momentum = 0.9;
  configs.push_back(plain);
  return configs;
}

class DeviceConformanceTest : public testing::Test {
 protected:
  static void SetUpTestSuite() { SetMathThreads(kMathThreads); }
};

TEST_F(DeviceConformanceTest, OpenBackendNamesAndRejects) {
  for (const char* name : {"cpu", "simulated", "auto"}) {
    auto b = OpenBackend(name, kMathThreads, SimulatedOptions{});
    ASSERT_TRUE(b.ok()) << name << ": " << b.status();
    EXPECT_FALSE(b->why.empty());
    EXPECT_EQ(b->device->name(), std::string(name) == "simulated" ? "simulated" : "cpu");
  }
  auto unknown = OpenBackend("tpu", 1, SimulatedOptions{});
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(unknown.status().message()).find("tpu"), std::string::npos);
  SimulatedOptions bad;
  bad.copy_gbps = 0;
  EXPECT_EQ(OpenBackend("simulated", 1, bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(DeviceConformanceTest, EveryBackendMatchesHostMathBitForBitAndCpuWithinBounds) {
  std::map<std::string, double> worst;  // backend/config -> worst rel. error vs cpu
  uint32_t seed = 1000;
  for (const MuonConfig& config : AllConfigs()) {
    std::vector<Case> host = MakeCases(seed);
    for (Case& c : host) HostUpdate(config, c);
    std::vector<Case> cpu;
    for (const char* backend : kBackends) {
      SCOPED_TRACE(absl::StrCat(backend, " ", ConfigName(config)));
      auto opened = OpenBackend(backend, kMathThreads, SimulatedOptions{});
      ASSERT_TRUE(opened.ok()) << opened.status();
      std::vector<Case> cases = MakeCases(seed);
      DeviceUpdate(*opened->device, config, cases);
      if (testing::Test::HasFatalFailure()) return;
      if (std::string(backend) == "cpu") cpu = cases;
      double& w = worst[absl::StrCat(backend, " ", ConfigName(config))];
      for (size_t i = 0; i < cases.size(); ++i) {
        const Case& got = cases[i];
        EXPECT_TRUE(SameBits(got.update, host[i].update)) << got.spec.name << ": update";
        EXPECT_TRUE(SameBits(got.new_momentum, host[i].new_momentum))
            << got.spec.name << ": momentum";
        const double err = RelativeError(got.update, cpu[i].update);
        EXPECT_LT(err, Bound(config.compute_dtype)) << got.spec.name;
        EXPECT_LT(RelativeError(got.new_momentum, cpu[i].new_momentum), 1e-6) << got.spec.name;
        w = std::max(w, err);
      }
    }
    seed += 100;
  }
  std::vector<std::string> lines;
  for (const auto& [k, v] : worst) lines.push_back(absl::StrCat(k, " ", v));
  std::printf("worst rel. error vs cpu backend:\n  %s\n", absl::StrJoin(lines, "\n  ").c_str());
}

// Several kernel calls, one per shape, in flight at once on one stream: the stream keeps them in
// order and each result still equals the host math.
TEST_F(DeviceConformanceTest, ManyKernelCallsInFlightOnOneStream) {
  MuonConfig config;
  std::vector<Case> host = MakeCases(77);
  for (Case& c : host) HostUpdate(config, c);
  for (const char* backend : kBackends) {
    SCOPED_TRACE(backend);
    auto opened = OpenBackend(backend, kMathThreads, SimulatedOptions{});
    ASSERT_TRUE(opened.ok());
    Device& dev = *opened->device;
    auto s = dev.CreateStream();
    ASSERT_TRUE(s.ok());
    std::vector<Case> cases = MakeCases(77);
    std::vector<DeviceBuffer> grads, moms;
    for (Case& c : cases) {
      const size_t bytes = c.grad.size() * sizeof(float);
      grads.push_back(*dev.Allocate(bytes));
      moms.push_back(*dev.Allocate(bytes));
      c.update.assign(c.grad.size(), 0.0f);
      c.new_momentum.assign(c.grad.size(), 0.0f);
    }
    for (size_t i = 0; i < cases.size(); ++i) {
      Case& c = cases[i];
      const size_t bytes = c.grad.size() * sizeof(float);
      ASSERT_TRUE((*s)->CopyToDevice(grads[i], 0, c.grad.data(), bytes).ok());
      ASSERT_TRUE((*s)->CopyToDevice(moms[i], 0, c.momentum.data(), bytes).ok());
      ASSERT_TRUE((*s)->Muon(config, {{&c.spec, &grads[i], &moms[i]}}).ok());
      ASSERT_TRUE((*s)->CopyToHost(c.update.data(), grads[i], 0, bytes).ok());
      ASSERT_TRUE((*s)->CopyToHost(c.new_momentum.data(), moms[i], 0, bytes).ok());
    }
    ASSERT_TRUE((*s)->Synchronize().ok());
    for (size_t i = 0; i < cases.size(); ++i) {
      EXPECT_TRUE(SameBits(cases[i].update, host[i].update)) << cases[i].spec.name;
      EXPECT_TRUE(SameBits(cases[i].new_momentum, host[i].new_momentum)) << cases[i].spec.name;
    }
  }
}

}  // namespace
}  // namespace muond::server::device
