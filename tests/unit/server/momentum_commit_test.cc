// Job::Commit in update mode (server/jobs/job_commit.cc), in process: a Job on the CPU device
// (in place) and on the simulated one (staged copies), driven through SubmitShared as the shared-memory server drives it (the test holds the ranks'
// gradient memory, as a peer holds its region).
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
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "common/layout.h"
#include "common/metrics.h"
#include "gtest/gtest.h"
#include "server/device/device.h"
#include "server/device/device_streams.h"
#include "server/jobs/compute_executor.h"
#include "server/jobs/job.h"
#include "server/jobs/momentum_store.h"
#include "server/jobs/param_store.h"
#include "server/jobs/state_buffers.h"
#include "server/optim/muon_math.h"
#include "server/storage/checkpoint.h"

namespace muond::server {
namespace {

using common::DType;

common::MatrixSpec Matrix(const std::string& name, std::vector<int64_t> shape, DType dtype) {
  common::MatrixSpec m;
  m.name = name;
  m.shape = std::move(shape);
  m.dtype = dtype;
  return m;
}

// One step's whole-matrix gradients, each value exactly representable in its matrix's dtype (so
// the widened bytes the job reads are these floats).
std::vector<std::vector<float>> RandomGradients(const common::JobSpec& spec, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> grads;
  for (const common::MatrixSpec& m : spec.matrices) {
    std::vector<float> g(static_cast<size_t>(m.numel()));
    for (float& v : g) v = normal(rng);
    std::string bytes(g.size() * common::DTypeSize(m.dtype), '\0');
    common::FromFloat32(g.data(), g.size(), m.dtype, bytes.data());
    common::ToFloat32(m.dtype, bytes.data(), g.size(), g.data());
    grads.push_back(std::move(g));
  }
  return grads;
}

// One rank's part of a step as its shared-memory regions hold it: per span, the gradient bytes
// (the matrix dtype) and the update bytes.
struct RankRegion {
  std::vector<common::ShardSpan> spans;
  std::vector<std::string> in;
  std::vector<std::string> out;
};

RankRegion FillRegion(const common::JobSpec& spec, int rank,
                      const std::vector<std::vector<float>>& grads) {
  RankRegion r;
  r.spans = common::RankSpans(spec, rank);
  for (const common::ShardSpan& s : r.spans) {
    const DType dtype = spec.matrices[s.matrix].dtype;
    std::string bytes(s.length * common::DTypeSize(dtype), '\0');
    common::FromFloat32(grads[s.matrix].data() + s.offset, s.length, dtype, bytes.data());
    r.in.push_back(std::move(bytes));
    r.out.emplace_back(r.in.back().size(), '\x5a');
  }
  return r;
}

// A submission's outcome, set by its done callback (which runs under the job's lock).
struct Outcome {
  absl::Notification ended;
  absl::Status status;
};

// Run on the cpu device (the step computes in place: the committed momentum read where it is
// stored, the new one written by the kernel into the store's back buffer) and on the simulated
// device (the staged path: copies to and from its buffers).
class MomentumCommitTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/momentum-commit-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    const device::SimulatedOptions simulated;
    const bool in_place = GetParam();
    auto devices =
        DeviceStreams::Create(device::NewHostDevice(2, in_place ? nullptr : &simulated),
                              in_place ? "cpu" : "simulated", false);
    ASSERT_TRUE(devices.ok()) << devices.status();
    ASSERT_EQ((*devices)->device->ComputesInHostMemory(), in_place);
    devices_ = *std::move(devices);
    executor_ = std::make_unique<ComputeExecutor>(2);
  }
  void TearDown() override {
    job_.reset();
    executor_.reset();
    devices_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  // Creates job_ for `spec` and attaches every rank.
  void StartJob(const common::JobSpec& spec) {
    ASSERT_TRUE(common::ValidateJobSpec(spec).ok()) << common::ValidateJobSpec(spec);
    job_ = std::make_shared<Job>(
        spec, std::string(32, 'k'), "cpu", executor_.get(), uint64_t{256} << 20, devices_.get(),
        absl::StrCat(dir_, "/", spec.job_id), absl::Seconds(120), JobOwner{});
    sessions_.clear();
    for (int r = 0; r < spec.world_size; ++r) {
      auto session = job_->Attach(r, /*takeover=*/false);
      ASSERT_TRUE(session.ok()) << session.status();
      sessions_.push_back(*session);
    }
  }

  // Rings for `rank`: the job checks the region's values and enters the rank into the step.
  absl::Status Submit(int rank, int64_t step, RankRegion& region, Outcome* outcome,
                      const StepHyper* hyper = nullptr) {
    std::vector<const char*> in;
    std::vector<char*> out;
    for (size_t i = 0; i < region.spans.size(); ++i) {
      in.push_back(region.in[i].data());
      out.push_back(region.out[i].data());
    }
    return job_->SubmitShared(rank, sessions_[rank], step, in, out, nullptr,
                              [outcome](const absl::Status& s, bool, double) {
                                outcome->status = s;
                                outcome->ended.Notify();
                              },
                              hyper);
  }

  // Returns once every task submitted to the executor so far has run (it runs them in order).
  void WaitForExecutor() {
    absl::Notification ran;
    executor_->Submit([&ran] { ran.Notify(); });
    ran.WaitForNotification();
  }

  // Step `step` of every rank with `grads` (whole matrices); it must commit.
  void StepAll(const common::JobSpec& spec, int64_t step,
               const std::vector<std::vector<float>>& grads) {
    std::vector<RankRegion> regions;
    for (int r = 0; r < spec.world_size; ++r) regions.push_back(FillRegion(spec, r, grads));
    std::vector<Outcome> outcomes(spec.world_size);
    for (int r = 0; r < spec.world_size; ++r) {
      ASSERT_TRUE(Submit(r, step, regions[r], &outcomes[r]).ok());
    }
    for (Outcome& o : outcomes) {
      o.ended.WaitForNotification();
      ASSERT_TRUE(o.status.ok()) << o.status;
    }
  }

  // Steps 0 .. steps-1 of every rank with fresh gradients; each must commit.
  void StepClean(const common::JobSpec& spec, std::mt19937& rng, int steps) {
    for (int64_t step = 0; step < steps; ++step) {
      ASSERT_NO_FATAL_FAILURE(StepAll(spec, step, RandomGradients(spec, rng)));
    }
  }

  // Steps a job of `spec` with every rank and compares its store with the serial EMA (below).
  void ExpectSerialEma(const common::JobSpec& spec);
  // A job id unique to this device parameter: the metrics registry outlives the test.
  static std::string JobId(const std::string& base) {
    return base + (GetParam() ? "-cpu" : "-simulated");
  }
  // Apply mode: a step whose global clipping recomputes it, with or without a peer that rewrote
  // a gradient after the first pass read it (below).
  void ExpectClipRedo(const std::string& id, bool rewrite);
  // A shared-memory peer that rewrites its gradient after its matrix was computed (below).
  void ExpectRewriteChangesNothing(const std::string& id,
                                   const std::function<void(std::string*)>& rewrite);

  // The momentum store, through a checkpoint (whole matrices, in job order).
  std::vector<std::vector<float>> SavedMomentum() {
    auto info = job_->SaveCheckpoint();
    EXPECT_TRUE(info.ok()) << info.status();
    checkpoint::Store store(job_->checkpoint_dir(), 3);
    auto loaded = store.Load(checkpoint::Selector{});
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    if (!loaded.ok()) return {};
    const std::vector<checkpoint::StateTensor> names = checkpoint::StateTensors(job_->spec());
    EXPECT_EQ(loaded->names.size(), names.size());
    for (size_t m = 0; m < names.size() && m < loaded->names.size(); ++m) {
      EXPECT_EQ(loaded->names[m], names[m].name);
    }
    return loaded->data;
  }

  std::string dir_;
  std::unique_ptr<DeviceStreams> devices_;
  std::unique_ptr<ComputeExecutor> executor_;
  std::shared_ptr<Job> job_;
  std::vector<uint64_t> sessions_;
};

// Elements whose bits differ.
size_t BitDifferences(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  size_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return diff;
}

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

// World 2, ZeRO-2: rank 0 owns all of "a" (complete as soon as rank 0 rings) and the start of
// "b"; rank 1 the rest of "b" and "c".
common::JobSpec TwoRankSpec(const std::string& id) {
  common::JobSpec spec;
  spec.job_id = id;  // unique per device parameter (the metrics registry is process-wide)
  spec.world_size = 2;
  spec.zero_stage = 2;
  spec.matrices = {Matrix("a", {64, 2000}, DType::kBFloat16),
                   Matrix("b", {64, 2000}, DType::kBFloat16),
                   Matrix("c", {16, 16}, DType::kBFloat16)};
  return spec;
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

TEST_P(MomentumCommitTest, GradientMadeNonFiniteBeforeAssemblyRefusesWithMomentumUnchanged) {
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
  }
  const JobReport report = job_->Report();
  EXPECT_FALSE(report.fenced);
  EXPECT_EQ(report.steps_refused, 1);
  EXPECT_EQ(report.next_step, 2);
  const std::vector<std::vector<float>> after = SavedMomentum();
  ASSERT_EQ(after.size(), before.size());
  for (size_t m = 0; m < after.size(); ++m) {
    EXPECT_EQ(BitDifferences(after[m], before[m]), 0u) << spec.matrices[m].name;
  }
}

// Apply mode with global clipping: every step clips (max_grad_norm tiny), so once every tensor is
// done the step computes them all again from the gradients, scaled by the clip coefficient
// (step_pipeline.cc CheckReread). A peer that rewrites its region after "a" was read the first
// time makes the step refused (INVALID_ARGUMENT naming the rank and tensor), with the master
// weights as they were; without the rewrite the same step commits with a redo.
void MomentumCommitTest::ExpectClipRedo(const std::string& id, bool rewrite) {
  common::JobSpec spec = TwoRankSpec(id);
  spec.mode = common::JobMode::kApply;
  spec.groups = {{"all", 1e-3, 0.0}};
  spec.max_grad_norm = 1e-3;
  for (common::MatrixSpec& m : spec.matrices) {
    m.group = "all";
    m.param_dtype = DType::kBFloat16;  // new parameters come back in the regions' update size
  }
  StartJob(spec);
  ASSERT_NE(job_, nullptr);
  std::mt19937 rng(17);
  const std::vector<std::vector<float>> init = RandomGradients(spec, rng);
  for (int r = 0; r < spec.world_size; ++r) {
    std::vector<std::string> w32;
    std::vector<const char*> in;
    for (const common::ShardSpan& span : common::RankSpans(spec, r)) {
      w32.emplace_back(reinterpret_cast<const char*>(init[span.matrix].data() + span.offset),
                       span.length * sizeof(float));
    }
    for (const std::string& w : w32) in.push_back(w.data());
    ASSERT_TRUE(job_->InitParams(r, sessions_[r], in, /*float32=*/true).ok());
  }
  const auto masters = [this] {
    std::vector<std::vector<float>> all;
    int64_t step = 0;
    EXPECT_TRUE(job_->ExportParams(
                        [&all](uint32_t, const std::vector<float>& w) {
                          all.push_back(w);
                          return absl::OkStatus();
                        },
                        &step)
                    .ok());
    return all;
  };
  const std::vector<std::vector<float>> before = masters();
  ASSERT_EQ(before.size(), spec.matrices.size());
  StepHyper hyper;
  hyper.lr = {1e-3};
  hyper.weight_decay = {0.0};
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
    EXPECT_NE(masters(), before);
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
  EXPECT_EQ(masters(), before) << "the masters changed";
}

TEST_P(MomentumCommitTest, ClipRedoRefusesAGradientRewrittenAfterItWasRead) {
  ExpectClipRedo(JobId("clip-reread"), /*rewrite=*/true);
}

TEST_P(MomentumCommitTest, ClipRedoOfAnUnchangedGradientCommits) {
  ExpectClipRedo(JobId("clip-same"), /*rewrite=*/false);
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

}  // namespace
}  // namespace muond::server
