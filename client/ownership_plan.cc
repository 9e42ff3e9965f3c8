// The ownership plan (ownership_plan.h).
#include "client/ownership_plan.h"

#include <algorithm>
#include <cmath>
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

int64_t Rows(const common::MatrixSpec& m) { return common::TensorRows(m.shape); }

// Step 1's second half: while some move of one tensor off the busiest node, or swap of one of
// its tensors with a cheaper one elsewhere, lowers the larger of the two nodes' FLOPs below the
// busiest node's, does the one that lowers it most (first found among equals). Each change
// lowers the nodes' FLOPs sorted descending lexicographically, so it ends.
void ImproveMuon(const std::vector<size_t>& muon, const std::vector<double>& flops,
                 std::vector<int32_t>* owner, std::vector<double>* load) {
  std::vector<double>& f = *load;
  for (int round = 0; round < kMaxImprovements; ++round) {
    const int b = static_cast<int>(std::max_element(f.begin(), f.end()) - f.begin());
    double best = f[b] * (1 - 1e-12);
    size_t move_i = 0, swap_j = 0;
    int to = -1;
    bool swap = false;
    for (size_t i : muon) {
      if ((*owner)[i] != b) continue;
      for (int n = 0; n < static_cast<int>(f.size()); ++n) {
        if (n == b) continue;
        const double worst = std::max(f[b] - flops[i], f[n] + flops[i]);
        if (worst < best) best = worst, move_i = i, to = n, swap = false;
      }
      for (size_t j : muon) {
        const int n = (*owner)[j];
        if (n == b || flops[j] >= flops[i]) continue;
        const double d = flops[i] - flops[j];
        const double worst = std::max(f[b] - d, f[n] + d);
        if (worst < best) best = worst, move_i = i, swap_j = j, to = n, swap = true;
      }
    }
    if (to < 0) return;
    f[b] -= flops[move_i];
    f[to] += flops[move_i];
    (*owner)[move_i] = to;
    if (swap) {
      f[to] -= flops[swap_j];
      f[b] += flops[swap_j];
      (*owner)[swap_j] = b;
    }
  }
}

// The level L at which `amount` fills the nodes below it: sum over nodes of max(0, L - load).
double WaterLevel(std::vector<double> load, double amount) {
  std::sort(load.begin(), load.end());
  double sum = 0;
  for (size_t k = 1; k <= load.size(); ++k) {
    sum += load[k - 1];
    const double level = (amount + sum) / static_cast<double>(k);
    if (k == load.size() || level <= load[k]) return level;
  }
  return load.back();
}

// Step 2's split tensors (`deferred`, `deferred_bytes` of state in all), in that order: their rows
// onto the nodes below the water level, the node with the most room first, each piece at least
// kMinPieceBytes or the tensor's remainder; rounding's rest joins the tensor's last piece. Fills
// split[i] and plan->owner[i] of each, and the nodes' FLOPs and bytes.
void PourByRows(const common::JobSpec& spec, const std::vector<size_t>& deferred,
                double deferred_bytes, const std::vector<double>& flops,
                const std::vector<double>& bytes, OwnershipPlan* plan,
                std::vector<std::vector<PlanPiece>>* split) {
  const double level = WaterLevel(plan->node_bytes, deferred_bytes);
  std::vector<int> order(plan->node_bytes.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return plan->node_bytes[a] < plan->node_bytes[b]; });
  size_t at = 0;  // the node of `order` being filled
  for (size_t i : deferred) {
    std::vector<PlanPiece>& pieces = (*split)[i];
    const int64_t rows = Rows(spec.matrices[i]);
    const double row_bytes = bytes[i] / static_cast<double>(rows);
    const double row_flops = flops[i] / static_cast<double>(rows);
    const auto add = [&](int node, int64_t count) {
      plan->node_bytes[node] += count * row_bytes;
      plan->node_flops[node] += count * row_flops;
    };
    int64_t next = 0;
    for (; at < order.size() && next < rows; ++at) {
      const int node = order[at];
      const double room = level - plan->node_bytes[node];
      const int64_t take = std::min<int64_t>(
          rows - next, static_cast<int64_t>(std::floor(std::max(0.0, room) / row_bytes)));
      if (take < rows - next && take * row_bytes < kMinPieceBytes) continue;  // too little room
      pieces.push_back({static_cast<int32_t>(i), next, next + take, node});
      add(node, take);
      next += take;
      if (next == rows && take * row_bytes < room - kMinPieceBytes) break;  // room left here
    }
    if (next < rows) {  // rounding: the rest joins the tensor's last piece, or goes whole
      if (pieces.empty()) {
        pieces.push_back({static_cast<int32_t>(i), 0, 0, LeastLoaded(plan->node_bytes)});
      }
      add(pieces.back().node, rows - next);
      pieces.back().row_end = rows;
    }
    plan->owner[i] = pieces.front().node;
  }
}

}  // namespace

double OwnershipPlan::FlopsImbalance() const { return Imbalance(node_flops); }
double OwnershipPlan::BytesImbalance() const { return Imbalance(node_bytes); }

bool OwnershipPlan::Split(size_t t) const {
  size_t n = 0;
  for (const PlanPiece& p : pieces) n += static_cast<size_t>(p.tensor) == t ? 1 : 0;
  return n > 1;
}

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

double StepFlops(const common::MatrixSpec& m, const common::MuonConfig& muon) {
  if (m.optimizer == common::Optimizer::kAdamW) {
    return kAdamWFlopsPerElement * static_cast<double>(m.numel());
  }
  return NewtonSchulzFlops(m, muon);
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
  std::vector<double> flops(n), bytes(n);
  std::vector<size_t> muon, adamw;
  double total_bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    const common::MatrixSpec& m = spec.matrices[i];
    if (m.full_rows > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("ownership plan: job '", spec.job_id, "': tensor '", m.name,
                       "' is already rows of a split tensor (a node's job, not the global one)"));
    }
    flops[i] = StepFlops(m, spec.muon);
    bytes[i] = StateBytes(m, spec.mode);
    total_bytes += bytes[i];
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
  }
  ImproveMuon(muon, flops, &plan.owner, &plan.node_flops);
  for (size_t i : muon) plan.node_bytes[plan.owner[i]] += bytes[i];

  // AdamW: whole where it fits under the mean, else split by rows (deferred).
  const double mean = total_bytes / nodes;
  std::vector<size_t> deferred;
  double deferred_bytes = 0;
  for (size_t i : LargestFirst(adamw, bytes)) {
    const int node = LeastLoaded(plan.node_bytes);
    const bool splittable = nodes > 1 && Rows(spec.matrices[i]) >= 2 &&
                            bytes[i] >= 2 * kMinPieceBytes;
    if (!splittable || plan.node_bytes[node] + bytes[i] <= mean) {
      plan.owner[i] = node;
      plan.node_bytes[node] += bytes[i];
      plan.node_flops[node] += flops[i];
      continue;
    }
    deferred.push_back(i);
    deferred_bytes += bytes[i];
  }
  std::vector<std::vector<PlanPiece>> split(n);
  if (!deferred.empty()) PourByRows(spec, deferred, deferred_bytes, flops, bytes, &plan, &split);
  for (size_t i = 0; i < n; ++i) {
    if (split[i].empty()) {
      plan.pieces.push_back({static_cast<int32_t>(i), 0, Rows(spec.matrices[i]), plan.owner[i]});
    } else {
      plan.pieces.insert(plan.pieces.end(), split[i].begin(), split[i].end());
    }
  }
  std::vector<int> owned(nodes, 0);
  for (const PlanPiece& p : plan.pieces) ++owned[p.node];
  for (int node = 0; node < nodes; ++node) {
    if (owned[node] == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ownership plan: job '", spec.job_id, "' has ", n, " tensors for ", nodes,
          " nodes: node ", node, " would own no tensor (", muon.size(), " Muon and ",
          adamw.size(), " AdamW tensors, ", plan.pieces.size(), " pieces); use fewer nodes"));
    }
  }
  return plan;
}

}  // namespace muond::client
