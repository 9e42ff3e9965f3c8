// Internal to server/optim: the batched LibTorch products of Newton-Schulz on the CPU, shared by
// newton_schulz.cc (normalization, the standard iterations) and ns_gram.cc (the Gram iteration).
// Includes ATen: only those .cc files include this header.
//
// Blocks are [batch, m, n] tensors with m <= n. Every product is computed block by block or as
// one batched GEMM whose per-block result does not depend on the batch (same-shape batching must
// give the bits of one block at a time).
#ifndef MUOND_SERVER_OPTIM_NS_BATCHED_MATH_H_
#define MUOND_SERVER_OPTIM_NS_BATCHED_MATH_H_

#include <ATen/ATen.h>

#include <cstdint>

#include "server/optim/ns_schedule.h"

namespace muond::server::internal {

// BLAS products (fp16 emulation's iterations, the Gram iteration's m x m side) run on the system
// BLAS's own threads (OpenBLAS pthreads); ATen's OpenMP workers (oneDNN's GEMMs and the
// elementwise ops) would only spin beside them and take the cores: measured at 512 x 512, fp32
// Newton-Schulz on BLAS ran at ~33 GFLOP/s with 2 OpenMP threads and ~55 with 1. Work that is
// BLAS runs with one OpenMP thread; the previous count is restored on leaving. OpenMP's thread
// count is a setting of the calling thread (others are not affected). at::set_num_threads is not
// used: it also rebuilds LibTorch's pthreadpool on every change.
class ScopedSingleAtenThread {
 public:
  explicit ScopedSingleAtenThread(bool active);
  ~ScopedSingleAtenThread();
  ScopedSingleAtenThread(const ScopedSingleAtenThread&) = delete;
  ScopedSingleAtenThread& operator=(const ScopedSingleAtenThread&) = delete;

 private:
  const int saved_;
  const bool active_;
};

// How a reduced dtype is computed when it is not native: in fp32 storage holding values of that
// dtype, every op's fp32 result rounded to it (nearest even).
enum class Emulation { kNone, kBf16, kFp16 };

// The products in one dtype: fp32, bf16 (oneDNN, AVX-512 BF16 or AMX, fp32 accumulation, each op's
// result rounded once), or bf16 or fp16 emulated in fp32 storage (each op's fp32 result rounded to
// the dtype; cpu_isa.h says when bf16 is). `*op` names the op in flight for error messages; it is
// shared between instances.
class BatchedMath {
 public:
  BatchedMath(at::ScalarType storage, Emulation emulation, const char** op)
      : storage_(storage), emulation_(emulation), op_(op) {}

  at::ScalarType storage() const { return storage_; }
  Emulation emulation() const { return emulation_; }
  // Whether Iteration runs on the system BLAS (fp16 emulation) rather than the task pool.
  bool UsesBlas() const { return emulation_ == Emulation::kFp16; }

  // One iteration of the formula on x [b, m, n] (contiguous, m <= n, this dtype):
  // a = X X^T, p = b A + c A A, next = a X + P X; a and p are [b, m, m] scratch, next [b, m, n].
  // fp32, bf16 and bf16 emulation: the upper-triangle strips and column chunks of ns_tasks.h
  // (single-threaded oneDNN products side by side on the calling thread's OpenMP team; no BLAS
  // thread pool beside it; emulation rounds each product's result to bf16). fp16 emulation: the symmetric BLAS products (symmetric_products.h), each op's result
  // rounded to fp16.
  void Iteration(const at::Tensor& x, const ns::Coefficients& k, at::Tensor& a, at::Tensor& p,
                 at::Tensor& next);

  // out = a @ b
  void Bmm(const char* op, const at::Tensor& a, const at::Tensor& b, at::Tensor& out);
  // out = beta * c + alpha * (a @ b); out must not alias an input.
  void Baddbmm(const char* op, const at::Tensor& c, const at::Tensor& a, const at::Tensor& b,
               double beta, double alpha, at::Tensor& out);
  // Under emulation, rounds t's fp32 values to the emulated dtype in place; otherwise nothing.
  void RoundToCompute(at::Tensor& t);
  // A copy of t as an operand in this dtype (rounded to it under emulation).
  at::Tensor ToCompute(const char* op, const at::Tensor& t);
  void SetOp(const char* op) { *op_ = op; }

 private:
  void BlasIteration(const at::Tensor& x, const ns::Coefficients& k, at::Tensor& a, at::Tensor& p,
                     at::Tensor& next);

  const at::ScalarType storage_;
  const Emulation emulation_;
  const char** op_;
};

// A per-thread scratch tensor of each kind, kept between calls: the step's Newton-Schulz buffers
// are the same sizes every step, and allocating them anew each time page-faulted them in again
// after every heap trim between steps (HeapTrimmer), and mapped and unmapped the ones above the
// mmap threshold on every call. Each kind keeps its largest size so far (bounded by the daemon's
// largest same-shape batch, which the gather budget bounds). Tensors of different kinds never
// share memory; a kind's tensor is valid until the same thread asks for that kind again.
enum class Scratch {
  kNormalized,
  kA,
  kP,
  kNext,
  kGramR,
  kGramP,
  kGramQ,
  kGramT,
  kGramS,
  kGramX1,
  kGramX2,
  kCount
};
at::Tensor ScratchTensor(Scratch kind, at::IntArrayRef sizes, at::ScalarType dtype);

// The Gram iteration (ns_gram.cc) on the normalized fp32 blocks x0 [b, m, n], m < n: every m x m
// product in fp32 through the symmetric BLAS products, the m x n products in long_math's dtype
// (fp32 before the restart when first_long_fp32). Returns the result [b, m, n] in long_math's
// storage dtype.
at::Tensor GramIterations(BatchedMath& long_math, BatchedMath& fp32_math, bool first_long_fp32,
                          bool rest_long_fp32, common::NsMethod method, int steps, at::Tensor x0);

// Whether the Gram iteration costs less than the standard one for blocks [m, n] (m <= n) with
// `steps` iterations; fp32 m x m work is weighted by fp32_weight (its cost per FLOP relative to
// the long-side products' dtype). See ns_gram.cc.
bool GramPays(int64_t m, int64_t n, int steps, double fp32_weight);

}  // namespace muond::server::internal

#endif  // MUOND_SERVER_OPTIM_NS_BATCHED_MATH_H_
