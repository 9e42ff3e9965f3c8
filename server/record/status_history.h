// StepHistory: the last few committed steps of every job, with the time each phase took, for the
// status page (server/ops/status_page.h) and its JSON (/api/v1/status). The metrics keep the same
// durations as histograms (muond_step_phase_duration_seconds), which cannot show one step.
//
// Memory is bounded: at most kStepsKept steps per job, and the jobs are those the registry lists
// (Prune drops the rest; a job re-created under the same id starts a fresh history).
//
// Thread-safety: all methods are thread-safe (one mutex, held for a copy at most).
#ifndef MUOND_SERVER_RECORD_STATUS_HISTORY_H_
#define MUOND_SERVER_RECORD_STATUS_HISTORY_H_

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace muond::server {

// One committed step: its id, when it committed, its wall time (first gradient to commit) and
// the seconds of each phase, in StepHistory::kPhaseNames order.
struct StepSample {
  static constexpr int kPhases = 6;
  int64_t step = 0;
  int64_t unix_ms = 0;
  double seconds = 0;
  std::array<double, kPhases> phase_seconds{};
};

class StepHistory {
 public:
  static constexpr size_t kStepsKept = 60;
  // As muond_step_phase_duration_seconds{phase} names them.
  static constexpr const char* kPhaseNames[StepSample::kPhases] = {
      "assembly", "copy_in", "newton_schulz", "writeback", "return", "commit"};

  // The history the daemon records into (Job commits) and the status page reads.
  static StepHistory& Default();

  // Records a committed step of job `job_id`, created at `created_unix_ms` (a different creation
  // time than the one recorded means the id was re-used: the old history goes).
  void Record(const std::string& job_id, int64_t created_unix_ms, const StepSample& sample)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The kept steps of `job_id`, oldest first (empty for an unknown job).
  std::vector<StepSample> Steps(const std::string& job_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets every job not in `present`.
  void Prune(const std::set<std::string>& present) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets job `job_id` created at `created_unix_ms` (its deletion; a job re-created under the
  // same id since keeps its own history).
  void Forget(const std::string& job_id, int64_t created_unix_ms) ABSL_LOCKS_EXCLUDED(mu_);
  // Jobs with a history (tests: the history goes with the job).
  size_t jobs() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct JobSteps {
    int64_t created_unix_ms = 0;
    std::deque<StepSample> steps;
  };
  mutable absl::Mutex mu_;
  std::map<std::string, JobSteps> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond::server

#endif  // MUOND_SERVER_RECORD_STATUS_HISTORY_H_
