// muonctl plan JOB.json NODES...: the ownership plan of a job over several nodes (DESIGN.md 4c),
// computed locally as every rank computes it (no daemon involved).
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/muonctl_util.h"
#include "client/ownership_plan.h"
#include "common/job_spec.h"
#include "common/status_macros.h"

namespace muond::client {

// Prints, per node count: every node's tensors (a tensor split by rows counts once on each node
// holding rows of it), GFLOP per step (Newton-Schulz and AdamW) and GiB of state, the row ranges
// of each split tensor, and max/mean of FLOPs and bytes.
absl::Status CmdPlan(const Args& a) {
  if (a.words.size() < 3) {
    return absl::InvalidArgumentError("plan needs a job.json and one or more node counts");
  }
  ASSIGN_OR_RETURN(const std::string text, ReadFile(a.words[1], "job spec"));
  ASSIGN_OR_RETURN(const common::JobSpec spec, common::ParseJobSpecJson(text));
  for (size_t w = 2; w < a.words.size(); ++w) {
    int nodes = 0;
    if (!absl::SimpleAtoi(a.words[w], &nodes)) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan: node count '", a.words[w], "' is not an integer"));
    }
    ASSIGN_OR_RETURN(const OwnershipPlan plan, PlanOwnership(spec, nodes));
    std::printf("nodes: %d (%zu tensors)\n", nodes, spec.matrices.size());
    std::vector<int> tensors(nodes, 0);
    for (const PlanPiece& p : plan.pieces) ++tensors[p.node];
    for (int n = 0; n < nodes; ++n) {
      std::printf("  node %d: %d tensors, %.1f GFLOP/step, %.3f GiB state\n", n, tensors[n],
                  plan.node_flops[n] / 1e9, plan.node_bytes[n] / (1024.0 * 1024 * 1024));
    }
    // The pieces come by tensor then rows: a run of more than one is a split tensor.
    for (size_t first = 0, end = 0; first < plan.pieces.size(); first = end) {
      const int32_t t = plan.pieces[first].tensor;
      std::string where;
      for (end = first; end < plan.pieces.size() && plan.pieces[end].tensor == t; ++end) {
        const PlanPiece& p = plan.pieces[end];
        absl::StrAppend(&where, where.empty() ? "" : ", ", "node ", p.node, " rows [", p.row_begin,
                        ", ", p.row_end, ")");
      }
      if (end - first < 2) continue;
      std::printf("  tensor '%s' split by rows: %s\n", spec.matrices[t].name.c_str(),
                  where.c_str());
    }
    std::printf("  flops max/mean: %.4f\n  bytes max/mean: %.4f\n", plan.FlopsImbalance(),
                plan.BytesImbalance());
  }
  return absl::OkStatus();
}

}  // namespace muond::client
