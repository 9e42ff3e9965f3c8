// Geometry, scale and the momentum part of the Muon step (DESIGN.md 3 steps 1, 2 and 4). The
// Newton-Schulz part (step 3) and everything that needs LibTorch live in newton_schulz.cc.
#include "server/optim/muon_math.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "server/optim/newton_schulz.h"
#include "server/optim/ns_layout.h"
#include "server/optim/state_codec.h"

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
double NewtonSchulzFlops(const common::MuonConfig& config, const common::MatrixSpec& spec) {
  const MatrixGeometry g = GeometryOf(spec);
  const double m = static_cast<double>(std::min(g.rows, g.cols));
  const double n = static_cast<double>(std::max(g.rows, g.cols));
  return static_cast<double>(g.batch) * config.ns_steps * (4 * m * m * n + 2 * m * m * m);
}

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

void ApplyMomentum(const common::MuonConfig& config, const float* grad, float* momentum, size_t n) {
  const float one_minus_beta = static_cast<float>(1.0 - config.momentum);
  for (size_t i = 0; i < n; ++i) momentum[i] = Lerp(momentum[i], grad[i], one_minus_beta);
}

namespace {

// Steps 1 and 2 in fp32, one pass: momentum_out <- lerp(momentum_in, grad), the update from it.
// `update` may alias `grad` and `momentum_out` may alias `momentum_in`: element i of every input
// is read before element i of any output is written.
void MomentumAndUpdate(const common::MuonConfig& config, const float* grad,
                       const float* momentum_in, float* momentum_out, float* update, int64_t n) {
  const float one_minus_beta = static_cast<float>(1.0 - config.momentum);
  const float beta = static_cast<float>(config.momentum);
  if (config.nesterov) {
    for (int64_t i = 0; i < n; ++i) {
      const float gi = grad[i];
      const float m = Lerp(momentum_in[i], gi, one_minus_beta);
      momentum_out[i] = m;
      update[i] = Lerp(gi, m, beta);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float m = Lerp(momentum_in[i], grad[i], one_minus_beta);
      momentum_out[i] = m;
      update[i] = m;
    }
  }
}

// MomentumAndUpdate of group matrix k whose momentum is held compressed: per piece of whole
// blocks (the team's ranges start at multiples of kRangeElements, a multiple of the block),
// decoded into a buffer of the thread's, stepped, and encoded into held_out[k] (a piece is read
// before it is written, so held_out may be held_in).
void HeldMomentumAndUpdate(const common::MuonConfig& config, const MuonGroup& group, size_t k,
                           int threads) {
  static_assert(internal::kRangeElements % common::kStateBlock == 0);
  const size_t n = static_cast<size_t>(group.specs[k]->numel());
  constexpr size_t kPiece = common::kStateBlock * 8;
  internal::ParallelRanges(static_cast<int64_t>(n), threads, [&](int64_t first, int64_t last) {
    std::vector<float> m(kPiece);
    for (size_t begin = static_cast<size_t>(first); begin < static_cast<size_t>(last);
         begin += kPiece) {
      const size_t len = std::min(kPiece, static_cast<size_t>(last) - begin);
      DecodeStored(group.held_dtype, StateRole::kSigned, group.held_in[k], n, begin, len, m.data());
      MomentumAndUpdate(config, group.grads[k] + begin, m.data(), m.data(),
                        group.updates[k] + begin, static_cast<int64_t>(len));
      EncodeStored(group.held_dtype, StateRole::kSigned, m.data(), n, begin, len,
                   group.held_out[k]);
    }
  });
}

}  // namespace

absl::Status MuonUpdate(const common::MuonConfig& config, const common::MatrixSpec& spec,
                        const float* grad, float* momentum, float* update) {
  const common::MatrixSpec* specs = &spec;
  return MuonUpdateSameShape(config, 1, &specs, &grad, &momentum, &update);
}

absl::Status MuonUpdateSameShape(const common::MuonConfig& config, size_t count,
                                 const common::MatrixSpec* const* specs, const float* const* grads,
                                 float* const* momenta, float* const* updates) {
  const MuonGroup group{count, specs, grads, momenta, updates};
  return MuonUpdateGroups(config, &group, 1);
}

namespace {

// INVALID_ARGUMENT unless the group's matrices are Muon matrices of one shape and heads.
absl::Status CheckGroup(const MuonGroup& group) {
  const common::MatrixSpec& spec = *group.specs[0];
  const MatrixGeometry g = GeometryOf(spec);
  if (g.batch < 1 || g.rows < 1 || g.cols < 1 || g.batch * g.rows * g.cols != spec.numel()) {
    return absl::InvalidArgumentError(
        absl::StrCat("matrix '", spec.name, "': shape [", absl::StrJoin(spec.shape, ", "),
                     "] with num_heads ", spec.num_heads, " is not a Muon matrix"));
  }
  for (size_t k = 1; k < group.count; ++k) {
    if (group.specs[k]->shape != spec.shape || group.specs[k]->num_heads != spec.num_heads) {
      return absl::InvalidArgumentError(
          absl::StrCat("matrices '", spec.name, "' and '", group.specs[k]->name,
                       "' differ in shape or heads and cannot share one batched Newton-Schulz"));
    }
  }
  return absl::OkStatus();
}

// A Newton-Schulz error of the group, naming the matrix: the first whose result is not finite
// (or the whole group).
absl::Status NameMatrix(const MuonGroup& group, const absl::Status& status) {
  const common::MatrixSpec& spec = *group.specs[0];
  if (group.count == 1) {
    return absl::Status(status.code(),
                        absl::StrCat("matrix '", spec.name, "': ", status.message()));
  }
  const int64_t n = spec.numel();
  for (size_t k = 0; k < group.count; ++k) {
    const float* r = group.updates[k];
    if (const int64_t bad = common::FindNonFinite(r, static_cast<size_t>(n)); bad >= 0) {
      return absl::Status(status.code(),
                          absl::StrCat("matrix '", group.specs[k]->name,
                                       "': Newton-Schulz: result is not finite (element ", bad,
                                       " of ", n, " is ", r[bad], ")"));
    }
  }
  return absl::Status(status.code(),
                      absl::StrCat("matrices '", spec.name, "' and ", group.count - 1,
                                   " more of its shape: ", status.message()));
}

}  // namespace

absl::Status MuonUpdateGroups(const common::MuonConfig& config, const MuonGroup* groups,
                              size_t count) {
  std::vector<const MuonGroup*> live;
  for (size_t i = 0; i < count; ++i) {
    if (groups[i].count == 0) continue;
    RETURN_IF_ERROR(CheckGroup(groups[i]));
    live.push_back(&groups[i]);
  }
  // Memory-bound passes over the team (elementwise: no bit depends on the thread count); one
  // thread alone does not reach the memory bandwidth of the cores, and these passes read and
  // write the whole model every step. Every gradient is checked before any momentum is touched,
  // so a refused gradient leaves every momentum bit-identical.
  const int threads = omp_get_max_threads();
  for (const MuonGroup* group : live) {
    const int64_t n = group->specs[0]->numel();
    for (size_t k = 0; k < group->count; ++k) {
      const float* grad = group->grads[k];
      if (const int64_t bad = internal::FindNonFiniteParallel(grad, n, threads); bad >= 0) {
        return absl::InvalidArgumentError(absl::StrCat("matrix '", group->specs[k]->name,
                                                       "': gradient element ", bad,
                                                       " is not finite (", grad[bad], ")"));
      }
    }
  }
  std::vector<internal::NsGroup> ns_groups;
  for (const MuonGroup* group : live) {
    const int64_t n = group->specs[0]->numel();
    for (size_t k = 0; k < group->count; ++k) {
      if (group->held_in != nullptr) {
        HeldMomentumAndUpdate(config, *group, k, threads);
        continue;
      }
      const float* momentum_in =
          group->momenta_in != nullptr ? group->momenta_in[k] : group->momenta[k];
      internal::ParallelRanges(n, threads, [&](int64_t begin, int64_t end) {
        MomentumAndUpdate(config, group->grads[k] + begin, momentum_in + begin,
                          group->momenta[k] + begin, group->updates[k] + begin, end - begin);
      });
    }
    // Same-shape batching: the blocks of all the group's matrices form one batched Newton-Schulz
    // over the update buffers themselves (newton_schulz.cc computes every block independently of
    // the batch it is in, so the bits equal those of one matrix at a time).
    const MatrixGeometry g = GeometryOf(*group->specs[0]);
    ns_groups.push_back(
        {g, group->count, MuonScale(config.scale_mode, g.rows, g.cols), group->updates});
  }
  size_t failed = internal::kNoGroup;
  const absl::Status status =
      internal::ScaledNewtonSchulzGroups(config, ns_groups.data(), ns_groups.size(), &failed);
  if (status.ok()) return status;
  if (failed < live.size()) return NameMatrix(*live[failed], status);
  return absl::Status(
      status.code(), absl::StrCat("Newton-Schulz of ", live.size(), " shapes: ", status.message()));
}

}  // namespace muond::server
