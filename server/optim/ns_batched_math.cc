// See ns_batched_math.h. The products of one Newton-Schulz iteration, by dtype.
#include "server/optim/ns_batched_math.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "server/optim/symmetric_products.h"

namespace muond::server::internal {
namespace {

// m*k*n of one block at or below which a bf16 product is evaluated in fp32 (see Bmm); a margin
// above LibTorch's own threshold (16^3 per batched product), still negligible work.
constexpr int64_t kSmallBf16Gemm = int64_t{1} << 16;

// bf16 blocks with m >= kTriangleMinRows compute X X^T and A A one triangle at a time: block rows
// of about kTriangleBlockRows rows (equal parts, so no part is tiny), each one oneDNN GEMM of its
// rows against the rows from its first one on. With 128-row parts a 1024-row block costs 36/64 of
// the full product; every part's GEMM is >= 64 x 64 x 256, far above oneDNN's small-GEMM cutoff,
// so each is rounded once, as one full GEMM is.
constexpr int64_t kTriangleMinRows = 256;
constexpr int64_t kTriangleBlockRows = 128;

// Per block m*k*n at or below kSmallBf16Gemm (independent of the batch size).
bool SmallPerBlock(const at::Tensor& a, const at::Tensor& b) {
  return a.size(1) * a.size(2) * b.size(2) <= kSmallBf16Gemm;
}

// out [m, m] = beta * c + alpha * (y y^T) for y [m, k] (c undefined: out = y y^T), computed on
// the upper triangle's block rows and mirrored, so out is exactly symmetric. scratch holds at
// least kTriangleBlockRows * 2 * m elements of out's dtype.
void TriangleProduct(const at::Tensor& y, const at::Tensor& c, double beta, double alpha,
                     at::Tensor& out, at::Tensor& scratch) {
  const int64_t m = y.size(0);
  const int64_t parts = (m + kTriangleBlockRows - 1) / kTriangleBlockRows;
  for (int64_t part = 0; part < parts; ++part) {
    const int64_t r0 = m * part / parts;
    const int64_t rows = m * (part + 1) / parts - r0;
    const int64_t cols = m - r0;
    at::Tensor t = scratch.narrow(0, 0, rows * cols).view({rows, cols});
    const at::Tensor lhs = y.narrow(0, r0, rows);
    const at::Tensor rhs = y.narrow(0, r0, cols).t();
    if (c.defined()) {
      at::addmm_out(t, c.narrow(0, r0, rows).narrow(1, r0, cols), lhs, rhs, beta, alpha);
    } else {
      at::mm_out(t, lhs, rhs);
    }
    out.narrow(0, r0, rows).narrow(1, r0, cols).copy_(t);
  }
  MirrorUpper(static_cast<uint16_t*>(out.data_ptr()), m);
}

}  // namespace

ScopedSingleAtenThread::ScopedSingleAtenThread(bool active)
    : saved_(omp_get_max_threads()), active_(active && saved_ != 1) {
  if (active_) omp_set_num_threads(1);
}

ScopedSingleAtenThread::~ScopedSingleAtenThread() {
  if (active_) omp_set_num_threads(saved_);
}

void BatchedMath::Iteration(const at::Tensor& x, const ns::Coefficients& k, at::Tensor& a,
                            at::Tensor& p, at::Tensor& next) {
  if (storage_ == at::kFloat) return BlasIteration(x, k, a, p, next);
  if (storage_ == at::kBFloat16 && x.size(1) >= kTriangleMinRows) {
    return Bf16TriangleIteration(x, k, a, p, next);
  }
  Bmm("bmm(X, X^T)", x, x.transpose(1, 2), a);
  Baddbmm("baddbmm(b A + c A A)", a, a, a, k.b, k.c, p);
  Baddbmm("baddbmm(a X + B X)", x, p, x, k.a, 1.0, next);
}

void BatchedMath::BlasIteration(const at::Tensor& x, const ns::Coefficients& k, at::Tensor& a,
                                at::Tensor& p, at::Tensor& next) {
  const int64_t batch = x.size(0), m = x.size(1), n = x.size(2);
  const float* xd = x.data_ptr<float>();
  float* ad = a.data_ptr<float>();
  float* pd = p.data_ptr<float>();
  float* nd = next.data_ptr<float>();
  *op_ = "syrk(X X^T)";
  for (int64_t j = 0; j < batch; ++j) SymmetricGram(xd + j * m * n, m, n, ad + j * m * m);
  RoundToCompute(a);
  *op_ = "syrk(b A + c A A)";
  for (int64_t j = 0; j < batch; ++j) {
    SymmetricPolynomial(ad + j * m * m, m, static_cast<float>(k.b), static_cast<float>(k.c),
                        pd + j * m * m);
  }
  RoundToCompute(p);
  *op_ = "symm(a X + P X)";
  for (int64_t j = 0; j < batch; ++j) {
    SymmetricApply(pd + j * m * m, xd + j * m * n, m, n, static_cast<float>(k.a), nd + j * m * n);
  }
  RoundToCompute(next);
}

void BatchedMath::Bf16TriangleIteration(const at::Tensor& x, const ns::Coefficients& k,
                                        at::Tensor& a, at::Tensor& p, at::Tensor& next) {
  const int64_t m = x.size(1);
  at::Tensor scratch = at::empty({2 * kTriangleBlockRows * m}, x.options());
  for (int64_t j = 0; j < x.size(0); ++j) {
    const at::Tensor xj = x[j];
    at::Tensor aj = a[j], pj = p[j], nj = next[j];
    *op_ = "mm(X, X^T) (upper block rows)";
    TriangleProduct(xj, at::Tensor(), 0.0, 1.0, aj, scratch);
    *op_ = "addmm(b A + c A A) (upper block rows)";
    TriangleProduct(aj, aj, k.b, k.c, pj, scratch);
    *op_ = "addmm(a X + P X)";
    at::addmm_out(nj, xj, pj, xj, k.a, 1.0);
  }
}

void BatchedMath::Bmm(const char* op, const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  *op_ = op;
  if (out.scalar_type() == at::kBFloat16 && SmallPerBlock(a, b)) {
    // Whether LibTorch sends a bf16 product to oneDNN depends on batch*m*k*n; computed in fp32
    // and rounded once, a small block's bits do not depend on the batch it is in.
    out.copy_(at::bmm(a.to(at::kFloat), b.to(at::kFloat)));
    return;
  }
  at::bmm_out(out, a, b);
  RoundToCompute(out);
}

void BatchedMath::Baddbmm(const char* op, const at::Tensor& c, const at::Tensor& a,
                          const at::Tensor& b, double beta, double alpha, at::Tensor& out) {
  *op_ = op;
  if (out.scalar_type() == at::kBFloat16 && SmallPerBlock(a, b)) {
    // LibTorch 1.13 sends small bf16 GEMMs (below oneDNN's 16^3 threshold, counted over the
    // whole batch) to a kernel that rounds beta * C to bf16 before adding the product: a second
    // rounding, and bits that would depend on the batch size. Small blocks are computed in fp32
    // and rounded once instead.
    out.copy_(at::baddbmm(c.to(at::kFloat), a.to(at::kFloat), b.to(at::kFloat), beta, alpha));
    return;
  }
  at::baddbmm_out(out, c, a, b, beta, alpha);
  RoundToCompute(out);
}

void BatchedMath::RoundToCompute(at::Tensor& t) {
  if (emulate_half_) t.copy_(t.to(at::kHalf));
}

at::Tensor BatchedMath::ToCompute(const char* op, const at::Tensor& t) {
  *op_ = op;
  at::Tensor out = t.to(storage_, /*non_blocking=*/false, /*copy=*/true);
  RoundToCompute(out);
  return out;
}

}  // namespace muond::server::internal
