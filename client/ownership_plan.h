// The ownership plan of a job that spans nodes (DESIGN.md 4c): which node's daemon holds each
// tensor. Computed in the client library so that every rank of the trainer computes the same plan
// from the same job spec, with no daemon involved (daemons never talk to each other).
//
// Cost model: a Muon tensor costs its Newton-Schulz FLOPs per step (standard iteration: per block
// of m x n, m <= n, 4 m^2 n + 2 m^3 per iteration, times ns_steps; blocks are heads and experts as
// DESIGN.md 3 views them); every tensor costs its bytes of fp32 state (update mode: the momentum,
// 4 B per element; apply mode: masters and momentum 8 B, masters and AdamW moments 12 B).
// Placement: longest processing time first, twice. Muon tensors by FLOPs (largest first, ties in
// job order) each onto the node with the fewest FLOPs so far; then AdamW tensors by bytes onto the
// node with the fewest bytes so far; ties go to the lower node. Deterministic, pure, thread-safe.
#ifndef MUOND_CLIENT_OWNERSHIP_PLAN_H_
#define MUOND_CLIENT_OWNERSHIP_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_spec.h"

namespace muond::client {

struct OwnershipPlan {
  std::vector<int32_t> owner;      // per tensor (job order): its node
  std::vector<double> node_flops;  // per node: Newton-Schulz FLOPs per step
  std::vector<double> node_bytes;  // per node: bytes of fp32 state
  // max / mean over the nodes (1 when all are equal; the mean of zeros counts as 1).
  double FlopsImbalance() const;
  double BytesImbalance() const;
};

// Newton-Schulz FLOPs of one step of tensor `m` under `muon` (0 for an AdamW tensor).
double NewtonSchulzFlops(const common::MatrixSpec& m, const common::MuonConfig& muon);
// Bytes of fp32 state the daemon keeps for tensor `m` in a job of `mode`.
double StateBytes(const common::MatrixSpec& m, common::JobMode mode);

// The plan for `nodes` nodes. INVALID_ARGUMENT for nodes outside 1..kMaxNodes, or when some node
// would own no tensor (fewer tensors than nodes).
absl::StatusOr<OwnershipPlan> PlanOwnership(const common::JobSpec& spec, int nodes);

}  // namespace muond::client

#endif  // MUOND_CLIENT_OWNERSHIP_PLAN_H_
