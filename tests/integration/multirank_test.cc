// ZeRO-sharded jobs equal the world-size-1 whole-matrix trajectory bit for bit (DESIGN.md 4):
// world sizes 1, 2, 3, 4 and 8; stages 1, 2 and 3; explicit layouts; float32 and bfloat16; a
// matrix larger than a stage 1/2 partition, one with fewer elements than ranks, an expert batch
// and a per-head matrix. Every rank is a thread with its own Client and RankSession, and all ranks
// push concurrently. Gather budgets below one matrix exercise the "processed alone" path.
#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/layout.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"

namespace muond::integration {
namespace {

constexpr int kSteps = 3;
constexpr uint64_t kDaemonDefaultBudget = uint64_t{1} << 30;  // muond's --gather-budget-bytes

class MultiRankTest : public DaemonSuite {
 protected:
  // Creates `spec`, steps it kSteps times with its ranks concurrently, and expects every rank's
  // update spans to equal the slices of `want` (the world-size-1 trajectory) bit for bit, and the
  // job's counters and gather accounting to be consistent.
  static void ExpectEquivalent(const common::JobSpec& spec, const MatrixBytes& grads,
                               const MatrixBytes& want, bool use_buffer) {
    SCOPED_TRACE(absl::StrCat("job ", spec.job_id, ": world ", spec.world_size, " stage ",
                              spec.zero_stage, spec.explicit_layout.empty() ? "" : " explicit",
                              " budget ", spec.gather_budget_bytes,
                              use_buffer ? " (StepBuffer)" : " (Step spans)"));
    auto token = client().CreateJob(spec);
    ASSERT_TRUE(token.ok()) << token.status();
    const std::vector<RankRun> runs =
        RunRanks(address(), spec.job_id, *token, spec.world_size, grads, use_buffer);
    uint64_t owned = 0;
    for (int r = 0; r < spec.world_size; ++r) {
      SCOPED_TRACE(absl::StrCat("rank ", r));
      const RankRun& run = runs[r];
      ASSERT_EQ(run.status.size(), static_cast<size_t>(kSteps));
      for (int t = 0; t < kSteps; ++t) {
        ASSERT_TRUE(run.status[t].ok()) << "step " << t << ": " << run.status[t];
        EXPECT_TRUE(SpansEqual(spec, run.layout, run.spans[t], want[t])) << "step " << t;
      }
      for (const common::ShardSpan& s : run.layout) owned += s.length;
    }
    uint64_t total = 0, largest = 0;
    for (const common::MatrixSpec& m : spec.matrices) {
      total += m.numel();
      largest = std::max<uint64_t>(largest, m.numel());
    }
    EXPECT_EQ(owned, total) << "the ranks' spans do not cover every element once";

    auto st = client().GetJob(spec.job_id, *token);
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->next_step(), kSteps);
    EXPECT_EQ(st->steps_completed(), kSteps);
    EXPECT_EQ(st->steps_refused(), 0);
    EXPECT_EQ(st->steps_aborted(), 0);
    EXPECT_FALSE(st->fenced()) << st->fence_reason();
    EXPECT_FALSE(st->has_step_in_flight());
    EXPECT_EQ(st->momentum_bytes(), total * sizeof(float));
    const uint64_t budget =
        spec.gather_budget_bytes != 0 ? spec.gather_budget_bytes : kDaemonDefaultBudget;
    EXPECT_EQ(st->gather_budget_bytes(), budget);
    EXPECT_EQ(st->spec().gather_budget_bytes(), spec.gather_budget_bytes);
    // Each matrix costs 8 bytes per element while assembled (fp32 gradient + momentum on the
    // device), 4 on the cpu backend (the update runs in place on the fp32 staging).
    const uint64_t per_element = st->backend().rfind("cpu", 0) == 0 ? 4 : 8;
    EXPECT_GE(st->gather_peak_bytes(), per_element * largest)
        << "the largest matrix was never gathered (backend " << st->backend() << ")";
    EXPECT_LE(st->gather_peak_bytes(), std::max<uint64_t>(budget, per_element * largest));
    ASSERT_EQ(st->ranks_size(), spec.world_size);
    for (int r = 0; r < spec.world_size; ++r) {
      uint64_t elements = 0;
      for (const common::ShardSpan& s : common::RankSpans(spec, r)) elements += s.length;
      EXPECT_EQ(st->ranks(r).elements(), elements) << "rank " << r;
    }
    // Every session ended with its RankSession (a shared-memory session ends when the daemon
    // sees its socket close, so poll).
    EXPECT_TRUE(WaitForJob(client(), spec.job_id, *token, [](const v1::JobStatus& s) {
      for (const v1::RankStatus& r : s.ranks()) {
        if (r.attached()) return false;
      }
      return true;
    })) << "ranks still attached after their sessions ended";
    EXPECT_TRUE(client().DeleteJob(spec.job_id, *token).ok());
  }

  static common::JobSpec ShardedJob(const std::string& prefix, int world, int stage,
                                    std::vector<common::MatrixSpec> matrices,
                                    uint64_t budget = 0) {
    common::JobSpec spec;
    spec.job_id = NewJobId(prefix);
    spec.world_size = world;
    spec.zero_stage = stage;
    spec.matrices = std::move(matrices);
    spec.gather_budget_bytes = budget;
    return spec;
  }
};

// Budgets: below every matrix but "tiny" (each matrix processed alone, "big" far beyond it), in
// between (some batching), and the daemon's default.
uint64_t BudgetFor(int world) { return world == 2 ? 4096 : world == 3 ? 30000 : 0; }

TEST_F(MultiRankTest, Stage1And2PartitionsEqualWholeMatrixTrajectory) {
  const std::vector<common::MatrixSpec> matrices = MixedMatrices();
  const MatrixBytes grads = MakeGradients(matrices, kSteps, /*seed=*/11);
  common::JobSpec like;
  like.matrices = matrices;
  auto want = ReferenceTrajectory(client(), NewJobId("ref-f32"), like, grads);
  ASSERT_TRUE(want.ok()) << want.status();
  for (int stage : {1, 2}) {
    for (int world : {1, 2, 3, 4, 8}) {
      const common::JobSpec spec =
          ShardedJob(absl::StrCat("s", stage, "w", world), world, stage, matrices, BudgetFor(world));
      if (world >= 2) {
        // "big" is larger than a whole partition, so it straddles two or more ranks.
        const uint64_t partition = common::RankBufferElements(spec, 0);
        EXPECT_LT(partition, static_cast<uint64_t>(matrices[0].numel()));
        std::set<int> owners;
        for (int r = 0; r < world; ++r) {
          for (const common::ShardSpan& s : common::RankSpans(spec, r)) {
            if (s.matrix == 0) owners.insert(r);
          }
        }
        EXPECT_GE(owners.size(), 2u);
      }
      ExpectEquivalent(spec, grads, *want, /*use_buffer=*/true);
    }
  }
}

TEST_F(MultiRankTest, Stage3ChunksEqualWholeMatrixTrajectory) {
  const std::vector<common::MatrixSpec> matrices = MixedMatrices();
  const MatrixBytes grads = MakeGradients(matrices, kSteps, /*seed=*/12);
  common::JobSpec like;
  like.matrices = matrices;
  auto want = ReferenceTrajectory(client(), NewJobId("ref-f32"), like, grads);
  ASSERT_TRUE(want.ok()) << want.status();
  for (int world : {1, 2, 3, 4, 8}) {
    const common::JobSpec spec =
        ShardedJob(absl::StrCat("s3w", world), world, 3, matrices, BudgetFor(world));
    if (world == 8) {
      // "tiny" has 6 elements: ranks 6 and 7 own none of it (their chunk is all padding).
      for (int r : {6, 7}) {
        for (const common::ShardSpan& s : common::RankSpans(spec, r)) EXPECT_NE(s.matrix, 1u);
      }
    }
    ExpectEquivalent(spec, grads, *want, /*use_buffer=*/world % 2 == 0);
  }
}

// bfloat16 gradients (and one float32 matrix: stage 3 allows mixed dtypes), pushed as spans.
TEST_F(MultiRankTest, Stage3Bfloat16EqualsWholeMatrixTrajectory) {
  const std::vector<common::MatrixSpec> matrices =
      MixedMatrices(common::DType::kBFloat16, common::DType::kFloat32);
  const MatrixBytes grads = MakeGradients(matrices, kSteps, /*seed=*/13);
  common::JobSpec like;
  like.matrices = matrices;
  auto want = ReferenceTrajectory(client(), NewJobId("ref-bf16"), like, grads);
  ASSERT_TRUE(want.ok()) << want.status();
  for (int world : {1, 2, 3, 4, 8}) {
    ExpectEquivalent(ShardedJob(absl::StrCat("bf16w", world), world, 3, matrices,
                                BudgetFor(world)),
                     grads, *want, /*use_buffer=*/false);
  }
}

TEST_F(MultiRankTest, ExplicitLayoutEqualsWholeMatrixTrajectory) {
  const std::vector<common::MatrixSpec> matrices = MixedMatrices();
  const MatrixBytes grads = MakeGradients(matrices, kSteps, /*seed=*/14);
  common::JobSpec like;
  like.matrices = matrices;
  auto want = ReferenceTrajectory(client(), NewJobId("ref-f32"), like, grads);
  ASSERT_TRUE(want.ok()) << want.status();
  // Matrices: 0 big (6144), 1 tiny (6), 2 experts (1152), 3 heads (1280), 4 tall (1600).
  // Spans listed out of matrix order; "big" is split over all three ranks, twice on rank 0.
  common::JobSpec spec = ShardedJob("explicit3", 3, 0, matrices, /*budget=*/20000);
  spec.explicit_layout = {
      {{4, 800, 800}, {0, 0, 1000}, {1, 0, 6}, {0, 5500, 644}},
      {{0, 1000, 4000}, {3, 640, 640}, {4, 0, 800}},
      {{2, 0, 1152}, {3, 0, 640}, {0, 5000, 500}},
  };
  ExpectEquivalent(spec, grads, *want, /*use_buffer=*/true);
  ExpectEquivalent(
      [&] {
        common::JobSpec s = spec;
        s.job_id = NewJobId("explicit3-spans");
        return s;
      }(),
      grads, *want, /*use_buffer=*/false);

  // Two ranks, one of them owning whole matrices only.
  common::JobSpec two = ShardedJob("explicit2", 2, 0, matrices);
  two.explicit_layout = {
      {{0, 0, 6144}, {1, 0, 6}},
      {{2, 0, 1152}, {3, 0, 1280}, {4, 0, 1600}},
  };
  ExpectEquivalent(two, grads, *want, /*use_buffer=*/true);
}

}  // namespace
}  // namespace muond::integration
