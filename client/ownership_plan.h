// The ownership plan of a job that spans nodes (DESIGN.md 4c): which node's daemon holds each
// tensor, or each row range of an AdamW tensor split across nodes. Computed in the client library
// so that every rank of the trainer computes the same plan from the same job spec, with no daemon
// involved (daemons never talk to each other).
//
// Cost model, per tensor and step:
// - time: a Muon tensor costs its Newton-Schulz FLOPs (standard iteration: per block of m x n,
//   m <= n, 4 m^2 n + 2 m^3 per iteration, times ns_steps; blocks are heads and experts as
//   DESIGN.md 3 views them); an AdamW tensor kAdamWFlopsPerElement per element (elementwise);
// - memory: its bytes of fp32 state (update mode: the momentum, 4 B per element; apply mode:
//   masters and momentum 8 B, masters and AdamW moments 12 B).
// Placement, deterministic (ties go to the lower node, then job order):
// 1. Muon tensors (whole: Newton-Schulz needs the whole matrix) by FLOPs, largest first, each
//    onto the node with the fewest FLOPs so far; then moves and swaps between the busiest node and
//    the others while they lower the busiest node's FLOPs (at most kMaxImprovements).
// 2. AdamW tensors by bytes, largest first: whole onto the node with the fewest bytes when it
//    stays within the mean bytes of a node there (or cannot be split: one row); the others are
//    split by rows (AdamW is elementwise, so a row range is a tensor of its own on its node) and
//    poured, in that order, onto the nodes below the water level (the level at which the split
//    tensors' bytes exactly fill the nodes below it), fullest room first, each node's piece at
//    least kMinPieceBytes (or the tensor's remainder).
// Pure and thread-safe.
#ifndef MUOND_CLIENT_OWNERSHIP_PLAN_H_
#define MUOND_CLIENT_OWNERSHIP_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/job_spec.h"

namespace muond::client {

// AdamW per element: the moments, bias corrections, sqrt, divide and decay.
inline constexpr double kAdamWFlopsPerElement = 16;
inline constexpr double kMinPieceBytes = double{1 << 20};
inline constexpr int kMaxImprovements = 4096;

// Rows [row_begin, row_end) of tensor `tensor` (job order) held by node `node`. A tensor that is
// not split has one piece with all its rows (rows: its first dimension; a 0-d tensor has one).
struct PlanPiece {
  int32_t tensor = 0;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  int32_t node = 0;
  bool operator==(const PlanPiece& o) const {
    return tensor == o.tensor && row_begin == o.row_begin && row_end == o.row_end &&
           node == o.node;
  }
};

struct OwnershipPlan {
  std::vector<int32_t> owner;      // per tensor (job order): its node (split: its first rows')
  std::vector<PlanPiece> pieces;   // every tensor's pieces, by tensor then rows
  std::vector<double> node_flops;  // per node: FLOPs per step (Newton-Schulz and AdamW)
  std::vector<double> node_bytes;  // per node: bytes of fp32 state
  // max / mean over the nodes (1 when all are equal; the mean of zeros counts as 1).
  double FlopsImbalance() const;
  double BytesImbalance() const;
  // Whether tensor `t` is split across nodes.
  bool Split(size_t t) const;
};

// Newton-Schulz FLOPs of one step of tensor `m` under `muon` (0 for an AdamW tensor).
double NewtonSchulzFlops(const common::MatrixSpec& m, const common::MuonConfig& muon);
// FLOPs of one step of tensor `m`: Newton-Schulz, or AdamW's kAdamWFlopsPerElement per element.
double StepFlops(const common::MatrixSpec& m, const common::MuonConfig& muon);
// Bytes of fp32 state the daemon keeps for tensor `m` in a job of `mode`.
double StateBytes(const common::MatrixSpec& m, common::JobMode mode);

// The plan for `nodes` nodes. INVALID_ARGUMENT for nodes outside 1..kMaxNodes, or when some node
// would own nothing (fewer tensors and rows than nodes).
absl::StatusOr<OwnershipPlan> PlanOwnership(const common::JobSpec& spec, int nodes);

}  // namespace muond::client

#endif  // MUOND_CLIENT_OWNERSHIP_PLAN_H_
