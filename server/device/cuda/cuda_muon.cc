// Muon on a CUDA stream (see cuda_muon.h).
//
// Layout: the items of one call are grouped by block shape (rows x cols of GeometryOf); the blocks
// of a group (heads, experts, and same-shape matrices) are normalized into one contiguous
// workspace [B, m, n] (m <= n: blocks with rows > cols are transposed by the normalizing copy), so
// that every product of an iteration is one strided-batched GEMM over all B blocks. The result is
// transposed back, scaled and checked for non-finite values by the copy into the caller's buffer.
// A group whose workspace would exceed MuonLaunch::workspace_cap is split by items.
//
// GEMMs: cublasGemmStridedBatchedEx with CUBLAS_COMPUTE_32F (fp32 accumulation; no TF32: the
// handle's math mode is the default one with reduced-precision reductions disallowed), inputs and
// output in fp32, bf16 or fp16. The operands are row-major; cuBLAS is column-major, so
// C = op(A) op(B) is computed as C^T = op(B)^T op(A)^T (RowMajorGemm).
#include "server/device/cuda/cuda_muon.h"

#include <algorithm>
#include <climits>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/device/cuda/cuda_kernels.h"
#include "server/device/cuda/cuda_status.h"
#include "server/muon/muon_math.h"

namespace muond::server::device::cuda {
namespace {

using common::DType;
using common::MuonConfig;
using common::NsMethod;

// The coefficients and constants of newton_schulz.cc (DESIGN.md 3), which this file must match.
struct Coefficients {
  double a, b, c;
};
constexpr Coefficients kStandard{3.4445, -4.7750, 2.0315};
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
constexpr double kPolarExpressSafety = 1.01;
constexpr double kNormEpsilon = 1e-7;
constexpr int kGramRestartAfter = 2;
constexpr int kBf16Fp32Steps = 2;
constexpr int64_t kBf16SmallSide = 256;
constexpr int64_t kBf16WideRatio = 8;
constexpr size_t kAlign = 256;

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

cudaDataType CudaType(Elem e) {
  switch (e) {
    case Elem::kF32:
      return CUDA_R_32F;
    case Elem::kBf16:
      return CUDA_R_16BF;
    case Elem::kF16:
      return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

size_t AlignUp(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// A batch of row-major blocks in one element type.
struct Mat {
  void* data;
  Elem type;
};

// Workspace bytes for `blocks` blocks of m x n (m <= n): two [B, m, n] fp32 buffers (X and the
// next X, also used as 16-bit), five [B, m, m] fp32 buffers (A/R, B/P, Q, T and a 16-bit cast),
// the per-block denominators and norm partial sums.
struct WorkspaceLayout {
  WorkspaceLayout(int64_t blocks, int64_t m, int64_t n) {
    e_bytes = AlignUp(static_cast<size_t>(blocks * m * n) * sizeof(float));
    s_bytes = AlignUp(static_cast<size_t>(blocks * m * m) * sizeof(float));
    denom_bytes = AlignUp(static_cast<size_t>(blocks) * sizeof(float));
    partial_bytes = AlignUp(static_cast<size_t>(blocks) * kMaxNormChunks * sizeof(double));
    total = 2 * e_bytes + 5 * s_bytes + denom_bytes + partial_bytes;
  }
  size_t e_bytes, s_bytes, denom_bytes, partial_bytes, total;
};

// Newton-Schulz on B blocks of m x n (m <= n) in a workspace, enqueued on one stream.
class BatchedNs {
 public:
  BatchedNs(const MuonLaunch& launch, const MuonConfig& config, int64_t blocks, int64_t m,
            int64_t n, char* workspace)
      : launch_(launch), config_(config), blocks_(blocks), m_(m), n_(n), layout_(blocks, m, n) {
    char* p = workspace;
    e_[0] = p;
    e_[1] = p + layout_.e_bytes;
    p += 2 * layout_.e_bytes;
    for (void*& s : s_) {
      s = p;
      p += layout_.s_bytes;
    }
    denom_ = reinterpret_cast<float*>(p);
    partials_ = reinterpret_cast<double*>(p + layout_.denom_bytes);
  }

  // The normalized input goes here, in FirstType(), block by block.
  void* input() const { return e_[0]; }
  float* denom() const { return denom_; }
  double* partials() const { return partials_; }
  Elem FirstType() const {
    return config_.compute_dtype == DType::kFloat16 ? Elem::kF16 : Elem::kF32;
  }

  // Runs the iterations on input(); the result is *out ([B, m, n] of type out->type).
  absl::Status Run(Mat* out) {
    const int steps = config_.ns_steps;
    const NsMethod method = config_.ns_method;
    const Elem compute = config_.compute_dtype == DType::kFloat32    ? Elem::kF32
                         : config_.compute_dtype == DType::kBFloat16 ? Elem::kBf16
                                                                     : Elem::kF16;
    if (method == NsMethod::kGram && m_ != n_) return GramMethod(compute, out);
    Mat x{e_[0], FirstType()};
    Mat next{e_[1], FirstType()};
    if (compute != Elem::kBf16) {
      RETURN_IF_ERROR(Direct(&x, &next, 0, steps));
      *out = x;
      return absl::OkStatus();
    }
    // bf16 precision plan of newton_schulz.cc: iterations 0 and 1 in fp32, then bf16.
    const int fp32_steps = std::min(kBf16Fp32Steps, steps);
    RETURN_IF_ERROR(Direct(&x, &next, 0, fp32_steps));
    if (fp32_steps < steps) {
      next.type = Elem::kBf16;
      RETURN_IF_ERROR(Convert(x, next, Elems()));
      std::swap(x, next);
      next.type = Elem::kBf16;
      const bool fp32_polynomial = m_ < kBf16SmallSide || n_ >= kBf16WideRatio * m_;
      RETURN_IF_ERROR(fp32_polynomial ? Fp32Polynomial(&x, &next, fp32_steps, steps)
                                       : Direct(&x, &next, fp32_steps, steps));
    }
    *out = x;
    return absl::OkStatus();
  }

 private:
  int64_t Elems() const { return blocks_ * m_ * n_; }
  int64_t Squares() const { return blocks_ * m_ * m_; }

  // Row-major C[M, N] = alpha op(A)[M, K] op(B)[K, N] + beta C, batched over the blocks; ld* are
  // the row lengths of the stored operands, stride* their block strides (elements).
  absl::Status RowMajorGemm(bool ta, bool tb, int64_t rows, int64_t cols, int64_t inner,
                            float alpha, Mat a, int64_t lda, int64_t stride_a, Mat b, int64_t ldb,
                            int64_t stride_b, float beta, Mat c, int64_t ldc, int64_t stride_c) {
    MUOND_CUBLAS_RETURN_IF_ERROR(cublasGemmStridedBatchedEx(
        launch_.blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
        static_cast<int>(cols), static_cast<int>(rows), static_cast<int>(inner), &alpha, b.data,
        CudaType(b.type), static_cast<int>(ldb), stride_b, a.data, CudaType(a.type),
        static_cast<int>(lda), stride_a, &beta, c.data, CudaType(c.type), static_cast<int>(ldc),
        stride_c, static_cast<int>(blocks_), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  }
  // out[m, m] = X X^T
  absl::Status XXt(Mat x, Mat out) {
    return RowMajorGemm(false, true, m_, m_, n_, 1.0f, x, n_, m_ * n_, x, n_, m_ * n_, 0.0f, out,
                        m_, m_ * m_);
  }
  // out[m, m] = alpha a b + beta out
  absl::Status Square(Mat a, Mat b, float alpha, float beta, Mat out) {
    return RowMajorGemm(false, false, m_, m_, m_, alpha, a, m_, m_ * m_, b, m_, m_ * m_, beta, out,
                        m_, m_ * m_);
  }
  // out[m, n] = alpha p x + beta out
  absl::Status Left(Mat p, Mat x, float alpha, float beta, Mat out) {
    return RowMajorGemm(false, false, m_, n_, m_, alpha, p, m_, m_ * m_, x, n_, m_ * n_, beta, out,
                        n_, m_ * n_);
  }
  absl::Status Copy(Mat to, Mat from, int64_t elems) {
    MUOND_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(to.data, from.data, elems * ElemSize(from.type),
                                               cudaMemcpyDeviceToDevice, launch_.stream));
    return absl::OkStatus();
  }
  absl::Status Convert(Mat from, Mat to, int64_t elems) {
    MUOND_CUDA_RETURN_IF_ERROR(
        LaunchConvert(from.type, from.data, to.type, to.data, elems, launch_.stream));
    return absl::OkStatus();
  }
  absl::Status AddDiagonal(Mat p, double a) {
    MUOND_CUDA_RETURN_IF_ERROR(LaunchAddDiagonal(static_cast<float*>(p.data), blocks_, m_,
                                                 static_cast<float>(a), launch_.stream));
    return absl::OkStatus();
  }

  // Iterations [begin, end) of the formula as written, in x's type:
  // A = X X^T; B = b A + c A A; X = a X + B X.
  absl::Status Direct(Mat* x, Mat* next, int begin, int end) {
    const Mat a{s_[0], x->type};
    const Mat b{s_[1], x->type};
    for (int i = begin; i < end; ++i) {
      const Coefficients k = IterationCoefficients(config_.ns_method, i, config_.ns_steps);
      RETURN_IF_ERROR(XXt(*x, a));
      RETURN_IF_ERROR(Copy(b, a, Squares()));
      RETURN_IF_ERROR(Square(a, a, static_cast<float>(k.c), static_cast<float>(k.b), b));
      next->type = x->type;
      RETURN_IF_ERROR(Copy(*next, *x, Elems()));
      RETURN_IF_ERROR(Left(b, *x, 1.0f, static_cast<float>(k.a), *next));
      std::swap(*x, *next);
    }
    return absl::OkStatus();
  }

  // bf16 iterations [begin, end) with the m x m polynomial in fp32:
  // A = X X^T (bf16), P = a I + b A + c A A (fp32), X = bf16(P) X (bf16).
  absl::Status Fp32Polynomial(Mat* x, Mat* next, int begin, int end) {
    const Mat a{s_[0], Elem::kBf16};
    const Mat a32{s_[1], Elem::kF32};
    const Mat p{s_[2], Elem::kF32};
    const Mat p16{s_[3], Elem::kBf16};
    for (int i = begin; i < end; ++i) {
      const Coefficients k = IterationCoefficients(config_.ns_method, i, config_.ns_steps);
      RETURN_IF_ERROR(XXt(*x, a));
      RETURN_IF_ERROR(Convert(a, a32, Squares()));
      RETURN_IF_ERROR(Copy(p, a32, Squares()));
      RETURN_IF_ERROR(Square(a32, a32, static_cast<float>(k.c), static_cast<float>(k.b), p));
      RETURN_IF_ERROR(AddDiagonal(p, k.a));
      RETURN_IF_ERROR(Convert(p, p16, Squares()));
      RETURN_IF_ERROR(Left(p16, *x, 1.0f, 0.0f, *next));
      std::swap(*x, *next);
    }
    return absl::OkStatus();
  }

  // The gram method of newton_schulz.cc (GramIterations): the polynomial on R = X0 X0^T with the
  // m x m side in fp32, Q accumulated, X = Q X0 at the restart and at the end. X0 starts in the
  // first type (fp32, or fp16) and is `compute` after the restart.
  absl::Status GramMethod(Elem compute, Mat* out) {
    Mat x0{e_[0], FirstType()};
    Mat spare{e_[1], FirstType()};
    Mat r{s_[0], Elem::kF32}, p{s_[1], Elem::kF32}, q{s_[2], Elem::kF32}, t{s_[3], Elem::kF32};
    const int steps = config_.ns_steps;
    // Q in X0's type for Q X0 (fp32: Q itself).
    auto q_as = [&](Elem type, Mat* qc) -> absl::Status {
      if (type == Elem::kF32) {
        *qc = q;
        return absl::OkStatus();
      }
      *qc = Mat{s_[4], type};
      return Convert(q, *qc, Squares());
    };
    RETURN_IF_ERROR(XXt(x0, r));  // mixed: X0's type in, fp32 out
    bool q_is_identity = true;
    for (int i = 0; i < steps; ++i) {
      if (i == kGramRestartAfter) {
        Mat qc{};
        RETURN_IF_ERROR(q_as(x0.type, &qc));
        spare.type = x0.type;
        RETURN_IF_ERROR(Left(qc, x0, 1.0f, 0.0f, spare));
        if (x0.type != compute) {
          x0.type = compute;
          RETURN_IF_ERROR(Convert(spare, x0, Elems()));
        } else {
          std::swap(x0, spare);
        }
        RETURN_IF_ERROR(XXt(x0, r));
        q_is_identity = true;
      }
      const Coefficients k = IterationCoefficients(config_.ns_method, i, steps);
      RETURN_IF_ERROR(Copy(p, r, Squares()));
      RETURN_IF_ERROR(Square(r, r, static_cast<float>(k.c), static_cast<float>(k.b), p));
      RETURN_IF_ERROR(AddDiagonal(p, k.a));
      if (i + 1 < steps && i + 1 != kGramRestartAfter) {
        RETURN_IF_ERROR(Square(r, p, 1.0f, 0.0f, t));
        RETURN_IF_ERROR(Square(p, t, 1.0f, 0.0f, r));
      }
      if (q_is_identity) {
        std::swap(q, p);
        q_is_identity = false;
      } else {
        RETURN_IF_ERROR(Square(p, q, 1.0f, 0.0f, t));
        std::swap(q, t);
      }
    }
    Mat qc{};
    RETURN_IF_ERROR(q_as(x0.type, &qc));
    spare.type = x0.type;
    RETURN_IF_ERROR(Left(qc, x0, 1.0f, 0.0f, spare));
    *out = spare;
    return absl::OkStatus();
  }

  const MuonLaunch& launch_;
  const MuonConfig& config_;
  const int64_t blocks_, m_, n_;
  const WorkspaceLayout layout_;
  void* e_[2];
  void* s_[5];
  float* denom_;
  double* partials_;
};

struct ItemShape {
  size_t index;  // in the call's items
  MatrixGeometry g;
};

// Normalize, iterate and write back one batch of same-shape items.
absl::Status RunGroup(const MuonLaunch& launch, const MuonConfig& config,
                      const std::vector<MuonKernelItem>& items,
                      const std::vector<ItemShape>& group) {
  const int64_t rows = group.front().g.rows;
  const int64_t cols = group.front().g.cols;
  const bool transposed = rows > cols;
  const int64_t m = std::min(rows, cols);
  const int64_t n = std::max(rows, cols);
  int64_t blocks = 0;
  for (const ItemShape& s : group) blocks += s.g.batch;
  if (m > INT_MAX || n > INT_MAX || blocks > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("matrix '", items[group.front().index].spec->name,
                                                   "': blocks too large for cuBLAS"));
  }
  const WorkspaceLayout layout(blocks, m, n);
  ASSIGN_OR_RETURN(DeviceBuffer workspace, launch.allocate(layout.total));
  BatchedNs ns(launch, config, blocks, m, n, static_cast<char*>(workspace.data()));
  const float k = static_cast<float>(
      config.ns_method == NsMethod::kPolarExpress ? kPolarExpressSafety : 1.0);
  const Elem first = ns.FirstType();
  int64_t offset = 0;  // blocks before the item
  for (const ItemShape& s : group) {
    float* u = static_cast<float*>(items[s.index].grad_update->data());
    const int chunks = NormChunks(rows * cols);
    MUOND_CUDA_RETURN_IF_ERROR(LaunchNormPartials(
        u, s.g.batch, rows * cols, chunks, ns.partials() + offset * kMaxNormChunks, launch.stream));
    MUOND_CUDA_RETURN_IF_ERROR(LaunchNormFinalize(
        ns.partials() + offset * kMaxNormChunks, s.g.batch, chunks, k,
        static_cast<float>(kNormEpsilon), ns.denom() + offset, launch.flag,
        FlagCode(launch.first_seq + s.index, kInputNotFinite), launch.stream));
    MUOND_CUDA_RETURN_IF_ERROR(LaunchTransform(
        Elem::kF32, u, first, static_cast<char*>(ns.input()) + offset * m * n * ElemSize(first),
        s.g.batch, rows, cols, transposed, ns.denom() + offset, 1.0f, nullptr, 0, launch.stream));
    offset += s.g.batch;
  }
  Mat result{};
  RETURN_IF_ERROR(ns.Run(&result));
  const float scale = static_cast<float>(MuonScale(config.scale_mode, rows, cols));
  offset = 0;
  for (const ItemShape& s : group) {
    float* u = static_cast<float*>(items[s.index].grad_update->data());
    MUOND_CUDA_RETURN_IF_ERROR(LaunchTransform(
        result.type, static_cast<char*>(result.data) + offset * m * n * ElemSize(result.type),
        Elem::kF32, u, s.g.batch, m, n, transposed, nullptr, scale, launch.flag,
        FlagCode(launch.first_seq + s.index, kResultNotFinite), launch.stream));
    offset += s.g.batch;
  }
  return absl::OkStatus();  // `workspace` is freed stream-ordered by the pool
}

}  // namespace

absl::Status ValidateMuonItems(const MuonConfig& config, const std::vector<MuonKernelItem>& items) {
  if (config.ns_steps < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("Newton-Schulz: ns_steps must be >= 1, got ", config.ns_steps));
  }
  for (const MuonKernelItem& it : items) {
    if (it.spec == nullptr || it.grad_update == nullptr || it.momentum == nullptr) {
      return absl::InvalidArgumentError("Muon kernel item without a spec or a buffer");
    }
    const MatrixGeometry g = GeometryOf(*it.spec);
    const int64_t n = it.spec->numel();
    if (g.batch < 1 || g.rows < 1 || g.cols < 1 || g.batch * g.rows * g.cols != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("matrix '", it.spec->name, "': shape with num_heads ", it.spec->num_heads,
                       " is not a Muon matrix"));
    }
    const size_t bytes = static_cast<size_t>(n) * sizeof(float);
    if (it.grad_update->size() < bytes || it.momentum->size() < bytes ||
        it.grad_update->data() == nullptr || it.momentum->data() == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("matrix '", it.spec->name, "': device buffers of ", it.grad_update->size(),
                       " and ", it.momentum->size(), " bytes, need ", bytes));
    }
  }
  return absl::OkStatus();
}

absl::Status EnqueueMuon(const MuonLaunch& launch, const MuonConfig& config,
                         const std::vector<MuonKernelItem>& items) {
  // Steps 1 and 2: the host's formula in fp32 (update aliases grad).
  const float one_minus_beta = static_cast<float>(1.0 - config.momentum);
  const float beta = static_cast<float>(config.momentum);
  for (const MuonKernelItem& it : items) {
    float* g = static_cast<float*>(it.grad_update->data());
    MUOND_CUDA_RETURN_IF_ERROR(LaunchMomentum(g, static_cast<float*>(it.momentum->data()), g,
                                              it.spec->numel(), one_minus_beta, beta,
                                              config.nesterov, launch.stream));
  }
  // Step 3 and 4, by block shape, in the order the shapes first appear.
  std::vector<std::pair<int64_t, int64_t>> order;
  std::map<std::pair<int64_t, int64_t>, std::vector<ItemShape>> groups;
  for (size_t i = 0; i < items.size(); ++i) {
    const MatrixGeometry g = GeometryOf(*items[i].spec);
    auto& group = groups[{g.rows, g.cols}];
    if (group.empty()) order.push_back({g.rows, g.cols});
    group.push_back({i, g});
  }
  for (const auto& shape : order) {
    const std::vector<ItemShape>& group = groups[shape];
    const int64_t m = std::min(shape.first, shape.second);
    const int64_t n = std::max(shape.first, shape.second);
    std::vector<ItemShape> batch;
    int64_t blocks = 0;
    for (const ItemShape& s : group) {
      if (!batch.empty() &&
          WorkspaceLayout(blocks + s.g.batch, m, n).total > launch.workspace_cap) {
        RETURN_IF_ERROR(RunGroup(launch, config, items, batch));
        batch.clear();
        blocks = 0;
      }
      batch.push_back(s);
      blocks += s.g.batch;
    }
    RETURN_IF_ERROR(RunGroup(launch, config, items, batch));
  }
  return absl::OkStatus();
}

}  // namespace muond::server::device::cuda
