// Apply mode's engine end to end (DESIGN.md 4b) against a real muond, through the client library:
// atomicity of refused steps (non-finite gradient, ranks disagreeing on lr), steps before the
// initial weights, speculative global clipping against the serial computation bit for bit,
// transport and layout independence, init_from and export (checkpoints across kill -9 and another
// world size: apply_checkpoint_test.cc). The trajectories against an independent torch reference
// are in tests/python/apply_mode_test.py; here every comparison is between two runs of the daemon
// that must agree bit for bit.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/layout.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "server/optim/grad_norm.h"
#include "tests/apply/apply_run.h"
#include "tests/integration/daemon_fixture.h"

namespace muond::integration {
namespace {

using apply_test::ApplySpec;
using apply_test::ExpectBitEqual;
using apply_test::Export;
using apply_test::Flatten;
using apply_test::Floats;
using apply_test::Hyper;
using apply_test::JobRun;
using apply_test::Model;
using apply_test::Random;
using apply_test::RandomModel;
using apply_test::RunJob;
using apply_test::Unflatten;
using common::DType;

class ApplyEngineTest : public DaemonSuite {
 protected:
  std::string Create(const common::JobSpec& spec) {
    auto token = client().CreateJob(spec);
    EXPECT_TRUE(token.ok()) << token.status();
    return token.ok() ? *token : "";
  }
};

TEST_F(ApplyEngineTest, RefusedStepsLeaveEveryStateBitIdentical) {
  const common::JobSpec a = ApplySpec(NewJobId("refuse-a"), 1, 0, DType::kFloat32);
  common::JobSpec b = a;
  b.job_id = NewJobId("refuse-b");
  const std::string ta = Create(a), tb = Create(b);
  const Model init = RandomModel(a, 1, 0.05f);
  std::vector<Model> g = {RandomModel(a, 2, 1.0f), RandomModel(a, 3, 1.0f),
                          RandomModel(a, 4, 1.0f)};
  const std::vector<client::StepHyper> h = {Hyper(0.02, 0.003), Hyper(0.015, 0.002),
                                            Hyper(0.01, 0.001)};
  const JobRun clean = RunJob(address(), b, tb, &init, g, h, 0, client::Transport::kGrpc);
  for (const auto& s : clean.status) ASSERT_TRUE(s.ok()) << s;
  // Job a: step 0, then step 1 with a NaN in the last tensor (refused), an infinite divisor's
  // overflow (refused), then the clean steps 1 and 2.
  JobRun first = RunJob(address(), a, ta, &init, {g[0]}, {h[0]}, 0, client::Transport::kGrpc);
  ASSERT_TRUE(first.status[0].ok()) << first.status[0];
  Model bad = g[1];
  bad.back()[5] = std::nanf("");
  JobRun refused = RunJob(address(), a, ta, nullptr, {bad}, {h[1]}, 1, client::Transport::kGrpc);
  EXPECT_EQ(refused.status[0].code(), absl::StatusCode::kInvalidArgument) << refused.status[0];
  EXPECT_NE(refused.status[0].message().find("'head'"), std::string::npos) << refused.status[0];
  JobRun overflow = RunJob(address(), a, ta, nullptr, {g[1]}, {Hyper(0.015, 0.002, 1e-300)}, 1,
                           client::Transport::kGrpc);
  EXPECT_EQ(overflow.status[0].code(), absl::StatusCode::kInvalidArgument) << overflow.status[0];
  EXPECT_NE(overflow.status[0].message().find("overflow"), std::string::npos) << overflow.status[0];
  JobRun rest =
      RunJob(address(), a, ta, nullptr, {g[1], g[2]}, {h[1], h[2]}, 1, client::Transport::kGrpc);
  ASSERT_TRUE(rest.status[0].ok() && rest.status[1].ok()) << rest.status[0] << rest.status[1];
  ExpectBitEqual(first.params[0], clean.params[0], "step 0");
  ExpectBitEqual(rest.params[0], clean.params[1], "step 1 after two refusals");
  ExpectBitEqual(rest.params[1], clean.params[2], "step 2");
  // fp32 params: what the ranks got is the masters, bit for bit.
  ExpectBitEqual(Export(client(), a, ta), clean.params[2], "export");
  auto st = client().GetJob(a.job_id, ta);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->steps_refused(), 2);
  EXPECT_EQ(st->next_step(), 3);
  EXPECT_TRUE(st->weights_complete());
  EXPECT_GT(st->last_grad_norm(), 0);
}

TEST_F(ApplyEngineTest, StepsWaitForEveryRanksInitialWeights) {
  const common::JobSpec spec = ApplySpec(NewJobId("init"), 2, 1, DType::kFloat32);
  const std::string token = Create(spec);
  auto c0 = client::Client::Connect(address());
  ASSERT_TRUE(c0.ok());
  auto r0 = (*c0)->Attach(spec.job_id, 0, token, false, client::Transport::kGrpc);
  ASSERT_TRUE(r0.ok()) << r0.status();
  ASSERT_TRUE((*r0)->SetHyper(Hyper(0.02, 0.003)).ok());
  const Model g = RandomModel(spec, 9, 1.0f);
  const Floats flat = Flatten(spec, 0, g);
  std::string out((*r0)->buffer_elements() * sizeof(float), '\0');
  auto s = (*r0)->StepBuffer(0, flat.data(), out.data());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
  EXPECT_NE(s.status().message().find("ranks 0, 1"), std::string::npos) << s.status();
  const Model init = RandomModel(spec, 8, 0.05f);
  const Floats w0 = Flatten(spec, 0, init);
  ASSERT_TRUE((*r0)->InitParamsBuffer(w0.data(), true).ok());
  s = (*r0)->StepBuffer(0, flat.data(), out.data());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
  EXPECT_NE(s.status().message().find("rank 1 "), std::string::npos) << s.status();
  // A non-finite initial weight is refused and changes nothing.
  Floats w1 = Flatten(spec, 1, init);
  w1[3] = INFINITY;
  auto r1 = (*c0)->Attach(spec.job_id, 1, token, false, client::Transport::kGrpc);
  ASSERT_TRUE(r1.ok()) << r1.status();
  absl::Status bad = (*r1)->InitParamsBuffer(w1.data(), true);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  auto st = client().GetJob(spec.job_id, token);
  ASSERT_TRUE(st.ok());
  EXPECT_FALSE(st->weights_complete());
  ASSERT_EQ(st->ranks_missing_weights_size(), 1);
  EXPECT_EQ(st->ranks_missing_weights(0), 1);
  EXPECT_EQ(st->next_step(), 0);
  // Export and save say why there is nothing yet.
  EXPECT_EQ(client().ExportParams(spec.job_id, token).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client().SaveCheckpoint(spec.job_id, token).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(ApplyEngineTest, RanksThatDisagreeOnLrRefuseTheStepForEveryone) {
  const common::JobSpec spec = ApplySpec(NewJobId("disagree"), 2, 2, DType::kFloat32);
  common::JobSpec ref = spec;
  ref.job_id = NewJobId("disagree-ref");
  const std::string token = Create(spec), ref_token = Create(ref);
  const Model init = RandomModel(spec, 11, 0.05f);
  const std::vector<Model> g = {RandomModel(spec, 12, 1.0f)};
  const JobRun want = RunJob(address(), ref, ref_token, &init, g, {Hyper(0.02, 0.003)}, 0,
                             client::Transport::kGrpc);
  ASSERT_TRUE(want.status[0].ok()) << want.status[0];
  // Rank 1 sends another lr for group 'adamw' (both ranks' weights in first).
  std::vector<absl::Status> got(2);
  std::atomic<int> ready{0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      auto c = client::Client::Connect(address());
      auto session = (*c)->Attach(spec.job_id, r, token, false, client::Transport::kGrpc);
      if (!session.ok()) {
        got[r] = session.status();
        return;
      }
      const Floats w = Flatten(spec, r, init), flat = Flatten(spec, r, g[0]);
      got[r] = (*session)->InitParamsBuffer(w.data(), true);
      ++ready;
      while (ready.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (got[r].ok()) got[r] = (*session)->SetHyper(Hyper(0.02, r == 0 ? 0.003 : 0.004));
      std::string out((*session)->buffer_elements() * sizeof(float), '\0');
      if (got[r].ok()) got[r] = (*session)->StepBuffer(0, flat.data(), out.data()).status();
    });
  }
  for (auto& t : ranks) t.join();
  bool named = false;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r].code(), absl::StatusCode::kInvalidArgument) << "rank " << r << ": " << got[r];
    named = named || got[r].message().find("disagree") != std::string::npos;
  }
  EXPECT_TRUE(named) << got[0] << " / " << got[1];
  // The retry with one lr equals the reference: nothing of the refused step stayed.
  const JobRun retry =
      RunJob(address(), spec, token, nullptr, g, {Hyper(0.02, 0.003)}, 0, client::Transport::kGrpc);
  ASSERT_TRUE(retry.status[0].ok()) << retry.status[0];
  ExpectBitEqual(retry.params[0], want.params[0], "retry");
}

TEST_F(ApplyEngineTest, SpeculativeClippingEqualsTheSerialComputationBitForBit) {
  common::JobSpec clip = ApplySpec(NewJobId("clip"), 2, 1, DType::kFloat32);
  // Gradients of norm about 36; the step-1 gradients are scaled down to stay under the limit.
  clip.max_grad_norm = 5.0;
  common::JobSpec serial = clip;
  serial.job_id = NewJobId("serial");
  serial.max_grad_norm = 0;
  const std::string tc = Create(clip), ts = Create(serial);
  const Model init = RandomModel(clip, 21, 0.05f);
  std::vector<Model> g = {RandomModel(clip, 22, 1.0f), RandomModel(clip, 23, 0.01f),
                          RandomModel(clip, 24, 1.0f)};
  const std::vector<client::StepHyper> h = {Hyper(0.02, 0.003), Hyper(0.02, 0.003),
                                            Hyper(0.02, 0.003, 4.0)};
  // The serial computation: the norm first (the daemon's fixed order: per tensor, then in tensor
  // order; after the divisor), then the gradients multiplied by clip / divisor in float once.
  std::vector<Model> pre = g;
  std::vector<client::StepHyper> pre_h = h;
  double last_norm = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    double total = 0;
    for (const Floats& t : g[i]) total += server::SumOfSquares(t.data(), t.size());
    const double d = h[i].grad_divisor;
    last_norm = std::sqrt(total) / d;
    const float coef = server::ClipCoefficient(total / (d * d), clip.max_grad_norm);
    const float scale = static_cast<float>(static_cast<double>(coef) / d);
    SCOPED_TRACE(absl::StrCat("step ", i, " coef ", coef));
    EXPECT_EQ(coef < 1.0f, i != 1);  // clipping triggers on steps 0 and 2 only
    for (Floats& t : pre[i]) {
      for (float& x : t) x *= scale;
    }
    pre_h[i].grad_divisor = 1;
  }
  const JobRun spec_run = RunJob(address(), clip, tc, &init, g, h, 0, client::Transport::kGrpc);
  const JobRun serial_run =
      RunJob(address(), serial, ts, &init, pre, pre_h, 0, client::Transport::kGrpc);
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_TRUE(spec_run.status[i].ok()) << spec_run.status[i];
    ASSERT_TRUE(serial_run.status[i].ok()) << serial_run.status[i];
    ExpectBitEqual(spec_run.params[i], serial_run.params[i], absl::StrCat("step ", i));
  }
  auto st = client().GetJob(clip.job_id, tc);
  ASSERT_TRUE(st.ok());
  // Steps 0 and 2 clip. A step recomputes only the tensors computed before its seal (with clip 1,
  // into the step window); one sealed before any was computed has the clip first and recomputes
  // nothing.
  EXPECT_LE(st->clip_redo_steps(), 2u);
  // The norm of the last step, after the divisor and before clipping.
  EXPECT_NEAR(st->last_grad_norm(), last_norm, 1e-9 * last_norm);
}

TEST_F(ApplyEngineTest, TransportsAndLayoutsAgreeAndBf16ParamsAreTheRoundedMasters) {
  const Model init = RandomModel(ApplySpec("x", 1, 0, DType::kBFloat16), 31, 0.05f);
  std::vector<Model> g;
  std::vector<client::StepHyper> h;
  for (int i = 0; i < 3; ++i) {
    g.push_back(RandomModel(ApplySpec("x", 1, 0, DType::kBFloat16), 32 + i, 1.0f));
    h.push_back(Hyper(0.02 / (i + 1), 0.003));
  }
  struct Case {
    int world, stage;
    client::Transport transport;
  };
  std::vector<JobRun> runs;
  std::vector<Model> exported;
  for (const Case& k : {Case{1, 0, client::Transport::kGrpc}, Case{2, 1, client::Transport::kShm},
                        Case{3, 2, client::Transport::kGrpc}, Case{2, 3, client::Transport::kShm},
                        Case{4, 3, client::Transport::kGrpc}}) {
    const common::JobSpec spec = ApplySpec(NewJobId(absl::StrCat("layout", k.world, k.stage)),
                                           k.world, k.stage, DType::kBFloat16);
    const std::string token = Create(spec);
    // The initial weights go up as bf16-representable values (the shm path rounds to the param
    // dtype, gRPC keeps float32): both transports start from the same masters.
    Model rounded = init;
    for (Floats& t : rounded) {
      std::vector<uint16_t> b(t.size());
      common::FromFloat32(t.data(), t.size(), DType::kBFloat16, b.data());
      common::ToFloat32(DType::kBFloat16, b.data(), t.size(), t.data());
    }
    runs.push_back(RunJob(address(), spec, token, &rounded, g, h, 0, k.transport));
    for (const auto& s : runs.back().status) ASSERT_TRUE(s.ok()) << spec.job_id << ": " << s;
    exported.push_back(Export(client(), spec, token));
  }
  for (size_t c = 1; c < runs.size(); ++c) {
    for (size_t i = 0; i < g.size(); ++i) {
      ExpectBitEqual(runs[c].params[i], runs[0].params[i], absl::StrCat("case ", c, " step ", i));
    }
    ExpectBitEqual(exported[c], exported[0], absl::StrCat("case ", c, " masters"));
  }
  // The bf16 parameters returned are the masters rounded to nearest even.
  Model rounded = exported[0];
  for (Floats& t : rounded) {
    std::vector<uint16_t> b(t.size());
    common::FromFloat32(t.data(), t.size(), DType::kBFloat16, b.data());
    common::ToFloat32(DType::kBFloat16, b.data(), t.size(), t.data());
  }
  ExpectBitEqual(runs[0].params.back(), rounded, "bf16 params vs rounded masters");
}

TEST_F(ApplyEngineTest, InitFromReadsTheFileAndRefusesWhatItCannotUse) {
  common::JobSpec spec = ApplySpec(NewJobId("from"), 1, 0, DType::kFloat32);
  const Model init = RandomModel(spec, 41, 0.05f);
  TempDir files;
  ::chmod(files.path().c_str(), 0755);
  std::vector<common::TensorRef> refs;
  for (size_t t = 0; t < spec.matrices.size(); ++t) {
    refs.push_back({spec.matrices[t].name, DType::kFloat32, spec.matrices[t].shape,
                    std::string_view(reinterpret_cast<const char*>(init[t].data()),
                                     init[t].size() * sizeof(float))});
  }
  const std::string path = files.File("model.safetensors");
  ASSERT_TRUE(common::WriteSafetensorsFile(path, refs).ok());
  ::chmod(path.c_str(), 0600);  // the creator's own file: fine
  common::JobSpec from = spec;
  from.job_id = NewJobId("from-file");
  from.init_from = path;
  const std::string tf = Create(from), tu = Create(spec);
  const std::vector<Model> g = {RandomModel(spec, 42, 1.0f)};
  const JobRun a =
      RunJob(address(), from, tf, nullptr, g, {Hyper(0.02, 0.003)}, 0, client::Transport::kGrpc);
  const JobRun b =
      RunJob(address(), spec, tu, &init, g, {Hyper(0.02, 0.003)}, 0, client::Transport::kGrpc);
  ASSERT_TRUE(a.status[0].ok()) << a.status[0];
  ASSERT_TRUE(b.status[0].ok()) << b.status[0];
  ExpectBitEqual(a.params[0], b.params[0], "init_from vs upload");
  // The read shows as an operation, like a save or a load (GetProgress, the status page).
  auto ops = client().GetProgress(from.job_id, tf);
  ASSERT_TRUE(ops.ok()) << ops.status();
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  bool seen = false;
  for (const auto& op : *ops) {
    if (op.kind() != "init_from") continue;
    seen = true;
    EXPECT_TRUE(op.done());
    EXPECT_EQ(op.error(), "");
    EXPECT_EQ(op.bytes_total(), static_cast<uint64_t>(st.st_size));
    EXPECT_EQ(op.bytes_done(), op.bytes_total());
  }
  EXPECT_TRUE(seen) << "no init_from operation in GetProgress";
  // Refusals at creation, and no job is made.
  auto refused = [&](const std::string& file, absl::StatusCode code, const std::string& want) {
    common::JobSpec bad = spec;
    bad.job_id = NewJobId("from-bad");
    bad.init_from = file;
    auto t = client().CreateJob(bad);
    EXPECT_EQ(t.status().code(), code) << file << ": " << t.status();
    EXPECT_NE(t.status().message().find(want), std::string::npos) << t.status();
    EXPECT_EQ(client().GetJob(bad.job_id, "x").status().code(), absl::StatusCode::kNotFound);
  };
  refused(files.File("absent.safetensors"), absl::StatusCode::kNotFound, "absent");
  refused("relative.safetensors", absl::StatusCode::kInvalidArgument, "absolute");
  std::vector<common::TensorRef> short_refs(refs.begin(), refs.end() - 1);
  ASSERT_TRUE(common::WriteSafetensorsFile(files.File("short.safetensors"), short_refs).ok());
  refused(files.File("short.safetensors"), absl::StatusCode::kInvalidArgument, "'head'");
  // Someone else's private file: the daemon could read it, its creator could not.
  if (::geteuid() == 0) {
    const std::string other = files.File("other.safetensors");
    ASSERT_TRUE(common::WriteSafetensorsFile(other, refs).ok());
    ASSERT_EQ(::chown(other.c_str(), 65534, 65534), 0);
    ::chmod(other.c_str(), 0600);
    refused(other, absl::StatusCode::kPermissionDenied, "neither owned by the job's creator");
  }
  refs[1].shape = {24, 48};
  ASSERT_TRUE(common::WriteSafetensorsFile(files.File("shape.safetensors"), refs).ok());
  refused(files.File("shape.safetensors"), absl::StatusCode::kInvalidArgument, "'attn.w'");
}

TEST_F(ApplyEngineTest, ResetZeroesTheOptimizerStateAndKeepsTheMasters) {
  const common::JobSpec spec = ApplySpec(NewJobId("reset"), 1, 0, DType::kFloat32);
  common::JobSpec fresh = spec;
  fresh.job_id = NewJobId("reset-fresh");
  const std::string token = Create(spec), tf = Create(fresh);
  const Model init = RandomModel(spec, 51, 0.05f);
  const std::vector<Model> g = {RandomModel(spec, 52, 1.0f), RandomModel(spec, 53, 1.0f)};
  const JobRun first = RunJob(address(), spec, token, &init, {g[0]}, {Hyper(0.02, 0.003)}, 0,
                              client::Transport::kGrpc);
  ASSERT_TRUE(first.status[0].ok()) << first.status[0];
  ASSERT_TRUE(client().ResetJob(spec.job_id, token, 0).ok());
  // After the reset: a fresh job started from the masters of step 0.
  const JobRun after = RunJob(address(), spec, token, nullptr, {g[1]}, {Hyper(0.02, 0.003)}, 0,
                              client::Transport::kGrpc);
  const JobRun want = RunJob(address(), fresh, tf, &first.params[0], {g[1]}, {Hyper(0.02, 0.003)},
                             0, client::Transport::kGrpc);
  ASSERT_TRUE(after.status[0].ok()) << after.status[0];
  ASSERT_TRUE(want.status[0].ok()) << want.status[0];
  ExpectBitEqual(after.params[0], want.params[0], "after reset");
}

}  // namespace
}  // namespace muond::integration
