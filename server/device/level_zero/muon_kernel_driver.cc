// The Muon driver: newton_schulz.cc's sequence of batched products, as kernel launches.
//
// Every block is processed as X [batch, m, n] with m <= n (tall blocks are transposed by the
// normalization and back by the write-back), so each product is one batched GEMM launch over all
// blocks of the matrix (heads, experts). Scratch: three X-sized slots (the iterate, the next one,
// a cast copy) and five m x m slots, sized once per call for its largest matrix and reused by
// every matrix of the call (the queue is in order).
#include "server/device/level_zero/muon_kernel_driver.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "server/device/level_zero/muon_kernels.h"
#include "server/optim/ns_schedule.h"

namespace muond::server::device::level_zero {
namespace {

using common::DType;
using common::MuonConfig;
using common::NsMethod;

using ns::Coefficients;
using ns::IterationCoefficients;
using ns::kGramRestartAfter;
using ns::kNormEpsilon;

// Scratch sizes in elements (allocated as fp32, the widest storage dtype).
struct ScratchSize {
  int64_t x = 1;        // batch * m * n
  int64_t square = 1;   // batch * m * m
  int64_t batch = 1;    // the norm denominators
  int64_t partial = 1;  // the norm's partial sums

  void Add(MatrixGeometry g) {
    const int64_t m = std::min(g.rows, g.cols);
    const int64_t n = std::max(g.rows, g.cols);
    x = std::max(x, g.batch * m * n);
    square = std::max(square, g.batch * m * m);
    batch = std::max(batch, g.batch);
    partial = std::max(partial, g.batch * NormParts(m * n));
  }
};

struct Scratch {
  std::unique_ptr<QueueBuffer> x[3];
  std::unique_ptr<QueueBuffer> square[5];
  std::unique_ptr<QueueBuffer> denom;
  std::unique_ptr<QueueBuffer> partial;
};

absl::StatusOr<Scratch> AllocateScratch(KernelQueue& queue, const ScratchSize& size) {
  Scratch s;
  constexpr size_t kFloat = sizeof(float);
  for (auto& b : s.x) {
    ASSIGN_OR_RETURN(b, queue.Allocate(static_cast<size_t>(size.x) * kFloat));
  }
  for (auto& b : s.square) {
    ASSIGN_OR_RETURN(b, queue.Allocate(static_cast<size_t>(size.square) * kFloat));
  }
  ASSIGN_OR_RETURN(s.denom, queue.Allocate(static_cast<size_t>(size.batch) * kFloat));
  ASSIGN_OR_RETURN(s.partial, queue.Allocate(static_cast<size_t>(size.partial) * kFloat));
  return s;
}

// One Newton-Schulz call on blocks [batch, m, n] (m <= n) held in scratch slots.
class NewtonSchulzRun {
 public:
  NewtonSchulzRun(KernelQueue& queue, Scratch& scratch, const MuonConfig& config, MatrixGeometry g)
      : q_(queue),
        s_(scratch),
        method_(config.ns_method),
        steps_(config.ns_steps),
        compute_(config.compute_dtype),
        fp32_steps_(config.compute_dtype == DType::kFloat32
                        ? config.ns_steps
                        : std::clamp(config.fp32_iterations, 0, config.ns_steps)),
        batch_(g.batch),
        m_(std::min(g.rows, g.cols)),
        n_(std::max(g.rows, g.cols)) {}

  // x: fp32 [batch, rows, cols] of geometry g; result (times scale) written back into it.
  absl::Status Run(MatrixGeometry g, double scale, KernelBufferRef x) {
    const bool transposed = g.rows > g.cols;
    const MatrixBatch input{x, 0, DType::kFloat32, g.batch, g.rows, g.cols};
    const double k = ns::NormFactor(method_);
    const KernelBufferRef denom = s_.denom->ref();
    RETURN_IF_ERROR(FrobeniusDenominator(q_, input, static_cast<float>(k),
                                         static_cast<float>(kNormEpsilon), s_.partial->ref(),
                                         denom));
    // The precision plan of newton_schulz.cc (DESIGN.md 3): the first fp32_steps_ iterations in
    // fp32 (all of them for fp32 compute), then the compute dtype; without fp32 iterations the
    // normalized input is rounded to the compute dtype once.
    const DType first = fp32_steps_ > 0 ? DType::kFloat32 : compute_;
    int xi = 0;
    RETURN_IF_ERROR(Convert(q_, input, transposed, &denom, 1.0f, X(xi, first)));

    DType dtype = first;
    if (method_ == NsMethod::kGram && m_ != n_) {
      RETURN_IF_ERROR(Gram(first, &xi, &dtype));
    } else {
      RETURN_IF_ERROR(Direct(dtype, &xi, 0, fp32_steps_));
      if (fp32_steps_ < steps_) {
        if (dtype != compute_) RETURN_IF_ERROR(CastX(&xi, &dtype, compute_));
        RETURN_IF_ERROR(Direct(dtype, &xi, fp32_steps_, steps_));
      }
    }
    return Convert(q_, X(xi, dtype), transposed, nullptr, static_cast<float>(scale), input);
  }

 private:
  MatrixBatch X(int slot, DType dtype) const {
    return {s_.x[slot]->ref(), 0, dtype, batch_, m_, n_};
  }
  MatrixBatch Square(int slot, DType dtype) const {
    return {s_.square[slot]->ref(), 0, dtype, batch_, m_, m_};
  }
  static int OtherX(int a, int b = -1) {
    for (int i = 0; i < 3; ++i) {
      if (i != a && i != b) return i;
    }
    return 0;
  }
  // Copies X into another slot as `to` (the host's ToCompute of X).
  absl::Status CastX(int* xi, DType* dtype, DType to) {
    const int next = OtherX(*xi);
    RETURN_IF_ERROR(Convert(q_, X(*xi, *dtype), false, nullptr, 1.0f, X(next, to)));
    *xi = next;
    *dtype = to;
    return absl::OkStatus();
  }

  // Iterations [begin, end) as written, every product in `dtype`:
  // A = X X^T; B = b A + c A A; X = a X + B X.
  absl::Status Direct(DType dtype, int* xi, int begin, int end) {
    const MatrixBatch a = Square(0, dtype);
    const MatrixBatch b = Square(1, dtype);
    for (int i = begin; i < end; ++i) {
      const Coefficients k = IterationCoefficients(method_, i, steps_);
      const MatrixBatch x = X(*xi, dtype);
      const int next_slot = OtherX(*xi);
      const MatrixBatch next = X(next_slot, dtype);
      RETURN_IF_ERROR(Gemm(q_, x, false, x, true, nullptr, 1.0f, 0.0f, 0.0f, a));
      RETURN_IF_ERROR(Gemm(q_, a, false, a, false, &a, static_cast<float>(k.c),
                           static_cast<float>(k.b), 0.0f, b));
      RETURN_IF_ERROR(Gemm(q_, b, false, x, false, &x, 1.0f, static_cast<float>(k.a), 0.0f, next));
      *xi = next_slot;
    }
    return absl::OkStatus();
  }

  // newton_schulz.cc's Gram iteration (ns_gram.cc): the m x m side (R, P, Q) in fp32; X0 and the
  // products Q X0 in `x_dtype` until the restart and in the compute dtype after it (unless the
  // fp32 iterations cover it).
  absl::Status Gram(DType x_dtype, int* xi, DType* dtype) {
    int r = 0, p = 1, q = 2, t = 3;
    constexpr int kCastQ = 4;
    const DType f32 = DType::kFloat32;
    auto gram = [&]() {
      const MatrixBatch x0 = X(*xi, x_dtype);
      return Gemm(q_, x0, false, x0, true, nullptr, 1.0f, 0.0f, 0.0f, Square(r, f32));
    };
    // X = cast(Q) X0 into another slot, in x_dtype.
    auto apply_q = [&](int* out_slot) -> absl::Status {
      MatrixBatch qm = Square(q, f32);
      if (x_dtype != f32) {
        RETURN_IF_ERROR(Convert(q_, qm, false, nullptr, 1.0f, Square(kCastQ, x_dtype)));
        qm = Square(kCastQ, x_dtype);
      }
      *out_slot = OtherX(*xi);
      return Gemm(q_, qm, false, X(*xi, x_dtype), false, nullptr, 1.0f, 0.0f, 0.0f,
                  X(*out_slot, x_dtype));
    };
    bool q_is_identity = true;  // Q = I is implicit: not stored, not multiplied
    RETURN_IF_ERROR(gram());
    for (int i = 0; i < steps_; ++i) {
      if (i == kGramRestartAfter) {
        int x_slot = 0;
        RETURN_IF_ERROR(apply_q(&x_slot));
        *xi = x_slot;
        // After the restart X0 is in the compute dtype, unless the fp32 iterations cover it.
        if (x_dtype != compute_ && fp32_steps_ <= kGramRestartAfter) {
          RETURN_IF_ERROR(CastX(xi, &x_dtype, compute_));
        }
        RETURN_IF_ERROR(gram());
        q_is_identity = true;
      }
      const Coefficients k = IterationCoefficients(method_, i, steps_);
      const MatrixBatch rm = Square(r, f32);
      RETURN_IF_ERROR(Gemm(q_, rm, false, rm, false, &rm, static_cast<float>(k.c),
                           static_cast<float>(k.b), static_cast<float>(k.a), Square(p, f32)));
      // R is needed by the next iteration unless that one restarts from X.
      if (i + 1 < steps_ && i + 1 != kGramRestartAfter) {
        RETURN_IF_ERROR(
            Gemm(q_, rm, false, Square(p, f32), false, nullptr, 1.0f, 0.0f, 0.0f, Square(t, f32)));
        RETURN_IF_ERROR(
            Gemm(q_, Square(p, f32), false, Square(t, f32), false, nullptr, 1.0f, 0.0f, 0.0f, rm));
      }
      if (q_is_identity) {
        std::swap(q, p);
        q_is_identity = false;
      } else {
        RETURN_IF_ERROR(Gemm(q_, Square(p, f32), false, Square(q, f32), false, nullptr, 1.0f, 0.0f,
                             0.0f, Square(t, f32)));
        std::swap(q, t);
      }
    }
    int x_slot = 0;
    RETURN_IF_ERROR(apply_q(&x_slot));
    *xi = x_slot;
    *dtype = x_dtype;
    return absl::OkStatus();
  }

  KernelQueue& q_;
  Scratch& s_;
  const NsMethod method_;
  const int steps_;
  const DType compute_;
  const int fp32_steps_;
  const int64_t batch_;
  const int64_t m_;
  const int64_t n_;
};

absl::Status CheckGeometry(const MuonConfig& config, MatrixGeometry g) {
  if (g.batch < 1 || g.rows < 1 || g.cols < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("Newton-Schulz: bad geometry [", g.batch, ", ", g.rows, ", ", g.cols, "]"));
  }
  if (config.ns_steps < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("Newton-Schulz: ns_steps must be >= 1, got ", config.ns_steps));
  }
  return absl::OkStatus();
}

// The index of the first item whose flag is set, or -1.
absl::StatusOr<int64_t> FirstFlagged(KernelQueue& queue, KernelBufferRef flags, size_t n) {
  std::vector<int32_t> host(n, 0);
  RETURN_IF_ERROR(queue.Read(flags, 0, host.data(), n * sizeof(int32_t)));
  for (size_t i = 0; i < n; ++i) {
    if (host[i] != 0) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace

absl::Status RunNewtonSchulz(KernelQueue& queue, const MuonConfig& config, MatrixGeometry geometry,
                             double scale, KernelBufferRef x) {
  RETURN_IF_ERROR(CheckGeometry(config, geometry));
  ScratchSize size;
  size.Add(geometry);
  ASSIGN_OR_RETURN(Scratch scratch, AllocateScratch(queue, size));
  return NewtonSchulzRun(queue, scratch, config, geometry).Run(geometry, scale, x);
}

absl::Status RunMuon(KernelQueue& queue, const MuonConfig& config,
                     const std::vector<KernelMuonItem>& items) {
  if (items.empty()) return absl::OkStatus();
  ScratchSize size;
  std::vector<MatrixGeometry> geometries;
  for (const KernelMuonItem& it : items) {
    const common::MatrixSpec& spec = *it.spec;
    const MatrixGeometry g = GeometryOf(spec);
    if (g.batch < 1 || g.rows < 1 || g.cols < 1 || g.batch * g.rows * g.cols != spec.numel()) {
      return absl::InvalidArgumentError(
          absl::StrCat("matrix '", spec.name, "': shape [", absl::StrJoin(spec.shape, ", "),
                       "] with num_heads ", spec.num_heads, " is not a Muon matrix"));
    }
    RETURN_IF_ERROR(CheckGeometry(config, g));
    size.Add(g);
    geometries.push_back(g);
  }
  const auto count = static_cast<int64_t>(items.size());
  ASSIGN_OR_RETURN(std::unique_ptr<QueueBuffer> flags,
                   queue.Allocate(items.size() * sizeof(int32_t)));

  // Every gradient is checked before any momentum is touched.
  RETURN_IF_ERROR(FillInt(queue, flags->ref(), count, 0));
  for (int64_t i = 0; i < count; ++i) {
    RETURN_IF_ERROR(FlagNonFinite(queue, items[i].grad_update, 0, items[i].spec->numel(),
                                  flags->ref(), static_cast<int32_t>(i)));
  }
  ASSIGN_OR_RETURN(const int64_t bad_grad, FirstFlagged(queue, flags->ref(), items.size()));
  if (bad_grad >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("matrix '", items[bad_grad].spec->name,
                     "': gradient holds a value that is not finite (NaN or infinity)"));
  }

  ASSIGN_OR_RETURN(Scratch scratch, AllocateScratch(queue, size));
  const auto one_minus_beta = static_cast<float>(1.0 - config.momentum);
  const auto beta = static_cast<float>(config.momentum);
  for (int64_t i = 0; i < count; ++i) {
    const KernelMuonItem& it = items[i];
    const MatrixGeometry g = geometries[i];
    RETURN_IF_ERROR(MuonMomentum(queue, it.grad_update, it.momentum, it.spec->numel(),
                                 one_minus_beta, beta, config.nesterov));
    const absl::Status s =
        NewtonSchulzRun(queue, scratch, config, g)
            .Run(g, MuonScale(config.scale_mode, g.rows, g.cols), it.grad_update);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("matrix '", it.spec->name, "': ", s.message()));
    }
  }

  RETURN_IF_ERROR(FillInt(queue, flags->ref(), count, 0));
  for (int64_t i = 0; i < count; ++i) {
    RETURN_IF_ERROR(FlagNonFinite(queue, items[i].grad_update, 0, items[i].spec->numel(),
                                  flags->ref(), static_cast<int32_t>(i)));
  }
  ASSIGN_OR_RETURN(const int64_t bad_result, FirstFlagged(queue, flags->ref(), items.size()));
  if (bad_result >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("matrix '", items[bad_result].spec->name,
                     "': Newton-Schulz: result is not finite; the input overflowed in ",
                     std::string(common::DTypeName(config.compute_dtype))));
  }
  return absl::OkStatus();
}

}  // namespace muond::server::device::level_zero
