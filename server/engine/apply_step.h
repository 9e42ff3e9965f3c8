// The host side of an apply-mode step (DESIGN.md 4b), per tensor, called by the StepPipeline on
// the executor thread:
//   - PrepareGradient: the assembled fp32 gradient's sum of squares (for global clipping), the
//     checks that it is finite and that the divisor does not overflow it, the scaling by
//     StepState::grad_scale, and for a Muon tensor the new momentum (the EMA) into the back buffer
//     (unless the device's kernel writes it there itself);
//   - ApplyAdamW: the whole AdamW update, front -> back, the new parameters into each owner's span;
//   - ApplyMuon: W <- W*(1 - lr*wd) - lr*U once the device returned U, the same way out.
// Everything reads the committed front of the ParamStore and writes its back (param_store.h), so
// a refused step, or one recomputed because clipping triggered, starts from the same state.
#ifndef MUOND_SERVER_ENGINE_APPLY_STEP_H_
#define MUOND_SERVER_ENGINE_APPLY_STEP_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "server/engine/job_layout.h"
#include "server/engine/param_store.h"
#include "server/engine/step_state.h"
#include "server/optim/adamw.h"

namespace muond::server {

class ApplyStep {
 public:
  // `group_of[t]`: tensor t's index in spec.groups. All must outlive the object.
  ApplyStep(const common::JobSpec& spec, const JobLayout& layout, ParamStore* params);

  // `grad` holds tensor t's whole fp32 gradient; on OK it holds the scaled gradient and
  // *sum_sq its raw sum of squares, and for a Muon tensor, unless `kernel_writes_momentum` (the
  // device's Muon kernel writes the new momentum into the back buffer itself: a device that
  // computes in host memory), the new momentum is in the back buffer. INVALID_ARGUMENT (the step
  // is refused) when a value is not finite (a shared-memory peer changed its gradient after it
  // was checked) or when the divisor would overflow float32.
  absl::Status PrepareGradient(const StepState& state, uint32_t t, float* grad, double* sum_sq,
                               bool kernel_writes_momentum);
  // Elements [at, at + length) of a tensor's raw gradient (in its dtype) at `data`.
  struct RawPiece {
    uint64_t at = 0;
    uint64_t length = 0;
    const char* data = nullptr;
  };
  // A gradient that goes to the device without being assembled (the direct path): from the
  // pieces that tile tensor t, *sum_sq as PrepareGradient computes it from the assembled fp32
  // gradient (bit for bit: the same blocks, widened, summed in the same order), and the same
  // refusals (a value not finite, a divisor that overflows). Reads only; the scaling and the
  // momentum are the device's.
  absl::Status CheckRawGradient(const StepState& state, uint32_t t, std::vector<RawPiece> pieces,
                                double* sum_sq) const;
  // The sum CheckRawGradient computes, alone (update mode's norm pass, step_pipeline_clip.cc):
  // the sum of squares of tensor `ms`'s raw gradient from the pieces that tile it, bit for bit
  // ParallelSumOfSquares of its assembled fp32 gradient. INTERNAL when they do not tile it.
  static absl::Status RawSumOfSquares(const common::MatrixSpec& ms, std::vector<RawPiece>* pieces,
                                      double* sum_sq);
  // AdamW of tensor t from its prepared gradient; writes the owners' output spans.
  void ApplyAdamW(StepState& state, uint32_t t, const float* grad);
  // The Muon apply of tensor t from its update U (scaled); writes the owners' output spans.
  void ApplyMuon(StepState& state, uint32_t t, const float* update);
  // Tensor t is absent this step (the presence mask): its state unchanged (the step writes none
  // of its arrays, so the commit neither swaps them nor counts it a step), its parameters as they
  // are into the owners' output spans. Reads no gradient.
  void Carry(StepState& state, uint32_t t);
  // Where the new master of tensor t is (the store's back), for QK-Clip to rescale.
  float* NewMaster(const StepState& state, uint32_t t);

  // QK-Clip (DESIGN.md 4e), once every tensor is done and before the commit: each pair's query
  // and key heads of the new masters (the store's back) rescaled from the step's per-head maxima
  // (state.hyper.max_logits, the maximum over the ranks), and the clipped parameters written into
  // those tensors' owners' output spans again. Adds to state.qk_heads_clipped and
  // state.qk_max_logit. Nothing when the job has no qk_clip.
  void QkClip(StepState& state);

  // After every tensor is done: the step's gradient norm from the tensors' sums (in tensor order)
  // and the clip coefficient it implies (1 when the job does not clip or the norm is within).
  static double GradNorm(const StepState& state);
  float ClipCoefficient(const StepState& state) const;
  // The scale gradients are multiplied by for `clip` and the step's divisor.
  static float GradScale(float clip, double grad_divisor);

 private:
  // Tensor t's new masters (the store's back) into its owners' output spans, in param_dtype.
  void WriteParameters(StepState& state, uint32_t t);
  // ApplyAdamW of a job that holds AdamW's moments compressed (JobSpec::state).
  void ApplyAdamWHeld(StepState& state, uint32_t t, const AdamWHyper& h, int64_t step,
                      const float* grad);
  // The refusals of a tensor's raw sum of squares `ss` (find_bad: the first element that is not
  // finite, asked only when ss is not).
  absl::Status CheckSumOfSquares(const StepState& state, uint32_t t, double ss,
                                 const std::function<int64_t()>& find_bad) const;

  const common::JobSpec& spec_;
  const JobLayout& layout_;
  ParamStore* const params_;
  std::vector<size_t> group_of_;
  std::vector<std::pair<uint32_t, uint32_t>> qk_tensors_;  // per QK-Clip pair: q, k
};

}  // namespace muond::server

#endif  // MUOND_SERVER_ENGINE_APPLY_STEP_H_
