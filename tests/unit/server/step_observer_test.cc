// StepObserver (server/engine/step_observer.h), TrainerClock (trainer_clock.h) and the metrics they
// record (server/record/optimizer_metrics.h), without a daemon: shape classes and their cap, the FLOP
// split of a batch's time, the orthogonality sample's rotation, when a step counts as delivered,
// and the removal of a deleted job's series.
#include "server/engine/step_observer.h"

#include <set>
#include <string>
#include <vector>

#include "common/metrics.h"
#include "gtest/gtest.h"
#include "server/jobs/trainer_clock.h"
#include "server/optim/muon_math.h"
#include "server/record/optimizer_metrics.h"

namespace muond::server {
namespace {

bool Has(const std::string& line) {
  return ("\n" + common::DefaultRegistry().Serialize()).find("\n" + line + "\n") !=
         std::string::npos;
}

double Sample(const std::string& series) {
  const std::string text = "\n" + common::DefaultRegistry().Serialize();
  const size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + series.size() + 2));
}

common::MatrixSpec Matrix(std::string name, std::vector<int64_t> shape) {
  common::MatrixSpec m;
  m.name = std::move(name);
  m.shape = std::move(shape);
  return m;
}

TEST(StepObserverTest, ShapeClassesAreTheJobsShapesUpToTheCap) {
  common::JobSpec spec;
  spec.job_id = "obs-classes";
  spec.matrices = {Matrix("a", {64, 128}), Matrix("b", {64, 128}), Matrix("c", {4, 32, 16})};
  StepObserver small(spec, "cpu");
  EXPECT_EQ(small.ShapeClassOf(0), "64x128");
  EXPECT_EQ(small.ShapeClassOf(1), "64x128");
  EXPECT_EQ(small.ShapeClassOf(2), "4x32x16");
  const std::vector<StepObserver::ShapeTime> t = small.ShapeTimes();
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].per_step, 2u);
  EXPECT_EQ(t[1].per_step, 1u);

  // 40 distinct shapes: the 32 with the most FLOPs keep a class, the 8 lightest share "other".
  common::JobSpec many;
  many.job_id = "obs-many";
  for (int i = 1; i <= 40; ++i)
    many.matrices.push_back(Matrix("m" + std::to_string(i), {8 * i, 64}));
  StepObserver capped(many, "cpu");
  const std::vector<StepObserver::ShapeTime> c = capped.ShapeTimes();
  ASSERT_EQ(c.size(), StepObserver::kMaxShapeClasses + 1);
  EXPECT_EQ(c.back().shape, "other");
  EXPECT_EQ(c.back().per_step, 8u);
  EXPECT_EQ(capped.ShapeClassOf(0), "other");    // 8x64: among the lightest
  EXPECT_EQ(capped.ShapeClassOf(39), "320x64");  // the heaviest
}

TEST(StepObserverTest, ABatchsTimeIsSharedByNewtonSchulzFlops) {
  common::JobSpec spec;
  spec.job_id = "obs-share";
  spec.matrices = {Matrix("small", {32, 64}), Matrix("large", {64, 128})};
  StepObserver observer(spec, "cpu");
  const double fs = NewtonSchulzFlops(spec.muon, spec.matrices[0]);
  const double fl = NewtonSchulzFlops(spec.muon, spec.matrices[1]);
  observer.Attribute({0, 1}, 0.9);
  const std::vector<StepObserver::ShapeTime> t = observer.ShapeTimes();
  ASSERT_EQ(t.size(), 2u);
  EXPECT_NEAR(t[0].seconds, 0.9 * fs / (fs + fl), 1e-12);
  EXPECT_NEAR(t[1].seconds, 0.9 * fl / (fs + fl), 1e-12);
  EXPECT_EQ(t[0].matrices, 1u);
  const std::string series =
      "muond_newton_schulz_seconds_sum{backend=\"cpu\",dtype=\"float32\",muond_job=\"obs-share\","
      "shape=\"64x128\"}";
  EXPECT_NEAR(Sample(series), 0.9 * fl / (fs + fl), 1e-9);
  // Nothing is recorded for a negative or NaN time (a device clock that went backwards).
  observer.Attribute({0, 1}, -1);
  EXPECT_EQ(observer.ShapeTimes()[1].matrices, 1u);
}

TEST(StepObserverTest, TheOrthogonalitySampleRotatesOverEveryMuonMatrix) {
  common::JobSpec spec;
  spec.job_id = "obs-sample";
  for (int i = 0; i < 10; ++i) spec.matrices.push_back(Matrix("m" + std::to_string(i), {8, 8}));
  StepObserver observer(spec, "cpu");
  SetOrthogonalityEvery(5);
  std::set<uint32_t> seen;
  for (int64_t step = 0; step < 30; ++step) {
    size_t sampled = 0;
    for (uint32_t m = 0; m < 10; ++m) {
      if (!observer.Samples(step, m)) continue;
      EXPECT_EQ(step % 5, 0) << step;
      ++sampled;
      seen.insert(m);
    }
    if (step % 5 == 0) {
      EXPECT_GE(sampled, 1u) << step;
      EXPECT_LE(sampled, StepObserver::kOrthogonalitySample) << step;
    }
  }
  EXPECT_EQ(seen.size(), 10u);  // 3 sampled steps (stride 3) covered every matrix
  SetOrthogonalityEvery(0);
  EXPECT_FALSE(observer.Samples(0, 0));
  SetOrthogonalityEvery(100);
}

TEST(StepObserverTest, MeasureKeepsTheStepsWorstValue) {
  common::JobSpec spec;
  spec.job_id = "obs-measure";
  spec.muon.scale_mode = common::ScaleMode::kNone;
  spec.matrices = {Matrix("a", {2, 2}), Matrix("b", {2, 2})};
  StepObserver observer(spec, "cpu");
  const float identity[] = {1, 0, 0, 1};
  const float doubled[] = {2, 0, 0, 2};  // G = 4 I: ||G - I|| / sqrt(2) = 3
  observer.Measure(0, 0, identity);
  observer.Measure(0, 1, doubled);
  auto o = observer.LastOrthogonality();
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->step, 0);
  EXPECT_EQ(o->matrices, 2);
  EXPECT_NEAR(o->value, 3.0, 1e-6);
  EXPECT_NEAR(Sample("muond_update_orthogonality{muond_job=\"obs-measure\"}"), 3.0, 1e-6);
  observer.Measure(100, 0, identity);  // a new sampled step starts over
  o = observer.LastOrthogonality();
  EXPECT_EQ(o->step, 100);
  EXPECT_NEAR(o->value, 0.0, 1e-6);
  EXPECT_EQ(Sample("muond_orthogonality_checks_total{muond_job=\"obs-measure\"}"), 3);
}

TEST(TrainerClockTest, AStepWithoutGrpcRanksIsTimedAtRelease) {
  TrainerClock clock("clock-shm");
  const absl::Time t0 = absl::UnixEpoch() + absl::Seconds(1000);
  clock.Released(4, t0, t0 + absl::Milliseconds(30), 0, t0 + absl::Milliseconds(50));
  const auto last = clock.last();
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->step, 4);
  EXPECT_NEAR(last->visible_seconds, 0.050, 1e-9);
  EXPECT_NEAR(last->wait_seconds, 0.020, 1e-9);
  EXPECT_TRUE(Has("muond_step_trainer_visible_seconds_count{muond_job=\"clock-shm\"} 1"));
  EXPECT_TRUE(Has("muond_step_trainer_wait_seconds_sum{muond_job=\"clock-shm\"} 0.02"));
}

TEST(TrainerClockTest, AStepWithGrpcRanksIsTimedWhenTheLastWasSentItsUpdate) {
  TrainerClock clock("clock-grpc");
  const absl::Time t0 = absl::UnixEpoch() + absl::Seconds(2000);
  clock.Released(7, t0, t0 + absl::Milliseconds(10), 2, t0 + absl::Milliseconds(20));
  EXPECT_FALSE(clock.last().has_value());
  clock.Sent(6, t0 + absl::Milliseconds(25));  // another step's delivery: ignored
  clock.Sent(7, t0 + absl::Milliseconds(30));
  EXPECT_FALSE(clock.last().has_value());
  clock.Sent(7, t0 + absl::Milliseconds(40));
  ASSERT_TRUE(clock.last().has_value());
  EXPECT_NEAR(clock.last()->visible_seconds, 0.040, 1e-9);
  EXPECT_NEAR(clock.last()->wait_seconds, 0.030, 1e-9);
  clock.Sent(7, t0 + absl::Milliseconds(90));  // a replay after it was timed: not timed again
  EXPECT_NEAR(clock.last()->visible_seconds, 0.040, 1e-9);
  // A step whose gRPC rank never received its update is not timed; the next step replaces it.
  clock.Released(8, t0, t0, 1, t0 + absl::Milliseconds(5));
  clock.Released(9, t0, t0, 0, t0 + absl::Milliseconds(6));
  EXPECT_EQ(clock.last()->step, 9);
  EXPECT_TRUE(Has("muond_step_trainer_visible_seconds_count{muond_job=\"clock-grpc\"} 2"));
}

TEST(OptimizerMetricsTest, PressureGaugesAndTheirRemovalWithTheJob) {
  JobPressure p;
  p.matrices_waiting = 3;
  p.gather_in_use_bytes = 4096;
  p.momentum_bytes = 10;
  p.masters_bytes = 20;
  p.moments_bytes = 30;
  p.session_region_bytes = 40;
  p.staging_bytes = 50;
  SetJobPressure("press", p);
  RecordNewtonSchulz("press", "8x8", "float32", "cpu", 0.001);
  EXPECT_TRUE(Has("muond_job_matrices_waiting{muond_job=\"press\"} 3"));
  EXPECT_TRUE(Has("muond_job_gather_in_use_bytes{muond_job=\"press\"} 4096"));
  EXPECT_TRUE(Has("muond_job_pinned_bytes{kind=\"masters\",muond_job=\"press\"} 20"));
  EXPECT_TRUE(Has("muond_job_pinned_bytes{kind=\"session_regions\",muond_job=\"press\"} 40"));
  EXPECT_TRUE(Has("muond_job_pinned_bytes{kind=\"staging\",muond_job=\"press\"} 50"));
  RemoveJobsNotIn({});
  const std::string text = common::DefaultRegistry().Serialize();
  EXPECT_EQ(text.find("muond_job=\"press\""), std::string::npos) << text;
}

}  // namespace
}  // namespace muond::server
