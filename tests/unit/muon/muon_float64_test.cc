// MuonUpdate and NewtonSchulz against a float64 evaluation of DESIGN.md 3 computed here, with a
// separate, deliberately plain implementation (one block at a time, standard formula, ATen double
// ops). For the gram method the reference is the standard formula: the two are the same polynomial
// of X, so they agree up to rounding.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/optim/muon_math.h"

namespace muond::server {
namespace {

using common::DType;
using common::MatrixSpec;
using common::MuonConfig;
using common::NsMethod;
using common::ScaleMode;

// Accuracy bounds (rel. Frobenius error against float64, DESIGN.md 3): fp32 1e-4; bf16 5e-2 when
// every iteration is bf16 (fp32_iterations 0, as the reference implementations compute; they
// measure ~3e-2 on transformer shapes), 2e-2 with fp32_iterations >= 2.
// fp16: 3 more mantissa bits than bf16 (unit roundoff 2^-11 vs 2^-8), so ~8x less error; 1e-2
// bounds it with margin for the emulation's extra rounding of elementwise results.
double Bound(DType dtype, int fp32_iterations) {
  switch (dtype) {
    case DType::kFloat32:
      return 1e-4;
    case DType::kBFloat16:
      return fp32_iterations >= 2 ? 2e-2 : 5e-2;
    case DType::kFloat16:
      return 1e-2;
  }
  return 0.0;
}
// The fp32_iterations a dtype is tested with: none and the first two (fp32 computes in fp32).
std::vector<int> Fp32IterationCases(DType dtype) {
  return dtype == DType::kFloat32 ? std::vector<int>{0} : std::vector<int>{0, 2};
}
// "method/dtype" plus "/fp32x2" when the first two iterations are fp32.
std::string Key(NsMethod method, DType dtype, int fp32_iterations) {
  return absl::StrCat(std::string(common::NsMethodName(method)), "/",
                      std::string(common::DTypeName(dtype)),
                      fp32_iterations > 0 ? absl::StrCat("/fp32x", fp32_iterations) : "");
}
constexpr double kMomentumBound = 1e-6;  // fp32 lerp vs double lerp

// ---- The float64 reference (DESIGN.md 3, written out directly). ----

struct Triple {
  double a, b, c;
};

Triple ReferenceCoefficients(NsMethod method, int i, int steps) {
  if (method != NsMethod::kPolarExpress) return {3.4445, -4.7750, 2.0315};
  static const Triple kListed[7] = {{8.28721201814563, -23.595886519098837, 17.300387312530933},
                                    {4.107059111542203, -2.9478499167379106, 0.5448431082926601},
                                    {3.9486908534822946, -2.908902115962949, 0.5518191394370137},
                                    {3.3184196573706015, -2.488488024314874, 0.51004894012372},
                                    {2.300652019954817, -1.6689039845747493, 0.4188073119525673},
                                    {1.891301407787398, -1.2679958271945868, 0.37680408948524835},
                                    {1.8750014808534479, -1.2500016453999487, 0.3750001645474248}};
  Triple t = i < 7 ? kListed[i] : Triple{1.875, -1.25, 0.375};
  if (i != steps - 1) {
    t.a /= 1.01;
    t.b /= std::pow(1.01, 3);
    t.c /= std::pow(1.01, 5);
  }
  return t;
}

at::Tensor ReferenceNs(at::Tensor x, NsMethod method, int steps) {
  const bool transposed = x.size(0) > x.size(1);
  if (transposed) x = x.t();
  const double k = method == NsMethod::kPolarExpress ? 1.01 : 1.0;
  x = x / (x.norm().item<double>() * k + 1e-7);
  for (int i = 0; i < steps; ++i) {
    const Triple t = ReferenceCoefficients(method, i, steps);
    const at::Tensor a = at::matmul(x, x.t());
    const at::Tensor b = t.b * a + t.c * at::matmul(a, a);
    x = t.a * x + at::matmul(b, x);
  }
  return transposed ? x.t() : x;
}

// [blocks, r', c'] view of a tensor of spec.shape: heads are contiguous rows, experts are batches,
// conv weights are [out, in*kh*kw].
at::Tensor ReferenceBlocks(const at::Tensor& t, const MatrixSpec& spec) {
  const std::vector<int64_t>& s = spec.shape;
  const int64_t h = spec.num_heads;
  if (s.size() == 2) return t.reshape({h, s[0] / h, s[1]});
  if (s.size() == 3) return t.reshape({s[0] * h, s[1] / h, s[2]});
  return t.reshape({h, s[0] / h, s[1] * s[2] * s[3]});
}

double ReferenceScale(ScaleMode mode, double r, double c) {
  if (mode == ScaleMode::kOriginal) return std::sqrt(std::max(1.0, r / c));
  if (mode == ScaleMode::kMatchRmsAdamw) return 0.2 * std::sqrt(std::max(r, c));
  return 1.0;
}

// One step in float64; m is updated, the update returned (flat).
at::Tensor ReferenceStep(const MuonConfig& config, const MatrixSpec& spec, const at::Tensor& g,
                         at::Tensor& m) {
  const double beta = config.momentum;
  m = m + (1.0 - beta) * (g - m);
  const at::Tensor u = config.nesterov ? g + beta * (m - g) : m;
  const at::Tensor blocks = ReferenceBlocks(u, spec);
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < blocks.size(0); ++i) {
    const at::Tensor block = blocks[i];
    out.push_back(ReferenceNs(block, config.ns_method, config.ns_steps) *
                  ReferenceScale(config.scale_mode, block.size(0), block.size(1)));
  }
  return at::stack(out).reshape({-1});
}

double RelativeError(const std::vector<float>& got, const at::Tensor& want) {
  const at::Tensor g =
      at::from_blob(const_cast<float*>(got.data()), {static_cast<int64_t>(got.size())}, at::kFloat)
          .to(at::kDouble);
  return (g - want.reshape({-1})).norm().item<double>() / want.norm().item<double>();
}

// ---- The parameterized comparison. ----

struct ShapeCase {
  const char* name;
  std::vector<int64_t> shape;
  int64_t num_heads;
};

const ShapeCase kShapes[] = {
    {"wide", {24, 40}, 1},
    {"tall", {40, 24}, 1},
    {"square", {32, 32}, 1},
    {"per_head", {64, 24}, 4},        // 4 blocks of 16 x 24
    {"per_head_tall", {128, 12}, 4},  // 4 tall blocks of 32 x 12
    {"experts", {3, 20, 36}, 1},      // 3 blocks of 20 x 36
    {"experts_heads", {2, 32, 20}, 2},
    {"conv", {16, 4, 3, 3}, 1},       // 16 x 36
    {"conv_tall", {48, 2, 2, 3}, 2},  // 2 blocks of 24 x 12
    {"very_wide", {12, 160}, 1},      // gram's iteration in bf16 too (ns_gram.cc: n >= 12 m)
};

// Worst errors seen, printed at the end for the record: "method/dtype" -> error.
std::map<std::string, std::pair<double, std::string>>& WorstErrors() {
  static auto* worst = new std::map<std::string, std::pair<double, std::string>>;
  return *worst;
}

class ReportWorstErrors : public testing::Environment {
 public:
  void SetUp() override { SetMathThreads(2); }
  void TearDown() override {
    for (const auto& [key, worst] : WorstErrors()) {
      std::printf("[ float64  ] worst rel. error %-24s %.3e (%s)\n", key.c_str(), worst.first,
                  worst.second.c_str());
    }
  }
};
testing::Environment* const kEnvironment = testing::AddGlobalTestEnvironment(new ReportWorstErrors);

using Param = std::tuple<NsMethod, DType, int>;  // int: index into kShapes

class MuonFloat64Test : public testing::TestWithParam<Param> {};

TEST_P(MuonFloat64Test, ThreeStepsEveryScaleModeAndNesterov) {
  const auto [method, dtype, shape_index] = GetParam();
  const ShapeCase& shape = kShapes[shape_index];
  MatrixSpec spec;
  spec.name = shape.name;
  spec.shape = shape.shape;
  spec.num_heads = shape.num_heads;
  const int64_t n = spec.numel();
  for (int fp32_iterations : Fp32IterationCases(dtype)) {
    const std::string key = Key(method, dtype, fp32_iterations);
    std::mt19937 rng(1234 + shape_index);
    std::normal_distribution<double> normal(0.0, 1.0);
    for (ScaleMode scale : {ScaleMode::kOriginal, ScaleMode::kMatchRmsAdamw, ScaleMode::kNone}) {
      for (bool nesterov : {true, false}) {
        SCOPED_TRACE(absl::StrCat(std::string(common::ScaleModeName(scale)),
                                  nesterov ? " nesterov" : "", " fp32_iterations ",
                                  fp32_iterations));
        MuonConfig config;
        config.fp32_iterations = fp32_iterations;
        config.ns_method = method;
        config.compute_dtype = dtype;
        config.scale_mode = scale;
        config.nesterov = nesterov;
        config.momentum = 0.9;
        std::vector<float> momentum(n, 0.0f);
        std::vector<float> update(n);
        at::Tensor ref_momentum = at::zeros({n}, at::kDouble);
        for (int step = 0; step < 3; ++step) {
          std::vector<float> grad(n);
          for (float& v : grad) v = static_cast<float>(1e-2 * normal(rng));
          const at::Tensor g = at::from_blob(grad.data(), {n}, at::kFloat).to(at::kDouble);
          const at::Tensor want = ReferenceStep(config, spec, g, ref_momentum);
          const absl::Status status =
              MuonUpdate(config, spec, grad.data(), momentum.data(), update.data());
          ASSERT_TRUE(status.ok()) << status;
          const double error = RelativeError(update, want);
          const double momentum_error = RelativeError(momentum, ref_momentum);
          EXPECT_LT(error, Bound(dtype, fp32_iterations)) << "step " << step;
          EXPECT_LT(momentum_error, kMomentumBound) << "step " << step;
          auto& [worst, where] = WorstErrors()[key];
          if (error > worst) {
            worst = error;
            where = shape.name;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllMethodsDtypesShapes, MuonFloat64Test,
    testing::Combine(testing::Values(NsMethod::kStandard, NsMethod::kGram, NsMethod::kPolarExpress),
                     testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                     testing::Range(0, static_cast<int>(sizeof(kShapes) / sizeof(kShapes[0])))),
    [](const testing::TestParamInfo<Param>& info) {
      return absl::StrCat(std::string(common::NsMethodName(std::get<0>(info.param))), "_",
                          std::string(common::DTypeName(std::get<1>(info.param))), "_",
                          kShapes[std::get<2>(info.param)].name);
    });

// Iteration counts around the gram restart (after iteration 2) and beyond the listed Polar
// Express triples, in fp32, on raw NewtonSchulz (no scale).
TEST(MuonFloat64Steps, GramRestartEdgesAndPolarExpressTail) {
  const int64_t batch = 3, rows = 12, cols = 40;
  std::mt19937 rng(99);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> input(batch * rows * cols);
  for (float& v : input) v = static_cast<float>(normal(rng));
  const at::Tensor x = at::from_blob(input.data(), {batch, rows, cols}, at::kFloat).to(at::kDouble);
  for (NsMethod method : {NsMethod::kGram, NsMethod::kPolarExpress, NsMethod::kStandard}) {
    for (int steps : {1, 2, 3, 4, 7, 9}) {
      SCOPED_TRACE(absl::StrCat(std::string(common::NsMethodName(method)), " steps ", steps));
      MuonConfig config;
      config.ns_method = method;
      config.ns_steps = steps;
      std::vector<float> got = input;
      ASSERT_TRUE(NewtonSchulz(config, {batch, rows, cols}, got.data()).ok());
      std::vector<at::Tensor> want;
      for (int64_t b = 0; b < batch; ++b) want.push_back(ReferenceNs(x[b], method, steps));
      EXPECT_LT(RelativeError(got, at::stack(want)), 1e-4);
    }
  }
}

// bf16 on blocks large enough (m >= 256) for newton_schulz.cc's triangle-of-blocks products, with
// a Gaussian input and one of decaying spectrum (singular values ~ 1/i, closer to real momenta),
// every iteration bf16 and with fp32_iterations 2, to the DESIGN.md 3 bounds.
TEST(MuonFloat64Steps, Bf16LargeBlocks) {
  const int64_t rows = 256, cols = 320;
  std::mt19937 rng(5);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> values(rows * cols);
  for (double& v : values) v = normal(rng);
  const at::Tensor gaussian = at::from_blob(values.data(), {rows, cols}, at::kDouble).clone();
  const auto [u, s, vh] = at::linalg_svd(gaussian, /*full_matrices=*/false);
  const at::Tensor decaying =
      at::matmul(u * at::reciprocal(at::arange(1, s.size(0) + 1, at::kDouble)), vh);
  for (NsMethod method : {NsMethod::kStandard, NsMethod::kPolarExpress, NsMethod::kGram}) {
    for (const auto& [name, input] : {std::pair<const char*, at::Tensor>{"gaussian", gaussian},
                                      std::pair<const char*, at::Tensor>{"1/i", decaying}}) {
      for (const auto& [tall, fp32_iterations] :
           {std::pair{false, 0}, std::pair{true, 0}, std::pair{false, 2}, std::pair{true, 2}}) {
        SCOPED_TRACE(absl::StrCat(std::string(common::NsMethodName(method)), " ", name,
                                  tall ? " tall" : " wide", " fp32_iterations ", fp32_iterations));
        const at::Tensor x = (tall ? input.t() : input).contiguous().to(at::kFloat);
        MuonConfig config;
        config.ns_method = method;
        config.compute_dtype = DType::kBFloat16;
        config.fp32_iterations = fp32_iterations;
        std::vector<float> got(x.data_ptr<float>(), x.data_ptr<float>() + x.numel());
        ASSERT_TRUE(NewtonSchulz(config, {1, x.size(0), x.size(1)}, got.data()).ok());
        const double error =
            RelativeError(got, ReferenceNs(x.to(at::kDouble), method, config.ns_steps));
        EXPECT_LT(error, Bound(DType::kBFloat16, fp32_iterations));
        const std::string key = Key(method, DType::kBFloat16, fp32_iterations) + " 256x320";
        auto& [worst, where] = WorstErrors()[key];
        if (error > worst) {
          worst = error;
          where = absl::StrCat(name, tall ? " tall" : " wide");
        }
      }
    }
  }
}

// The polynomial converges towards an orthogonal factor: singular values of a standard 5-step
// result lie in the band the coefficients are designed for (about 0.7 .. 1.2), whatever the input
// scale.
TEST(MuonFloat64Steps, StandardResultIsNearlyOrthogonal) {
  const int64_t rows = 16, cols = 48;
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> x(rows * cols);
  for (float& v : x) v = static_cast<float>(1e3 * normal(rng));
  ASSERT_TRUE(NewtonSchulz(MuonConfig{}, {1, rows, cols}, x.data()).ok());
  const at::Tensor s = at::linalg_svdvals(at::from_blob(x.data(), {rows, cols}, at::kFloat));
  EXPECT_GT(s.min().item<float>(), 0.6f);
  EXPECT_LT(s.max().item<float>(), 1.25f);
}

}  // namespace
}  // namespace muond::server
