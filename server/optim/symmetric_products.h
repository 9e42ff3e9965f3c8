// Symmetric products of a Newton-Schulz iteration on one fp32 block, through the system BLAS
// (OpenBLAS): A = X X^T and A A are symmetric, so only one triangle of each is computed (SYRK),
// which costs about half of a full GEMM; B X reads B's upper triangle (SYMM) at a full GEMM's cost.
//
// One standard iteration on X [m, n] (row-major, m <= n), with (a, b, c) its coefficients:
//   SymmetricGram(x, m, n, A)              A = X X^T            (both triangles written)
//   SymmetricPolynomial(A, m, b, c, B)     B = b A + c A A      (upper triangle valid)
//   SymmetricApply(B, x, m, n, a, next)    next = a X + B X     (B's upper triangle read)
// Every call works on one block and its result does not depend on what else is computed, so
// same-shape batches give the same bits as single blocks. Calls block; BLAS runs them on its own
// threads (openblas-pthread). Thread-safe for distinct outputs.
#ifndef MUOND_SERVER_OPTIM_SYMMETRIC_PRODUCTS_H_
#define MUOND_SERVER_OPTIM_SYMMETRIC_PRODUCTS_H_

#include <cstdint>

namespace muond::server::internal {

// a[m, m] = x x^T for x[m, n]; the upper triangle is computed, the lower one mirrored from it, so
// `a` is exactly symmetric.
void SymmetricGram(const float* x, int64_t m, int64_t n, float* a);

// The upper triangle of p[m, m] = b * a + c * a a, for a symmetric a[m, m] (both triangles set).
// The strict lower triangle of p holds a's values on return (not part of the result), except for
// small blocks (m^3 <= 2^18), which get the full product.
void SymmetricPolynomial(const float* a, int64_t m, float b, float c, float* p);

// next[m, n] = alpha * x + p x, where p[m, m] is symmetric and only its upper triangle is read
// (small blocks, m^2 n <= 2^18: all of p, as SymmetricPolynomial leaves it).
// next must not alias x or p.
void SymmetricApply(const float* p, const float* x, int64_t m, int64_t n, float alpha, float* next);

// Copies the upper triangle of a[m, m] onto its lower one (T: the element type; any trivially
// copyable type).
template <typename T>
void MirrorUpper(T* a, int64_t m) {
  constexpr int64_t kTile = 64;  // a 64 x 64 tile of source and destination stays in L1
  for (int64_t i0 = 0; i0 < m; i0 += kTile) {
    const int64_t i1 = i0 + kTile < m ? i0 + kTile : m;
    for (int64_t j0 = 0; j0 <= i0; j0 += kTile) {
      // Lower tile (rows i, columns j < i) from the upper elements (j, i).
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t j1 = j0 + kTile < i ? j0 + kTile : i;
        for (int64_t j = j0; j < j1; ++j) a[i * m + j] = a[j * m + i];
      }
    }
  }
}

}  // namespace muond::server::internal

#endif  // MUOND_SERVER_OPTIM_SYMMETRIC_PRODUCTS_H_
