// Conformance of the CUDA backend (issue 6): the Muon kernel through the Stream API on random
// matrices of many shapes (tiny, tall, wide, per-head, experts, conv, blocks large enough for the
// bf16 plan's plain path, same-shape matrices batched across items), every Newton-Schulz method,
// fp32/bf16/fp16 compute, Nesterov on and off, every scale mode and the gram restart edges:
//  - the new momentum is bit-identical to the host's (same formula, same rounding);
//  - the update is within DESIGN.md 3's bounds of the cpu backend (the host MuonUpdate, which
//    device_conformance_test shows equal to it bit for bit) and of a float64 evaluation.
// Every test skips, with the reason, where there is no CUDA device.
#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/device/device.h"
#include "server/optim/muon_math.h"
#include "tests/gpu/cuda_test_util.h"

namespace muond::server::device {
namespace {

using common::DType;
using common::MatrixSpec;
using common::MuonConfig;
using common::NsMethod;
using common::ScaleMode;
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
    {"wide_again", {24, 72}, 1},  // batched with "wide" into one GEMM batch
    {"tall", {72, 24}, 1},
    {"square", {32, 32}, 1},
    {"tiny", {2, 3}, 1},
    {"vector_like", {1, 40}, 1},
    {"per_head", {64, 24}, 4},        // 4 blocks of 16 x 24
    {"head_sized", {16, 24}, 1},      // batched with per_head's blocks
    {"per_head_tall", {128, 12}, 4},  // 4 tall blocks of 32 x 12
    {"experts", {3, 20, 36}, 1},      // 3 blocks of 20 x 36
    {"experts_heads", {2, 32, 20}, 2},
    {"conv", {16, 4, 3, 3}, 1},       // 16 x 36
    {"conv_tall", {48, 2, 2, 3}, 2},  // 2 blocks of 24 x 12
    {"odd", {37, 53}, 1},
    {"large", {256, 320}, 1},       // bf16: the plain bf16 iterations (m >= 256, n < 8m)
    {"large_tall", {320, 256}, 1},  // the same, transposed
    {"very_wide", {40, 400}, 1},    // n >= 8m
};

struct Coefficients {
  double a, b, c;
};

// DESIGN.md 3, written out again (not shared with the implementations under test).
Coefficients ReferenceCoefficients(NsMethod method, int i, int steps) {
  static const Coefficients kPolar[] = {
      {8.28721201814563, -23.595886519098837, 17.300387312530933},
      {4.107059111542203, -2.9478499167379106, 0.5448431082926601},
      {3.9486908534822946, -2.908902115962949, 0.5518191394370137},
      {3.3184196573706015, -2.488488024314874, 0.51004894012372},
      {2.300652019954817, -1.6689039845747493, 0.4188073119525673},
      {1.891301407787398, -1.2679958271945868, 0.37680408948524835},
      {1.8750014808534479, -1.2500016453999487, 0.3750001645474248},
  };
  if (method != NsMethod::kPolarExpress) return {3.4445, -4.7750, 2.0315};
  Coefficients k = i < 7 ? kPolar[i] : Coefficients{1.875, -1.25, 0.375};
  if (i != steps - 1) {
    k.a /= 1.01;
    k.b /= std::pow(1.01, 3);
    k.c /= std::pow(1.01, 5);
  }
  return k;
}

// The Muon update in float64 (gram is the standard formula in exact arithmetic).
std::vector<double> ReferenceUpdate(const MuonConfig& config, const MatrixSpec& spec,
                                    const std::vector<float>& grad,
                                    const std::vector<float>& momentum) {
  const size_t total = grad.size();
  const double beta = config.momentum;
  std::vector<double> u(total);
  for (size_t i = 0; i < total; ++i) {
    const double m = momentum[i] + (1 - beta) * (grad[i] - static_cast<double>(momentum[i]));
    u[i] = config.nesterov ? grad[i] + beta * (m - grad[i]) : m;
  }
  const MatrixGeometry g = GeometryOf(spec);
  const bool transposed = g.rows > g.cols;
  const int64_t m = std::min(g.rows, g.cols), n = std::max(g.rows, g.cols);
  const double k = config.ns_method == NsMethod::kPolarExpress ? 1.01 : 1.0;
  const double scale = MuonScale(config.scale_mode, g.rows, g.cols);
  std::vector<double> x(m * n), a(m * m), b(m * m), next(m * n);
  for (int64_t blk = 0; blk < g.batch; ++blk) {
    double* block = u.data() + blk * m * n;
    double norm = 0;
    for (int64_t i = 0; i < m * n; ++i) norm += block[i] * block[i];
    norm = std::sqrt(norm) * k + 1e-7;
    for (int64_t r = 0; r < g.rows; ++r) {
      for (int64_t c = 0; c < g.cols; ++c) {
        (transposed ? x[c * n + r] : x[r * n + c]) = block[r * g.cols + c] / norm;
      }
    }
    for (int it = 0; it < config.ns_steps; ++it) {
      const Coefficients co = ReferenceCoefficients(config.ns_method, it, config.ns_steps);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < m; ++j) {
          double s = 0;
          for (int64_t l = 0; l < n; ++l) s += x[i * n + l] * x[j * n + l];
          a[i * m + j] = s;
        }
      }
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < m; ++j) {
          double s = 0;
          for (int64_t l = 0; l < m; ++l) s += a[i * m + l] * a[l * m + j];
          b[i * m + j] = co.b * a[i * m + j] + co.c * s;
        }
      }
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) next[i * n + j] = co.a * x[i * n + j];
        for (int64_t l = 0; l < m; ++l) {
          const double bil = b[i * m + l];
          for (int64_t j = 0; j < n; ++j) next[i * n + j] += bil * x[l * n + j];
        }
      }
      std::swap(x, next);
    }
    for (int64_t r = 0; r < g.rows; ++r) {
      for (int64_t c = 0; c < g.cols; ++c) {
        block[r * g.cols + c] = (transposed ? x[c * n + r] : x[r * n + c]) * scale;
      }
    }
  }
  return u;
}

std::vector<Case> MakeCases(uint32_t seed) { return test_util::MakeCases(kShapes, seed); }

std::string ConfigName(const MuonConfig& c) {
  return absl::StrCat(std::string(common::NsMethodName(c.ns_method)), "/",
                      std::string(common::DTypeName(c.compute_dtype)), "/steps=", c.ns_steps,
                      c.nesterov ? "" : "/no-nesterov",
                      c.scale_mode == ScaleMode::kOriginal ? ""
                      : c.scale_mode == ScaleMode::kNone   ? "/scale=none"
                                                           : "/scale=rms");
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
  auto add = [&](NsMethod method, DType dtype, int steps, bool nesterov, ScaleMode scale,
                 double momentum) {
    MuonConfig c;
    c.ns_method = method;
    c.compute_dtype = dtype;
    c.ns_steps = steps;
    c.nesterov = nesterov;
    c.scale_mode = scale;
    c.momentum = momentum;
    configs.push_back(c);
  };
  add(NsMethod::kStandard, DType::kFloat32, 5, false, ScaleMode::kNone, 0.9);
  add(NsMethod::kStandard, DType::kBFloat16, 7, false, ScaleMode::kMatchRmsAdamw, 0.95);
  add(NsMethod::kGram, DType::kFloat32, 1, true, ScaleMode::kOriginal, 0.95);   // no restart
  add(NsMethod::kGram, DType::kBFloat16, 2, true, ScaleMode::kOriginal, 0.95);  // no restart
  add(NsMethod::kGram, DType::kFloat16, 3, true, ScaleMode::kNone, 0.8);        // restart, 1 after
  add(NsMethod::kPolarExpress, DType::kBFloat16, 9, true, ScaleMode::kMatchRmsAdamw, 0.95);
  add(NsMethod::kPolarExpress, DType::kFloat32, 8, false, ScaleMode::kOriginal, 0.5);
  return configs;
}

TEST(CudaConformanceTest, MatchesCpuAndFloat64WithinBoundsMomentumBitForBit) {
  MUOND_REQUIRE_CUDA_DEVICE(dev);
  SetMathThreads(4);
  std::map<std::string, std::pair<double, double>> worst;  // config -> (vs cpu, vs float64)
  uint32_t seed = 2000;
  for (const MuonConfig& config : AllConfigs()) {
    SCOPED_TRACE(ConfigName(config));
    std::vector<Case> host = MakeCases(seed);
    for (Case& c : host) HostUpdate(config, c);
    std::vector<Case> cases = MakeCases(seed);
    DeviceUpdate(*dev, config, cases);
    if (testing::Test::HasFatalFailure()) return;
    auto& [vs_cpu, vs_f64] = worst[ConfigName(config)];
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& got = cases[i];
      EXPECT_TRUE(SameBits(got.new_momentum, host[i].new_momentum)) << got.spec.name;
      const double e_cpu = RelativeError(got.update, host[i].update);
      const double e_f64 =
          RelativeError(got.update, ReferenceUpdate(config, got.spec, got.grad, got.momentum));
      EXPECT_LT(e_cpu, Bound(config.compute_dtype)) << got.spec.name;
      EXPECT_LT(e_f64, Bound(config.compute_dtype)) << got.spec.name;
      vs_cpu = std::max(vs_cpu, e_cpu);
      vs_f64 = std::max(vs_f64, e_f64);
    }
    seed += 100;
  }
  std::vector<std::string> lines;
  for (const auto& [k, v] : worst) {
    lines.push_back(absl::StrCat(k, ": vs cpu ", v.first, ", vs float64 ", v.second));
  }
  std::printf("worst rel. error of the cuda backend:\n  %s\n",
              absl::StrJoin(lines, "\n  ").c_str());
}

// Qwen3-like blocks: the sizes where cuBLAS picks its tensor-core kernels.
TEST(CudaConformanceTest, LargeMatricesMatchCpu) {
  MUOND_REQUIRE_CUDA_DEVICE(dev);
  SetMathThreads(8);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    MuonConfig config;
    config.compute_dtype = dtype;
    std::vector<Case> host(2), cases;
    host[0].spec = {"k_proj", {1024, 2560}, 8};  // 8 heads of 128 x 2560
    host[1].spec = {"down_proj", {2560, 1024}, 1};
    uint32_t seed = 77;
    for (Case& c : host) {
      c.grad = RandomValues(c.spec.numel(), seed++);
      c.momentum = RandomValues(c.spec.numel(), seed++, 0.5f);
    }
    cases = host;
    for (Case& c : host) HostUpdate(config, c);
    DeviceUpdate(*dev, config, cases);
    if (testing::Test::HasFatalFailure()) return;
    for (size_t i = 0; i < cases.size(); ++i) {
      EXPECT_TRUE(SameBits(cases[i].new_momentum, host[i].new_momentum)) << cases[i].spec.name;
      const double err = RelativeError(cases[i].update, host[i].update);
      EXPECT_LT(err, Bound(dtype)) << cases[i].spec.name << " " << common::DTypeName(dtype);
      std::printf("%s %s: rel. error vs cpu %.3g\n", cases[i].spec.name.c_str(),
                  std::string(common::DTypeName(dtype)).c_str(), err);
    }
  }
}

}  // namespace
}  // namespace muond::server::device
