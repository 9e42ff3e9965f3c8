#include "common/job_spec.h"

#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/unit/common/job_spec_test_util.h"

namespace muond::common {
namespace {

constexpr char kMinimal[] = R"({"job_id": "j1", "matrices": [{"name": "w", "shape": [4, 8]}]})";

// kMinimal with `muon` as the muon object.
std::string WithMuon(const std::string& muon) {
  return R"({"job_id": "j1", "muon": )" + muon +
         R"(, "matrices": [{"name": "w", "shape": [4, 8]}]})";
}
// A job whose second matrix is `matrix`.
std::string WithMatrix(const std::string& matrix) {
  return R"({"job_id": "j1", "matrices": [{"name": "w", "shape": [4, 8]}, )" + matrix + "]}";
}

JobSpec ValidSpec() {
  JobSpec spec;
  spec.job_id = "job-1";
  MatrixSpec m;
  m.name = "w";
  m.shape = {128, 64};
  spec.matrices.push_back(m);
  return spec;
}

void ExpectValidateError(const JobSpec& spec, const std::string& substring);

// "step_buffers": 1 or 2 (default 2), round-tripped through job.json; anything
// else is INVALID_ARGUMENT naming the field.
TEST(JobSpecStepBuffersTest, OneOrTwoRoundTripOthersRefused) {
  auto spec = ParseJobSpecJson(kMinimal);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->step_buffers, 2);
  auto one = ParseJobSpecJson(
      R"({"job_id": "j1", "step_buffers": 1, "matrices": [{"name": "w", "shape": [4, 8]}]})");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->step_buffers, 1);
  auto again = ParseJobSpecJson(JobSpecToJson(*one));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->step_buffers, 1);
  for (int bad : {0, 3, -1}) {
    JobSpec s = ValidSpec();
    s.step_buffers = bad;
    ExpectValidateError(s, absl::StrCat("step_buffers ", bad, " is outside 1..2"));
  }
}

// "step_window_bytes": absent or 0 (the daemon's default) or at least the largest tensor's state
// (4 bytes an element in update mode, 8 per Muon element in apply mode), round-tripped through
// job.json and written only when set; smaller is INVALID_ARGUMENT naming the field and the tensor;
// negative is refused by the parser.
TEST(JobSpecStepWindowTest, AtLeastTheLargestTensorsStateRoundTrips) {
  auto spec = ParseJobSpecJson(kMinimal);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->step_window_bytes, 0u);
  EXPECT_EQ(JobSpecToJson(*spec).find("step_window_bytes"), std::string::npos);
  auto set = ParseJobSpecJson(
      R"({"job_id": "j1", "step_window_bytes": 128, "matrices": [{"name": "w", "shape": [4, 8]}]})");
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->step_window_bytes, 128u);
  auto again = ParseJobSpecJson(JobSpecToJson(*set));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->step_window_bytes, 128u);
  auto negative = ParseJobSpecJson(
      R"({"job_id": "j1", "step_window_bytes": -1, "matrices": [{"name": "w", "shape": [4, 8]}]})");
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(negative.status().message().find("step_window_bytes"), std::string::npos);
  JobSpec s = ValidSpec();  // "w" 128 x 64
  s.step_window_bytes = 128 * 64 * 4 - 1;
  ExpectValidateError(s, "step_window_bytes 32767 is smaller than tensor 'w''s state (32768 bytes");
  s.step_window_bytes = 128 * 64 * 4;
  EXPECT_TRUE(ValidateJobSpec(s).ok());
}

// "state": {"momentum_dtype", "adamw_dtype"}: each "float32" (default), "bfloat16" or "int8",
// written only when not both fp32, round-tripped; the window bytes follow the held sizes (int8:
// a byte an element plus an fp32 scale per 2048); an unknown dtype or field, a non-string, AdamW
// moments in update mode and compressed state in a transport probe are INVALID_ARGUMENT naming
// the field.
TEST(JobSpecStateTest, DtypesRoundTripAndBadOnesAreNamed) {
  auto plain = ParseJobSpecJson(kMinimal);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->state.compressed());
  EXPECT_EQ(JobSpecToJson(*plain).find("\"state\""), std::string::npos);
  auto held = ParseJobSpecJson(R"({"job_id": "j1", "mode": "apply",
    "state": {"momentum_dtype": "int8", "adamw_dtype": "bfloat16"},
    "tensors": [{"name": "w", "shape": [4, 1000]}, {"name": "b", "shape": [9],
                 "optimizer": "adamw"}], "groups": [{"name": "muon", "lr": 0.02},
                 {"name": "adamw", "lr": 0.001}]})");
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->state.momentum, StateDType::kInt8);
  EXPECT_EQ(held->state.adamw, StateDType::kBFloat16);
  auto again = ParseJobSpecJson(JobSpecToJson(*held));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->state.momentum, StateDType::kInt8);
  EXPECT_EQ(again->state.adamw, StateDType::kBFloat16);
  // Master fp32 + int8 momentum (4000 codes, 2 blocks' scales); AdamW: master + 2 x bf16.
  EXPECT_EQ(held->StateBytesOf(held->matrices[0]), 4u * 4000 + 4000 + 2 * 4);
  EXPECT_EQ(held->StateBytesOf(held->matrices[1]), 4u * 9 + 2 * 2 * 9);

  const std::string matrices = R"("matrices": [{"name": "w", "shape": [4, 8]}])";
  for (const auto& [state, field] : std::vector<std::pair<std::string, std::string>>{
           {R"({"momentum_dtype": "int4"})", "state.momentum_dtype: unknown state dtype 'int4'"},
           {R"({"momentum_dtype": 8})", "state.momentum_dtype: expected a string"},
           {R"({"momentum": "int8"})", "unknown field 'state.momentum'"},
           {R"("int8")", "state: expected an object"},
           {R"({"adamw_dtype": "int8"})", "state.adamw_dtype \"int8\": an update-mode job"}}) {
    auto bad =
        ParseJobSpecJson(absl::StrCat(R"({"job_id": "j1", "state": )", state, ", ", matrices, "}"));
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << state;
    EXPECT_NE(bad.status().message().find(field), std::string::npos) << bad.status();
  }
  JobSpec probe = ValidSpec();
  probe.transport_probe = true;
  probe.state.momentum = StateDType::kBFloat16;
  ExpectValidateError(probe, "state: a transport probe holds no optimizer state");
}

void ExpectValidateError(const JobSpec& spec, const std::string& substring) {
  const absl::Status s = ValidateJobSpec(spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << substring;
  EXPECT_NE(s.message().find(substring), std::string_view::npos)
      << "message: " << s.message() << "\nwanted: " << substring;
}

TEST(JobSpecTest, Defaults) {
  const auto spec = ParseJobSpecJson(kMinimal);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->job_id, "j1");
  EXPECT_EQ(spec->world_size, 1);
  EXPECT_EQ(spec->zero_stage, 0);
  EXPECT_EQ(spec->muon.momentum, 0.95);
  EXPECT_TRUE(spec->muon.nesterov);
  EXPECT_EQ(spec->muon.ns_method, NsMethod::kStandard);
  EXPECT_EQ(spec->muon.ns_steps, 5);
  EXPECT_EQ(spec->muon.compute_dtype, DType::kFloat32);
  EXPECT_EQ(spec->muon.scale_mode, ScaleMode::kOriginal);
  ASSERT_EQ(spec->matrices.size(), 1u);
  EXPECT_EQ(spec->matrices[0].name, "w");
  EXPECT_EQ(spec->matrices[0].shape, (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(spec->matrices[0].num_heads, 1);
  EXPECT_EQ(spec->matrices[0].dtype, DType::kFloat32);
  EXPECT_EQ(spec->matrices[0].numel(), 32);
}

TEST(JobSpecTest, EveryFieldAndRoundTrip) {
  const auto spec = ParseJobSpecJson(R"({
    "job_id": "llama.7b_run-3", "world_size": 8, "zero_stage": 3,
    "muon": {"momentum": 0.9, "nesterov": false, "ns_method": "polar_express", "ns_steps": 7,
             "compute_dtype": "bf16", "scale_mode": "match_rms_adamw"},
    "matrices": [{"name": "attn.qkv", "shape": [384, 128], "num_heads": 6, "dtype": "bfloat16"},
                 {"name": "experts", "shape": [8, 96, 64], "num_heads": 4, "dtype": "fp16"},
                 {"name": "conv", "shape": [64, 3, 3, 3], "num_heads": 2}]})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->world_size, 8);
  EXPECT_EQ(spec->zero_stage, 3);
  EXPECT_EQ(spec->muon.momentum, 0.9);
  EXPECT_FALSE(spec->muon.nesterov);
  EXPECT_EQ(spec->muon.ns_method, NsMethod::kPolarExpress);
  EXPECT_EQ(spec->muon.ns_steps, 7);
  EXPECT_EQ(spec->muon.compute_dtype, DType::kBFloat16);
  EXPECT_EQ(spec->muon.scale_mode, ScaleMode::kMatchRmsAdamw);
  ASSERT_EQ(spec->matrices.size(), 3u);
  EXPECT_EQ(spec->matrices[0].num_heads, 6);
  EXPECT_EQ(spec->matrices[0].dtype, DType::kBFloat16);
  EXPECT_EQ(spec->matrices[1].dtype, DType::kFloat16);
  EXPECT_EQ(spec->matrices[1].numel(), 8 * 96 * 64);
  EXPECT_EQ(spec->matrices[2].numel(), 64 * 27);

  const std::string json = JobSpecToJson(*spec);
  for (const char* field :
       {"\"job_id\"", "\"world_size\"", "\"zero_stage\"", "\"momentum\": 0.9,", "\"nesterov\"",
        "\"ns_method\": \"polar_express\"", "\"ns_steps\"", "\"compute_dtype\": \"bfloat16\"",
        "\"scale_mode\"", "\"num_heads\"", "\"dtype\": \"float16\""}) {
    EXPECT_NE(json.find(field), std::string::npos) << field << " in " << json;
  }
  const auto again = ParseJobSpecJson(json);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(JobSpecToJson(*again), json);
  EXPECT_EQ(again->matrices[2].shape, (std::vector<int64_t>{64, 3, 3, 3}));
  EXPECT_EQ(JobSpecToJson(*ParseJobSpecJson(JobSpecToJson(ValidSpec()))),
            JobSpecToJson(ValidSpec()));
}

// muon.fp32_iterations: read, written only when set (specs without it read as before), kept
// through JSON and the API message.
TEST(JobSpecTest, Fp32IterationsRoundTrip) {
  EXPECT_EQ(JobSpecToJson(ValidSpec()).find("fp32_iterations"), std::string::npos);
  const auto spec = ParseJobSpecJson(R"({"job_id": "j",
    "muon": {"compute_dtype": "bfloat16", "fp32_iterations": 2},
    "matrices": [{"name": "w", "shape": [8, 16]}]})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->muon.fp32_iterations, 2);
  const std::string json = JobSpecToJson(*spec);
  EXPECT_NE(json.find("\"fp32_iterations\": 2"), std::string::npos) << json;
  EXPECT_EQ(ParseJobSpecJson(json)->muon.fp32_iterations, 2);
}

TEST(JobSpecTest, EnumNames) {
  for (NsMethod m : {NsMethod::kStandard, NsMethod::kGram, NsMethod::kPolarExpress}) {
    EXPECT_EQ(*ParseNsMethod(NsMethodName(m)), m);
  }
  for (ScaleMode m : {ScaleMode::kOriginal, ScaleMode::kMatchRmsAdamw, ScaleMode::kNone}) {
    EXPECT_EQ(*ParseScaleMode(ScaleModeName(m)), m);
  }
  EXPECT_EQ(NsMethodName(NsMethod::kPolarExpress), "polar_express");
  EXPECT_EQ(ScaleModeName(ScaleMode::kMatchRmsAdamw), "match_rms_adamw");
}

TEST(JobSpecTest, MalformedJson) {
  ExpectInvalid("{", "job.json: not valid JSON");
  ExpectInvalid("[]", "job.json: expected a JSON object");
  ExpectInvalid(R"({"job_id": "j1", "matrices": [{"name": "w", "shape": [4, 8]}], "foo": 1})",
                "job.json: unknown field 'foo'");
  ExpectInvalid(WithMuon(R"({"foo": 1})"), "job.json: unknown field 'muon.foo'");
  ExpectInvalid(WithMatrix(R"({"name": "v", "shape": [4, 8], "heads": 2})"),
                "job.json: unknown field 'matrices[1].heads'");
}

TEST(JobSpecTest, WrongTypes) {
  ExpectInvalid(R"({"matrices": [{"name": "w", "shape": [4, 8]}]})", "job.json: job_id: missing");
  ExpectInvalid(R"({"job_id": 5, "matrices": [{"name": "w", "shape": [4, 8]}]})",
                "job.json: job_id: expected a string");
  ExpectInvalid(R"({"job_id": "j", "world_size": "2", "matrices": []})",
                "job.json: world_size: expected an integer");
  ExpectInvalid(R"({"job_id": "j", "world_size": 1.5, "matrices": []})",
                "job.json: world_size: expected an integer");
  ExpectInvalid(R"({"job_id": "j", "world_size": 4294967297, "matrices": []})",
                "job.json: world_size: 4294967297 is out of range");
  ExpectInvalid(R"({"job_id": "j", "zero_stage": -1e3, "matrices": []})",
                "job.json: zero_stage: expected an integer");
  ExpectInvalid(WithMuon("[]"), "job.json: muon: expected an object");
  ExpectInvalid(WithMuon(R"({"momentum": "0.9"})"), "job.json: muon.momentum: expected a number");
  ExpectInvalid(WithMuon(R"({"nesterov": 1})"), "job.json: muon.nesterov: expected true or false");
  ExpectInvalid(WithMuon(R"({"ns_method": "fast"})"),
                "job.json: muon.ns_method: unknown ns_method 'fast'");
  ExpectInvalid(WithMuon(R"({"ns_method": 1})"), "job.json: muon.ns_method: expected a string");
  ExpectInvalid(WithMuon(R"({"ns_steps": 2.0})"), "job.json: muon.ns_steps: expected an integer");
  ExpectInvalid(WithMuon(R"({"fp32_iterations": "2"})"),
                "job.json: muon.fp32_iterations: expected an integer");
  ExpectInvalid(WithMuon(R"({"compute_dtype": "int8"})"),
                "job.json: muon.compute_dtype: unknown dtype 'int8'");
  ExpectInvalid(WithMuon(R"({"scale_mode": "max"})"),
                "job.json: muon.scale_mode: unknown scale_mode 'max'");
  ExpectInvalid(R"({"job_id": "j"})", "job.json: matrices: missing");
  ExpectInvalid(R"({"job_id": "j", "matrices": {}})", "job.json: matrices: expected an array");
  ExpectInvalid(WithMatrix("7"), "job.json: matrices[1]: expected an object");
  ExpectInvalid(WithMatrix(R"({"shape": [4, 4]})"), "job.json: matrices[1].name: missing");
  ExpectInvalid(WithMatrix(R"({"name": ["v"], "shape": [4, 4]})"),
                "job.json: matrices[1].name: expected a string");
  ExpectInvalid(WithMatrix(R"({"name": "v"})"), "job.json: matrices[1].shape: missing");
  for (const char* shape :
       {"[4, -1]", "[4, 0]", "[4, 2.0]", "\"4x4\"", "[4, \"4\"]", "[4, 18446744073709551615]"}) {
    ExpectInvalid(WithMatrix(std::string(R"({"name": "v", "shape": )") + shape + "}"),
                  "job.json: matrices[1].shape: expected an array of positive integers");
  }
  ExpectInvalid(WithMatrix(R"({"name": "v", "shape": [4, 4], "num_heads": "2"})"),
                "job.json: matrices[1].num_heads: expected an integer");
  ExpectInvalid(WithMatrix(R"({"name": "v", "shape": [4, 4], "dtype": "fp8"})"),
                "job.json: matrices[1].dtype: unknown dtype 'fp8'");
}

TEST(JobSpecTest, ParseRunsValidation) {
  ExpectInvalid(WithMatrix(R"({"name": "attn.qkv", "shape": [128, 64], "num_heads": 5})"),
                "job.json: matrix 'attn.qkv': num_heads 5 does not divide rows 128");
  ExpectInvalid(WithMuon(R"({"momentum": 1})"),
                "job.json: muon.momentum 1 must be finite and in [0, 1)");
  ExpectInvalid(R"({"job_id": "j", "matrices": []})",
                "job.json: matrices: at least one matrix is required");
}

TEST(JobSpecTest, ValidateAcceptsBoundaries) {
  JobSpec spec = ValidSpec();
  spec.muon.momentum = 0.0;
  spec.muon.ns_steps = kMaxNsSteps;
  spec.world_size = kMaxWorldSize;
  spec.zero_stage = 1;
  spec.job_id = std::string(kMaxJobIdLength, 'a');
  spec.matrices[0].shape = {int64_t{1} << 17, int64_t{1} << 17};  // exactly kMaxMatrixElements
  spec.matrices[0].num_heads = 1 << 17;
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
}

TEST(JobSpecTest, ValidateJobFields) {
  JobSpec spec = ValidSpec();
  spec.job_id = "";
  ExpectValidateError(spec, "job_id is empty");
  spec.job_id = std::string(kMaxJobIdLength + 1, 'a');
  ExpectValidateError(spec, "... (129 bytes) is longer than 128 bytes");
  spec.job_id = "a b";
  ExpectValidateError(spec, "job_id 'a b' must match [A-Za-z0-9][A-Za-z0-9._-]{0,127}");
  spec.job_id = "../etc";
  ExpectValidateError(spec, "job_id '../etc' must match");
  // Names that would be the state directory itself, its parent, or hidden/daemon-made entries.
  for (const char* id : {".", "..", ".deleted-x", ".creating", "-x", "_x"}) {
    spec.job_id = id;
    ExpectValidateError(spec, "must match");
  }
  spec.job_id = std::string("a\0b", 3);
  ExpectValidateError(spec, "job_id 'a\\x00b' must match");

  spec = ValidSpec();
  spec.world_size = 0;
  ExpectValidateError(spec, "world_size 0 is outside 1..65536");
  spec.world_size = kMaxWorldSize + 1;
  spec.zero_stage = 1;
  ExpectValidateError(spec, "world_size 65537 is outside 1..65536");
  spec.world_size = 2;
  spec.zero_stage = 4;
  ExpectValidateError(spec, "zero_stage 4 is outside 0..3");
  spec.zero_stage = -1;
  ExpectValidateError(spec, "zero_stage -1 is outside 0..3");
  spec.zero_stage = 0;
  ExpectValidateError(spec,
                      "zero_stage 0 (whole matrices) requires world_size 1 or an explicit layout, "
                      "got world_size 2");

  spec = ValidSpec();
  for (double bad : {1.0, -0.1, std::nan(""), std::numeric_limits<double>::infinity()}) {
    spec.muon.momentum = bad;
    ExpectValidateError(spec, "must be finite and in [0, 1)");
  }
  spec = ValidSpec();
  spec.muon.ns_steps = 0;
  ExpectValidateError(spec, "muon.ns_steps 0 is outside 1..100");
  spec.muon.ns_steps = kMaxNsSteps + 1;
  ExpectValidateError(spec, "muon.ns_steps 101 is outside 1..100");
  spec = ValidSpec();
  spec.muon.fp32_iterations = -1;
  ExpectValidateError(spec, "muon.fp32_iterations -1 is outside 0..ns_steps (5)");
  spec.muon.fp32_iterations = 6;
  ExpectValidateError(spec, "muon.fp32_iterations 6 is outside 0..ns_steps (5)");
  spec = ValidSpec();
  spec.muon.ns_method = static_cast<NsMethod>(9);
  ExpectValidateError(spec, "out of range");
}

TEST(JobSpecTest, ValidateMatrices) {
  JobSpec spec = ValidSpec();
  spec.matrices.clear();
  ExpectValidateError(spec, "matrices: at least one matrix is required");

  spec = ValidSpec();
  spec.matrices.push_back(spec.matrices[0]);
  ExpectValidateError(spec, "matrix 'w' appears twice: matrices[0] and matrices[1]");
  spec.matrices[1].name = "";
  ExpectValidateError(spec, "matrices[1].name is empty");
  spec.matrices[1].name = "bad\xFF";
  ExpectValidateError(spec, "matrices[1].name 'bad\\xff' is not UTF-8");
  spec.matrices[1].name = "a\nb";
  ExpectValidateError(spec, "matrices[1].name 'a\\x0ab' holds a control character");
  spec.matrices[1].name = std::string(257, 'n');
  ExpectValidateError(spec, "is longer than 256 bytes");

  spec = ValidSpec();
  MatrixSpec& m = spec.matrices[0];
  m.shape = {16};
  ExpectValidateError(spec, "matrix 'w': shape [16] has 1 dimensions; expected 2 to 4");
  m.shape = {2, 2, 2, 2, 2};
  ExpectValidateError(spec, "has 5 dimensions");
  m.shape = {4, 0};
  ExpectValidateError(spec, "matrix 'w': shape [4, 0] has a non-positive dimension");
  m.shape = {4, -4};
  ExpectValidateError(spec, "non-positive dimension");
  m.shape = {int64_t{1} << 17, int64_t{1} << 17, 2};
  ExpectValidateError(spec, "matrix 'w': shape [131072, 131072, 2] has more than 17179869184");
  m.shape = {int64_t{1} << 40, int64_t{1} << 40};  // would overflow int64 if multiplied naively
  ExpectValidateError(spec, "has more than 17179869184 elements");
  EXPECT_EQ(m.numel(), std::numeric_limits<int64_t>::max());  // saturates

  m.shape = {128, 64};
  m.num_heads = 0;
  ExpectValidateError(spec, "matrix 'w': num_heads 0 is < 1");
  m.num_heads = -2;
  ExpectValidateError(spec, "num_heads -2 is < 1");
  // Rows: shape[0] for 2-D and 4-D, shape[1] for [E, r, c].
  m.num_heads = 3;
  ExpectValidateError(spec, "matrix 'w': num_heads 3 does not divide rows 128");
  m.shape = {6, 96, 64};
  EXPECT_TRUE(ValidateJobSpec(spec).ok());  // 3 divides r = 96 (E = 6 is not the rows)
  m.shape = {9, 64, 96};
  ExpectValidateError(spec, "num_heads 3 does not divide rows 64");
  m.shape = {64, 3, 3, 3};
  ExpectValidateError(spec, "num_heads 3 does not divide rows 64");
  m.shape = {96, 4, 3, 3};
  EXPECT_TRUE(ValidateJobSpec(spec).ok());
}

}  // namespace
}  // namespace muond::common
