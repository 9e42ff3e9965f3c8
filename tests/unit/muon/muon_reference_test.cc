// MuonUpdate against the stored reference vectors (tests/data/muon_v1: float64 evaluations of
// DESIGN.md 3, stored as fp32), plus the small pure functions of muon_math.h and error paths.
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/optim/muon_math.h"

namespace muond::server {
namespace {

using common::MatrixSpec;
using common::MuonConfig;
using common::NsMethod;
using common::ScaleMode;

double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0.0;
  double norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - static_cast<double>(want[i]);
    diff += d * d;
    norm += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(diff) / std::sqrt(norm);
}

std::vector<float> ReadF32(const common::SafetensorsFile& file, const std::string& name) {
  const common::TensorInfo* info = file.Find(name);
  if (info == nullptr) {
    ADD_FAILURE() << "tensor " << name << " missing";
    return {};
  }
  EXPECT_EQ(info->dtype, common::DType::kFloat32) << name;
  const std::string_view bytes = file.Data(*info);
  std::vector<float> out(static_cast<size_t>(info->numel()));
  EXPECT_EQ(bytes.size(), out.size() * sizeof(float)) << name;
  std::memcpy(out.data(), bytes.data(), std::min(bytes.size(), out.size() * sizeof(float)));
  return out;
}

TEST(MuonReferenceVectors, EveryCaseThreeStepsMatchesFloat64Reference) {
  SetMathThreads(2);
  const std::string dir = MUOND_TEST_DATA_DIR;
  std::ifstream json_file(dir + "/muon_v1.json");
  ASSERT_TRUE(json_file.good()) << dir << "/muon_v1.json";
  const nlohmann::json cases = nlohmann::json::parse(json_file)["cases"];
  ASSERT_GE(cases.size(), 6u);
  auto file = common::SafetensorsFile::ReadFile(dir + "/muon_v1.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();

  for (const nlohmann::json& c : cases) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    MuonConfig config;
    config.momentum = c["momentum"];
    config.nesterov = c["nesterov"];
    config.ns_steps = c["ns_steps"];
    auto method = common::ParseNsMethod(c["ns_method"].get<std::string>());
    auto scale = common::ParseScaleMode(c["scale_mode"].get<std::string>());
    ASSERT_TRUE(method.ok() && scale.ok());
    config.ns_method = *method;
    config.scale_mode = *scale;
    MatrixSpec spec;
    spec.name = name;
    spec.shape = {c["rows"].get<int64_t>(), c["cols"].get<int64_t>()};
    spec.num_heads = c["num_heads"];

    const size_t n = static_cast<size_t>(spec.numel());
    std::vector<float> momentum(n, 0.0f);
    std::vector<float> update(n);
    const int steps = c["steps"];
    ASSERT_EQ(steps, 3);
    for (int t = 0; t < steps; ++t) {
      const std::string prefix = absl::StrCat(name, "/step", t, "/");
      const std::vector<float> grad = ReadF32(*file, prefix + "grad");
      ASSERT_EQ(grad.size(), n);
      ASSERT_TRUE(MuonUpdate(config, spec, grad.data(), momentum.data(), update.data()).ok());
      const double update_error = RelativeError(update, ReadF32(*file, prefix + "update"));
      const double momentum_error = RelativeError(momentum, ReadF32(*file, prefix + "momentum"));
      EXPECT_LT(update_error, 1e-4) << "step " << t;
      EXPECT_LT(momentum_error, 1e-4) << "step " << t;
      std::printf("[ muon_v1  ] %-18s step %d  update err %.2e  momentum err %.2e\n", name.c_str(),
                  t, update_error, momentum_error);
    }
  }
}

TEST(MuonGeometry, EachRank) {
  MatrixSpec spec;
  spec.shape = {128, 48};
  spec.num_heads = 4;
  MatrixGeometry g = GeometryOf(spec);
  EXPECT_EQ(g.batch, 4);
  EXPECT_EQ(g.rows, 32);
  EXPECT_EQ(g.cols, 48);

  spec.shape = {96, 160};
  spec.num_heads = 1;
  g = GeometryOf(spec);
  EXPECT_EQ(g.batch, 1);
  EXPECT_EQ(g.rows, 96);
  EXPECT_EQ(g.cols, 160);

  spec.shape = {3, 20, 36};  // experts, each split in 2 heads
  spec.num_heads = 2;
  g = GeometryOf(spec);
  EXPECT_EQ(g.batch, 6);
  EXPECT_EQ(g.rows, 10);
  EXPECT_EQ(g.cols, 36);

  spec.shape = {16, 4, 3, 3};  // conv [out, in, kh, kw] -> [16, 36]
  spec.num_heads = 1;
  g = GeometryOf(spec);
  EXPECT_EQ(g.batch, 1);
  EXPECT_EQ(g.rows, 16);
  EXPECT_EQ(g.cols, 36);
  spec.num_heads = 2;
  g = GeometryOf(spec);
  EXPECT_EQ(g.batch, 2);
  EXPECT_EQ(g.rows, 8);
  EXPECT_EQ(g.cols, 36);
}

TEST(MuonScaleTest, Values) {
  EXPECT_DOUBLE_EQ(MuonScale(ScaleMode::kOriginal, 32, 48), 1.0);
  EXPECT_DOUBLE_EQ(MuonScale(ScaleMode::kOriginal, 48, 48), 1.0);
  EXPECT_DOUBLE_EQ(MuonScale(ScaleMode::kOriginal, 48, 12), 2.0);
  EXPECT_DOUBLE_EQ(MuonScale(ScaleMode::kOriginal, 256, 64), 2.0);
  EXPECT_DOUBLE_EQ(MuonScale(ScaleMode::kMatchRmsAdamw, 48, 160), 0.2 * std::sqrt(160.0));
  EXPECT_DOUBLE_EQ(MuonScale(ScaleMode::kMatchRmsAdamw, 400, 100), 4.0);
  EXPECT_DOUBLE_EQ(MuonScale(ScaleMode::kNone, 400, 100), 1.0);
}

TEST(MuonMathThreads, SetAndGet) {
  SetMathThreads(2);
  EXPECT_EQ(MathThreads(), 2);
  SetMathThreads(1);
  EXPECT_EQ(MathThreads(), 1);
  SetMathThreads(2);
}

std::vector<float> Ramp(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::sin(0.37f * static_cast<float>(i) + 0.1f);
  return v;
}

TEST(MuonUpdateErrors, NanGradientIsInvalidArgumentAndMomentumUntouched) {
  MatrixSpec spec;
  spec.name = "layers.3.mlp";
  spec.shape = {8, 12};
  std::vector<float> grad = Ramp(96);
  grad[17] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> momentum = Ramp(96);
  const std::vector<float> momentum_before = momentum;
  std::vector<float> update(96, 0.0f);
  const absl::Status status =
      MuonUpdate(MuonConfig{}, spec, grad.data(), momentum.data(), update.data());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("layers.3.mlp"), std::string_view::npos) << status;
  EXPECT_NE(status.message().find("17"), std::string_view::npos) << status;
  EXPECT_EQ(std::memcmp(momentum.data(), momentum_before.data(), 96 * sizeof(float)), 0);

  grad[17] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(MuonUpdate(MuonConfig{}, spec, grad.data(), momentum.data(), update.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MuonUpdateErrors, NonFiniteNewtonSchulzInputIsInvalidArgument) {
  for (NsMethod method : {NsMethod::kStandard, NsMethod::kGram, NsMethod::kPolarExpress}) {
    for (common::DType dtype :
         {common::DType::kFloat32, common::DType::kBFloat16, common::DType::kFloat16}) {
      MuonConfig config;
      config.ns_method = method;
      config.compute_dtype = dtype;
      std::vector<float> x = Ramp(2 * 6 * 10);
      x[70] = std::numeric_limits<float>::quiet_NaN();  // in the second block
      const absl::Status status = NewtonSchulz(config, {2, 6, 10}, x.data());
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument)
          << common::NsMethodName(method) << " " << common::DTypeName(dtype) << ": " << status;
    }
  }
}

TEST(MuonUpdateErrors, ShapeNotDivisibleByHeadsIsInvalidArgument) {
  MatrixSpec spec;
  spec.name = "attn";
  spec.shape = {10, 12};
  spec.num_heads = 4;
  std::vector<float> grad = Ramp(120), momentum(120, 0.0f), update(120);
  EXPECT_EQ(MuonUpdate(MuonConfig{}, spec, grad.data(), momentum.data(), update.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MuonUpdateAliasing, UpdateMayAliasGrad) {
  MatrixSpec spec;
  spec.name = "w";
  spec.shape = {12, 20};
  const std::vector<float> grad = Ramp(240);
  std::vector<float> m1(240, 0.25f), m2(240, 0.25f), update(240);
  std::vector<float> in_place = grad;
  ASSERT_TRUE(MuonUpdate(MuonConfig{}, spec, grad.data(), m1.data(), update.data()).ok());
  ASSERT_TRUE(MuonUpdate(MuonConfig{}, spec, in_place.data(), m2.data(), in_place.data()).ok());
  EXPECT_EQ(std::memcmp(update.data(), in_place.data(), 240 * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(m1.data(), m2.data(), 240 * sizeof(float)), 0);
}

}  // namespace
}  // namespace muond::server
