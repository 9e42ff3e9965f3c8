// Job::Commit in update mode (server/jobs/job_commit.cc), in process, on the fixture of
// momentum_commit_fixture.h (the cpu device in place, the simulated one staged):
//  - The momentum store after each commit is bit for bit the serial EMA (ApplyMomentum over each
//    whole matrix from the widened gradient), for a multi-rank layout whose spans the parallel
//    pass cuts (spans of more than 1M elements) and groups (runs of small spans), in the three
//    gradient dtypes.
//  - A rank's gradient rewritten after it rang: after its matrix was computed, nothing committed
//    changes (the momentum is the reference EMA of the gradient as rung, the update the one a job
//    without the rewrite returns; a non-finite value written then is never read); a non-finite
//    value written before its matrix was assembled is caught by the device's own check (the step
//    refused, the momentum bit-identical).
//  - A change of the store while a checkpoint snapshot is in progress hands the writer the old
//    values; steps and commits that overtake a save copy nothing on their threads (StateBuffers
//    hands the snapshot's buffers over instead).
#include <cstring>
#include <string>
#include <vector>

#include "tests/unit/server/momentum_commit_fixture.h"

namespace muond::server {
namespace {

using commit_test::BitDifferences;
using commit_test::FillRegion;
using commit_test::Matrix;
using commit_test::Outcome;
using commit_test::RandomGradients;
using commit_test::RankRegion;
using commit_test::TwoRankSpec;
using common::DType;

class MomentumCommitTest : public commit_test::CommitFixture {
 protected:
  // Steps a job of `spec` with every rank and compares its store with the serial EMA (below).
  void ExpectSerialEma(const common::JobSpec& spec);
  // A shared-memory peer that rewrites its gradient after its matrix was computed (below).
  void ExpectRewriteChangesNothing(const std::string& id,
                                   const std::function<void(std::string*)>& rewrite);
};

// The matrices of the bit-for-bit tests: more than 8 MiB of gradient and momentum in all (the
// pass runs on every CPU), "wide" larger than a piece of the pass (1M elements).
std::vector<common::MatrixSpec> MixedMatrices(bool one_dtype) {
  const DType fp32 = one_dtype ? DType::kBFloat16 : DType::kFloat32;
  const DType fp16 = one_dtype ? DType::kBFloat16 : DType::kFloat16;
  return {Matrix("first", {8, 8}, DType::kBFloat16),
          Matrix("second", {5, 7}, fp32),
          Matrix("wide", {64, 40000}, DType::kBFloat16),
          Matrix("fp16", {3, 1000}, fp16),
          Matrix("mid", {32, 20000}, fp32),
          Matrix("last", {16, 16}, DType::kBFloat16)};
}

// Steps `spec` three times with every rank and compares the store after each commit with the
// serial EMA, whole matrix by whole matrix.
void MomentumCommitTest::ExpectSerialEma(const common::JobSpec& spec) {
  StartJob(spec);
  ASSERT_NE(job_, nullptr);
  std::vector<std::vector<float>> reference;
  for (const common::MatrixSpec& m : spec.matrices) reference.emplace_back(m.numel(), 0.0f);
  std::mt19937 rng(7);
  constexpr int kSteps = 3;
  for (int64_t step = 0; step < kSteps; ++step) {
    const std::vector<std::vector<float>> grads = RandomGradients(spec, rng);
    ASSERT_NO_FATAL_FAILURE(StepAll(spec, step, grads));
    for (size_t m = 0; m < spec.matrices.size(); ++m) {
      ApplyMomentum(spec.muon, grads[m].data(), reference[m].data(), reference[m].size());
    }
    const std::vector<std::vector<float>> saved = SavedMomentum();
    ASSERT_EQ(saved.size(), reference.size());
    for (size_t m = 0; m < saved.size(); ++m) {
      EXPECT_EQ(BitDifferences(saved[m], reference[m]), 0u)
          << "matrix '" << spec.matrices[m].name << "' after step " << step;
    }
  }
  // The commit's time is a phase of the step's metrics.
  const std::string metrics = common::DefaultRegistry().Serialize();
  EXPECT_NE(metrics.find(absl::StrCat("muond_step_phase_duration_seconds_count{muond_job=\"",
                                      spec.job_id, "\",phase=\"commit\"} ", kSteps)),
            std::string::npos)
      << metrics;
  EXPECT_EQ(job_->Report().steps_completed, kSteps);
}

TEST_P(MomentumCommitTest, ZeroStage2CommitIsTheSerialEmaBitForBit) {
  // World 3: partitions of ~1.07M elements. Rank 0 holds two small spans (one group of the pass)
  // and 1.07M elements of "wide" (cut into two pieces); rank 1 1.07M of "wide" (cut); rank 2 the
  // rest of "wide" with "fp16" (one group), then "mid" and "last" (another).
  common::JobSpec spec;
  spec.job_id = JobId("commit-zero2");
  spec.world_size = 3;
  spec.zero_stage = 2;
  spec.muon.momentum = 0.9;
  spec.matrices = MixedMatrices(/*one_dtype=*/true);
  ExpectSerialEma(spec);
}

TEST_P(MomentumCommitTest, ExplicitLayoutOfMixedDtypesCommitIsTheSerialEmaBitForBit) {
  // bf16, fp32 and fp16 gradients; spans listed out of matrix order; "wide" cut at 1.5M.
  common::JobSpec spec;
  spec.job_id = JobId("commit-explicit");
  spec.world_size = 3;
  spec.matrices = MixedMatrices(/*one_dtype=*/false);
  spec.explicit_layout = {{{2, 0, 1500000}, {0, 0, 64}, {1, 0, 20}},
                          {{1, 20, 15}, {3, 0, 3000}, {4, 0, 640000}, {5, 0, 100}},
                          {{5, 100, 156}, {2, 1500000, 1060000}}};
  ExpectSerialEma(spec);
}

// Steps 0 and 1 of a TwoRankSpec job; in step 1 rank 0's peer rewrites its gradient region for
// "a" (`rewrite` on its bytes) after "a" was computed and before rank 1 completes the step. The
// step must commit with the momentum the serial EMA of the gradients as they were when rung (the
// reference), and rank 0's update of "a" must be the one a job that saw no rewrite returns.
void MomentumCommitTest::ExpectRewriteChangesNothing(
    const std::string& id, const std::function<void(std::string*)>& rewrite) {
  const common::JobSpec spec = TwoRankSpec(id);
  std::mt19937 rng(11);
  const std::vector<std::vector<float>> grads0 = RandomGradients(spec, rng);
  const std::vector<std::vector<float>> grads1 = RandomGradients(spec, rng);
  std::vector<std::vector<float>> reference;
  for (size_t m = 0; m < spec.matrices.size(); ++m) {
    reference.emplace_back(spec.matrices[m].numel(), 0.0f);
    ApplyMomentum(spec.muon, grads0[m].data(), reference[m].data(), reference[m].size());
    ApplyMomentum(spec.muon, grads1[m].data(), reference[m].data(), reference[m].size());
  }
  // Rank 0's update of "a" at step 1 from a job that sees no rewrite.
  common::JobSpec clean_spec = spec;
  clean_spec.job_id = id + "-clean";
  StartJob(clean_spec);
  ASSERT_NE(job_, nullptr);
  ASSERT_NO_FATAL_FAILURE(StepAll(clean_spec, 0, grads0));
  RankRegion clean0 = FillRegion(clean_spec, 0, grads1);
  RankRegion clean1 = FillRegion(clean_spec, 1, grads1);
  Outcome c0, c1;
  ASSERT_TRUE(Submit(0, 1, clean0, &c0).ok());
  ASSERT_TRUE(Submit(1, 1, clean1, &c1).ok());
  c0.ended.WaitForNotification();
  c1.ended.WaitForNotification();
  ASSERT_TRUE(c0.status.ok()) << c0.status;

  StartJob(spec);
  ASSERT_NE(job_, nullptr);
  ASSERT_NO_FATAL_FAILURE(StepAll(spec, 0, grads0));
  RankRegion rank0 = FillRegion(spec, 0, grads1), rank1 = FillRegion(spec, 1, grads1);
  ASSERT_EQ(rank0.spans[0].matrix, 0u);
  ASSERT_EQ(rank0.spans[0].length, 64u * 2000);
  Outcome out0, out1;
  ASSERT_TRUE(Submit(0, 1, rank0, &out0).ok());  // checked: every value finite
  WaitForExecutor();
  // "a" was computed and its update written into rank 0's region before the rewrite.
  ASSERT_EQ(rank0.out[0], clean0.out[0]);
  EXPECT_FALSE(out0.ended.HasBeenNotified());
  const std::string as_rung = rank0.in[0];
  rewrite(&rank0.in[0]);
  ASSERT_NE(rank0.in[0], as_rung);
  ASSERT_TRUE(Submit(1, 1, rank1, &out1).ok());
  for (Outcome* o : {&out0, &out1}) {
    o->ended.WaitForNotification();
    EXPECT_TRUE(o->status.ok()) << o->status;
  }
  const JobReport report = job_->Report();
  EXPECT_FALSE(report.fenced);
  EXPECT_EQ(report.steps_completed, 2);
  EXPECT_EQ(rank0.out[0], clean0.out[0]) << "rank 0's update of 'a'";
  const std::vector<std::vector<float>> saved = SavedMomentum();
  ASSERT_EQ(saved.size(), reference.size());
  for (size_t m = 0; m < saved.size(); ++m) {
    EXPECT_EQ(BitDifferences(saved[m], reference[m]), 0u) << "matrix '" << spec.matrices[m].name;
  }
}

TEST_P(MomentumCommitTest, GradientRewrittenAfterItsMatrixWasComputedChangesNothingCommitted) {
  // The peer reuses its region early (every value of "a" replaced by another finite value): the
  // stored momentum is still the one the update was computed from.
  std::mt19937 noise(5);
  ExpectRewriteChangesNothing(JobId("commit-rewrite"), [&noise](std::string* bytes) {
    std::uniform_int_distribution<int> value(0x3c00, 0x4100);  // finite bf16 values 2^-7 .. 8
    for (size_t at = 0; at + 2 <= bytes->size(); at += 2) {
      const uint16_t v = static_cast<uint16_t>(value(noise));
      std::memcpy(bytes->data() + at, &v, sizeof(v));
    }
  });
}

TEST_P(MomentumCommitTest, GradientMadeNonFiniteAfterItsMatrixWasComputedIsNotReadAgain) {
  // A NaN written after "a" was computed (and checked) is never read: the step commits.
  ExpectRewriteChangesNothing(JobId("commit-late-nan"), [](std::string* bytes) {
    const uint16_t nan_bf16 = 0x7fc0;
    std::memcpy(bytes->data() + 100001 * 2, &nan_bf16, sizeof(nan_bf16));
  });
}

// A peer that makes its gradient non-finite after its submission was checked, before the daemon
// assembled it: the step was sealed (every rank's last part in and checked), so the state was
// being updated in place (one copy, state_buffers.h). The device's own check finds the value and
// the step cannot be refused with the state unchanged: the job is fenced, the error names the
// matrix and says to load the newest checkpoint, and that load brings back the committed state.
TEST_P(MomentumCommitTest, GradientMadeNonFiniteAfterTheSealFencesAndTheCheckpointRestores) {
  const common::JobSpec spec = TwoRankSpec(JobId("commit-early-inf"));
  StartJob(spec);
  ASSERT_NE(job_, nullptr);
  std::mt19937 rng(13);
  StepClean(spec, rng, 2);
  const std::vector<std::vector<float>> before = SavedMomentum();

  // The executor is held, so nothing of step 2 is assembled until the peer has written.
  absl::Notification release;
  executor_->Submit([&release] { release.WaitForNotification(); });
  const std::vector<std::vector<float>> grads = RandomGradients(spec, rng);
  RankRegion rank0 = FillRegion(spec, 0, grads), rank1 = FillRegion(spec, 1, grads);
  Outcome out0, out1;
  ASSERT_TRUE(Submit(0, 2, rank0, &out0).ok());
  ASSERT_TRUE(Submit(1, 2, rank1, &out1).ok());
  const common::ShardSpan& c = rank1.spans.back();
  ASSERT_EQ(c.matrix, 2u);
  const uint16_t inf_bf16 = 0x7f80;
  std::memcpy(rank1.in.back().data() + 5 * 2, &inf_bf16, sizeof(inf_bf16));
  release.Notify();
  for (Outcome* o : {&out0, &out1}) {
    o->ended.WaitForNotification();
    EXPECT_EQ(o->status.code(), absl::StatusCode::kInvalidArgument) << o->status;
    EXPECT_NE(o->status.message().find("'c'"), std::string::npos) << o->status;
    EXPECT_NE(o->status.message().find("updated in place"), std::string::npos) << o->status;
    EXPECT_NE(o->status.message().find("load its newest checkpoint"), std::string::npos)
        << o->status;
  }
  JobReport report = job_->Report();
  EXPECT_TRUE(report.fenced);
  EXPECT_EQ(report.steps_refused, 0);
  EXPECT_EQ(report.next_step, 2);
  auto loaded = job_->LoadCheckpoint(checkpoint::Selector{});
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  report = job_->Report();
  EXPECT_FALSE(report.fenced);
  EXPECT_EQ(report.next_step, 2);
  const std::vector<std::vector<float>> after = SavedMomentum();
  ASSERT_EQ(after.size(), before.size());
  for (size_t m = 0; m < after.size(); ++m) {
    EXPECT_EQ(BitDifferences(after[m], before[m]), 0u) << spec.matrices[m].name;
  }
}

// A save that begins while a sealed step updates the state in place (held there by the test
// hook, after its first batch was written) waits for the commit: its generation is the state at a
// step boundary, whole, and the step it names. Before, it began at once and saved a mixture of
// the old and new state under the old step's number.
TEST_P(MomentumCommitTest, ASaveDuringAnInPlaceStepIsTheStateAtAStepBoundary) {
  common::JobSpec spec = TwoRankSpec(JobId("commit-save-in-place"));
  spec.checkpoint_keep = 100;
  StartJob(spec);
  ASSERT_NE(job_, nullptr);
  std::mt19937 rng(17);
  StepClean(spec, rng, 2);
  const std::vector<std::vector<float>> before = SavedMomentum();

  SetInPlaceHoldForTesting(800);
  const std::vector<std::vector<float>> grads = RandomGradients(spec, rng);
  RankRegion rank0 = FillRegion(spec, 0, grads), rank1 = FillRegion(spec, 1, grads);
  Outcome out0, out1;
  ASSERT_TRUE(Submit(0, 2, rank0, &out0).ok());
  ASSERT_TRUE(Submit(1, 2, rank1, &out1).ok());
  absl::SleepFor(absl::Milliseconds(200));  // the step is sealed and holds in place
  auto during = job_->SaveCheckpoint();
  SetInPlaceHoldForTesting(0);
  ASSERT_TRUE(during.ok()) << during.status();
  for (Outcome* o : {&out0, &out1}) {
    o->ended.WaitForNotification();
    ASSERT_TRUE(o->status.ok()) << o->status;
  }
  const std::vector<std::vector<float>> after = SavedMomentum();
  EXPECT_EQ(during->step, 3) << "the save did not wait for the step writing in place";
  checkpoint::Store store(job_->checkpoint_dir(), 100);
  checkpoint::Selector which;
  which.generation = during->generation;
  auto loaded = store.Load(which);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const std::vector<std::vector<float>>& expected = during->step == 3 ? after : before;
  ASSERT_EQ(loaded->data.size(), expected.size());
  for (size_t m = 0; m < expected.size(); ++m) {
    EXPECT_EQ(BitDifferences(loaded->data[m], expected[m]), 0u)
        << "matrix " << spec.matrices[m].name << " of the generation saved at step "
        << during->step;
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, MomentumCommitTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "CpuInPlace" : "SimulatedStaged";
                         });

// MomentumStore's copy-on-write with more than 8 MiB to preserve (the copy runs over the CPUs): a
// change while a snapshot is in progress hands the writer the old values of every matrix it has
// not copied yet.
TEST(MomentumStoreSnapshotTest, AChangeDuringASnapshotHandsTheWriterTheOldValues) {
  common::JobSpec spec;
  spec.job_id = "cow";
  for (int m = 0; m < 6; ++m) {
    spec.matrices.push_back(Matrix(absl::StrCat("m", m), {512, 1024}, DType::kFloat32));
  }
  std::unique_ptr<device::Device> device = device::NewHostDevice(1, nullptr);
  MomentumStore store(spec, device.get());
  auto fill = [&store](MomentumStore::Lock& lock, float base) {
    for (uint32_t m = 0; m < store.matrices(); ++m) {
      float* d = lock.mutable_data(m);
      std::fill(d, d + store.numel(m), base + static_cast<float>(m));
    }
  };
  {
    MomentumStore::Lock lock(store);
    fill(lock, 1);
    lock.BeginSnapshot();
  }
  std::vector<float> copied;
  store.CopyForSnapshot(0, &copied);  // the writer has matrix 0 before the change
  {
    MomentumStore::Lock lock(store);
    fill(lock, 100);
  }
  for (uint32_t m = 0; m < store.matrices(); ++m) {
    if (m > 0) store.CopyForSnapshot(m, &copied);
    ASSERT_EQ(copied.size(), store.numel(m));
    EXPECT_EQ(std::count(copied.begin(), copied.end(), 1.0f + m), static_cast<long>(copied.size()))
        << "the snapshot of matrix " << m;
    EXPECT_EQ(std::count(store.data(m), store.data(m) + store.numel(m), 100.0f + m),
              static_cast<long>(store.numel(m)))
        << "the store's matrix " << m;
  }
  store.EndSnapshot();
}

// Steps that overtake a save (the writer has copied one matrix of six when three steps commit)
// copy nothing on their threads: the first commit flips, the next step hands the snapshot's
// buffers over to it instead of overwriting them (StateBuffers), and the writer, copying on its
// own thread, still gets every matrix's value at the snapshot, bit for bit. Before, the first
// commit copied the five matrices the writer had not reached (10 MiB) while it held the store.
TEST(MomentumStoreSnapshotTest, StepsDuringASnapshotCopyNothingOnTheirThreads) {
  common::JobSpec spec;
  spec.job_id = "cow-bound";
  for (int m = 0; m < 6; ++m) {
    spec.matrices.push_back(Matrix(absl::StrCat("m", m), {512, 1024}, DType::kFloat32));
  }
  std::unique_ptr<device::Device> device = device::NewHostDevice(1, nullptr);
  MomentumStore store(spec, device.get());
  const uint64_t matrix_bytes = 512 * 1024 * sizeof(float);
  // A step: every matrix's new momentum `base + m` into next(), then the commit's flip.
  auto step = [&store](float base) {
    for (uint32_t m = 0; m < store.matrices(); ++m) {
      float* d = store.next(m);
      std::fill(d, d + store.numel(m), base + static_cast<float>(m));
    }
    MomentumStore::Lock lock(store);
    lock.Flip();
  };
  auto holds = [](const float* d, size_t n, float v) {
    return std::count(d, d + n, v) == static_cast<long>(n);
  };
  step(1);
  {
    MomentumStore::Lock lock(store);
    lock.BeginSnapshot();
  }
  std::vector<float> copied;
  store.CopyForSnapshot(0, &copied);  // the writer has matrix 0 before the steps
  EXPECT_TRUE(holds(copied.data(), copied.size(), 1.0f));
  for (float base : {100.0f, 200.0f, 300.0f}) step(base);
  StateBuffers::SnapshotCost cost = store.snapshot_cost();
  EXPECT_EQ(cost.change_copied, 0u) << "bytes copied for the snapshot by the commits";
  EXPECT_EQ(cost.step_handed_over, 5 * matrix_bytes);
  for (uint32_t m = 1; m < store.matrices(); ++m) {
    store.CopyForSnapshot(m, &copied);
    ASSERT_EQ(copied.size(), store.numel(m));
    EXPECT_TRUE(holds(copied.data(), copied.size(), 1.0f + m)) << "the snapshot of matrix " << m;
    EXPECT_TRUE(holds(store.data(m), store.numel(m), 300.0f + m)) << "the store's matrix " << m;
  }
  store.EndSnapshot();
  cost = store.snapshot_cost();
  EXPECT_EQ(cost.change_copied, 0u);
  EXPECT_EQ(cost.writer_copied, 6 * matrix_bytes);
  // Later steps (the handed-over buffers come back as spares) keep the store exact.
  for (float base : {400.0f, 500.0f, 600.0f}) step(base);
  for (uint32_t m = 0; m < store.matrices(); ++m) {
    EXPECT_TRUE(holds(store.data(m), store.numel(m), 600.0f + m)) << "the store's matrix " << m;
  }
}

// Apply mode's ParamStore keeps its snapshots the same way: a step that overtakes a save writes
// every array's next value (masters, momentum, moments) without copying for the save, and the
// writer still gets the values and step counts of the snapshot.
TEST(ParamStoreSnapshotTest, StepsDuringASnapshotCopyNothingOnTheirThreads) {
  common::JobSpec spec;
  spec.job_id = "cow-apply";
  spec.mode = common::JobMode::kApply;
  spec.matrices = {Matrix("w", {256, 512}, DType::kFloat32),
                   Matrix("bias", {1, 512}, DType::kFloat32)};
  spec.matrices[1].optimizer = common::Optimizer::kAdamW;
  std::unique_ptr<device::Device> device = device::NewHostDevice(1, nullptr);
  ParamStore store(spec, device.get());
  // A step: array (t, s) becomes base + 10 t + s, then the commit's flip.
  auto step = [&store](float base) {
    for (uint32_t t = 0; t < store.tensors(); ++t) {
      for (int s = 0; s < store.slots(t); ++s) {
        float* d = store.back(t, s);
        std::fill(d, d + store.numel(t), base + 10.0f * t + s);
      }
    }
    ParamStore::Lock lock(store);
    lock.Flip();
  };
  step(1);
  {
    ParamStore::Lock lock(store);
    lock.BeginSnapshot();
  }
  for (float base : {100.0f, 200.0f}) step(base);
  EXPECT_EQ(store.snapshot_cost().change_copied, 0u);
  EXPECT_EQ(store.SnapshotSteps(), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(store.steps(1), 3);
  std::vector<float> copied;
  for (uint32_t t = 0; t < store.tensors(); ++t) {
    for (int s = 0; s < store.slots(t); ++s) {
      store.CopyForSnapshot(t, s, &copied);
      ASSERT_EQ(copied.size(), store.numel(t));
      const float want = 1.0f + 10.0f * t + s;
      EXPECT_EQ(std::count(copied.begin(), copied.end(), want), static_cast<long>(copied.size()))
          << "tensor " << t << " slot " << s;
      EXPECT_EQ(store.front(t, s)[0], 200.0f + 10.0f * t + s);
    }
  }
  store.EndSnapshot();
  EXPECT_EQ(store.snapshot_cost().change_copied, 0u);
}

// A two-phase commit flips keeping the old front as the back (Flip(absent, keep_back = true)), so
// that RollbackStep's Unflip brings back the values and step counts of before the step, also
// after a snapshot handed buffers over (the plain Flip would swap a spare, of stale values, into
// the back); a tensor the step skipped (absent) keeps its count.
TEST(ParamStoreRollbackTest, UnflipAfterAKeptFlipRestoresValuesAndStepCounts) {
  common::JobSpec spec;
  spec.job_id = "rollback-apply";
  spec.mode = common::JobMode::kApply;
  spec.matrices = {Matrix("w", {64, 96}, DType::kFloat32), Matrix("bias", {1, 96}, DType::kFloat32),
                   Matrix("gain", {1, 96}, DType::kFloat32)};
  spec.matrices[1].optimizer = common::Optimizer::kAdamW;
  spec.matrices[2].optimizer = common::Optimizer::kAdamW;
  std::unique_ptr<device::Device> device = device::NewHostDevice(1, nullptr);
  ParamStore store(spec, device.get());
  const std::vector<uint8_t> gain_absent = {0, 0, 1};
  auto step = [&store](float base, const std::vector<uint8_t>& absent) {
    for (uint32_t t = 0; t < store.tensors(); ++t) {
      for (int s = 0; s < store.slots(t); ++s) {
        float* d = store.back(t, s);
        const bool skipped = t < absent.size() && absent[t] != 0;
        const float* front = store.front(t, s);
        for (size_t i = 0; i < store.numel(t); ++i) {
          d[i] = skipped ? front[i] : base + 10.0f * t + s;
        }
      }
    }
    ParamStore::Lock lock(store);
    lock.Flip(absent, /*keep_back=*/true);
  };
  auto expect_front = [&store](float base, const char* when) {
    for (uint32_t t = 0; t < store.tensors(); ++t) {
      for (int s = 0; s < store.slots(t); ++s) {
        const float want = base + 10.0f * t + s;
        EXPECT_EQ(std::count(store.front(t, s), store.front(t, s) + store.numel(t), want),
                  static_cast<long>(store.numel(t)))
            << when << ": tensor " << t << " slot " << s;
      }
    }
  };
  step(1, {});
  {  // a save's snapshot while steps overtake it: buffers are handed over
    ParamStore::Lock lock(store);
    lock.BeginSnapshot();
  }
  step(2, {});
  step(3, {});  // writes the snapshot's buffer: handed over, a fresh unpinned one in its place
  std::vector<float> copied;
  for (uint32_t t = 0; t < store.tensors(); ++t) {
    for (int s = 0; s < store.slots(t); ++s) store.CopyForSnapshot(t, s, &copied);
  }
  store.EndSnapshot();  // the handed-over buffers become spares
  step(4, gain_absent);
  EXPECT_EQ(store.steps(1), 4);
  EXPECT_EQ(store.steps(2), 3);
  {
    ParamStore::Lock lock(store);
    lock.Unflip(gain_absent);
  }
  expect_front(3, "after the rollback of step 4");
  EXPECT_EQ(store.steps(1), 3);
  EXPECT_EQ(store.steps(2), 3) << "the absent tensor's count went down";
  // The step again commits on the restored front.
  step(5, {});
  expect_front(5, "after step 4 again");
  EXPECT_EQ(store.steps(1), 4);
}

}  // namespace
}  // namespace muond::server
