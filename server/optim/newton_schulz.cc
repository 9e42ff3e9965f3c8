// Newton-Schulz orthogonalization (DESIGN.md 3, NS(X)) on the CPU. This file, ns_batched_math.cc
// and ns_gram.cc are the files of server/optim that include LibTorch headers; every LibTorch
// exception is caught here.
//
// Layout: the caller's fp32 buffer is wrapped without a copy (at::from_blob) as [batch, rows,
// cols]. Blocks with rows > cols are processed transposed, so every product works on X of shape
// [batch, m, n] with m <= n.
//
// Compute dtypes (ns_batched_math.h):
//  - float32 and bfloat16: oneDNN's matmul (AVX-512, and AVX-512 BF16 where the CPU has it),
//    accumulating in fp32 and rounding each op's result to the storage dtype once, called
//    directly (dnnl_gemm.h): X X^T and A A as upper-triangle strips (mirrored), B X in column
//    chunks, every piece a single-threaded product and the pieces of all blocks spread over the
//    threads (ns_tasks.h). Per iteration on [m, n] with S strips: (1 + 1/S)/2 of X X^T and A A,
//    all of B X. No BLAS thread pool runs beside the OpenMP team (fp32 used OpenBLAS's SYRK/SYMM
//    on its own pthreads, which fought the team's spinning threads for the cores: one 512 x 512
//    call was seen to take 1.26 s instead of 0.04 s).
//  - float16: LibTorch 1.13's CPU GEMM has no Half kernel, so fp16 is emulated: fp32 storage and
//    the system BLAS's symmetric products (SYRK, SYMM: symmetric_products.h), each op's result
//    rounded to fp16 (nearest even, overflow to inf).
//    It exists for parity with fp16 device backends, not for speed.
//
// Precision plan (DESIGN.md 3): bf16 and fp16 run every iteration in that dtype, as the reference
// implementations do (contract < 5e-2 against float64; muon_float64_test measures ~2-3e-2 on its
// Gaussian blocks). The job option muon.fp32_iterations = K runs iterations [0, K) in fp32 on the
// fp32-normalized input first (K >= 2: < 2e-2). Why the first ones: the normalized input has
// singular values far below 1, and rounding X, A or P there puts an error of 2^-9 of the largest
// singular directions into the small ones, which the next iterations grow by a^k (a = 3.4
// standard, 8.3 then 4.1 Polar Express) towards 1; from iteration 2 on no single rounding costs
// more than ~6e-3 (measured with a float64 emulation of each op's rounding). Steep spectra are
// worse (singular values ~1/i^2 on 256 x 256: ~2.7e-2 even with K = 2).
//
// Normalization: the per-block Frobenius norm is summed in float64 on the caller's data in one
// fixed order and rounded to fp32; X / (norm*k + 1e-7) is computed in fp32, then cast to the
// compute dtype once (the same formula with one rounding fewer than rounding X first). It and the
// scaled write-back are tiled passes over raw buffers (ns_layout.h), not LibTorch ops.
//
// gram: see ns_gram.cc (which shapes use it, and its precision).
#include "server/optim/newton_schulz.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "server/optim/cpu_isa.h"
#include "server/optim/ns_batched_math.h"
#include "server/optim/ns_layout.h"
#include "server/optim/ns_schedule.h"
#include "server/optim/ns_tasks.h"

namespace muond::server {
namespace {

using common::DType;
using common::MuonConfig;
using common::NsMethod;

using internal::BatchedMath;
using internal::ScopedSingleAtenThread;
using internal::Scratch;
using internal::ScratchTensor;
using ns::IterationCoefficients;
using ns::kGramRestartAfter;
using ns::kNormEpsilon;

// The fp32 m x m work of the Gram iteration costs about this many times a bf16 GEMM's per FLOP
// (ns_gram.cc's GramPays weighs it so). Set from a 2-thread measurement of bf16 matmul at ~600
// GFLOP/s against fp32 SYRK/SYMM; OpenBLAS 0.3.21 runs its Cooperlake (AVX-512) kernels on this
// CPU (openblas_get_corename), ~170 GFLOP/s per core for SGEMM, so a plain GEMM alone would
// suggest ~2: the weight is conservative (bf16 keeps the standard iteration unless n >= 12 m).
constexpr double kFp32CostInBf16 = 3.0;

// bf16 is native or emulated in fp32 storage (cpu_isa.h), fp16 always emulated.
at::ScalarType StorageType(DType compute, bool emulate_bf16) {
  switch (compute) {
    case DType::kBFloat16:
      return emulate_bf16 ? at::kFloat : at::kBFloat16;
    case DType::kFloat16:  // emulated in fp32 storage, see the file comment
    case DType::kFloat32:
      return at::kFloat;
  }
  return at::kFloat;
}

// INVALID_ARGUMENT for a geometry or a step count that ScaledNewtonSchulz cannot run.
absl::Status CheckArguments(const MuonConfig& config, MatrixGeometry geometry) {
  if (geometry.batch < 1 || geometry.rows < 1 || geometry.cols < 1) {
    return absl::InvalidArgumentError(absl::StrCat("Newton-Schulz: bad geometry [", geometry.batch,
                                                   ", ", geometry.rows, ", ", geometry.cols, "]"));
  }
  if (config.ns_steps < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("Newton-Schulz: ns_steps must be >= 1, got ", config.ns_steps));
  }
  return absl::OkStatus();
}

// X / (||X||_F * k + eps) per block of the caller's buffers, into one contiguous tensor
// [count * b, m, n] of `storage` (ns_layout.h: transposed through tiles when rows > cols): fp32
// wherever fp32 iterations or the Gram path come first (cast later, see Iterations), or straight
// to bf16 (the quotient computed in fp32 and rounded once on store: the bits of the fp32 quotient
// cast afterwards, one pass over the matrix fewer).
at::Tensor NormalizeBlocks(NsMethod method, const internal::BlockLayout& layout,
                           const float* const* xs, at::ScalarType storage, const char** op) {
  const int64_t m = std::min(layout.rows, layout.cols), n = std::max(layout.rows, layout.cols);
  at::Tensor out = ScratchTensor(
      Scratch::kNormalized, {static_cast<int64_t>(layout.count) * layout.batch, m, n}, storage);
  *op = "normalize";
  internal::NormalizeBlocksInto(
      layout, xs, ns::NormFactor(method), static_cast<float>(kNormEpsilon),
      storage == at::kBFloat16 ? internal::GemmType::kBFloat16 : internal::GemmType::kFloat32,
      out.data_ptr(), omp_get_max_threads());
  return out;
}

// Iterations [begin, end) of the formula in math's dtype on X [b, m, n] (m <= n); `steps` is the
// total (for the coefficients).
at::Tensor DirectIterations(BatchedMath& math, at::Tensor x, NsMethod method, int begin, int end,
                            int steps) {
  if (begin >= end) return x;
  const int64_t batch = x.size(0);
  const int64_t m = x.size(1);
  at::Tensor a = ScratchTensor(Scratch::kA, {batch, m, m}, x.scalar_type());
  at::Tensor p = ScratchTensor(Scratch::kP, {batch, m, m}, x.scalar_type());
  // next must not share memory with x: x is the normalized scratch or a fresh cast.
  at::Tensor next = ScratchTensor(Scratch::kNext, x.sizes(), x.scalar_type());
  // fp16 emulation is BLAS work on BLAS's threads (see ScopedSingleAtenThread).
  ScopedSingleAtenThread blas(math.UsesBlas());
  for (int i = begin; i < end; ++i) {
    math.Iteration(x, IterationCoefficients(method, i, steps), a, p, next);
    std::swap(x, next);
  }
  return x;
}

// All config.ns_steps iterations on the normalized fp32 xs [b, m, n] (m <= n): the first
// fp32_iterations in fp32 (bf16 and fp16 only), the rest in the compute dtype; gram where
// GramPays. math computes in the compute dtype, fp32_math in fp32.
at::Tensor Iterations(const MuonConfig& config, BatchedMath& math, BatchedMath& fp32_math,
                      at::Tensor xs) {
  // Emulated bf16 products run on fp32 kernels: the Gram iteration's fp32 m x m side costs the same
  // per FLOP as the long side.
  const int steps = config.ns_steps;
  const NsMethod method = config.ns_method;
  const bool reduced = config.compute_dtype != DType::kFloat32;
  const int fp32_steps = reduced ? std::clamp(config.fp32_iterations, 0, steps) : steps;
  const double fp32_weight =
      config.compute_dtype == DType::kBFloat16 && math.emulation() == internal::Emulation::kNone
          ? kFp32CostInBf16
          : 1.0;
  if (method == NsMethod::kGram && internal::GramPays(xs.size(1), xs.size(2), steps, fp32_weight)) {
    return internal::GramIterations(math, fp32_math, /*first_long_fp32=*/fp32_steps > 0,
                                    /*rest_long_fp32=*/fp32_steps > kGramRestartAfter, method,
                                    steps, std::move(xs));
  }
  at::Tensor x = DirectIterations(fp32_math, std::move(xs), method, 0, fp32_steps, steps);
  if (fp32_steps == steps) return x;
  // Normalized straight into bf16 (ScaledNewtonSchulzMany) when no fp32 iteration comes first;
  // otherwise cast (and under fp16 emulation, rounded) here.
  const bool already_compute =
      fp32_steps == 0 && x.scalar_type() == at::kBFloat16 && math.storage() == at::kBFloat16;
  if (!already_compute) x = math.ToCompute("cast X to the compute dtype", x);
  return DirectIterations(math, std::move(x), method, fp32_steps, steps, steps);
}

// INVALID_ARGUMENT naming the first non-finite element of the result, if any.
absl::Status CheckFinite(const MuonConfig& config, MatrixGeometry geometry, const float* x) {
  const int64_t n = geometry.batch * geometry.rows * geometry.cols;
  if (const int64_t bad = common::FindNonFinite(x, static_cast<size_t>(n)); bad >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Newton-Schulz: result is not finite (element ", bad, " of ", n, " is ",
                     x[bad], "); the input holds a non-finite value or overflowed in ",
                     std::string(common::DTypeName(config.compute_dtype))));
  }
  return absl::OkStatus();
}

}  // namespace

namespace internal {

absl::Status ScaledNewtonSchulzMany(const MuonConfig& config, MatrixGeometry geometry, size_t count,
                                    double scale, float* const* xs) {
  RETURN_IF_ERROR(CheckArguments(config, geometry));
  if (count == 0) return absl::OkStatus();
  const char* op = "from_blob";
  const bool emulate_bf16 = config.compute_dtype == DType::kBFloat16 && EmulateBf16();
  const internal::Emulation emulation = config.compute_dtype == DType::kFloat16
                                            ? internal::Emulation::kFp16
                                        : emulate_bf16 ? internal::Emulation::kBf16
                                                       : internal::Emulation::kNone;
  BatchedMath math(StorageType(config.compute_dtype, emulate_bf16), emulation, &op);
  BatchedMath fp32_math(at::kFloat, internal::Emulation::kNone, &op);
  int64_t bad = -1;  // the first buffer whose result is not finite
  try {
    c10::InferenceMode no_autograd;
    const internal::BlockLayout layout{count, geometry.batch, geometry.rows, geometry.cols};
    // Normalized straight into bf16 when the first iteration is a plain native bf16 one (emulation
    // normalizes in fp32 and rounds on the cast: the same values).
    const bool plain_bf16 = config.compute_dtype == DType::kBFloat16 && !emulate_bf16 &&
                            config.fp32_iterations <= 0 && config.ns_method != NsMethod::kGram;
    at::Tensor normalized =
        NormalizeBlocks(config.ns_method, layout, xs, plain_bf16 ? at::kBFloat16 : at::kFloat, &op);
    const at::Tensor result =
        Iterations(config, math, fp32_math, std::move(normalized)).contiguous();
    op = "write back";
    if (result.scalar_type() != at::kFloat && result.scalar_type() != at::kBFloat16) {
      throw std::runtime_error("the iterations' result is neither fp32 nor bf16");
    }
    // fp32 results are scaled and stored at once; bf16 ones widened first, then scaled in fp32
    // (scaling in bf16 would round once more).
    bad = internal::WriteBackBlocks(layout, result.data_ptr(),
                                    result.scalar_type() == at::kBFloat16
                                        ? internal::GemmType::kBFloat16
                                        : internal::GemmType::kFloat32,
                                    scale, xs, omp_get_max_threads());
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("Newton-Schulz: LibTorch op ", op, " failed: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("Newton-Schulz: LibTorch op ", op, " failed: ", e.what()));
  }
  if (bad >= 0) return CheckFinite(config, geometry, xs[bad]);
  return absl::OkStatus();
}

namespace {

// Every iteration a plain bf16 one of the task pool (no fp32 iteration first; standard or Polar
// Express: gram picks its path per shape). fp32 iterates group by group on the same task pool: its
// scratch (X and the next X, 8 bytes per element) is held for one group at a time, not for the
// whole batch at once (twice the host memory the gather budget counts for the batch's staging).
bool Pooled(const MuonConfig& config) {
  return config.compute_dtype == DType::kBFloat16 && config.fp32_iterations <= 0 &&
         config.ns_method != NsMethod::kGram;
}

// Where each group's blocks lie in the pooled scratch (elements).
struct PooledPlan {
  std::vector<BlockLayout> layouts;
  std::vector<int64_t> x_offset, a_offset;  // [b, m, n] and [b, m, m] per group
  int64_t x_total = 0, a_total = 0;
};

PooledPlan PlanPooled(const NsGroup* groups, size_t count) {
  PooledPlan plan;
  for (size_t g = 0; g < count; ++g) {
    const MatrixGeometry& geo = groups[g].geometry;
    plan.layouts.push_back(BlockLayout{groups[g].count, geo.batch, geo.rows, geo.cols});
    const int64_t blocks = static_cast<int64_t>(groups[g].count) * geo.batch;
    const int64_t m = std::min(geo.rows, geo.cols), n = std::max(geo.rows, geo.cols);
    plan.x_offset.push_back(plan.x_total);
    plan.a_offset.push_back(plan.a_total);
    plan.x_total += blocks * m * n;
    plan.a_total += blocks * m * m;
  }
  return plan;
}

// ScaledNewtonSchulzGroups when Pooled(config): normalization, every iteration as one task pool
// per phase over all groups, write-back; the bits of ScaledNewtonSchulzMany per group (the same
// passes and the same single-threaded products).
absl::Status PooledNewtonSchulz(const MuonConfig& config, const NsGroup* groups, size_t count,
                                size_t* failed) {
  const PooledPlan plan = PlanPooled(groups, count);
  const int threads = omp_get_max_threads();
  const char* op = "scratch";
  // Native bf16, or bf16 values in fp32 storage with each product's result rounded (cpu_isa.h).
  const bool emulate = EmulateBf16();
  const GemmType type = emulate ? GemmType::kFloat32 : GemmType::kBFloat16;
  const at::ScalarType storage = emulate ? at::kFloat : at::kBFloat16;
  const size_t kEs = emulate ? 4 : 2;
  try {
    c10::InferenceMode no_autograd;
    char* x =
        static_cast<char*>(ScratchTensor(Scratch::kNormalized, {plan.x_total}, storage).data_ptr());
    char* next =
        static_cast<char*>(ScratchTensor(Scratch::kNext, {plan.x_total}, storage).data_ptr());
    char* a = static_cast<char*>(ScratchTensor(Scratch::kA, {plan.a_total}, storage).data_ptr());
    char* p = static_cast<char*>(ScratchTensor(Scratch::kP, {plan.a_total}, storage).data_ptr());
    op = "normalize";
    for (size_t g = 0; g < count; ++g) {
      NormalizeBlocksInto(plan.layouts[g], groups[g].xs, ns::NormFactor(config.ns_method),
                          static_cast<float>(kNormEpsilon), type, x + plan.x_offset[g] * kEs,
                          threads);
    }
    // The native path rounds the fp32 quotient to bf16 on store; emulation rounds it here.
    if (emulate) RoundToBf16(reinterpret_cast<float*>(x), plan.x_total, threads);
    std::vector<TaskBlocks> blocks(count);
    for (int i = 0; i < config.ns_steps; ++i) {
      for (size_t g = 0; g < count; ++g) {
        const BlockLayout& l = plan.layouts[g];
        blocks[g] = TaskBlocks{type,
                               static_cast<int64_t>(l.count) * l.batch,
                               std::min(l.rows, l.cols),
                               std::max(l.rows, l.cols),
                               x + plan.x_offset[g] * kEs,
                               a + plan.a_offset[g] * kEs,
                               p + plan.a_offset[g] * kEs,
                               next + plan.x_offset[g] * kEs,
                               /*round_bf16=*/emulate};
      }
      TaskIteration(blocks.data(), count,
                    IterationCoefficients(config.ns_method, i, config.ns_steps), threads, &op);
      std::swap(x, next);
    }
    op = "write back";
    for (size_t g = 0; g < count; ++g) {
      const int64_t bad =
          WriteBackBlocks(plan.layouts[g], x + plan.x_offset[g] * kEs, type, groups[g].scale,
                          groups[g].xs, threads);
      if (bad >= 0) {
        *failed = g;
        return CheckFinite(config, groups[g].geometry, groups[g].xs[bad]);
      }
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("Newton-Schulz: LibTorch op ", op, " failed: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("Newton-Schulz: op ", op, " failed: ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace

uint64_t ScratchPerMatrix(const MatrixGeometry& geometry) {
  const uint64_t m = static_cast<uint64_t>(std::min(geometry.rows, geometry.cols));
  const uint64_t n = static_cast<uint64_t>(std::max(geometry.rows, geometry.cols));
  return static_cast<uint64_t>(geometry.batch) * (2 * m * n + 2 * m * m) * sizeof(float);
}

namespace {

// One call's groups: pieces of the caller's groups (same xs, a run of their matrices) and, per
// piece, the caller's group index.
struct ScratchChunk {
  std::vector<NsGroup> groups;
  std::vector<size_t> origin;
};

// The groups cut into calls of at most kNewtonSchulzScratchBytes of scratch each (a matrix that
// needs more goes alone), in order.
std::vector<ScratchChunk> ChunkByScratch(const NsGroup* groups, size_t count) {
  std::vector<ScratchChunk> chunks(1);
  uint64_t used = 0;
  for (size_t g = 0; g < count; ++g) {
    const uint64_t per = std::max<uint64_t>(1, ScratchPerMatrix(groups[g].geometry));
    size_t done = 0;
    while (done < groups[g].count) {
      if (used + per > kNewtonSchulzScratchBytes && !chunks.back().groups.empty()) {
        chunks.emplace_back();
        used = 0;
      }
      const uint64_t room = kNewtonSchulzScratchBytes > used ? kNewtonSchulzScratchBytes - used : 0;
      const size_t take =
          std::min<size_t>(groups[g].count - done, std::max<uint64_t>(1, room / per));
      NsGroup piece = groups[g];
      piece.count = take;
      piece.xs = groups[g].xs + done;
      chunks.back().groups.push_back(piece);
      chunks.back().origin.push_back(g);
      used += take * per;
      done += take;
    }
  }
  return chunks;
}

// ScaledNewtonSchulzGroups on one chunk (the caller bounded its scratch).
absl::Status NewtonSchulzChunk(const MuonConfig& config, const NsGroup* groups, size_t count,
                               size_t* failed) {
  if (!Pooled(config)) {
    for (size_t g = 0; g < count; ++g) {
      absl::Status s = ScaledNewtonSchulzMany(config, groups[g].geometry, groups[g].count,
                                              groups[g].scale, groups[g].xs);
      if (!s.ok()) {
        *failed = g;
        return s;
      }
    }
    return absl::OkStatus();
  }
  return PooledNewtonSchulz(config, groups, count, failed);
}

}  // namespace

absl::Status ScaledNewtonSchulzGroups(const MuonConfig& config, const NsGroup* groups, size_t count,
                                      size_t* failed) {
  *failed = kNoGroup;
  for (size_t g = 0; g < count; ++g) {
    if (absl::Status s = CheckArguments(config, groups[g].geometry); !s.ok()) {
      *failed = g;
      return s;
    }
  }
  // Each block's bits are those of a call on it alone (ScaledNewtonSchulzMany), so the cut
  // changes no result; it bounds the scratch the compute thread keeps by the budget, not by the
  // batch (which the gather budget bounds: up to the whole model).
  for (const ScratchChunk& chunk : ChunkByScratch(groups, count)) {
    size_t piece = kNoGroup;
    absl::Status s = NewtonSchulzChunk(config, chunk.groups.data(), chunk.groups.size(), &piece);
    if (!s.ok()) {
      *failed = piece == kNoGroup ? kNoGroup : chunk.origin[piece];
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status ScaledNewtonSchulz(const MuonConfig& config, MatrixGeometry geometry, double scale,
                                float* x) {
  return ScaledNewtonSchulzMany(config, geometry, 1, scale, &x);
}

}  // namespace internal

absl::Status NewtonSchulz(const MuonConfig& config, MatrixGeometry geometry, float* x) {
  return internal::ScaledNewtonSchulz(config, geometry, 1.0, x);
}

void SetMathThreads(int n) { at::set_num_threads(n < 1 ? 1 : n); }

int MathThreads() { return at::get_num_threads(); }

}  // namespace muond::server
