// Optimizer state held compressed (job.json "state"; server/optim/state_codec.h), in process on
// the fixture of momentum_commit_fixture.h (cpu: the kernel works on the decoding in place;
// simulated: staged copies to and from its buffers):
//  - update mode, bf16 and int8 momentum, two ranks under ZeRO-2 (blocks that cross the ranks'
//    spans, a partial last block, a matrix smaller than one block): every step's update is bit
//    for bit the serial Muon step computed from the decoded committed momentum, and the committed
//    momentum is the encoding of the new one (a checkpoint holds its decoding);
//  - a job that loads that checkpoint continues bit for bit (the decoding encodes back exactly);
//  - the same through the step window (a matrix computed before the seal) and in place (after
//    it), mixed within a step;
//  - apply mode, int8 momentum and int8 AdamW moments: a checkpoint, a load and the next step give
//    the bits of the job that ran on, and the masters stay close to those of an fp32-state job.
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "server/optim/state_codec.h"
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
using common::StateDType;

class HeldStateTest : public commit_test::CommitFixture {
 protected:
  // A fresh job of `spec` (its id changed to `id`) whose state is loaded from `from`'s newest
  // checkpoint.
  void StartLoadedFrom(common::JobSpec spec, const std::string& id,
                       const std::shared_ptr<JobImpl>& from) {
    spec.job_id = id;
    StartJob(spec);
    ASSERT_NE(job_, nullptr);
    auto loaded = job_->LoadCheckpointFrom(from, checkpoint::Selector{});
    ASSERT_TRUE(loaded.ok()) << loaded.status();
  }
  // Step `step` of a TwoRankSpec job in one of two orders (below).
  std::vector<RankRegion> StepOrdered(const common::JobSpec& spec, int64_t step,
                                      const std::vector<std::vector<float>>& grads, bool split);
};

// The serial step of update mode on held momentum: decode, MuonUpdate, encode.
struct HeldReference {
  StateDType dtype;
  std::vector<std::vector<float>> held;  // per matrix, as held

  HeldReference(const common::JobSpec& spec, StateDType d) : dtype(d) {
    for (const common::MatrixSpec& m : spec.matrices) {
      held.emplace_back(StoredWords(d, static_cast<size_t>(m.numel())), 0.0f);
    }
  }
  std::vector<float> Decoded(size_t m, size_t n) const {
    std::vector<float> x(n);
    DecodeStoredAll(dtype, StateRole::kSigned, held[m].data(), n, x.data());
    return x;
  }
  // The step's updates per matrix.
  std::vector<std::vector<float>> Step(const common::JobSpec& spec,
                                       const std::vector<std::vector<float>>& grads) {
    std::vector<std::vector<float>> updates;
    for (size_t m = 0; m < spec.matrices.size(); ++m) {
      const size_t n = static_cast<size_t>(spec.matrices[m].numel());
      const std::vector<float> in = Decoded(m, n);
      std::vector<float> next(n), update(n);
      const common::MatrixSpec* specs[] = {&spec.matrices[m]};
      const float* g[] = {grads[m].data()};
      float* mom[] = {next.data()};
      float* upd[] = {update.data()};
      const float* mom_in[] = {in.data()};
      const MuonGroup group{1, specs, g, mom, upd, mom_in};
      EXPECT_TRUE(MuonUpdateGroups(spec.muon, &group, 1).ok());
      EncodeStoredAll(dtype, StateRole::kSigned, next.data(), n, held[m].data());
      updates.push_back(std::move(update));
    }
    return updates;
  }
};

// Update bytes that differ from the reference's, over every rank's spans.
size_t UpdateDifferences(const common::JobSpec& spec, const std::vector<RankRegion>& regions,
                         const std::vector<std::vector<float>>& updates) {
  size_t diff = 0;
  for (const RankRegion& r : regions) {
    for (size_t i = 0; i < r.spans.size(); ++i) {
      const common::ShardSpan& s = r.spans[i];
      const DType dtype = spec.matrices[s.matrix].dtype;
      std::string want(s.length * common::DTypeSize(dtype), '\0');
      common::FromFloat32(updates[s.matrix].data() + s.offset, s.length, dtype, want.data());
      diff += want != r.out[i] ? 1 : 0;
    }
  }
  return diff;
}

TEST_P(HeldStateTest, UpdateModeStepsAreTheSerialStepOnTheDecodedMomentum) {
  for (StateDType dtype : {StateDType::kBFloat16, StateDType::kInt8}) {
    const std::string name(common::StateDTypeName(dtype));
    SCOPED_TRACE(name);
    common::JobSpec spec = TwoRankSpec(JobId("held-update-" + name));
    spec.state.momentum = dtype;
    ASSERT_NO_FATAL_FAILURE(StartJob(spec));
    std::mt19937 rng(41);
    HeldReference ref(spec, dtype);
    std::vector<std::vector<float>> grads;
    for (int64_t step = 0; step < 2; ++step) {
      grads = RandomGradients(spec, rng);
      const std::vector<RankRegion> regions = StepRegions(spec, step, grads);
      EXPECT_EQ(UpdateDifferences(spec, regions, ref.Step(spec, grads)), 0u) << "step " << step;
    }
    const std::vector<std::vector<float>> saved = SavedMomentum();
    ASSERT_EQ(saved.size(), spec.matrices.size());
    for (size_t m = 0; m < saved.size(); ++m) {
      EXPECT_EQ(BitDifferences(saved[m], ref.Decoded(m, saved[m].size())), 0u) << "matrix " << m;
    }
    // A job that loads the checkpoint continues as this one would.
    const std::shared_ptr<JobImpl> first = job_;
    ASSERT_NO_FATAL_FAILURE(StartLoadedFrom(spec, JobId("held-update-loaded-" + name), first));
    grads = RandomGradients(spec, rng);
    const std::vector<RankRegion> regions = StepRegions(spec, 2, grads);
    EXPECT_EQ(UpdateDifferences(spec, regions, ref.Step(spec, grads)), 0u) << "after the load";
  }
}

// Step `step` of a two-rank job: `split`: rank 0 rings and its complete matrix ("a") is computed
// into the step window before rank 1 rings (the step is sealed then, and "b" and "c" are
// computed in place); else both ring before anything is computed (every matrix in place).
std::vector<RankRegion> HeldStateTest::StepOrdered(const common::JobSpec& spec, int64_t step,
                                                   const std::vector<std::vector<float>>& grads,
                                                   bool split) {
  std::vector<RankRegion> regions = {FillRegion(spec, 0, grads), FillRegion(spec, 1, grads)};
  Outcome out0, out1;
  absl::Notification release;
  if (!split) executor_->Submit([&release] { release.WaitForNotification(); });
  EXPECT_TRUE(Submit(0, step, regions[0], &out0).ok());
  if (split) WaitForExecutor();
  EXPECT_TRUE(Submit(1, step, regions[1], &out1).ok());
  if (!split) release.Notify();
  for (Outcome* o : {&out0, &out1}) {
    o->ended.WaitForNotification();
    EXPECT_TRUE(o->status.ok()) << o->status;
  }
  return regions;
}

// The held momentum through both of the step's writes: the step window (encoded there before the
// seal, swapped in at the commit) and in place (encoded into the store once sealed), mixed within
// a step and alternating between steps: every update and the committed momentum are the serial
// step's bits.
TEST_P(HeldStateTest, WindowAndInPlaceWritesGiveTheSerialBits) {
  for (StateDType dtype : {StateDType::kBFloat16, StateDType::kInt8}) {
    const std::string name(common::StateDTypeName(dtype));
    SCOPED_TRACE(name);
    common::JobSpec spec = TwoRankSpec(JobId("held-window-" + name));
    spec.state.momentum = dtype;
    const uint64_t one_matrix = spec.StateBytesOf(spec.matrices[0]);
    spec.step_window_bytes = one_matrix;  // "a" fits, nothing more
    ASSERT_NO_FATAL_FAILURE(StartJob(spec));
    std::mt19937 rng(43);
    HeldReference ref(spec, dtype);
    for (int64_t step = 0; step < 4; ++step) {
      const bool split = step == 1 || step == 2;
      const std::vector<std::vector<float>> grads = RandomGradients(spec, rng);
      const std::vector<RankRegion> regions = StepOrdered(spec, step, grads, split);
      EXPECT_EQ(UpdateDifferences(spec, regions, ref.Step(spec, grads)), 0u)
          << "step " << step << (split ? " (window, then in place)" : " (in place)");
      // The window keeps the buffer of the matrix the step computed before the seal.
      const uint64_t window = job_->Report().memory.step_window;
      if (split) {
        EXPECT_GE(window, one_matrix) << "step " << step << ": nothing went to the window";
      } else {
        EXPECT_EQ(window, 0u) << "step " << step << ": a sealed step wrote the window";
      }
    }
    const std::vector<std::vector<float>> saved = SavedMomentum();
    ASSERT_EQ(saved.size(), spec.matrices.size());
    for (size_t m = 0; m < saved.size(); ++m) {
      EXPECT_EQ(BitDifferences(saved[m], ref.Decoded(m, saved[m].size())), 0u) << "matrix " << m;
    }
  }
}

// A world-1 apply-mode job: a Muon tensor over many blocks and an AdamW tensor, both with bf16
// parameters; the state as `state` says.
common::JobSpec ApplySpec(const std::string& id, common::StateStorage state) {
  common::JobSpec spec;
  spec.job_id = id;
  spec.mode = common::JobMode::kApply;
  spec.groups = {{"all", 1e-2, 0.01}};
  spec.matrices = {commit_test::Matrix("w", {96, 700}, DType::kBFloat16),
                   commit_test::Matrix("emb", {50, 90}, DType::kBFloat16)};
  spec.matrices[1].optimizer = common::Optimizer::kAdamW;
  for (common::MatrixSpec& m : spec.matrices) {
    m.group = "all";
    m.param_dtype = DType::kBFloat16;
  }
  spec.state = state;
  return spec;
}

class HeldApplyTest : public HeldStateTest {
 protected:
  void StartWith(const common::JobSpec& spec, const std::vector<std::vector<float>>& init) {
    ASSERT_NO_FATAL_FAILURE(StartJob(spec));
    InitWeights(spec, init);
  }
};

TEST_P(HeldApplyTest, Int8MomentumAndMomentsReloadBitForBitAndTrackFp32) {
  const common::JobSpec held =
      ApplySpec(JobId("held-apply"), {StateDType::kInt8, StateDType::kInt8});
  const common::JobSpec fp32 = ApplySpec(JobId("held-apply-fp32"), {});
  std::mt19937 rng(7);
  const std::vector<std::vector<float>> init = RandomGradients(held, rng);
  std::vector<std::vector<std::vector<float>>> grads;
  for (int t = 0; t < 4; ++t) grads.push_back(RandomGradients(held, rng));
  StepHyper hyper;
  hyper.lr = {1e-2};
  hyper.weight_decay = {0.01};

  // The fp32-state job: the masters after four steps.
  ASSERT_NO_FATAL_FAILURE(StartWith(fp32, init));
  for (int t = 0; t < 4; ++t) StepRegions(fp32, t, grads[t], &hyper);
  const std::vector<std::vector<float>> fp32_masters = Masters();

  // The held job: two steps, a checkpoint, a third step.
  ASSERT_NO_FATAL_FAILURE(StartWith(held, init));
  for (int t = 0; t < 2; ++t) StepRegions(held, t, grads[t], &hyper);
  ASSERT_TRUE(job_->SaveCheckpoint().ok());
  const std::vector<RankRegion> ran_on = StepRegions(held, 2, grads[2], &hyper);
  const std::shared_ptr<JobImpl> first = job_;
  // A job loaded from the checkpoint: the same third step, bit for bit.
  ASSERT_NO_FATAL_FAILURE(StartLoadedFrom(held, JobId("held-apply-loaded"), first));
  const std::vector<RankRegion> loaded = StepRegions(held, 2, grads[2], &hyper);
  ASSERT_EQ(loaded.size(), ran_on.size());
  for (size_t i = 0; i < ran_on[0].out.size(); ++i) {
    EXPECT_TRUE(loaded[0].out[i] == ran_on[0].out[i]) << "tensor " << held.matrices[i].name;
  }
  StepRegions(held, 3, grads[3], &hyper);
  const std::vector<std::vector<float>> held_masters = Masters();
  // Close to fp32 state: what the four steps moved, within a few percent.
  ASSERT_EQ(held_masters.size(), fp32_masters.size());
  for (size_t t = 0; t < held_masters.size(); ++t) {
    double moved = 0, apart = 0;
    for (size_t i = 0; i < held_masters[t].size(); ++i) {
      const double a = held_masters[t][i] - init[t][i], b = fp32_masters[t][i] - init[t][i];
      moved += b * b;
      apart += (a - b) * (a - b);
    }
    ASSERT_GT(moved, 0) << held.matrices[t].name;
    EXPECT_LT(std::sqrt(apart / moved), 0.05) << held.matrices[t].name;
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, HeldStateTest, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "cpu" : "simulated"; });
INSTANTIATE_TEST_SUITE_P(Devices, HeldApplyTest, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "cpu" : "simulated"; });

}  // namespace
}  // namespace muond::server
