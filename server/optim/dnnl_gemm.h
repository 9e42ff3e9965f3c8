// Internal to server/optim: one single-threaded GEMM through oneDNN's matmul primitive (the
// Debian libdnnl that LibTorch itself uses for its bf16 products), for the task-parallel
// Newton-Schulz iteration (ns_tasks.h).
//
// Why not at::bmm: LibTorch creates and caches a primitive per call from its own arguments, splits
// each product over its OpenMP team (a barrier per product) and computes beta * C + alpha * A B as
// a product plus separate passes. Here the primitive is made once per (shape, strides, scales),
// fuses alpha and beta (oneDNN output scale and sum post-op: fp32 accumulation, one rounding to the
// destination dtype) and runs on the calling thread only, so independent tasks run side by side
// on the daemon's threads with no synchronisation inside a product.
//
// Determinism: a primitive is always created and executed with one thread (the calling thread's
// OpenMP thread count is set to 1 while it runs), so a product's bits depend only on its
// arguments, not on the daemon's thread count or on which thread runs it.
#ifndef MUOND_SERVER_OPTIM_DNNL_GEMM_H_
#define MUOND_SERVER_OPTIM_DNNL_GEMM_H_

#include <cstddef>
#include <cstdint>

namespace muond::server::internal {

enum class GemmType { kFloat32, kBFloat16 };

// Row-major operands: a is [m, k] with row stride lda; b is [k, n] with row stride ldb, or when
// b_transposed the matrix B^T of b stored as [n, k] with row stride ldb; c is [m, n] with row
// stride ldc. Element strides are 1; strides count elements.
struct GemmArgs {
  GemmType type = GemmType::kFloat32;
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  bool b_transposed = false;
  float alpha = 1.0f;  // c = alpha * a b + beta * c (c is read only when beta != 0)
  float beta = 0.0f;
};

// Runs the product on the calling thread. Throws std::runtime_error naming the product on a
// oneDNN failure (an unsupported layout, out of memory); callers catch it.
void DnnlGemm(const GemmArgs& args);

// Primitives currently cached (for tests). The cache holds at most kMaxCachedPrimitives; when full
// it is emptied (shapes are the daemon's matrices' strips: a few dozen per model).
inline constexpr size_t kMaxCachedPrimitives = 1024;
size_t DnnlCachedPrimitives();

}  // namespace muond::server::internal

#endif  // MUOND_SERVER_OPTIM_DNNL_GEMM_H_
