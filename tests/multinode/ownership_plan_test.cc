// The ownership plan (client/ownership_plan.h): deterministic, every row of every tensor owned
// once, Muon tensors whole; FLOPs and bytes of state both balanced within 10% (max/mean, printed)
// on Qwen3-0.6B-like and Qwen3-4B-like models over 2, 4, 8 and 64 nodes, in update and apply
// mode (apply: the 151936-row embedding is split by rows where it is more than a node's share).
#include "client/ownership_plan.h"

#include <cstdio>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace muond::client {
namespace {

common::MatrixSpec Tensor(const std::string& name, std::vector<int64_t> shape,
                          common::Optimizer opt = common::Optimizer::kMuon) {
  common::MatrixSpec m;
  m.name = name;
  m.shape = std::move(shape);
  m.optimizer = opt;
  m.group = opt == common::Optimizer::kMuon ? "muon" : "adamw";
  return m;
}

struct ModelShape {
  const char* name;
  int layers;
  int64_t hidden, q, kv, mlp, vocab;
};
// Qwen3-0.6B: 28 layers, hidden 1024, 16 query and 8 key/value heads of 128, MLP 3072.
// Qwen3-4B: 36 layers, hidden 2560, 32 query and 8 key/value heads of 128, MLP 9728.
// Vocabulary 151936; norms and the embedding as AdamW tensors (apply mode).
constexpr ModelShape kQwen3_06b{"qwen3-0.6b-like", 28, 1024, 16 * 128, 8 * 128, 3072, 151936};
constexpr ModelShape kQwen3_4b{"qwen3-4b-like", 36, 2560, 32 * 128, 8 * 128, 9728, 151936};

common::JobSpec Model(const ModelShape& s, bool apply) {
  common::JobSpec spec;
  spec.job_id = s.name;
  spec.mode = apply ? common::JobMode::kApply : common::JobMode::kUpdate;
  const int64_t h = s.hidden;
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = absl::StrCat("layers.", l, ".");
    spec.matrices.push_back(Tensor(p + "q_proj", {s.q, h}));
    spec.matrices.push_back(Tensor(p + "k_proj", {s.kv, h}));
    spec.matrices.push_back(Tensor(p + "v_proj", {s.kv, h}));
    spec.matrices.push_back(Tensor(p + "o_proj", {h, s.q}));
    spec.matrices.push_back(Tensor(p + "gate_proj", {s.mlp, h}));
    spec.matrices.push_back(Tensor(p + "up_proj", {s.mlp, h}));
    spec.matrices.push_back(Tensor(p + "down_proj", {h, s.mlp}));
    if (apply) {
      spec.matrices.push_back(Tensor(p + "input_norm", {h}, common::Optimizer::kAdamW));
      spec.matrices.push_back(Tensor(p + "post_norm", {h}, common::Optimizer::kAdamW));
    }
  }
  if (apply) {
    spec.matrices.push_back(Tensor("embed", {s.vocab, h}, common::Optimizer::kAdamW));
    spec.matrices.push_back(Tensor("norm", {h}, common::Optimizer::kAdamW));
  }
  return spec;
}

// Every row of every tensor in exactly one piece, pieces by tensor then rows, Muon tensors whole,
// a node at most one piece of a tensor; node_flops and node_bytes are the pieces' sums.
void ExpectPlanConsistent(const common::JobSpec& spec, const OwnershipPlan& plan, int nodes) {
  ASSERT_EQ(plan.owner.size(), spec.matrices.size());
  std::vector<double> flops(nodes, 0), bytes(nodes, 0);
  size_t at = 0;
  for (size_t t = 0; t < spec.matrices.size(); ++t) {
    const common::MatrixSpec& m = spec.matrices[t];
    const int64_t rows = m.shape.empty() ? 1 : m.shape[0];
    int64_t next = 0;
    std::set<int32_t> holders;
    const int32_t first = at < plan.pieces.size() ? plan.pieces[at].node : -1;
    for (; at < plan.pieces.size() && plan.pieces[at].tensor == static_cast<int32_t>(t); ++at) {
      const PlanPiece& p = plan.pieces[at];
      ASSERT_EQ(p.row_begin, next) << m.name;
      ASSERT_GT(p.row_end, p.row_begin) << m.name;
      ASSERT_GE(p.node, 0);
      ASSERT_LT(p.node, nodes);
      ASSERT_TRUE(holders.insert(p.node).second) << m.name << ": two pieces on node " << p.node;
      const double share = static_cast<double>(p.row_end - p.row_begin) / rows;
      flops[p.node] += share * StepFlops(m, spec.muon);
      bytes[p.node] += share * StateBytes(m, spec.mode);
      next = p.row_end;
    }
    ASSERT_EQ(next, rows) << m.name;
    EXPECT_EQ(plan.owner[t], first) << m.name << ": owner is the node of its first rows";
    if (m.optimizer == common::Optimizer::kMuon) {
      EXPECT_FALSE(plan.Split(t)) << m.name;
    }
  }
  EXPECT_EQ(at, plan.pieces.size());
  for (int n = 0; n < nodes; ++n) {
    EXPECT_NEAR(plan.node_flops[n], flops[n], 1e-9 * flops[n] + 1) << "node " << n;
    EXPECT_NEAR(plan.node_bytes[n], bytes[n], 1e-9 * bytes[n] + 1) << "node " << n;
  }
}

TEST(OwnershipPlanTest, BytesAndFlopsWithinTenPercentOnQwen3Models) {
  for (const ModelShape& shape : {kQwen3_06b, kQwen3_4b}) {
    for (bool apply : {false, true}) {
      const common::JobSpec spec = Model(shape, apply);
      for (int nodes : {2, 4, 8, 64}) {
        SCOPED_TRACE(absl::StrCat(shape.name, apply ? " apply" : " update", " on ", nodes));
        auto plan = PlanOwnership(spec, nodes);
        ASSERT_TRUE(plan.ok()) << plan.status();
        int split = 0;
        for (size_t t = 0; t < spec.matrices.size(); ++t) split += plan->Split(t) ? 1 : 0;
        std::printf(
            "%s (%s, %zu tensors) on %2d nodes: flops max/mean %.4f, bytes max/mean %.4f, %zu "
            "pieces, %d tensor(s) split\n",
            shape.name, apply ? "apply" : "update", spec.matrices.size(), nodes,
            plan->FlopsImbalance(), plan->BytesImbalance(), plan->pieces.size(), split);
        EXPECT_LE(plan->FlopsImbalance(), 1.10);
        EXPECT_LE(plan->BytesImbalance(), 1.10);
        ExpectPlanConsistent(spec, *plan, nodes);
        // Deterministic: the same plan again.
        auto again = PlanOwnership(spec, nodes);
        EXPECT_EQ(again->owner, plan->owner);
        EXPECT_EQ(again->pieces, plan->pieces);
      }
    }
  }
}

TEST(OwnershipPlanTest, Qwen3_4bLikeMuonFlopsWithinFivePercentUpToEightNodes) {
  for (bool apply : {false, true}) {
    const common::JobSpec spec = Model(kQwen3_4b, apply);
    for (int nodes : {2, 4, 8}) {
      auto plan = PlanOwnership(spec, nodes);
      ASSERT_TRUE(plan.ok()) << plan.status();
      EXPECT_LE(plan->FlopsImbalance(), 1.05);
    }
  }
}

TEST(OwnershipPlanTest, ALargeAdamWTensorIsSplitByRowsAndSmallOnesStayWhole) {
  common::JobSpec spec;
  spec.job_id = "j";
  spec.mode = common::JobMode::kApply;
  spec.matrices = {Tensor("w", {64, 64}), Tensor("embed", {1000, 1024}, common::Optimizer::kAdamW),
                   Tensor("bias", {1000}, common::Optimizer::kAdamW)};
  auto plan = PlanOwnership(spec, 4);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ExpectPlanConsistent(spec, *plan, 4);
  EXPECT_FALSE(plan->Split(0));
  EXPECT_TRUE(plan->Split(1));
  EXPECT_FALSE(plan->Split(2));
  EXPECT_LE(plan->BytesImbalance(), 1.02);  // the bias goes whole on top of a level node
  // 1 node: nothing to split.
  auto one = PlanOwnership(spec, 1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->pieces.size(), 3u);
  // A tensor under two minimum pieces (1 MiB of state each) stays whole.
  spec.matrices[1].shape = {100, 1024};  // 1.2 MB
  plan = PlanOwnership(spec, 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->Split(1));
  // Rows of a split tensor are a node's job, not a global one: refused.
  spec.matrices[1].full_rows = 200;
  EXPECT_EQ(PlanOwnership(spec, 2).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(OwnershipPlanTest, FlopsOfOneMatrix) {
  common::MuonConfig muon;  // 5 iterations
  // 64 x 256: m = 64, n = 256: 5 * (4 * 64^2 * 256 + 2 * 64^3).
  EXPECT_DOUBLE_EQ(NewtonSchulzFlops(Tensor("w", {64, 256}), muon),
                   5.0 * (4.0 * 64 * 64 * 256 + 2.0 * 64 * 64 * 64));
  // Transposed: the same.
  EXPECT_DOUBLE_EQ(NewtonSchulzFlops(Tensor("w", {256, 64}), muon),
                   NewtonSchulzFlops(Tensor("w", {64, 256}), muon));
  // Two heads of 32 x 256, experts as a batch.
  common::MatrixSpec heads = Tensor("w", {64, 256});
  heads.num_heads = 2;
  EXPECT_DOUBLE_EQ(NewtonSchulzFlops(heads, muon),
                   2 * 5.0 * (4.0 * 32 * 32 * 256 + 2.0 * 32 * 32 * 32));
  EXPECT_DOUBLE_EQ(NewtonSchulzFlops(Tensor("e", {3, 64, 256}), muon),
                   3 * NewtonSchulzFlops(Tensor("w", {64, 256}), muon));
  EXPECT_EQ(NewtonSchulzFlops(Tensor("b", {64}, common::Optimizer::kAdamW), muon), 0);
  EXPECT_EQ(StepFlops(Tensor("b", {64}, common::Optimizer::kAdamW), muon),
            64 * kAdamWFlopsPerElement);
}

TEST(OwnershipPlanTest, AdamWBalancedByBytesAndEveryNodeOwnsOne) {
  common::JobSpec spec;
  spec.job_id = "j";
  spec.mode = common::JobMode::kApply;
  spec.matrices = {Tensor("a", {100}, common::Optimizer::kAdamW),
                   Tensor("b", {60}, common::Optimizer::kAdamW),
                   Tensor("c", {40}, common::Optimizer::kAdamW)};
  auto plan = PlanOwnership(spec, 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->owner, (std::vector<int32_t>{0, 1, 1}));
  EXPECT_DOUBLE_EQ(plan->node_bytes[0], 1200);
  EXPECT_DOUBLE_EQ(plan->node_bytes[1], 1200);
  auto too_many = PlanOwnership(spec, 4);
  ASSERT_FALSE(too_many.ok());
  EXPECT_NE(std::string(too_many.status().message()).find("3 tensors for 4 nodes"),
            std::string::npos)
      << too_many.status();
  EXPECT_FALSE(PlanOwnership(spec, 0).ok());
}

}  // namespace
}  // namespace muond::client
