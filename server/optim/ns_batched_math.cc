// See ns_batched_math.h. The products of one Newton-Schulz iteration, by dtype.
#include "server/optim/ns_batched_math.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>

#include "server/optim/ns_layout.h"
#include "server/optim/ns_tasks.h"
#include "server/optim/symmetric_products.h"

namespace muond::server::internal {
namespace {

// m*k*n of one block at or below which a bf16 product is evaluated in fp32 (see Bmm); a margin
// above LibTorch's own threshold (16^3 per batched product), still negligible work.
constexpr int64_t kSmallBf16Gemm = int64_t{1} << 16;

// Per block m*k*n at or below kSmallBf16Gemm (independent of the batch size).
bool SmallPerBlock(const at::Tensor& a, const at::Tensor& b) {
  return a.size(1) * a.size(2) * b.size(2) <= kSmallBf16Gemm;
}

}  // namespace

// Bytes of every thread's kept scratch (NewtonSchulzScratchBytes).
std::atomic<uint64_t> g_scratch_bytes{0};

// A thread's kept tensors; their bytes leave the count when the thread ends.
struct KeptScratch {
  std::array<at::Tensor, static_cast<size_t>(Scratch::kCount)> tensors;
  ~KeptScratch() {
    for (const at::Tensor& t : tensors) {
      if (t.defined()) g_scratch_bytes.fetch_sub(static_cast<uint64_t>(t.numel()));
    }
  }
};

at::Tensor ScratchTensor(Scratch kind, at::IntArrayRef sizes, at::ScalarType dtype) {
  thread_local KeptScratch kept;
  at::Tensor& t = kept.tensors[static_cast<size_t>(kind)];
  int64_t numel = 1;
  for (int64_t d : sizes) numel *= d;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (!t.defined() || t.numel() < bytes) {
    const uint64_t old = t.defined() ? static_cast<uint64_t>(t.numel()) : 0;
    t = at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
    g_scratch_bytes.fetch_add(static_cast<uint64_t>(bytes) - old);
  }
  return t.narrow(0, 0, bytes).view(dtype).view(sizes);
}

ScopedSingleAtenThread::ScopedSingleAtenThread(bool active)
    : saved_(omp_get_max_threads()), active_(active && saved_ != 1) {
  if (active_) omp_set_num_threads(1);
}

ScopedSingleAtenThread::~ScopedSingleAtenThread() {
  if (active_) omp_set_num_threads(saved_);
}

void BatchedMath::Iteration(const at::Tensor& x, const ns::Coefficients& k, at::Tensor& a,
                            at::Tensor& p, at::Tensor& next) {
  if (UsesBlas()) return BlasIteration(x, k, a, p, next);
  // fp32 and bf16: the upper-triangle strips and column chunks of ns_tasks.h, each a
  // single-threaded oneDNN product, over the calling thread's OpenMP team.
  TaskBlocks blocks;
  blocks.type = storage_ == at::kFloat ? GemmType::kFloat32 : GemmType::kBFloat16;
  blocks.round_bf16 = emulation_ == Emulation::kBf16;
  blocks.batch = x.size(0);
  blocks.m = x.size(1);
  blocks.n = x.size(2);
  blocks.x = x.data_ptr();
  blocks.a = a.data_ptr();
  blocks.p = p.data_ptr();
  blocks.next = next.data_ptr();
  TaskIteration(blocks, k, omp_get_max_threads(), op_);
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
  if (emulation_ == Emulation::kFp16) t.copy_(t.to(at::kHalf));
  if (emulation_ == Emulation::kBf16) {
    if (t.is_contiguous()) {
      RoundToBf16(t.data_ptr<float>(), t.numel(), omp_get_max_threads());
    } else {
      t.copy_(t.to(at::kBFloat16));
    }
  }
}

at::Tensor BatchedMath::ToCompute(const char* op, const at::Tensor& t) {
  *op_ = op;
  at::Tensor out = t.to(storage_, /*non_blocking=*/false, /*copy=*/true);
  RoundToCompute(out);
  return out;
}

uint64_t NewtonSchulzScratchBytes() { return g_scratch_bytes.load(); }

}  // namespace muond::server::internal
