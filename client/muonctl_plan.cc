// muonctl plan JOB.json NODES...: the ownership plan of a job over several nodes (DESIGN.md 4c),
// computed locally as every rank computes it (no daemon involved).
#include <cstdio>
#include <string>

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
    for (int n = 0; n < nodes; ++n) {
      int tensors = 0;
      for (const PlanPiece& p : plan.pieces) tensors += p.node == n ? 1 : 0;
      std::printf("  node %d: %d tensors, %.1f GFLOP/step, %.3f GiB state\n", n, tensors,
                  plan.node_flops[n] / 1e9, plan.node_bytes[n] / (1024.0 * 1024 * 1024));
    }
    for (size_t t = 0; t < spec.matrices.size(); ++t) {
      if (!plan.Split(t)) continue;
      std::string where;
      for (const PlanPiece& p : plan.pieces) {
        if (static_cast<size_t>(p.tensor) != t) continue;
        absl::StrAppend(&where, where.empty() ? "" : ", ", "node ", p.node, " rows [", p.row_begin,
                        ", ", p.row_end, ")");
      }
      std::printf("  tensor '%s' split by rows: %s\n", spec.matrices[t].name.c_str(),
                  where.c_str());
    }
    std::printf("  flops max/mean: %.4f\n  bytes max/mean: %.4f\n", plan.FlopsImbalance(),
                plan.BytesImbalance());
  }
  return absl::OkStatus();
}

}  // namespace muond::client
