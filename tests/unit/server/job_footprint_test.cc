// The admission footprint counts every byte a job can hold (issue: hardening, second round, item
// 7): state, tables, step buffers and shared-memory regions, the save's copy and the gathered
// matrices, so --max-state-bytes bounds all of it.
#include "server/jobs/job_footprint.h"

#include "common/shm_protocol.h"
#include "gtest/gtest.h"
#include "server/device/device_streams.h"
#include "server/engine/state_buffers.h"
#include "server/engine/step_pipeline.h"

namespace muond::server {
namespace {

common::MatrixSpec Matrix(const std::string& name, std::vector<int64_t> shape,
                          common::DType dtype = common::DType::kFloat32) {
  common::MatrixSpec m;
  m.name = name;
  m.shape = std::move(shape);
  m.dtype = dtype;
  m.param_dtype = dtype;
  return m;
}

TEST(JobFootprintTest, CountsStepBuffersRegionsSaveCopyAndGather) {
  common::JobSpec spec;
  spec.job_id = "f";
  spec.world_size = 2;
  spec.zero_stage = 2;
  spec.matrices = {Matrix("a", {256, 128}), Matrix("b", {128, 128}, common::DType::kBFloat16)};
  const uint64_t n_a = 256 * 128, n_b = 128 * 128;
  auto f = MeasureJob(spec, /*daemon_gather_budget_bytes=*/uint64_t{1} << 30);
  ASSERT_TRUE(f.ok()) << f.status();
  // Update mode: the fp32 momentum once, and the step window: the daemon's default is larger
  // than the whole state, so the whole state.
  EXPECT_EQ(f->state_bytes, (n_a + n_b) * 4);
  EXPECT_EQ(f->window_bytes, f->state_bytes);
  // B = U = the gradients' bytes in their dtypes (+ 64 bytes of padding per rank): the regions'
  // four buffers, each rank's hyper block, ring and pages, and the replay copy.
  const uint64_t b = n_a * 4 + n_b * 2 + 2 * 64;
  const uint64_t per_rank = 4 * (common::shm::HyperBytes(spec.groups.size(), 2) + 128) +
                            common::shm::kRingBytes + 3 * 4096;
  EXPECT_EQ(f->step_bytes, 4 * (b - 2 * 64) + 2 * per_rank + b);
  // The save's copy-on-write (the state) and the writer's staging of the largest tensor (fp32).
  EXPECT_EQ(f->save_copy_bytes, f->state_bytes + n_a * 4);
  // The gather budget is larger than every matrix assembled at once (8 bytes per element).
  EXPECT_EQ(f->gather_bytes, (n_a + n_b) * 8);
  // Newton-Schulz scratch: both matrices fit the scratch budget: X, next X, A and P in fp32.
  EXPECT_EQ(f->scratch_bytes, (2 * n_a + 2 * 128 * 128 + 2 * n_b + 2 * 128 * 128) * 4);
  EXPECT_EQ(f->total(), f->state_bytes + f->window_bytes + f->table_bytes + f->step_bytes +
                            f->save_copy_bytes + f->gather_bytes + f->scratch_bytes);
  const JobMemory kinds = f->kinds();
  EXPECT_EQ(kinds.total(), f->total()) << "the kinds are the footprint, split";
  EXPECT_EQ(kinds.state, kinds.step_window);
  EXPECT_EQ(kinds.replay, n_a * 4 + n_b * 2 + 2 * 64);
  // A job's own budget below that bounds the gathered bytes.
  spec.gather_budget_bytes = 4096;
  f = MeasureJob(spec, uint64_t{1} << 30);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->gather_bytes, 4096u);
}

// The pipeline assembles at most kDepth batches of the batch target (or of one matrix, when a
// matrix is larger): a model larger than that reserves those, not the whole budget.
TEST(JobFootprintTest, GatherIsAtMostKDepthBatches) {
  common::JobSpec spec;
  spec.job_id = "g";
  for (int i = 0; i < 64; ++i)
    spec.matrices.push_back(Matrix("m" + std::to_string(i), {1024, 1024}));
  auto f = MeasureJob(spec, /*daemon_gather_budget_bytes=*/uint64_t{1} << 30);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->gather_bytes, DeviceStreams::kDepth * StepPipeline::kBatchTargetBytes);
  // Compressed momentum: 12 bytes an element, the same batches.
  spec.state.momentum = common::StateDType::kInt8;
  f = MeasureJob(spec, uint64_t{1} << 30);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->gather_bytes, DeviceStreams::kDepth * StepPipeline::kBatchTargetBytes);
  // One matrix larger than the target: kDepth of it, within the budget.
  spec.state.momentum = common::StateDType::kFloat32;
  spec.matrices = {Matrix("big", {4096, 4096}), Matrix("small", {16, 16})};
  f = MeasureJob(spec, uint64_t{1} << 30);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->gather_bytes, std::min<uint64_t>(uint64_t{1} << 30, (4096 * 4096 + 256) * 8));
  spec.matrices = {Matrix("big", {4096, 4096}), Matrix("big2", {4096, 4096})};
  f = MeasureJob(spec, uint64_t{1} << 30);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->gather_bytes, uint64_t{2} * 4096 * 4096 * 8) << "all of it: below kDepth batches";
  f = MeasureJob(spec, uint64_t{200} << 20);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->gather_bytes, uint64_t{200} << 20) << "the budget bounds it";
}

// The gather reserves what the pipeline assembles per matrix on the daemon's device
// (StepPipeline::AssembledBytesOf): a staged device (the default) the fp32 gradient and momentum
// (and the momentum's fp32 decoding when it is held compressed), the cpu device that computes in
// place only the gradient; AdamW tensors only the gradient on either.
TEST(JobFootprintTest, GatherCountsWhatTheDeviceAssembles) {
  common::JobSpec spec;
  spec.job_id = "d";
  spec.matrices = {Matrix("a", {256, 256}), Matrix("b", {128, 512})};
  const uint64_t n = 2 * 256 * 256;
  const uint64_t budget = uint64_t{1} << 30;
  const auto gather = [&](bool in_host) {
    auto f = MeasureJob(spec, budget, kDefaultStepWindowBytes, in_host);
    EXPECT_TRUE(f.ok()) << f.status();
    return f.ok() ? f->gather_bytes : 0;
  };
  EXPECT_EQ(gather(false), n * 8);
  EXPECT_EQ(gather(true), n * 4) << "the cpu device reads the momentum in place";
  spec.state.momentum = common::StateDType::kInt8;
  EXPECT_EQ(gather(false), n * 12) << "the staged momentum's fp32 decoding";
  EXPECT_EQ(gather(true), n * 4) << "the cpu kernel decodes block by block";
  spec.state.momentum = common::StateDType::kFloat32;
  spec.mode = common::JobMode::kApply;
  spec.groups = {{"g", 0.01, 0.0}};
  for (common::MatrixSpec& m : spec.matrices) m.group = "g";
  spec.matrices[1].optimizer = common::Optimizer::kAdamW;
  EXPECT_EQ(gather(false), n / 2 * 8 + n / 2 * 4) << "AdamW assembles only its gradient";
  EXPECT_EQ(gather(true), n * 4);
  for (const common::MatrixSpec& m : spec.matrices) {
    EXPECT_EQ(StepPipeline::AssembledBytesOf(spec, m, false),
              static_cast<uint64_t>(m.numel()) * (m.optimizer == common::Optimizer::kAdamW ? 4 : 8))
        << m.name;
  }
}

// Compressed state (JobSpec::state): the state and the window count the held bytes, each array
// a whole number of 32-bit words: update mode int8 momentum, n + 4 per 2048-block; apply mode the
// fp32 masters plus bf16 AdamW moments.
TEST(JobFootprintTest, CompressedStateCountsTheHeldBytes) {
  common::JobSpec spec;
  spec.job_id = "h";
  spec.matrices = {Matrix("a", {100, 41})};  // 4100 elements: 3 blocks, 4100 code bytes
  spec.state.momentum = common::StateDType::kInt8;
  auto f = MeasureJob(spec, uint64_t{1} << 30);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->state_bytes, 4100u + 3 * 4);
  EXPECT_EQ(f->window_bytes, f->state_bytes);
  spec.mode = common::JobMode::kApply;
  spec.groups = {{"g", 0.01, 0.0}};
  spec.matrices.push_back(Matrix("b", {7}));
  spec.matrices[1].optimizer = common::Optimizer::kAdamW;
  for (common::MatrixSpec& m : spec.matrices) m.group = "g";
  spec.state.adamw = common::StateDType::kBFloat16;
  f = MeasureJob(spec, uint64_t{1} << 30);
  ASSERT_TRUE(f.ok()) << f.status();
  // a: master 4100 x 4 + int8 momentum; b: master 7 x 4 + two bf16 arrays of 14 -> 16 bytes.
  EXPECT_EQ(f->state_bytes, 4100u * 4 + 4100 + 3 * 4 + 7 * 4 + 2 * 16);
}

// The step window: the job's own (at least its largest tensor's state), the daemon's default
// where it sets none, never more than the whole state (global clipping included); a whole second
// copy for the jobs that roll a committed step back (two-phase commits).
TEST(JobFootprintTest, StepWindowIsBoundedExceptForJobsThatKeepTwoCopies) {
  common::JobSpec spec;
  spec.job_id = "w";
  spec.matrices = {Matrix("a", {256, 128}), Matrix("b", {128, 128})};
  const uint64_t n_a = 256 * 128, n_b = 128 * 128;
  EXPECT_EQ(StepWindowBytes(spec, uint64_t{1} << 30), (n_a + n_b) * 4) << "at most the state";
  EXPECT_EQ(StepWindowBytes(spec, 1), n_a * 4) << "at least the largest tensor's state";
  spec.step_window_bytes = n_a * 4 + 8;
  EXPECT_EQ(StepWindowBytes(spec, 1), n_a * 4 + 8) << "the job's own";
  auto f = MeasureJob(spec, uint64_t{1} << 30);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->window_bytes, n_a * 4 + 8);
  EXPECT_EQ(f->kinds().step_window, n_a * 4 + 8);
  EXPECT_EQ(f->kinds().state, (n_a + n_b) * 4);
  spec.mode = common::JobMode::kApply;  // a Muon tensor's master and momentum
  spec.step_window_bytes = 0;
  EXPECT_EQ(StepWindowBytes(spec, 1), n_a * 8);
  spec.max_grad_norm = 1.0;  // clipping decides at the seal: one copy, the window bounded
  EXPECT_FALSE(KeepsTwoCopies(spec));
  EXPECT_EQ(StepWindowBytes(spec, 1), n_a * 8);
  spec.multinode.nodes = 2;  // a two-phase job rolls a committed step back
  EXPECT_TRUE(KeepsTwoCopies(spec));
  EXPECT_EQ(StepWindowBytes(spec, 1), StateBuffers::kTwoCopies);
  f = MeasureJob(spec, uint64_t{1} << 30, /*daemon_step_window_bytes=*/1);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->window_bytes, f->state_bytes) << "two copies: the window is a whole copy";
}

TEST(JobFootprintTest, ApplyModeBuffersAreInTheParamDtype) {
  common::JobSpec spec;
  spec.job_id = "g";
  spec.world_size = 1;
  spec.mode = common::JobMode::kApply;
  common::MatrixSpec w = Matrix("w", {64, 64});
  w.param_dtype = common::DType::kBFloat16;
  spec.matrices = {w};
  auto f = MeasureJob(spec, 0);
  ASSERT_TRUE(f.ok()) << f.status();
  // Gradients fp32, updates (new parameters) bf16: each region buffer holds the larger.
  const uint64_t u = 64 * 64 * 2 + 64;
  const uint64_t per_rank = 4 * (common::shm::HyperBytes(spec.groups.size(), 1) + 128) +
                            common::shm::kRingBytes + 3 * 4096;
  // No replay copy: a replay's new parameters are written from the masters.
  EXPECT_EQ(f->update_bytes, u);
  EXPECT_EQ(f->step_bytes, 4 * 64 * 64 * 4 + per_rank);
  EXPECT_EQ(f->kinds().replay, 0u);
  EXPECT_EQ(f->gather_bytes, 0u) << "no budget given: none counted";
}

}  // namespace
}  // namespace muond::server
