// RankSpans: every layout tiles every matrix exactly once, and rank buffers follow DESIGN.md 4.
#include "common/layout.h"

#include <gtest/gtest.h>

#include <vector>

#include "common/job_spec.h"

namespace muond::common {
namespace {

JobSpec Spec(int world, int stage, std::vector<std::vector<int64_t>> shapes) {
  JobSpec s;
  s.job_id = "t";
  s.world_size = world;
  s.zero_stage = stage;
  for (size_t i = 0; i < shapes.size(); ++i) {
    MatrixSpec m;
    m.name = "m" + std::to_string(i);
    m.shape = shapes[i];
    s.matrices.push_back(m);
  }
  return s;
}

// Counts how often each element of each matrix is covered across all ranks.
void ExpectTiles(const JobSpec& spec) {
  std::vector<std::vector<int>> hits;
  for (const MatrixSpec& m : spec.matrices) hits.emplace_back(m.numel(), 0);
  for (int r = 0; r < spec.world_size; ++r) {
    for (const ShardSpan& s : RankSpans(spec, r)) {
      ASSERT_LT(s.matrix, spec.matrices.size());
      ASSERT_LE(s.offset + s.length, static_cast<uint64_t>(spec.matrices[s.matrix].numel()));
      for (uint64_t i = 0; i < s.length; ++i) ++hits[s.matrix][s.offset + i];
    }
  }
  for (size_t m = 0; m < hits.size(); ++m) {
    for (size_t i = 0; i < hits[m].size(); ++i) {
      ASSERT_EQ(hits[m][i], 1) << "matrix " << m << " element " << i;
    }
  }
}

TEST(LayoutTest, StageZeroIsWholeMatrices) {
  JobSpec spec = Spec(1, 0, {{4, 8}, {3, 5}});
  std::vector<ShardSpan> spans = RankSpans(spec, 0);
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0], (ShardSpan{0, 0, 32, 0}));
  EXPECT_EQ(spans[1], (ShardSpan{1, 0, 15, 32}));
  ExpectTiles(spec);
}

TEST(LayoutTest, StageTwoPartitionsStraddleMatrices) {
  // total 32 + 15 = 47, world 3: P = 16; rank 2 owns [32, 47) = all of matrix 1, 15 elements.
  JobSpec spec = Spec(3, 2, {{4, 8}, {3, 5}});
  EXPECT_EQ(RankSpans(spec, 0), (std::vector<ShardSpan>{{0, 0, 16, 0}}));
  EXPECT_EQ(RankSpans(spec, 1), (std::vector<ShardSpan>{{0, 16, 16, 0}}));
  EXPECT_EQ(RankSpans(spec, 2), (std::vector<ShardSpan>{{1, 0, 15, 0}}));
  ExpectTiles(spec);
  JobSpec odd = Spec(4, 1, {{7, 3}, {2, 2}, {5, 1}});  // 30 elements, P = 8
  EXPECT_EQ(RankSpans(odd, 2), (std::vector<ShardSpan>{{0, 16, 5, 0}, {1, 0, 3, 5}}));
  ExpectTiles(odd);
}

TEST(LayoutTest, StageThreeSplitsEachMatrix) {
  // 15 elements over 4 ranks: chunks of 4; rank 3 owns 3 elements, its buffer is padded.
  JobSpec spec = Spec(4, 3, {{4, 8}, {3, 5}});
  EXPECT_EQ(RankSpans(spec, 3), (std::vector<ShardSpan>{{0, 24, 8, 0}, {1, 12, 3, 8}}));
  ExpectTiles(spec);
  // More ranks than elements: the last ranks own nothing of the small matrix.
  JobSpec tiny = Spec(8, 3, {{2, 2}});
  EXPECT_TRUE(RankSpans(tiny, 7).empty());
  ExpectTiles(tiny);
}

}  // namespace
}  // namespace muond::common

namespace muond::common {
namespace {

JobSpec Explicit(std::vector<std::vector<LayoutSpan>> layout) {
  JobSpec s;
  s.job_id = "x";
  s.world_size = static_cast<int>(layout.size());
  s.matrices = {MatrixSpec{"a", {4, 4}}, MatrixSpec{"b", {2, 3}}};
  s.explicit_layout = std::move(layout);
  return s;
}

TEST(LayoutTest, ExplicitLayoutTilesOrNamesTheGapOrOverlap) {
  JobSpec ok = Explicit({{{0, 0, 10}, {1, 0, 6}}, {{0, 10, 6}}});
  ASSERT_TRUE(ValidateJobSpec(ok).ok()) << ValidateJobSpec(ok);
  EXPECT_EQ(RankSpans(ok, 0), (std::vector<ShardSpan>{{0, 0, 10, 0}, {1, 0, 6, 10}}));
  EXPECT_EQ(RankBufferElements(ok, 1), 6u);

  absl::Status gap = ValidateJobSpec(Explicit({{{0, 0, 10}, {1, 0, 6}}, {{0, 11, 5}}}));
  EXPECT_EQ(gap.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(gap.message().find("matrix 'a' has a gap: elements [10, 11)"), std::string::npos)
      << gap;
  absl::Status overlap = ValidateJobSpec(Explicit({{{0, 0, 10}, {1, 0, 6}}, {{0, 8, 8}}}));
  EXPECT_NE(overlap.message().find("matrix 'a' has an overlap: elements [8, 10) are owned by rank 0 "
                                   "and rank 1"),
            std::string::npos)
      << overlap;
  absl::Status tail = ValidateJobSpec(Explicit({{{0, 0, 16}}, {{1, 0, 5}}}));
  EXPECT_NE(tail.message().find("matrix 'b' has a gap: elements [5, 6)"), std::string::npos)
      << tail;
  absl::Status outside = ValidateJobSpec(Explicit({{{0, 0, 16}}, {{1, 2, 5}}}));
  EXPECT_NE(outside.message().find("outside its 6 elements"), std::string::npos) << outside;
  JobSpec staged = Explicit({{{0, 0, 16}, {1, 0, 6}}});
  staged.zero_stage = 2;
  EXPECT_FALSE(ValidateJobSpec(staged).ok());
}

TEST(LayoutTest, ExplicitLayoutRoundTripsThroughJson) {
  auto spec = ParseJobSpecJson(R"({"job_id": "x", "matrices": [{"name": "a", "shape": [4, 4]}],
      "layout": [[{"matrix": "a", "offset": 0, "length": 7}], [{"matrix": "a", "offset": 7,
      "length": 9}]]})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->world_size, 2);
  auto again = ParseJobSpecJson(JobSpecToJson(*spec));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->explicit_layout, spec->explicit_layout);
  auto unknown = ParseJobSpecJson(R"({"job_id": "x", "matrices": [{"name": "a", "shape": [4, 4]}],
      "layout": [[{"matrix": "zz", "offset": 0, "length": 16}]]})");
  EXPECT_NE(unknown.status().message().find("layout[0][0].matrix: no matrix named 'zz'"),
            std::string::npos)
      << unknown.status();
}

}  // namespace
}  // namespace muond::common
