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
#include "server/device/cuda/cuda_ns_plan.h"
#include "server/device/cuda/cuda_status.h"
#include "server/optim/muon_math.h"

namespace muond::server::device::cuda {
namespace {

using common::MuonConfig;

// The plan's primitive operations on a CUDA stream: cuBLAS and the kernels of cuda_kernels.h.
class CudaNsOps final : public NsOps {
 public:
  explicit CudaNsOps(const MuonLaunch& launch) : launch_(launch) {}
  absl::Status Gemm(const GemmArgs& g) override {
    MUOND_CUBLAS_RETURN_IF_ERROR(cublasGemmStridedBatchedEx(
        launch_.blas, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
        g.m, g.n, g.k, &g.alpha, g.a.data, CudaType(g.a.type), g.lda, g.stride_a, g.b.data,
        CudaType(g.b.type), g.ldb, g.stride_b, &g.beta, g.c.data, CudaType(g.c.type), g.ldc,
        g.stride_c, g.batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  }
  absl::Status Copy(Mat to, Mat from, int64_t elems) override {
    MUOND_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(to.data, from.data, elems * ElemSize(from.type),
                                               cudaMemcpyDeviceToDevice, launch_.stream));
    return absl::OkStatus();
  }
  absl::Status Convert(Mat from, Mat to, int64_t elems) override {
    MUOND_CUDA_RETURN_IF_ERROR(
        LaunchConvert(from.type, from.data, to.type, to.data, elems, 1.0f, launch_.stream));
    return absl::OkStatus();
  }
  absl::Status AddDiagonal(Mat p, int64_t blocks, int64_t m, float a) override {
    MUOND_CUDA_RETURN_IF_ERROR(
        LaunchAddDiagonal(static_cast<float*>(p.data), blocks, m, a, launch_.stream));
    return absl::OkStatus();
  }

 private:
  static cudaDataType CudaType(Elem e) {
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
  const MuonLaunch& launch_;
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
    return absl::InvalidArgumentError(absl::StrCat(
        "matrix '", items[group.front().index].spec->name, "': blocks too large for cuBLAS"));
  }
  const NsWorkspace layout(blocks, m, n);
  ASSIGN_OR_RETURN(DeviceBuffer workspace, launch.allocate(layout.total));
  CudaNsOps ops(launch);
  NsPlan ns(ops, config, blocks, m, n, static_cast<char*>(workspace.data()));
  const float k = static_cast<float>(NsNormFactor(config.ns_method));
  const Elem first = ns.FirstType();
  int64_t offset = 0;  // blocks before the item
  for (const ItemShape& s : group) {
    float* u = static_cast<float*>(items[s.index].grad_update->data());
    const int chunks = NormChunks(rows * cols);
    MUOND_CUDA_RETURN_IF_ERROR(LaunchNormPartials(
        u, s.g.batch, rows * cols, chunks, ns.partials() + offset * kMaxNormChunks, launch.stream));
    MUOND_CUDA_RETURN_IF_ERROR(
        LaunchNormFinalize(ns.partials() + offset * kMaxNormChunks, s.g.batch, chunks, k,
                           static_cast<float>(kNsNormEpsilon), ns.denom() + offset, launch.flag,
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
    if (it.held_in != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("matrix '", it.spec->name,
                       "': momentum held compressed in host memory is for host-memory devices; "
                       "the CUDA kernel takes a device copy of its decoding"));
    }
    if (it.momentum_out != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("matrix '", it.spec->name,
                       "': a separate momentum output is for host-memory devices; the CUDA "
                       "kernel updates its device copy of the momentum in place"));
    }
    const MatrixGeometry g = GeometryOf(*it.spec);
    const int64_t n = it.spec->numel();
    if (g.batch < 1 || g.rows < 1 || g.cols < 1 || g.batch * g.rows * g.cols != n) {
      return absl::InvalidArgumentError(absl::StrCat("matrix '", it.spec->name,
                                                     "': shape with num_heads ", it.spec->num_heads,
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
      if (!batch.empty() && NsWorkspace(blocks + s.g.batch, m, n).total > launch.workspace_cap) {
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
