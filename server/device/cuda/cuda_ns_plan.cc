#include "server/device/cuda/cuda_ns_plan.h"

#include <algorithm>
#include <utility>

#include "common/status_macros.h"

namespace muond::server::device::cuda {
namespace {

using common::DType;
using common::MuonConfig;
using common::NsMethod;

// The coefficients and constants of newton_schulz.cc (DESIGN.md 3), which this file must match.
struct Coefficients {
  double a, b, c;
};
constexpr Coefficients kStandard{3.4445, -4.7750, 2.0315};
constexpr Coefficients kPolarExpress[] = {
    {8.28721201814563, -23.595886519098837, 17.300387312530933},
    {4.107059111542203, -2.9478499167379106, 0.5448431082926601},
    {3.9486908534822946, -2.908902115962949, 0.5518191394370137},
    {3.3184196573706015, -2.488488024314874, 0.51004894012372},
    {2.300652019954817, -1.6689039845747493, 0.4188073119525673},
    {1.891301407787398, -1.2679958271945868, 0.37680408948524835},
    {1.8750014808534479, -1.2500016453999487, 0.3750001645474248},
};
constexpr int kPolarExpressListed = sizeof(kPolarExpress) / sizeof(kPolarExpress[0]);
constexpr Coefficients kPolarExpressTail{1.875, -1.25, 0.375};
constexpr double kPolarExpressSafety = 1.01;
constexpr int kGramRestartAfter = 2;
constexpr int kBf16Fp32Steps = 2;
constexpr int64_t kBf16SmallSide = 256;
constexpr int64_t kBf16WideRatio = 8;
constexpr size_t kAlign = 256;

Coefficients IterationCoefficients(NsMethod method, int i, int steps) {
  if (method != NsMethod::kPolarExpress) return kStandard;
  Coefficients k = i < kPolarExpressListed ? kPolarExpress[i] : kPolarExpressTail;
  if (i != steps - 1) {
    const double f = kPolarExpressSafety;
    k.a /= f;
    k.b /= f * f * f;
    k.c /= f * f * f * f * f;
  }
  return k;
}

size_t AlignUp(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

}  // namespace

double NsNormFactor(NsMethod method) {
  return method == NsMethod::kPolarExpress ? kPolarExpressSafety : 1.0;
}

NsWorkspace::NsWorkspace(int64_t blocks, int64_t m, int64_t n) {
  e_bytes = AlignUp(static_cast<size_t>(blocks * m * n) * sizeof(float));
  s_bytes = AlignUp(static_cast<size_t>(blocks * m * m) * sizeof(float));
  denom_bytes = AlignUp(static_cast<size_t>(blocks) * sizeof(float));
  partial_bytes = AlignUp(static_cast<size_t>(blocks) * kMaxNormChunks * sizeof(double));
  total = 2 * e_bytes + 5 * s_bytes + denom_bytes + partial_bytes;
}

NsPlan::NsPlan(NsOps& ops, const MuonConfig& config, int64_t blocks, int64_t m, int64_t n,
               char* workspace)
    : ops_(ops), config_(config), blocks_(blocks), m_(m), n_(n) {
  const NsWorkspace layout(blocks, m, n);
  char* p = workspace;
  e_[0] = p;
  e_[1] = p + layout.e_bytes;
  p += 2 * layout.e_bytes;
  for (void*& s : s_) {
    s = p;
    p += layout.s_bytes;
  }
  denom_ = reinterpret_cast<float*>(p);
  partials_ = reinterpret_cast<double*>(p + layout.denom_bytes);
}

Elem NsPlan::FirstType() const {
  return config_.compute_dtype == DType::kFloat16 ? Elem::kF16 : Elem::kF32;
}

absl::Status NsPlan::Run(Mat* out) {
  const int steps = config_.ns_steps;
  const NsMethod method = config_.ns_method;
  const Elem compute = config_.compute_dtype == DType::kFloat32    ? Elem::kF32
                       : config_.compute_dtype == DType::kBFloat16 ? Elem::kBf16
                                                                   : Elem::kF16;
  if (method == NsMethod::kGram && m_ != n_) return GramMethod(compute, out);
  Mat x{e_[0], FirstType()};
  Mat next{e_[1], FirstType()};
  if (compute != Elem::kBf16) {
    RETURN_IF_ERROR(Direct(&x, &next, 0, steps));
    *out = x;
    return absl::OkStatus();
  }
  // bf16 precision plan of newton_schulz.cc: iterations 0 and 1 in fp32, then bf16.
  const int fp32_steps = std::min(kBf16Fp32Steps, steps);
  RETURN_IF_ERROR(Direct(&x, &next, 0, fp32_steps));
  if (fp32_steps < steps) {
    next.type = Elem::kBf16;
    RETURN_IF_ERROR(ops_.Convert(x, next, Elems()));
    std::swap(x, next);
    next.type = Elem::kBf16;
    const bool fp32_polynomial = m_ < kBf16SmallSide || n_ >= kBf16WideRatio * m_;
    RETURN_IF_ERROR(fp32_polynomial ? Fp32Polynomial(&x, &next, fp32_steps, steps)
                                     : Direct(&x, &next, fp32_steps, steps));
  }
  *out = x;
  return absl::OkStatus();
}

// Row-major C[rows, cols] = alpha op(A)[rows, inner] op(B)[inner, cols] + beta C, batched over
// the blocks; ld* are the row lengths of the stored operands, stride* their block strides. A
// row-major matrix is its transpose in column-major order, so this is the column-major
// C^T = op(B)^T op(A)^T: B first, then A, with m = cols and n = rows.
absl::Status NsPlan::RowMajorGemm(bool ta, bool tb, int64_t rows, int64_t cols, int64_t inner,
                                  float alpha, Mat a, int64_t lda, int64_t stride_a, Mat b,
                                  int64_t ldb, int64_t stride_b, float beta, Mat c, int64_t ldc,
                                  int64_t stride_c) {
  GemmArgs g;
  g.trans_a = tb;
  g.trans_b = ta;
  g.m = static_cast<int>(cols);
  g.n = static_cast<int>(rows);
  g.k = static_cast<int>(inner);
  g.alpha = alpha;
  g.a = b;
  g.lda = static_cast<int>(ldb);
  g.stride_a = stride_b;
  g.b = a;
  g.ldb = static_cast<int>(lda);
  g.stride_b = stride_a;
  g.beta = beta;
  g.c = c;
  g.ldc = static_cast<int>(ldc);
  g.stride_c = stride_c;
  g.batch = static_cast<int>(blocks_);
  return ops_.Gemm(g);
}

absl::Status NsPlan::XXt(Mat x, Mat out) {
  return RowMajorGemm(false, true, m_, m_, n_, 1.0f, x, n_, m_ * n_, x, n_, m_ * n_, 0.0f, out,
                      m_, m_ * m_);
}

absl::Status NsPlan::Square(Mat a, Mat b, float alpha, float beta, Mat out) {
  return RowMajorGemm(false, false, m_, m_, m_, alpha, a, m_, m_ * m_, b, m_, m_ * m_, beta, out,
                      m_, m_ * m_);
}

absl::Status NsPlan::Left(Mat p, Mat x, float alpha, float beta, Mat out) {
  return RowMajorGemm(false, false, m_, n_, m_, alpha, p, m_, m_ * m_, x, n_, m_ * n_, beta, out,
                      n_, m_ * n_);
}

absl::Status NsPlan::Direct(Mat* x, Mat* next, int begin, int end) {
  const Mat a{s_[0], x->type};
  const Mat b{s_[1], x->type};
  for (int i = begin; i < end; ++i) {
    const Coefficients k = IterationCoefficients(config_.ns_method, i, config_.ns_steps);
    RETURN_IF_ERROR(XXt(*x, a));
    RETURN_IF_ERROR(ops_.Copy(b, a, Squares()));
    RETURN_IF_ERROR(Square(a, a, static_cast<float>(k.c), static_cast<float>(k.b), b));
    next->type = x->type;
    RETURN_IF_ERROR(ops_.Copy(*next, *x, Elems()));
    RETURN_IF_ERROR(Left(b, *x, 1.0f, static_cast<float>(k.a), *next));
    std::swap(*x, *next);
  }
  return absl::OkStatus();
}

absl::Status NsPlan::Fp32Polynomial(Mat* x, Mat* next, int begin, int end) {
  const Mat a{s_[0], Elem::kBf16};
  const Mat a32{s_[1], Elem::kF32};
  const Mat p{s_[2], Elem::kF32};
  const Mat p16{s_[3], Elem::kBf16};
  for (int i = begin; i < end; ++i) {
    const Coefficients k = IterationCoefficients(config_.ns_method, i, config_.ns_steps);
    RETURN_IF_ERROR(XXt(*x, a));
    RETURN_IF_ERROR(ops_.Convert(a, a32, Squares()));
    RETURN_IF_ERROR(ops_.Copy(p, a32, Squares()));
    RETURN_IF_ERROR(Square(a32, a32, static_cast<float>(k.c), static_cast<float>(k.b), p));
    RETURN_IF_ERROR(ops_.AddDiagonal(p, blocks_, m_, static_cast<float>(k.a)));
    RETURN_IF_ERROR(ops_.Convert(p, p16, Squares()));
    RETURN_IF_ERROR(Left(p16, *x, 1.0f, 0.0f, *next));
    std::swap(*x, *next);
  }
  return absl::OkStatus();
}

absl::Status NsPlan::GramMethod(Elem compute, Mat* out) {
  Mat x0{e_[0], FirstType()};
  Mat spare{e_[1], FirstType()};
  Mat r{s_[0], Elem::kF32}, p{s_[1], Elem::kF32}, q{s_[2], Elem::kF32}, t{s_[3], Elem::kF32};
  const int steps = config_.ns_steps;
  // Q in X0's type for Q X0 (fp32: Q itself).
  auto q_as = [&](Elem type, Mat* qc) -> absl::Status {
    if (type == Elem::kF32) {
      *qc = q;
      return absl::OkStatus();
    }
    *qc = Mat{s_[4], type};
    return ops_.Convert(q, *qc, Squares());
  };
  RETURN_IF_ERROR(XXt(x0, r));  // mixed: X0's type in, fp32 out
  bool q_is_identity = true;
  for (int i = 0; i < steps; ++i) {
    if (i == kGramRestartAfter) {
      Mat qc{};
      RETURN_IF_ERROR(q_as(x0.type, &qc));
      spare.type = x0.type;
      RETURN_IF_ERROR(Left(qc, x0, 1.0f, 0.0f, spare));
      if (x0.type != compute) {
        x0.type = compute;
        RETURN_IF_ERROR(ops_.Convert(spare, x0, Elems()));
      } else {
        std::swap(x0, spare);
      }
      RETURN_IF_ERROR(XXt(x0, r));
      q_is_identity = true;
    }
    const Coefficients k = IterationCoefficients(config_.ns_method, i, steps);
    RETURN_IF_ERROR(ops_.Copy(p, r, Squares()));
    RETURN_IF_ERROR(Square(r, r, static_cast<float>(k.c), static_cast<float>(k.b), p));
    RETURN_IF_ERROR(ops_.AddDiagonal(p, blocks_, m_, static_cast<float>(k.a)));
    if (i + 1 < steps && i + 1 != kGramRestartAfter) {
      RETURN_IF_ERROR(Square(r, p, 1.0f, 0.0f, t));
      RETURN_IF_ERROR(Square(p, t, 1.0f, 0.0f, r));
    }
    if (q_is_identity) {
      std::swap(q, p);
      q_is_identity = false;
    } else {
      RETURN_IF_ERROR(Square(p, q, 1.0f, 0.0f, t));
      std::swap(q, t);
    }
  }
  Mat qc{};
  RETURN_IF_ERROR(q_as(x0.type, &qc));
  spare.type = x0.type;
  RETURN_IF_ERROR(Left(qc, x0, 1.0f, 0.0f, spare));
  *out = spare;
  return absl::OkStatus();
}

}  // namespace muond::server::device::cuda
