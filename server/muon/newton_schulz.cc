// Newton-Schulz orthogonalization (DESIGN.md 3, NS(X)) on the CPU with LibTorch. The only file of
// server/muon that includes LibTorch headers; every LibTorch exception is caught here.
//
// Layout: the caller's fp32 buffer is wrapped without a copy (at::from_blob) as [batch, rows,
// cols]. Blocks with rows > cols are processed transposed, so every product below works on X of
// shape [batch, m, n] with m <= n, and each product is one batched GEMM (bmm/baddbmm) over all
// blocks.
//
// Compute dtypes:
//  - float32: fp32 tensors and LibTorch's CPU GEMM (the system BLAS).
//  - bfloat16: bf16 tensors; LibTorch 1.13 routes bf16 bmm/baddbmm to oneDNN (AVX-512 BF16 on this
//    CPU), accumulating in fp32 and rounding each op's result to bf16 once.
//  - float16: LibTorch 1.13's CPU GEMM has no Half kernel ("addmm_impl_cpu_" not implemented for
//    'Half'), so fp16 is emulated: tensors hold fp16-representable values in fp32 storage, each
//    GEMM accumulates in fp32 (like an fp16 GEMM with fp32 accumulation on a GPU) and each op's
//    result is rounded to fp16 (nearest even, overflow to inf). It runs at fp32 GEMM speed plus the
//    rounding passes: it exists for parity with fp16 device backends, not for speed.
//
// Normalization: the per-block Frobenius norm is taken in fp32 on the caller's data and X / (norm*k
// + 1e-7) is rounded into the compute dtype once (instead of rounding X, then the quotient): the
// same formula with one rounding fewer.
#include "server/muon/newton_schulz.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <exception>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace muond::server {
namespace {

using common::DType;
using common::MuonConfig;
using common::NsMethod;

struct Coefficients {
  double a;
  double b;
  double c;
};

constexpr Coefficients kStandard{3.4445, -4.7750, 2.0315};
// Polar Express (arXiv 2505.16932), one triple per iteration; kPolarExpressTail after these.
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
// Polar Express safety factor: the norm is inflated by it, and every iteration but the last one
// divides (a, b, c) by (f, f^3, f^5).
constexpr double kPolarExpressSafety = 1.01;
constexpr double kNormEpsilon = 1e-7;
// The gram method recomputes X and R from the accumulated factor after this many iterations (once):
// the first iterations see the badly conditioned R of the raw input, and restarting there bounds
// the error that the r x r products accumulate.
constexpr int kGramRestartAfter = 2;
// batch*m*k*n at or below which a bf16 baddbmm is evaluated in fp32 (see BatchedMath::Baddbmm); a
// margin above LibTorch's own threshold (16^3 per product), still negligible work.
constexpr int64_t kSmallBf16Gemm = int64_t{1} << 16;

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

// The batched products in one dtype (the compute dtype, or fp32 for gram's m x m side). `*op`
// names the op in flight for error messages; it is shared between instances.
class BatchedMath {
 public:
  BatchedMath(at::ScalarType storage, bool emulate_half, const char** op)
      : storage_(storage), emulate_half_(emulate_half), op_(op) {}

  // out = a @ b
  void Bmm(const char* op, const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
    *op_ = op;
    at::bmm_out(out, a, b);
    RoundToCompute(out);
  }
  // out = beta * c + alpha * (a @ b); out must not alias an input.
  void Baddbmm(const char* op, const at::Tensor& c, const at::Tensor& a, const at::Tensor& b,
               double beta, double alpha, at::Tensor& out) {
    *op_ = op;
    if (out.scalar_type() == at::kBFloat16 &&
        a.size(0) * a.size(1) * a.size(2) * b.size(2) <= kSmallBf16Gemm) {
      // LibTorch 1.13 sends small bf16 GEMMs (below oneDNN's 16^3 threshold) to a kernel that
      // rounds beta * C to bf16 before adding the product: a second rounding that costs ~4x the
      // error against float64 here. Tiny products are computed in fp32 and rounded once instead.
      out.copy_(at::baddbmm(c.to(at::kFloat), a.to(at::kFloat), b.to(at::kFloat), beta, alpha));
      return;
    }
    at::baddbmm_out(out, c, a, b, beta, alpha);
    RoundToCompute(out);
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

// Standard iteration on X [b, m, n] (m <= n): A = X X^T; B = b A + c A A; X = a X + B X.
at::Tensor StandardIterations(BatchedMath& math, at::Tensor x, NsMethod method, int steps) {
  const int64_t batch = x.size(0);
  const int64_t m = x.size(1);
  at::Tensor a = at::empty({batch, m, m}, x.options());
  at::Tensor b = at::empty({batch, m, m}, x.options());
  at::Tensor next = at::empty_like(x);
  for (int i = 0; i < steps; ++i) {
    const Coefficients k = IterationCoefficients(method, i, steps);
    math.Bmm("bmm(X, X^T)", x, x.transpose(1, 2), a);
    math.Baddbmm("baddbmm(b A + c A A)", a, a, a, k.b, k.c, b);
    math.Baddbmm("baddbmm(a X + B X)", x, b, x, k.a, 1.0, next);
    std::swap(x, next);
  }
  return x;
}

// The same polynomial on the Gram matrix. With X_k = Q_k X_0 and R_k = X_k X_k^T, one iteration is
// P = a I + b R + c R^2, X_{k+1} = P X_k, hence Q_{k+1} = P Q_k and R_{k+1} = P R_k P: everything
// but the first R and the final X = Q X_0 is an m x m product, which is cheaper when n >> m.
// After kGramRestartAfter iterations: X_0 <- Q X_0, R <- X_0 X_0^T, Q <- I.
//
// Precision: the m x m side (R, P, Q) is kept in fp32 whatever the compute dtype; only the X-side
// products (X_0 X_0^T, Q X_0), which are the O(m^2 n) work, run in the compute dtype. R squares the
// condition number of X, and rounding R, P and Q to bf16 measured ~8% error against float64 on
// small blocks (vs ~2% for the standard method); the fp32 m x m side costs O(m^3), small next to
// O(m^2 n) in the n >> m regime this method is for.
at::Tensor GramIterations(BatchedMath& math, BatchedMath& square_math, const char** op,
                          at::Tensor x0, NsMethod method, int steps) {
  const int64_t batch = x0.size(0);
  const int64_t m = x0.size(1);
  const at::TensorOptions fp32 = x0.options().dtype(at::kFloat);
  at::Tensor r = at::empty({batch, m, m}, fp32);
  at::Tensor p = at::empty_like(r);
  at::Tensor q = at::empty_like(r);
  at::Tensor t = at::empty_like(r);
  at::Tensor r_compute = at::empty({batch, m, m}, x0.options());
  bool q_is_identity = true;  // Q = I is implicit: not stored, not multiplied
  math.Bmm("bmm(X0, X0^T)", x0, x0.transpose(1, 2), r_compute);
  *op = "copy R";
  r.copy_(r_compute);
  for (int i = 0; i < steps; ++i) {
    if (i == kGramRestartAfter) {
      at::Tensor x = at::empty_like(x0);
      math.Bmm("bmm(Q, X0) (restart)", math.ToCompute("cast Q (restart)", q), x0, x);
      x0 = std::move(x);
      math.Bmm("bmm(X0, X0^T) (restart)", x0, x0.transpose(1, 2), r_compute);
      *op = "copy R (restart)";
      r.copy_(r_compute);
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
  math.Bmm("bmm(Q, X0)", math.ToCompute("cast Q", q), x0, x);
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

}  // namespace

namespace internal {

absl::Status ScaledNewtonSchulz(const MuonConfig& config, MatrixGeometry geometry, double scale,
                                float* x) {
  if (geometry.batch < 1 || geometry.rows < 1 || geometry.cols < 1) {
    return absl::InvalidArgumentError(absl::StrCat("Newton-Schulz: bad geometry [", geometry.batch,
                                                   ", ", geometry.rows, ", ", geometry.cols, "]"));
  }
  if (config.ns_steps < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("Newton-Schulz: ns_steps must be >= 1, got ", config.ns_steps));
  }
  const char* op = "from_blob";
  const at::ScalarType storage = StorageType(config.compute_dtype);
  BatchedMath math(storage, /*emulate_half=*/config.compute_dtype == DType::kFloat16, &op);
  BatchedMath square_math(at::kFloat, /*emulate_half=*/false, &op);
  try {
    c10::InferenceMode no_autograd;
    // Not owned: the tensor must not outlive this call.
    at::Tensor blocks = at::from_blob(x, {geometry.batch, geometry.rows, geometry.cols},
                                      at::TensorOptions().dtype(at::kFloat));
    const bool transposed = geometry.rows > geometry.cols;
    at::Tensor view = transposed ? blocks.transpose(1, 2) : blocks;  // [b, m, n], m <= n

    const double k = config.ns_method == NsMethod::kPolarExpress ? kPolarExpressSafety : 1.0;
    op = "frobenius norm";
    at::Tensor denom =
        at::linalg_vector_norm(view, 2, at::IntArrayRef{1, 2}, /*keepdim=*/true, c10::nullopt);
    denom.mul_(k).add_(kNormEpsilon);
    op = "normalize";
    at::Tensor xs = at::empty(view.sizes(), view.options().dtype(storage));
    at::div_out(xs, view, denom);  // contiguous [b, m, n]; casts to the compute dtype on write
    math.RoundToCompute(xs);

    const bool gram = config.ns_method == NsMethod::kGram && view.size(1) != view.size(2);
    at::Tensor result =
        gram ? GramIterations(math, square_math, &op, xs, config.ns_method, config.ns_steps)
             : StandardIterations(math, xs, config.ns_method, config.ns_steps);

    op = "write back";
    if (result.scalar_type() == at::kFloat) {
      at::mul_out(view, result, scale);  // fp32: scale and store at once
    } else {
      // mul_out would multiply in bf16 (an extra rounding): widen first, then scale in fp32.
      view.copy_(result);
      if (scale != 1.0) blocks.mul_(scale);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("Newton-Schulz: LibTorch op ", op, " failed: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("Newton-Schulz: LibTorch op ", op, " failed: ", e.what()));
  }
  const int64_t n = geometry.batch * geometry.rows * geometry.cols;
  if (const int64_t bad = common::FindNonFinite(x, static_cast<size_t>(n)); bad >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Newton-Schulz: result is not finite (element ", bad, " of ", n, " is ",
                     x[bad], "); the input holds a non-finite value or overflowed in ",
                     std::string(common::DTypeName(config.compute_dtype))));
  }
  return absl::OkStatus();
}

}  // namespace internal

absl::Status NewtonSchulz(const MuonConfig& config, MatrixGeometry geometry, float* x) {
  return internal::ScaledNewtonSchulz(config, geometry, 1.0, x);
}

void SetMathThreads(int n) { at::set_num_threads(n < 1 ? 1 : n); }

int MathThreads() { return at::get_num_threads(); }

}  // namespace muond::server
