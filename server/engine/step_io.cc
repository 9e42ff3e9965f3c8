// The checks of what comes into a step (step_io.h).
#include "server/engine/step_io.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace muond::server {

absl::StatusOr<StepHyper> ResolveStepHyper(const common::JobSpec& spec,
                                           const std::vector<GroupValue>& values,
                                           double grad_divisor) {
  StepHyper h;
  const size_t n = spec.groups.size();
  h.lr.assign(n, 0);
  h.weight_decay.assign(n, 0);
  std::vector<bool> seen(n, false);
  for (const GroupValue& v : values) {
    size_t g = 0;
    while (g < n && spec.groups[g].name != v.group) ++g;
    if (g == n) {
      return absl::InvalidArgumentError(absl::StrCat("job '", spec.job_id, "' has no group '",
                                                     v.group, "' (step hyperparameters)"));
    }
    if (seen[g]) {
      return absl::InvalidArgumentError(
          absl::StrCat("group '", v.group, "' appears twice in the step's hyperparameters"));
    }
    seen[g] = true;
    h.lr[g] = v.lr;
    h.weight_decay[g] = v.weight_decay.value_or(spec.groups[g].weight_decay);
  }
  for (size_t g = 0; g < n; ++g) {
    if (!seen[g]) {
      return absl::InvalidArgumentError(
          absl::StrCat("job '", spec.job_id, "': the step gives no lr for group '",
                       spec.groups[g].name, "' (every group's lr is needed each step)"));
    }
  }
  h.grad_divisor = grad_divisor == 0 ? 1 : grad_divisor;
  return h;
}

absl::Status CheckStepHyper(const common::JobSpec& spec, const StepHyper& hyper,
                            const std::string& where) {
  const size_t n = spec.groups.size();
  if (hyper.lr.size() != n || hyper.weight_decay.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", hyper.lr.size(), " learning rates for the job's ", n, " groups"));
  }
  for (size_t g = 0; g < n; ++g) {
    const double lr = hyper.lr[g], wd = hyper.weight_decay[g];
    if (!std::isfinite(lr) || lr < 0 || !std::isfinite(wd) || wd < 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": group '", spec.groups[g].name,
                                                     "' has lr ", lr, " and weight decay ", wd,
                                                     "; both must be finite and >= 0"));
    }
  }
  if (!std::isfinite(hyper.grad_divisor) || hyper.grad_divisor <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": gradient divisor ", hyper.grad_divisor, " must be finite and > 0"));
  }
  if (!hyper.absent.empty() && hyper.absent.size() != spec.matrices.size()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": a presence mask of ",
                                                   hyper.absent.size(), " tensors for the job's ",
                                                   spec.matrices.size()));
  }
  RETURN_IF_ERROR(common::CheckMaxLogits(spec, hyper.max_logits, where));
  for (size_t t = 0; t < hyper.absent.size(); ++t) {
    if (hyper.absent[t] > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the presence mask byte of tensor '", spec.matrices[t].name,
                       "' is ", hyper.absent[t], "; 0 (has a gradient) or 1 (has none)"));
    }
  }
  return CheckClipSource(spec, hyper, where);
}

absl::Status CheckClipSource(const common::JobSpec& spec, const StepHyper& hyper,
                             const std::string& where) {
  const bool global = spec.two_phase() && spec.max_grad_norm > 0;
  if (hyper.clip_source == ClipSource::kLocal) {
    if (!global) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": the job is node ", spec.multinode.node, " of multi-node job '",
        spec.multinode.global_job_id, "' with max_grad_norm ", spec.max_grad_norm,
        ": its gradient norm spans the nodes, so a step needs a coordinating client that sends "
        "the global clip (MultiNodeMuonWithAuxAdam; muond_session_set_global_clip); this one sent "
        "none and the step is refused, nothing changed"));
  }
  if (!global) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": a global clip was sent, but the job is not a multi-node job with max_grad_norm "
        "(it clips by its own norm, or not at all)"));
  }
  if (hyper.clip_source != ClipSource::kSpeculate && hyper.clip_source != ClipSource::kGlobal) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": unknown global clip mode ", static_cast<int>(hyper.clip_source),
        " (1: speculate with clip 1, 2: clip by the global sum of squares)"));
  }
  if (hyper.clip_source == ClipSource::kGlobal &&
      (!std::isfinite(hyper.global_sum_sq) || hyper.global_sum_sq < 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": the global sum of squares ", hyper.global_sum_sq, " must be finite and >= 0"));
  }
  return absl::OkStatus();
}

}  // namespace muond::server
