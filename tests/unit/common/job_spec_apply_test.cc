// Apply mode in job specs (DESIGN.md 4b): job.json fields, defaults, canonical form and the rules.
// What each bad input gets: INVALID_ARGUMENT naming the field or tensor; nothing else changes.
#include <string>

#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "tests/unit/common/job_spec_test_util.h"

namespace muond::common {
namespace {

constexpr char kApply[] = R"({
  "job_id": "a1", "mode": "apply", "world_size": 2, "zero_stage": 3,
  "tensors": [
    {"name": "wq", "shape": [64, 32], "dtype": "bfloat16", "param_dtype": "bfloat16"},
    {"name": "embed", "shape": [100, 32], "optimizer": "adamw", "group": "embed",
     "dtype": "bfloat16", "param_dtype": "float32"},
    {"name": "norm", "shape": [32], "optimizer": "adamw", "group": "embed"},
    {"name": "scale", "shape": [], "optimizer": "adamw", "group": "embed"}],
  "groups": [{"name": "muon", "lr": 0.02, "weight_decay": 0.01},
             {"name": "embed", "lr": 0.001}],
  "adamw": {"betas": [0.9, 0.95], "eps": 1e-10},
  "max_grad_norm": 1.0, "init_from": "/var/lib/models/init.safetensors"})";


// kApply with `from` replaced by `to` (once).
std::string Edit(const std::string& from, const std::string& to) {
  std::string json = kApply;
  const size_t at = json.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return at == std::string::npos ? json : json.replace(at, from.size(), to);
}

TEST(JobSpecApplyTest, EveryFieldDefaultsAndRoundTrip) {
  auto spec = ParseJobSpecJson(kApply);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->mode, JobMode::kApply);
  ASSERT_EQ(spec->matrices.size(), 4u);
  const MatrixSpec& wq = spec->matrices[0];
  EXPECT_EQ(wq.optimizer, Optimizer::kMuon);
  EXPECT_EQ(wq.group, "muon");  // the optimizer's name by default
  EXPECT_EQ(wq.param_dtype, DType::kBFloat16);
  EXPECT_EQ(spec->matrices[1].optimizer, Optimizer::kAdamW);
  EXPECT_EQ(spec->matrices[1].param_dtype, DType::kFloat32);
  EXPECT_EQ(spec->matrices[2].param_dtype, DType::kFloat32);  // default: its dtype
  EXPECT_EQ(spec->matrices[2].numel(), 32);
  EXPECT_EQ(spec->matrices[3].numel(), 1);  // a 0-d tensor
  ASSERT_EQ(spec->groups.size(), 2u);
  EXPECT_EQ(spec->groups[1].name, "embed");
  EXPECT_DOUBLE_EQ(spec->groups[1].lr, 0.001);
  EXPECT_DOUBLE_EQ(spec->groups[1].weight_decay, 0.0);
  EXPECT_DOUBLE_EQ(spec->adamw.beta2, 0.95);
  EXPECT_DOUBLE_EQ(spec->adamw.eps, 1e-10);
  EXPECT_DOUBLE_EQ(spec->max_grad_norm, 1.0);
  EXPECT_EQ(spec->init_from, "/var/lib/models/init.safetensors");
  // The canonical form says "tensors" and every apply field, and reads back the same.
  const std::string canonical = JobSpecToJson(*spec);
  EXPECT_NE(canonical.find("\"tensors\""), std::string::npos);
  EXPECT_EQ(canonical.find("\"matrices\""), std::string::npos);
  auto again = ParseJobSpecJson(canonical);
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << canonical;
  EXPECT_EQ(JobSpecToJson(*again), canonical);
}

TEST(JobSpecApplyTest, UpdateModeJsonIsUnchangedAndRefusesApplyFields) {
  auto spec = ParseJobSpecJson(R"({"job_id": "u1", "tensors": [{"name": "w", "shape": [4, 8]}]})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->mode, JobMode::kUpdate);
  const std::string canonical = JobSpecToJson(*spec);
  for (const char* field : {"\"mode\"", "\"tensors\"", "\"groups\"", "\"adamw\"", "optimizer",
                            "param_dtype", "max_grad_norm", "init_from"}) {
    EXPECT_EQ(canonical.find(field), std::string::npos) << field << " in\n" << canonical;
  }
  ExpectInvalid(
      R"({"job_id": "u1", "matrices": [{"name": "w", "shape": [4], "optimizer": "adamw"}]})",
      "mode 'apply' only");
  ExpectInvalid(R"({"job_id": "u1", "matrices": [{"name": "w", "shape": [4, 8]}],
                    "groups": [{"name": "muon", "lr": 1}]})",
                "mode 'apply' only");
}

// Update mode clips too: max_grad_norm round-trips through job.json, a bad value is refused as in
// apply mode, and a multi-node update job (no global clip there) refuses it.
TEST(JobSpecApplyTest, UpdateModeTakesMaxGradNorm) {
  auto spec = ParseJobSpecJson(R"({"job_id": "u1", "matrices": [{"name": "w", "shape": [4, 8]}],
                                   "max_grad_norm": 0.5})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->mode, JobMode::kUpdate);
  EXPECT_DOUBLE_EQ(spec->max_grad_norm, 0.5);
  const std::string canonical = JobSpecToJson(*spec);
  EXPECT_NE(canonical.find("\"max_grad_norm\": 0.5"), std::string::npos) << canonical;
  EXPECT_EQ(canonical.find("\"mode\""), std::string::npos) << canonical;
  auto again = ParseJobSpecJson(canonical);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_DOUBLE_EQ(again->max_grad_norm, 0.5);
  ExpectInvalid(R"({"job_id": "u1", "matrices": [{"name": "w", "shape": [4, 8]}],
                    "max_grad_norm": -1})",
                "max_grad_norm -1 must be finite and >= 0");
  ExpectInvalid(R"({"job_id": "u1", "matrices": [{"name": "w", "shape": [4, 8]}],
                    "max_grad_norm": 1, "multinode": {"global_job_id": "g", "node": 0, "nodes": 2}})",
                "multi-node job clips globally in mode 'apply' only");
}

TEST(JobSpecApplyTest, BadApplyInputsNameWhatIsWrong) {
  ExpectInvalid(Edit(R"("mode": "apply")", R"("mode": "fused")"), "mode: unknown mode 'fused'");
  ExpectInvalid(Edit(R"("optimizer": "adamw", "group": "embed",
     "dtype")",
                     R"("optimizer": "sgd", "group": "embed",
     "dtype")"),
                "tensors[1].optimizer: unknown optimizer 'sgd'");
  ExpectInvalid(Edit(R"("param_dtype": "float32"})", R"("param_dtype": "int8"})"),
                "tensors[1].param_dtype");
  ExpectInvalid(Edit(R"("tensors": [)", R"("matrices": [], "tensors": [)"), "not both");
  ExpectInvalid(Edit(R"({"name": "embed", "lr": 0.001})", R"({"name": "embed2", "lr": 0.001})"),
                "group 'embed' is not one of the job's groups");
  ExpectInvalid(Edit(R"({"name": "embed", "lr": 0.001})", R"({"name": "muon", "lr": 0.001})"),
                "appears twice");
  ExpectInvalid(Edit(R"({"name": "embed", "lr": 0.001})", R"({"name": "embed"})"),
                "groups[1].lr: missing");
  ExpectInvalid(Edit(R"("lr": 0.001)", R"("lr": -0.001)"), "must be finite and >= 0");
  ExpectInvalid(Edit(R"("groups": [{"name": "muon", "lr": 0.02, "weight_decay": 0.01},
             {"name": "embed", "lr": 0.001}],)",
                     ""),
                "needs 1..1024 parameter groups, got 0");
  ExpectInvalid(Edit(R"("betas": [0.9, 0.95])", R"("betas": [0.9, 1.0])"), "adamw: betas");
  ExpectInvalid(Edit(R"("betas": [0.9, 0.95])", R"("betas": [0.9])"),
                "adamw.betas: expected an array of two numbers");
  ExpectInvalid(Edit(R"("eps": 1e-10)", R"("eps": 0)"), "eps 0 finite and > 0");
  ExpectInvalid(Edit(R"("max_grad_norm": 1.0)", R"("max_grad_norm": -1)"), "max_grad_norm -1");
  ExpectInvalid(Edit(R"("init_from": "/var/lib/models/init.safetensors")", R"("init_from": 3)"),
                "init_from: expected a string");
  ExpectInvalid(Edit(R"({"name": "wq", "shape": [64, 32])", R"({"name": "wq", "shape": [64])"),
                "expected 2 to 4");
  ExpectInvalid(Edit(R"("shape": [32], "optimizer": "adamw")",
                     R"("shape": [1, 1, 1, 1, 1, 1, 1, 1, 1], "optimizer": "adamw")"),
                "expected 0 to 8 (adamw)");
  ExpectInvalid(Edit(R"("shape": [32], "optimizer": "adamw")",
                     R"("shape": [32], "num_heads": 2, "optimizer": "adamw")"),
                "applies to muon tensors only");
  ExpectInvalid(Edit(R"("groups": [)", R"("transport_probe": true, "groups": [)"),
                "transport probe runs in mode 'update' only");
  // ZeRO 1/2: one flat buffer of one parameter dtype as well as one gradient dtype.
  ExpectInvalid(Edit(R"("zero_stage": 3)", R"("zero_stage": 2)"), "flat buffer of one dtype");
}

// Rows of an AdamW tensor split across nodes (the ownership plan): "rows" {"offset", "of"} on an
// AdamW tensor of an apply-mode multi-node job, written back in the canonical form; everywhere
// else, or out of range, INVALID_ARGUMENT naming the tensor.
TEST(JobSpecApplyTest, RowsOfATensorSplitAcrossNodes) {
  const std::string multinode =
      R"("multinode": {"global_job_id": "g", "node": 1, "nodes": 3}, "max_grad_norm")";
  const auto with = [&](const std::string& rows, const std::string& tensor = "\"group\": \"embed\",") {
    std::string json = Edit("\"max_grad_norm\"", multinode);
    const size_t at = json.find(tensor);
    return json.replace(at, tensor.size(), tensor + " " + rows + ",");
  };
  auto spec = ParseJobSpecJson(with(R"("rows": {"offset": 50, "of": 300})"));
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->matrices[1].row_offset, 50);
  EXPECT_EQ(spec->matrices[1].full_rows, 300);
  EXPECT_EQ(spec->matrices[0].full_rows, 0);
  auto again = ParseJobSpecJson(JobSpecToJson(*spec));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->matrices[1].row_offset, 50);
  EXPECT_EQ(again->matrices[1].full_rows, 300);
  EXPECT_EQ(JobSpecToJson(*again), JobSpecToJson(*spec));
  // The last rows exactly: [200, 300).
  EXPECT_TRUE(ParseJobSpecJson(with(R"("rows": {"offset": 200, "of": 300})")).ok());
  const std::pair<std::string, std::string> bad[] = {
      {with(R"("rows": {"offset": 201, "of": 300})"), "rows [201, 201 + 100) are not within"},
      {with(R"("rows": {"offset": 0, "of": 99})"), "are not within the tensor's 99 rows"},
      {with(R"("rows": {"offset": -1, "of": 300})"), "are not within"},
      {with(R"("rows": {"offset": 0, "of": 0})"), "rows.of: 0 is not >= 1"},
      {with(R"("rows": {"offset": 0})"), "rows.of: missing"},
      {with(R"("rows": {"offset": 0, "of": 300, "x": 1})"), "rows.x"},
      {with(R"("rows": [0, 300])"), "expected an object"},
      {with(R"("rows": {"offset": 0, "of": 300})", "\"name\": \"wq\","),
       "tensor 'wq': rows: only an AdamW tensor"},
      {with(R"("rows": {"offset": 0, "of": 300})", "\"name\": \"scale\","),
       "a 0-d tensor has no rows"},
      {with(R"("rows": {"offset": 0, "of": 9223372036854775807})"), "more than"},
      {Edit("\"group\": \"embed\",", R"("group": "embed", "rows": {"offset": 0, "of": 300},)"),
       "tensor 'embed': rows: only an AdamW tensor of an apply-mode multi-node job"},
  };
  for (const auto& [json, phrase] : bad) {
    auto s = ParseJobSpecJson(json);
    ASSERT_FALSE(s.ok()) << phrase;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_NE(std::string(s.status().message()).find(phrase), std::string::npos)
        << s.status() << " (wanted: " << phrase << ")";
  }
}

}  // namespace
}  // namespace muond::common
