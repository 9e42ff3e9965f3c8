// The Newton-Schulz iterations of the CUDA backend as a sequence of primitive operations
// (strided-batched GEMMs in cuBLAS's column-major convention, copies, casts, a diagonal add) on a
// workspace, independent of where they run: cuda_muon.cc runs them with cuBLAS and its kernels,
// and the tests run the same plan on host memory through an emulation of those operations, which
// checks the buffer choreography and the row-major -> column-major GEMM mapping without a GPU.
//
// The plan follows newton_schulz.cc step by step: the formula as written for fp32 and fp16
// (fp16 GEMMs with fp32 accumulation, one rounding per op); bf16's precision plan (iterations 0-1
// in fp32, then bf16 GEMMs with the m x m polynomial in fp32 for small or wide blocks); the gram
// method with its fp32 m x m side and restart after iteration 2. No CUDA headers here.
#ifndef MUOND_SERVER_DEVICE_CUDA_CUDA_NS_PLAN_H_
#define MUOND_SERVER_DEVICE_CUDA_CUDA_NS_PLAN_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "common/job_spec.h"

namespace muond::server::device::cuda {

// Element types of the Newton-Schulz buffers.
enum class Elem { kF32, kBf16, kF16 };
inline size_t ElemSize(Elem e) { return e == Elem::kF32 ? 4 : 2; }

// A batch of blocks in one element type.
struct Mat {
  void* data;
  Elem type;
};

// cublasGemmStridedBatchedEx's arguments (column-major; fp32 accumulation and alpha/beta):
// C[i] = alpha op(A[i]) op(B[i]) + beta C[i] for i < batch, op(A) m x k, op(B) k x n, C m x n.
struct GemmArgs {
  bool trans_a, trans_b;
  int m, n, k;
  float alpha;
  Mat a;
  int lda;
  int64_t stride_a;
  Mat b;
  int ldb;
  int64_t stride_b;
  float beta;
  Mat c;
  int ldc;
  int64_t stride_c;
  int batch;
};

class NsOps {
 public:
  virtual ~NsOps() = default;
  virtual absl::Status Gemm(const GemmArgs& args) = 0;
  virtual absl::Status Copy(Mat to, Mat from, int64_t elems) = 0;  // same type
  virtual absl::Status Convert(Mat from, Mat to, int64_t elems) = 0;
  // p[b][i][i] += a (fp32)
  virtual absl::Status AddDiagonal(Mat p, int64_t blocks, int64_t m, float a) = 0;
};

// Blocks of the Frobenius norm's first pass per matrix block (cuda_kernels.h).
constexpr int kMaxNormChunks = 64;

// The norm's factor k and epsilon: X / (||X||_F * k + eps).
double NsNormFactor(common::NsMethod method);
constexpr double kNsNormEpsilon = 1e-7;

// Workspace bytes for `blocks` blocks of m x n (m <= n): two [B, m, n] fp32 buffers (X and the
// next X, also used as 16-bit), five [B, m, m] fp32 buffers (A/R, B/P, Q, T and a 16-bit cast),
// the per-block denominators and norm partial sums (kMaxNormChunks doubles per block).
struct NsWorkspace {
  NsWorkspace(int64_t blocks, int64_t m, int64_t n);
  size_t e_bytes, s_bytes, denom_bytes, partial_bytes, total;
};

// Newton-Schulz on `blocks` blocks of m x n (m <= n) in `workspace` (NsWorkspace bytes, 256-byte
// aligned). REQUIRES: m, n, blocks <= INT_MAX; config.ns_steps >= 1.
class NsPlan {
 public:
  NsPlan(NsOps& ops, const common::MuonConfig& config, int64_t blocks, int64_t m, int64_t n,
         char* workspace);

  // The normalized input goes here ([B, m, n], row-major, in FirstType()), before Run.
  void* input() const { return e_[0]; }
  Elem FirstType() const;
  // The compute dtype's element type, and how many leading iterations run in fp32.
  Elem Compute() const;
  int Fp32Steps() const;
  float* denom() const { return denom_; }
  double* partials() const { return partials_; }

  // Enqueues the iterations; *out is the result ([B, m, n] row-major, type out->type).
  absl::Status Run(Mat* out);

 private:
  absl::Status RowMajorGemm(bool ta, bool tb, int64_t rows, int64_t cols, int64_t inner,
                            float alpha, Mat a, int64_t lda, int64_t stride_a, Mat b, int64_t ldb,
                            int64_t stride_b, float beta, Mat c, int64_t ldc, int64_t stride_c);
  absl::Status XXt(Mat x, Mat out);
  absl::Status Square(Mat a, Mat b, float alpha, float beta, Mat out);
  absl::Status Left(Mat p, Mat x, float alpha, float beta, Mat out);
  absl::Status Direct(Mat* x, Mat* next, int begin, int end);
  absl::Status GramMethod(Elem compute, Mat* out);
  int64_t Elems() const { return blocks_ * m_ * n_; }
  int64_t Squares() const { return blocks_ * m_ * m_; }

  NsOps& ops_;
  const common::MuonConfig& config_;
  const int64_t blocks_, m_, n_;
  void* e_[2];
  void* s_[5];
  float* denom_;
  double* partials_;
};

}  // namespace muond::server::device::cuda

#endif  // MUOND_SERVER_DEVICE_CUDA_CUDA_NS_PLAN_H_
