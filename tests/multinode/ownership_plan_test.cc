// The ownership plan (client/ownership_plan.h): deterministic, every tensor owned once, Muon
// FLOPs balanced within 5% on a Qwen3-4B-like model over 2, 4 and 8 nodes (printed).
#include "client/ownership_plan.h"

#include <cstdio>
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

// Qwen3-4B's shapes: 36 layers, hidden 2560, 32 query heads and 8 key/value heads of 128,
// MLP 9728, vocabulary 151936; norms and embeddings as AdamW tensors (apply mode).
common::JobSpec Qwen3_4bLike(bool apply) {
  common::JobSpec spec;
  spec.job_id = "qwen3-4b-like";
  spec.mode = apply ? common::JobMode::kApply : common::JobMode::kUpdate;
  const int64_t h = 2560, q = 32 * 128, kv = 8 * 128, mlp = 9728;
  for (int l = 0; l < 36; ++l) {
    const std::string p = absl::StrCat("layers.", l, ".");
    spec.matrices.push_back(Tensor(p + "q_proj", {q, h}));
    spec.matrices.push_back(Tensor(p + "k_proj", {kv, h}));
    spec.matrices.push_back(Tensor(p + "v_proj", {kv, h}));
    spec.matrices.push_back(Tensor(p + "o_proj", {h, q}));
    spec.matrices.push_back(Tensor(p + "gate_proj", {mlp, h}));
    spec.matrices.push_back(Tensor(p + "up_proj", {mlp, h}));
    spec.matrices.push_back(Tensor(p + "down_proj", {h, mlp}));
    if (apply) {
      spec.matrices.push_back(Tensor(p + "input_norm", {h}, common::Optimizer::kAdamW));
      spec.matrices.push_back(Tensor(p + "post_norm", {h}, common::Optimizer::kAdamW));
    }
  }
  if (apply) {
    spec.matrices.push_back(Tensor("embed", {151936, h}, common::Optimizer::kAdamW));
    spec.matrices.push_back(Tensor("norm", {h}, common::Optimizer::kAdamW));
  }
  return spec;
}

TEST(OwnershipPlanTest, Qwen3_4bLikeFlopsWithinFivePercent) {
  for (bool apply : {false, true}) {
    const common::JobSpec spec = Qwen3_4bLike(apply);
    for (int nodes : {2, 4, 8}) {
      auto plan = PlanOwnership(spec, nodes);
      ASSERT_TRUE(plan.ok()) << plan.status();
      std::printf(
          "qwen3-4b-like (%s, %zu tensors) on %d nodes: flops max/mean %.4f, bytes "
          "max/mean %.4f\n",
          apply ? "apply" : "update", spec.matrices.size(), nodes, plan->FlopsImbalance(),
          plan->BytesImbalance());
      EXPECT_LE(plan->FlopsImbalance(), 1.05);
      ASSERT_EQ(plan->owner.size(), spec.matrices.size());
      double flops = 0;
      for (size_t i = 0; i < spec.matrices.size(); ++i) {
        ASSERT_GE(plan->owner[i], 0);
        ASSERT_LT(plan->owner[i], nodes);
        flops += NewtonSchulzFlops(spec.matrices[i], spec.muon);
      }
      double planned = 0;
      for (double f : plan->node_flops) planned += f;
      EXPECT_DOUBLE_EQ(planned, flops);
      // Deterministic: the same plan again.
      EXPECT_EQ(PlanOwnership(spec, nodes)->owner, plan->owner);
    }
  }
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
