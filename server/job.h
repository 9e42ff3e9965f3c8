// A job: one training run's Muon state on this node (DESIGN.md section 4).
//
// A Job owns the fp32 momentum of every matrix, the step counter, the attached rank sessions and the
// step in flight. Ranks take part in step t through RankStep objects (one per rank and step): they
// add gradient chunks, then Finish(), which blocks until every rank has finished and the update is
// committed, and returns the rank's update spans.
//
// Atomicity: gradients are assembled into whole fp32 matrices. The Muon update of each matrix writes
// its new momentum into a staged buffer; the staged buffers replace the momentum only after every
// matrix of the step succeeded. Cost: one extra fp32 copy of the momentum of the matrices in flight.
// So a refused or aborted step leaves every momentum bit-identical.
//
// Thread-safe: all methods may be called concurrently (one RankStep per rank stream).
#ifndef MUOND_SERVER_JOB_H_
#define MUOND_SERVER_JOB_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "muond/v1/muond.pb.h"

namespace muond::server {

struct StepState;

// One span of a rank's update, in the matrix's dtype.
struct UpdateSpan {
  uint32_t matrix = 0;
  uint64_t offset = 0;  // elements
  std::string bytes;
};

struct RankUpdate {
  int64_t step = -1;
  std::vector<UpdateSpan> spans;
  double compute_seconds = 0;
};

class Job;

// One rank's part in one step. Not thread-safe: used by the one stream of that rank.
// Destroying it before Finish() returned means the rank went away mid-step: the step is aborted for
// every rank and the job is fenced.
class RankStep {
 public:
  ~RankStep();
  RankStep(const RankStep&) = delete;
  RankStep& operator=(const RankStep&) = delete;

  // Copies `data` (elements of the matrix's dtype starting at element `offset`) into the step's
  // assembly. INVALID_ARGUMENT (and the step is refused for every rank) for a bad matrix index, a
  // chunk outside the rank's spans, overlapping data, a CRC mismatch or a non-finite value.
  absl::Status AddGradient(uint32_t matrix, uint64_t offset, std::string_view data, uint32_t crc32c);
  // The rank has sent everything. Blocks until the step committed or failed. On success returns the
  // rank's update spans (owned by the job; valid until this rank begins its next step).
  // `cancelled` (may be empty) is polled while waiting for the other ranks: once it returns true
  // (the rank's client went away, or the server is shutting down) the step is aborted for every
  // rank and the job fenced, as if the rank had left mid-step.
  absl::StatusOr<std::shared_ptr<const RankUpdate>> Finish(
      const std::function<bool()>& cancelled = {});
  // True when this is a replay of the last committed step: gradients are ignored.
  bool replay() const { return replay_ != nullptr; }
  int64_t step() const { return step_; }
  uint64_t bytes_in() const { return bytes_in_; }

 private:
  friend class Job;
  RankStep(Job* job, int rank, int64_t step, std::shared_ptr<StepState> state,
           std::shared_ptr<const RankUpdate> replay);

  Job* job_;
  int rank_;
  int64_t step_;
  std::shared_ptr<StepState> state_;
  std::shared_ptr<const RankUpdate> replay_;
  bool done_ = false;
  uint64_t bytes_in_ = 0;
};

class Job {
 public:
  Job(common::JobSpec spec, std::string token, std::string backend);
  ~Job();

  const common::JobSpec& spec() const { return spec_; }
  const std::string& id() const { return spec_.job_id; }
  // Constant-time comparison with the job's token.
  bool TokenMatches(std::string_view token) const;

  // Starts a new session for `rank` (replacing an earlier one). INVALID_ARGUMENT for a bad rank.
  absl::StatusOr<uint64_t> Attach(int rank);
  // Starts `rank`'s part in `step`. FAILED_PRECONDITION when the job is fenced, the session is not
  // the rank's current one, the step is out of order, or the rank already has a step in flight.
  absl::StatusOr<std::unique_ptr<RankStep>> BeginStep(int rank, uint64_t session, int64_t step);
  // Zeroes the momentum, clears a fence and sets the next step. FAILED_PRECONDITION while a step is
  // in flight.
  absl::Status Reset(int64_t next_step);
  // Marks the job deleted: steps in flight and later ones fail with NOT_FOUND.
  void MarkDeleted();

  v1::JobStatus Status() const;
  // The momentum of matrix `m` (a copy), for tests and checkpoints.
  std::vector<float> MomentumSnapshot(uint32_t m) const;

 private:
  friend class RankStep;

  absl::Status AddGradient(StepState& state, int rank, uint32_t matrix, uint64_t offset,
                           std::string_view data, uint32_t crc32c);
  absl::StatusOr<std::shared_ptr<const RankUpdate>> FinishRank(
      const std::shared_ptr<StepState>& state, int rank, const std::function<bool()>& cancelled);
  // Runs the Muon update of every matrix of a complete step and commits it.
  absl::Status ComputeAndCommit(StepState& state);
  // Ends the step in flight with `status` (refused: not fenced; aborted: fenced).
  void FailStep(StepState& state, const absl::Status& status, bool fence)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AbortRank(const std::shared_ptr<StepState>& state, int rank);

  const common::JobSpec spec_;
  const std::string token_;
  const std::string backend_;
  const int64_t created_unix_ms_;
  std::vector<std::vector<common::ShardSpan>> rank_spans_;  // per rank, immutable

  mutable absl::Mutex mu_;
  // Momentum per matrix (fp32, numel elements). Written only by ComputeAndCommit.
  std::vector<std::vector<float>> momentum_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> sessions_ ABSL_GUARDED_BY(mu_);  // per rank; 0 = not attached
  uint64_t next_session_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t next_step_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_completed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_refused_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_aborted_ ABSL_GUARDED_BY(mu_) = 0;
  bool fenced_ ABSL_GUARDED_BY(mu_) = false;
  bool deleted_ ABSL_GUARDED_BY(mu_) = false;
  std::string fence_reason_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<StepState> in_flight_ ABSL_GUARDED_BY(mu_);
  // The last committed step's update per rank (for replays).
  std::vector<std::shared_ptr<const RankUpdate>> last_updates_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::server

#endif  // MUOND_SERVER_JOB_H_
