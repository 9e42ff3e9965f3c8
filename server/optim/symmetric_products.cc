// SYRK/SYMM through the CBLAS interface of the system BLAS (libblas.so.3: OpenBLAS's pthread build
// on Debian, the alternative deploy/install-deps.sh installs; LibTorch's fp32 GEMMs use the same
// library). See symmetric_products.h.
#include "server/optim/symmetric_products.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>

namespace muond::server::internal {

void SymmetricGram(const float* x, int64_t m, int64_t n, float* a) {
  // beta = 0: BLAS does not read `a` (uninitialized memory is fine, NaN bits included).
  cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              1.0f, x, static_cast<int>(n), 0.0f, a, static_cast<int>(m));
  MirrorUpper(a, m);
}

void SymmetricPolynomial(const float* a, int64_t m, float b, float c, float* p) {
  // a a = a a^T for a symmetric a: SYRK of a with beta = b over a copy of a gives b a + c a a.
  std::memcpy(p, a, static_cast<size_t>(m * m) * sizeof(float));
  cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, static_cast<int>(m), static_cast<int>(m), c,
              a, static_cast<int>(m), b, p, static_cast<int>(m));
}

void SymmetricApply(const float* p, const float* x, int64_t m, int64_t n, float alpha,
                    float* next) {
  std::memcpy(next, x, static_cast<size_t>(m * n) * sizeof(float));
  cblas_ssymm(CblasRowMajor, CblasLeft, CblasUpper, static_cast<int>(m), static_cast<int>(n), 1.0f,
              p, static_cast<int>(m), x, static_cast<int>(n), alpha, next, static_cast<int>(n));
}

}  // namespace muond::server::internal
