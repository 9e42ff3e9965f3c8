// Apply mode's checkpoints end to end (DESIGN.md 4b) against a real muond: a job killed with
// SIGKILL and restarted on the same state directory, and the same state resumed at another world
// size and stage, continue bit for bit like a job that never stopped.
#include <signal.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/apply/apply_run.h"
#include "tests/integration/daemon_fixture.h"

namespace muond::integration {
namespace {

using apply_test::ApplySpec;
using apply_test::ExpectBitEqual;
using apply_test::Export;
using apply_test::Hyper;
using apply_test::JobRun;
using apply_test::Model;
using apply_test::RandomModel;
using apply_test::RunJob;
using common::DType;

// Kill -9 and restart on the same state directory; resume at another world size and stage.
TEST(ApplyCheckpointTest, KillRestartAndAnotherLayoutContinueBitForBit) {
  TempDir dir;
  auto daemon = DaemonProcess::StartIn(dir.path());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto c = client::Client::Connect((*daemon)->address());
  ASSERT_TRUE(c.ok());
  const common::JobSpec spec = ApplySpec("ckpt", 1, 0, DType::kBFloat16);
  common::JobSpec ref = spec;
  ref.job_id = "ckpt-ref";
  auto token = (*c)->CreateJob(spec);
  auto ref_token = (*c)->CreateJob(ref);
  ASSERT_TRUE(token.ok() && ref_token.ok());
  const Model init = RandomModel(spec, 61, 0.05f);
  std::vector<Model> g;
  std::vector<client::StepHyper> h;
  for (int i = 0; i < 5; ++i) {
    g.push_back(RandomModel(spec, 62 + i, 1.0f));
    h.push_back(Hyper(0.02, 0.003));
  }
  const JobRun want =
      RunJob((*daemon)->address(), ref, *ref_token, &init, g, h, 0, client::Transport::kGrpc);
  for (const auto& s : want.status) ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE((*c)->SaveCheckpoint(ref.job_id, *ref_token).ok());
  const std::vector<Model> g02(g.begin(), g.begin() + 2);
  JobRun first = RunJob((*daemon)->address(), spec, *token, &init, g02, {h[0], h[1]}, 0,
                        client::Transport::kGrpc);
  ASSERT_TRUE(first.status[1].ok()) << first.status[1];
  auto saved = (*c)->SaveCheckpoint(spec.job_id, *token);
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->step(), 2);
  // Step 2 runs and is lost with the daemon.
  JobRun lost = RunJob((*daemon)->address(), spec, *token, nullptr, {g[2]}, {h[2]}, 2,
                       client::Transport::kGrpc);
  ASSERT_TRUE(lost.status[0].ok()) << lost.status[0];
  ASSERT_EQ(::kill((*daemon)->pid(), SIGKILL), 0);
  daemon->reset();
  daemon = DaemonProcess::StartIn(dir.path());
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  c = client::Client::Connect((*daemon)->address());
  ASSERT_TRUE(c.ok());
  auto st = (*c)->GetJob(spec.job_id, *token);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->next_step(), 2);
  EXPECT_TRUE(st->weights_complete());
  const std::vector<Model> g24(g.begin() + 2, g.end());
  const std::vector<client::StepHyper> h24(h.begin() + 2, h.end());
  // The same job after the restart, and a new world-3 stage-2 job restored from its checkpoint.
  common::JobSpec wide = ApplySpec("ckpt-wide", 3, 2, DType::kBFloat16);
  v1::RestoreFrom restore;
  restore.set_job_id(spec.job_id);
  restore.set_token(*token);
  auto wide_token = (*c)->CreateJob(wide, &restore);
  ASSERT_TRUE(wide_token.ok()) << wide_token.status();
  const JobRun again =
      RunJob((*daemon)->address(), spec, *token, nullptr, g24, h24, 2, client::Transport::kGrpc);
  const JobRun resumed = RunJob((*daemon)->address(), wide, *wide_token, nullptr, g24, h24, 2,
                                client::Transport::kShm);
  for (size_t i = 0; i < g24.size(); ++i) {
    ASSERT_TRUE(again.status[i].ok()) << again.status[i];
    ASSERT_TRUE(resumed.status[i].ok()) << resumed.status[i];
    ExpectBitEqual(again.params[i], want.params[2 + i], absl::StrCat("restarted step ", 2 + i));
    ExpectBitEqual(resumed.params[i], want.params[2 + i], absl::StrCat("world 3 step ", 2 + i));
  }
  // The export of the restarted job is the same model as the reference's.
  ExpectBitEqual(Export(**c, spec, *token), Export(**c, ref, *ref_token), "export");
  EXPECT_EQ((*daemon)->Stop(), 0);
}

}  // namespace
}  // namespace muond::integration
