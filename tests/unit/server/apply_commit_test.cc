// Job::Commit in apply mode (DESIGN.md 4b), in process, on the fixture of
// momentum_commit_fixture.h (the cpu device computes in place, its kernel writing each Muon
// tensor's new momentum into the parameter store's back buffer; the simulated device is staged,
// and the host writes the momentum):
//  - Over three steps the committed momentum of every tensor is bit for bit the serial EMA of the
//    gradients, and the masters move.
//  - Global clipping's redo refuses a gradient rewritten after it was read, and commits otherwise.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "server/engine/step_observer.h"
#include "tests/unit/server/momentum_commit_fixture.h"

namespace muond::server {
namespace {

using commit_test::BitDifferences;
using commit_test::FillRegion;
using commit_test::Outcome;
using commit_test::RandomGradients;
using commit_test::RankRegion;
using commit_test::TwoRankSpec;
using common::DType;

class ApplyCommitTest : public commit_test::CommitFixture {
 protected:
  // An apply-mode TwoRankSpec job, every tensor Muon in group "all", bf16 parameters back, the
  // initial masters random; `max_grad_norm` > 0 clips.
  common::JobSpec StartApplyJob(const std::string& id, double max_grad_norm, std::mt19937& rng,
                                const common::QkClip& qk_clip = {});
  // The hyperparameters of every step here: group "all" at lr 1e-3, no weight decay.
  static StepHyper Hyper() {
    StepHyper hyper;
    hyper.lr = {1e-3};
    hyper.weight_decay = {0.0};
    return hyper;
  }
  // A step whose global clipping recomputes it, with or without a peer that rewrote a gradient
  // after the first pass read it (below).
  void ExpectClipRedo(const std::string& id, bool rewrite);
};

common::JobSpec ApplyCommitTest::StartApplyJob(const std::string& id, double max_grad_norm,
                                               std::mt19937& rng, const common::QkClip& qk_clip) {
  common::JobSpec spec = TwoRankSpec(id);
  spec.mode = common::JobMode::kApply;
  spec.groups = {{"all", 1e-3, 0.0}};
  spec.max_grad_norm = max_grad_norm;
  spec.qk_clip = qk_clip;
  for (common::MatrixSpec& m : spec.matrices) {
    m.group = "all";
    m.param_dtype = DType::kBFloat16;  // new parameters come back in the regions' update size
  }
  StartJob(spec);
  EXPECT_NE(job_, nullptr);
  if (job_ == nullptr) return spec;
  InitWeights(spec, RandomGradients(spec, rng));
  return spec;
}

// Three steps; after each, the saved state's momentum of every (Muon) tensor is bit for bit the
// serial EMA of the gradients (the divisor is 1 and nothing clips, so the kernel's gradient is
// the rung one). On the cpu device only the kernel writes it (ApplyStep::PrepareGradient leaves it
// to the kernel); on the simulated device only the host does: a step that skipped either write
// would commit a stale back buffer.
TEST_P(ApplyCommitTest, MomentumIsTheSerialEmaBitForBit) {
  std::mt19937 rng(23);
  const common::JobSpec spec = StartApplyJob(JobId("apply-ema"), /*max_grad_norm=*/0, rng);
  ASSERT_NE(job_, nullptr);
  std::vector<std::vector<float>> reference;
  for (const common::MatrixSpec& m : spec.matrices) reference.emplace_back(m.numel(), 0.0f);
  const StepHyper hyper = Hyper();
  std::vector<std::vector<float>> masters = Masters();
  for (int64_t step = 0; step < 3; ++step) {
    const std::vector<std::vector<float>> grads = RandomGradients(spec, rng);
    ASSERT_NO_FATAL_FAILURE(StepAll(spec, step, grads, &hyper));
    for (size_t m = 0; m < spec.matrices.size(); ++m) {
      ApplyMomentum(spec.muon, grads[m].data(), reference[m].data(), reference[m].size());
    }
    // Apply mode saves master and momentum per Muon tensor (checkpoint::StateTensors).
    const std::vector<std::vector<float>> saved = SavedMomentum();
    ASSERT_EQ(saved.size(), 2 * reference.size());
    for (size_t m = 0; m < reference.size(); ++m) {
      EXPECT_EQ(BitDifferences(saved[2 * m + 1], reference[m]), 0u)
          << "tensor '" << spec.matrices[m].name << "' after step " << step;
    }
    const std::vector<std::vector<float>> now = Masters();
    EXPECT_NE(now, masters) << "step " << step << " did not move the masters";
    masters = now;
  }
  EXPECT_EQ(job_->Report().steps_completed, 3);
}

// Apply mode with global clipping: every step clips (max_grad_norm tiny), so once every tensor is
// done the step computes them all again from the gradients, scaled by the clip coefficient
// (step_pipeline.cc CheckReread). A peer that rewrites its region after "a" was read the first
// time makes the step refused (INVALID_ARGUMENT naming the rank and tensor), with the master
// weights as they were; without the rewrite the same step commits with a redo.
void ApplyCommitTest::ExpectClipRedo(const std::string& id, bool rewrite) {
  std::mt19937 rng(17);
  const common::JobSpec spec = StartApplyJob(id, /*max_grad_norm=*/1e-3, rng);
  ASSERT_NE(job_, nullptr);
  const std::vector<std::vector<float>> before = Masters();
  ASSERT_EQ(before.size(), spec.matrices.size());
  const StepHyper hyper = Hyper();
  const std::vector<std::vector<float>> grads = RandomGradients(spec, rng);
  RankRegion rank0 = FillRegion(spec, 0, grads), rank1 = FillRegion(spec, 1, grads);
  ASSERT_EQ(rank0.spans[0].matrix, 0u);
  ASSERT_EQ(rank0.spans[0].length, 64u * 2000);
  Outcome out0, out1;
  ASSERT_TRUE(Submit(0, 0, rank0, &out0, &hyper).ok());
  WaitForExecutor();  // "a" (all rank 0's) was read by the first pass
  EXPECT_FALSE(out0.ended.HasBeenNotified());
  if (rewrite) rank0.in[0][4 * 2] ^= 0x01;  // one bit of element 4 of "a"
  ASSERT_TRUE(Submit(1, 0, rank1, &out1, &hyper).ok());
  for (Outcome* o : {&out0, &out1}) o->ended.WaitForNotification();
  const JobReport report = job_->Report();
  if (!rewrite) {
    EXPECT_TRUE(out0.status.ok()) << out0.status;
    EXPECT_TRUE(out1.status.ok()) << out1.status;
    EXPECT_EQ(report.steps_completed, 1);
    EXPECT_EQ(report.clip_redo_steps, 1);
    EXPECT_NE(Masters(), before);
    return;
  }
  for (Outcome* o : {&out0, &out1}) {
    EXPECT_EQ(o->status.code(), absl::StatusCode::kInvalidArgument) << o->status;
    EXPECT_NE(o->status.message().find("rank 0's gradient of tensor 'a'"), std::string::npos)
        << o->status;
    EXPECT_NE(o->status.message().find("changed after it was read"), std::string::npos)
        << o->status;
  }
  EXPECT_EQ(report.steps_completed, 0);
  EXPECT_EQ(report.steps_refused, 1);
  EXPECT_FALSE(report.fenced);
  EXPECT_EQ(Masters(), before) << "the masters changed";
}

TEST_P(ApplyCommitTest, ClipRedoRefusesAGradientRewrittenAfterItWasRead) {
  ExpectClipRedo(JobId("clip-reread"), /*rewrite=*/true);
}

TEST_P(ApplyCommitTest, ClipRedoOfAnUnchangedGradientCommits) {
  ExpectClipRedo(JobId("clip-same"), /*rewrite=*/false);
}

// What operators see of an apply-mode job (step_observer.h, trainer_clock.h): the Newton-Schulz
// time of each shape class, every step's sample measured (--orthogonality-every 1) before the
// masters are applied, the trainer's view of the newest step (shared-memory ranks: timed at the
// commit), and the pinned masters and momentum, with nothing waiting between steps.
TEST_P(ApplyCommitTest, OperatorsSeeShapeTimesOrthogonalityAndTrainerTime) {
  SetOrthogonalityEvery(1);
  std::mt19937 rng(29);
  const common::JobSpec spec = StartApplyJob(JobId("apply-observed"), /*max_grad_norm=*/0, rng);
  ASSERT_NE(job_, nullptr);
  const StepHyper hyper = Hyper();
  for (int64_t step = 0; step < 2; ++step) {
    ASSERT_NO_FATAL_FAILURE(StepAll(spec, step, RandomGradients(spec, rng), &hyper));
  }
  SetOrthogonalityEvery(100);
  const JobReport r = job_->Report();
  uint64_t matrices = 0, per_step = 0;
  for (const JobReport::ShapeTime& t : r.newton_schulz) {
    matrices += t.matrices;
    per_step += t.per_step;
    EXPECT_GT(t.seconds, 0) << t.shape;
  }
  EXPECT_EQ(per_step, spec.matrices.size());
  EXPECT_EQ(matrices, 2 * spec.matrices.size());
  ASSERT_TRUE(r.orthogonality_step.has_value());
  EXPECT_EQ(*r.orthogonality_step, 1);
  EXPECT_GT(r.orthogonality, 0.0);
  EXPECT_LT(r.orthogonality, 0.6);
  EXPECT_EQ(r.orthogonality_matrices, static_cast<int>(spec.matrices.size()));
  ASSERT_TRUE(r.trainer_step.has_value());
  EXPECT_EQ(*r.trainer_step, 1);
  EXPECT_GE(r.trainer_visible_seconds, r.trainer_wait_seconds);
  EXPECT_GE(r.trainer_wait_seconds, 0);
  EXPECT_EQ(r.matrices_waiting, 0u);
  EXPECT_EQ(r.gather_in_use_bytes, 0u);
  uint64_t elements = 0;
  for (const common::MatrixSpec& m : spec.matrices) elements += m.numel();
  // The committed buffer of each array and the step window's buffers held, where mlock allowed
  // them (RLIMIT_MEMLOCK): all or nothing here; one copy, at most two.
  auto one_or_two_copies = [&](uint64_t bytes) {
    return bytes == 0 || (bytes >= 4 * elements && bytes <= 2 * 4 * elements);
  };
  EXPECT_TRUE(one_or_two_copies(r.pinned_masters_bytes)) << r.pinned_masters_bytes;
  EXPECT_TRUE(one_or_two_copies(r.pinned_momentum_bytes)) << r.pinned_momentum_bytes;
  EXPECT_EQ(r.pinned_moments_bytes, 0u);  // every tensor is Muon
}

// QK-Clip (DESIGN.md 4e) in the daemon: the same step on a twin job without qk_clip gives the
// unclipped masters; the clipped job's query and key heads are those masters times each head's
// factor (float64 product, rounded once: bit for bit), the other tensors and heads at or under the
// threshold bit-identical, the factors from the maximum of the two ranks' logits. A step without
// logits is refused naming the pair, and changes nothing.
TEST_P(ApplyCommitTest, QkClipScalesTheHeadsOverTheThresholdBitForBit) {
  common::QkClip qk;
  qk.threshold = 10;
  qk.alpha = 0.25;
  qk.pairs = {{"a", "b", 16, 16, 4}};  // a: q [16 heads x 4, 2000]; b: k, one key head per query
  const StepHyper hyper = Hyper();
  std::mt19937 twin_rng(41), rng(41);
  const common::JobSpec twin = StartApplyJob(JobId("qk-twin"), 0, twin_rng);
  ASSERT_NE(job_, nullptr);
  const std::vector<std::vector<float>> grads = RandomGradients(twin, twin_rng);
  ASSERT_NO_FATAL_FAILURE(StepAll(twin, 0, grads, &hyper));
  const std::vector<std::vector<float>> unclipped = Masters();

  const common::JobSpec spec = StartApplyJob(JobId("qk-clip"), 0, rng, qk);
  ASSERT_NE(job_, nullptr);
  (void)RandomGradients(spec, rng);  // the same draws as the twin's
  const std::vector<std::vector<float>> before = Masters();
  // No logits: refused by the daemon (the hyper check both transports use), naming the pair.
  {
    RankRegion r0 = FillRegion(spec, 0, grads);
    Outcome out0;
    const absl::Status s = Submit(0, 0, r0, &out0, &hyper);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("QK-Clip pair q='a' needs its 16"), std::string::npos) << s;
    EXPECT_EQ(Masters(), before);
  }
  // Heads 0-3 over the threshold on one rank or the other (the maximum counts), head 4 at it
  // (untouched), the rest under.
  StepHyper h0 = hyper, h1 = hyper;
  h0.max_logits.assign(16, 1.0f);
  h1.max_logits.assign(16, -3.0f);
  h0.max_logits[0] = 40;  // gamma 1/4
  h1.max_logits[1] = 12.5;
  h0.max_logits[2] = 11;
  h1.max_logits[2] = 20;  // the larger wins: gamma 1/2
  h0.max_logits[3] = 1e6;
  h1.max_logits[4] = 10;
  std::vector<RankRegion> regions = {FillRegion(spec, 0, grads), FillRegion(spec, 1, grads)};
  Outcome out0, out1;
  ASSERT_TRUE(Submit(0, 0, regions[0], &out0, &h0).ok());
  ASSERT_TRUE(Submit(1, 0, regions[1], &out1, &h1).ok());
  for (Outcome* o : {&out0, &out1}) {
    o->ended.WaitForNotification();
    ASSERT_TRUE(o->status.ok()) << o->status;
  }
  const std::vector<std::vector<float>> clipped = Masters();
  const double gammas[] = {10.0 / 40, 10.0 / 12.5, 10.0 / 20, 10.0 / 1e6};
  uint64_t changed = 0;
  for (size_t t = 0; t < spec.matrices.size(); ++t) {
    const double alpha = t == 0 ? qk.alpha : t == 1 ? 1 - qk.alpha : 0;
    for (size_t i = 0; i < clipped[t].size(); ++i) {
      const size_t head = i / (4 * 2000);
      float want = unclipped[t][i];
      if (t < 2 && head < 4) {
        want = static_cast<float>(static_cast<double>(unclipped[t][i]) *
                                  std::pow(gammas[head], alpha));
        changed += want != unclipped[t][i];
      }
      ASSERT_EQ(std::memcmp(&clipped[t][i], &want, sizeof(float)), 0)
          << spec.matrices[t].name << " element " << i << ": " << clipped[t][i] << " vs " << want;
    }
  }
  EXPECT_GT(changed, 0u);
  // The ranks received the clipped parameters (bf16, rounded from the clipped masters).
  for (int r = 0; r < 2; ++r) {
    for (size_t k = 0; k < regions[r].spans.size(); ++k) {
      const common::ShardSpan& span = regions[r].spans[k];
      std::string want(span.length * 2, '\0');
      common::FromFloat32(clipped[span.matrix].data() + span.offset, span.length, DType::kBFloat16,
                          want.data());
      EXPECT_EQ(regions[r].out[k], want) << "rank " << r << " span " << k;
    }
  }
  const JobReport report = job_->Report();
  EXPECT_EQ(report.qk_heads_clipped, 4);
  ASSERT_TRUE(report.qk_max_logit.has_value());
  EXPECT_EQ(*report.qk_max_logit, 1e6f);
}

// Apply mode keeps no copy of a committed update for replays: when a rank's shared-memory session
// ends (its regions, which held the update, go), or when the rank begins its next step, the job
// keeps only where the spans were, and a replay writes the new parameters from the committed
// masters. A rank coming back over shared memory and one coming back over gRPC both receive
// their step-1 result bit for bit, with no replay bytes held; the job then steps on.
TEST_P(ApplyCommitTest, ReplaysComeFromTheMastersWithNoCopyKept) {
  std::mt19937 rng(29);
  const common::JobSpec spec = StartApplyJob(JobId("apply-replay"), /*max_grad_norm=*/0, rng);
  ASSERT_NE(job_, nullptr);
  const StepHyper hyper = Hyper();
  ASSERT_NO_FATAL_FAILURE(StepAll(spec, 0, RandomGradients(spec, rng), &hyper));
  const std::vector<std::vector<float>> grads = RandomGradients(spec, rng);
  const std::vector<RankRegion> committed = StepRegions(spec, 1, grads, &hyper);
  for (int r = 0; r < spec.world_size; ++r) {
    job_->EndSharedSession(r, sessions_[r], nullptr, /*clean=*/true);
    auto session = job_->Attach(r, /*takeover=*/false);
    ASSERT_TRUE(session.ok()) << session.status();
    sessions_[r] = *session;
  }
  EXPECT_EQ(job_->Report().memory.replay, 0u) << "a copy of the update was kept";
  // Rank 0 over shared memory: a fresh region, the same gradients.
  RankRegion again = FillRegion(spec, 0, grads);
  for (std::string& out : again.out) std::fill(out.begin(), out.end(), '\0');
  Outcome replayed;
  ASSERT_TRUE(Submit(0, 1, again, &replayed, &hyper).ok());
  replayed.ended.WaitForNotification();
  EXPECT_TRUE(replayed.status.ok()) << replayed.status;
  EXPECT_NE(replayed.flags & kDoneReplayed, 0u);
  EXPECT_EQ(again.out, committed[0].out) << "the replay's new parameters differ";
  // Rank 1 over gRPC, asking for the committed result only.
  auto step = job_->BeginStep(1, sessions_[1], 1, &hyper);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_TRUE((*step)->replay());
  auto update = (*step)->Finish([] { return false; }, 0);
  ASSERT_TRUE(update.ok()) << update.status();
  ASSERT_EQ((*update)->spans.size(), committed[1].out.size());
  for (size_t i = 0; i < committed[1].out.size(); ++i) {
    EXPECT_EQ(std::string((*update)->spans[i].data, (*update)->spans[i].size), committed[1].out[i])
        << "span " << i;
  }
  EXPECT_EQ(job_->Report().memory.replay, 0u);
  // The job steps on from the same masters.
  const std::vector<std::vector<float>> before = Masters();
  ASSERT_NO_FATAL_FAILURE(StepAll(spec, 2, RandomGradients(spec, rng), &hyper));
  EXPECT_NE(Masters(), before);
  EXPECT_EQ(job_->Report().steps_completed, 3);
}

INSTANTIATE_TEST_SUITE_P(Devices, ApplyCommitTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "CpuInPlace" : "SimulatedStaged";
                         });

}  // namespace
}  // namespace muond::server
