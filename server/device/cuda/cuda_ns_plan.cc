#include "server/device/cuda/cuda_ns_plan.h"

#include <algorithm>
#include <utility>

#include "common/status_macros.h"
#include "server/optim/ns_schedule.h"

namespace muond::server::device::cuda {
namespace {

using common::DType;
using common::MuonConfig;
using common::NsMethod;

using ns::Coefficients;
using ns::IterationCoefficients;
using ns::kGramRestartAfter;

constexpr size_t kAlign = 256;

size_t AlignUp(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

}  // namespace

double NsNormFactor(NsMethod method) { return ns::NormFactor(method); }

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

Elem NsPlan::Compute() const {
  switch (config_.compute_dtype) {
    case DType::kFloat32:
      return Elem::kF32;
    case DType::kBFloat16:
      return Elem::kBf16;
    case DType::kFloat16:
      return Elem::kF16;
  }
  return Elem::kF32;
}

int NsPlan::Fp32Steps() const {
  const int steps = config_.ns_steps;
  return Compute() == Elem::kF32 ? steps : std::clamp(config_.fp32_iterations, 0, steps);
}

// The precision plan of newton_schulz.cc (DESIGN.md 3): bf16 and fp16 run every iteration in
// that dtype unless the job asks for fp32_iterations, which run first, in fp32.
Elem NsPlan::FirstType() const { return Fp32Steps() > 0 ? Elem::kF32 : Compute(); }

absl::Status NsPlan::Run(Mat* out) {
  const int steps = config_.ns_steps;
  const Elem compute = Compute();
  if (config_.ns_method == NsMethod::kGram && m_ != n_) return GramMethod(compute, out);
  Mat x{e_[0], FirstType()};
  Mat next{e_[1], FirstType()};
  const int fp32_steps = Fp32Steps();
  RETURN_IF_ERROR(Direct(&x, &next, 0, fp32_steps));
  if (fp32_steps < steps) {
    if (x.type != compute) {
      next.type = compute;
      RETURN_IF_ERROR(ops_.Convert(x, next, Elems()));
      std::swap(x, next);
      next.type = compute;
    }
    RETURN_IF_ERROR(Direct(&x, &next, fp32_steps, steps));
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
  return RowMajorGemm(false, true, m_, m_, n_, 1.0f, x, n_, m_ * n_, x, n_, m_ * n_, 0.0f, out, m_,
                      m_ * m_);
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
      // After the restart X0 is in the compute dtype, unless the fp32 iterations cover it.
      if (x0.type != compute && Fp32Steps() <= kGramRestartAfter) {
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
