// One copy of the state and its step window (README "Memory", "One copy of the state"), through
// the real daemon and the client library over shared memory, a step in parts as muon_offload
// streams it:
//  - a job whose "step_window_bytes" holds two matrices' state computes at most two matrices
//    before the step is sealed (its rank's last part), then the rest in place; a job with the
//    default window (larger than its state) computes every matrix as its part arrives;
//  - both give the same update bits at every step, and the same as a step sent whole;
//  - the job reports its window (footprint) and never holds more in it;
//  - a window smaller than a tensor's state is refused at create, naming the field.
#include <sys/wait.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/integration/multirank_util.h"

namespace muond::integration {
namespace {

constexpr int kMatrices = 6;
constexpr int kSteps = 3;
constexpr uint64_t kMatrixStateBytes = 64 * 64 * 4;  // update mode: fp32 momentum

common::JobSpec Spec(const std::string& id, uint64_t window) {
  common::JobSpec spec;
  spec.job_id = id;
  for (int i = 0; i < kMatrices; ++i) {
    spec.matrices.push_back(Matrix(absl::StrCat("m", i), {64, 64}));
  }
  spec.step_window_bytes = window;
  spec.step_buffers = 1;
  return spec;
}

size_t Count(const std::vector<bool>& v) {
  size_t n = 0;
  for (bool b : v) n += b ? 1 : 0;
  return n;
}

// Step t in parts, one matrix each, the last part empty. Before the last part, waits until
// `expect_before_seal` matrices' results are announced and checks that no more come (the window
// is full: compute waits for the seal). Returns the update bytes per matrix.
std::vector<std::string> StepInParts(client::RankSession& s, int64_t t,
                                     const std::vector<std::string>& grads,
                                     size_t expect_before_seal) {
  auto in = s.GradientView(t);
  EXPECT_TRUE(in.ok()) << in.status();
  if (!in.ok()) return {};
  for (size_t i = 0; i < s.spans().size(); ++i) {
    const common::ShardSpan& span = s.spans()[i];
    std::memcpy(in->data + span.rank_offset * 4, grads[span.matrix].data(), span.length * 4);
    EXPECT_TRUE(s.PostPart(t, span.rank_offset * 4, span.length * 4, false).ok());
  }
  std::vector<bool> ready;
  bool ended = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (Count(ready) < expect_before_seal && std::chrono::steady_clock::now() < deadline) {
    EXPECT_TRUE(s.PartsProgress(t, 0.5, &ready, &ended).ok());
  }
  EXPECT_EQ(Count(ready), expect_before_seal) << "step " << t << ": results before the seal";
  // Nothing more comes before the seal.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_TRUE(s.PartsProgress(t, 0, &ready, &ended).ok());
  EXPECT_EQ(Count(ready), expect_before_seal) << "step " << t << ": computed past the window";
  EXPECT_FALSE(ended);
  EXPECT_TRUE(s.PostPart(t, 0, 0, true).ok());
  auto result = s.WaitParts(t);
  EXPECT_TRUE(result.ok()) << result.status();
  auto out = s.UpdateView(t);
  EXPECT_TRUE(out.ok()) << out.status();
  if (!out.ok()) return {};
  std::vector<std::string> updates(kMatrices);
  for (const common::ShardSpan& span : s.spans()) {
    updates[span.matrix].assign(out->data + span.rank_offset * 4, span.length * 4);
  }
  return updates;
}

TEST(StepWindowTest, AFullWindowWaitsForTheSealAndTheBitsAreThoseOfAWholeStep) {
  TempDir dir;
  auto daemon = DaemonProcess::StartIn(dir.path(), {"--backend", "cpu"});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto c = client::Client::Connect((*daemon)->address());
  ASSERT_TRUE(c.ok()) << c.status();
  client::Client& client = **c;

  const common::JobSpec narrow = Spec("narrow", 2 * kMatrixStateBytes);
  const common::JobSpec wide = Spec("wide", 0);
  const MatrixBytes grads = MakeGradients(narrow.matrices, kSteps, /*seed=*/31);
  auto reference = ReferenceTrajectory(client, "whole", narrow, grads);
  ASSERT_TRUE(reference.ok()) << reference.status();

  auto tn = client.CreateJob(narrow);
  auto tw = client.CreateJob(wide);
  ASSERT_TRUE(tn.ok() && tw.ok()) << tn.status() << " / " << tw.status();
  auto sn = client.Attach("narrow", 0, *tn, false, client::Transport::kShm);
  auto sw = client.Attach("wide", 0, *tw, false, client::Transport::kShm);
  ASSERT_TRUE(sn.ok() && sw.ok()) << sn.status() << " / " << sw.status();
  for (int t = 0; t < kSteps; ++t) {
    SCOPED_TRACE(absl::StrCat("step ", t));
    const std::vector<std::string> n = StepInParts(**sn, t, grads[t], 2);
    const std::vector<std::string> w = StepInParts(**sw, t, grads[t], kMatrices);
    ASSERT_EQ(n.size(), static_cast<size_t>(kMatrices));
    for (int m = 0; m < kMatrices; ++m) {
      EXPECT_TRUE(n[m] == (*reference)[t][m]) << "narrow window, matrix " << m;
      EXPECT_TRUE(w[m] == (*reference)[t][m]) << "default window, matrix " << m;
    }
  }
  auto st = client.GetJob("narrow", *tn);
  ASSERT_TRUE(st.ok()) << st.status();
  bool seen = false;
  for (const v1::MemoryUse& use : st->memory()) {
    if (use.kind() != "step_window") continue;
    seen = true;
    EXPECT_EQ(use.footprint_bytes(), 2 * kMatrixStateBytes);
    EXPECT_LE(use.bytes(), use.footprint_bytes());
  }
  EXPECT_TRUE(seen) << "no step_window kind in the job's memory";
  EXPECT_FALSE(st->fenced());
  EXPECT_EQ(st->steps_completed(), kSteps);

  // A window that cannot hold one tensor's state: refused at create, naming the field.
  auto bad = client.CreateJob(Spec("too-narrow", kMatrixStateBytes - 1));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_NE(bad.status().message().find("step_window_bytes"), std::string::npos) << bad.status();
  EXPECT_NE(bad.status().message().find("'m0'"), std::string::npos) << bad.status();
  sn->reset();
  sw->reset();
  const int status = (*daemon)->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << (*daemon)->Log();
}

}  // namespace
}  // namespace muond::integration
