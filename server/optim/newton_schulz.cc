// Newton-Schulz orthogonalization (DESIGN.md 3, NS(X)) on the CPU with LibTorch. The only file of
// server/muon that includes LibTorch headers; every LibTorch exception is caught here.
//
// Layout: the caller's fp32 buffer is wrapped without a copy (at::from_blob) as [batch, rows,
// cols]. Blocks with rows > cols are processed transposed, so every product below works on X of
// shape [batch, m, n] with m <= n, and each product is one batched GEMM (bmm/baddbmm) over all
// blocks.
//
// Compute dtypes:
//  - float32: fp32 tensors; each iteration is the symmetric products of symmetric_products.h
//    through the system BLAS: X X^T and A A by SYRK (one triangle, half a GEMM's FLOPs), B X by
//    SYMM. Per iteration on [m, n]: 1.5 m^2 n + 0.5 m^3 multiply-adds instead of 2 m^2 n + m^3.
//  - bfloat16: LibTorch 1.13 routes bf16 bmm/baddbmm to oneDNN (AVX-512 BF16 on this CPU),
//    accumulating in fp32 and rounding each op's result to bf16 once. Not every op runs in bf16:
//    see "bf16 precision plan" below (the first iterations and the m x m side are fp32).
//  - float16: LibTorch 1.13's CPU GEMM has no Half kernel ("addmm_impl_cpu_" not implemented for
//    'Half'), so fp16 is emulated: tensors hold fp16-representable values in fp32 storage, each
//    GEMM accumulates in fp32 (like an fp16 GEMM with fp32 accumulation on a GPU) and each op's
//    result is rounded to fp16 (nearest even, overflow to inf). It runs at fp32 GEMM speed plus the
//    rounding passes: it exists for parity with fp16 device backends, not for speed.
//
// Normalization: the per-block Frobenius norm is taken in fp32 on the caller's data and X / (norm*k
// + 1e-7) is computed in fp32 (and, for fp16, rounded to it once), instead of rounding X, then the
// quotient: the same formula with one rounding fewer.
//
// bf16 precision plan (DESIGN.md 3: rel. error < 2e-2 against float64 for every method). Measured
// with a float64 emulation of each op's rounding (bf16 = round-to-nearest of the fp32 result, as
// oneDNN does), worst rel. Frobenius error over 20 Gaussian inputs for each shape of
// muon_float64_test (12x24 .. 32x32 blocks), standard / polar_express:
//   every op bf16 (the plain formula in bf16; the previous implementation)   1.9e-2 / 4.1e-2
//   + P = a I + b A + c A A kept in fp32, X <- bf16(P) @ X                    1.6e-2 / 4.2e-2
//   + iteration 0 in fp32                                                    1.5e-2 / 3.3e-2
//   + iterations 0 and 1 in fp32 (the plan below)                            9.7e-3 / 1.3e-2
//   iterations 0 and 1 in fp32, then the plain formula in bf16               1.5e-2 / 1.2e-2
// The error comes from the first two iterations: the normalized input has singular values far
// below 1, and rounding X, A or P there puts an error of 2^-9 of the largest singular directions
// into the small ones, which the next iterations grow by a^k (a = 3.4 standard, 8.3 then 4.1 Polar
// Express) towards 1. Single-op attribution (polar_express): rounding P in iteration 0 alone costs
// 3.5e-2, X in iteration 1 alone 2.0e-2; from iteration 2 on no single rounding costs more than
// 6e-3. Gradients are often of low effective rank, which makes this worse: with singular values
// ~1/i, a 512 x 512 block in plain bf16 measured 2.3e-2 (over the bound), with the plan 8.1e-3.
// Limit: much steeper spectra still exceed it (~1/i^1.5 on 256 x 256: 1.8e-2; ~1/i^2: 2.7e-2;
// both ~1e-2 with three fp32 iterations): 5 iterations leave such inputs far from converged and
// every bf16 rounding shows in their small directions.
// muon_float64_test measures (its Gaussian inputs) standard 9.6e-3, gram 9.6e-3 (square, i.e.
// standard; 4.9e-3 on the others), polar_express 1.1e-2, and ~1e-2 on 256 x 320 blocks.
// Hence, for bf16:
//  - iterations 0 and 1 (kBf16Fp32Steps) run in fp32 on the fp32-normalized input;
//  - the later ones keep the two products that touch the long side, A = X X^T and the update
//    (the O(m^2 n) GEMMs), in bf16, and compute the m x m polynomial P = a I + b A + c A A in fp32
//    (X <- bf16(P) @ X) when that is cheap or the block is small (m < 256 or n >= 8m: measured
//    above); for large near-square blocks, where A A is a third of the work, it is the plain
//    formula in bf16 (measured 1.0e-2 .. 1.1e-2 on 256^2 .. 512x1024 Gaussian blocks, 7e-3 .. 9e-3
//    with singular values ~1/i; on the small blocks above 1.5e-2, and 1.9e-2 with singular values
//    ~1/sqrt(i), hence the m < 256 rule);
//  - gram: its products before the restart (R = X0 X0^T and Q X0: the same two iterations) in
//    fp32, and R = X X^T always in fp32 (see GramIterations); only the final Q X is bf16.
// Cost: two fp32 iterations of five, i.e. 6 of the 15 GEMMs of a square block (fewer for gram).
// Measured with `muond-bench ns` (standard, square n x n, 2 threads; GFLOP/s, n = 512/1024):
//   bf16 NS, this plan                78-85 / 90-94   (bf16 matmul ~166)
//   bf16 NS, every op bf16 (before)  157 / 162
//   fp32 NS                           53-57 / 61-62   (fp32 matmul ~62-65)
// fp32 GEMMs are OpenBLAS's (pthreads build, its own threads); ATen's libgomp workers spin while
// they run and take the cores from them (fp32 NS at 512: ~33 with 2 OpenMP threads), so the fp32
// GEMM phases run with one OpenMP thread (ScopedSingleAtenThread). bf16 stays the fastest compute
// dtype, by ~1.2-1.5x over fp32 rather than ~2.5x: two of five iterations in fp32 cap bf16 NS at
// ~0.6 of a bf16 matmul; that is the price of the DESIGN.md 3 bound (the all-bf16 formula exceeds
// it: 3.3e-2 in the tests, 2.3e-2 on a 512 x 512 block with singular values ~1/i). The float16
// emulation is fp32-GEMM bound likewise.
#include "server/optim/newton_schulz.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <omp.h>

#include <algorithm>
#include <exception>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "server/optim/ns_schedule.h"
#include "server/optim/symmetric_products.h"

namespace muond::server {
namespace {

using common::DType;
using common::MuonConfig;
using common::NsMethod;

using ns::Bf16PolynomialInFp32;
using ns::Coefficients;
using ns::IterationCoefficients;
using ns::kBf16Fp32Steps;
using ns::kGramRestartAfter;
using ns::kNormEpsilon;

// m*k*n of one block at or below which a bf16 product is evaluated in fp32 (see BatchedMath); a
// margin above LibTorch's own threshold (16^3 per batched product), still negligible work.
constexpr int64_t kSmallBf16Gemm = int64_t{1} << 16;

// fp32 products are OpenBLAS GEMMs, which run on OpenBLAS's own threads; ATen's OpenMP workers
// (used by oneDNN's bf16 GEMMs and the elementwise ops) then only spin and take the cores from
// them: measured at 512 x 512, fp32 Newton-Schulz runs at ~33 GFLOP/s with 2 OpenMP threads and
// ~55 with 1 (an fp32 matmul: ~63). Work that is fp32 GEMMs runs with one OpenMP thread; the
// previous count is restored on leaving. OpenMP's thread count is a setting of the calling thread
// (other threads are not affected). at::set_num_threads is not used: it also rebuilds LibTorch's
// pthreadpool on every change, creating threads per call.
class ScopedSingleAtenThread {
 public:
  explicit ScopedSingleAtenThread(bool active)
      : saved_(omp_get_max_threads()), active_(active && saved_ != 1) {
    if (active_) omp_set_num_threads(1);
  }
  ~ScopedSingleAtenThread() {
    if (active_) omp_set_num_threads(saved_);
  }
  ScopedSingleAtenThread(const ScopedSingleAtenThread&) = delete;
  ScopedSingleAtenThread& operator=(const ScopedSingleAtenThread&) = delete;

 private:
  const int saved_;
  const bool active_;
};

// The batched products in one dtype (the compute dtype, or fp32 for the m x m side and bf16's fp32
// iterations). `*op` names the op in flight for error messages; it is shared between instances.
class BatchedMath {
 public:
  BatchedMath(at::ScalarType storage, bool emulate_half, const char** op)
      : storage_(storage), emulate_half_(emulate_half), op_(op) {}

  // out = a @ b
  void Bmm(const char* op, const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
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
  // out = beta * c + alpha * (a @ b); out must not alias an input.
  void Baddbmm(const char* op, const at::Tensor& c, const at::Tensor& a, const at::Tensor& b,
               double beta, double alpha, at::Tensor& out) {
    *op_ = op;
    if (out.scalar_type() == at::kBFloat16 && SmallPerBlock(a, b)) {
      // LibTorch 1.13 sends small bf16 GEMMs (below oneDNN's 16^3 threshold, counted over the
      // whole batch) to a kernel that rounds beta * C to bf16 before adding the product: a second
      // rounding that costs ~4x the error against float64 here, and bits that would depend on the
      // batch size. Small blocks are computed in fp32 and rounded once instead.
      out.copy_(at::baddbmm(c.to(at::kFloat), a.to(at::kFloat), b.to(at::kFloat), beta, alpha));
      return;
    }
    at::baddbmm_out(out, c, a, b, beta, alpha);
    RoundToCompute(out);
  }
  // One iteration of the formula on fp32 blocks x [batch, m, n] (contiguous, m <= n) with the
  // symmetric products of symmetric_products.h, block by block, each op's result rounded like
  // Bmm's: a = X X^T, p = b A + c A A (upper triangle), next = a X + P X.
  void SymmetricIteration(const at::Tensor& x, const Coefficients& k, at::Tensor& a, at::Tensor& p,
                          at::Tensor& next) {
    const int64_t batch = x.size(0), m = x.size(1), n = x.size(2);
    float* xd = x.data_ptr<float>();
    float* ad = a.data_ptr<float>();
    float* pd = p.data_ptr<float>();
    float* nd = next.data_ptr<float>();
    *op_ = "syrk(X X^T)";
    for (int64_t j = 0; j < batch; ++j)
      internal::SymmetricGram(xd + j * m * n, m, n, ad + j * m * m);
    RoundToCompute(a);
    *op_ = "syrk(b A + c A A)";
    for (int64_t j = 0; j < batch; ++j) {
      internal::SymmetricPolynomial(ad + j * m * m, m, static_cast<float>(k.b),
                                    static_cast<float>(k.c), pd + j * m * m);
    }
    RoundToCompute(p);
    *op_ = "symm(a X + P X)";
    for (int64_t j = 0; j < batch; ++j) {
      internal::SymmetricApply(pd + j * m * m, xd + j * m * n, m, n, static_cast<float>(k.a),
                               nd + j * m * n);
    }
    RoundToCompute(next);
  }
  // Per block m*k*n at or below kSmallBf16Gemm (independent of the batch size).
  static bool SmallPerBlock(const at::Tensor& a, const at::Tensor& b) {
    return a.size(1) * a.size(2) * b.size(2) <= kSmallBf16Gemm;
  }
  // Under fp16 emulation, rounds t's fp32 values to fp16 in place; otherwise nothing.
  void RoundToCompute(at::Tensor& t) {
    if (emulate_half_) t.copy_(t.to(at::kHalf));
  }
  // A copy of t as an operand in this dtype (rounded to fp16 under emulation).
  at::Tensor ToCompute(const char* op, const at::Tensor& t) {
    *op_ = op;
    at::Tensor out = t.to(storage_, /*non_blocking=*/false, /*copy=*/true);
    RoundToCompute(out);
    return out;
  }

 private:
  const at::ScalarType storage_;
  const bool emulate_half_;
  const char** op_;
};

// Iterations [begin, end) of the formula as written, in math's dtype, on X [b, m, n] (m <= n):
// A = X X^T; B = b A + c A A; X = a X + B X. `steps` is the total (for the coefficients).
at::Tensor DirectIterations(BatchedMath& math, at::Tensor x, NsMethod method, int begin, int end,
                            int steps) {
  if (begin >= end) return x;
  const int64_t batch = x.size(0);
  const int64_t m = x.size(1);
  at::Tensor a = at::empty({batch, m, m}, x.options());
  at::Tensor b = at::empty({batch, m, m}, x.options());
  at::Tensor next = at::empty_like(x);
  const bool symmetric = x.scalar_type() == at::kFloat;
  for (int i = begin; i < end; ++i) {
    const Coefficients k = IterationCoefficients(method, i, steps);
    if (symmetric) {
      math.SymmetricIteration(x, k, a, b, next);
      std::swap(x, next);
      continue;
    }
    math.Bmm("bmm(X, X^T)", x, x.transpose(1, 2), a);
    math.Baddbmm("baddbmm(b A + c A A)", a, a, a, k.b, k.c, b);
    math.Baddbmm("baddbmm(a X + B X)", x, b, x, k.a, 1.0, next);
    std::swap(x, next);
  }
  return x;
}

// bf16 iterations [begin, steps) with the m x m polynomial in fp32 (see the file comment):
// A = X X^T (bf16 GEMM), P = a I + b A + c A A (fp32), X = bf16(P) X (bf16 GEMM).
at::Tensor Fp32PolynomialIterations(BatchedMath& math, BatchedMath& square_math, const char** op,
                                    at::Tensor x, NsMethod method, int begin, int steps) {
  if (begin >= steps) return x;
  const int64_t batch = x.size(0);
  const int64_t m = x.size(1);
  at::Tensor a = at::empty({batch, m, m}, x.options());
  at::Tensor a32 = at::empty({batch, m, m}, x.options().dtype(at::kFloat));
  at::Tensor p = at::empty_like(a32);
  at::Tensor next = at::empty_like(x);
  for (int i = begin; i < steps; ++i) {
    const Coefficients k = IterationCoefficients(method, i, steps);
    math.Bmm("bmm(X, X^T)", x, x.transpose(1, 2), a);
    *op = "widen A";
    a32.copy_(a);
    square_math.Baddbmm("baddbmm(b A + c A A)", a32, a32, a32, k.b, k.c, p);
    *op = "diagonal add (P = a I + ...)";
    p.diagonal(0, 1, 2).add_(k.a);
    math.Bmm("bmm(P, X)", math.ToCompute("cast P", p), x, next);
    std::swap(x, next);
  }
  return x;
}

// The same polynomial on the Gram matrix. With X_k = Q_k X_0 and R_k = X_k X_k^T, one iteration is
// P = a I + b R + c R^2, X_{k+1} = P X_k, hence Q_{k+1} = P Q_k and R_{k+1} = P R_k P: everything
// but the first R and the final X = Q X_0 is an m x m product, which is cheaper when n >> m.
// After kGramRestartAfter iterations: X_0 <- Q X_0, R <- X_0 X_0^T, Q <- I.
//
// Precision: the m x m side (R, P, Q) is kept in fp32 whatever the compute dtype, and so is the
// product R = X_0 X_0^T (of X_0 in the compute dtype): R squares the condition number of X, and
// rounding R, P and Q to bf16 measured ~8% error against float64 on small blocks (vs ~2% for the
// standard method). The fp32 m x m side costs O(m^3), small next to O(m^2 n) in the n >> m regime
// this method is for. Q X_0 runs in first_math before the restart and in rest_math after it (for
// bf16: fp32, then bf16, the file comment's precision plan; otherwise both are the compute
// dtype); x0 is in first_math's dtype. For bf16, then, only the final Q X_0 is a bf16 GEMM: three
// of the four O(m^2 n) products are fp32 (measured worst 7e-3 on the test's blocks, 9e-3 with
// singular values ~1/i on 256 x 320).
at::Tensor GramIterations(BatchedMath& first_math, BatchedMath& rest_math, BatchedMath& square_math,
                          const char** op, at::Tensor x0, NsMethod method, int steps) {
  const int64_t batch = x0.size(0);
  const int64_t m = x0.size(1);
  const at::TensorOptions fp32 = x0.options().dtype(at::kFloat);
  at::Tensor r = at::empty({batch, m, m}, fp32);
  at::Tensor p = at::empty_like(r);
  at::Tensor q = at::empty_like(r);
  at::Tensor t = at::empty_like(r);
  BatchedMath* x_math = &first_math;
  // R <- X0 X0^T, an fp32 product of X0's values (rounded to the compute dtype after the restart):
  // rounding R itself to bf16 costs its small eigenvalues (the squares of X's small singular
  // values) their precision, measured 5.6e-2 error with singular values ~1/i (256 x 320).
  auto gram = [&](const char* name) {
    if (x0.scalar_type() == at::kFloat) {
      square_math.Bmm(name, x0, x0.transpose(1, 2), r);
      return;
    }
    *op = "widen X0";
    const at::Tensor x32 = x0.to(at::kFloat);
    square_math.Bmm(name, x32, x32.transpose(1, 2), r);
  };
  bool q_is_identity = true;  // Q = I is implicit: not stored, not multiplied
  gram("bmm(X0, X0^T)");
  for (int i = 0; i < steps; ++i) {
    if (i == kGramRestartAfter) {
      at::Tensor x = at::empty_like(x0);
      x_math->Bmm("bmm(Q, X0) (restart)", x_math->ToCompute("cast Q (restart)", q), x0, x);
      if (x_math != &rest_math) {
        x_math = &rest_math;
        x = x_math->ToCompute("cast X (restart)", x);
      }
      x0 = std::move(x);
      gram("bmm(X0, X0^T) (restart)");
      q_is_identity = true;
    }
    const Coefficients k = IterationCoefficients(method, i, steps);
    square_math.Baddbmm("baddbmm(b R + c R R)", r, r, r, k.b, k.c, p);
    *op = "diagonal add (P = a I + ...)";
    p.diagonal(0, 1, 2).add_(k.a);
    // R is needed by the next iteration unless that one restarts from X.
    if (i + 1 < steps && i + 1 != kGramRestartAfter) {
      square_math.Bmm("bmm(R, P)", r, p, t);
      square_math.Bmm("bmm(P, R P)", p, t, r);
    }
    if (q_is_identity) {
      std::swap(q, p);
      q_is_identity = false;
    } else {
      square_math.Bmm("bmm(P, Q)", p, q, t);
      std::swap(q, t);
    }
  }
  at::Tensor x = at::empty_like(x0);
  x_math->Bmm("bmm(Q, X0)", x_math->ToCompute("cast Q", q), x0, x);
  return x;
}

at::ScalarType StorageType(DType compute) {
  switch (compute) {
    case DType::kBFloat16:
      return at::kBFloat16;
    case DType::kFloat16:  // emulated in fp32 storage, see the file comment
    case DType::kFloat32:
      return at::kFloat;
  }
  return at::kFloat;
}

// INVALID_ARGUMENT for a geometry or a step count that ScaledNewtonSchulz cannot run.
absl::Status CheckArguments(const MuonConfig& config, MatrixGeometry geometry) {
  if (geometry.batch < 1 || geometry.rows < 1 || geometry.cols < 1) {
    return absl::InvalidArgumentError(absl::StrCat("Newton-Schulz: bad geometry [", geometry.batch,
                                                   ", ", geometry.rows, ", ", geometry.cols, "]"));
  }
  if (config.ns_steps < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("Newton-Schulz: ns_steps must be >= 1, got ", config.ns_steps));
  }
  return absl::OkStatus();
}

// X / (||X||_F * k + eps) per block of view [b, m, n], into a new contiguous fp32 tensor for every
// compute dtype (bf16 starts with fp32 iterations, fp16 is emulated in fp32), then rounded to the
// compute dtype under fp16 emulation (see the file comment).
at::Tensor NormalizeBlocks(BatchedMath& math, NsMethod method, const at::Tensor& view,
                           const char** op) {
  const int64_t batch = view.size(0);
  const double k = ns::NormFactor(method);
  *op = "frobenius norm";
  // One reduction per block: a reduction over several blocks at once may split a block's sum
  // differently (across threads) than over that block alone, and a matrix's bits must not
  // depend on the batch it is computed in (same-shape batching).
  at::Tensor denom = at::empty({batch, 1, 1}, view.options());
  for (int64_t b = 0; b < batch; ++b) {
    denom[b].copy_(
        at::linalg_vector_norm(view[b], 2, c10::nullopt, /*keepdim=*/true, c10::nullopt));
  }
  denom.mul_(k).add_(kNormEpsilon);
  *op = "normalize";
  at::Tensor xs = at::empty(view.sizes(), view.options());
  at::div_out(xs, view, denom);  // contiguous [b, m, n]
  math.RoundToCompute(xs);
  return xs;
}

// bf16: iterations 0 and 1 (kBf16Fp32Steps) in fp32, the rest in bf16 with the m x m polynomial
// in fp32 where Bf16PolynomialInFp32 says so (the file comment's precision plan).
at::Tensor Bf16Iterations(BatchedMath& math, BatchedMath& fp32_math, const char** op, at::Tensor xs,
                          NsMethod method, int steps) {
  const int fp32_steps = std::min(kBf16Fp32Steps, steps);
  at::Tensor result;
  {
    ScopedSingleAtenThread fp32_gemms(true);
    result = DirectIterations(fp32_math, xs, method, 0, fp32_steps, steps);
  }
  if (fp32_steps < steps) {
    result = math.ToCompute("cast X to bfloat16", result);
    result = Bf16PolynomialInFp32(xs.size(1), xs.size(2))
                 ? Fp32PolynomialIterations(math, fp32_math, op, result, method, fp32_steps, steps)
                 : DirectIterations(math, result, method, fp32_steps, steps, steps);
  }
  return result;
}

// All config.ns_steps iterations on the normalized xs [b, m, n] (m <= n), by method and compute
// dtype; math computes in the compute dtype, fp32_math in fp32.
at::Tensor Iterations(const MuonConfig& config, BatchedMath& math, BatchedMath& fp32_math,
                      const char** op, at::Tensor xs) {
  const int steps = config.ns_steps;
  const NsMethod method = config.ns_method;
  const bool bf16 = config.compute_dtype == DType::kBFloat16;
  if (method == NsMethod::kGram && xs.size(1) != xs.size(2)) {
    ScopedSingleAtenThread fp32_gemms(!bf16);
    return GramIterations(bf16 ? fp32_math : math, math, fp32_math, op, xs, method, steps);
  }
  if (!bf16) {
    ScopedSingleAtenThread fp32_gemms(true);
    return DirectIterations(math, xs, method, 0, steps, steps);
  }
  return Bf16Iterations(math, fp32_math, op, xs, method, steps);
}

// Stores result * scale into the caller's buffer: blocks, seen through view ([b, m, n]).
void WriteBack(const at::Tensor& result, double scale, at::Tensor& view, const at::Tensor& blocks,
               const char** op) {
  *op = "write back";
  if (result.scalar_type() == at::kFloat) {
    at::mul_out(view, result, scale);  // fp32: scale and store at once
  } else {
    // mul_out would multiply in bf16 (an extra rounding): widen first, then scale in fp32.
    view.copy_(result);
    if (scale != 1.0) blocks.mul_(scale);
  }
}

// INVALID_ARGUMENT naming the first non-finite element of the result, if any.
absl::Status CheckFinite(const MuonConfig& config, MatrixGeometry geometry, const float* x) {
  const int64_t n = geometry.batch * geometry.rows * geometry.cols;
  if (const int64_t bad = common::FindNonFinite(x, static_cast<size_t>(n)); bad >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Newton-Schulz: result is not finite (element ", bad, " of ", n, " is ",
                     x[bad], "); the input holds a non-finite value or overflowed in ",
                     std::string(common::DTypeName(config.compute_dtype))));
  }
  return absl::OkStatus();
}

}  // namespace

namespace internal {

absl::Status ScaledNewtonSchulz(const MuonConfig& config, MatrixGeometry geometry, double scale,
                                float* x) {
  RETURN_IF_ERROR(CheckArguments(config, geometry));
  const char* op = "from_blob";
  BatchedMath math(StorageType(config.compute_dtype),
                   /*emulate_half=*/config.compute_dtype == DType::kFloat16, &op);
  BatchedMath fp32_math(at::kFloat, /*emulate_half=*/false, &op);
  try {
    c10::InferenceMode no_autograd;
    // Not owned: the tensor must not outlive this call.
    at::Tensor blocks = at::from_blob(x, {geometry.batch, geometry.rows, geometry.cols},
                                      at::TensorOptions().dtype(at::kFloat));
    const bool transposed = geometry.rows > geometry.cols;
    at::Tensor view = transposed ? blocks.transpose(1, 2) : blocks;  // [b, m, n], m <= n
    const at::Tensor xs = NormalizeBlocks(math, config.ns_method, view, &op);
    const at::Tensor result = Iterations(config, math, fp32_math, &op, xs);
    WriteBack(result, scale, view, blocks, &op);
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("Newton-Schulz: LibTorch op ", op, " failed: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("Newton-Schulz: LibTorch op ", op, " failed: ", e.what()));
  }
  return CheckFinite(config, geometry, x);
}

}  // namespace internal

absl::Status NewtonSchulz(const MuonConfig& config, MatrixGeometry geometry, float* x) {
  return internal::ScaledNewtonSchulz(config, geometry, 1.0, x);
}

void SetMathThreads(int n) { at::set_num_threads(n < 1 ? 1 : n); }

int MathThreads() { return at::get_num_threads(); }

}  // namespace muond::server
