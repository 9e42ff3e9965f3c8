// SYRK/SYMM through the CBLAS interface of the system BLAS (libblas.so.3: OpenBLAS's pthread build
// on Debian, the alternative deploy/install-deps.sh installs; LibTorch's fp32 GEMMs use the same
// library). See symmetric_products.h.
#include "server/optim/symmetric_products.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>

namespace muond::server::internal {
namespace {

// Tile edge of the mirror copy: a 64 x 64 fp32 tile of source and destination stay in L1.
constexpr int64_t kMirrorTile = 64;

}  // namespace

void MirrorUpper(float* a, int64_t m) {
  for (int64_t i0 = 0; i0 < m; i0 += kMirrorTile) {
    const int64_t i1 = std::min(m, i0 + kMirrorTile);
    for (int64_t j0 = 0; j0 <= i0; j0 += kMirrorTile) {
      const int64_t j1 = std::min(m, j0 + kMirrorTile);
      // Lower tile (rows i, columns j < i) from the upper element (j, i).
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = j0; j < std::min(j1, i); ++j) a[i * m + j] = a[j * m + i];
      }
    }
  }
}

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
