// The fixture of the job-engine commit tests (momentum_commit_test.cc: update mode;
// apply_commit_test.cc: apply mode): a Job on the CPU device (in place) and on the simulated one
// (staged copies), driven through SubmitShared as the shared-memory server drives it (the test
// holds the ranks' gradient memory, as a peer holds its region).
#ifndef MUOND_TESTS_UNIT_SERVER_MOMENTUM_COMMIT_FIXTURE_H_
#define MUOND_TESTS_UNIT_SERVER_MOMENTUM_COMMIT_FIXTURE_H_

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
#include "server/engine/compute_executor.h"
#include "server/engine/momentum_store.h"
#include "server/engine/param_store.h"
#include "server/engine/state_buffers.h"
#include "server/jobs/job_impl.h"
#include "server/optim/muon_math.h"
#include "server/storage/checkpoint.h"

namespace muond::server::commit_test {

using common::DType;

inline common::MatrixSpec Matrix(const std::string& name, std::vector<int64_t> shape, DType dtype) {
  common::MatrixSpec m;
  m.name = name;
  m.shape = std::move(shape);
  m.dtype = dtype;
  return m;
}

// One step's whole-matrix gradients, each value exactly representable in its matrix's dtype (so
// the widened bytes the job reads are these floats).
inline std::vector<std::vector<float>> RandomGradients(const common::JobSpec& spec,
                                                       std::mt19937& rng) {
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

inline RankRegion FillRegion(const common::JobSpec& spec, int rank,
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
  uint32_t flags = 0;       // kDoneSkipped, kDoneReplayed
  double grad_sum_sq = -1;  // the completion's sum of squares
};

// Run on the cpu device (the step computes in place: the committed momentum read where it is
// stored, the new one written by the kernel into the store's back buffer) and on the simulated
// device (the staged path: copies to and from its buffers).
class CommitFixture : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/momentum-commit-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    const device::SimulatedOptions simulated;
    const bool in_place = GetParam();
    auto devices = DeviceStreams::Create(device::NewHostDevice(2, in_place ? nullptr : &simulated),
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
    JobParts parts;
    parts.executor = executor_.get();
    parts.gather_budget_bytes = uint64_t{256} << 20;
    parts.batch_target_bytes = batch_target_bytes_;
    parts.devices = devices_.get();
    parts.backend = "cpu";
    parts.checkpoint_dir = absl::StrCat(dir_, "/", spec.job_id);
    parts.step_timeout = absl::Seconds(120);
    job_ = std::make_shared<JobImpl>(spec, std::string(32, 'k'), JobOwner{}, std::move(parts));
    sessions_.clear();
    for (int r = 0; r < spec.world_size; ++r) {
      auto session = job_->Attach(r, /*takeover=*/false);
      ASSERT_TRUE(session.ok()) << session.status();
      sessions_.push_back(*session);
    }
  }

  // Rings for `rank`: the job checks the region's values and enters the rank into the step.
  // `outside`: update mode with max_grad_norm, the rank's share of the norm.
  absl::Status Submit(int rank, int64_t step, RankRegion& region, Outcome* outcome,
                      const StepHyper* hyper = nullptr, double outside = 0) {
    std::vector<const char*> in;
    std::vector<char*> out;
    for (size_t i = 0; i < region.spans.size(); ++i) {
      in.push_back(region.in[i].data());
      out.push_back(region.out[i].data());
    }
    return job_->SubmitShared(
        rank, sessions_[rank], step, in, out, nullptr,
        [outcome](const absl::Status& s, uint32_t flags, double, double sum_sq) {
          outcome->status = s;
          outcome->flags = flags;
          outcome->grad_sum_sq = sum_sq;
          outcome->ended.Notify();
        },
        hyper, {}, outside);
  }

  // Returns once every task submitted to the executor so far has run (it runs them in order).
  void WaitForExecutor() {
    absl::Notification ran;
    executor_->Submit([&ran] { ran.Notify(); });
    ran.WaitForNotification();
  }

  // Step `step` of every rank with `grads` (whole matrices; `hyper` for apply mode); it must
  // commit. Returns the ranks' regions (their results).
  std::vector<RankRegion> StepRegions(const common::JobSpec& spec, int64_t step,
                                      const std::vector<std::vector<float>>& grads,
                                      const StepHyper* hyper = nullptr) {
    std::vector<RankRegion> regions;
    for (int r = 0; r < spec.world_size; ++r) regions.push_back(FillRegion(spec, r, grads));
    std::vector<Outcome> outcomes(spec.world_size);
    for (int r = 0; r < spec.world_size; ++r) {
      EXPECT_TRUE(Submit(r, step, regions[r], &outcomes[r], hyper).ok());
    }
    for (Outcome& o : outcomes) {
      o.ended.WaitForNotification();
      EXPECT_TRUE(o.status.ok()) << o.status;
    }
    return regions;
  }
  void StepAll(const common::JobSpec& spec, int64_t step,
               const std::vector<std::vector<float>>& grads, const StepHyper* hyper = nullptr) {
    StepRegions(spec, step, grads, hyper);
  }

  // Apply mode: every rank uploads its spans of `init` (whole tensors, fp32) as its initial
  // weights.
  void InitWeights(const common::JobSpec& spec, const std::vector<std::vector<float>>& init) {
    for (int r = 0; r < spec.world_size; ++r) {
      std::vector<const char*> in;
      for (const common::ShardSpan& span : common::RankSpans(spec, r)) {
        in.push_back(reinterpret_cast<const char*>(init[span.matrix].data() + span.offset));
      }
      EXPECT_TRUE(job_->InitParams(r, sessions_[r], in, /*float32=*/true).ok());
    }
  }

  // Apply mode: the masters at a step boundary, per tensor.
  std::vector<std::vector<float>> Masters() {
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
  }

  // Steps 0 .. steps-1 of every rank with fresh gradients; each must commit.
  void StepClean(const common::JobSpec& spec, std::mt19937& rng, int steps) {
    for (int64_t step = 0; step < steps; ++step) {
      ASSERT_NO_FATAL_FAILURE(StepAll(spec, step, RandomGradients(spec, rng)));
    }
  }

  // A job id unique to this device parameter: the metrics registry outlives the test.
  static std::string JobId(const std::string& base) {
    return base + (GetParam() ? "-cpu" : "-simulated");
  }

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
  uint64_t batch_target_bytes_ = StepPipeline::kBatchTargetBytes;  // set before StartJob
  std::unique_ptr<DeviceStreams> devices_;
  std::unique_ptr<ComputeExecutor> executor_;
  std::shared_ptr<JobImpl> job_;
  std::vector<uint64_t> sessions_;
};

// Elements whose bits differ.
inline size_t BitDifferences(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  size_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return diff;
}

// World 2, ZeRO-2: rank 0 owns all of "a" (complete as soon as rank 0 rings) and the start of
// "b"; rank 1 the rest of "b" and "c".
inline common::JobSpec TwoRankSpec(const std::string& id) {
  common::JobSpec spec;
  spec.job_id = id;  // unique per device parameter (the metrics registry is process-wide)
  spec.world_size = 2;
  spec.zero_stage = 2;
  spec.matrices = {Matrix("a", {64, 2000}, DType::kBFloat16),
                   Matrix("b", {64, 2000}, DType::kBFloat16),
                   Matrix("c", {16, 16}, DType::kBFloat16)};
  return spec;
}

}  // namespace muond::server::commit_test

#endif  // MUOND_TESTS_UNIT_SERVER_MOMENTUM_COMMIT_FIXTURE_H_
