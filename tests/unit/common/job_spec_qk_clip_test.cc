// QK-Clip in job specs (DESIGN.md 4e): the "qk_clip" block, its canonical form, and what each bad
// block gets (INVALID_ARGUMENT naming the field and the value); the check of a step's maxima.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "tests/unit/common/job_spec_test_util.h"

namespace muond::common {
namespace {

// A GQA pair (8 query heads, 2 key heads of dim 4) and an MHA pair (4 and 4), over input 24.
constexpr char kJob[] = R"({
  "job_id": "qk", "mode": "apply", "world_size": 1, "zero_stage": 0,
  "tensors": [
    {"name": "gqa.q", "shape": [32, 24]}, {"name": "gqa.k", "shape": [8, 24]},
    {"name": "mha.q", "shape": [16, 24]}, {"name": "mha.k", "shape": [16, 24]},
    {"name": "mlp", "shape": [24, 40]},
    {"name": "norm", "shape": [24], "optimizer": "adamw", "group": "other"}],
  "groups": [{"name": "muon", "lr": 0.02}, {"name": "other", "lr": 0.001}],
  "qk_clip": {"threshold": 100, "pairs": [
    {"q": "gqa.q", "k": "gqa.k", "q_heads": 8, "kv_heads": 2, "head_dim": 4},
    {"q": "mha.q", "k": "mha.k", "q_heads": 4, "kv_heads": 4, "head_dim": 4}]}})";

std::string Edit(const std::string& from, const std::string& to) {
  std::string json = kJob;
  const size_t at = json.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return at == std::string::npos ? json : json.replace(at, from.size(), to);
}

TEST(JobSpecQkClipTest, ParsesDefaultsAndRoundTrips) {
  auto spec = ParseJobSpecJson(kJob);
  ASSERT_TRUE(spec.ok()) << spec.status();
  const QkClip& c = spec->qk_clip;
  EXPECT_TRUE(c.enabled());
  EXPECT_DOUBLE_EQ(c.threshold, 100);
  EXPECT_DOUBLE_EQ(c.alpha, 0.5);  // the default
  ASSERT_EQ(c.pairs.size(), 2u);
  EXPECT_EQ(c.pairs[0].k, "gqa.k");
  EXPECT_EQ(c.pairs[0].kv_heads, 2);
  EXPECT_EQ(c.logits(), 12u);
  const auto tensors = QkClipTensors(*spec);
  ASSERT_EQ(tensors.size(), 2u);
  EXPECT_EQ(tensors[0], (std::pair<uint32_t, uint32_t>{0, 1}));
  EXPECT_EQ(tensors[1], (std::pair<uint32_t, uint32_t>{2, 3}));
  auto again = ParseJobSpecJson(JobSpecToJson(*spec));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(JobSpecToJson(*again), JobSpecToJson(*spec));
  EXPECT_DOUBLE_EQ(again->qk_clip.alpha, 0.5);
  EXPECT_EQ(again->qk_clip.pairs[1].q, "mha.q");
  // A job without the block writes none (its job.json is as it was).
  JobSpec plain = *spec;
  plain.qk_clip = QkClip{};
  EXPECT_EQ(JobSpecToJson(plain).find("qk_clip"), std::string::npos);
}

TEST(JobSpecQkClipTest, RefusesEachBadBlockNamingTheField) {
  struct Case {
    std::string from, to, message;
  };
  const std::vector<Case> cases = {
      {R"("threshold": 100)", R"("threshold": 0)", "qk_clip.threshold: 0 must be finite and > 0"},
      {R"("threshold": 100)", R"("threshold": -5)", "qk_clip.threshold"},
      {R"("threshold": 100)", R"("threshold": 100, "alpha": 1.5)", "qk_clip.alpha: 1.5"},
      {R"("threshold": 100)", R"("alpha": 0.5)", "qk_clip.threshold: missing"},
      {R"("kv_heads": 2)", R"("kv_heads": 3)", "kv_heads 3 does not divide q_heads 8"},
      {R"("kv_heads": 2)", R"("kv_heads": 4)",
       "qk_clip.pairs[0].k: tensor 'gqa.k' has shape [8, 24]; expected [kv_heads * head_dim, in]"},
      {R"("q_heads": 8)", R"("q_heads": 0)", "must be >= 1"},
      {R"("head_dim": 4})", R"("head_dim": 4, "rope": 1})", "qk_clip.pairs[0].rope"},
      {R"("q": "gqa.q")", R"("q": "nope")", "qk_clip.pairs[0].q: tensor 'nope' is not a tensor"},
      {R"("k": "gqa.k")", R"("k": "norm")",
       "qk_clip.pairs[0].k: tensor 'norm' is optimized by AdamW"},
      {R"("k": "gqa.k")", R"("k": "gqa.q")", "q and k are the same tensor"},
      {R"("q": "mha.q", "k": "mha.k", "q_heads": 4)", R"("q": "gqa.q", "k": "mha.k", "q_heads": 8)",
       "qk_clip.pairs[1].q: tensor 'gqa.q' is already in qk_clip.pairs[0].q"},
      {R"({"name": "mha.k", "shape": [16, 24]})", R"({"name": "mha.k", "shape": [16, 20]})",
       "q has 24 columns and k 20"},
      {R"("world_size": 1)",
       R"("world_size": 1, "multinode": {"global_job_id": "g", "node": 0, "nodes": 2})",
       "not supported on a node of a multi-node job"},
  };
  for (const Case& c : cases) ExpectInvalid(Edit(c.from, c.to), c.message);
  const std::string head = std::string(kJob).substr(0, std::string(kJob).find(R"("qk_clip")"));
  ExpectInvalid(head + R"("qk_clip": {"threshold": 1, "pairs": 3}})",
                "qk_clip.pairs: expected an array");
  ExpectInvalid(head + R"("qk_clip": {"pairs": []}})", "qk_clip.threshold: missing");
  // An update-mode job carries no pair (the masters are the trainer's there).
  auto spec = ParseJobSpecJson(kJob);
  ASSERT_TRUE(spec.ok()) << spec.status();
  spec->mode = JobMode::kUpdate;
  const absl::Status update = ValidateQkClip(*spec);
  EXPECT_EQ(update.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(update.message().find("qk_clip: QK-Clip rescales the master weights: mode 'apply' "
                                  "only"),
            std::string::npos)
      << update;
  // A pair's q of several heads (num_heads > 1) is refused: its rows are Muon's heads then.
  ExpectInvalid(Edit(R"({"name": "gqa.q", "shape": [32, 24]})",
                     R"({"name": "gqa.q", "shape": [32, 24], "num_heads": 2})"),
                "num_heads > 1");
}

TEST(JobSpecQkClipTest, MaxLogitsOfAStep) {
  auto spec = ParseJobSpecJson(kJob);
  ASSERT_TRUE(spec.ok()) << spec.status();
  std::vector<float> ok(12, 3.5f);
  EXPECT_TRUE(CheckMaxLogits(*spec, ok, "step 0").ok());
  // Missing: names the first pair without its values.
  absl::Status none = CheckMaxLogits(*spec, {}, "job 'qk' step 0 rank 1");
  EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(none.message().find("job 'qk' step 0 rank 1: the step carries 0 max attention "
                                "logits; QK-Clip pair q='gqa.q' needs its 8"),
            std::string::npos)
      << none;
  absl::Status short_one = CheckMaxLogits(*spec, std::vector<float>(10, 1.0f), "s");
  EXPECT_NE(short_one.message().find("pair q='mha.q'"), std::string::npos) << short_one;
  absl::Status long_one = CheckMaxLogits(*spec, std::vector<float>(13, 1.0f), "s");
  EXPECT_NE(long_one.message().find("13 max attention logits; the job's QK-Clip pairs have 12"),
            std::string::npos)
      << long_one;
  for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> v = ok;
    v[9] = bad;
    absl::Status s = CheckMaxLogits(*spec, v, "s");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("head 1 of QK-Clip pair q='mha.q' is not finite"), std::string::npos)
        << s;
  }
  // Negative logits are logits: accepted.
  EXPECT_TRUE(CheckMaxLogits(*spec, std::vector<float>(12, -7.0f), "s").ok());
  // A job without qk_clip takes none.
  JobSpec plain = *spec;
  plain.qk_clip = QkClip{};
  EXPECT_TRUE(CheckMaxLogits(plain, {}, "s").ok());
  absl::Status extra = CheckMaxLogits(plain, {1.0f}, "s");
  EXPECT_NE(extra.message().find("the job has no qk_clip pairs"), std::string::npos) << extra;
}

}  // namespace
}  // namespace muond::common
