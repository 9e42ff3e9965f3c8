// The client library in apply mode (DESIGN.md 4b): SetHyper and its checks, the initial
// parameters (InitParamsTensors, InitParamsBuffer, the shared-memory zero-copy path), steps that
// return new parameters (StepTensors, StepBuffer, StepInPlace), ExportParams, and the C ABI
// (muond_session_set_hyper, muond_session_set_absent, muond_init_params*, muond_session_param_byte_offset, muond_export).
// Expected parameters: the float64 AdamW reference of apply_test_model.h.
//
// ClientApplyHyperTest needs no daemon (ResolveStepHyper on a parsed spec).
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/muond_client.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "common/safetensors.h"
#include "common/shm_protocol.h"
#include "gtest/gtest.h"
#include "tests/integration/apply_test_model.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"
#include "tests/integration/reference_data.h"

namespace muond::integration {
namespace {

namespace am = apply_model;
using common::DType;

common::JobSpec ModelSpec(const std::string& id, int world, int stage, DType param_w,
                          DType param_b) {
  auto spec = common::ParseJobSpecJson(am::JobJson(id, world, stage, param_w, param_b));
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? *spec : common::JobSpec{};
}

// ---- ResolveStepHyper, without a daemon.

TEST(ClientApplyHyperTest, ResolvesEveryGroupWithDefaultWeightDecay) {
  const common::JobSpec spec = ModelSpec("hyper", 1, 0, DType::kFloat32, DType::kFloat32);
  ASSERT_EQ(spec.groups.size(), 2u);
  client::StepHyper h;
  h.lr = {{"no_decay", 0.5}, {"decay", 0.25}};  // any order
  h.weight_decay = {{"no_decay", 0.125}};
  h.grad_divisor = 64;
  auto v = client::ResolveStepHyper(spec, h);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->lr, (std::vector<double>{0.25, 0.5}));              // spec.groups order
  EXPECT_EQ(v->weight_decay, (std::vector<double>{0.05, 0.125}));  // "decay" keeps its default
  EXPECT_EQ(v->grad_divisor, 64);
}

TEST(ClientApplyHyperTest, RefusalsNameTheGroup) {
  const common::JobSpec spec = ModelSpec("hyper", 1, 0, DType::kFloat32, DType::kFloat32);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    client::StepHyper hyper;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{{}, {}, 1}, "'decay'"},
      {{{{"decay", 0.1}}, {}, 1}, "'no_decay'"},
      {{{{"decay", 0.1}, {"no_decay", 0.1}, {"bogus", 0.1}}, {}, 1}, "'bogus'"},
      {{{{"decay", 0.1}, {"decay", 0.2}, {"no_decay", 0.1}}, {}, 1}, "twice"},
      {{{{"decay", -0.1}, {"no_decay", 0.1}}, {}, 1}, "'decay'"},
      {{{{"decay", nan}, {"no_decay", 0.1}}, {}, 1}, "'decay'"},
      {{{{"decay", 0.1}, {"no_decay", inf}}, {}, 1}, "'no_decay'"},
      {{{{"decay", 0.1}, {"no_decay", 0.1}}, {{"no_decay", -1}}, 1}, "'no_decay'"},
      {{{{"decay", 0.1}, {"no_decay", 0.1}}, {{"nope", 0}}, 1}, "'nope'"},
      {{{{"decay", 0.1}, {"no_decay", 0.1}}, {}, 0}, "divisor"},
      {{{{"decay", 0.1}, {"no_decay", 0.1}}, {}, -2}, "divisor"},
      {{{{"decay", 0.1}, {"no_decay", 0.1}}, {}, inf}, "divisor"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    auto v = client::ResolveStepHyper(spec, cases[i].hyper);
    ASSERT_FALSE(v.ok());
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
    EXPECT_NE(v.status().message().find(cases[i].want), std::string::npos) << v.status();
  }
  // An update-mode job takes no hyperparameters.
  common::JobSpec update;
  update.job_id = "upd";
  update.matrices.push_back({"w", {4, 4}});
  auto v = client::ResolveStepHyper(update, {{{"muon", 0.1}}, {}, 1});
  EXPECT_EQ(v.status().code(), absl::StatusCode::kFailedPrecondition) << v.status();
}

// ---- Against the daemon.

class ClientApplyTest : public DaemonSuite {
 protected:
  // Creates the model's job (spec_, token_).
  void CreateJob(const std::string& prefix, int world, int stage, DType param_w, DType param_b) {
    spec_ = ModelSpec(NewJobId(prefix), world, stage, param_w, param_b);
    auto token = client().CreateJob(spec_);
    ASSERT_TRUE(token.ok()) << token.status();
    token_ = *token;
  }

  std::unique_ptr<client::RankSession> Attach(int rank, client::Transport transport,
                                              client::Client* c = nullptr) {
    auto s = (c != nullptr ? *c : client()).Attach(spec_.job_id, rank, token_, false, transport);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  // The model's whole-tensor values of step t's gradients (float32).
  static std::vector<client::NamedTensor> GradTensors(int t) {
    return {MakeTensor("w", am::kShapes[0], am::Gradient(0, t)),
            MakeTensor("b", am::kShapes[1], am::Gradient(1, t))};
  }

  // Rank r's flat buffer of whole-tensor values `whole` in `dtype`, padding zero.
  std::string FlatBuffer(int r, const std::vector<std::vector<float>>& whole, DType dtype) const {
    std::vector<float> flat(common::RankBufferElements(spec_, r), 0.0f);
    for (const common::ShardSpan& s : common::RankSpans(spec_, r)) {
      for (uint64_t k = 0; k < s.length; ++k)
        flat[s.rank_offset + k] = whole[s.matrix][s.offset + k];
    }
    std::string bytes(flat.size() * common::DTypeSize(dtype), '\0');
    common::FromFloat32(flat.data(), flat.size(), dtype, bytes.data());
    return bytes;
  }

  // A rank's flat buffer of new parameters against the masters of `ref` (padding zero).
  ::testing::AssertionResult FlatParamsMatch(int r, const std::string& bytes, DType dtype,
                                             const am::Reference& ref) const {
    const std::vector<float> flat = ToFloats(dtype, bytes);
    uint64_t owned = 0;
    for (const common::ShardSpan& s : common::RankSpans(spec_, r)) {
      const std::vector<float> part(flat.begin() + s.rank_offset,
                                    flat.begin() + s.rank_offset + s.length);
      auto near = am::ParamsNear(part, ref.master(s.matrix), dtype, s.offset);
      if (!near) return near << " (tensor " << am::kNames[s.matrix] << ", rank " << r << ")";
      owned += s.length;
    }
    for (uint64_t i = owned; i < flat.size(); ++i) {
      if (flat[i] != 0.0f) return ::testing::AssertionFailure() << "padding " << i << " not zero";
    }
    return ::testing::AssertionSuccess();
  }

  static constexpr int kSteps = 3;

  // Rank r of a world-2 job: uploads its flat buffer of the initial weights (rank 0 in float32,
  // rank 1 in the param dtype bfloat16), waits until every rank's weights are in, then steps
  // 0..kSteps-1 with StepBuffer; (*outs)[t] gets step t's parameters.
  absl::Status RunRank(client::Client& c, int r, client::Transport transport,
                       const std::vector<std::vector<float>>& w0, std::vector<std::string>* outs) {
    auto s = c.Attach(spec_.job_id, r, token_, false, transport);
    if (!s.ok()) return s.status();
    const bool f32 = r == 0;
    const std::string init = FlatBuffer(r, w0, f32 ? DType::kFloat32 : DType::kBFloat16);
    absl::Status st = (*s)->InitParamsBuffer(init.data(), f32);
    if (!st.ok()) return st;
    if (!WaitForJob(c, spec_.job_id, token_,
                    [](const v1::JobStatus& j) { return j.weights_complete(); })) {
      return absl::DeadlineExceededError("the other rank's weights never came");
    }
    for (int t = 0; t < kSteps; ++t) {
      st = (*s)->SetHyper(am::ClientHyper(t));
      if (!st.ok()) return st;
      const std::string grads =
          FlatBuffer(r, {am::Gradient(0, t), am::Gradient(1, t)}, DType::kFloat32);
      (*outs)[t].assign((*s)->buffer_elements() * 2, '\x7f');  // bfloat16; padding too
      st = (*s)->StepBuffer(t, grads.data(), (*outs)[t].data()).status();
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }

  void ExpectExport(DType dtype) {
    int64_t step = -1;
    auto tensors = client().ExportParams(spec_.job_id, token_, dtype, &step);
    ASSERT_TRUE(tensors.ok()) << tensors.status();
    ASSERT_EQ(tensors->size(), static_cast<size_t>(am::kTensors));
    for (int m = 0; m < am::kTensors; ++m) {
      const client::NamedTensor& t = (*tensors)[m];
      EXPECT_EQ(t.name, am::kNames[m]);
      EXPECT_EQ(t.shape, am::kShapes[m]);
      EXPECT_EQ(t.dtype, dtype);
      EXPECT_TRUE(am::ParamsNear(ToFloats(t), ref_.master(m), dtype)) << t.name;
    }
    auto status = client().GetJob(spec_.job_id, token_);
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_EQ(step, status->next_step());
  }

  common::JobSpec spec_;
  std::string token_;
  am::Reference ref_;
};

TEST_F(ClientApplyTest, RefusedWithoutHyperOrInTheWrongModeOrTransport) {
  ASSERT_NO_FATAL_FAILURE(CreateJob("cl-apply-refuse", 1, 0, DType::kFloat32, DType::kFloat32));
  auto s = Attach(0, client::Transport::kGrpc);
  ASSERT_NE(s, nullptr);
  EXPECT_TRUE(s->apply());
  auto done = s->StepTensors(0, GradTensors(0));
  EXPECT_EQ(done.status().code(), absl::StatusCode::kFailedPrecondition) << done.status();
  EXPECT_NE(done.status().message().find("lr"), std::string::npos) << done.status();
  EXPECT_EQ(s->InitParamsView().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s->InitParamsInPlace().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s->ParamByteOffset(0).status().code(), absl::StatusCode::kFailedPrecondition);
  // Whole tensors of the wrong dtype, shape or name.
  std::vector<client::NamedTensor> params = {
      MakeTensor("w", {4, 8}, am::Initial(0), DType::kFloat16),
      MakeTensor("b", {6}, am::Initial(1))};
  absl::Status st = s->InitParamsTensors(params);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("'w'"), std::string::npos) << st;
  params[0] = MakeTensor("w", {8, 4}, am::Initial(0));
  st = s->InitParamsTensors(params);
  EXPECT_NE(st.message().find("[8, 4]"), std::string::npos) << st;
  // Spans that do not cover the rank's part.
  const std::vector<float> w0 = am::Initial(0);
  st = s->InitParams({{0, 0, w0.data(), 32}}, /*float32=*/true);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("'b'"), std::string::npos) << st;
  // Nothing of that reached the daemon.
  auto status = client().GetJob(spec_.job_id, token_);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_FALSE(status->weights_complete());
  EXPECT_EQ(status->next_step(), 0);

  // An update-mode job.
  common::JobSpec update =
      WholeMatrixJob(NewJobId("cl-upd"), "wide_std", {CaseMatrix("wide_std", "w")});
  auto token = client().CreateJob(update);
  ASSERT_TRUE(token.ok()) << token.status();
  auto u = client().Attach(update.job_id, 0, *token, false, client::Transport::kAuto);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_FALSE((*u)->apply());
  EXPECT_EQ((*u)->SetHyper(am::ClientHyper(0)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*u)->InitParamsTensors({}).code(), absl::StatusCode::kFailedPrecondition);
  auto exported = client().ExportParams(update.job_id, *token);
  EXPECT_EQ(exported.status().code(), absl::StatusCode::kFailedPrecondition) << exported.status();
  // Its steps are as before.
  auto out = (*u)->StepTensors(0, {RefGrad("wide_std", 0, "w")});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(MatchesReferenceUpdate(ToFloats((*out)[0]), "wide_std", 0, 1e-4));
}

TEST_F(ClientApplyTest, WholeTensorsOverGrpcAndShm) {
  for (client::Transport transport : {client::Transport::kGrpc, client::Transport::kShm}) {
    SCOPED_TRACE(transport == client::Transport::kShm ? "shm" : "grpc");
    ref_ = am::Reference();
    ASSERT_NO_FATAL_FAILURE(CreateJob("cl-apply-w1", 1, 0, DType::kFloat32, DType::kBFloat16));
    auto s = Attach(0, transport);
    ASSERT_NE(s, nullptr);
    ASSERT_EQ(s->transport(), transport);
    // "b" in float32 while its param dtype is bfloat16: the upload goes as float32.
    absl::Status st = s->InitParamsTensors(
        {MakeTensor("b", {6}, am::Initial(1)), MakeTensor("w", {4, 8}, am::Initial(0))});
    ASSERT_TRUE(st.ok()) << st;
    for (int t = 0; t < 3; ++t) {
      SCOPED_TRACE(t);
      ASSERT_TRUE(s->SetHyper(am::ClientHyper(t)).ok());
      ref_.Step(t);
      client::StepResult result;
      auto out = s->StepTensors(t, GradTensors(t), &result);
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(result.step, t);
      ASSERT_EQ(out->size(), 2u);
      for (int m = 0; m < am::kTensors; ++m) {
        EXPECT_EQ((*out)[m].name, am::kNames[m]);
        EXPECT_EQ((*out)[m].dtype, spec_.matrices[m].param_dtype);
        EXPECT_EQ((*out)[m].shape, am::kShapes[m]);
        EXPECT_TRUE(am::ParamsNear(ToFloats((*out)[m]), ref_.master(m), (*out)[m].dtype));
      }
    }
    ExpectExport(DType::kFloat32);
    ExpectExport(DType::kBFloat16);
    ExpectExport(DType::kFloat16);
  }
}

TEST_F(ClientApplyTest, FlatBuffersWorld2Stage1OverGrpcAndShm) {
  for (client::Transport transport : {client::Transport::kGrpc, client::Transport::kShm}) {
    SCOPED_TRACE(transport == client::Transport::kShm ? "shm" : "grpc");
    ref_ = am::Reference();
    ASSERT_NO_FATAL_FAILURE(CreateJob("cl-apply-w2", 2, 1, DType::kBFloat16, DType::kBFloat16));
    const std::vector<std::vector<float>> w0 = {am::Initial(0), am::Initial(1)};
    std::vector<std::vector<std::string>> outs(2, std::vector<std::string>(kSteps));
    std::vector<absl::Status> errors(2);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.emplace_back([&, r] {
        auto c = client::Client::Connect(address());
        if (!c.ok()) return void(errors[r] = c.status());
        errors[r] = RunRank(**c, r, transport, w0, &outs[r]);
        // A failed rank deletes the job, which ends a step the other rank waits in.
        if (!errors[r].ok()) (void)(*c)->DeleteJob(spec_.job_id, token_);
      });
    }
    for (std::thread& th : ranks) th.join();
    ASSERT_TRUE(errors[0].ok()) << errors[0];
    ASSERT_TRUE(errors[1].ok()) << errors[1];
    for (int t = 0; t < kSteps; ++t) {
      ref_.Step(t);
      for (int r = 0; r < 2; ++r) {
        EXPECT_TRUE(FlatParamsMatch(r, outs[r][t], DType::kBFloat16, ref_)) << "step " << t;
      }
    }
    ExpectExport(DType::kFloat32);
  }
}

TEST_F(ClientApplyTest, ZeroCopySharedMemory) {
  ASSERT_NO_FATAL_FAILURE(CreateJob("cl-apply-zc", 1, 0, DType::kFloat32, DType::kBFloat16));
  auto s = Attach(0, client::Transport::kShm);
  ASSERT_NE(s, nullptr);
  ASSERT_EQ(s->spans().size(), 2u);
  auto init = s->InitParamsView();
  ASSERT_TRUE(init.ok()) << init.status();
  std::vector<uint64_t> param_at(2);
  for (size_t i = 0; i < 2; ++i) {
    auto at = s->ParamByteOffset(i);
    ASSERT_TRUE(at.ok()) << at.status();
    param_at[i] = *at;
    const uint32_t m = s->spans()[i].matrix;
    const std::vector<float> w0 = am::Initial(m);
    ASSERT_LE(*at + w0.size() * common::DTypeSize(spec_.matrices[m].param_dtype), init->size);
    common::FromFloat32(w0.data(), w0.size(), spec_.matrices[m].param_dtype, init->data + *at);
  }
  EXPECT_EQ(s->ParamByteOffset(2).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(s->InitParamsInPlace().ok());
  auto hyper_at = s->HyperByteOffset();
  ASSERT_TRUE(hyper_at.ok()) << hyper_at.status();
  for (int t = 0; t < 2; ++t) {
    SCOPED_TRACE(t);
    ASSERT_TRUE(s->SetHyper(am::ClientHyper(t)).ok());
    ref_.Step(t);
    auto in = s->GradientView(t);
    ASSERT_TRUE(in.ok()) << in.status();
    for (const common::ShardSpan& span : s->spans()) {  // float32 gradients, flat layout
      const std::vector<float> g = am::Gradient(span.matrix, t);
      std::memcpy(in->data + span.rank_offset * 4, g.data() + span.offset, span.length * 4);
    }
    auto done = s->StepInPlace(t);
    ASSERT_TRUE(done.ok()) << done.status();
    // The step's hyperparameters are where the protocol says, as float64.
    // The model has a group per tensor: lr, weight decay, then the divisor and the global clip
    // (mode 0: none, sum 0).
    double block[2 * am::kTensors + 3];
    std::memcpy(block, in->data + *hyper_at, sizeof(block));
    // Then the presence mask: every tensor has a gradient.
    for (int m = 0; m < am::kTensors; ++m) {
      EXPECT_EQ(in->data[*hyper_at + sizeof(block) + m], 0) << am::kNames[m];
    }
    EXPECT_EQ(sizeof(block) + am::kTensors,
              common::shm::HyperBytes(spec_.groups.size(), spec_.matrices.size()));
    const am::Hyper h = am::HyperOf(t);
    EXPECT_EQ(block[0], h.lr[0]);
    EXPECT_EQ(block[1], h.lr[1]);
    EXPECT_EQ(block[2], h.wd[0]);
    EXPECT_EQ(block[3], h.wd[1]);
    EXPECT_EQ(block[4], h.divisor);
    EXPECT_EQ(block[5], 0.0);
    EXPECT_EQ(block[6], 0.0);
    auto out = s->UpdateView(t);
    ASSERT_TRUE(out.ok()) << out.status();
    for (size_t i = 0; i < 2; ++i) {
      const uint32_t m = s->spans()[i].matrix;
      const DType dtype = spec_.matrices[m].param_dtype;
      const size_t bytes = am::Numel(m) * common::DTypeSize(dtype);
      EXPECT_TRUE(am::ParamsNear(ToFloats(dtype, std::string(out->data + param_at[i], bytes)),
                                 ref_.master(m), dtype))
          << am::kNames[m];
    }
  }
}

TEST_F(ClientApplyTest, CAbi) {
  ASSERT_NO_FATAL_FAILURE(CreateJob("cl-apply-c", 1, 1, DType::kBFloat16, DType::kBFloat16));
  muond_client* c = nullptr;
  ASSERT_EQ(muond_connect(address().c_str(), &c), 0) << muond_last_error();
  std::unique_ptr<muond_client, void (*)(muond_client*)> client_owner(c, muond_client_free);
  muond_session* s = nullptr;
  ASSERT_EQ(muond_attach(c, spec_.job_id.c_str(), 0, token_.c_str(), 0, "grpc", &s), 0)
      << muond_last_error();
  std::unique_ptr<muond_session, void (*)(muond_session*)> session_owner(s, muond_session_free);
  uint64_t at = 0;
  EXPECT_EQ(muond_session_param_byte_offset(s, 0, &at), 9) << muond_last_error();
  void* view = nullptr;
  size_t size = 0;
  EXPECT_EQ(muond_session_init_view(s, &view, &size), 9);
  // A group without an lr, then one unknown: named in the error.
  const char* one[] = {"decay"};
  const double lr_one[] = {0.01};
  EXPECT_EQ(muond_session_set_hyper(s, one, lr_one, nullptr, 1, 1.0), 3);
  EXPECT_NE(std::string(muond_last_error()).find("'no_decay'"), std::string::npos)
      << muond_last_error();
  const char* three[] = {"decay", "no_decay", "bogus"};
  const double lr_three[] = {0.01, 0.01, 0.01};
  EXPECT_EQ(muond_session_set_hyper(s, three, lr_three, nullptr, 3, 1.0), 3);
  EXPECT_NE(std::string(muond_last_error()).find("'bogus'"), std::string::npos);
  // The presence mask: an index past the tensors, NULL with a count; then none absent.
  const uint32_t past[] = {2};
  EXPECT_EQ(muond_session_set_absent(s, past, 1), 3);
  EXPECT_NE(std::string(muond_last_error()).find("absent tensor index 2"), std::string::npos)
      << muond_last_error();
  EXPECT_NE(muond_session_set_absent(s, nullptr, 1), 0);
  EXPECT_EQ(muond_session_set_absent(s, nullptr, 0), 0) << muond_last_error();
  // A step before any hyperparameters: FAILED_PRECONDITION.
  const uint64_t n = muond_session_buffer_elements(s);
  const std::string grads0 =
      FlatBuffer(0, {am::Gradient(0, 0), am::Gradient(1, 0)}, DType::kFloat32);
  std::string out(n * 2, '\0');
  EXPECT_EQ(muond_step_buffer(s, 0, grads0.data(), out.data()), 9);
  // World size 1 with stage 1: one partition holding everything.
  const std::string init = FlatBuffer(0, {am::Initial(0), am::Initial(1)}, DType::kFloat32);
  ASSERT_EQ(muond_init_params_buffer(s, init.data(), 1), 0) << muond_last_error();
  for (int t = 0; t < 2; ++t) {
    SCOPED_TRACE(t);
    const am::Hyper h = am::HyperOf(t);
    const char* groups[] = {am::kGroups[1], am::kGroups[0]};  // any order
    const double lr[] = {h.lr[1], h.lr[0]};
    const double wd[] = {h.wd[1], h.wd[0]};
    ASSERT_EQ(muond_session_set_hyper(s, groups, lr, wd, 2, h.divisor), 0) << muond_last_error();
    ref_.Step(t);
    const std::string grads =
        FlatBuffer(0, {am::Gradient(0, t), am::Gradient(1, t)}, DType::kFloat32);
    ASSERT_EQ(muond_step_buffer(s, t, grads.data(), out.data()), 0) << muond_last_error();
    EXPECT_TRUE(FlatParamsMatch(0, out, DType::kBFloat16, ref_));
  }
  TempDir dir;
  const std::string path = dir.File("model.safetensors");
  EXPECT_EQ(muond_export(c, spec_.job_id.c_str(), token_.c_str(), "int8", path.c_str()), 3);
  ASSERT_EQ(muond_export(c, spec_.job_id.c_str(), token_.c_str(), "bfloat16", path.c_str()), 0)
      << muond_last_error();
  auto file = common::SafetensorsFile::ReadFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  for (int m = 0; m < am::kTensors; ++m) {
    const common::TensorInfo* t = file->Find(am::kNames[m]);
    ASSERT_NE(t, nullptr) << am::kNames[m];
    EXPECT_EQ(t->dtype, DType::kBFloat16);
    EXPECT_EQ(t->shape, am::kShapes[m]);
    EXPECT_TRUE(am::ParamsNear(ToFloats(t->dtype, std::string(file->Data(*t))), ref_.master(m),
                               DType::kBFloat16));
  }
  EXPECT_EQ(file->metadata().at("step"), "2");
  EXPECT_EQ(file->metadata().at("job"), spec_.job_id);
}

}  // namespace
}  // namespace muond::integration
