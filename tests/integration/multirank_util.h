// Helpers for the multi-rank tests: deterministic gradients, the world-size-1 whole-matrix
// reference trajectory, and ranks stepping concurrently, one thread and one Client each.
//
// Gradients and updates are kept per step and matrix as the matrix's raw bytes (its dtype), so
// that a rank's update spans can be compared bit for bit with slices of the whole-matrix update.
// Thread-safe: the functions share no state.
#ifndef MUOND_TESTS_INTEGRATION_MULTIRANK_UTIL_H_
#define MUOND_TESTS_INTEGRATION_MULTIRANK_UTIL_H_

#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "gtest/gtest.h"

namespace muond::integration {

// [step][matrix] -> whole-matrix bytes in the matrix's dtype.
using MatrixBytes = std::vector<std::vector<std::string>>;

// A matrix spec.
common::MatrixSpec Matrix(const std::string& name, std::vector<int64_t> shape,
                          int64_t num_heads = 1, common::DType dtype = common::DType::kFloat32);

// The mix of shapes of the equivalence tests: "big" [64, 96] (more than half of all elements,
// so larger than a stage 1/2 partition for world sizes >= 2), "tiny" [2, 3] (fewer elements
// than 8 ranks), "experts" [3, 16, 24], "heads" [32, 40] with 4 heads, "tall" [80, 20].
// `dtype` for all but "tall", which is `tall_dtype`.
std::vector<common::MatrixSpec> MixedMatrices(common::DType dtype = common::DType::kFloat32,
                                              common::DType tall_dtype = common::DType::kFloat32);

// Deterministic pseudo-random gradients in [-1, 1) (rounded to each matrix's dtype) for steps
// [0, steps), different per matrix, step and seed.
MatrixBytes MakeGradients(const std::vector<common::MatrixSpec>& matrices, int steps,
                          uint64_t seed = 1);

// Runs the gradients through a fresh world-size-1, zero-stage-0 job `job_id` with the matrices,
// Muon config and state dtypes of `like`, steps 0, 1, ...; returns the updates.
absl::StatusOr<MatrixBytes> ReferenceTrajectory(client::Client& client, const std::string& job_id,
                                                const common::JobSpec& like,
                                                const MatrixBytes& grads);

// One rank's step through RankSession::Step: its spans of the whole-matrix gradients
// `grads` (one entry per matrix) are pushed; returns the update bytes per span (RankSpans order).
absl::StatusOr<std::vector<std::string>> StepSpans(client::RankSession& session, int64_t step,
                                                   const std::vector<std::string>& grads,
                                                   client::StepResult* result = nullptr);
// The same through StepBuffer: the rank's flat buffer is assembled from `grads` (padding filled
// with `padding_value`), and the returned update buffer is split into spans. Fails when the
// update's padding is not zero.
absl::StatusOr<std::vector<std::string>> StepFlatBuffer(client::RankSession& session,
                                                        int64_t step,
                                                        const std::vector<std::string>& grads,
                                                        float padding_value = 0.0f,
                                                        client::StepResult* result = nullptr);

// What one rank thread got: per step, its status and update spans.
struct RankRun {
  std::vector<absl::Status> status;
  std::vector<std::vector<std::string>> spans;  // [step] -> bytes per span
  std::vector<common::ShardSpan> layout;        // the rank's spans
};

// Steps `first_step` .. first_step + grads.size() - 1 of job `job_id` with `world` ranks at once,
// each in its own thread with its own Client::Connect(address) and RankSession (attached with
// `takeover`). grads[i] is used for step first_step + i. A rank stops at its first failed step.
std::vector<RankRun> RunRanks(const std::string& address, const std::string& job_id,
                              const std::string& token, int world, const MatrixBytes& grads,
                              bool use_buffer, int64_t first_step = 0, bool takeover = false);

// Success when every span of `layout` in `got` equals the bytes of the same elements of the
// whole-matrix updates `want` (one entry per matrix).
::testing::AssertionResult SpansEqual(const common::JobSpec& spec,
                                      const std::vector<common::ShardSpan>& layout,
                                      const std::vector<std::string>& got,
                                      const std::vector<std::string>& want);

// The bytes of elements [offset, offset + length) of a matrix of `dtype`.
std::string Slice(const std::string& whole, common::DType dtype, uint64_t offset,
                  uint64_t length);

// A thread running one rank's blocking step. Join() waits for it; should a failed assertion leave
// the scope first, the destructor calls `unblock` (e.g. deletes the job, which ends a step that
// waits for other ranks) and then joins, so a failing test neither hangs nor terminates.
class StepThread {
 public:
  StepThread(std::function<void()> body, std::function<void()> unblock)
      : unblock_(std::move(unblock)), thread_(std::move(body)) {}
  ~StepThread() {
    if (thread_.joinable()) {
      unblock_();
      thread_.join();
    }
  }
  StepThread(const StepThread&) = delete;
  StepThread& operator=(const StepThread&) = delete;
  void Join() { thread_.join(); }

 private:
  std::function<void()> unblock_;
  std::thread thread_;
};

// Polls GetJob until `pred` holds (true) or `timeout_seconds` passed (false).
bool WaitForJob(client::Client& client, const std::string& job_id, const std::string& token,
                const std::function<bool(const v1::JobStatus&)>& pred,
                double timeout_seconds = 20);

}  // namespace muond::integration

#endif  // MUOND_TESTS_INTEGRATION_MULTIRANK_UTIL_H_
