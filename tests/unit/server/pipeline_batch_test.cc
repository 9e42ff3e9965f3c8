// How much a step assembles at once (StepPipeline::kBatchTargetBytes), in process on the fixture
// of momentum_commit_fixture.h (cpu in place: 4 bytes an element assembled; simulated staged: 8):
// with every matrix ready at once, the batches stay at the batch target (a matrix larger than it
// alone), so at most kDepth of them are assembled at once whatever the gather budget allows; a
// target as large as the budget's third assembles the whole step at once. The knob is shrunk so
// that a small model shows what a large one does with the default. Both give the serial EMA.
#include <algorithm>
#include <string>
#include <vector>

#include "tests/unit/server/momentum_commit_fixture.h"

namespace muond::server {
namespace {

using commit_test::BitDifferences;
using commit_test::Matrix;
using commit_test::RandomGradients;
using common::DType;

class PipelineBatchTest : public commit_test::CommitFixture {
 protected:
  // World 1: every matrix is ready when the rank rings. 12 matrices of 64 x 256.
  common::JobSpec TwelveMatrices(const std::string& id) {
    common::JobSpec spec;
    spec.job_id = id;
    for (int i = 0; i < 12; ++i) {
      spec.matrices.push_back(Matrix("m" + std::to_string(i), {64, 256}, DType::kBFloat16));
    }
    return spec;
  }
  // Steps the job three times; returns the gather peak, after checking the momentum against the
  // serial EMA.
  uint64_t StepAndPeak(const common::JobSpec& spec) {
    StartJob(spec);
    std::mt19937 rng(7);
    std::vector<std::vector<float>> reference;
    for (const common::MatrixSpec& m : spec.matrices) reference.emplace_back(m.numel(), 0.0f);
    for (int64_t step = 0; step < 3; ++step) {
      const std::vector<std::vector<float>> grads = RandomGradients(spec, rng);
      StepAll(spec, step, grads);
      for (size_t m = 0; m < spec.matrices.size(); ++m) {
        ApplyMomentum(spec.muon, grads[m].data(), reference[m].data(), reference[m].size());
      }
    }
    const std::vector<std::vector<float>> saved = SavedMomentum();
    EXPECT_EQ(saved.size(), reference.size());
    for (size_t m = 0; m < saved.size() && m < reference.size(); ++m) {
      EXPECT_EQ(BitDifferences(saved[m], reference[m]), 0u) << spec.matrices[m].name;
    }
    return job_->Report().gather_peak_bytes;
  }
};

TEST_P(PipelineBatchTest, BatchesStayAtTheTargetWhateverTheBudgetAllows) {
  const uint64_t per_element = GetParam() ? 4 : 8;
  const uint64_t matrix = 64 * 256 * per_element;
  // A target of two matrices: kDepth batches of two at most.
  batch_target_bytes_ = 2 * matrix;
  const uint64_t bounded = StepAndPeak(TwelveMatrices(JobId("batch-small")));
  EXPECT_GE(bounded, 2 * matrix);
  EXPECT_LE(bounded, static_cast<uint64_t>(DeviceStreams::kDepth) * 2 * matrix)
      << "more than kDepth batches of the target assembled at once";
  // A target smaller than one matrix: each matrix alone.
  batch_target_bytes_ = matrix / 2;
  const uint64_t alone = StepAndPeak(TwelveMatrices(JobId("batch-alone")));
  EXPECT_LE(alone, static_cast<uint64_t>(DeviceStreams::kDepth) * matrix);
  // The target at the budget's third (256 MiB here): the whole step at once.
  batch_target_bytes_ = StepPipeline::kBatchTargetBytes;
  const uint64_t whole = StepAndPeak(TwelveMatrices(JobId("batch-whole")));
  EXPECT_EQ(whole, 12 * matrix);
}

INSTANTIATE_TEST_SUITE_P(Devices, PipelineBatchTest, ::testing::Values(true, false),
                         [](const auto& info) {
                           return info.param ? std::string("CpuInPlace")
                                             : std::string("SimulatedStaged");
                         });

}  // namespace
}  // namespace muond::server
