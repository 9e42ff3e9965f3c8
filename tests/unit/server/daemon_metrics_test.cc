// server/record/daemon_metrics.h: the Record* functions land in the default registry under the documented
// names, labels and units (the scrape-time collector is covered end to end by
// tests/metrics/muond_live_test.sh against the real daemon).
#include "server/ops/metrics_collector.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "gtest/gtest.h"

namespace muond::server {
namespace {

bool Has(const std::string& text, const std::string& line) {
  return text.find("\n" + line + "\n") != std::string::npos;
}

TEST(DaemonMetricsTest, PhaseNames) {
  EXPECT_STREQ(StepPhaseName(StepPhase::kAssembly), "assembly");
  EXPECT_STREQ(StepPhaseName(StepPhase::kCopyIn), "copy_in");
  EXPECT_STREQ(StepPhaseName(StepPhase::kNewtonSchulz), "newton_schulz");
  EXPECT_STREQ(StepPhaseName(StepPhase::kWriteback), "writeback");
  EXPECT_STREQ(StepPhaseName(StepPhase::kReturn), "return");
}

TEST(DaemonMetricsTest, RecordsStepsPhasesBytesAndErrors) {
  RecordStepCompleted("unit-a", 0.003);
  RecordStepCompleted("unit-a", 0.005);
  RecordPhase("unit-a", StepPhase::kNewtonSchulz, 0.002);
  RecordBytes(Transport::kGrpc, Direction::kIn, 1000);
  RecordBytes(Transport::kGrpc, Direction::kIn, 24);
  RecordBytes(Transport::kShm, Direction::kOut, 4096);
  RecordRpcError("Step", absl::StatusCode::kFailedPrecondition);
  RecordRpcError("Step", absl::StatusCode::kFailedPrecondition);
  RecordRpcError("GetJob", absl::StatusCode::kPermissionDenied);
  const std::string text = "\n" + common::DefaultRegistry().Serialize();
  EXPECT_TRUE(Has(text, "muond_step_duration_seconds_count{muond_job=\"unit-a\"} 2")) << text;
  EXPECT_TRUE(Has(text, "muond_step_duration_seconds_sum{muond_job=\"unit-a\"} 0.008")) << text;
  // 0.003 and 0.005 fall in the 0.004 and 0.008 buckets (0.001 * 2^k).
  EXPECT_TRUE(Has(text, "muond_step_duration_seconds_bucket{muond_job=\"unit-a\",le=\"0.002\"} 0"));
  EXPECT_TRUE(Has(text, "muond_step_duration_seconds_bucket{muond_job=\"unit-a\",le=\"0.004\"} 1"));
  EXPECT_TRUE(Has(text, "muond_step_duration_seconds_bucket{muond_job=\"unit-a\",le=\"0.008\"} 2"));
  EXPECT_TRUE(Has(text, "muond_step_duration_seconds_bucket{muond_job=\"unit-a\",le=\"+Inf\"} 2"));
  EXPECT_TRUE(Has(text,
                  "muond_step_phase_duration_seconds_count{muond_job=\"unit-a\",phase=\"newton_"
                  "schulz\"} 1"))
      << text;
  EXPECT_TRUE(Has(text, "muond_transfer_bytes_total{direction=\"in\",transport=\"grpc\"} 1024"));
  EXPECT_TRUE(Has(text, "muond_transfer_bytes_total{direction=\"out\",transport=\"shm\"} 4096"));
  EXPECT_TRUE(Has(text, "muond_transfer_bytes_total{direction=\"in\",transport=\"shm\"} 0"));
  EXPECT_TRUE(Has(text, "muond_rpc_errors_total{code=\"FAILED_PRECONDITION\",rpc=\"Step\"} 2"));
  EXPECT_TRUE(Has(text, "muond_rpc_errors_total{code=\"PERMISSION_DENIED\",rpc=\"GetJob\"} 1"));
  EXPECT_TRUE(Has(text, "# TYPE muond_step_duration_seconds histogram"));
  EXPECT_TRUE(Has(text, "# TYPE muond_transfer_bytes_total counter"));
}

TEST(DaemonMetricsTest, CpuModelNameIsNotEmpty) { EXPECT_FALSE(CpuModelName().empty()); }

}  // namespace
}  // namespace muond::server
