// Geometry, scale and the momentum part of the Muon step (DESIGN.md 3 steps 1, 2 and 4). The
// Newton-Schulz part (step 3) and everything that needs LibTorch live in newton_schulz.cc.
#include "server/muon/muon_math.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "server/muon/newton_schulz.h"

namespace muond::server {
namespace {

// This file is compiled with -ffp-contract=off: ApplyMomentum and MuonUpdate must round the EMA
// identically, which a fused multiply-add in one of them would break.
// torch.lerp's formula: start + weight * (end - start), evaluated from the nearer end so that the
// result is exact at weight 0 and 1 (for weight < 0.5 exactly M + (1-beta)(G - M) of DESIGN 3).
inline float Lerp(float start, float end, float weight) {
  return std::abs(weight) < 0.5f ? start + weight * (end - start)
                                 : end - (end - start) * (1.0f - weight);
}

}  // namespace

MatrixGeometry GeometryOf(const common::MatrixSpec& spec) {
  const std::vector<int64_t>& s = spec.shape;
  const int64_t heads = std::max<int64_t>(1, spec.num_heads);
  MatrixGeometry g;
  switch (s.size()) {
    case 2:  // [r, c]: H head blocks of r/H contiguous rows
      g = {heads, s[0] / heads, s[1]};
      break;
    case 3:  // [E, r, c]: E experts, each split into H heads
      g = {s[0] * heads, s[1] / heads, s[2]};
      break;
    case 4:  // conv [out, in, kh, kw] viewed as [out, in*kh*kw]
      g = {heads, s[0] / heads, s[1] * s[2] * s[3]};
      break;
    default:  // not a valid spec; rows 0 makes MuonUpdate refuse it
      g = {1, 0, 0};
      break;
  }
  return g;
}

// Both modes use the shape of the block that Newton-Schulz orthogonalizes (one head of one
// expert), not of the whole tensor: the block is the matrix Muon treats as a unit, so its aspect
// ratio is what the scale corrects for, and the reference vectors (tests/data/muon_v1, case
// per_head) are generated that way.
double MuonScale(common::ScaleMode mode, int64_t rows, int64_t cols) {
  switch (mode) {
    case common::ScaleMode::kOriginal:
      return std::sqrt(std::max(1.0, static_cast<double>(rows) / static_cast<double>(cols)));
    case common::ScaleMode::kMatchRmsAdamw:
      return 0.2 * std::sqrt(static_cast<double>(std::max(rows, cols)));
    case common::ScaleMode::kNone:
      return 1.0;
  }
  return 1.0;
}

void ApplyMomentum(const common::MuonConfig& config, const float* grad, float* momentum,
                   size_t n) {
  const float one_minus_beta = static_cast<float>(1.0 - config.momentum);
  for (size_t i = 0; i < n; ++i) momentum[i] = Lerp(momentum[i], grad[i], one_minus_beta);
}

absl::Status MuonUpdate(const common::MuonConfig& config, const common::MatrixSpec& spec,
                        const float* grad, float* momentum, float* update) {
  const MatrixGeometry g = GeometryOf(spec);
  const int64_t n = spec.numel();
  if (g.batch < 1 || g.rows < 1 || g.cols < 1 || g.batch * g.rows * g.cols != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("matrix '", spec.name, "': shape [", absl::StrJoin(spec.shape, ", "),
                     "] with num_heads ", spec.num_heads, " is not a Muon matrix"));
  }
  // Checked before momentum is touched, so a refused gradient leaves the momentum bit-identical.
  if (const int64_t bad = common::FindNonFinite(grad, static_cast<size_t>(n)); bad >= 0) {
    return absl::InvalidArgumentError(absl::StrCat("matrix '", spec.name, "': gradient element ",
                                                   bad, " is not finite (", grad[bad], ")"));
  }
  // Steps 1 and 2 in fp32, one pass (memory-bound: a second thread would not help much next to
  // the O(r^2 c) Newton-Schulz). `update` may alias `grad`: grad[i] is read before update[i].
  const float one_minus_beta = static_cast<float>(1.0 - config.momentum);
  const float beta = static_cast<float>(config.momentum);
  if (config.nesterov) {
    for (int64_t i = 0; i < n; ++i) {
      const float gi = grad[i];
      const float m = Lerp(momentum[i], gi, one_minus_beta);
      momentum[i] = m;
      update[i] = Lerp(gi, m, beta);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float m = Lerp(momentum[i], grad[i], one_minus_beta);
      momentum[i] = m;
      update[i] = m;
    }
  }
  const absl::Status status =
      internal::ScaledNewtonSchulz(config, g, MuonScale(config.scale_mode, g.rows, g.cols), update);
  if (!status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat("matrix '", spec.name, "': ", status.message()));
  }
  return absl::OkStatus();
}

}  // namespace muond::server
