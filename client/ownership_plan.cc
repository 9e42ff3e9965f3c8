// The ownership plan (ownership_plan.h).
#include "client/ownership_plan.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace muond::client {

namespace {

double Imbalance(const std::vector<double>& v) {
  if (v.empty()) return 1;
  const double mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  if (mean <= 0) return 1;
  return *std::max_element(v.begin(), v.end()) / mean;
}

// Indices of `tensors` in order of `cost` descending, ties in job order.
std::vector<size_t> LargestFirst(std::vector<size_t> tensors, const std::vector<double>& cost) {
  std::stable_sort(tensors.begin(), tensors.end(),
                   [&](size_t a, size_t b) { return cost[a] > cost[b]; });
  return tensors;
}

// The node with the least `load` (the lowest index among equals).
int LeastLoaded(const std::vector<double>& load) {
  return static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
}

}  // namespace

double OwnershipPlan::FlopsImbalance() const { return Imbalance(node_flops); }
double OwnershipPlan::BytesImbalance() const { return Imbalance(node_bytes); }

double NewtonSchulzFlops(const common::MatrixSpec& m, const common::MuonConfig& muon) {
  if (m.optimizer != common::Optimizer::kMuon || m.shape.size() < 2) return 0;
  double batch = 1, rows = 0, cols = 0;
  if (m.shape.size() == 2) {
    rows = static_cast<double>(m.shape[0]);
    cols = static_cast<double>(m.shape[1]);
  } else if (m.shape.size() == 3) {  // [E, r, c]: experts
    batch = static_cast<double>(m.shape[0]);
    rows = static_cast<double>(m.shape[1]);
    cols = static_cast<double>(m.shape[2]);
  } else {  // [out, in, kh, kw] viewed as [out, in * kh * kw]
    rows = static_cast<double>(m.shape[0]);
    cols = static_cast<double>(m.shape[1] * m.shape[2] * m.shape[3]);
  }
  const double heads = static_cast<double>(std::max<int64_t>(1, m.num_heads));
  batch *= heads;
  rows /= heads;
  const double small = std::min(rows, cols), large = std::max(rows, cols);
  return batch * muon.ns_steps * (4 * small * small * large + 2 * small * small * small);
}

double StateBytes(const common::MatrixSpec& m, common::JobMode mode) {
  const double n = static_cast<double>(m.numel());
  if (mode == common::JobMode::kUpdate) return 4 * n;
  return m.optimizer == common::Optimizer::kMuon ? 8 * n : 12 * n;
}

absl::StatusOr<OwnershipPlan> PlanOwnership(const common::JobSpec& spec, int nodes) {
  if (nodes < 1 || nodes > common::kMaxNodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("ownership plan: nodes ", nodes, " is outside 1..", common::kMaxNodes));
  }
  const size_t n = spec.matrices.size();
  if (n < static_cast<size_t>(nodes)) {
    return absl::InvalidArgumentError(absl::StrCat("ownership plan: job '", spec.job_id, "' has ",
                                                   n, " tensors for ", nodes,
                                                   " nodes; every node must own one at least"));
  }
  std::vector<double> flops(n), bytes(n);
  std::vector<size_t> muon, adamw;
  for (size_t i = 0; i < n; ++i) {
    const common::MatrixSpec& m = spec.matrices[i];
    flops[i] = NewtonSchulzFlops(m, spec.muon);
    bytes[i] = StateBytes(m, spec.mode);
    (m.optimizer == common::Optimizer::kMuon ? muon : adamw).push_back(i);
  }
  OwnershipPlan plan;
  plan.owner.assign(n, -1);
  plan.node_flops.assign(nodes, 0);
  plan.node_bytes.assign(nodes, 0);
  for (size_t i : LargestFirst(muon, flops)) {
    const int node = LeastLoaded(plan.node_flops);
    plan.owner[i] = node;
    plan.node_flops[node] += flops[i];
    plan.node_bytes[node] += bytes[i];
  }
  for (size_t i : LargestFirst(adamw, bytes)) {
    const int node = LeastLoaded(plan.node_bytes);
    plan.owner[i] = node;
    plan.node_bytes[node] += bytes[i];
  }
  std::vector<int> owned(nodes, 0);
  for (int32_t node : plan.owner) ++owned[node];
  for (int node = 0; node < nodes; ++node) {
    if (owned[node] == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("ownership plan: job '", spec.job_id, "': node ", node, " of ", nodes,
                       " would own no tensor (", muon.size(), " Muon and ", adamw.size(),
                       " AdamW tensors); use fewer nodes"));
    }
  }
  return plan;
}

}  // namespace muond::client
