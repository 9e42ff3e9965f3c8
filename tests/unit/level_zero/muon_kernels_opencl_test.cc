// The Level Zero backend's kernels (server/device/level_zero/kernels/muon_kernels.cl), run through
// OpenCL on whatever platform is installed (PoCL on the CPU here) from the same source file the
// build compiles to SPIR-V: every kernel against a CPU reference on many shapes (odd sizes,
// non-multiples of the tile, 1 x N, N x 1, batched), every storage dtype and transpose. The whole
// Muon update through the driver: muon_driver_opencl_test.cc. Skips (with the reason) when no
// OpenCL platform is available.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/device/level_zero/muon_kernels.h"
#include "server/optim/muon_math.h"
#include "tests/unit/level_zero/muon_kernels_opencl_fixture.h"
#include "tests/unit/level_zero/muon_kernels_test_util.h"

namespace muond::server::device::level_zero {
namespace {

using common::DType;
using common::MuonConfig;
using testutil::RandomValues;

#ifdef MUOND_HAVE_OPENCL

// Unit roundoff of a storage dtype.
double Roundoff(DType d) {
  return d == DType::kFloat32 ? 0x1p-24 : d == DType::kBFloat16 ? 0x1p-8 : 0x1p-11;
}

TEST_F(MuonKernelsOpenClTest, GemmMatchesReferenceForEveryShapeTransposeAndDtype) {
  struct Shape {
    int64_t m, n, k, batch;
  };
  const Shape shapes[] = {{1, 1, 1, 1},    {1, 37, 5, 1},  {37, 1, 5, 1},  {16, 16, 16, 1},
                          {17, 33, 15, 2}, {31, 7, 64, 3}, {5, 70, 19, 1}, {48, 48, 40, 2}};
  struct Types {
    DType in, out;
  };
  const Types types[] = {{DType::kFloat32, DType::kFloat32},  {DType::kBFloat16, DType::kBFloat16},
                         {DType::kFloat16, DType::kFloat16},  {DType::kBFloat16, DType::kFloat32},
                         {DType::kFloat32, DType::kBFloat16}, {DType::kFloat16, DType::kFloat32}};
  uint32_t seed = 1;
  int checked = 0;
  for (const Shape& s : shapes) {
    for (int trans = 0; trans < 4; ++trans) {
      for (const Types& t : types) {
        const bool at = (trans & 1) != 0, bt = (trans & 2) != 0;
        const bool square = s.m == s.n;
        const float alpha = 1.3f, beta = 0.7f, diag = square ? 0.3f : 0.0f;
        SCOPED_TRACE(absl::StrCat(s.m, "x", s.n, "x", s.k, " batch ", s.batch, at ? " A^T" : "",
                                  bt ? " B^T" : "", " in ", std::string(common::DTypeName(t.in)),
                                  " out ", std::string(common::DTypeName(t.out))));
        // Stored shapes: A is m x k (k x m when transposed), B is k x n (n x k).
        const MatrixBatch a_shape{{}, 0, t.in, s.batch, at ? s.k : s.m, at ? s.m : s.k};
        const MatrixBatch b_shape{{}, 0, t.in, s.batch, bt ? s.n : s.k, bt ? s.k : s.n};
        const auto a = testutil::Round(RandomValues(s.batch * s.m * s.k, seed++), t.in);
        const auto b = testutil::Round(RandomValues(s.batch * s.k * s.n, seed++), t.in);
        const auto c = testutil::Round(RandomValues(s.batch * s.m * s.n, seed++), t.out);
        auto da = Upload(a, t.in), db = Upload(b, t.in), dc = Upload(c, t.out);
        auto dout = *queue().Allocate(static_cast<size_t>(s.batch * s.m * s.n * 4));
        MatrixBatch ma = a_shape, mb = b_shape;
        ma.buffer = da->ref();
        mb.buffer = db->ref();
        const MatrixBatch mc{dc->ref(), 0, t.out, s.batch, s.m, s.n};
        const MatrixBatch mo{dout->ref(), 0, t.out, s.batch, s.m, s.n};
        ASSERT_TRUE(Gemm(queue(), ma, at, mb, bt, &mc, alpha, beta, diag, mo).ok());
        const std::vector<float> got = Download(*dout, c.size(), t.out);
        for (int64_t z = 0; z < s.batch; ++z) {
          for (int64_t i = 0; i < s.m; ++i) {
            for (int64_t j = 0; j < s.n; ++j) {
              double sum = 0, mag = 0;
              for (int64_t l = 0; l < s.k; ++l) {
                const double x = a[z * s.m * s.k + (at ? l * s.m + i : i * s.k + l)];
                const double y = b[z * s.k * s.n + (bt ? j * s.k + l : l * s.n + j)];
                sum += x * y;
                mag += std::abs(x * y);
              }
              const double cz = c[z * s.m * s.n + i * s.n + j];
              const double want = alpha * sum + beta * cz + (i == j ? diag : 0.0);
              const double bound =
                  (s.k + 4) * 0x1p-24 * (alpha * mag + std::abs(beta * cz) + diag) +
                  Roundoff(t.out) * std::abs(want) + 1e-7;
              const double g = got[z * s.m * s.n + i * s.n + j];
              ASSERT_LE(std::abs(g - want), bound) << "at " << z << "," << i << "," << j;
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 10000);
}

TEST_F(MuonKernelsOpenClTest, GemmRefusesMismatchedShapesAndAliasing) {
  auto buf = *queue().Allocate(1024);
  auto other = *queue().Allocate(1024);
  const MatrixBatch a{buf->ref(), 0, DType::kFloat32, 1, 4, 5};
  const MatrixBatch out{other->ref(), 0, DType::kFloat32, 1, 4, 4};
  EXPECT_EQ(Gemm(queue(), a, false, a, false, nullptr, 1, 0, 0, out).code(),
            absl::StatusCode::kInvalidArgument);  // 4x5 @ 4x5
  EXPECT_TRUE(Gemm(queue(), a, false, a, true, nullptr, 1, 0, 0, out).ok());
  const MatrixBatch aliased{buf->ref(), 0, DType::kFloat32, 1, 4, 4};
  EXPECT_EQ(Gemm(queue(), a, false, a, true, nullptr, 1, 0, 0, aliased).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Gemm(queue(), a, false, a, true, nullptr, 1, 0.5f, 0, out).code(),
            absl::StatusCode::kInvalidArgument);  // beta without C
}

TEST_F(MuonKernelsOpenClTest, ConvertCastsTransposesAndScalesExactly) {
  struct Shape {
    int64_t rows, cols, batch;
  };
  const Shape shapes[] = {{1, 1, 1}, {1, 40, 1}, {40, 1, 1}, {17, 33, 2}, {16, 16, 1}, {33, 70, 3}};
  // Rounding edge cases: ties to even for bf16 and fp16, fp16 overflow and subnormals, specials.
  const std::vector<float> specials = {1.0f + 0x1p-8f,  1.0f + 3 * 0x1p-8f,
                                       1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f,
                                       70000.0f,        65519.0f,
                                       65520.0f,        1e-8f,
                                       3e-8f,           -0.0f,
                                       std::nanf(""),   INFINITY,
                                       -INFINITY,       3.0e38f,
                                       1e-40f};
  uint32_t seed = 100;
  for (const Shape& s : shapes) {
    const int64_t n = s.rows * s.cols * s.batch;
    std::vector<float> values = RandomValues(n, seed++);
    for (size_t i = 0; i < specials.size() && i < values.size(); ++i) values[i] = specials[i];
    std::vector<float> denom = RandomValues(s.batch, seed++);
    for (float& d : denom) d = 0.5f + std::abs(d);
    auto ddenom = Upload(denom, DType::kFloat32);
    for (bool transpose : {false, true}) {
      for (DType from : kDTypes) {
        for (DType to : kDTypes) {
          for (int mode = 0; mode < 3; ++mode) {  // plain cast, scale, normalize
            SCOPED_TRACE(absl::StrCat(s.rows, "x", s.cols, " batch ", s.batch,
                                      transpose ? " transposed " : " ",
                                      std::string(common::DTypeName(from)), " -> ",
                                      std::string(common::DTypeName(to)), " mode ", mode));
            const std::vector<float> src = testutil::Round(values, from);
            auto dsrc = Upload(src, from);
            auto dout = *queue().Allocate(static_cast<size_t>(n * 4));
            // src is stored as cols x rows when transposed.
            const MatrixBatch msrc{dsrc->ref(),
                                   0,
                                   from,
                                   s.batch,
                                   transpose ? s.cols : s.rows,
                                   transpose ? s.rows : s.cols};
            const MatrixBatch mout{dout->ref(), 0, to, s.batch, s.rows, s.cols};
            const float factor = mode == 1 ? 0.37f : 1.0f;
            const KernelBufferRef dref = ddenom->ref();
            ASSERT_TRUE(
                Convert(queue(), msrc, transpose, mode == 2 ? &dref : nullptr, factor, mout).ok());
            const std::vector<float> got = Download(*dout, static_cast<size_t>(n), to);
            for (int64_t z = 0; z < s.batch; ++z) {
              for (int64_t i = 0; i < s.rows; ++i) {
                for (int64_t j = 0; j < s.cols; ++j) {
                  const int64_t block = s.rows * s.cols;
                  float v = src[z * block + (transpose ? j * s.rows + i : i * s.cols + j)];
                  if (mode == 2) v = v / denom[z];
                  const float want = testutil::Round({v * factor}, to)[0];
                  const float g = got[z * block + i * s.cols + j];
                  if (std::isnan(want)) {
                    ASSERT_TRUE(std::isnan(g)) << i << "," << j;
                  } else if (mode == 0 || std::isinf(want)) {
                    ASSERT_EQ(std::memcmp(&g, &want, 4), 0)
                        << i << "," << j << ": " << g << " vs " << want;
                  } else {
                    // Division may be 2.5 ulp in OpenCL; one unit of the output dtype.
                    ASSERT_LE(std::abs(g - want), 2 * Roundoff(to) * std::abs(want) + 1e-38)
                        << i << "," << j;
                  }
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST_F(MuonKernelsOpenClTest, FrobeniusDenominatorMatchesFloat64) {
  struct Shape {
    int64_t batch, len;
  };
  const Shape shapes[] = {{1, 1}, {1, 63}, {2, 64}, {3, 65}, {2, 1000}, {1, 100000}, {5, 4097}};
  uint32_t seed = 200;
  for (const Shape& s : shapes) {
    for (DType d : kDTypes) {
      SCOPED_TRACE(absl::StrCat(s.batch, " x ", s.len, " ", std::string(common::DTypeName(d))));
      const auto x = testutil::Round(RandomValues(s.batch * s.len, seed++), d);
      auto dx = Upload(x, d);
      auto partial = *queue().Allocate(static_cast<size_t>(s.batch * NormParts(s.len) * 4));
      auto denom = *queue().Allocate(static_cast<size_t>(s.batch * 4));
      const MatrixBatch mx{dx->ref(), 0, d, s.batch, 1, s.len};
      ASSERT_TRUE(
          FrobeniusDenominator(queue(), mx, 1.01f, 1e-7f, partial->ref(), denom->ref()).ok());
      const std::vector<float> got =
          Download(*denom, static_cast<size_t>(s.batch), DType::kFloat32);
      for (int64_t z = 0; z < s.batch; ++z) {
        double sum = 0;
        for (int64_t i = 0; i < s.len; ++i) sum += double{x[z * s.len + i]} * x[z * s.len + i];
        const double want = std::sqrt(sum) * 1.01 + 1e-7;
        EXPECT_NEAR(got[z], want, 1e-5 * want) << "block " << z;
      }
    }
  }
}

TEST_F(MuonKernelsOpenClTest, FlagNonFiniteFindsEveryNanAndInfinity) {
  const int64_t sizes[] = {1, 63, 64, 65, 5000, 300000};
  uint32_t seed = 300;
  for (int64_t n : sizes) {
    SCOPED_TRACE(n);
    std::vector<float> clean = RandomValues(n, seed++);
    clean[0] = 3.0e38f;  // large but finite
    std::vector<std::vector<float>> cases = {clean, clean, clean, clean};
    cases[1][n - 1] = std::nanf("");
    cases[2][0] = INFINITY;
    cases[3][n / 2] = -INFINITY;
    auto flags = *queue().Allocate(cases.size() * 4);
    ASSERT_TRUE(FillInt(queue(), flags->ref(), static_cast<int64_t>(cases.size()), 7).ok());
    ASSERT_TRUE(FillInt(queue(), flags->ref(), static_cast<int64_t>(cases.size()), 0).ok());
    std::vector<std::unique_ptr<QueueBuffer>> held;
    for (size_t c = 0; c < cases.size(); ++c) {
      held.push_back(Upload(cases[c], DType::kFloat32));
      ASSERT_TRUE(
          FlagNonFinite(queue(), held.back()->ref(), 0, n, flags->ref(), static_cast<int32_t>(c))
              .ok());
    }
    int32_t got[4] = {-1, -1, -1, -1};
    ASSERT_TRUE(queue().Read(flags->ref(), 0, got, sizeof(got)).ok());
    EXPECT_EQ(got[0], 0);
    EXPECT_EQ(got[1], 1);
    EXPECT_EQ(got[2], 1);
    EXPECT_EQ(got[3], 1);
  }
}

// The host's Lerp (server/muon/muon_math.cc); this file is compiled without contraction.
float HostLerp(float start, float end, float weight) {
  return std::abs(weight) < 0.5f ? start + weight * (end - start)
                                 : end - (end - start) * (1.0f - weight);
}

TEST_F(MuonKernelsOpenClTest, MomentumIsBitIdenticalToHostLerp) {
  uint32_t seed = 400;
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{100001}}) {
    for (double beta : {0.95, 0.9, 0.5, 0.3, 0.0}) {
      for (bool nesterov : {true, false}) {
        SCOPED_TRACE(absl::StrCat("n ", n, " beta ", beta, nesterov ? " nesterov" : ""));
        const std::vector<float> grad = RandomValues(n, seed++);
        const std::vector<float> mom = RandomValues(n, seed++);
        auto dg = Upload(grad, DType::kFloat32), dm = Upload(mom, DType::kFloat32);
        ASSERT_TRUE(MuonMomentum(queue(), dg->ref(), dm->ref(), n, static_cast<float>(1.0 - beta),
                                 static_cast<float>(beta), nesterov)
                        .ok());
        const std::vector<float> got_u = Download(*dg, static_cast<size_t>(n), DType::kFloat32);
        const std::vector<float> got_m = Download(*dm, static_cast<size_t>(n), DType::kFloat32);
        MuonConfig config;
        config.momentum = beta;
        std::vector<float> want_m = mom;
        ApplyMomentum(config, grad.data(), want_m.data(), static_cast<size_t>(n));
        ASSERT_EQ(std::memcmp(got_m.data(), want_m.data(), want_m.size() * 4), 0);
        for (int64_t i = 0; i < n; ++i) {
          const float want_u =
              nesterov ? HostLerp(grad[i], want_m[i], static_cast<float>(beta)) : want_m[i];
          ASSERT_EQ(std::memcmp(&got_u[i], &want_u, 4), 0) << i;
        }
      }
    }
  }
}

#else  // !MUOND_HAVE_OPENCL

TEST_F(MuonKernelsOpenClTest, KernelsAndDriver) {}  // SetUp skips with the reason

#endif  // MUOND_HAVE_OPENCL

}  // namespace
}  // namespace muond::server::device::level_zero
