// The CUDA backend's Newton-Schulz plan (server/device/cuda/cuda_ns_plan.h) run on host memory
// through an emulation of its primitive operations: cublasGemmStridedBatchedEx's column-major
// semantics with fp32 accumulation and one rounding of the result to the output type, casts with
// round-to-nearest-even, copies, the diagonal add. This runs without a GPU and checks what the
// GPU run depends on besides cuBLAS itself: the row-major -> column-major GEMM mapping, the
// workspace choreography of every method and dtype (fp32_iterations, the gram restart), against the
// host's NewtonSchulz within DESIGN.md 3's bounds.
#include "server/device/cuda/cuda_ns_plan.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/optim/muon_math.h"
#include "tests/gpu/cuda_test_util.h"

namespace muond::server::device::cuda {
namespace {

using common::DType;
using common::MuonConfig;
using common::NsMethod;

DType DTypeOf(Elem e) {
  return e == Elem::kF32 ? DType::kFloat32 : e == Elem::kBf16 ? DType::kBFloat16 : DType::kFloat16;
}

std::vector<float> Load(Mat m, int64_t elems) {
  std::vector<float> v(static_cast<size_t>(elems));
  common::ToFloat32(DTypeOf(m.type), m.data, v.size(), v.data());
  return v;
}

void Store(const std::vector<float>& v, Mat m) {
  common::FromFloat32(v.data(), v.size(), DTypeOf(m.type), m.data);
}

class HostNsOps final : public NsOps {
 public:
  absl::Status Gemm(const GemmArgs& g) override {
    ++gemms;
    if (g.m < 1 || g.n < 1 || g.k < 1 || g.batch < 1) return absl::InvalidArgumentError("dims");
    // cuBLAS's leading-dimension rules: the stored column-major operand has ld >= its rows.
    const int a_rows = g.trans_a ? g.k : g.m;
    const int b_rows = g.trans_b ? g.n : g.k;
    if (g.lda < a_rows || g.ldb < b_rows || g.ldc < g.m) {
      return absl::InvalidArgumentError(
          absl::StrCat("leading dimension too small: lda ", g.lda, " ldb ", g.ldb, " ldc ", g.ldc));
    }
    const int64_t a_cols = g.trans_a ? g.m : g.k;
    const int64_t b_cols = g.trans_b ? g.k : g.n;
    const std::vector<float> a = Load(g.a, (g.batch - 1) * g.stride_a + g.lda * a_cols);
    const std::vector<float> b = Load(g.b, (g.batch - 1) * g.stride_b + g.ldb * b_cols);
    const int64_t c_elems = (g.batch - 1) * g.stride_c + int64_t{g.ldc} * g.n;
    std::vector<float> c = Load(g.c, c_elems);
    for (int64_t p = 0; p < g.batch; ++p) {
      const float* pa = a.data() + p * g.stride_a;
      const float* pb = b.data() + p * g.stride_b;
      float* pc = c.data() + p * g.stride_c;
      for (int j = 0; j < g.n; ++j) {
        for (int i = 0; i < g.m; ++i) {
          float acc = 0;
          for (int l = 0; l < g.k; ++l) {
            const float av = g.trans_a ? pa[l + int64_t{i} * g.lda] : pa[i + int64_t{l} * g.lda];
            const float bv = g.trans_b ? pb[j + int64_t{l} * g.ldb] : pb[l + int64_t{j} * g.ldb];
            acc += av * bv;
          }
          float& out = pc[i + int64_t{j} * g.ldc];
          out = g.alpha * acc + (g.beta == 0 ? 0.0f : g.beta * out);  // beta 0: C not read
        }
      }
    }
    Store(c, g.c);
    return absl::OkStatus();
  }
  absl::Status Copy(Mat to, Mat from, int64_t elems) override {
    if (to.type != from.type) return absl::InvalidArgumentError("copy between types");
    std::memmove(to.data, from.data, elems * ElemSize(from.type));
    return absl::OkStatus();
  }
  absl::Status Convert(Mat from, Mat to, int64_t elems) override {
    Store(Load(from, elems), to);
    return absl::OkStatus();
  }
  absl::Status AddDiagonal(Mat p, int64_t blocks, int64_t m, float a) override {
    if (p.type != Elem::kF32) return absl::InvalidArgumentError("diagonal of a 16-bit matrix");
    float* f = static_cast<float*>(p.data);
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t i = 0; i < m; ++i) f[b * m * m + i * m + i] += a;
    }
    return absl::OkStatus();
  }
  int gemms = 0;
};

// Runs the plan on [blocks, rows, cols] fp32 x (normalizing and transposing as cuda_muon.cc's
// kernels do) and returns the result in x's layout.
std::vector<float> PlanNewtonSchulz(const MuonConfig& config, int64_t blocks, int64_t rows,
                                    int64_t cols, const std::vector<float>& x, int* gemms) {
  const bool transposed = rows > cols;
  const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  const NsWorkspace layout(blocks, m, n);
  std::vector<double> storage(layout.total / sizeof(double) + 1);
  HostNsOps ops;
  NsPlan plan(ops, config, blocks, m, n, reinterpret_cast<char*>(storage.data()));
  std::vector<float> input(x.size());
  const float k = static_cast<float>(NsNormFactor(config.ns_method));
  for (int64_t b = 0; b < blocks; ++b) {
    const float* src = x.data() + b * rows * cols;
    double sum = 0;
    for (int64_t i = 0; i < rows * cols; ++i) sum += static_cast<double>(src[i]) * src[i];
    const float denom = static_cast<float>(std::sqrt(sum)) * k + static_cast<float>(kNsNormEpsilon);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        (transposed ? input[b * m * n + c * n + r] : input[b * m * n + r * n + c]) =
            src[r * cols + c] / denom;
      }
    }
  }
  Store(input, Mat{plan.input(), plan.FirstType()});
  Mat result{};
  const absl::Status s = plan.Run(&result);
  EXPECT_TRUE(s.ok()) << s;
  *gemms = ops.gemms;
  const std::vector<float> out = Load(result, blocks * m * n);
  std::vector<float> back(x.size());
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        back[b * rows * cols + r * cols + c] =
            transposed ? out[b * m * n + c * n + r] : out[b * m * n + r * n + c];
      }
    }
  }
  return back;
}

using testing_cuda::Bound;

struct Shape {
  int64_t blocks, rows, cols;
};

TEST(CudaNsPlanTest, EveryMethodAndDtypeMatchesHostNewtonSchulz) {
  SetMathThreads(2);
  const Shape shapes[] = {{1, 24, 40}, {3, 40, 24}, {2, 32, 32}, {4, 8, 72}, {1, 2, 3}, {1, 1, 9}};
  struct Variant {
    NsMethod method;
    int steps;
  };
  const Variant variants[] = {{NsMethod::kStandard, 5},     {NsMethod::kGram, 5},
                              {NsMethod::kPolarExpress, 5}, {NsMethod::kGram, 1},
                              {NsMethod::kGram, 2},         {NsMethod::kGram, 3},
                              {NsMethod::kPolarExpress, 9}, {NsMethod::kStandard, 2}};
  uint32_t seed = 5;
  for (const Variant& v : variants) {
    for (const auto& [dtype, fp32_iterations] :
         {std::pair{DType::kFloat32, 0}, std::pair{DType::kBFloat16, 0},
          std::pair{DType::kBFloat16, 2}, std::pair{DType::kFloat16, 0},
          std::pair{DType::kFloat16, 1}}) {
      MuonConfig config;
      config.fp32_iterations = std::min(fp32_iterations, v.steps);
      config.ns_method = v.method;
      config.ns_steps = v.steps;
      config.compute_dtype = dtype;
      for (const Shape& s : shapes) {
        SCOPED_TRACE(absl::StrCat(std::string(common::NsMethodName(v.method)), " steps ", v.steps,
                                  " fp32_iterations ", config.fp32_iterations, " ",
                                  std::string(common::DTypeName(dtype)), " [", s.blocks, ", ",
                                  s.rows, ", ", s.cols, "]"));
        const std::vector<float> x = testing_cuda::RandomValues(s.blocks * s.rows * s.cols, seed++);
        std::vector<float> want = x;
        ASSERT_TRUE(NewtonSchulz(config, {s.blocks, s.rows, s.cols}, want.data()).ok());
        int gemms = 0;
        const std::vector<float> got =
            PlanNewtonSchulz(config, s.blocks, s.rows, s.cols, x, &gemms);
        EXPECT_LT(testing_cuda::RelativeError(got, want), Bound(dtype, config.fp32_iterations));
        EXPECT_GT(gemms, 0);
      }
    }
  }
}

// bf16 on larger blocks: every iteration bf16 (the default) or the first two in fp32; and a
// transposed block of the same kind.
TEST(CudaNsPlanTest, Bf16LargeBlocksMatchHost) {
  SetMathThreads(2);
  MuonConfig config;
  config.compute_dtype = DType::kBFloat16;
  for (const auto& [s, fp32_iterations] :
       {std::pair{Shape{1, 256, 272}, 0}, std::pair{Shape{1, 272, 256}, 0},
        std::pair{Shape{1, 256, 272}, 2}}) {
    config.fp32_iterations = fp32_iterations;
    const std::vector<float> x = testing_cuda::RandomValues(s.rows * s.cols, 99);
    std::vector<float> want = x;
    ASSERT_TRUE(NewtonSchulz(config, {s.blocks, s.rows, s.cols}, want.data()).ok());
    int gemms = 0;
    const std::vector<float> got = PlanNewtonSchulz(config, s.blocks, s.rows, s.cols, x, &gemms);
    EXPECT_LT(testing_cuda::RelativeError(got, want), Bound(config.compute_dtype, fp32_iterations))
        << s.rows << " x " << s.cols << " fp32_iterations " << fp32_iterations;
    EXPECT_EQ(gemms, 15);  // 3 per iteration
  }
}

// Gram (m != n) does its m x m work in fp32 and only touches X with the long side twice plus
// once per restart: fewer GEMMs on X than the standard method's 2 per iteration.
TEST(CudaNsPlanTest, GramRestartsOnceAndCountsItsProducts) {
  MuonConfig config;
  config.ns_method = NsMethod::kGram;
  const std::vector<float> x = testing_cuda::RandomValues(16 * 64, 3);
  int gemms = 0;
  (void)PlanNewtonSchulz(config, 1, 16, 64, x, &gemms);
  // R0, then per iteration 1 polynomial GEMM (5), R updates (2 each) in iterations 0, 2, 3
  // (not 1: the restart follows; not 4: the last), Q updates in iterations 1, 3, 4, the restart's
  // Q X0 and R, and the final Q X0: 1 + 5 + 6 + 3 + 2 + 1 = 18.
  EXPECT_EQ(gemms, 18);
}

}  // namespace
}  // namespace muond::server::device::cuda
