// The Gram Newton-Schulz iteration (DESIGN.md 3, method `gram`) on the CPU, and the rule for the
// shapes it runs on.
//
// With X_k = Q_k X_0 and R_k = X_k X_k^T, one iteration is P = a I + b R + c R^2,
// X_{k+1} = P X_k, hence Q_{k+1} = P Q_k and R_{k+1} = P R_k P: everything but the first R and the
// final X = Q X_0 is an m x m product, which is cheaper when n >> m. After kGramRestartAfter
// iterations: X_0 <- Q X_0, R <- X_0 X_0^T, Q <- I (bounds the error the m x m products
// accumulate). R, P and Q are polynomials in the same R_0, so they commute and are symmetric:
//   P = b R + c R R           SYRK of R                   m^3 / 2
//   R <- P R P = R P^2        SYRK of P, then SYMM         3 m^3 / 2
//   Q <- P Q                  SYMM                         m^3
//   R = X X^T                 SYRK (m x n)                 m^2 n / 2
//   X = Q X_0                 SYMM (fp32) or GEMM (bf16)   m^2 n
// (multiply-adds; the symmetric results are mirrored so they stay exactly symmetric).
//
// Precision: the m x m side (R, P, Q) is fp32 whatever the compute dtype, and R is computed in
// fp32 from X's values: R squares X's condition number, and rounding R, P and Q to bf16 measured
// ~8% error against float64 on small blocks (5.6e-2 for R alone with singular values ~1/i). The
// m x n product Q X_0 runs in the compute dtype (fp32 when the job asks for fp32 iterations that
// cover it).
//
// Which shapes: GramPays compares the multiply-adds of both methods for the block's m, n and
// iteration count, the fp32 m x m work weighted by its cost per FLOP against the compute dtype's
// GEMMs; `gram` runs the Gram iteration only where it is cheaper and the standard one elsewhere
// (always on square blocks, as DESIGN.md 3 says). With 5 iterations: fp32 compute from n >= 1.7 m
// (at n = 2 m: 16 m^3 against 17.5 m^3; at n = 4 m: 22 against 32.5); bf16 compute, whose m x m
// side is fp32 at ~1/3 of a bf16 GEMM's rate here, from n >= 12 m.
#include <algorithm>
#include <cstdint>
#include <utility>

#include "server/optim/ns_batched_math.h"
#include "server/optim/symmetric_products.h"

namespace muond::server::internal {
namespace {

using ns::Coefficients;
using ns::IterationCoefficients;
using ns::kGramRestartAfter;

float* Block(at::Tensor& t, int64_t j) { return t.data_ptr<float>() + j * t.size(1) * t.size(2); }

// r [b, m, m] = x x^T in fp32 (x widened first when it is not fp32).
void Gram(BatchedMath& fp32_math, const at::Tensor& x, at::Tensor& r) {
  fp32_math.SetOp("syrk(X0 X0^T)");
  at::Tensor x32 = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const int64_t m = x32.size(1), n = x32.size(2);
  ScopedSingleAtenThread blas(true);
  for (int64_t j = 0; j < x32.size(0); ++j) SymmetricGram(Block(x32, j), m, n, Block(r, j));
}

// Q x in x_math's dtype; q [b, m, m] symmetric fp32.
at::Tensor ApplyQ(BatchedMath& x_math, at::Tensor& q, const at::Tensor& x, Scratch slot,
                  const char* op) {
  at::Tensor out = ScratchTensor(slot, x.sizes(), x.scalar_type());
  if (x_math.storage() != at::kFloat) {
    x_math.Bmm(op, x_math.ToCompute("cast Q", q), x, out);
    return out;
  }
  // Emulated bf16 rounds Q to bf16 as the native product's operand (still exactly symmetric).
  at::Tensor qc = x_math.emulation() == Emulation::kBf16 ? x_math.ToCompute("cast Q", q) : q;
  x_math.SetOp(op);
  at::Tensor xc = x;
  const int64_t m = x.size(1), n = x.size(2);
  ScopedSingleAtenThread blas(true);
  for (int64_t j = 0; j < x.size(0); ++j)
    SymmetricApply(Block(qc, j), Block(xc, j), m, n, 0.0f, Block(out, j));
  x_math.RoundToCompute(out);
  return out;
}

// p = a I + b r + c r r (full, symmetric).
void Polynomial(BatchedMath& fp32_math, const Coefficients& k, at::Tensor& r, at::Tensor& p) {
  fp32_math.SetOp("syrk(b R + c R R)");
  const int64_t m = r.size(1);
  for (int64_t j = 0; j < r.size(0); ++j) {
    float* pj = Block(p, j);
    SymmetricPolynomial(Block(r, j), m, static_cast<float>(k.b), static_cast<float>(k.c), pj);
    MirrorUpper(pj, m);
    for (int64_t d = 0; d < m; ++d) pj[d * m + d] += static_cast<float>(k.a);
  }
}

// out = left right for symmetric left (upper read) and right commuting with it: the product is
// symmetric in exact arithmetic and is made exactly so.
void CommutingProduct(at::Tensor& left, at::Tensor& right, at::Tensor& out) {
  const int64_t m = left.size(1);
  for (int64_t j = 0; j < left.size(0); ++j) {
    SymmetricApply(Block(left, j), Block(right, j), m, m, 0.0f, Block(out, j));
    MirrorUpper(Block(out, j), m);
  }
}

}  // namespace

at::Tensor GramIterations(BatchedMath& long_math, BatchedMath& fp32_math, bool first_long_fp32,
                          bool rest_long_fp32, common::NsMethod method, int steps, at::Tensor x0) {
  const int64_t batch = x0.size(0), m = x0.size(1);
  at::Tensor r = ScratchTensor(Scratch::kGramR, {batch, m, m}, at::kFloat);
  at::Tensor p = ScratchTensor(Scratch::kGramP, {batch, m, m}, at::kFloat);
  at::Tensor q = ScratchTensor(Scratch::kGramQ, {batch, m, m}, at::kFloat);
  at::Tensor t = ScratchTensor(Scratch::kGramT, {batch, m, m}, at::kFloat);
  at::Tensor s = ScratchTensor(Scratch::kGramS, {batch, m, m}, at::kFloat);
  BatchedMath* x_math = first_long_fp32 ? &fp32_math : &long_math;
  at::Tensor x = first_long_fp32 ? x0 : long_math.ToCompute("cast X0", x0);
  Gram(fp32_math, x, r);
  bool q_is_identity = true;  // Q = I is implicit: not stored, not multiplied
  for (int i = 0; i < steps; ++i) {
    if (i == kGramRestartAfter) {
      x = ApplyQ(*x_math, q, x, Scratch::kGramX1, "Q X0 (restart)");
      if (!rest_long_fp32 && x_math != &long_math) {
        x_math = &long_math;
        x = long_math.ToCompute("cast X (restart)", x);
      }
      Gram(fp32_math, x, r);
      q_is_identity = true;
    }
    const Coefficients k = IterationCoefficients(method, i, steps);
    ScopedSingleAtenThread blas(true);
    Polynomial(fp32_math, k, r, p);
    // R is needed by the next iteration unless that one restarts from X.
    if (i + 1 < steps && i + 1 != kGramRestartAfter) {
      fp32_math.SetOp("R P^2");
      for (int64_t j = 0; j < batch; ++j) SymmetricGram(Block(p, j), m, m, Block(t, j));
      CommutingProduct(t, r, s);
      std::swap(r, s);
    }
    if (q_is_identity) {
      std::swap(q, p);
      q_is_identity = false;
    } else {
      fp32_math.SetOp("P Q");
      CommutingProduct(p, q, t);
      std::swap(q, t);
    }
  }
  // Not kGramX1: x may be the restart's product.
  return ApplyQ(*x_math, q, x, Scratch::kGramX2, "Q X0");
}

bool GramPays(int64_t m, int64_t n, int steps, double fp32_weight) {
  if (m >= n) return false;
  const double mm = static_cast<double>(m) * m, mmm = mm * m, mmn = mm * n;
  // Standard, symmetric products: 1.5 m^2 n + 0.5 m^3 per iteration, all in the compute dtype.
  const double standard = steps * (1.5 * mmn + 0.5 * mmm);
  double long_side = 0, fp32_side = 0.5 * mmn;  // the first R
  bool q_is_identity = true;
  for (int i = 0; i < steps; ++i) {
    if (i == kGramRestartAfter) {
      long_side += mmn;        // Q X0
      fp32_side += 0.5 * mmn;  // R
      q_is_identity = true;
    }
    fp32_side += 0.5 * mmm;                                                   // P
    if (i + 1 < steps && i + 1 != kGramRestartAfter) fp32_side += 1.5 * mmm;  // R P^2
    if (!q_is_identity) fp32_side += mmm;                                     // P Q
    q_is_identity = false;
  }
  long_side += mmn;  // the final Q X0
  return long_side + fp32_weight * fp32_side < standard;
}

}  // namespace muond::server::internal
