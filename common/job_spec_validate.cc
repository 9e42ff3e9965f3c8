// JobSpec validation: the values of a spec, however it was built (job.json, or the API's proto).
// Each part names the field and the tensor it refuses.
#include "common/job_spec.h"

#include <cmath>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/layout.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace muond::common {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status ValidateMatrix(const MatrixSpec& m, size_t index) {
  RETURN_IF_ERROR(ValidateTensorName(m.name, absl::StrCat("matrices[", index, "].name")));
  const std::string where = absl::StrCat("matrix ", Quoted(m.name), ": ");
  const bool adamw = m.optimizer == Optimizer::kAdamW;
  if (adamw ? m.shape.size() > 8 : (m.shape.size() < 2 || m.shape.size() > 4)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "shape ", ShapeString(m.shape), " has ", m.shape.size(), " dimensions; expected ",
        adamw ? "0 to 8 (adamw)" : "2 to 4"));
  }
  int64_t numel = 1;
  for (int64_t d : m.shape) {
    if (d <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "shape ", ShapeString(m.shape), " has a non-positive dimension"));
    }
    if (__builtin_mul_overflow(numel, d, &numel) || numel > kMaxMatrixElements) {
      return absl::InvalidArgumentError(absl::StrCat(where, "shape ", ShapeString(m.shape),
                                                     " has more than ", kMaxMatrixElements,
                                                     " elements"));
    }
  }
  // Rows of the matrix Muon sees: [E, r, c] is a batch of r x c; [out, in, kh, kw] is out x rest.
  // (AdamW tensors have no rows: num_heads must be 1.)
  const int64_t rows = adamw ? 1 : m.shape.size() == 3 ? m.shape[1] : m.shape[0];
  if (adamw && m.num_heads != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "num_heads ", m.num_heads, " applies to muon tensors only"));
  }
  if (m.num_heads < 1) {
    return absl::InvalidArgumentError(absl::StrCat(where, "num_heads ", m.num_heads, " is < 1"));
  }
  if (rows % m.num_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "num_heads ", m.num_heads, " does not divide rows ", rows));
  }
  if (DTypeName(m.dtype) == "unknown") {
    return absl::InvalidArgumentError(absl::StrCat(where, "unknown dtype"));
  }
  return absl::OkStatus();
}

// The job's size and its limits: world size, checkpoints kept, the step timeout (and the
// non-finite policy, which single-node jobs alone may skip with).
absl::Status ValidateJobLimits(const JobSpec& spec) {
  if (spec.nonfinite_skip && spec.two_phase()) {
    return absl::InvalidArgumentError(
        "nonfinite: \"skip\" is for single-node jobs (a multi-node step commits in two phases; "
        "skip the step in the trainer)");
  }
  if (spec.world_size < 1 || spec.world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size ", spec.world_size, " is outside 1..", kMaxWorldSize));
  }
  if (spec.checkpoint_keep < 1 || spec.checkpoint_keep > kMaxCheckpointKeep) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint_keep ", spec.checkpoint_keep, " is outside 1..", kMaxCheckpointKeep));
  }
  if (spec.step_window_bytes != 0 && !spec.transport_probe) {
    for (const MatrixSpec& m : spec.matrices) {
      const uint64_t bytes = spec.StateBytesOf(m);
      if (spec.step_window_bytes >= bytes) continue;
      return absl::InvalidArgumentError(absl::StrCat(
          "step_window_bytes ", spec.step_window_bytes, " is smaller than tensor '", m.name,
          "''s state (", bytes, " bytes a step writes); the window holds at least one tensor"));
    }
  }
  if (spec.step_buffers < 1 || spec.step_buffers > 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step_buffers ", spec.step_buffers,
        " is outside 1..2 (1: each step's results are taken before the next step's gradients "
        "are written, as muon_offload does; 2: a trainer that writes step t+1's gradients while "
        "step t computes)"));
  }
  if (spec.step_timeout_seconds < 0 || spec.step_timeout_seconds > kMaxStepTimeoutSeconds) {
    return absl::InvalidArgumentError(absl::StrCat("step_timeout_seconds ",
                                                   spec.step_timeout_seconds, " is outside 0..",
                                                   kMaxStepTimeoutSeconds));
  }
  return absl::OkStatus();
}

// How the matrices are split between the ranks: a ZeRO stage or an explicit layout.
absl::Status ValidatePartitioning(const JobSpec& spec) {
  if (spec.zero_stage < 0 || spec.zero_stage > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("zero_stage ", spec.zero_stage, " is outside 0..3"));
  }
  if (!spec.explicit_layout.empty()) {
    if (spec.zero_stage != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "an explicit layout replaces zero_stage; zero_stage must be 0, got ", spec.zero_stage));
    }
    if (spec.explicit_layout.size() != static_cast<size_t>(spec.world_size)) {
      return absl::InvalidArgumentError(absl::StrCat("layout has ", spec.explicit_layout.size(),
                                                     " ranks but world_size is ",
                                                     spec.world_size));
    }
  } else if (spec.zero_stage == 0 && spec.world_size != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "zero_stage 0 (whole matrices) requires world_size 1 or an explicit layout, got "
        "world_size ",
        spec.world_size));
  }
  return absl::OkStatus();
}

absl::Status ValidateMuonConfig(const MuonConfig& muon) {
  if (!std::isfinite(muon.momentum) || muon.momentum < 0.0 || muon.momentum >= 1.0) {
    return absl::InvalidArgumentError(
        absl::StrCat("muon.momentum ", muon.momentum, " must be finite and in [0, 1)"));
  }
  if (muon.ns_steps < 1 || muon.ns_steps > kMaxNsSteps) {
    return absl::InvalidArgumentError(
        absl::StrCat("muon.ns_steps ", muon.ns_steps, " is outside 1..", kMaxNsSteps));
  }
  if (muon.fp32_iterations < 0 || muon.fp32_iterations > muon.ns_steps) {
    return absl::InvalidArgumentError(absl::StrCat("muon.fp32_iterations ", muon.fp32_iterations,
                                                   " is outside 0..ns_steps (", muon.ns_steps,
                                                   ")"));
  }
  if (NsMethodName(muon.ns_method) == "unknown" || ScaleModeName(muon.scale_mode) == "unknown" ||
      DTypeName(muon.compute_dtype) == "unknown") {
    return absl::InvalidArgumentError("muon: ns_method, scale_mode or compute_dtype out of range");
  }
  return absl::OkStatus();
}

// Each matrix, their names (no two alike) and, for ZeRO 1/2, their one dtype.
absl::Status ValidateMatrices(const JobSpec& spec) {
  if (spec.matrices.empty()) {
    return absl::InvalidArgumentError("matrices: at least one matrix is required");
  }
  std::map<std::string_view, size_t> seen;
  for (size_t i = 0; i < spec.matrices.size(); ++i) {
    RETURN_IF_ERROR(ValidateMatrix(spec.matrices[i], i));
    const auto [it, inserted] = seen.emplace(spec.matrices[i].name, i);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat("matrix '", spec.matrices[i].name,
                                                     "' appears twice: matrices[", it->second,
                                                     "] and matrices[", i, "]"));
    }
  }
  if (spec.explicit_layout.empty() && (spec.zero_stage == 1 || spec.zero_stage == 2)) {
    // A ZeRO 1/2 partition is one flat buffer of one dtype.
    for (const MatrixSpec& m : spec.matrices) {
      if (m.dtype != spec.matrices[0].dtype) {
        return absl::InvalidArgumentError(absl::StrCat(
            "zero_stage ", spec.zero_stage, " partitions are one flat buffer of one dtype, but "
            "matrix '", m.name, "' is ", std::string(DTypeName(m.dtype)), " and matrix '",
            spec.matrices[0].name, "' is ", std::string(DTypeName(spec.matrices[0].dtype))));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateJobSpec(const JobSpec& spec) {
  RETURN_IF_ERROR(ValidateJobId(spec.job_id));
  RETURN_IF_ERROR(ValidateJobLimits(spec));
  RETURN_IF_ERROR(ValidatePartitioning(spec));
  RETURN_IF_ERROR(ValidateMuonConfig(spec.muon));
  RETURN_IF_ERROR(ValidateMatrices(spec));
  RETURN_IF_ERROR(ValidateApplyMode(spec));
  RETURN_IF_ERROR(ValidateMultiNode(spec));
  RETURN_IF_ERROR(ValidateQkClip(spec));
  RETURN_IF_ERROR(ValidateStateStorage(spec));
  if (!spec.explicit_layout.empty()) RETURN_IF_ERROR(ValidateExplicitLayout(spec));
  return absl::OkStatus();
}

}  // namespace muond::common
