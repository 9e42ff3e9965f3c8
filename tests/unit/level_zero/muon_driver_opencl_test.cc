// The Level Zero backend's Muon driver (muon_kernel_driver.cc) run through OpenCL on whatever
// platform is installed (PoCL on the CPU here), from the same kernel source the build compiles to
// SPIR-V: the whole Muon update against the host math (MuonUpdate, i.e. the cpu backend): momentum
// bit for bit, the update within DESIGN.md 3's bounds, for every NS method x compute dtype,
// Nesterov on/off, every scale mode, per-head, 3-D and 4-D shapes; non-finite input is refused.
// Skips (with the reason) when no OpenCL platform is available; built with OpenCL only (without,
// muon_kernels_opencl_test.cc reports the suite skipped).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/device/level_zero/muon_kernel_driver.h"
#include "server/device/level_zero/muon_kernels.h"
#include "server/optim/muon_math.h"
#include "tests/common/muon_cases.h"
#include "tests/unit/level_zero/muon_kernels_opencl_fixture.h"

namespace muond::server::device::level_zero {
namespace {

#ifdef MUOND_HAVE_OPENCL

using common::DType;
using common::MatrixSpec;
using common::MuonConfig;
using common::NsMethod;
using common::ScaleMode;

using test_util::Bound;
using test_util::Case;
using test_util::RelativeError;
using test_util::ShapeCase;

const std::vector<ShapeCase> kShapes = {
    {"wide", {24, 72}, 1},
    {"tall", {72, 24}, 1},
    {"square", {32, 32}, 1},
    {"tiny", {2, 3}, 1},
    {"row", {1, 70}, 1},
    {"column", {70, 1}, 1},
    {"odd", {33, 17}, 1},
    {"odd_wide", {17, 65}, 1},
    {"larger", {96, 200}, 1},
    {"per_head", {64, 24}, 4},        // 4 blocks of 16 x 24
    {"per_head_tall", {128, 12}, 4},  // 4 tall blocks of 32 x 12
    {"experts", {3, 20, 36}, 1},      // 3 blocks of 20 x 36
    {"experts_heads", {2, 32, 20}, 2},
    {"conv", {16, 4, 3, 3}, 1},       // 16 x 36
    {"conv_tall", {48, 2, 2, 3}, 2},  // 2 blocks of 24 x 12
};

std::vector<Case> MakeCases(uint32_t seed) { return test_util::MakeCases(kShapes, seed); }

std::vector<MuonConfig> Configs() {
  std::vector<MuonConfig> configs;
  for (NsMethod method : {NsMethod::kStandard, NsMethod::kGram, NsMethod::kPolarExpress}) {
    for (DType dtype : kDTypes) {
      MuonConfig c;
      c.ns_method = method;
      c.compute_dtype = dtype;
      configs.push_back(c);
    }
  }
  auto add = [&](NsMethod method, DType dtype, bool nesterov, int steps, ScaleMode scale,
                 double momentum) {
    MuonConfig c;
    c.ns_method = method;
    c.compute_dtype = dtype;
    c.nesterov = nesterov;
    c.ns_steps = steps;
    c.scale_mode = scale;
    c.momentum = momentum;
    configs.push_back(c);
  };
  add(NsMethod::kStandard, DType::kFloat32, false, 7, ScaleMode::kMatchRmsAdamw, 0.9);
  add(NsMethod::kPolarExpress, DType::kBFloat16, true, 3, ScaleMode::kNone, 0.95);
  add(NsMethod::kGram, DType::kFloat32, false, 1, ScaleMode::kOriginal, 0.5);
  add(NsMethod::kGram, DType::kFloat16, false, 6, ScaleMode::kMatchRmsAdamw, 0.95);
  add(NsMethod::kStandard, DType::kFloat16, true, 2, ScaleMode::kNone, 0.0);
  add(NsMethod::kPolarExpress, DType::kFloat32, false, 9, ScaleMode::kOriginal, 0.99);
  return configs;
}

std::string ConfigName(const MuonConfig& c) {
  return absl::StrCat(std::string(common::NsMethodName(c.ns_method)), "/",
                      std::string(common::DTypeName(c.compute_dtype)), "/steps ", c.ns_steps,
                      c.nesterov ? "" : "/no-nesterov", "/scale ", static_cast<int>(c.scale_mode),
                      "/beta ", c.momentum);
}

TEST_F(MuonKernelsOpenClTest, WholeMuonUpdateMatchesHostMath) {
  uint32_t seed = 1000;
  std::string report;
  for (const MuonConfig& config : Configs()) {
    SCOPED_TRACE(ConfigName(config));
    std::vector<Case> cases = MakeCases(seed);
    seed += 100;
    // All matrices in one driver call, as a Muon kernel call of the step pipeline.
    std::vector<std::unique_ptr<QueueBuffer>> grads, moms;
    std::vector<KernelMuonItem> items;
    for (Case& c : cases) {
      grads.push_back(Upload(c.grad, DType::kFloat32));
      moms.push_back(Upload(c.momentum, DType::kFloat32));
      items.push_back({&c.spec, grads.back()->ref(), moms.back()->ref()});
    }
    const absl::Status s = RunMuon(queue(), config, items);
    ASSERT_TRUE(s.ok()) << s;
    double worst = 0;
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      std::vector<float> want_u(c.grad.size()), want_m = c.momentum;
      ASSERT_TRUE(MuonUpdate(config, c.spec, c.grad.data(), want_m.data(), want_u.data()).ok());
      const auto got_u = Download(*grads[i], c.grad.size(), DType::kFloat32);
      const auto got_m = Download(*moms[i], c.grad.size(), DType::kFloat32);
      EXPECT_EQ(std::memcmp(got_m.data(), want_m.data(), want_m.size() * 4), 0)
          << c.spec.name << ": momentum";
      const double err = RelativeError(got_u, want_u);
      EXPECT_LT(err, Bound(config.compute_dtype)) << c.spec.name;
      worst = std::max(worst, err);
    }
    absl::StrAppend(&report, "  ", ConfigName(config), ": ", worst, "\n");
  }
  std::printf("worst rel. error of the update vs host MuonUpdate:\n%s", report.c_str());
}

TEST_F(MuonKernelsOpenClTest, NonFiniteGradientIsRefusedBeforeAnyMomentumIsWritten) {
  for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    std::vector<Case> cases = MakeCases(5000);
    cases.resize(3);
    cases[1].grad[cases[1].grad.size() / 2] = bad;
    std::vector<std::unique_ptr<QueueBuffer>> grads, moms;
    std::vector<KernelMuonItem> items;
    for (Case& c : cases) {
      grads.push_back(Upload(c.grad, DType::kFloat32));
      moms.push_back(Upload(c.momentum, DType::kFloat32));
      items.push_back({&c.spec, grads.back()->ref(), moms.back()->ref()});
    }
    const absl::Status s = RunMuon(queue(), MuonConfig{}, items);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(std::string(s.message()).find(cases[1].spec.name), std::string::npos) << s;
    for (size_t i = 0; i < cases.size(); ++i) {
      const auto m = Download(*moms[i], cases[i].momentum.size(), DType::kFloat32);
      EXPECT_EQ(std::memcmp(m.data(), cases[i].momentum.data(), m.size() * 4), 0) << i;
    }
  }
}

TEST_F(MuonKernelsOpenClTest, RefusesWhatMuonUpdateRefuses) {
  std::vector<Case> cases = MakeCases(6000);
  auto g = Upload(cases[0].grad, DType::kFloat32), m = Upload(cases[0].momentum, DType::kFloat32);
  MatrixSpec bad = cases[0].spec;  // 24 rows in 5 heads
  bad.num_heads = 5;
  absl::Status s = RunMuon(queue(), MuonConfig{}, {{&bad, g->ref(), m->ref()}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("is not a Muon matrix"), std::string::npos) << s;
  MuonConfig zero_steps;
  zero_steps.ns_steps = 0;
  s = RunMuon(queue(), zero_steps, {{&cases[0].spec, g->ref(), m->ref()}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(RunNewtonSchulz(queue(), MuonConfig{}, MatrixGeometry{1, 0, 4}, 1.0, g->ref()).code(),
            absl::StatusCode::kInvalidArgument);
}

#endif  // MUOND_HAVE_OPENCL

}  // namespace
}  // namespace muond::server::device::level_zero
