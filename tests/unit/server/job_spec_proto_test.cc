// The API form of job specs (common/job_spec_proto.h): apply-mode fields survive a round trip;
// update-mode specs carry none of them; unknown enum values are INVALID_ARGUMENT naming the field.
#include "common/job_spec_proto.h"

#include "common/job_spec.h"
#include "gtest/gtest.h"

namespace muond::common {
namespace {

TEST(JobSpecProtoTest, ApplyModeRoundTrip) {
  auto spec = ParseJobSpecJson(R"({
    "job_id": "a1", "mode": "apply",
    "tensors": [{"name": "w", "shape": [8, 4], "dtype": "bfloat16"},
                {"name": "b", "shape": [8], "optimizer": "adamw", "param_dtype": "float16"}],
    "groups": [{"name": "muon", "lr": 0.02, "weight_decay": 0.1}, {"name": "adamw", "lr": 3e-4}],
    "adamw": {"betas": [0.8, 0.9], "eps": 1e-6}, "max_grad_norm": 0.5, "init_from": "/m.st"})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  const v1::JobSpec proto = JobSpecToProto(*spec);
  EXPECT_EQ(proto.mode(), v1::JOB_MODE_APPLY);
  EXPECT_EQ(proto.matrices(1).optimizer(), v1::OPTIMIZER_ADAMW);
  auto back = JobSpecFromProto(proto);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(JobSpecToJson(*back), JobSpecToJson(*spec));
  EXPECT_EQ(back->matrices[0].param_dtype, DType::kBFloat16);  // absent in JSON: its dtype
  EXPECT_EQ(back->matrices[1].group, "adamw");                 // absent in JSON: the optimizer
}

TEST(JobSpecProtoTest, Fp32IterationsRoundTrip) {
  auto spec = ParseJobSpecJson(R"({"job_id": "f", "muon": {"compute_dtype": "bfloat16",
    "fp32_iterations": 3}, "matrices": [{"name": "w", "shape": [4, 8]}]})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  const v1::JobSpec proto = JobSpecToProto(*spec);
  EXPECT_EQ(proto.muon().fp32_iterations(), 3);
  auto back = JobSpecFromProto(proto);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->muon.fp32_iterations, 3);
  EXPECT_FALSE(
      JobSpecToProto(
          *ParseJobSpecJson(R"({"job_id": "g", "matrices": [{"name": "w", "shape": [4, 8]}]})"))
          .muon()
          .has_fp32_iterations());
}

TEST(JobSpecProtoTest, UpdateModeCarriesNoApplyFields) {
  auto spec = ParseJobSpecJson(R"({"job_id": "u1", "matrices": [{"name": "w", "shape": [4, 8]}]})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  const v1::JobSpec proto = JobSpecToProto(*spec);
  EXPECT_EQ(proto.mode(), v1::JOB_MODE_UNSPECIFIED);
  EXPECT_EQ(proto.groups_size(), 0);
  EXPECT_FALSE(proto.has_adamw());
  EXPECT_FALSE(proto.matrices(0).has_param_dtype());
}

TEST(JobSpecProtoTest, StateDtypesRoundTripAndUnknownOnesAreNamed) {
  auto spec = ParseJobSpecJson(R"({"job_id": "s", "state": {"momentum_dtype": "int8"},
    "matrices": [{"name": "w", "shape": [4, 8]}]})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  v1::JobSpec proto = JobSpecToProto(*spec);
  EXPECT_EQ(proto.state().momentum_dtype(), v1::STATE_DTYPE_INT8);
  auto back = JobSpecFromProto(proto);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(JobSpecToJson(*back), JobSpecToJson(*spec));
  EXPECT_FALSE(
      JobSpecToProto(
          *ParseJobSpecJson(R"({"job_id": "g", "matrices": [{"name": "w", "shape": [4, 8]}]})"))
          .has_state());
  proto.mutable_state()->set_adamw_dtype(static_cast<v1::StateDType>(7));
  const absl::Status bad = JobSpecFromProto(proto).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("state.adamw_dtype: unknown state dtype 7"), std::string::npos)
      << bad;
}

TEST(JobSpecProtoTest, UnknownEnumValuesAreNamed) {
  auto spec = ParseJobSpecJson(R"({"job_id": "u1", "matrices": [{"name": "w", "shape": [4, 8]}]})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  v1::JobSpec proto = JobSpecToProto(*spec);
  proto.set_mode(static_cast<v1::JobMode>(9));
  EXPECT_EQ(JobSpecFromProto(proto).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(JobSpecFromProto(proto).status().message().find("mode"), std::string_view::npos);
  proto.set_mode(v1::JOB_MODE_APPLY);
  proto.add_groups()->set_name("muon");
  proto.mutable_matrices(0)->set_optimizer(static_cast<v1::Optimizer>(7));
  EXPECT_NE(JobSpecFromProto(proto).status().message().find("matrices[0].optimizer"),
            std::string_view::npos);
  // Apply fields on an update-mode spec are refused, not ignored.
  proto = JobSpecToProto(*spec);
  proto.add_groups()->set_name("muon");
  EXPECT_NE(JobSpecFromProto(proto).status().message().find("mode 'apply' only"),
            std::string_view::npos);
  // max_grad_norm is both modes' (update mode clips by the norm on its node).
  proto = JobSpecToProto(*spec);
  proto.set_max_grad_norm(1.0);
  auto clipped = JobSpecFromProto(proto);
  ASSERT_TRUE(clipped.ok()) << clipped.status();
  EXPECT_DOUBLE_EQ(clipped->max_grad_norm, 1.0);
  EXPECT_DOUBLE_EQ(JobSpecToProto(*clipped).max_grad_norm(), 1.0);  // and back
}

// uint64 fields that job.json holds as integers up to INT64_MAX: a larger value is refused when
// the job is created (it would be stored, then refused when the daemon reads job.json at restart).
TEST(JobSpecProtoTest, Uint64FieldsBeyondJobJsonRangeAreRefused) {
  auto spec = ParseJobSpecJson(R"({"job_id": "u2", "matrices": [{"name": "w", "shape": [4, 8]}]})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  const uint64_t too_large = uint64_t{1} << 63;
  v1::JobSpec proto = JobSpecToProto(*spec);
  proto.set_gather_budget_bytes(too_large);
  auto refused = JobSpecFromProto(proto);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("gather_budget_bytes: 9223372036854775808"),
            std::string_view::npos)
      << refused.status();
  proto.set_gather_budget_bytes(too_large - 1);  // the largest job.json holds: accepted
  auto largest = JobSpecFromProto(proto);
  ASSERT_TRUE(largest.ok()) << largest.status();
  EXPECT_TRUE(ParseJobSpecJson(JobSpecToJson(*largest)).ok());
  proto = JobSpecToProto(*spec);
  proto.set_checkpoint_every_steps(~uint64_t{0});
  EXPECT_NE(JobSpecFromProto(proto).status().message().find("checkpoint_every_steps"),
            std::string_view::npos);
}

}  // namespace
}  // namespace muond::common
