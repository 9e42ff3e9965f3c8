// The presence mask of apply mode (DESIGN.md 4b): a tensor with no gradient on any rank in a step
// is skipped as torch.optim.AdamW skips a parameter whose grad is None (master, moments and step
// count unchanged, its parameters returned as they were), over gRPC (StepBegin.absent_tensors)
// and shared memory (a byte per tensor after the hyperparameters). Ranks that disagree on the
// mask are refused like ranks that disagree on the lr; a malformed mask from a raw peer is refused
// naming the tensor, and nothing changes.
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/shm_channel.h"
#include "common/dtype.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "common/shm_protocol.h"
#include "gtest/gtest.h"
#include "tests/integration/apply_test_model.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/raw_step.h"
#include "tests/integration/reference_data.h"

namespace muond::integration {
namespace {

namespace am = apply_model;
using common::DType;

class ApplyAbsentTest : public DaemonSuite {
 protected:
  void CreateJob(const std::string& prefix, int world, int stage) {
    auto spec = common::ParseJobSpecJson(
        am::JobJson(NewJobId(prefix), world, stage, DType::kFloat32, DType::kFloat32));
    ASSERT_TRUE(spec.ok()) << spec.status();
    spec_ = *spec;
    auto token = client().CreateJob(spec_);
    ASSERT_TRUE(token.ok()) << token.status();
    token_ = *token;
  }

  std::unique_ptr<client::RankSession> Attach(int rank, client::Transport transport,
                                              client::Client& c) {
    auto s = c.Attach(spec_.job_id, rank, token_, false, transport);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  static std::vector<client::NamedTensor> Whole(const std::vector<float>& w,
                                                const std::vector<float>& b) {
    return {MakeTensor("w", am::kShapes[0], w), MakeTensor("b", am::kShapes[1], b)};
  }

  // The masters (float32 export) against the reference's.
  void ExpectMasters(const am::Reference& ref) {
    auto tensors = client().ExportParams(spec_.job_id, token_, DType::kFloat32);
    ASSERT_TRUE(tensors.ok()) << tensors.status();
    for (int m = 0; m < am::kTensors; ++m) {
      EXPECT_TRUE(am::ParamsNear(ToFloats((*tensors)[m]), ref.master(m), DType::kFloat32))
          << am::kNames[m];
    }
  }

  // Rank r's spans of whole float32 tensors.
  std::vector<client::GradientSpan> Spans(int r, const std::vector<std::vector<float>>& whole) {
    std::vector<client::GradientSpan> out;
    for (const common::ShardSpan& sp : common::RankSpans(spec_, r)) {
      out.push_back({sp.matrix, sp.offset, whole[sp.matrix].data() + sp.offset, sp.length});
    }
    return out;
  }

  // An update-mode job with rank 0 attached over gRPC.
  void AttachUpdateModeJob(const std::string& prefix, std::string* token,
                           std::unique_ptr<client::RankSession>* session) {
    const common::JobSpec update =
        WholeMatrixJob(NewJobId(prefix), "wide_std", {CaseMatrix("wide_std", "w")});
    auto t = client().CreateJob(update);
    ASSERT_TRUE(t.ok()) << t.status();
    *token = *t;
    auto u = client().Attach(update.job_id, 0, *token, false, client::Transport::kGrpc);
    ASSERT_TRUE(u.ok()) << u.status();
    *session = *std::move(u);
  }

  int64_t NextStep() {
    auto st = client().GetJob(spec_.job_id, token_);
    EXPECT_TRUE(st.ok()) << st.status();
    return st.ok() ? st->next_step() : -1;
  }

  common::JobSpec spec_;
  std::string token_;
};

// Steps 0..3 with masks {}, {b}, {w}, {}: every step's parameters are the reference's, whose
// skipped tensors keep their state and step count (the bias correction of the next step shows
// it), and a skipped tensor comes back bit for bit as it was.
TEST_F(ApplyAbsentTest, SkippedTensorsKeepStateStepCountAndParameters) {
  for (client::Transport transport : {client::Transport::kGrpc, client::Transport::kShm}) {
    SCOPED_TRACE(transport == client::Transport::kShm ? "shm" : "grpc");
    ASSERT_NO_FATAL_FAILURE(CreateJob("absent", 1, 0));
    auto s = Attach(0, transport, client());
    ASSERT_NE(s, nullptr);
    ASSERT_TRUE(s->InitParamsTensors(Whole(am::Initial(0), am::Initial(1))).ok());
    am::Reference ref;
    const std::vector<std::vector<uint32_t>> masks = {{}, {1}, {0}, {}};
    std::vector<std::vector<float>> last = {am::Initial(0), am::Initial(1)};
    for (int t = 0; t < static_cast<int>(masks.size()); ++t) {
      SCOPED_TRACE(t);
      ASSERT_TRUE(s->SetHyper(am::ClientHyper(t)).ok());
      ASSERT_TRUE(s->SetAbsent(masks[t]).ok());
      std::vector<bool> absent(am::kTensors, false);
      for (uint32_t m : masks[t]) absent[m] = true;
      ref.Step(t, absent);
      // An absent tensor's gradient is still sent (zeros here) and not used.
      std::vector<float> gw = am::Gradient(0, t), gb = am::Gradient(1, t);
      if (absent[0]) gw.assign(gw.size(), 0.0f);
      if (absent[1]) gb.assign(gb.size(), 0.0f);
      auto out = s->StepTensors(t, Whole(gw, gb));
      ASSERT_TRUE(out.ok()) << out.status();
      for (int m = 0; m < am::kTensors; ++m) {
        const std::vector<float> got = ToFloats((*out)[m]);
        EXPECT_TRUE(am::ParamsNear(got, ref.master(m), DType::kFloat32)) << am::kNames[m];
        if (absent[m]) EXPECT_EQ(got, last[m]) << am::kNames[m] << " changed while absent";
        last[m] = got;
      }
    }
    EXPECT_EQ(NextStep(), 4);
    ExpectMasters(ref);
  }
}

// The client refuses a mask it cannot send: an index past the job's tensors, one named twice,
// and any mask on an update-mode job.
TEST_F(ApplyAbsentTest, ClientRefusesMalformedMasks) {
  ASSERT_NO_FATAL_FAILURE(CreateJob("absent-client", 1, 0));
  auto s = Attach(0, client::Transport::kGrpc, client());
  ASSERT_NE(s, nullptr);
  absl::Status st = s->SetAbsent({2});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "absent tensor index 2")) << st;
  st = s->SetAbsent({1, 1});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "'b' is named absent twice")) << st;
  std::string token;
  std::unique_ptr<client::RankSession> u;
  ASSERT_NO_FATAL_FAILURE(AttachUpdateModeJob("absent-upd", &token, &u));
  EXPECT_EQ(u->SetAbsent({0}).code(), absl::StatusCode::kFailedPrecondition);
}

// Two ranks, one says 'b' has no gradient, the other that it has: both are refused
// (INVALID_ARGUMENT naming the tensor), nothing changes; with the same mask the step commits.
TEST_F(ApplyAbsentTest, RanksThatDisagreeAreRefusedAndNothingChanges) {
  ASSERT_NO_FATAL_FAILURE(CreateJob("absent-w2", 2, 1));
  const std::vector<std::vector<float>> w0 = {am::Initial(0), am::Initial(1)};
  std::vector<std::unique_ptr<client::Client>> clients;
  std::vector<std::unique_ptr<client::RankSession>> sessions;
  for (int r = 0; r < 2; ++r) {
    auto c = client::Client::Connect(address());
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(*std::move(c));
    sessions.push_back(Attach(r, client::Transport::kGrpc, *clients.back()));
    ASSERT_NE(sessions.back(), nullptr);
    const absl::Status init = sessions.back()->InitParams(Spans(r, w0), /*float32=*/true);
    ASSERT_TRUE(init.ok()) << init;
  }
  auto both = [&](const std::vector<std::vector<uint32_t>>& masks) {
    std::vector<absl::Status> st(2);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.emplace_back([&, r] {
        st[r] = sessions[r]->SetHyper(am::ClientHyper(0));
        if (st[r].ok()) st[r] = sessions[r]->SetAbsent(masks[r]);
        std::vector<float> gb = am::Gradient(1, 0);
        if (!masks[r].empty()) gb.assign(gb.size(), 0.0f);
        const std::vector<std::vector<float>> grads = {am::Gradient(0, 0), gb};
        std::vector<std::vector<float>> out = grads;  // float32 params: the same sizes
        std::vector<client::UpdateSpan> updates;
        for (const common::ShardSpan& sp : sessions[r]->spans()) {
          updates.push_back({sp.matrix, sp.offset, out[sp.matrix].data() + sp.offset, sp.length});
        }
        if (st[r].ok()) st[r] = sessions[r]->Step(0, Spans(r, grads), updates).status();
      });
    }
    for (std::thread& th : ranks) th.join();
    return st;
  };
  std::vector<absl::Status> st = both({{1}, {}});
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(st[r].code(), absl::StatusCode::kInvalidArgument) << "rank " << r << ": " << st[r];
    EXPECT_TRUE(absl::StrContains(st[r].message(), "disagree")) << st[r];
  }
  EXPECT_TRUE(absl::StrContains(absl::StrCat(st[0].message(), st[1].message()), "tensor 'b'"));
  EXPECT_EQ(NextStep(), 0);
  am::Reference ref;
  ExpectMasters(ref);
  st = both({{1}, {1}});
  ASSERT_TRUE(st[0].ok()) << st[0];
  ASSERT_TRUE(st[1].ok()) << st[1];
  ref.Step(0, {false, true});
  EXPECT_EQ(NextStep(), 1);
  ExpectMasters(ref);
}

// What the client library never sends, from a raw peer: over gRPC an index past the tensors, one
// named twice, a mask on an update-mode job; over shared memory a mask byte other than 0 or 1.
// Each is INVALID_ARGUMENT naming what is wrong, and the job stays at step 0 with its masters.
TEST_F(ApplyAbsentTest, MalformedMasksFromARawPeerAreRefused) {
  ASSERT_NO_FATAL_FAILURE(CreateJob("absent-raw", 1, 0));
  auto s = Attach(0, client::Transport::kGrpc, client());
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(s->InitParamsTensors(Whole(am::Initial(0), am::Initial(1))).ok());
  auto stub = RawStub(address());
  auto step_with = [&](const std::vector<uint32_t>& absent) {
    v1::StepRequest begin = BeginRequest(spec_.job_id, 0, s->session_id(), 0);
    for (int g = 0; g < am::kTensors; ++g) {
      v1::GroupHyper* h = begin.mutable_begin()->add_hyper();
      h->set_group(am::kGroups[g]);
      h->set_lr(0.01);
    }
    for (uint32_t t : absent) begin.mutable_begin()->add_absent_tensors(t);
    return RunRawStep(*stub, &token_,
                      {begin, GradientRequest(0, 0, Fp32Bytes(am::Gradient(0, 0))),
                       GradientRequest(1, 0, Fp32Bytes(am::Gradient(1, 0))), EndRequest()});
  };
  RawStepResult r = step_with({7});
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << r.status.error_message();
  EXPECT_TRUE(absl::StrContains(r.status.error_message(), "absent tensor index 7 of a job with 2"))
      << r.status.error_message();
  r = step_with({0, 0});
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << r.status.error_message();
  EXPECT_TRUE(absl::StrContains(r.status.error_message(), "'w' is named absent twice"))
      << r.status.error_message();
  EXPECT_EQ(NextStep(), 0);
  ExpectMasters(am::Reference());

  // Shared memory: the hyperparameter block by hand, with a mask byte of 2 for 'b'.
  const absl::Status detached = s->Detach();
  ASSERT_TRUE(detached.ok()) << detached;
  auto c = client::ShmChannel::Attach(client::ShmSocketFor(address()), spec_.job_id, 0, token_,
                                      /*takeover=*/true);
  ASSERT_TRUE(c.ok()) << c.status();
  client::ShmChannel& ch = **c;
  // The mask makes the hyperparameter block an odd number of bytes: the buffer is still whole
  // 64-byte lines, so buffer 1's spans are as aligned as buffer 0's.
  EXPECT_EQ(ch.buffer_bytes() % 64, 0u) << ch.buffer_bytes();
  char* buf = ch.GradientBuffer(0);
  for (const client::ShmSpan& span : ch.spans()) {
    const std::vector<float> g = am::Gradient(span.matrix, 0);
    std::memcpy(buf + span.byte_offset, g.data() + span.offset, span.length * sizeof(float));
  }
  // lr, weight decay, divisor, then the global clip (mode 0, sum 0): the protocol's block.
  const double block[2 * am::kTensors + 3] = {0.01, 0.01, 0.05, 0.0, 1.0, 0.0, 0.0};
  std::memcpy(buf + ch.hyper_byte_offset(), block, sizeof(block));
  char* mask = buf + ch.hyper_byte_offset() + sizeof(block);
  mask[0] = 0;
  mask[1] = 2;
  auto rung = ch.Ring(0);
  EXPECT_EQ(rung.status().code(), absl::StatusCode::kInvalidArgument) << rung.status();
  EXPECT_TRUE(absl::StrContains(rung.status().message(),
                                "presence mask byte of tensor 'b' is 2"))
      << rung.status();
  EXPECT_EQ(NextStep(), 0);
  ExpectMasters(am::Reference());
  // The same bytes with 'b' marked absent (1): the step commits, 'b' skipped.
  mask[1] = 1;
  auto ok = ch.Ring(0);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(NextStep(), 1);
  am::Reference ref;
  ref.Step(0, {false, true});
  // The hand-written block's lr and weight decay are step 0's of the reference only for 'b'
  // (skipped) and in their defaults for 'w': compare 'b', which must be untouched.
  auto tensors = client().ExportParams(spec_.job_id, token_, DType::kFloat32);
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  EXPECT_TRUE(am::ParamsNear(ToFloats((*tensors)[1]), ref.master(1), DType::kFloat32));

  // An update-mode job takes no mask.
  std::string token;
  std::unique_ptr<client::RankSession> u;
  ASSERT_NO_FATAL_FAILURE(AttachUpdateModeJob("absent-raw-upd", &token, &u));
  v1::StepRequest begin = BeginRequest(u->spec().job_id, 0, u->session_id(), 0);
  begin.mutable_begin()->add_absent_tensors(0);
  r = RunRawStep(*stub, &token, {begin, EndRequest()});
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << r.status.error_message();
  EXPECT_TRUE(absl::StrContains(r.status.error_message(), "presence mask"))
      << r.status.error_message();
}

}  // namespace
}  // namespace muond::integration
