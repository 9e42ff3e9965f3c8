// SYRK/SYMM through the CBLAS interface of the system BLAS (libblas.so.3: OpenBLAS's pthread build
// on Debian, the alternative deploy/install-deps.sh installs; LibTorch's fp32 GEMMs use the same
// library). See symmetric_products.h.
#include "server/optim/symmetric_products.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>

namespace muond::server::internal {
namespace {

// Products of at most this many multiply-adds use plain SGEMM on the full matrices. OpenBLAS
// 0.3.21 runs SYRK/SYMM on its thread pool whatever the size (a 48 x 64 SYMM was dispatched as
// ssymm_thread_RL), while SGEMM stays on the calling thread below 64^3 multiply-adds; such tiny
// threaded calls, issued thousands of times by small per-head blocks, were seen to hang in
// OpenBLAS's thread server (exec_blas and its worker both spinning in sched_yield) when the
// daemon's CPUs were oversubscribed. Small blocks gain nothing from the triangle anyway.
constexpr int64_t kSmallMultiplyAdds = int64_t{1} << 18;

bool Small(int64_t m, int64_t n, int64_t k) { return m * n * k <= kSmallMultiplyAdds; }

}  // namespace

void SymmetricGram(const float* x, int64_t m, int64_t n, float* a) {
  if (Small(m, m, n)) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(m),
                static_cast<int>(n), 1.0f, x, static_cast<int>(n), x, static_cast<int>(n), 0.0f, a,
                static_cast<int>(m));
    MirrorUpper(a, m);  // exactly symmetric, as the SYRK path
    return;
  }
  // beta = 0: BLAS does not read `a` (uninitialized memory is fine, NaN bits included).
  cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              1.0f, x, static_cast<int>(n), 0.0f, a, static_cast<int>(m));
  MirrorUpper(a, m);
}

void SymmetricPolynomial(const float* a, int64_t m, float b, float c, float* p) {
  // a a = a a^T for a symmetric a: SYRK of a with beta = b over a copy of a gives b a + c a a.
  std::memcpy(p, a, static_cast<size_t>(m * m) * sizeof(float));
  if (Small(m, m, m)) {  // the full result (both triangles)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(m),
                static_cast<int>(m), c, a, static_cast<int>(m), a, static_cast<int>(m), b, p,
                static_cast<int>(m));
    return;
  }
  cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, static_cast<int>(m), static_cast<int>(m), c,
              a, static_cast<int>(m), b, p, static_cast<int>(m));
}

void SymmetricApply(const float* p, const float* x, int64_t m, int64_t n, float alpha,
                    float* next) {
  std::memcpy(next, x, static_cast<size_t>(m * n) * sizeof(float));
  if (Small(m, n, m)) {
    // p's lower triangle is valid here too: a small p came from SymmetricPolynomial's full SGEMM
    // (m^3 <= m^2 n), or was mirrored by the caller.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
                static_cast<int>(m), 1.0f, p, static_cast<int>(m), x, static_cast<int>(n), alpha,
                next, static_cast<int>(n));
    return;
  }
  cblas_ssymm(CblasRowMajor, CblasLeft, CblasUpper, static_cast<int>(m), static_cast<int>(n), 1.0f,
              p, static_cast<int>(m), x, static_cast<int>(n), alpha, next, static_cast<int>(n));
}

}  // namespace muond::server::internal
